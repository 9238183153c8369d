"""The values that a pass's variances are summed about (this folder's
`README.md`, "A variance in its mean's pass")."""

from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._mesh import BatchSharding
from .._sharding import across
from .._structs import typed
from ._element import element_fn, positions as _positions
from ._passes import strong
from ._plan import Plan, SHIFT


# At most this many elements, spread evenly over the batch, give a variance's
# shift: each is evaluated once more (up to its level, from the inputs when the
# boundaries are not kept).
SAMPLE = 256


def shifts(
    plan: Plan,
    level: int,
    fixed: list[Any],
    results: dict[int, list[Array]],
    inputs: tuple[list[Array], list[int]],
    chunk_size: int,
    shard: BatchSharding | None,
) -> dict[Any, Array]:
    """The values that the variances of the level's pass are summed about
    (`_moments.py`), by the variable of their mean: each mean's operand averaged
    over a sample of this device's elements (of `inputs`, the mapped leaves of
    the stage `(SHIFT, level)` and their axes) and over the devices, without
    derivatives.

    The sample is `SAMPLE` elements (nor more than a chunk) at an even stride,
    so that a sorted batch's sample is like the whole; a whole chunk is more
    work at a budget's large chunks (the L = 8 BatchNorm MLP's gradient at a
    quarter of `jax.vmap`'s memory: 2.26x `jax.vmap`'s time, 2.18x with 256,
    medians of five same-round pairs; 1.25x either way at its full memory). It is
    evaluated in a loop of two steps of half as many (a `lax.while_loop`, so
    that a program's `lax.scan`s are its passes): XLA gives a loop's body
    memory that the other loops reuse, where the same work outside any loop
    kept its working set beside theirs (measured on CPU: a first chunk of 1,024
    elements added 1 MiB to the BatchNorm MLP of `benchmarks/collectives.py`, a
    third of its memory).
    """
    positions = _positions(plan, shard)
    local = positions.shape[0]
    size = min(SAMPLE, chunk_size, local)
    steps = 2 if size >= 2 else 1
    size -= size % steps
    stride = local // size
    leaves, axes = inputs
    stopped = lambda x: lax.stop_gradient(x) if isinstance(x, jax.Array) else x  # noqa: E731
    fixed, results, leaves = jax.tree.map(stopped, (fixed, results, leaves))
    element = element_fn(plan, (SHIFT, level), fixed, results)

    def _step(step: Array, total: list[Array]) -> list[Array]:
        index = (step * (size // steps) + jnp.arange(size // steps)) * stride
        part = [jnp.take(x, index, axis=a) for x, a in zip(leaves, axes, strict=True)]
        rows = jax.vmap(element, in_axes=(axes, 0))(part, positions[index])
        return [t + jnp.sum(strong(x), axis=0) for t, x in zip(total, rows)]

    # The stage's targets: the operand of each moment's mean.
    operands = plan.targets[(SHIFT, level)]
    init = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in operands]
    # A `while` (not a `scan`, which the passes are), with no derivative: the
    # shift is a constant of the pass.
    _, totals = lax.while_loop(
        lambda c: c[0] < steps, lambda c: (c[0] + 1, _step(*c)), (jnp.array(0), init)
    )
    shifts = {}
    for moment, total in zip(plan.moments[level], totals, strict=True):
        shift = total / size
        if shard is not None:
            shift = across("sum", shift, shard.axis_names) / shard.num_devices
        shifts[moment.m] = typed(shift.astype(total.dtype), moment.m.aval)
    return shifts


def shifted_means(plan: Plan, level: int) -> dict[int, Any]:
    """The position among the level's operands of the mean of each variance that
    the level's pass computes beside it, and the mean's variable (which keys its
    shift)."""
    starts = plan.operand_starts(plan.at_level(level))
    return {starts[moment.mean]: moment.m for moment in plan.moments.get(level, [])}
