"""A call on the valid elements of a batch only ([`Chunked.valid`][]): a traced
count of them (the first `count`), or a traced mask (packed to the front in a
stable order, then written back).

The plan wraps `filter_chunked_vmap`'s. Its batch gains one mapped input, each
element's position, and closes over the count; each chunk's function
(`_gated`) then

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

The number of steps is the padded batch's, so every count and every mask of the
same shapes runs one compiled program.
"""

import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding
from jaxtyping import Array, PyTree

from ._batch import Batch, run_batch
from ._custom_types import ChunkOutput, InputArray
from ._loop._accumulate import lowest
from ._sharding import BatchSharding, leaf_sharding
from ._structs import full
from ._wrapper import AbstractPlan, Bound, ChunkOptions, Fun


FILL_TYPES = (bool, int, float, complex)


class ValidPlan(AbstractPlan):
    """`inner`'s plan on the valid elements only."""

    inner: Any  # `filter_chunked_vmap`'s or `filter_chunked_apply`'s plan
    count: Any  # an integer scalar, or `None`
    mask: Any  # a boolean vector of the batch's size, or `None`
    fill: Any = eqx.field(static=True, default=0)

    def bind(self, fun: Fun, options: ChunkOptions, args: Any, kwargs: Any) -> Bound:
        bound = self.inner.bind(fun, options, args, kwargs)
        api = f"{options.api}(...).valid"
        if options.axis_name is not None:
            raise ValueError(
                f"`{api}` does not take collectives yet: the transform was given "
                f"`axis_name={options.axis_name!r}`. Call it without `valid`, or "
                "compute the collective outside the map."
            )
        if bound.batch_size is None:
            raise ValueError(
                f"`{api}` needs a batch: nothing is mapped and no `axis_size` was "
                "given."
            )
        if self.mask is not None and jnp.shape(self.mask) != (bound.batch_size,):
            raise ValueError(
                f"`{api}(mask=...)` must have the batch's shape "
                f"({bound.batch_size},), got shape {jnp.shape(self.mask)}."
            )
        valid = (self.count, self.mask)
        return bound._replace(tree=(bound.tree, valid), in_axes=(bound.in_axes, None))

    def evaluate(
        self, fun: Fun, options: ChunkOptions, bound: Bound, chunk_size: int | None
    ) -> Any:
        tree, (count, mask) = bound.tree
        inner = bound._replace(tree=tree, in_axes=bound.in_axes[0])
        batch = self.inner.batch(fun, options, inner)
        order = None
        if mask is not None:
            # Valid elements first, in their order (`argsort` is stable).
            order = jnp.argsort(jnp.logical_not(mask), stable=True)
            count = jnp.sum(mask, dtype=int)
            mapped = _taken(batch.in_axes, batch.mapped, order, bound.sharding)
            batch = batch._replace(mapped=mapped)
        out = run_batch(
            gated(batch, count, self.fill, bound.sharding),
            chunk_size,
            options,
            bound.sharding,
        )
        if order is not None:
            out = _written_back(out, jnp.argsort(order), bound.sharding)
        return self.inner.finish(out)


def check_valid(count: Any, mask: Any, fill: Any, api: str) -> tuple[Any, Any]:
    """`count` and `mask` as arrays, or the error for bad ones (before any work)."""
    if (count is None) == (mask is None):
        raise TypeError(f"`{api}` takes exactly one of `count=` and `mask=`.")
    if not isinstance(fill, FILL_TYPES + (np.generic,)):
        raise TypeError(
            f"`{api}(fill=...)` must be a Python or NumPy scalar, got "
            f"{type(fill).__name__} object {fill!r}."
        )
    name, value = ("count", count) if mask is None else ("mask", mask)
    try:
        # Not traced, a NumPy array: converting it is no operation to compile.
        array = value if isinstance(value, Tracer) else np.asarray(value)
    except TypeError:
        raise TypeError(
            f"`{api}({name}=...)` must be an array, got {type(value).__name__} "
            f"object {value!r}."
        ) from None
    if mask is None:
        if array.shape != () or not jnp.issubdtype(array.dtype, jnp.integer):
            raise TypeError(
                f"`{api}(count=...)` must be an integer scalar, got "
                f"{array.dtype}{list(array.shape)}."
            )
        # One type, so that every integer type and weak type shares a program
        # (and, not traced, without an operation of its own to compile).
        if isinstance(array, Tracer):
            return lax.convert_element_type(array, jnp.int32), None
        return jnp.asarray(array.astype(np.int32)), None
    if array.ndim != 1 or array.dtype != jnp.bool_:
        raise TypeError(
            f"`{api}(mask=...)` must be a boolean vector, got "
            f"{array.dtype}{list(array.shape)}."
        )
    return None, jnp.asarray(array)


def gated(batch: Batch, count: Any, fill: Any, sharding: BatchSharding | None) -> Batch:
    """`batch` on its first `count` elements only: see the module's docstring."""
    positions = jnp.arange(batch.size)
    if sharding is not None:
        # Split like the batch, as `shard_map` takes a mapped input.
        split = NamedSharding(sharding.mesh, sharding.spec(0))
        positions = jax.device_put(positions, split)
    count = jnp.clip(count, 0, batch.size).astype(positions.dtype)
    chunk = _Gated(batch.chunk, batch.in_axes, fill)
    check = None if batch.check is None else ft.partial(_checked, batch.check)
    return Batch(
        chunk,
        (batch.closed, count),
        (batch.mapped, positions),
        (batch.in_axes, 0),
        batch.size,
        check=check,
        sum_match=batch.sum_match,
        check_vma=False,
    )


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
        every = jnp.all(valid)

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
            leaves, unbatched = _as_arrays(fn(safe))
            leaves = [
                jnp.where(
                    _along(valid, a, x.ndim),
                    _spread(x, valid, a) if _inexact(x) else x,
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
                _, unbatched = _as_arrays(fn(safe))
            leaves = [
                full(s, s.shape, _fill_value(s, k, self.fill))
                for s, k in zip(structs, layout[1], strict=True)
            ]
            return leaves, unbatched

        leaves, unbatched = lax.cond(jnp.any(valid), _run, _skip)
        batched = jtu.tree_unflatten(jtu.tree_structure(shapes.batched), leaves)
        return shapes._replace(batched=batched, unbatched=unbatched)


def _copied(x: InputArray, axis: int, valid: Array) -> Array:
    """`x`'s chunk with each invalid element replaced by its first element,
    which is valid if any is. Else zeros: only an outer `vmap` whose count
    differs between its elements computes such a chunk, and drops its outputs."""
    if not valid.shape[0]:
        return jnp.asarray(x)
    lane = lax.slice_in_dim(x, 0, 1, axis=axis)
    lane = jnp.where(valid[0], lane, lax.stop_gradient(jnp.zeros_like(lane)))
    return jnp.where(_along(valid, axis, x.ndim), x, lane)


def _inexact(x: Array) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.inexact))


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


def _as_arrays(tree: Any) -> Any:
    """Every leaf an array (a replayed jaxpr returns a constant as a scalar)."""
    return jtu.tree_map(
        lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), tree
    )


def _fill_value(struct: Any, kind: str | None, fill: Any) -> Any:
    """What an invalid row holds: `fill`, or an accumulator's identity."""
    if kind is None:
        return fill
    return 0 if kind == "sum" else lowest(struct.dtype, kind)


def _filler(x: Array, kind: str | None, fill: Any) -> Array:
    """A scalar of `x`'s full type holding its invalid rows' value."""
    return full(jax.typeof(x), (), _fill_value(x, kind, fill))


def _take(
    x: InputArray, index: Array, axis: int, sharding: BatchSharding | None
) -> Array:
    """`x` reordered along `axis`, split over the batch's devices as it was."""
    current = leaf_sharding(x)
    if current is not None and current.mesh.explicit_axes:
        where = (slice(None),) * axis + (index,)
        return jnp.asarray(x).at[where].get(out_sharding=current)
    out = jnp.take(x, index, axis=axis)
    if sharding is None:
        return out
    split = NamedSharding(sharding.mesh, sharding.spec(axis))
    return lax.with_sharding_constraint(out, split)


def _taken(
    in_axes: PyTree[int | None],
    mapped: Any,
    order: Array,
    sharding: BatchSharding | None,
) -> Any:
    """The mapped inputs reordered along their axes."""
    return jtu.tree_map(
        lambda axis, x: _take(x, order, axis, sharding), in_axes, mapped
    )


def _written_back(
    out: ChunkOutput, inverse: Array, sharding: BatchSharding | None
) -> ChunkOutput:
    """The packed outputs back at their elements' positions."""
    leaves, treedef = jtu.tree_flatten(out.batched)
    leaves = [
        x if k is not None else _take(x, inverse, a, sharding)
        for x, a, k in zip(leaves, out.batched_axes, out.kinds(), strict=True)
    ]
    return out._replace(batched=jtu.tree_unflatten(treedef, leaves))
