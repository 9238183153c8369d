"""`filter_chunked_apply`: call an already vectorised function on chunks of a batch."""

import functools as ft
import re
from collections.abc import Callable
from typing import Any, overload

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from beartype import beartype
from jaxtyping import jaxtyped, PyTree

from ._axes import (
    batch_size_of,
    bind_arguments,
    check_spec,
    describe,
    is_array,
    normalise_in_axes,
    resolve_axes,
)
from ._chunking import check_chunking, CheckpointSpec, ChunkOutput, run_in_chunks
from ._custom_types import AxisSpec, Remainder, sentinel
from ._eager import call_compiled, is_traced
from ._progress import AbstractProgressMeter, check_meter, is_reporting
from ._reporting import closing_on_error


_API = "filter_chunked_apply"


def _is_none(x: Any) -> bool:
    return x is None


def _out_axes(
    out: PyTree[Any], out_axes: PyTree[AxisSpec], size: int
) -> PyTree[int | None]:
    """Each output leaf's batch axis (made non-negative), checked against `size`."""

    def _check(path: tuple[Any, ...], axis: int | None, leaf: Any) -> int | None:
        if axis is None:
            return None
        where = describe("output", path)
        if not is_array(leaf):
            raise TypeError(
                f"`{where}` is {type(leaf).__name__} object {leaf!r}, which is not an "
                f"array, but its `out_axes` is {axis}. Only arrays have a batch "
                "axis: give it `None` (or use `eqx.if_array(...)`)."
            )
        shape = np.shape(leaf)
        if not -len(shape) <= axis < len(shape) or shape[axis] != size:
            raise ValueError(
                f"`{_API}`: `fun` returned `{where}` with shape {shape} for a chunk "
                f"of {size} elements, but its `out_axes` is {axis}: `fun` must return "
                "the chunk's elements along that axis. Check that `fun` is vectorised "
                "over the batch, or give outputs without a batch axis `None`."
            )
        return axis % len(shape)

    axes = resolve_axes(out, out_axes, "out_axes")
    return jtu.tree_map_with_path(_check, axes, out, is_leaf=_is_none)


def _chunk_fn(
    fun: Callable[..., Any],
    out_axes: PyTree[AxisSpec],
    static: Any,
    mapped: Any,
    size: int,
) -> ChunkOutput:
    """`fun` on one chunk (the mapped leaves `mapped`), its output split into
    batched arrays, unbatched arrays and the rest."""
    _args, _kwargs = eqx.combine(mapped, static)
    out = fun(*_args, **_kwargs)
    axes = _out_axes(out, out_axes, size)
    is_unbatched = jtu.tree_map(_is_none, axes, is_leaf=_is_none)
    unbatched, batched = eqx.partition(out, is_unbatched, is_leaf=_is_none)
    unbatched_arrays, rest = eqx.partition(unbatched, is_array)
    return ChunkOutput(batched, tuple(jtu.tree_leaves(axes)), unbatched_arrays, rest)


def _check_unbatched(
    chunk_fn: Callable[[Any, int], ChunkOutput],
    mapped: Any,
    in_axes: Any,
    chunk_size: int,
) -> None:
    """Raises if an output with `out_axes=None` depends on the mapped inputs.

    Chunking would return the last chunk's value of such an output. `jax.vmap` over
    a new axis of size one tells (abstractly) whether it depends on them.
    """
    paths: list[str] = []

    def _unbatched(_mapped: Any) -> list[Any]:
        leaves = jtu.tree_leaves_with_path(chunk_fn(_mapped, chunk_size).unbatched)
        paths[:] = [describe("output", path) for path, _ in leaves]
        return [x for _, x in leaves]

    def _struct(axis: int, x: Any) -> jax.ShapeDtypeStruct:
        shape = list(np.shape(x))
        shape[axis] = chunk_size
        return jax.ShapeDtypeStruct((1, *shape), jnp.result_type(x))

    structs = jtu.tree_map(_struct, in_axes, mapped)
    try:
        jax.eval_shape(jax.vmap(_unbatched, out_axes=None), structs)
    except ValueError as e:
        if "but output was batched" not in str(e):
            raise
        match = re.search(r"out_axes\[(\d+)\]", str(e))
        where = f"`{paths[int(match.group(1))]}`" if match else "an output"
        raise ValueError(
            f"`{_API}(..., out_axes=...)` gives `None` for {where}, but it depends "
            "on the mapped inputs, so each chunk would compute a different value. "
            "An output marked `None` must not depend on the batch; give it the "
            "integer axis along which `fun` returns the batch instead."
        ) from None


class _ChunkedApplyWrapper(eqx.Module):
    _fun: Callable[..., Any]
    _in_axes: PyTree[AxisSpec]
    _out_axes: PyTree[AxisSpec]
    _chunk_size: int | None
    _remainder: str
    _checkpoint: CheckpointSpec
    _progress_meter: AbstractProgressMeter | None = None

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self._fun

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if is_reporting(self._progress_meter):
            with closing_on_error():  # a failed call closes its meter
                return self._dispatch(args, kwargs)
        return self._dispatch(args, kwargs)

    def _dispatch(self, args: Any, kwargs: Any) -> Any:
        args, kwargs, spec = bind_arguments(
            self._fun, self._in_axes, args, kwargs, eqx.if_array(0), _API
        )
        tree = (args, kwargs)
        in_axes = normalise_in_axes(
            tree, resolve_axes(tree, spec, "in_axes"), "in_axes"
        )
        batch_size = batch_size_of(tree, in_axes, None, _API)
        if batch_size is None:
            return self._fun(*args, **kwargs)  # nothing to split
        if self._chunked(batch_size) and not is_traced((self, tree)):
            # An eager `lax.scan` recompiles on every call: see `_eager.py`.
            return call_compiled(lambda _tree: self._call(_tree, spec), tree)
        return self._call(tree, spec)

    def _chunked(self, batch_size: int) -> bool:
        return self._chunk_size is not None and self._chunk_size < batch_size

    def _call(self, tree: Any, spec: Any) -> Any:
        in_axes = normalise_in_axes(
            tree, resolve_axes(tree, spec, "in_axes"), "in_axes"
        )
        batch_size = batch_size_of(tree, in_axes, None, _API)
        assert batch_size is not None
        is_unmapped = jtu.tree_map(_is_none, in_axes, is_leaf=_is_none)
        static, mapped = eqx.partition(tree, is_unmapped)
        chunk_fn = ft.partial(_chunk_fn, self._fun, self._out_axes, static)
        if not self._chunked(batch_size):
            out = chunk_fn(mapped, batch_size)
        else:
            assert self._chunk_size is not None
            out = run_in_chunks(
                chunk_fn,
                mapped,
                in_axes,
                batch_size=batch_size,
                chunk_size=self._chunk_size,
                remainder=self._remainder,
                checkpoint=self._checkpoint,
                progress_meter=self._progress_meter,
                api=_API,
            )
            if jtu.tree_leaves(out.unbatched):
                _check_unbatched(chunk_fn, mapped, in_axes, self._chunk_size)
        return eqx.combine(out.batched, out.unbatched, out.static)

    def __get__(self, instance: Any, owner: Any) -> Any:
        del owner
        if instance is None:
            return self
        return eqx.Partial(self, instance)


@overload
def filter_chunked_apply(
    *,
    in_axes: PyTree[AxisSpec] = eqx.if_array(0),
    out_axes: PyTree[AxisSpec] = eqx.if_array(0),
    chunk_size: int | None = None,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def filter_chunked_apply(
    fun: Callable[..., Any],
    *,
    in_axes: PyTree[AxisSpec] = eqx.if_array(0),
    out_axes: PyTree[AxisSpec] = eqx.if_array(0),
    chunk_size: int | None = None,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]: ...


@jaxtyped(typechecker=beartype)
def filter_chunked_apply(
    fun: Callable[..., Any] = sentinel,
    *,
    in_axes: PyTree[Any] = eqx.if_array(0),
    out_axes: PyTree[Any] = eqx.if_array(0),
    chunk_size: int | None = None,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]:
    """Calls `fun`, a function already vectorised over a batch, on `chunk_size`
    elements of the batch at a time, to bound peak memory.

    This is NetKet's `apply_chunked` with Equinox's filtering. Where
    [`filtered_chunk.filter_chunked_vmap`][] vectorises a function of one element,
    `filter_chunked_apply` takes a function that already handles a whole batch (a
    model applied to a batch of inputs, a function of batched `jnp` operations) and
    only splits the batch: one `jax.lax.scan` calls `fun` on each chunk and writes
    its outputs into arrays allocated once at full size. Both transforms share
    that loop, so they handle the remainder, `out_axes` and derivatives in the
    same way; in particular gradients rematerialise one chunk at a time (see the
    guide on derivatives). Wherever `chunk_size` does not matter, the result is
    exactly `fun(*args, **kwargs)`.

    `fun` must treat the elements of the batch independently (no batch
    normalisation, no reduction over the batch), since each call sees one chunk.

    **Arguments:**

    - `fun`: a pure function whose mapped arguments hold the batch along their
        `in_axes` axis and whose outputs hold it along their `out_axes` axis.
    - `in_axes`: keyword-only. Where the batch lies in each argument, as for
        `filter_chunked_vmap`: a PyTree prefix of the positional arguments whose
        leaves are ints, `None` (the argument is passed whole to every call) or
        callables `leaf -> int | None`; or a dict mapping parameter names to such
        specs. `fun` receives each chunk with the batch axis where it was. Defaults
        to `equinox.if_array(0)`: arrays hold the batch along their leading axis;
        everything else is passed as it is.
    - `out_axes`: keyword-only. Where the batch lies in each output of `fun`
        (negative axes count from the end). An array output marked `None` has no
        batch axis: it must not depend on the batch (a `ValueError` says so if it
        does) and is returned once. Defaults to `equinox.if_array(0)`.
    - `chunk_size`: keyword-only. The number of batch elements per call of `fun`.
        `None` (the default), or any value at least the batch size, calls `fun`
        once on the whole batch.
    - `remainder`: keyword-only. As for `filter_chunked_vmap`: `"overlap"` (the
        default) runs `ceil(batch_size / chunk_size)` even chunks of at most
        `chunk_size` elements, the last overlapping the one before, in one loop;
        `"separate"` makes one more call of `fun` on the remainder.
    - `checkpoint`: keyword-only. Rematerialise each chunk in reverse mode, so that
        gradients need one chunk's residuals rather than every chunk's: `True` (the
        default), `False`, or a policy from `jax.checkpoint_policies` choosing which
        residuals to save.
    - `progress_meter`: keyword-only. Reports the elements done while the call
        runs, also under `jax.jit`: `None` or `filtered_chunk.NoProgressMeter()`
        (the default: nothing, at no cost), `filtered_chunk.TextProgressMeter()`,
        `filtered_chunk.TqdmProgressMeter()`, or a subclass of
        `filtered_chunk.AbstractProgressMeter`. Only a call split into chunks
        reports. See the guide on progress.

    **Returns:**

    A function with the signature of `fun`, returning what `fun` would.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtered_chunk as fc

        def predict(params, x):  # vectorised: `x` is a batch of inputs
            w, b = params
            return jnp.tanh(x @ w + b)

        params = (jnp.full((3, 2), 0.5), jnp.zeros(2))
        x = jnp.linspace(-1.0, 1.0, 3000).reshape(1000, 3)

        # `predict` on 128 inputs at a time; `params` is passed whole.
        chunked = fc.filter_chunked_apply(predict, in_axes=(None, 0), chunk_size=128)
        assert jnp.allclose(chunked(params, x), predict(params, x))

        # Gradients rematerialise one chunk at a time.
        loss = lambda p, f: jnp.mean(f(p, x) ** 2)
        grads = jax.grad(loss)(params, chunked)
        assert jnp.allclose(grads[0], jax.grad(loss)(params, predict)[0], atol=1e-6)
        ```
    """
    if fun is sentinel:
        return ft.partial(
            filter_chunked_apply,  # pyright: ignore[reportCallIssue]
            in_axes=in_axes,
            out_axes=out_axes,
            chunk_size=chunk_size,
            remainder=remainder,
            checkpoint=checkpoint,
            progress_meter=progress_meter,
        )
    _check_arguments(in_axes, out_axes, chunk_size, remainder)
    check_meter(progress_meter, _API)
    wrapper = _ChunkedApplyWrapper(
        _fun=fun,
        _in_axes=in_axes,
        _out_axes=out_axes,
        _chunk_size=chunk_size,
        _remainder=remainder,
        _checkpoint=checkpoint,
        _progress_meter=progress_meter,
    )
    return eqx.module_update_wrapper(wrapper)


def _check_arguments(
    in_axes: Any, out_axes: Any, chunk_size: int | None, remainder: str
) -> None:
    check_chunking(chunk_size, remainder, _API)
    check_spec(in_axes, "in_axes")
    check_spec(out_axes, "out_axes")
