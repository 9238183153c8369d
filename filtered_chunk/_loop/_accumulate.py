"""Outputs that the loop accumulates over the batch instead of writing it.

A chunk function may mark a batched output as accumulated (`ChunkOutput.reduce`):
a sum (`"sum"`), a running maximum (`"max"`) or minimum (`"min"`) over its rows.
The loop then carries one accumulator of the output's size, never a batch-sized
buffer: each step reduces its chunk's rows along the output's batch axis and
combines them with the accumulator. A row that the overlapping last step
recomputes is counted once: the step's rows before `first_new` are masked out.

A running maximum or minimum has no derivative in the loop (its tangent is zero);
a chunk function that needs one's error or tangent carries it in a sum beside it
(as the staged passes do for `pmax`).
"""

import math
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from .._jax_compat import varying_axes
from .._structs import full, typed


def lowest(dtype: Any, which: str) -> Any:
    """The identity of a running `which` (`"max"` or `"min"`) in `dtype`."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return -np.inf if which == "max" else np.inf
    if jnp.issubdtype(dtype, jnp.bool_):
        return which != "max"
    info = jnp.iinfo(dtype)
    return info.min if which == "max" else info.max


def identity(which: str, struct: Any, axis: int) -> Array:
    """The empty accumulator of rows like `struct` (batched at `axis`)."""
    shape = struct.shape[:axis] + struct.shape[axis + 1 :]
    return full(struct, shape, 0 if which == "sum" else lowest(struct.dtype, which))


def new_rows(
    start: Int[Array, ""] | int, first_new: Int[Array, ""] | int, size: int
) -> Array:
    """Which of a step's `size` rows (from `start`) no earlier step computed."""
    return start + jnp.arange(size) >= first_new


# Rows of at least this many elements are summed by a contraction on CPU (see
# `sum_rows`).
WIDE_ROWS = 2**15


def sum_rows(rows: Array, axis: int) -> Array:
    """`rows` summed along `axis`, in their dtype and weak type.

    On CPU a floating sum of wide rows is a contraction with a vector of ones:
    with XLA's default flags its CPU backend sums over a leading axis in a
    YNNPACK fusion, which turns slow once each row holds 2**15 elements or more
    (the `tanh` of 256 rows of 32,768 float32 elements summed: 27 ms against
    15 ms; of 65,536: 85 ms against 31 ms; of 4,096 or fewer, within 10%
    either way), and every step of a loop that accumulates (`sum_match=True`,
    a `psum` across chunks, the tangent of either) sums its chunk's rows so
    (per-example gradients: `benchmarks/dp_sgd.py`). Narrower rows keep
    `jnp.sum`, which XLA fuses with what computes them, where a contraction
    needs them in memory (the BatchNorm gradient of
    `benchmarks/collectives.py`: 4 MiB more, the same time). Elsewhere, and
    for integers (whose sum wraps around in their dtype), `jnp.sum`."""
    aval = jax.typeof(rows)

    def _sum(x: Array) -> Array:
        return jnp.sum(x, axis=axis, dtype=x.dtype)

    wide = math.prod(aval.shape) >= WIDE_ROWS * max(aval.shape[axis], 1)
    if not (wide and jnp.issubdtype(aval.dtype, jnp.inexact)):
        return _sum(rows)
    # As `jnp.sum`, half-precision floats accumulate in float32.
    small = aval.dtype in (jnp.bfloat16, jnp.float16)

    def _contraction(x: Array) -> Array:
        ones = jnp.ones((x.shape[axis],), x.dtype)
        out = lax.dot_general(
            ones,
            x,
            (((0,), (axis,)), ((), ())),
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32 if small else x.dtype,
        )
        # The type `jnp.sum` gives (a weak type kept), as the other branch's.
        return typed(out, jax.eval_shape(_sum, x))

    return lax.platform_dependent(rows, cpu=_contraction, default=_sum)


def reduce_rows(which: str, rows: Array, axis: int, mask: Array | None) -> Array:
    """`rows` reduced along `axis`, in their dtype, the rows outside `mask` left out."""
    if mask is not None:
        fill = 0 if which == "sum" else lowest(rows.dtype, which)
        shape = [1] * rows.ndim
        shape[axis] = -1
        rows = jnp.where(mask.reshape(shape), rows, jnp.asarray(fill, rows.dtype))
    if which == "sum":
        # In the rows' dtype: `jnp.sum` promotes small integers, XLA's `psum`
        # wraps around in them. A weak type is kept (`typed` by the caller).
        out = sum_rows(rows, axis)
    else:
        out = getattr(jnp, which)(rows, axis=axis)
    return typed(out, jax.typeof(rows))


def combine(which: str, acc: Array, part: Array) -> Array:
    """`acc` with one more step's reduced rows."""
    if which == "sum":
        out = acc + part
    else:
        out = getattr(jnp, f"{which}imum")(acc, part)
    return typed(out, jax.typeof(acc))


def zeros_like(x: Array) -> Array:
    """Zeros of `x`'s shape and dtype, strongly typed, varying like it."""
    varying = varying_axes(jax.typeof(x))
    out = jnp.zeros(x.shape, x.dtype)
    return lax.pcast(out, varying, to="varying") if varying else out
