"""What the budget tests share: the memory oracle, independent of the library's
search (`jax.jit` of the public transform at a fixed chunk size, compiled, read with
`memory_analysis()`), and the check that a choice fits and is the speed model's
size (the largest that fits, or on CPU one capped by the cache)."""

import re
import types
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

import filtered_chunk as fc
from filtered_chunk._budget import _model
from filtered_chunk._budget._search import MAX_COMPILATIONS
from filtered_chunk._fusions import uncounted


def memory_analysis(fn: Callable[..., Any], *args: Any) -> Any:
    """XLA's memory analysis of `fn` compiled for `args`, with its non-array
    arguments (Python scalars) fixed, as a chunked call runs it; on CPU with every
    buffer counted, as a budget counts them: plus what its YNNPACK fusions keep
    (`filtered_chunk/_fusions.py`, checked against what a run allocates in
    `test_budget_fusions.py`), and where one uses a product's result further at
    least the analysis of the program compiled with those fusions off."""
    dynamic, static = eqx.partition(args, eqx.is_array)
    program = lambda _dynamic: fn(*eqx.combine(_dynamic, static))  # noqa: E731
    lowered = jax.jit(program).lower(dynamic)
    compiled = lowered.compile()
    own: Any = compiled.memory_analysis()
    found = uncounted(str(compiled.as_text()))
    if jax.default_backend() != "cpu" or found is None:
        return own
    kept = types.SimpleNamespace(
        temp_size_in_bytes=own.temp_size_in_bytes + found.bytes,
        output_size_in_bytes=own.output_size_in_bytes,
    )
    analyses: list[Any] = [kept]
    if found.dots:
        options: Any = {"xla_cpu_experimental_ynn_fusion_type": ""}
        analyses.append(lowered.compile(compiler_options=options).memory_analysis())
    total = lambda a: a.temp_size_in_bytes + a.output_size_in_bytes  # noqa: E731
    return max(analyses, key=total)


def compiled_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """XLA's temporary plus output bytes of `fn` compiled for `args`."""
    analysis = memory_analysis(fn, *args)
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def nbytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jtu.tree_leaves(tree))


def derivative_bytes(fn: Callable[..., Any], p: Any, *rest: Any) -> int:
    """What a budget counts for `fn` differentiated w.r.t. its first argument, as
    `jax.grad`/`jax.linearize` run it: the larger of its pullback of a cotangent
    computed from its outputs as a loss computes it (`ct * y`, with `ct` an
    argument; the loss's value `sum(ct * y**2)` and `y` returned too, as by
    `jax.value_and_grad(..., has_aux=True)`), and its linearisation applied to
    a tangent plus the bytes of that tangent. Both come from arguments of the
    compiled program, as a real loss's cotangent is not a constant XLA could
    fold."""
    out = jax.eval_shape(fn, p, *rest)
    ct = jtu.tree_map(lambda o: np.zeros(o.shape, o.dtype), out)

    def _pullback(_ct: Any, _p: Any, *_rest: Any) -> Any:
        y, pullback = jax.vjp(lambda q: fn(q, *_rest), _p)
        cotangent = jtu.tree_map(lambda c, o: c * o, _ct, y)
        values = jtu.tree_map(lambda c, o: jnp.sum(c * o), cotangent, y)
        return y, values, pullback(cotangent)

    def _linearised(_t: Any, _p: Any, *_rest: Any) -> Any:
        y, push = jax.linearize(lambda q: fn(q, *_rest), _p)
        return y, push(_t)

    return max(
        compiled_bytes(_pullback, ct, p, *rest),
        compiled_bytes(_linearised, p, p, *rest) + nbytes(p),
    )


def next_size_up(batch_size: int, k: int, remainder: str) -> int | None:
    """The next chunk size that runs differently; `None` once the batch is reached.
    With `remainder="overlap"` that is the balanced size with one step fewer."""
    if k >= batch_size:
        return None
    if remainder == "separate":
        return k + 1
    steps = -(-batch_size // k)
    return -(-batch_size // (steps - 1))


def sizes_of(batch_size: int, remainder: str) -> list[int]:
    """Every chunk size that runs differently, ascending: with `"overlap"` the
    balanced ones, `ceil(batch_size / steps)`; with `"separate"` all."""
    if remainder == "separate":
        return list(range(1, batch_size + 1))
    return sorted({-(-batch_size // steps) for steps in range(1, batch_size + 1)})


def model_size(choice: fc.ChunkSizeChoice, batch_size: int, remainder: str) -> int:
    """The size the speed model runs (before checking that it fits), from the
    rule the docs state: on CPU (`model == "cache"`), the largest size of two or
    more steps whose working set `chunk_size * element_bytes` is within the
    model's cache (`cache_bytes`), at least one element; else the largest that
    fits."""
    # The machine the model reads (faked by `tests/test_budget_model.py`).
    backend, cache = _model.backend(), _model.cache_bytes()
    if choice.model == "largest":
        assert choice.cache_bytes is None and backend != "cpu"
        return choice.largest
    assert choice.model == "cache" and backend == "cpu"
    assert choice.cache_bytes == cache and cache is not None
    assert choice.element_bytes > 0
    if max(cache // choice.element_bytes, 1) >= choice.largest:
        return choice.largest  # no cap below the largest
    sizes = sizes_of(batch_size, remainder)
    two_steps = -(-batch_size // 2) if remainder == "overlap" else batch_size // 2
    under = [k for k in sizes if k * choice.element_bytes <= cache and k <= two_steps]
    return min(max(under, default=1), choice.largest)


def check_largest(
    bytes_at: Callable[[int | None], int],
    choice: fc.ChunkSizeChoice,
    budget: int,
    batch_size: int,
    remainder: str = "overlap",
) -> None:
    """By the oracle: `choice.largest` fits and the next size up does not; the
    chosen size fits and is the speed model's, or the largest where the model's
    does not fit (`tests/test_budget_model.py` fakes the cache to cap it)."""
    k, largest = choice.chunk_size, choice.largest
    assert choice.budget == budget
    at = lambda s: bytes_at(s if s < batch_size else None)  # noqa: E731
    assert at(k) == choice.bytes <= budget
    assert dict(choice.tried)[largest] == at(largest) <= budget
    up = next_size_up(batch_size, largest, remainder)
    if up is not None:
        assert at(up) > budget
    model = model_size(choice, batch_size, remainder)
    if k != model:
        # The model's size did not fit, or the search had no size left for it.
        assert k == largest
        assert at(model) > budget or (
            model not in dict(choice.tried) and len(choice.tried) == MAX_COMPILATIONS
        )
    assert dict(choice.working_set) == {
        s: s * choice.element_bytes for s, _ in choice.tried
    }


def nonlinear_element(x: Any) -> Any:
    """A `d x d` temporary per element, its output one row of it: non-linear."""
    return jnp.tanh(jnp.outer(x, x)) @ x


def check_refusal(
    message: str, bytes_at: Callable[[int | None], int], budget: int, batch_size: int
) -> dict[int, int]:
    """By the oracle: a refusal of a budget below the outputs names them and the
    whole batch's bytes; any other lists the sizes it measured, none fits, and it
    names the smallest as what the call needs. Under reverse mode a size whose
    pullback does not fit is listed with the pullback's bytes alone (its
    linearisation is not compiled), so those may fall short of the oracle's."""
    assert "is too small for this call" in message
    alone = re.search(
        r"Its outputs alone need (\d+) bytes .* whole batch at once "
        r"needs (\d+) bytes",
        message,
    )
    if alone is not None:  # below the outputs, which no chunk size changes
        outputs, whole = int(alone.group(1)), int(alone.group(2))
        assert budget < outputs <= whole == bytes_at(None)
        return {}
    listed = re.search(r"were ((?:\d+: \d+(?:, )?)+): none fits", message)
    assert listed is not None, message
    pairs = (item.split(": ") for item in listed.group(1).split(", "))
    measured = {int(k): int(b) for k, b in pairs}
    at = lambda s: bytes_at(s if s < batch_size else None)  # noqa: E731
    assert all(budget < b <= at(k) for k, b in measured.items())
    needs = re.search(r"needs (\d+) bytes", message)
    assert needs is not None
    k = min(measured, key=lambda s: (measured[s], s))
    assert int(needs.group(1)) == measured[k] == at(k)
    assert f"Give a budget of at least {measured[k]} bytes" in message
    return measured
