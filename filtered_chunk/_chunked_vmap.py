"""`filter_chunked_vmap`: `equinox.filter_vmap`, evaluated `chunk_size` elements
at a time. Its plan binds the arguments with their axes, maps `fun` over each chunk
with `jax.vmap` and moves the outputs to their out axes."""

import functools as ft
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, overload, SupportsIndex, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from beartype import beartype
from equinox.internal import Static
from jaxtyping import jaxtyped, PyTree

from ._axes import (
    batched_none_path,
    describe,
    is_array,
    resolve_axes,
    run_tagged,
    varying_unmapped,
)
from ._batch import Batch, run_batch, staged_cost
from ._boundary import BuilderOptions, deferred, keyword_only
from ._custom_types import (
    AxisSpec,
    CheckpointSpec,
    ChunkOutput,
    is_none,
    keep_untraced,
    sentinel,
    SpmdAxisName,
    unwrap_kept,
)
from ._progress import AbstractProgressMeter
from ._summed import split_varying, summed_output, with_sums
from ._wrapper import AbstractMappedPlan, Bound, Chunked, ChunkOptions, Fun, wrap


_API = "filter_chunked_vmap"


def _evaluate(
    out_axes: PyTree[AxisSpec], closed: Any, mapped: Any, batch_known: bool = True
) -> tuple[Any, ...]:
    """`fun` on one element (the mapped leaves `mapped`), its output split into
    mapped arrays, unmapped arrays, and `Static((the rest, out axes))`."""
    fun, static = closed
    _args, _kwargs = eqx.combine(mapped, static)
    out = fun(*_args, **_kwargs)
    axes = resolve_axes(out, out_axes, "out_axes")
    if not batch_known and jtu.tree_leaves(axes):
        # Before looking at the leaves, as `eqx.filter_vmap` does.
        raise ValueError(
            "Cannot resolve batch dimension. Non-`None` `out_axes` requires "
            "either `in_axes` or `axis_size` to be not `None`."
        )

    def _check(path: tuple[Any, ...], axis: int | None, leaf: Any) -> int | None:
        if axis is None:
            return None
        where = describe("output", path)
        # A Python scalar is a JAX type: `jax.vmap` broadcasts it to a weakly typed
        # array, and so does `eqx.filter_vmap` with an integer out axis.
        if not is_array(leaf) and not isinstance(leaf, bool | int | float | complex):
            raise TypeError(
                f"`{where}` is {type(leaf).__name__} object {leaf!r}, which is not an "
                f"array, but its `out_axes` is {axis}. Only arrays can be mapped: "
                "give it `None` (or use `eqx.if_array(...)`)."
            )
        ndim = np.ndim(leaf) + 1
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"`out_axes` gives axis {axis} for `{where}`, whose mapped shape has "
                f"rank {ndim}: axis {axis} is out of bounds for array of dimension "
                f"{ndim}. Use an axis in [-{ndim}, {ndim})."
            )
        return axis % ndim

    axes = jtu.tree_map_with_path(_check, axes, out, is_leaf=is_none)
    is_unmapped = jtu.tree_map(is_none, axes, is_leaf=is_none)
    unmapped, mapped = eqx.partition(out, is_unmapped, is_leaf=is_none)
    unmapped_arrays, unmapped_static = eqx.partition(unmapped, is_array)
    return mapped, unmapped_arrays, Static((unmapped_static, axes))


class _VmapPlan(AbstractMappedPlan):
    sharded: ClassVar[bool] = True
    sum_match: bool = False

    def evaluate(
        self, fun: Fun, options: ChunkOptions, bound: Bound, chunk_size: int | None
    ) -> Any:
        if bound.batch_size is None:
            static, mapped = _unmapped_and_mapped(bound)
            out = _evaluate(self.out_axes, (fun, static), mapped, batch_known=False)
            return eqx.combine(*out[:2], out[2].value[0])
        out = run_batch(
            self.batch(fun, options, bound), chunk_size, options, bound.sharding
        )
        return self.finish(out)

    def finish(self, out: ChunkOutput) -> Any:
        """The loop's output as `fun`'s: sums back in their places, or the mapped,
        unmapped and static parts combined."""
        if self.sum_match:
            return with_sums(out)
        return eqx.combine(out.batched, out.unbatched, unwrap_kept(out.static))

    def staged(
        self, fun: Fun, options: ChunkOptions, bound: Bound, chunk_size: int
    ) -> tuple[int, int, float]:
        if bound.batch_size is None:
            return 0, 0, 1.0
        batch = self.batch(fun, options, bound)
        return staged_cost(batch, chunk_size, options, bound.sharding)

    def batch(self, fun: Fun, options: ChunkOptions, bound: Bound) -> Batch:
        """The call's batch, as `run_batch` takes it."""
        assert bound.batch_size is not None
        static, mapped = _unmapped_and_mapped(bound)
        out_axes, in_axes, sum_match = self.out_axes, bound.in_axes, self.sum_match
        chunk = ft.partial(_chunk_fn, out_axes, in_axes, options.axis_name, sum_match)
        element = ft.partial(_evaluate, out_axes)
        return Batch(
            chunk,
            (fun, static),
            mapped,
            in_axes,
            bound.batch_size,
            element=element,
            sum_match=sum_match,
        )


def _unmapped_and_mapped(bound: Bound) -> tuple[Any, Any]:
    """The call's tree split into its unmapped leaves and its mapped ones."""
    is_unmapped = jtu.tree_map(is_none, bound.in_axes, is_leaf=is_none)
    return eqx.partition(bound.tree, is_unmapped)


def _chunk_fn(
    out_axes: PyTree[AxisSpec],
    in_axes: Any,
    axis_name: Hashable | None,
    sum_match: bool,
    closed: Any,
    mapped: Any,
    size: int,
) -> ChunkOutput:
    """One `jax.vmap` of `fun` over `size` elements, outputs at their out axes. With
    `sum_match`, the unmapped outputs that vary over the batch are rows of sums that
    the loop accumulates (`_summed.py`), after the mapped outputs in `batched`;
    `with_sums` puts them back in their places."""
    element = ft.partial(_evaluate, out_axes, closed)
    paths: list[str] = []
    varies: list[bool] = []

    # What tells an output that varies (`_summed.py`): a mapped input, sharded like
    # the batch; with none, the elements' positions.
    mapped_leaves = jtu.tree_leaves(mapped)
    positions = (jnp.arange(int(size)),) if sum_match and not mapped_leaves else ()

    def _flat_unmapped(_mapped: Any, *_positions: Any) -> tuple[Any, ...]:
        # The unmapped arrays go first, as a flat list: JAX's key path for an
        # output that varies is off once the output holds `None`s, its index is not.
        _out_mapped, _out_unmapped, _static = run_tagged(element, _mapped)
        leaves, treedef = jtu.tree_flatten_with_path(_out_unmapped)
        paths[:] = [describe("output", path) for path, _ in leaves]
        flat, summed = [x for _, x in leaves], []
        if sum_match:
            marker = (*jtu.tree_leaves(_mapped), *_positions)[0]
            summed, flat, varies[:] = split_varying(flat, marker)
        return flat, _out_mapped, summed, _static, Static(treedef)

    in_out = ((in_axes,) + (0,) * len(positions), (None, 0, 0, None, None))
    vmapped = jax.vmap(_flat_unmapped, *in_out, axis_name=axis_name, axis_size=size)
    try:
        unmapped, out_mapped, summed, static, treedef = vmapped(mapped, *positions)
    except ValueError as e:
        path = batched_none_path(e)
        if path is None:
            raise
        index = path[1] if len(path) == 2 and path[0] == 0 else len(paths)
        where = f"`{paths[index]}`" if index < len(paths) else "an output"
        raise varying_unmapped(_API, where) from None
    if sum_match:
        where = (list(varies), treedef.value)
        return summed_output(out_mapped, static, summed, unmapped, where)
    out_static, resolved = static.value  # the out axes, resolved on the output
    # What no trace computed is returned as it is (`jax.vmap` does the same).
    out_unmapped, kept = keep_untraced(jtu.tree_unflatten(treedef.value, unmapped))
    axes = tuple(jtu.tree_leaves(resolved))
    moved = [jnp.moveaxis(x, 0, a) for x, a in zip(jtu.tree_leaves(out_mapped), axes)]
    out_mapped = jtu.tree_unflatten(jtu.tree_structure(out_mapped), moved)
    return ChunkOutput(out_mapped, axes, out_unmapped, eqx.combine(out_static, kept))


class _VmapOptions(BuilderOptions, total=False):
    in_axes: PyTree[AxisSpec]
    out_axes: PyTree[AxisSpec]
    axis_name: Hashable
    axis_size: int | None
    spmd_axis_name: SpmdAxisName
    sum_match: bool
    keep_boundaries: bool | np.bool_ | SupportsIndex | None


@overload
def filter_chunked_vmap(
    **options: Unpack[_VmapOptions],
) -> Callable[[Fun], Chunked]: ...
@overload
def filter_chunked_vmap(fun: Fun, **options: Unpack[_VmapOptions]) -> Chunked: ...
@keyword_only("filter_chunked_vmap", 1, ("in_axes", "out_axes"), "jax.vmap")
@jaxtyped(typechecker=beartype)
def filter_chunked_vmap(
    fun: Callable[..., Any] = sentinel,
    *,
    in_axes: PyTree[Any] = eqx.if_array(0),
    out_axes: PyTree[Any] = eqx.if_array(0),
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    axis_name: Hashable = None,
    axis_size: int | None = None,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    spmd_axis_name: SpmdAxisName = None,
    progress_meter: AbstractProgressMeter | None = None,
    sum_match: bool = False,
    keep_boundaries: Any = None,  # checked: a bool, an integer or `None`
) -> Callable[..., Any]:
    """Vectorises `fun` like [`equinox.filter_vmap`][eqx-filter-vmap], but evaluates
    the batch `chunk_size` elements at a time to bound peak memory.

    One `jax.lax.scan` runs `jax.vmap(fun)` on each chunk and writes its outputs
    into preallocated arrays, so peak memory is the outputs plus one chunk's working
    set, not the whole batch's. Wherever `chunk_size` does not matter, the result is
    exactly `equinox.filter_vmap`'s: same values, shapes, dtypes, PyTree structure,
    and the same exception class for bad input.

    **Arguments:**

    - `fun`: a pure function to vectorise. It is never mapped itself: a Module or a
        bound method passed as `fun` is closed over.
    - `in_axes`: keyword-only. As for `equinox.filter_vmap`: a PyTree prefix of the
        positional arguments whose leaves are ints (negative allowed), `None`, or
        callables `leaf -> int | None` (such as `equinox.if_array(1)`); or a dict
        mapping parameter names to such specs. Defaults to `equinox.if_array(0)`: map
        every JAX/NumPy array along its leading axis and broadcast everything else.
    - `out_axes`: keyword-only. As for `equinox.filter_vmap`: where the mapped axis
        appears in each output. An array output marked `None` must not vary over
        the batch; it is returned once. Defaults to `equinox.if_array(0)`.
    - `chunk_size`: keyword-only. The number of batch elements evaluated together, of
        any integer type (`numpy.int64`, a JAX integer scalar). `None` (the default), or
        any value at least the batch size, evaluates the whole batch in one `vmap`,
        exactly as `equinox.filter_vmap`. With the batch split over devices (see
        `spmd_axis_name`), it counts elements per device: each device chunks its own
        `batch_size / num_devices` elements. Or a memory budget, `"auto"` or a
        [`filtered_chunk.MemoryBudget`][]: when the transform is first called with
        given shapes, a chunk size whose compiled program fits it is chosen: on CPU
        the fastest of a few that fit, timed once on your machine; elsewhere the
        largest (see [choosing `chunk_size`][choosing-chunk_size]).
    - `axis_name`: keyword-only. A name for the mapped axis, for collectives such as
        `jax.lax.psum`, computed over the whole batch as by `equinox.filter_vmap`
        however it is split: across chunks, `fun` is evaluated in passes over the batch,
        one per level of collectives that depend on each other, plus the final one (see
        [collectives across chunks][collectives-across-chunks]). What cannot be computed
        exactly across chunks (a collective inside a `lax.scan` body, or one that only a
        custom derivative rule performs) raises before anything runs.
    - `axis_size`: keyword-only. The batch size, needed only when nothing is mapped.
    - `remainder`: keyword-only. How to handle the last `batch_size % chunk_size`
        elements. `"overlap"` (the default) runs one loop of `ceil(batch_size /
        chunk_size)` steps over chunks of equal size (at most `chunk_size`), the last
        ending at the end of the batch: it recomputes fewer elements than there are
        steps, needs no second working set, and traces `fun` once (with `axis_name`,
        once more with the axis unbound, to find whether `fun` reads it). `"separate"`
        evaluates the remainder in a second `vmap` after the loop: no recomputation, but
        a second trace of `fun` and, measured, up to twice the memory.
    - `checkpoint`: keyword-only. Rematerialise each chunk in reverse mode, so that
        gradients need one chunk's residuals rather than every chunk's: `True` (the
        default), `False`, or a policy from `jax.checkpoint_policies` choosing which
        residuals to save. It has no effect on evaluation without differentiation.
    - `keep_boundaries`: keyword-only. With collectives across chunks (see
        `axis_name`), whether each pass over the batch keeps, in batch-sized
        buffers, the per-element values where the next pass resumes (its stage
        boundary), so that no part of `fun` is computed twice. `False` recomputes,
        in each pass, the part of `fun` before its collectives: the least memory,
        and a time that grows with the square of the number of collectives that
        depend on each other (a BatchNorm network has one per layer). `True` runs
        `fun` about once, at the cost of the boundaries' buffers (the batch size
        times the values kept per element): evaluated, those of two or three
        passes at once (a pass writes into buffers no later pass reads); under
        reverse mode, every pass's, as residuals (plus two buffers for their
        cotangents). An int `n` keeps those of every `n`-th pass only (passes `n`,
        `2n`, ...; `1` is `True`, and an `n` beyond the number of passes keeps
        none): the passes between recompute from the latest kept values, with
        fewer buffers. `None` (the default): `False` at a fixed `chunk_size`; with
        a memory budget, the most boundaries whose program fits the budget (every
        pass's, else every `n`-th pass's for a few `n`, else the middle pass's),
        at the size chosen without them or a smaller one
        ([`filtered_chunk.suggest_chunk_size`][] says which), else `False`. No
        effect without
        collectives across chunks. See
        [collectives across chunks][collectives-across-chunks].
    - `spmd_axis_name`: keyword-only. The mesh axis name (or tuple of names) that the
        batch is split over, as for `jax.vmap`. Each device then chunks its own elements
        inside `jax.shard_map`: the compiled program has no collective on the batch, and
        the mapped outputs are split like the inputs, along their out axes. The split is
        found by itself outside `jax.jit` and in explicit-sharding mode; name it only
        under `jit` in auto-sharding mode, with the mesh set by `jax.set_mesh`. The
        batch size must then be a multiple of the number of devices. Defaults to `None`.
        See the guide on [sharded and multi-host use][sharded-and-multi-host-use].
    - `progress_meter`: keyword-only. Reports the elements done while the call
        runs, also under `jax.jit`: {meters} Only a call split into chunks
        reports; with a sharded batch, one meter counts every device's elements.
        See the [guide on progress][progress].
    - `sum_match`: keyword-only. As for `jax.vmap`: an array output marked
        `out_axes=None` that varies over the batch is summed over it (in `jnp.sum`'s
        dtype) instead of raising; one that does not vary is returned as it is. Chunked,
        the sum is accumulated across chunks, costing its own size, never the batch's
        (see [per-example gradients][per-example-gradients-summed-in-one-map]).
        Defaults to `False`.

    **Returns:**

    A function with the signature of `fun`, returning what `equinox.filter_vmap` would.
    Unlike Equinox, it accepts keyword arguments, bound to `fun`'s signature first, so
    `f(x, y=y)` is `f(x, y)`. A dict `in_axes` names parameters however they are passed;
    with a tuple `in_axes`, the keyword arguments that cannot be passed positionally get
    `equinox.if_array(0)`; a single spec covers every argument. Its method
    `valid(count)` (or `valid(mask=mask)`) is the same function on the valid
    elements of a padded batch only, one compilation for every count (see
    [variable-size batches][variable-size-batches]).

    !!! example

        ```python
        import equinox as eqx
        import jax.numpy as jnp
        import filtered_chunk as fc

        def pairwise(x, y):
            return jnp.exp(-jnp.sum((x - y) ** 2, axis=-1))

        queries = jnp.linspace(0.0, 1.0, 1000).reshape(500, 2)
        references = jnp.linspace(0.0, 1.0, 4000).reshape(2000, 2)

        # Each of the 500 queries against all references, 64 queries at a time.
        kernel = fc.filter_chunked_vmap(pairwise, in_axes=(0, None), chunk_size=64)
        out = kernel(queries[:, None, :], references)
        assert out.shape == (500, 2000)
        assert jnp.allclose(out, eqx.filter_vmap(pairwise, in_axes=(0, None))(
            queries[:, None, :], references
        ))
        ```

    !!! tip

        Outside `jax.jit`, a chunked call (one that splits the batch) is traced and
        run as one compiled program, since a `lax.scan` run op by op would
        recompile on every call. The compilation is cached on the traced program,
        not on `fun`, so values that `fun` reads from its closure are never stale.
        As under `jit`, array arguments reach `fun` as tracers.

    [eqx-filter-vmap]: https://docs.kidger.site/equinox/api/transformations/#equinox.filter_vmap
    """
    if fun is sentinel:
        return deferred(filter_chunked_vmap, locals())
    options = ChunkOptions(
        _API,
        chunk_size,
        remainder,
        checkpoint,
        progress_meter,
        axis_name,
        spmd_axis_name,
        keep_boundaries,
    )
    return wrap(fun, _VmapPlan(in_axes, out_axes, axis_size, sum_match), options)
