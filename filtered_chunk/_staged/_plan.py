"""Staged collectives, part 2: which pass computes what.

Given the flat per-element program (`_program.py`), [`make_plan`][] gives
each collective over the mapped axis its level, and each stage the equations it
must evaluate: stage `s <= num_passes` computes the operands of the level-`s`
collectives, reading the results of lower levels; the final stage computes every
output, mapped or not (`out_axes=None`).

With `keep=1`, the stage boundaries are kept: a stage reads, from batch-sized
buffers that earlier passes wrote, every per-element value they computed that it
needs, instead of recomputing it, so that no equation of the program runs twice
for an element. Each pass then writes the values that later stages read of it.
With `keep=n`, only every `n`-th pass keeps what it computed (passes `n`, `2n`,
...; none if `n` is beyond the number of passes): the passes between recompute
from the latest kept values, with fewer buffers.
"""

import dataclasses
import functools as ft
from collections.abc import Collection, Iterator
from typing import Any

import jax.extend.core as jex

from .._jaxprs import subjaxprs
from .._structs import inexact, struct
from ._analysis import axis_names, in_derivatives
from ._moments import find_moments, Moment
from ._program import bind, CUSTOM, Program, varying_outputs


# Collectives that each element reads its own part of: always a pass, whose
# per-element values (broadcast when they do not vary) fill a batch-sized buffer.
_PER_ELEMENT = ("ppermute", "all_to_all", "reduce_scatter")
FINAL = "final"
# The stage `(SHIFT, s)` computes, for a sample of the batch, the operands of the
# means whose variances pass `s` computes too (`_moments.py`): their shifts.
SHIFT = "shift"


@dataclasses.dataclass(frozen=True)
class Plan:
    program: Program
    # Equation index -> level, for the collectives that take a pass.
    levels: dict[int, int]
    num_passes: int
    # Stage (1..num_passes, FINAL) -> the equations it evaluates, in order, and the
    # variables it returns.
    equations: dict[Any, list[int]]
    targets: dict[Any, list[Any]]
    # Stage -> the per-element values it reads from buffers that earlier passes
    # wrote (kept boundaries), and those it writes for later stages; empty unless
    # the plan keeps its boundaries.
    reads: dict[Any, list[Any]]
    writes: dict[Any, list[Any]]
    # The values with a derivative: those that depend on an inexact input other
    # than through `lax.stop_gradient`.
    differentiable: frozenset[Any]
    # Level -> the variances that its pass computes beside their means, about a
    # shift (`_moments.py`); the stage `(SHIFT, level)` computes the shifts.
    moments: dict[int, list[Moment]] = dataclasses.field(default_factory=dict)

    def has_derivative(self, v: Any) -> bool:
        """Whether the variable or literal `v` has a derivative (a literal, such
        as a constant cotangent under `jax.grad`, has none)."""
        return _is_var(v) and v in self.differentiable

    def operand_starts(self, ids: list[int]) -> dict[int, int]:
        """The position of each of the collectives `ids`' first operand among
        all their operands, in the order of `ids`."""
        eqns, starts, position = self.program.jaxpr.eqns, {}, 0
        for i in ids:
            starts[i] = position
            position += len(eqns[i].invars)
        return starts

    def at_level(self, level: int) -> list[int]:
        return [i for i, lv in self.levels.items() if lv == level]


def _is_var(v: Any) -> bool:
    return not isinstance(v, jex.Literal)


def make_plan(program: Program, keep: int = 0) -> Plan:
    """The plan of `program`: each collective's level, and for each stage (each
    pass, each variance's shift, the final loop) the equations it evaluates and
    the kept values it reads and writes; the values that every `keep`-th pass
    computes are kept (`0`: none)."""
    jaxpr, axis_name = program.jaxpr, program.axis_name
    invars = list(jaxpr.constvars) + list(jaxpr.invars)
    levels, moments, var = _levels(program)
    num_passes = max(levels.values(), default=0)
    targets: dict[Any, list[Any]] = {}
    for s in range(1, num_passes + 1):
        targets[s] = [v for i in levels if levels[i] == s for v in jaxpr.eqns[i].invars]
    # Every output, the unmapped ones too: `jax.vmap` in the final loop tells
    # whether those vary (`_staged._final`).
    targets[FINAL] = list(jaxpr.outvars)
    equations: dict[Any, list[int]] = {}
    reads: dict[Any, list[Any]] = {}
    writes: dict[Any, list[Any]] = {s: [] for s in targets}
    # A kept value -> the stage that computed it first (and writes it).
    kept: dict[Any, Any] = {}

    def _written(read: list[Any]) -> None:
        # Each kept value that a stage reads is written by the stage that kept it.
        for v in read:
            if v not in writes[kept[v]]:
                writes[kept[v]].append(v)

    for stage, roots in list(targets.items()):
        upto = num_passes + 1 if stage == FINAL else stage
        shifted = moments.get(upto, []) if stage != FINAL else []
        given = {moment.m for moment in shifted}
        if given:  # the means of the shifts' sample, before the pass
            probe = (SHIFT, stage)
            targets[probe] = [
                v for moment in shifted for v in jaxpr.eqns[moment.mean].invars
            ]
            equations[probe], reads[probe] = _stage_equations(
                jaxpr.eqns, targets[probe], upto, levels, False, kept.keys()
            )
            writes[probe] = []
            _written(reads[probe])
        order, read = _stage_equations(
            jaxpr.eqns, roots, upto, levels, stage == FINAL, kept.keys(), given
        )
        equations[stage], reads[stage] = order, read
        _written(read)
        if keep and stage != FINAL and stage % keep == 0:
            _keep(jaxpr, axis_name, order, given, var, kept, stage)
    return Plan(
        program,
        levels,
        num_passes,
        equations,
        targets,
        reads,
        writes,
        differentiable(jaxpr, invars),
        moments,
    )


def _levels(
    program: Program,
) -> tuple[dict[int, int], dict[int, list[Moment]], dict[Any, bool]]:
    """Each collective's level (by equation), the variances computed in their
    means' passes (by level), and whether each value of the program varies
    over the batch."""
    jaxpr, axis_name = program.jaxpr, program.axis_name
    invars = list(jaxpr.constvars) + list(jaxpr.invars)
    first = len(program.consts)
    level = {v: 0 for v in invars}
    var = {v: first <= i < first + program.num_mapped_in for i, v in enumerate(invars)}
    levels: dict[int, int] = {}
    found = find_moments(jaxpr, axis_name, program.batch_size)
    moments: dict[int, list[Moment]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        in_var = [_is_var(v) and var[v] for v in eqn.invars]
        lv = max((level[v] for v in eqn.invars if _is_var(v)), default=0)
        name = eqn.primitive.name
        if axis_name in axis_names(eqn.params) and name != "axis_index":
            if i in found and found[i].mean in levels and any(in_var):
                # A variance about its mean: in the mean's pass.
                lv = levels[found[i].mean]
                levels[i] = lv
                moments.setdefault(lv, []).append(found[i])
            elif any(in_var) or name in _PER_ELEMENT:
                lv += 1
                levels[i] = lv
        out_var = varying_outputs(eqn, in_var, axis_name)
        for v, b in zip(eqn.outvars, out_var, strict=True):
            level[v], var[v] = lv, b
    return levels, moments, var


def _keep(
    jaxpr: Any,
    axis_name: Any,
    order: list[int],
    given: set[Any],
    var: dict[Any, bool],
    kept: dict[Any, Any],
    stage: int,
) -> None:
    """Adds to `kept` each value that the equations `order` of a stage compute
    and that varies over the batch, kept by `stage`, but for a collective's
    result (given, or cheap) and what the pass computes about a shift (the
    values derived from `given`), which is not the program's value."""
    about_shift = set(given)
    for i in order:
        eqn = jaxpr.eqns[i]
        if any(_is_var(v) and v in about_shift for v in eqn.invars):
            about_shift.update(eqn.outvars)
            continue
        if axis_name in axis_names(eqn.params):
            continue
        for v in eqn.outvars:
            if not isinstance(v, jex.DropVar) and var[v] and v not in kept:
                kept[v] = stage


def differentiable(jaxpr: Any, seeds: list[Any]) -> frozenset[Any]:
    """The values of `jaxpr` that depend on an inexact one of `seeds` other than
    through `lax.stop_gradient` (the seeds included): those with a derivative."""
    found = {v for v in seeds if inexact(v.aval)}
    for eqn in jaxpr.eqns:
        ins = any(_is_var(v) and v in found for v in eqn.invars)
        if ins and eqn.primitive.name != "stop_gradient":
            found.update(v for v in eqn.outvars if inexact(v.aval))
    return frozenset(found)


def _stage_equations(
    eqns: list[Any],
    roots: list[Any],
    stage: int,
    levels: dict[int, int],
    effects: bool,
    kept: Collection[Any],
    given: Collection[Any] = (),
) -> tuple[list[int], list[Any]]:
    """The equations that compute `roots` at `stage`, where the collectives of
    lower levels and the `given` values are given and the `kept` values are read
    from buffers; and the kept values it reads, in the program's order. Effects
    (`jax.debug.callback`) run in the final stage only, so once per element."""
    needed = {v for v in roots if _is_var(v)}
    order = []
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        outvars = [v for v in eqn.outvars if not isinstance(v, jex.DropVar)]
        wanted = any(v in needed and v not in kept and v not in given for v in outvars)
        if not (wanted or (effects and eqn.effects)):
            continue
        order.append(i)
        needed.difference_update(outvars)
        if i in levels:
            assert levels[i] < stage
            continue  # its result is given
        needed.update(v for v in eqn.invars if _is_var(v))
    # What is still needed is an input of the program, or a kept value.
    read = [v for eqn in eqns for v in eqn.outvars if v in needed and v in kept]
    return order[::-1], read


def _custom_calls(jaxpr: Any) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in CUSTOM:
            yield eqn
        else:
            for value in eqn.params.values():
                for sub in subjaxprs(value):
                    yield from _custom_calls(sub)


def check_custom_rules(program: Program, api: str) -> None:
    """Refuses a collective over the axis that only a derivative rule performs (a
    `jax.custom_vjp` forward or backward pass, a `jax.custom_jvp` rule): staged
    evaluation cannot see it, and per chunk it would be wrong.

    Each custom-derivative call left in the program (none holds such a collective
    in its primal: see `_program.py`) is differentiated on its own, in
    reverse mode or, where that is not defined, in forward mode.
    """
    axis_name, size = program.axis_name, program.batch_size
    for eqn in _custom_calls(program.jaxpr):
        structs = [struct(v.aval, weak=False) for v in eqn.invars]
        if not any(inexact(s) for s in structs):
            continue
        found = in_derivatives(ft.partial(bind, eqn), structs, axis_name, size)
        if found:
            what = ", ".join(f"`{f}`" for f in found)
            raise ValueError(
                f"`{api}(..., axis_name={axis_name!r})`: the collective(s) {what} over "
                f"{axis_name!r} are performed only by a custom derivative rule (the "
                "backward pass of a `jax.custom_vjp`, or a `jax.custom_jvp` rule), "
                "which a split batch cannot compute exactly. Use `chunk_size=None` "
                "(or at least the batch size), or compute the collective outside "
                "the rule."
            )
