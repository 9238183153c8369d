"""The schedule of the loop over chunks: which rows each step computes.

A loop of `num_steps` steps of `chunk_size` rows: step `i` starts at
`i * chunk_size`, the last clamped to end at the batch's end (an overlapping
chunk, with `remainder="overlap"`) when `num_steps` exceeds the number of whole
chunks. [`Schedule`][] is what the loop, its derivative rule, the accumulators and
the progress reports read: its starts, the first new row of a step, the split of a
tangent into a stack of chunks and its inverse.
"""

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Int, PyTree

from .._custom_types import CheckpointSpec, InputArray
from .._reporting import Reporter
from ._accumulate import sum_rows
from ._weak_types import fork, join


# `write(buffers, chunk, start, first_new)`: the step's chunk (at `start`) written
# into the buffers and folded into the accumulators, whose rows before `first_new`
# an earlier step counted (`None`: none).
WriteFn = Callable[[list[Array], list[Array], Any, Any], list[Array]]


def balanced_chunk_size(batch_size: int, chunk_size: int) -> int:
    """The chunk size `remainder="overlap"` runs at: the same number of steps,
    `ceil(batch_size / chunk_size)`, with chunks as even as possible.

    The last step starts at `batch_size - size`, so it recomputes
    `num_steps * size - batch_size < num_steps` elements, rather than up to
    `chunk_size - 1` (for a batch of 512 in chunks of 100: 4 instead of 88, which
    cost 17% more time). The chunks are never larger than `chunk_size`.
    """
    num_steps = -(-batch_size // chunk_size)
    return -(-batch_size // num_steps)


class Steps(NamedTuple):
    """A loop's steps, in Python numbers, as the loop, the progress reports and
    the budget search read them: `num_steps` steps of `chunk_size` rows (with
    `remainder="overlap"` the balanced size, the last step ending at the batch's
    end), then, with `"separate"`, `leftover` rows in a step of their own."""

    batch_size: int
    chunk_size: int
    num_steps: int
    leftover: int

    @classmethod
    def of(cls, batch_size: int, chunk_size: int, remainder: str) -> "Steps":
        if remainder == "overlap":
            size = balanced_chunk_size(batch_size, chunk_size)
            return cls(batch_size, size, -(-batch_size // size), 0)
        num_steps, leftover = divmod(batch_size, chunk_size)
        return cls(batch_size, chunk_size, num_steps, leftover)

    @property
    def covered(self) -> int:
        """The rows the loop's steps compute (all but a separate leftover)."""
        return self.batch_size - self.leftover


class Schedule(eqx.Module):
    """The schedule of one loop (see the module's docstring)."""

    in_axes: Any = eqx.field(static=True)
    axes: tuple[int, ...] = eqx.field(static=True)
    batch_size: int = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)
    num_steps: int = eqx.field(static=True)
    checkpoint: CheckpointSpec = eqx.field(static=True)
    write: WriteFn = eqx.field(static=True)
    reporter: Reporter | None = eqx.field(static=True, default=None)
    # Per output: written (`None`) or accumulated (`_accumulate.py`).
    kinds: tuple[str | None, ...] = eqx.field(static=True, default=())
    # Positions, among the leaves of the inputs, of those the loop relays: returns
    # to a later loop that reads them again (`Chain.relay`).
    relay: tuple[int, ...] = eqx.field(static=True, default=())
    # Positions, among the outputs, of written ones whose tangents ride carries
    # (`Chain.carried`).
    carried: tuple[int, ...] = eqx.field(static=True, default=())

    @property
    def num_whole(self) -> int:
        return min(self.num_steps, self.batch_size // self.chunk_size)

    @property
    def overlaps(self) -> bool:
        """Whether the last step recomputes rows that the one before computed."""
        return self.num_steps > self.num_whole

    def first_new(self, start: Int[Array, ""]) -> Int[Array, ""] | None:
        """The first row of the step at `start` that no earlier step computed:
        `start` itself, but for an overlapping last step."""
        if not self.overlaps:
            return None
        last = self.batch_size - self.chunk_size
        return jnp.where(start == last, self.num_whole * self.chunk_size, start)

    def row_sum(self, t: Any, axis: int, start: Int[Array, ""]) -> Array:
        """The tangent of a step's accumulated sum from its rows' tangents `t`.

        Each copy of a row that two steps compute (the overlap of the last step)
        weighs half, so that its cotangent is split as the written outputs' is
        (`merge`): keeping one copy would give the other a zero cotangent, and
        `0 * inf` turns an infinite derivative into `nan`.
        """
        if self.overlaps:
            rows = start + jnp.arange(self.chunk_size)
            first = self.batch_size - self.chunk_size  # where the last step starts
            twice = (rows >= first) & (rows < self.num_whole * self.chunk_size)
            w = jnp.where(twice, 0.5, 1.0)
            shape = [1] * t.ndim
            shape[axis] = -1
            t = t * w.reshape(shape).astype(t.dtype)
        return sum_rows(t, axis)

    def starts(self) -> Int[Array, " num_steps"]:
        last = self.batch_size - self.chunk_size
        return jnp.minimum(jnp.arange(self.num_steps) * self.chunk_size, last)

    def slice(self, inputs: PyTree[InputArray], start: Int[Array, ""]) -> PyTree[Array]:
        def _slice(axis: int, x: InputArray) -> Array:
            # `start` is never negative: skip JAX's wrap-around of negative indices.
            return lax.dynamic_slice_in_dim(
                x, start, self.chunk_size, axis=axis, allow_negative_indices=False
            )

        return jtu.tree_map(_slice, self.in_axes, inputs)

    def split(self, x: InputArray, axis: int) -> Array:
        """The chunk of `x` that each step reads, stacked on a new leading axis."""
        whole = self.num_whole * self.chunk_size
        shape = x.shape[:axis] + (self.num_whole, self.chunk_size) + x.shape[axis + 1 :]
        stack = jnp.moveaxis(
            lax.slice_in_dim(x, 0, whole, axis=axis).reshape(shape), axis, 0
        )
        if self.num_steps == self.num_whole:
            return stack
        last = lax.slice_in_dim(x, self.batch_size - self.chunk_size, None, axis=axis)
        return jnp.concatenate([stack, last[None]])

    def without_overlap(self) -> "Schedule":
        """The loop of whole chunks alone."""
        return dataclasses.replace(self, num_steps=self.num_whole)

    def leftover(self) -> "Schedule":
        """The one step over the rows that no whole chunk covers."""
        covered = self.num_whole * self.chunk_size
        return dataclasses.replace(
            self, chunk_size=self.batch_size - covered, num_steps=1
        )

    def merge(self, stack: Array, axis: int, rest: InputArray | None = None) -> Array:
        """Inverse of `split` for output tangents; rows that no step writes are
        `rest` (the leftover's rows, evaluated apart) or zero (a separate
        remainder).

        A row that two steps compute (the overlap of the last step) is the mean
        of its two copies. Both are the same computation on the same values, so
        the tangent is unchanged (`0.5 * t + 0.5 * t == t`), and the transpose
        gives each copy half the cotangent. Keeping one copy instead would give
        the other a zero cotangent, and `0 * inf` turns an infinite derivative
        (`jnp.sqrt` at zero) into `nan` where `jax.vmap` gives `inf`.
        """
        whole = jnp.moveaxis(stack[: self.num_whole], 0, axis)
        shape = whole.shape[:axis] + (-1,) + whole.shape[axis + 2 :]
        rows = whole.reshape(shape)
        covered = self.num_whole * self.chunk_size
        parts = [rows]
        if self.num_steps > self.num_whole:
            first = self.batch_size - self.chunk_size  # where the last step starts
            last = stack[-1]
            overlap = covered - first
            mean = 0.5 * lax.slice_in_dim(rows, first, None, axis=axis)
            mean = mean + 0.5 * lax.slice_in_dim(last, 0, overlap, axis=axis)
            parts = [lax.slice_in_dim(rows, 0, first, axis=axis), mean]
            parts.append(lax.slice_in_dim(last, overlap, None, axis=axis))
            covered = self.batch_size
        if covered < self.batch_size:
            if rest is None:
                shape = list(rows.shape)
                shape[axis] = self.batch_size - covered
                rest = jnp.zeros(shape, stack.dtype)
            parts.append(jnp.asarray(rest))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis)


@ft.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _slice_rest(x: InputArray, start: int, size: int, axis: int) -> Array:
    return lax.slice_in_dim(x, start, start + size, axis=axis)


@_slice_rest.defjvp
def _slice_rest_jvp(
    start: int,
    size: int,
    axis: int,
    primals: tuple[InputArray],
    tangents: tuple[InputArray],
) -> tuple[Array, InputArray]:
    (x,), (t,) = primals, tangents
    t, (probe,) = fork(t, [(0,)])
    rest = join(_slice_rest(t, start, size, axis), probe)
    return _slice_rest(x, start, size, axis), rest


def slice_rest(x: InputArray, start: int, size: int, axis: int) -> Array:
    """`size` elements of `x` from `start` along `axis`, whose cotangent has the
    weak type of the remainder's (`_weak_types.py`): the remainder that
    `remainder="separate"` slices off before its own loop."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return _slice_rest(x, start, size, axis)
    return lax.slice_in_dim(x, start, start + size, axis=axis)
