"""The refusal of a budget that no chunk size fits, saying what the smallest program
measured needs and why (`_search.py`)."""

from ._program import Measured
from ._values import format_bytes, MemoryBudget


def too_small(
    api: str,
    budget: MemoryBudget,
    limit: int,
    tried: dict[int, Measured],
    n: int,
    reverse: bool = False,
) -> ValueError:
    """The refusal of a budget no size fits, for a batch of `n`: below the outputs,
    or what the smallest program measured needs, with (`reverse`) the loss assumed."""
    k = min(tried, key=lambda s: (tried[s].total, s))
    smallest = tried[k]
    head = (
        f"`{api}(..., chunk_size={budget!r})`: the memory budget of {limit} bytes "
        f"({format_bytes(limit)}) is too small for this call."
    )
    outputs = f"{smallest.output} bytes ({format_bytes(smallest.output)})"
    fix = "make the outputs smaller (map fewer elements per call, or return less)."
    fed = (
        f", and {smallest.fed} bytes are the tangents that the derivative around "
        "the call feeds in"
        if smallest.fed
        else ""
    )
    if smallest.output > limit:
        return ValueError(
            f"{head} Its outputs alone need {outputs}, allocated at full batch "
            f"size whatever the chunk size{fed}, so no chunk size fits. Give a "
            "budget larger than the outputs (the whole batch at once needs "
            f"{tried[n].total} bytes), or {fix}"
        )
    which = (
        "Even one element per chunk (one row or column, for a Jacobian)"
        if k == 1
        else "The smallest program measured, the whole batch at once,"
        if k == n
        else f"The smallest program measured, at {k} elements per chunk (rows or "
        "columns, for a Jacobian),"
    )
    measured = ", ".join(f"{s}: {tried[s].total}" for s in sorted(tried))
    return ValueError(
        f"{head} {which} needs {smallest.total} bytes "
        f"({format_bytes(smallest.total)}) of temporaries and outputs, of which "
        f"{outputs} are outputs, allocated at full batch size whatever the chunk "
        f"size{fed}. The chunk sizes measured (`chunk_size: bytes`) were "
        f"{measured}: none fits.{_ASSUMED if reverse else ''} Give a budget of at "
        f"least {smallest.total} bytes, or {fix}"
    )


_ASSUMED = (
    " Under reverse mode each size is measured as the larger of two programs, "
    "since `jax.grad` and `jax.linearize` cannot be told apart when the call is "
    "traced: the linearisation applied to a tangent (its bytes counted), and the "
    "backward pass with the cotangent computed from the call's outputs, as a "
    "loss that reads them computes it (the program of "
    "`jax.value_and_grad(loss, has_aux=True)` returning the outputs too). A "
    "`jax.grad` whose cotangent XLA folds into a constant (a plain `jnp.sum` of "
    "the outputs) needs less, but the search cannot see the loss."
)
