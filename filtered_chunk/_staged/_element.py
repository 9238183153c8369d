"""One element's stage of the staged program: what each pass's, the variances'
shifts' and the derivatives' chunk functions `jax.vmap` over."""

from collections.abc import Callable
from typing import Any

import jax.extend.core as jex
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._mesh import BatchSharding
from .._structs import typed
from ._analysis import axis_names
from ._passes import read, unstaged
from ._plan import Plan
from ._program import bind


def evaluate(
    plan: Plan,
    stage: Any,
    args: list[Any],
    results: dict[int, list[Array]],
    position: Any,
    kept: list[Array],
    shifts: dict[Any, Array],
) -> list[Any]:
    """Stage `stage` of the program for one element (at `position` in the batch,
    with `kept` its rows of the buffers the stage reads, and `shifts` the values
    that its variances are summed about): its targets, then the values it writes
    for later stages."""
    program = plan.program
    jaxpr, axis_name = program.jaxpr, program.axis_name
    env = dict(zip(list(jaxpr.constvars) + list(jaxpr.invars), args, strict=True))
    env |= shifts
    # A buffer holds the value's dtype; its weak type is the program's.
    env |= {v: typed(x, v.aval) for v, x in zip(plan.reads[stage], kept, strict=True)}
    get = lambda v: v.val if isinstance(v, jex.Literal) else env[v]  # noqa: E731
    for i in plan.equations[stage]:
        eqn = jaxpr.eqns[i]
        if i in plan.levels:
            out = read(eqn, results[i], position)
        elif axis_name in axis_names(eqn.params):
            invals = [get(v) for v in eqn.invars]
            out = unstaged(eqn, invals, position, axis_name, program.batch_size)
        else:
            out = bind(eqn, [get(v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, out, strict=True):
            env[v] = x
    # A literal output (a constant) gets its type from the jaxpr, weak or not.
    targets = [
        typed(jnp.asarray(v.val), v.aval) if isinstance(v, jex.Literal) else env[v]
        for v in plan.targets[stage]
    ]
    return targets + [env[v] for v in plan.writes[stage]]


def with_mapped(plan: Plan, fixed: list[Any], mapped: list[Any]) -> list[Any]:
    """The program's arguments: `fixed` is its consts then its unmapped inputs."""
    k = len(plan.program.consts)
    return fixed[:k] + list(mapped) + fixed[k:]


def element_fn(
    plan: Plan,
    stage: Any,
    fixed: list[Any],
    results: dict[int, list[Array]],
    shifts: dict[Any, Array] | None = None,
) -> Callable[[list[Array], Array], list[Any]]:
    """`evaluate` of `stage` for one element of the stage's loop's inputs."""
    num_mapped = plan.program.num_mapped_in
    shifts = shifts or {}

    def _element(_mapped: list[Array], _position: Array) -> list[Any]:
        _args = with_mapped(plan, fixed, _mapped[:num_mapped])
        kept = _mapped[num_mapped:]
        return evaluate(plan, stage, _args, results, _position, kept, shifts)

    return _element


def positions(plan: Plan, shard: BatchSharding | None) -> Array:
    """The positions in the whole batch of this device's elements."""
    num_devices = 1 if shard is None else shard.num_devices
    positions = jnp.arange(plan.program.batch_size // num_devices)
    if shard is not None:  # this device's elements follow those of the ones before
        device = lax.axis_index(shard.axis_names).astype(positions.dtype)
        positions = positions + device * positions.shape[0]
    return positions
