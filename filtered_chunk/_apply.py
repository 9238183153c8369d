"""`filter_chunked_apply`: call an already vectorised function on chunks of a batch."""

import functools as ft
from collections.abc import Callable
from typing import Any, overload, Unpack

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jex
import jax.tree_util as jtu
import numpy as np
from beartype import beartype
from jaxtyping import jaxtyped, PyTree

from ._axes import (
    batched_none_path,
    describe,
    is_array,
    resolve_axes,
    run_tagged,
    varying_unmapped,
)
from ._batch import Batch, run_batch
from ._boundary import BuilderOptions, deferred, keyword_only
from ._custom_types import (
    AxisSpec,
    CheckpointSpec,
    ChunkFn,
    ChunkOutput,
    is_none,
    keep_untraced,
    sentinel,
    unwrap_kept,
)
from ._progress import AbstractProgressMeter
from ._structs import struct
from ._wrapper import AbstractMappedPlan, Bound, Chunked, ChunkOptions, Fun, wrap


_API = "filter_chunked_apply"


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
    return jtu.tree_map_with_path(_check, axes, out, is_leaf=is_none)


def _chunk(
    out_axes: PyTree[AxisSpec], closed: Any, mapped: Any, size: int
) -> ChunkOutput:
    """`fun` on one chunk (`closed` is `fun` and the unmapped leaves, `mapped` the
    chunk's), its output split into batched arrays, unbatched arrays and the rest."""
    fun, static = closed
    _args, _kwargs = eqx.combine(mapped, static)
    out = fun(*_args, **_kwargs)
    axes = _out_axes(out, out_axes, size)
    is_unbatched = jtu.tree_map(is_none, axes, is_leaf=is_none)
    unbatched, batched = eqx.partition(out, is_unbatched, is_leaf=is_none)
    unbatched_arrays, rest = eqx.partition(unbatched, is_array)
    # What no trace computed is returned as it is, as `fun` returned it.
    unbatched_arrays, kept = keep_untraced(unbatched_arrays)
    rest = eqx.combine(rest, kept)
    return ChunkOutput(batched, tuple(jtu.tree_leaves(axes)), unbatched_arrays, rest)


def _program(closed: Any, index: int) -> tuple[str, list[Any]]:
    """The part of `closed` that computes its output `index`: its text and the
    constants it reads."""
    jaxpr = closed.jaxpr
    needed = {v for v in jaxpr.outvars[index : index + 1] if isinstance(v, jex.Var)}
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            eqns.append(eqn)
            needed.update(v for v in eqn.invars if isinstance(v, jex.Var))
    used = [i for i, v in enumerate(jaxpr.constvars) if v in needed]
    part = jaxpr.replace(
        constvars=[jaxpr.constvars[i] for i in used],
        invars=[v for v in jaxpr.invars if v in needed],
        outvars=[jaxpr.outvars[index]],
        eqns=eqns[::-1],
        debug_info=jaxpr.debug_info.with_unknown_names(),
    )
    return str(part), [closed.consts[i] for i in used]


_VALUES = (np.ndarray, np.generic, jax.Array, bool, int, float, complex, str, bytes)


def _same_value(x: Any, y: Any) -> bool:
    """Whether two traces' constants (or static outputs) are the same value: only
    values that compare by value are compared (two new objects without `__eq__`
    would differ though nothing depends on the chunk's size)."""
    if x is y or isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer):
        return True  # an outer tracer: the same one, or unknowable
    if not isinstance(x, _VALUES) or not isinstance(y, _VALUES):
        return True
    return bool(eqx.tree_equal(x, y, typematch=True))


def _check_contract(
    out_axes: PyTree[AxisSpec], in_axes: Any, closed: Any, mapped: Any, chunk_size: int
) -> None:
    """Raises if `fun`, traced (abstractly) on chunks of two sizes, breaks its
    contract, which chunking cannot see otherwise: each batched output must hold
    the chunk along its out axis at both (`x.T` does for a square chunk only), and
    each output marked `None` be computed alike from the same constants (one that
    reads `x.shape[0]` would differ from the unchunked result)."""
    chunk_fn = ft.partial(_chunk, out_axes, closed)
    traces = []
    for size in (chunk_size, chunk_size + 1):

        def _unbatched(_mapped: Any, size: int = size) -> list[Any]:
            out = chunk_fn(_mapped, size)
            leaves = jtu.tree_leaves_with_path(out.unbatched)
            traces.append(([p for p, _ in leaves], out.static))
            return [x for _, x in leaves]

        structs = jtu.tree_map(
            lambda axis, x: struct(x, axis, size, weak=False), in_axes, mapped
        )
        traced = jax.make_jaxpr(_unbatched)(structs)
        paths, static = traces.pop()
        programs = [_program(traced, i) for i in range(len(paths))]
        traces.append((paths, programs, unwrap_kept(static)))
    (paths, programs, static), (paths2, programs2, static2) = traces
    different = [
        path
        for path, (text, consts), (text2, consts2) in zip(paths, programs, programs2)
        if text != text2 or not all(map(_same_value, consts, consts2))
    ]
    if paths:
        # An output that depends on the elements says so more precisely.
        _check_unbatched(chunk_fn, mapped, in_axes, chunk_size)
    if paths != paths2 or jtu.tree_structure(static) != jtu.tree_structure(static2):
        different.append(())
    else:
        pairs = zip(jtu.tree_leaves_with_path(static), jtu.tree_leaves(static2))
        different += [p for (p, x), y in pairs if not _same_value(x, y)]
    if different:
        where = describe("output", different[0])
        raise ValueError(
            f"`{_API}(..., out_axes=...)` gives `None` for `{where}`, but it "
            "depends on the number of elements `fun` is called on: it differs "
            f"between chunks of {chunk_size} and {chunk_size + 1} elements, so "
            "chunking would change it. An output marked `None` must not depend on "
            "the batch; give it the integer axis along which `fun` returns the "
            "batch instead, or compute it outside `fun`."
        )


def _check_unbatched(
    chunk_fn: ChunkFn, mapped: Any, in_axes: Any, chunk_size: int
) -> None:
    """Raises if an output with `out_axes=None` depends on the mapped inputs (of
    which chunking would return the last chunk's value), as `jax.vmap` over a new
    axis of size one tells (abstractly)."""
    paths: list[str] = []

    def _unbatched(_mapped: Any) -> list[Any]:
        out = run_tagged(chunk_fn, _mapped, chunk_size)
        leaves = jtu.tree_leaves_with_path(out.unbatched)
        paths[:] = [describe("output", path) for path, _ in leaves]
        return [x for _, x in leaves]

    def _struct(axis: int, x: Any) -> jax.ShapeDtypeStruct:
        chunk = struct(x, axis, chunk_size, weak=False)
        return jax.ShapeDtypeStruct((1, *chunk.shape), chunk.dtype)

    structs = jtu.tree_map(_struct, in_axes, mapped)
    try:
        jax.eval_shape(jax.vmap(_unbatched, out_axes=None), structs)
    except ValueError as e:
        path = batched_none_path(e)
        if path is None:
            raise
        index = path[0] if len(path) == 1 else len(paths)
        where = f"`{paths[index]}`" if index < len(paths) else "an output"
        fix = "give it the integer axis along which `fun` returns the batch instead"
        raise varying_unmapped(_API, where, fix) from None


class _ApplyPlan(AbstractMappedPlan):
    def evaluate(
        self, fun: Fun, options: ChunkOptions, bound: Bound, chunk_size: int | None
    ) -> Any:
        if bound.batch_size is None:
            return fun(*bound.tree[0], **bound.tree[1])  # nothing to split
        return self.finish(
            run_batch(self.batch(fun, options, bound), chunk_size, options)
        )

    def batch(self, fun: Fun, options: ChunkOptions, bound: Bound) -> Batch:
        """The call's batch, as `run_batch` takes it."""
        del options
        assert bound.batch_size is not None
        is_unmapped = jtu.tree_map(is_none, bound.in_axes, is_leaf=is_none)
        static, mapped = eqx.partition(bound.tree, is_unmapped)
        chunk = ft.partial(_chunk, self.out_axes)
        check = ft.partial(_check_contract, self.out_axes, bound.in_axes)
        closed, size = (fun, static), bound.batch_size
        return Batch(chunk, closed, mapped, bound.in_axes, size, check=check)

    def finish(self, out: ChunkOutput) -> Any:
        """The loop's output as `fun`'s."""
        return eqx.combine(out.batched, out.unbatched, unwrap_kept(out.static))


class _ApplyOptions(BuilderOptions, total=False):
    in_axes: PyTree[AxisSpec]
    out_axes: PyTree[AxisSpec]


@overload
def filter_chunked_apply(
    **options: Unpack[_ApplyOptions],
) -> Callable[[Fun], Chunked]: ...
@overload
def filter_chunked_apply(fun: Fun, **options: Unpack[_ApplyOptions]) -> Chunked: ...
@keyword_only("filter_chunked_apply", 1, ("in_axes", "out_axes"), "jax.vmap")
@jaxtyped(typechecker=beartype)
def filter_chunked_apply(
    fun: Fun = sentinel,
    *,
    in_axes: PyTree[Any] = eqx.if_array(0),
    out_axes: PyTree[Any] = eqx.if_array(0),
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Fun:
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
    [guide on derivatives][derivatives]). Wherever `chunk_size` does not matter,
    the result is exactly `fun(*args, **kwargs)`.

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
        batch axis: it must not depend on the batch, nor on the number of
        elements `fun` is called on (such as `x.shape[0]`), and is returned once.
        Before the loop, `fun` is traced (abstractly) on chunks of two sizes: a
        `ValueError` names any output that breaks this, or whose `out_axes` axis
        does not hold the chunk's elements at both. Defaults to
        `equinox.if_array(0)`.
    - `chunk_size`: keyword-only. The number of batch elements per call of `fun`. `None`
        (the default), or any value at least the batch size, calls `fun` once on the
        whole batch. Or a memory budget, `"auto"` or a
        [`filtered_chunk.MemoryBudget`][]: a chunk size whose compiled program fits it
        is chosen: on CPU the fastest of a few that fit, timed once on your machine;
        elsewhere the largest, as for `filter_chunked_vmap`.
    - `remainder`: keyword-only. As for `filter_chunked_vmap`: `"overlap"` (the
        default) runs `ceil(batch_size / chunk_size)` even chunks of at most
        `chunk_size` elements, the last overlapping the one before, in one loop;
        `"separate"` makes one more call of `fun` on the remainder.
    - `checkpoint`: keyword-only. Rematerialise each chunk in reverse mode, so that
        gradients need one chunk's residuals rather than every chunk's: `True` (the
        default), `False`, or a policy from `jax.checkpoint_policies` choosing which
        residuals to save.
    - `progress_meter`: keyword-only. Reports the elements done while the call
        runs, also under `jax.jit`: {meters} Only a call split into chunks
        reports. See the [guide on progress][progress].

    **Returns:**

    A function with the signature of `fun`, returning what `fun` would. Its
    method `valid(count)` (or `valid(mask=mask)`) is the same function on the
    valid elements of a padded batch only (see
    [variable-size batches][variable-size-batches]).

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
        return deferred(filter_chunked_apply, locals())
    options = ChunkOptions(_API, chunk_size, remainder, checkpoint, progress_meter)
    return wrap(fun, _ApplyPlan(in_axes, out_axes), options)
