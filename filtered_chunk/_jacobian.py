"""Jacobians built `chunk_size` rows (reverse mode) or columns (forward mode) at a
time: `chunked_jacrev` and `chunked_jacfwd`."""

import dataclasses
import functools as ft
import math
from collections.abc import Callable, Sequence
from typing import Any, overload

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from beartype import beartype
from jaxtyping import Array, Int, jaxtyped

from ._axes import is_array
from ._basis import (
    Argnums,
    basis,
    check_dtypes,
    dynamic_args,
    in_chunks,
    inputs_rule,
    offsets,
    outputs_rule,
    unravel,
    without_float0,
)
from ._boundary import api_boundary, keyword_only
from ._budget import ChunkSizeChoice, ChunkSizeSpec, MemoryBudget
from ._chunk_search import choose_chunk_size
from ._chunking import check_chunking, CheckpointSpec, ChunkOutput
from ._custom_types import keep_untraced, Remainder, sentinel, unwrap_kept
from ._eager import call_compiled, is_traced
from ._progress import AbstractProgressMeter, check_meter, is_reporting
from ._reporting import closing_on_error


class Options(eqx.Module):
    """The arguments of `chunked_jacrev`/`chunked_jacfwd` other than `fun`."""

    argnums: Argnums
    has_aux: bool
    holomorphic: bool
    allow_int: bool
    chunk_size: Any  # as given; a `ChunkSize` once checked by `build`
    remainder: str
    checkpoint: CheckpointSpec
    api: str
    progress_meter: AbstractProgressMeter | None = None


def _jacrev(
    fun: Callable[..., Any], o: Options, args: tuple[Any, ...], kwargs: Any
) -> Any:
    f, dynamic, nums = dynamic_args(fun, o.argnums, args, kwargs, o.api)
    names = [f"args[{n}]" for n in nums]
    rule = inputs_rule(o.holomorphic, o.allow_int, rev=True)
    check_dtypes(dynamic, names, rule, "the input", o.api)
    y, pullback, *aux = jax.vjp(f, *dynamic, has_aux=o.has_aux)
    rule = outputs_rule(o.holomorphic, rev=True)
    check_dtypes((y,), ["output"], rule, "the output", o.api)

    def _rows(index: Int[Array, " size"], size: int) -> ChunkOutput:
        del size
        cotangents, axes = without_float0(jax.vmap(pullback)(basis(y, index)), False)
        return ChunkOutput(cotangents, axes, None, None)

    _, total = offsets(y)
    rows = in_chunks(
        _rows,
        total,
        o.chunk_size,
        o.remainder,
        o.checkpoint,
        o.progress_meter,
        o.api,
    ).batched
    example = dynamic[0] if isinstance(o.argnums, int) else dynamic
    rows = rows[0] if isinstance(o.argnums, int) else rows

    def _unravel_rows(x: Any, block: Any) -> Any:
        shape = lambda leaf: np.shape(leaf) + np.shape(x)
        return unravel(block, y, x, 0, shape)

    jac = jtu.tree_map(_unravel_rows, example, rows)
    jac = jtu.tree_transpose(jtu.tree_structure(example), jtu.tree_structure(y), jac)
    return (jac, *aux) if o.has_aux else jac


def _jacfwd(
    fun: Callable[..., Any], o: Options, args: tuple[Any, ...], kwargs: Any
) -> Any:
    f, dynamic, nums = dynamic_args(fun, o.argnums, args, kwargs, o.api)
    names = [f"args[{n}]" for n in nums]
    rule = inputs_rule(o.holomorphic, allow_int=False, rev=False)
    check_dtypes(dynamic, names, rule, "the input", o.api)

    def _columns(index: Int[Array, " size"], size: int) -> ChunkOutput:
        def _push(tangents: Any) -> Any:
            out = jax.jvp(f, dynamic, tangents, has_aux=o.has_aux)
            return out if o.has_aux else (*out, None)

        y, t, aux = jax.vmap(_push, out_axes=(None, -1, None), axis_size=size)(
            basis(dynamic, index)
        )
        tangents, axes = without_float0(t, True)
        unbatched, static = eqx.partition((y, aux), is_array)
        # What no trace computed (a NumPy `aux`) is returned as it is.
        unbatched, kept = keep_untraced(unbatched)
        return ChunkOutput(tangents, axes, unbatched, eqx.combine(static, kept))

    _, total = offsets(dynamic)
    out = in_chunks(
        _columns,
        total,
        o.chunk_size,
        o.remainder,
        o.checkpoint,
        o.progress_meter,
        o.api,
    )
    y, aux = eqx.combine(out.unbatched, unwrap_kept(out.static))
    rule = outputs_rule(o.holomorphic, rev=False)
    check_dtypes((y,), ["output"], rule, "the output", o.api)
    example = dynamic[0] if isinstance(o.argnums, int) else dynamic

    def _unravel_columns(y_leaf: Any, block: Any) -> Any:
        shape = lambda leaf: np.shape(y_leaf) + np.shape(leaf)
        return unravel(block, example, y_leaf, np.ndim(y_leaf), shape)

    jac = jtu.tree_map(_unravel_columns, y, out.batched)
    return (jac, aux) if o.has_aux else jac


class Jacobian(eqx.Module):
    """`fun`'s Jacobian, computed when called (the wrapper the builders return)."""

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

    def _total(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """The number of rows (reverse mode) or columns of the Jacobian."""
        o = self._options
        f, dynamic, _ = dynamic_args(self._fun, o.argnums, args, kwargs, o.api)
        if not self._rev:
            return offsets(dynamic)[1]
        out = jax.eval_shape(f, *dynamic)
        out = out[0] if o.has_aux else out
        return sum(math.prod(np.shape(y)) for y in jtu.tree_leaves(out))

    def _choose(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ChunkSizeChoice | None:
        """The chunk size the budget allows for these arguments (`None` when
        the Jacobian is empty)."""
        assert self._budget is not None
        total = self._total(args, kwargs)
        if not total:
            return None

        def _run(k: int | None, closed: Any) -> Any:
            jacobian, (_args, _kwargs) = closed
            options = dataclasses.replace(jacobian._options, chunk_size=k)
            return dataclasses.replace(jacobian, _options=options)._call(_args, _kwargs)

        o = self._options
        return choose_chunk_size(
            _run,
            (self, (args, kwargs)),
            batch_size=total,
            budget=self._budget,
            remainder=o.remainder,
            options=(o.remainder, o.checkpoint, self._rev),
            api=o.api,
        )

    @api_boundary
    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if self._budget is not None:
            choice = self._choose(args, kwargs)
            k = None if choice is None else choice.chunk_size
            options = dataclasses.replace(self._options, chunk_size=k)
            return dataclasses.replace(self, _options=options)(*args, **kwargs)
        if is_reporting(self._options.progress_meter):
            with closing_on_error():  # a failed call closes its meter
                return self._dispatch(args, kwargs)
        return self._dispatch(args, kwargs)

    def _dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._options.chunk_size is not None and not is_traced((self, args, kwargs)):
            # An eager `lax.scan` recompiles on every call: see `_eager.py`.
            return call_compiled(lambda _t: self._call(*_t), (args, kwargs))
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        jacobian = _jacrev if self._rev else _jacfwd
        return jacobian(self._fun, self._options, args, kwargs)

    def __get__(self, instance: Any, owner: Any) -> Any:
        del owner
        if instance is None:
            return self
        return eqx.Partial(self, instance)


def build(fun: Callable[..., Any], options: Options, rev: bool) -> Callable[..., Any]:
    """Checks the options and wraps `fun` in a `Jacobian`."""
    chunk_size = check_chunking(options.chunk_size, options.remainder, options.api)
    options = dataclasses.replace(options, chunk_size=chunk_size)
    check_meter(options.progress_meter, options.api)
    return eqx.module_update_wrapper(Jacobian(fun, options, rev))


@overload
def chunked_jacrev(
    *,
    argnums: int | Sequence[int] = 0,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def chunked_jacrev(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]: ...


@keyword_only(
    "chunked_jacrev", 2, ("has_aux", "holomorphic", "allow_int"), "jax.jacrev"
)
@jaxtyped(typechecker=beartype)
def chunked_jacrev(
    fun: Callable[..., Any] = sentinel,
    argnums: int | Sequence[int] = 0,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]:
    """The Jacobian of `fun` by reverse-mode autodiff, like `jax.jacrev`, built
    `chunk_size` rows at a time to bound peak memory.

    `jax.jacrev` evaluates `fun` once, then pulls every unit vector of the output
    space back through it in a single `jax.vmap`: its working set is the whole
    Jacobian times the backward pass's intermediates, plus an identity matrix as
    large as the output squared. `chunked_jacrev` evaluates `fun` once too, then
    pulls back `chunk_size` unit vectors per step of one `jax.lax.scan`, writing
    each block of rows into the Jacobian in place (like
    `torch.func.jacrev(..., chunk_size=...)`, for arbitrary PyTrees). The result is
    that of `jax.jacrev`: same values, PyTree structure, shapes and dtypes.

    **Arguments:**

    - `fun`: the function to differentiate, returning an array or a PyTree of
        real (or, with `holomorphic=True`, complex) arrays.
    - `argnums`: which positional argument(s) to differentiate with respect to:
        an int or a sequence of ints, as for `jax.jacrev`. Defaults to `0`.
    - `chunk_size`: keyword-only. The number of rows (elements of the flattened
        output) computed per step. `None` (the default), or any value at least the
        output size, computes them all in one `vmap`, as `jax.jacrev`. Or a
        memory budget, `"auto"` or a [`filtered_chunk.MemoryBudget`][]: the
        largest chunk size whose compiled program fits it is chosen, as for
        `filter_chunked_vmap`.
    - `has_aux`: keyword-only. Whether `fun` returns a pair `(output, aux)`; `aux`
        is returned beside the Jacobian. Defaults to `False`.
    - `holomorphic`: keyword-only. As for `jax.jacrev`. Defaults to `False`.
    - `allow_int`: keyword-only. As for `jax.jacrev`: accept integer and boolean
        inputs, whose derivatives are zero. Defaults to `False`.
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

    A function with the signature of `fun`, returning the Jacobian as a PyTree
    like the output of `fun` whose leaves are PyTrees like the differentiated
    arguments (or `(jacobian, aux)` with `has_aux=True`).

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtered_chunk as fc

        def f(x):
            return jnp.tanh(jnp.outer(x, x)).ravel()  # 400 outputs

        x = jnp.linspace(-1.0, 1.0, 20)
        jacobian = fc.chunked_jacrev(f, chunk_size=64)(x)  # 64 rows at a time
        assert jacobian.shape == (400, 20)
        assert jnp.allclose(jacobian, jax.jacrev(f)(x))
        ```
    """
    if fun is sentinel:
        return ft.partial(
            chunked_jacrev,  # pyright: ignore[reportCallIssue]
            argnums=argnums,
            chunk_size=chunk_size,
            has_aux=has_aux,
            holomorphic=holomorphic,
            allow_int=allow_int,
            remainder=remainder,
            checkpoint=checkpoint,
            progress_meter=progress_meter,
        )
    options = Options(
        argnums,
        has_aux,
        holomorphic,
        allow_int,
        chunk_size,
        remainder,
        checkpoint,
        "chunked_jacrev",
        progress_meter,
    )
    return build(fun, options, rev=True)


@overload
def chunked_jacfwd(
    *,
    argnums: int | Sequence[int] = 0,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def chunked_jacfwd(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]: ...


@keyword_only("chunked_jacfwd", 2, ("has_aux", "holomorphic"), "jax.jacfwd")
@jaxtyped(typechecker=beartype)
def chunked_jacfwd(
    fun: Callable[..., Any] = sentinel,
    argnums: int | Sequence[int] = 0,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    holomorphic: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]:
    """The Jacobian of `fun` by forward-mode autodiff, like `jax.jacfwd`, built
    `chunk_size` columns at a time to bound peak memory.

    `jax.jacfwd` pushes every unit vector of the input space forward through `fun`
    in a single `jax.vmap`. `chunked_jacfwd` pushes `chunk_size` of them per step
    of one `jax.lax.scan`, writing each block of columns into the Jacobian in
    place (like `torch.func.jacfwd(..., chunk_size=...)`, for arbitrary PyTrees).
    Each step re-evaluates `fun` alongside its `chunk_size` tangents. The result is
    that of `jax.jacfwd`: same values, PyTree structure, shapes and dtypes.

    **Arguments:**

    - `fun`: the function to differentiate.
    - `argnums`: which positional argument(s) to differentiate with respect to:
        an int or a sequence of ints, as for `jax.jacfwd`. Defaults to `0`.
    - `chunk_size`: keyword-only. The number of columns (elements of the flattened
        differentiated arguments) computed per step. `None` (the default), or any
        value at least the input size, computes them all in one `vmap`, as
        `jax.jacfwd`. Or a memory budget, `"auto"` or a
        [`filtered_chunk.MemoryBudget`][]: the largest chunk size whose compiled
        program fits it is chosen, as for `filter_chunked_vmap`.
    - `has_aux`: keyword-only. Whether `fun` returns a pair `(output, aux)`; `aux`
        is returned beside the Jacobian. Defaults to `False`.
    - `holomorphic`: keyword-only. As for `jax.jacfwd`. Defaults to `False`.
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

    A function with the signature of `fun`, returning the Jacobian as a PyTree
    like the output of `fun` whose leaves are PyTrees like the differentiated
    arguments (or `(jacobian, aux)` with `has_aux=True`).

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtered_chunk as fc

        def f(params, x):
            w, b = params
            return jnp.tanh(x @ w + b)

        params = (jnp.full((50, 8), 0.1), jnp.zeros(8))
        x = jnp.linspace(-1.0, 1.0, 50)
        # 408 columns (one per parameter), 100 at a time.
        jacobian = fc.chunked_jacfwd(f, chunk_size=100)(params, x)
        expected = jax.jacfwd(f)(params, x)
        assert jacobian[0].shape == (8, 50, 8)
        assert all(jnp.allclose(a, b) for a, b in zip(jacobian, expected))
        ```

    !!! tip

        Forward mode suits functions with fewer inputs than outputs; otherwise
        [`filtered_chunk.chunked_jacrev`][] needs fewer steps. A Hessian is
        `chunked_jacfwd(chunked_jacrev(f, chunk_size=...), chunk_size=...)`.
    """
    if fun is sentinel:
        return ft.partial(
            chunked_jacfwd,  # pyright: ignore[reportCallIssue]
            argnums=argnums,
            chunk_size=chunk_size,
            has_aux=has_aux,
            holomorphic=holomorphic,
            remainder=remainder,
            checkpoint=checkpoint,
            progress_meter=progress_meter,
        )
    options = Options(
        argnums,
        has_aux,
        holomorphic,
        False,
        chunk_size,
        remainder,
        checkpoint,
        "chunked_jacfwd",
        progress_meter,
    )
    return build(fun, options, rev=False)
