"""A batch on its valid elements only: the first `count`, a traced count.
[`gated`][] wraps a batch's chunk function (`_Gated`), which

- runs the chunk only if one of its elements is valid (`lax.cond`: a chunk of
  padding costs nothing but the unmapped outputs, which do not depend on it);
- gives its invalid elements a copy of its first element, which is valid, so
  that `fun` never sees a padded row (NaN in it cannot reach a value or a
  derivative);
- writes `fill` at the invalid elements' rows of the mapped outputs, and leaves
  their rows out of the sums of `sum_match=True`.

In reverse mode the copies share the first element's cotangent evenly
(`_spread`), as the rows that the loop's overlapping last step recomputes do
(`_loop/_rule.py`): a copy given none would add `0 * inf` (NaN) where `fun`'s
derivative is infinite, which `eqx.filter_vmap` on the valid elements never
computes.

The valid elements are the batch's first (`Batch.leading`): evaluated, the
loop stops after the last step that holds one (`_loop/_scan.py`), its outputs'
other rows holding `fill` from the start. A derivative runs every step (JAX
transposes no loop of a traced length), each chunk with no valid element
skipped by the branch above. The loop is the padded batch's, so every count of
the same shapes runs one compiled program. A sharded batch that its devices do
not divide is padded to a multiple of them (`padded`), its padding invalid.
"""

import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array, PyTree

from ._custom_types import Batch, ChunkOutput, InputArray, Leading
from ._loop._accumulate import lowest
from ._loop._scan import as_arrays
from ._mesh import BatchSharding, gathered, on_mesh
from ._structs import full, inexact


def gated(batch: Batch, count: Any, fill: Any, sharding: BatchSharding | None) -> Batch:
    """`batch` on its first `count` elements only: see the module's docstring.
    Split over devices that do not divide it, it is padded to a multiple of them
    ([`unpadded`][] then gives the outputs at its size)."""
    devices = 1 if sharding is None else sharding.num_devices
    size = -(-batch.size // devices) * devices
    positions = jnp.arange(size)  # split like the batch by `run_sharded`
    count = jnp.clip(count, 0, batch.size).astype(positions.dtype)
    chunk = _Gated(batch.chunk, batch.in_axes, fill)
    check = None if batch.check is None else ft.partial(_checked, batch.check)
    mapped = batch.mapped
    if size != batch.size:
        pad = ft.partial(_padded, sharding, size - batch.size)
        mapped = jtu.tree_map(pad, batch.in_axes, mapped)
    return Batch(
        chunk,
        (batch.closed, count),
        (mapped, positions),
        (batch.in_axes, 0),
        size,
        check=check,
        sum_match=batch.sum_match,
        check_vma=False,
        padding=size - batch.size,
        leading=ft.partial(_leading, fill),
    )


def _leading(fill: Any, closed: Any, mapped: Any) -> Leading:
    """The valid rows of a gated batch (a device's shard, inside `shard_map`):
    its leading ones, since its positions rise. The loop then evaluates only
    the steps that hold one, under an outer `vmap` the steps of the element
    with the most."""
    (_, count), (_, positions) = closed, mapped
    rows = jnp.sum(positions < count, dtype=positions.dtype)
    return Leading(_outer_p.bind(rows, kind="max"), fill)


def unpadded(
    out: ChunkOutput, size: int, sharding: BatchSharding | None
) -> ChunkOutput:
    """`out`'s mapped outputs at the first `size` elements of a padded batch:
    replicated over the batch's devices (in explicit mode), as `jax.vmap` gives
    them."""
    leaves, treedef = jtu.tree_flatten(out.batched)
    leaves = [
        x if k is not None or x.shape[a] == size else _sliced(x, a, size, sharding)
        for x, a, k in zip(leaves, out.batched_axes, out.kinds(), strict=True)
    ]
    return out._replace(batched=jtu.tree_unflatten(treedef, leaves))


def _sliced(x: Array, axis: int, size: int, sharding: BatchSharding | None) -> Array:
    if sharding is not None:
        x = gathered(sharding, x)
    return lax.slice_in_dim(x, 0, size, axis=axis)


def _padded(
    sharding: BatchSharding | None, rows: int, axis: int, x: InputArray
) -> InputArray:
    """`x` with `rows` rows of zeros after its last along `axis`."""
    widths = [(0, 0)] * jnp.ndim(x)
    widths[axis] = (0, rows)
    if isinstance(x, np.ndarray):
        return np.pad(x, widths)  # a NumPy array stays one (`InputArray`)
    if sharding is not None:
        # In explicit mode, on the mesh first: the pad's transpose, a slice,
        # then takes a replicated cotangent, where one split over the devices
        # cannot be cut to a size they do not divide.
        x = on_mesh(sharding, x)
    return jnp.pad(x, widths)


def _checked(check: Callable[..., None], closed: Any, mapped: Any, size: int) -> None:
    """The transform's own check of `fun`, on the batch without the count and
    the positions."""
    check(closed[0], mapped[0], size)


def _along(valid: Array, axis: int, ndim: int) -> Array:
    """`valid` shaped to broadcast along dimension `axis` of an array of `ndim`."""
    return valid.reshape((1,) * axis + (-1,) + (1,) * (ndim - axis - 1))


class _Gated(eqx.Module):
    """A batch's chunk function on the valid elements only (`gated`)."""

    chunk: Callable[[Any, PyTree[InputArray], int], ChunkOutput]
    in_axes: PyTree[int | None] = eqx.field(static=True)
    fill: Any = eqx.field(static=True)

    def __call__(self, closed: Any, mapped: Any, size: int) -> ChunkOutput:
        closed, count = closed
        mapped, positions = mapped
        valid = positions < count
        every = _outer_p.bind(jnp.all(valid), kind="all")

        def _safe(_mapped: Any) -> Any:
            return jtu.tree_map(
                lambda axis, x: _copied(x, axis, valid), self.in_axes, _mapped
            )

        # Only a chunk with invalid elements pays for replacing them: a select
        # of every element in a loop fusion (under `jax.grad` of an MLP's
        # per-example outputs, 1.20x the time against 1.05x: benchmarks/valid.py).
        safe = lax.cond(every, lambda m: m, _safe, mapped)
        traced: list[ChunkOutput] = []

        def _arrays(_mapped: Any) -> tuple[list[Array], Any]:
            out = self.chunk(closed, _mapped, size)
            traced.append(out)
            return jtu.tree_leaves(out.batched), out.unbatched

        # One trace of the chunk, run in either branch.
        fn = eqx.filter_closure_convert(_arrays, safe)
        shapes = traced[0]
        layout = (shapes.batched_axes, shapes.kinds())
        structs = jax.eval_shape(lambda: jtu.tree_leaves(shapes.batched))

        def _run() -> tuple[list[Array], Any]:
            leaves, unbatched = as_arrays(fn(safe))
            leaves = [
                jnp.where(
                    _along(valid, a, x.ndim),
                    _spread(x, valid, a) if inexact(x) else x,
                    _filler(x, k, self.fill),
                )
                for x, a, k in zip(leaves, *layout, strict=True)
            ]
            return leaves, unbatched

        def _skip() -> tuple[list[Array], Any]:
            # The unmapped outputs do not depend on the chunk: XLA keeps only
            # what computes them.
            unbatched = shapes.unbatched
            if jtu.tree_leaves(unbatched):
                _, unbatched = as_arrays(fn(safe))
            leaves = [
                full(s, s.shape, _fill_value(s, k, self.fill))
                for s, k in zip(structs, layout[1], strict=True)
            ]
            return leaves, unbatched

        # Under an outer `vmap` of differing counts: skipped where no element of
        # it has a valid element in the chunk.
        leaves, unbatched = lax.cond(
            _outer_p.bind(jnp.any(valid), kind="any"), _run, _skip
        )
        batched = jtu.tree_unflatten(jtu.tree_structure(shapes.batched), leaves)
        return shapes._replace(batched=batched, unbatched=unbatched)


# A scalar reduced over the elements of every `vmap` around the call (`kind`:
# `"any"` or `"all"` of a boolean, `"max"` of a number): not batched, so that a
# `lax.cond` on it stays one branch, where a batched predicate makes it a select
# that computes both (and a `lax.while_loop` bounded by it stays one loop). A
# primitive, not a `custom_vmap`, whose rule would be a new object on every
# trace: an eager call then finds its compiled program again (`_eager.py`).
_outer_p = jex.Primitive("reduced_over_outer_maps")
_outer_p.def_impl(lambda flag, *, kind: flag)
_outer_p.def_abstract_eval(lambda flag, *, kind: flag)
mlir.register_lowering(_outer_p, lambda ctx, flag, *, kind: [flag])


def _outer_batched(args: Any, dims: Any, *, kind: str) -> tuple[Array, Any]:
    (flag,), (dim,) = args, dims
    flag = {"any": jnp.any, "all": jnp.all, "max": jnp.max}[kind](flag, axis=dim)
    return _outer_p.bind(flag, kind=kind), None  # not batched


def _outer_jvp(primals: Any, tangents: Any, *, kind: str) -> tuple[Array, Any]:
    del tangents
    out = _outer_p.bind(*primals, kind=kind)
    return out, np.zeros(np.shape(out), jax.dtypes.float0)  # an integer's tangent


batching.primitive_batchers[_outer_p] = _outer_batched
ad.primitive_jvps[_outer_p] = _outer_jvp


def _copied(x: InputArray, axis: int, valid: Array) -> Array:
    """`x`'s chunk with each invalid element replaced by its first element,
    which is valid if any is. Else zeros: only an outer `vmap` whose count
    differs between its elements computes such a chunk, and drops its outputs."""
    if not valid.shape[0]:
        return jnp.asarray(x)
    lane = lax.slice_in_dim(x, 0, 1, axis=axis)
    lane = jnp.where(valid[0], lane, lax.stop_gradient(jnp.zeros_like(lane)))
    return jnp.where(_along(valid, axis, x.ndim), x, lane)


@ft.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _spread(x: Array, valid: Array, axis: int) -> Array:
    """`x`, the rows of a chunk whose invalid elements copy its first; in
    forward mode the first row's tangent is the mean of its copies', so that in
    reverse mode each copy gets an even share of its cotangent."""
    del valid, axis
    return x


@_spread.defjvp
def _spread_jvp(axis: int, primals: Any, tangents: Any) -> tuple[Array, Array]:
    x, valid = primals
    t, _ = tangents
    invalid = jnp.logical_not(_along(valid, axis, x.ndim))
    copies = jnp.sum(jnp.where(invalid, t, jnp.zeros_like(t)), axis, keepdims=True)
    share = (1 + jnp.sum(jnp.logical_not(valid))).astype(t.dtype)
    first = _along(jnp.arange(valid.shape[0]) == 0, axis, x.ndim)
    return x, jnp.where(first, (t + copies) / share, t)


def _fill_value(struct: Any, kind: str | None, fill: Any) -> Any:
    """What an invalid row holds: `fill`, or an accumulator's identity."""
    if kind is None:
        return fill
    return 0 if kind == "sum" else lowest(struct.dtype, kind)


def _filler(x: Array, kind: str | None, fill: Any) -> Array:
    """A scalar of `x`'s full type holding its invalid rows' value."""
    return full(jax.typeof(x), (), _fill_value(x, kind, fill))
