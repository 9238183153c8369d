"""`filter_chunked_jacrev` and `filter_chunked_jacfwd`: Equinox's filtered
Jacobians, built `chunk_size` rows or columns at a time (see `_jax.py`)."""

from collections.abc import Callable
from typing import Any, overload

from beartype import beartype
from jaxtyping import jaxtyped

from .._boundary import deferred, keyword_only
from .._custom_types import CheckpointSpec, Remainder, sentinel
from .._progress import AbstractProgressMeter
from .._wrapper import ChunkOptions, ChunkSizeSpec, wrap
from ._plans import JacfwdPlan, JacrevPlan


@overload
def filter_chunked_jacrev(
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def filter_chunked_jacrev(
    fun: Callable[..., Any],
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]: ...


@keyword_only("filter_chunked_jacrev", 1, ("has_aux",), "equinox.filter_jacrev")
@jaxtyped(typechecker=beartype)
def filter_chunked_jacrev(
    fun: Callable[..., Any] = sentinel,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]:
    """As `equinox.filter_jacrev`, with the Jacobian built `chunk_size` rows at a
    time: see [`filtered_chunk.chunked_jacrev`][].

    The Jacobian is taken with respect to the floating-point arrays of the first
    argument (for example the parameters of an `equinox.Module`); its other leaves
    get `None`. The remaining arguments are passed through.

    **Arguments:**

    - `fun`: the function to differentiate, returning real arrays.
    - `chunk_size`: keyword-only. The number of rows (elements of the flattened
        output) computed per step; `None` (the default) computes them all at once.
        Or a memory budget, `"auto"` or a [`filtered_chunk.MemoryBudget`][]: the
        largest chunk size whose compiled program fits it is chosen.
    - `has_aux`: keyword-only. Whether `fun` returns a pair `(output, aux)`.
    - `remainder`: keyword-only. As for `filter_chunked_vmap`: `"overlap"` (the
        default) or `"separate"`.
    - `checkpoint`: keyword-only. As for `filter_chunked_vmap`: rematerialise
        each chunk when the Jacobian is itself differentiated in reverse mode.
        `True` (the default), `False`, or a `jax.checkpoint_policies` policy.
    - `progress_meter`: keyword-only. Reports the rows done while the call
        runs, also under `jax.jit`: {meters} See the [guide on progress][progress].

    **Returns:**

    A function with the signature of `fun`, returning what `equinox.filter_jacrev`
    would.

    !!! example

        ```python
        import equinox as eqx
        import jax.numpy as jnp
        import jax.random as jr
        import filtered_chunk as fc

        model = eqx.nn.Linear(3, 100, key=jr.key(0))
        x = jnp.ones(3)
        jacobian = fc.filter_chunked_jacrev(lambda m, x: m(x), chunk_size=32)(model, x)
        assert jacobian.weight.shape == (100, 100, 3)
        expected = eqx.filter_jacrev(lambda m, x: m(x))(model, x)
        assert jnp.allclose(jacobian.weight, expected.weight)
        ```
    """
    if fun is sentinel:
        return deferred(filter_chunked_jacrev, locals())
    options = ChunkOptions(
        "filter_chunked_jacrev", chunk_size, remainder, checkpoint, progress_meter
    )
    return wrap(fun, JacrevPlan(0, has_aux, False, filtered=True), options)


@overload
def filter_chunked_jacfwd(
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def filter_chunked_jacfwd(
    fun: Callable[..., Any],
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]: ...


@keyword_only("filter_chunked_jacfwd", 1, ("has_aux",), "equinox.filter_jacfwd")
@jaxtyped(typechecker=beartype)
def filter_chunked_jacfwd(
    fun: Callable[..., Any] = sentinel,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]:
    """As `equinox.filter_jacfwd`, with the Jacobian built `chunk_size` columns at
    a time: see [`filtered_chunk.chunked_jacfwd`][].

    The Jacobian is taken with respect to the floating-point arrays of the first
    argument (for example the parameters of an `equinox.Module`); its other leaves
    get `None`. The remaining arguments are passed through.

    **Arguments:**

    - `fun`: the function to differentiate.
    - `chunk_size`: keyword-only. The number of columns (elements of the flattened
        floating-point arrays of the first argument) computed per step; `None` (the
        default) computes them all at once. Or a memory budget, `"auto"` or a
        [`filtered_chunk.MemoryBudget`][]: the largest chunk size whose compiled
        program fits it is chosen.
    - `has_aux`: keyword-only. Whether `fun` returns a pair `(output, aux)`.
    - `remainder`: keyword-only. As for `filter_chunked_vmap`: `"overlap"` (the
        default) or `"separate"`.
    - `checkpoint`: keyword-only. As for `filter_chunked_vmap`: rematerialise
        each chunk when the Jacobian is itself differentiated in reverse mode.
        `True` (the default), `False`, or a `jax.checkpoint_policies` policy.
    - `progress_meter`: keyword-only. Reports the columns done while the call
        runs, also under `jax.jit`: {meters} See the [guide on progress][progress].

    **Returns:**

    A function with the signature of `fun`, returning what `equinox.filter_jacfwd`
    would.

    !!! example

        ```python
        import equinox as eqx
        import jax.numpy as jnp
        import jax.random as jr
        import filtered_chunk as fc

        model = eqx.nn.Linear(30, 2, key=jr.key(0))
        x = jnp.ones(30)
        jacobian = fc.filter_chunked_jacfwd(lambda m, x: m(x), chunk_size=16)(model, x)
        expected = eqx.filter_jacfwd(lambda m, x: m(x))(model, x)
        assert jnp.allclose(jacobian.weight, expected.weight)
        ```
    """
    if fun is sentinel:
        return deferred(filter_chunked_jacfwd, locals())
    options = ChunkOptions(
        "filter_chunked_jacfwd", chunk_size, remainder, checkpoint, progress_meter
    )
    return wrap(fun, JacfwdPlan(0, has_aux, False, filtered=True), options)
