"""`filter_chunked_jacrev` and `filter_chunked_jacfwd`: chunked Jacobians with
respect to the floating-point arrays of the first argument, as Equinox's."""

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any, overload

import equinox as eqx
from beartype import beartype
from jaxtyping import jaxtyped

from ._boundary import api_boundary, keyword_only
from ._budget import ChunkSizeChoice, ChunkSizeSpec, MemoryBudget
from ._chunking import check_chunking, CheckpointSpec
from ._custom_types import Remainder, sentinel
from ._jacobian import Jacobian, Options
from ._progress import AbstractProgressMeter, check_meter


class _FilterJacobian(eqx.Module):
    """As `equinox.filter_jacrev`/`filter_jacfwd`: the Jacobian with respect to the
    floating-point arrays of the first argument."""

    _fun: Callable[..., Any]
    _options: Options
    _rev: bool

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self._fun

    @property
    def _budget(self) -> MemoryBudget | None:
        chunk_size = self._options.chunk_size
        return chunk_size if isinstance(chunk_size, MemoryBudget) else None

    def _jacobian(self, x: Any, args: Any, kwargs: Any) -> tuple[Jacobian, Any]:
        """The Jacobian of `fun` as a function of `x`'s floating-point arrays, and
        those arrays."""
        diff_x, static_x = eqx.partition(x, eqx.is_inexact_array)
        has_aux = self._options.has_aux

        def _fun(_diff_x: Any) -> tuple[Any, Any]:
            _out = self._fun(eqx.combine(_diff_x, static_x), *args, **kwargs)
            return _out if has_aux else (_out, None)

        options = eqx.tree_at(lambda o: o.has_aux, self._options, True)
        return Jacobian(_fun, options, self._rev), diff_x

    def _choose(self, args: Any, kwargs: Any) -> ChunkSizeChoice | None:
        """The chunk size the budget allows for these arguments."""
        jacobian, diff_x = self._jacobian(args[0], args[1:], kwargs)
        return jacobian._choose((diff_x,), {})

    @api_boundary
    def __call__(self, x: Any, /, *args: Any, **kwargs: Any) -> Any:
        jacobian, diff_x = self._jacobian(x, args, kwargs)
        jac, aux = jacobian(diff_x)
        return (jac, aux) if self._options.has_aux else jac

    def __get__(self, instance: Any, owner: Any) -> Any:
        del owner
        if instance is None:
            return self
        return eqx.Partial(self, instance)


def _build(fun: Callable[..., Any], options: Options, rev: bool) -> Callable[..., Any]:
    chunk_size = check_chunking(options.chunk_size, options.remainder, options.api)
    options = dataclasses.replace(options, chunk_size=chunk_size)
    check_meter(options.progress_meter, options.api)
    return eqx.module_update_wrapper(_FilterJacobian(fun, options, rev))


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
        runs, also under `jax.jit`: `None` or `filtered_chunk.NoProgressMeter()`
        (the default: nothing, at no cost), `filtered_chunk.TextProgressMeter()`,
        `filtered_chunk.TqdmProgressMeter()`, or a subclass of
        `filtered_chunk.AbstractProgressMeter`. See the [guide on progress][progress].

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
        return ft.partial(
            filter_chunked_jacrev,  # pyright: ignore[reportCallIssue]
            chunk_size=chunk_size,
            has_aux=has_aux,
            remainder=remainder,
            checkpoint=checkpoint,
            progress_meter=progress_meter,
        )
    options = Options(
        0,
        has_aux,
        False,
        False,
        chunk_size,
        remainder,
        checkpoint,
        "filter_chunked_jacrev",
        progress_meter,
    )
    return _build(fun, options, rev=True)


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
        runs, also under `jax.jit`: `None` or `filtered_chunk.NoProgressMeter()`
        (the default: nothing, at no cost), `filtered_chunk.TextProgressMeter()`,
        `filtered_chunk.TqdmProgressMeter()`, or a subclass of
        `filtered_chunk.AbstractProgressMeter`. See the [guide on progress][progress].

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
        return ft.partial(
            filter_chunked_jacfwd,  # pyright: ignore[reportCallIssue]
            chunk_size=chunk_size,
            has_aux=has_aux,
            remainder=remainder,
            checkpoint=checkpoint,
            progress_meter=progress_meter,
        )
    options = Options(
        0,
        has_aux,
        False,
        False,
        chunk_size,
        remainder,
        checkpoint,
        "filter_chunked_jacfwd",
        progress_meter,
    )
    return _build(fun, options, rev=False)
