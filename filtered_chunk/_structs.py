"""Abstract leaves and typed fills: one home for turning a leaf into a
`jax.ShapeDtypeStruct`, and a struct back into an array of its full type."""

from typing import Any

import jax
import jax.core
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from ._jax_compat import varying_axes, with_weak_type


def struct(
    x: Any,
    axis: int | None = None,
    size: int | None = None,
    *,
    weak: bool = True,
    sharding: Any = None,
) -> jax.ShapeDtypeStruct:
    """`x`'s shape and dtype (an array, a tracer, a struct or a Python scalar),
    with its weak type unless `weak=False`; its dimension `axis`, if given, is of
    `size` elements, or removed with `size=None`."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    shape = list(aval.shape)
    if axis is not None:
        if size is None:
            del shape[axis]
        else:
            shape[axis] = size
    weak_type = weak and aval.weak_type
    return jax.ShapeDtypeStruct(
        tuple(shape), aval.dtype, weak_type=weak_type, sharding=sharding
    )


def inexact(x: Any) -> bool:
    """Whether `x` (an array or a struct) has a floating or complex dtype."""
    return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def typed(x: Array, aval: Any) -> Array:
    """`x` with `aval`'s dtype and weak type."""
    if x.dtype == aval.dtype and jax.typeof(x).weak_type == aval.weak_type:
        return x
    return with_weak_type(lax.convert_element_type(x, aval.dtype), aval.weak_type)


def element_struct(axis: int, x: Any) -> jax.ShapeDtypeStruct:
    """One element of the mapped leaf `x` (batched at `axis`)."""
    return struct(x, axis)


def full(like: Any, shape: tuple[int, ...], fill: Any = 0) -> Array:
    """An array of `shape` filled with `fill`, of `like`'s full type: dtype, weak
    type, explicit sharding and varying manual axes.

    A scan carry must keep its type: a buffer that a chunk is written into must be
    typed like the chunk (sharded like it in explicit-sharding mode, varying over
    the same mesh axes inside `shard_map`).
    """
    if getattr(like, "weak_type", False):
        # A weak type only exists for the default dtypes: a Python scalar gives it.
        out = lax.full(shape, like.dtype.type(fill).item())
    else:
        sharding = getattr(like, "sharding", None)
        if any(entry is not None for entry in getattr(sharding, "spec", ())):
            out = jnp.full(shape, fill, like.dtype, out_sharding=sharding)
        else:
            out = jnp.full(shape, fill, like.dtype)
    varying = varying_axes(like)
    return lax.pcast(out, varying, to="varying") if varying else out
