"""A call on the valid elements of a batch only ([`Chunked.valid`][]): a traced
count of them (the first `count`), or a traced mask (packed to the front in a
stable order, then written back).

The plan wraps `filter_chunked_vmap`'s or `filter_chunked_apply`'s: its batch,
gated by the count (`_gate.py`), runs every count and every mask of the same
shapes in one compiled program.
"""

from typing import Any

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding
from jaxtyping import Array, PyTree

from ._batch import run_batch
from ._custom_types import ChunkOutput, InputArray
from ._gate import gated, unpadded
from ._mesh import BatchSharding, leaf_sharding
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
        gate = gated(batch, count, self.fill, bound.sharding)
        out = run_batch(gate, chunk_size, options, bound.sharding)
        out = unpadded(out, batch.size, bound.sharding)
        if order is not None:
            out = _written_back(out, jnp.argsort(order), bound.sharding)
        return self.inner.finish(out)


def check_valid(count: Any, mask: Any, fill: Any, api: str) -> tuple[Any, Any, Any]:
    """`count` and `mask` as arrays and `fill` as a Python scalar, or the error
    for bad ones (before any work)."""
    if (count is None) == (mask is None):
        raise TypeError(f"`{api}` takes exactly one of `count=` and `mask=`.")
    if not isinstance(fill, FILL_TYPES + (np.generic,)):
        raise TypeError(
            f"`{api}(fill=...)` must be a Python or NumPy scalar, got "
            f"{type(fill).__name__} object {fill!r}."
        )
    if isinstance(fill, np.generic):
        # Its value, converted to each output's dtype as it would be: a NumPy
        # scalar is an array to Equinox, which warns when one is made static.
        fill = fill.item()
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
        # (and, not traced, without an operation of its own to compile): first
        # saturated to that type's range, as the count is clipped, where a
        # conversion would wrap a count of 2**31 or more around.
        top = min(np.iinfo(array.dtype).max, np.iinfo(np.int32).max)
        if isinstance(array, Tracer):
            array = jnp.clip(array, 0, top)  # in its own type: both bounds fit
            return lax.convert_element_type(array, jnp.int32), None, fill
        return jnp.asarray(np.clip(array, 0, top).astype(np.int32)), None, fill
    if array.ndim != 1 or array.dtype != jnp.bool_:
        raise TypeError(
            f"`{api}(mask=...)` must be a boolean vector, got "
            f"{array.dtype}{list(array.shape)}."
        )
    return None, jnp.asarray(array), fill


def _take(
    x: InputArray, index: Array, axis: int, sharding: BatchSharding | None
) -> Array:
    """`x` reordered along `axis`, split over the batch's devices as it was."""
    current = leaf_sharding(x)
    if current is not None and current.mesh.explicit_axes:
        where = (slice(None),) * axis + (index,)
        return jnp.asarray(x).at[where].get(out_sharding=current)
    out = jnp.take(x, index, axis=axis)
    if sharding is None or sharding.mesh.explicit_axes:
        return out  # not split, or split by `run_sharded` (explicit mode)
    if out.shape[axis] % sharding.num_devices:
        return out  # the devices do not divide it: padded by `gated`
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
