"""Staged collectives, part 6: derivatives whose cotangents add where `jax.vmap`'s
do (this folder's `README.md`).

Differentiated through the loops one by one, a value that two loops recompute (`h
= sqrt(x)`, summed by a pass for `pmean(h)` and read by the final loop) gets one
cotangent per loop, each taken through `h`'s derivative on its own and added only
at `x`: where that derivative is infinite, `inf - inf` is `nan` where `jax.vmap`,
which adds the cotangents at `h` first, gives `inf`. So a plan that keeps no
stage boundaries runs under [`run_differentiable`][]'s JVP rule, whose tangents
come from one loop of the whole program for each element, with the collectives'
results held constant (the tangents of the mapped outputs and of every
collective's operand, through the inputs), and then, level by level, loops of the
tangents through the results alone:

    d(result of level s) = finish(sum over the batch of d(operand) through the
                           inputs) + sum of d(operand) through lower levels' results
    d(output)            = d(output) through the inputs + through the results

JAX transposes the first loop once for each element, adding the cotangents at
every value of the program before its derivative, as `jax.vmap` does; the others
give only the results' cotangents. The number of loops is that of the passes.

A variance summed in its mean's pass (`_moments.py`) is differentiated as
written, about the mean: its derivative through the mean, `-2 sum(y - m) dm`, is
zero for every input, since `m` is the mean of those `y`.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex
from jaxtyping import Array

from .._custom_types import ChunkOutput, LoopOptions
from .._jax_compat import batched_none_output
from .._mesh import BatchSharding
from .._sharding import across
from .._structs import inexact
from .._summed import as_sums, merge_varying, split_varying
from ._element import element_fn, with_mapped
from ._passes import finish, kind, strong
from ._plan import _stage_equations, differentiable, Plan
from ._run import _loop, forward, VaryingUnmappedOutput
from ._tangents import add_tangents, jvp_held, tangent_or_zero


# The stages of the tangent loops: the whole program for one element (every
# collective's operand and every output), and its outputs alone; both with every
# collective's result given, and without effects (which the forward loops run).
WHOLE = "whole"
OUTPUTS = "outputs"


def run_differentiable(
    plan: Plan,
    consts: list[Any],
    unmapped: list[Array],
    batch: tuple[list[Array], list[int]],
    options: LoopOptions,
    shard: BatchSharding | None,
    sum_match: bool = False,
) -> tuple[list[Array], list[Any]]:
    """`forward`'s outputs, the untraced unmapped ones as they are, with the
    derivatives described above where the plan recomputes what its passes
    computed (it keeps no stage boundaries); with `sum_match`, the unmapped
    outputs that vary over the batch summed, and their tangents too."""
    if plan.num_passes == 0 or any(plan.writes.values()):
        out_mapped, out_unmapped, _ = forward(
            plan, consts, unmapped, batch, options, shard, sum_match
        )
    else:
        leaves, axes = batch
        staged = _with_tangent_stages(plan)
        out_mapped, out_unmapped = _staged(
            list(consts),
            list(unmapped),
            list(leaves),
            plan=staged,
            axes=tuple(axes),
            options=options,
            shard=shard,
            sum_match=sum_match,
        )
    return out_mapped, [
        value if untraced else x
        for x, (untraced, value) in zip(out_unmapped, plan.program.kept, strict=True)
    ]


def _with_tangent_stages(plan: Plan) -> Plan:
    jaxpr = plan.program.jaxpr
    upto = plan.num_passes + 1
    operands = [v for i in _differentiated(plan) for v in jaxpr.eqns[i].invars]
    targets = {WHOLE: operands + list(jaxpr.outvars), OUTPUTS: list(jaxpr.outvars)}
    equations = {
        stage: _stage_equations(jaxpr.eqns, roots, upto, plan.levels, False, ())[0]
        for stage, roots in targets.items()
    }
    empty = {stage: [] for stage in targets}
    return dataclasses.replace(
        plan,
        equations=plan.equations | equations,
        targets=plan.targets | targets,
        reads=plan.reads | empty,
        writes=plan.writes | empty,
    )


def _differentiated(plan: Plan, level: int | None = None) -> list[int]:
    """The collectives (of `level`, or of every level) whose results have a
    derivative: those of floating or complex values, but `pmax` and `pmin`,
    which JAX does not differentiate."""
    levels = range(1, plan.num_passes + 1) if level is None else [level]
    eqns = plan.program.jaxpr.eqns
    return [
        i
        for s in levels
        for i in plan.at_level(s)
        if eqns[i].primitive.name not in ("pmax", "pmin")
        and all(inexact(v.aval) for v in eqns[i].outvars)
    ]


@eqx.filter_custom_jvp
def _staged(
    consts: list[Any],
    unmapped: list[Array],
    leaves: list[Array],
    *,
    plan: Plan,
    axes: tuple[int, ...],
    options: LoopOptions,
    shard: BatchSharding | None,
    sum_match: bool,
) -> tuple[list[Array], list[Array]]:
    out_mapped, out_unmapped, _ = forward(
        plan, consts, unmapped, (leaves, list(axes)), options, shard, sum_match
    )
    return out_mapped, out_unmapped


@_staged.def_jvp
def _staged_jvp(
    primals: tuple[Any, ...],
    tangents: tuple[Any, ...],
    *,
    plan: Plan,
    axes: tuple[int, ...],
    options: LoopOptions,
    shard: BatchSharding | None,
    sum_match: bool,
) -> tuple[Any, Any]:
    consts, unmapped, leaves = primals
    t_consts, t_unmapped, t_leaves = tangents
    batch = (list(leaves), list(axes))
    # Staged (`jax.jit`), as the loops always are: run on the known values of
    # a linearisation, their constants would be NumPy arrays and Python scalars.
    out_mapped, out_unmapped, results = jax.jit(
        lambda _c, _u, _l: forward(
            plan, _c, _u, (_l, list(axes)), options, shard, sum_match
        )
    )(list(consts), list(unmapped), list(leaves))
    fixed, t_fixed = list(consts) + list(unmapped), list(t_consts) + list(t_unmapped)
    _refuse_max_min(plan, t_fixed, list(t_leaves))
    quiet = options._replace(progress_meter=None)
    loops = _TangentLoops(plan, fixed, batch, results, quiet, shard, sum_match)
    # Through the inputs, the results held constant.
    t_sums, t_mapped, t_unmapped_out = jvp_held(
        lambda _fixed, _leaves: loops.whole(_fixed, _leaves),
        (fixed, list(leaves)),
        (t_fixed, list(t_leaves)),
    )
    # Then through the results, level by level.
    t_results: dict[int, list[Any]] = {}
    for level in range(1, plan.num_passes + 1):
        through = {}
        if level > 1:
            through = jvp_held(
                lambda _r, _level=level: loops.operands(_level, _r),
                (results,),
                (t_results,),
            )
        eqns = plan.program.jaxpr.eqns
        for i in _differentiated(plan, level):
            parts = [
                add_tangents(a, b)
                for a, b in zip(t_sums[i], through.get(i, [None] * len(t_sums[i])))
            ]
            if any(p is None for p in parts):  # no tangent reaches it
                continue
            t_results[i] = finish(
                eqns[i], parts, plan.program.axis_name, plan.program.batch_size
            )
    t_mapped_r, t_unmapped_r = jvp_held(
        lambda _r: loops.outputs(_r), (results,), (t_results,)
    )
    t_mapped = [
        tangent_or_zero(x, add_tangents(a, b))
        for x, a, b in zip(out_mapped, t_mapped, t_mapped_r)
    ]
    t_unmapped_out = [
        tangent_or_zero(x, add_tangents(a, b))
        for x, a, b in zip(out_unmapped, t_unmapped_out, t_unmapped_r, strict=True)
    ]
    return (out_mapped, out_unmapped), (t_mapped, t_unmapped_out)


class _TangentLoops:
    """The loops of the tangents above, each over this device's elements, on the
    primal values of the call (`fixed`: the program's consts and unmapped
    inputs; `batch`: its mapped leaves and their axes; `results`: the
    collectives' results). With `sum_match`, the unmapped outputs that vary
    are summed over the batch, as the forward loop sums them."""

    def __init__(
        self,
        plan: Plan,
        fixed: list[Any],
        batch: tuple[list[Array], list[int]],
        results: dict[int, list[Array]],
        options: LoopOptions,
        shard: BatchSharding | None,
        sum_match: bool,
    ):
        self.plan, self.fixed, self.batch = plan, fixed, batch
        self.results, self.options, self.shard = results, options, shard
        self.sum_match = sum_match

    def whole(self, fixed: list[Any], leaves: list[Array]) -> tuple[Any, ...]:
        """Every differentiated collective's accumulated operands (by equation),
        and the mapped and unmapped outputs, with the results held constant."""
        batch = (leaves, self.batch[1])
        return self._run(
            WHOLE, fixed, self.results, batch, {}, _differentiated(self.plan)
        )

    def operands(self, level: int, results: dict[int, list[Array]]) -> dict:
        """The level's differentiated collectives' accumulated operands, as
        functions of the results of lower levels (the mean of a variance summed
        beside it held at its value)."""
        plan, eqns = self.plan, self.plan.program.jaxpr.eqns
        shifts = {}
        for moment in plan.moments.get(level, []):
            shifts[moment.m] = moment.mean_from(eqns, self.results[moment.mean][0])
        ids = _differentiated(plan, level)
        return self._run(level, self.fixed, results, self.batch, shifts, ids)[0]

    def outputs(self, results: dict[int, list[Array]]) -> tuple[Any, ...]:
        """The mapped and unmapped outputs, as functions of the results."""
        return self._run(OUTPUTS, self.fixed, results, self.batch, {}, [])[1:]

    def _run(
        self,
        stage: Any,
        fixed: list[Any],
        results: dict[int, list[Array]],
        batch: tuple[list[Array], list[int]],
        shifts: dict[Any, Array],
        ids: list[int],
    ) -> tuple[dict[int, list[Array]], list[Array], list[Array]]:
        plan = self.plan
        eqns, k = plan.program.jaxpr.eqns, plan.program.num_mapped_out
        positions = _positions(plan, stage, ids)
        num_out = len(plan.program.jaxpr.outvars) if stage in (WHOLE, OUTPUTS) else 0
        element = element_fn(plan, stage, fixed, results, shifts)
        varies: list[bool] = []

        def _element(_m: list[Array], _p: Array) -> tuple[list[Any], ...]:
            out = element(_m, _p)
            outs = out[len(out) - num_out :] if num_out else []
            rows = [out[j] for j, _ in positions]
            if not self.sum_match:
                return rows, outs[:k], [], outs[k:]
            summed, unbatched, varies[:] = split_varying(outs[k:], _p)
            return rows, outs[:k], summed, unbatched

        def _chunk_fn(inputs: tuple[list[Array], Array], size: int) -> ChunkOutput:
            del size
            out_axes = (0, 0, 0, None)
            vmapped = jax.vmap(_element, in_axes=(batch[1], 0), out_axes=out_axes)
            try:
                rows, mapped, summed, unbatched = vmapped(*inputs)
            except ValueError as e:  # as the forward loop (which raised first)
                path = batched_none_output(e)
                if path is None or path[:1] != (2,):
                    raise
                raise VaryingUnmappedOutput(path[1] if len(path) > 1 else 0) from None
            kinds = [_kind(eqns[i]) for _, i in positions] + [None] * len(mapped)
            leaves = [strong(x) if w else x for x, w in zip(rows, kinds)] + list(mapped)
            leaves += as_sums(summed)
            kinds += ["sum"] * len(summed)
            return ChunkOutput(
                leaves, (0,) * len(leaves), unbatched, None, tuple(kinds)
            )

        level = plan.num_passes + 1
        out, _ = _loop(plan, _chunk_fn, batch, self.options, self.shard, level)
        values, kinds = list(out.batched), out.kinds()
        num_sums, num_mapped = len(positions), len(values) - len(positions)
        num_mapped -= sum(varies)
        sums, mapped = values[:num_sums], values[num_sums : num_sums + num_mapped]
        summed = values[num_sums + num_mapped :]
        if self.shard is not None:  # every device's accumulators, rows gathered
            names = self.shard.axis_names
            sums = [across(w, x, names) for x, w in zip(sums, kinds, strict=False)]
            summed = [across("sum", x, names) for x in summed]
        parts: dict[int, list[Array]] = {}
        for (_, i), x in zip(positions, sums, strict=True):
            parts.setdefault(i, []).append(x)
        unmapped = list(out.unbatched)
        if self.sum_match and num_out:
            unmapped = merge_varying(varies, summed, unmapped)
        return parts, mapped, unmapped


def _kind(eqn: Any) -> str | None:
    """How the loop keeps an operand's rows: summed, or written (`None`)."""
    return "sum" if kind(eqn) == "sum" else None


def _positions(plan: Plan, stage: Any, ids: list[int]) -> list[tuple[int, int]]:
    """For each operand of the collectives `ids`, its position among the stage's
    targets, and its collective."""
    eqns = plan.program.jaxpr.eqns
    order = ids if stage in (WHOLE, OUTPUTS) else plan.at_level(stage)
    starts = plan.operand_starts(order)
    return [(starts[i] + j, i) for i in ids for j in range(len(eqns[i].invars))]


def _refuse_max_min(plan: Plan, t_fixed: list[Any], t_leaves: list[Any]) -> None:
    """What `jax.vmap` raises where a staged `pmax` or `pmin` has an operand with a
    tangent: JAX defines no derivative of either."""
    jaxpr = plan.program.jaxpr
    invars = list(jaxpr.constvars) + list(jaxpr.invars)
    tangents = with_mapped(plan, t_fixed, t_leaves)
    seeds = [v for v, t in zip(invars, tangents, strict=True) if t is not None]
    moved = differentiable(jaxpr, seeds)
    for i in plan.levels:
        name = jaxpr.eqns[i].primitive.name
        operands = jaxpr.eqns[i].invars
        moves = any(not isinstance(v, jex.Literal) and v in moved for v in operands)
        if name in ("pmax", "pmin") and moves:
            raise NotImplementedError(
                f"Differentiation rule for '{name}' not implemented"
            )
