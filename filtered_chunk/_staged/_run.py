"""Collectives over the mapped axis across chunks, exactly: staged evaluation
(this folder's `README.md`).

[`forward`][] runs `fun` in passes of the library's one loop ([`run_in_chunks`][]):
pass `s` computes only the operands of the level-`s` collectives, with the results
of lower levels as unmapped values; the last computes every output (the unmapped
ones as the loop's unbatched outputs, so that `jax.vmap` tells whether they vary).
`psum`, `pmean`, `pmax`, `pmin`, `axis_index`, `axis_size`, `all_gather`,
`ppermute`, `psum_scatter` and `all_to_all` give `jax.vmap`'s results, up to the
order of floating-point sums.

Cost: a dependency depth of `d` costs up to `d + 1` evaluations of the prefix of
`fun`. Every pass's chunks are rematerialised in reverse mode (`checkpoint`), which
keeps gradients bounded too: without it, the residuals of every pass's chunks would
be kept.
"""

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.extend.core as jex
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._custom_types import ChunkOutput, LoopOptions
from .._jax_compat import batched_none_output
from .._loop import run_in_chunks
from .._sharding import across, BatchSharding
from .._structs import typed
from .._summed import as_sums, merge_varying, split_varying
from ._analysis import axis_names
from ._passes import finish, kind, read, strong, unstaged
from ._plan import check_custom_rules, FINAL, make_plan, Plan, SHIFT
from ._program import bind, staged_program


ElementFn = Callable[[list[Array], list[Array]], tuple[list[Any], list[Any], Any]]


class VaryingUnmappedOutput(ValueError):
    """An output marked `out_axes=None` varies over the batch: `index` is its
    position among the unmapped outputs."""

    def __init__(self, index: int):
        super().__init__(
            "`run_staged` gives `None` for an output that varies over the batch."
        )
        self.index = index


def _evaluate(
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
    for i in plan.schedules[stage]:
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


def _with_mapped(plan: Plan, fixed: list[Any], mapped: list[Any]) -> list[Any]:
    """The program's arguments: `fixed` is its consts then its unmapped inputs."""
    k = len(plan.program.consts)
    return fixed[:k] + list(mapped) + fixed[k:]


Buffers = dict[Any, Array]  # a kept value of the program -> its batch-sized buffer


def _stage_inputs(
    plan: Plan, stage: Any, batch: tuple[list[Array], list[int]], buffers: Buffers
) -> tuple[list[Array], list[int]]:
    """The mapped leaves of a stage's loop, and their axes: the call's, then the
    buffers of the kept values it reads (batched on axis 0)."""
    read = [buffers[v] for v in plan.reads[stage]]
    return list(batch[0]) + read, list(batch[1]) + [0] * len(read)


def _read_from(plan: Plan, level: int) -> set[Any]:
    """The kept values that the stages from `level` on read."""
    later = [*range(level, plan.num_passes + 1), FINAL]
    return {v for stage in later for v in plan.reads[stage]}


def _relay(plan: Plan, level: int, num_batch: int) -> list[int]:
    """The positions, among the leaves of the level's loop's inputs (the call's
    `num_batch` mapped leaves, then the kept values it reads), of the kept values
    it reads: the loop relays them all (`run_in_chunks`). A later stage that
    reads one again reads what the loop relays, so that in reverse mode each
    kept value's cotangent accumulates in one buffer, in place, through the
    loops that read it; one that no later stage reads is a spare of the next
    loops (`_spares`), which write a kept value's tangent into its tangent, so
    that a chain of kept values passes two cotangent buffers back and forth
    (this folder's `README.md`)."""
    return [num_batch + j for j in range(len(plan.reads[level]))]


def _spares(plan: Plan, level: int, buffers: Buffers, free: list[Array]) -> list[Array]:
    """The buffers that the loop of `level` may write its kept values into (see
    `run_in_chunks`), taken out of `free`, once the buffers that no stage from
    `level` on reads have joined it: the memory of the kept values is then that
    of those alive at once, not of them all."""
    read = _read_from(plan, level)
    free += [buffers.pop(v) for v in list(buffers) if v not in read]
    spares = []
    for v in plan.writes[level]:
        rows = [x.shape[1:] == v.aval.shape and x.dtype == v.aval.dtype for x in free]
        if any(rows):
            spares.append(free.pop(rows.index(True)))
    return spares


def _element_fn(
    plan: Plan,
    stage: Any,
    fixed: list[Any],
    results: dict[int, list[Array]],
    shifts: dict[Any, Array] | None = None,
) -> Callable[[list[Array], Array], list[Any]]:
    """`_evaluate` of `stage` for one element of the stage's loop's inputs."""
    num_mapped = plan.program.num_mapped_in
    shifts = shifts or {}

    def _element(_mapped: list[Array], _position: Array) -> list[Any]:
        _args = _with_mapped(plan, fixed, _mapped[:num_mapped])
        kept = _mapped[num_mapped:]
        return _evaluate(plan, stage, _args, results, _position, kept, shifts)

    return _element


def _pass(
    plan: Plan,
    level: int,
    fixed: list[Any],
    results: dict[int, list[Array]],
    batch: tuple[list[Array], list[int]],
    buffers: Buffers,
    spares: list[Array],
    options: LoopOptions,
    shard: BatchSharding | None,
) -> tuple[dict[int, list[Array]], Buffers]:
    """The results of the level's collectives, from one run of the library's loop
    (on each device's shard, then across the devices, if `shard` says so), and
    the buffers of the kept values it writes or relays (each device's its own
    rows).

    Its chunk function returns each operand's rows: a gather's are written into a
    batch-sized buffer, a reduction's are accumulated (`_loop/_accumulate.py`). A
    running maximum or minimum carries, with value zero, the tangents of the rows
    (where the operand has any: not through `lax.stop_gradient`): JAX defines no
    derivative of `pmax` or `pmin` (not even under `jax.vmap`), and the carrier is
    what raises its error when one is taken (`finish`).
    """
    eqns = plan.program.jaxpr.eqns
    # The accumulator kind and the aval of each operand of the level, and whether
    # a maximum's or minimum's rows have tangents to carry.
    operands = [
        (kind(eqns[i]), v.aval, plan.has_derivative(v))
        for i in plan.at_level(level)
        for v in eqns[i].invars
    ]

    inputs = _stage_inputs(plan, level, batch, buffers)
    shifts = {}
    if plan.moments.get(level):
        probe = _stage_inputs(plan, (SHIFT, level), batch, buffers)
        shifts = _shifts(plan, level, fixed, results, probe, options.chunk_size, shard)
    element = _element_fn(plan, level, fixed, results, shifts)
    num_written = len(plan.writes[level])
    # The operand of the mean of each variance summed about a shift is summed
    # about that shift too (`Moment.correct`, `_results`).
    about = {j: shifts[m] for j, m in _shifted_means(plan, level).items()}

    def _chunk_fn(_inputs: tuple[list[Array], Array], size: int) -> ChunkOutput:
        del size
        rows = jax.vmap(element, in_axes=(inputs[1], 0))(*_inputs)
        rows, written = rows[: len(rows) - num_written], rows[len(rows) - num_written :]
        leaves, kinds = [], []
        for j, ((which, _, carried), x) in enumerate(zip(operands, rows, strict=True)):
            if j in about:
                x = strong(x) - strong(about[j])[None]
            if which == "gather":
                leaves.append(x)
                kinds.append(None)
                continue
            x = strong(x)
            leaves.append(x if which == "sum" else lax.stop_gradient(x))
            kinds.append(which)
            if which != "sum" and carried:
                leaves.append(x - lax.stop_gradient(x))
                kinds.append("sum")
        leaves += written
        kinds += [None] * num_written
        return ChunkOutput(leaves, (0,) * len(leaves), None, None, tuple(kinds))

    relay = _relay(plan, level, len(batch[0]))
    # The kept values' tangents ride the loop's carry, from their spares'
    # (`run_in_chunks(..., carried=...)`): after the operands' rows (a
    # maximum's or minimum's and its carrier's, for one with tangents).
    first = sum(2 if w not in ("gather", "sum") and c else 1 for w, _, c in operands)
    carried = list(range(first, first + num_written))
    out, relayed = _loop(
        plan, _chunk_fn, inputs, options, shard, level, spares, relay, carried
    )
    values = list(out.batched)
    values, written = (
        values[: len(values) - num_written],
        values[len(values) - num_written :],
    )
    if shard is not None:  # every device's accumulators combined, rows gathered
        kinds = out.kinds()[: len(values)]
        values = [
            across(k, x, shard.axis_names) for x, k in zip(values, kinds, strict=True)
        ]
    values = iter(values)
    acc, gathered = [], []
    for which, _, carried in operands:
        if which == "gather":
            gathered.append(next(values))
        elif which == "sum":
            acc.append(next(values))
        else:
            top = next(values)
            acc.append((top, next(values) if carried else jnp.zeros_like(top)))
    kept = dict(zip(plan.writes[level], written, strict=True))
    reads = plan.reads[level]
    kept |= {reads[i - len(batch[0])]: x for i, x in zip(relay, relayed, strict=True)}
    return _results(plan, level, acc, gathered, shifts), kept


def _shifted_means(plan: Plan, level: int) -> dict[int, Any]:
    """The position among the level's operands of the mean of each variance that
    the level's pass computes beside it, and the mean's variable (which keys its
    shift)."""
    starts = plan.operand_starts(plan.at_level(level))
    return {starts[moment.mean]: moment.m for moment in plan.moments.get(level, [])}


def _positions(plan: Plan, shard: BatchSharding | None) -> Array:
    """The positions in the whole batch of this device's elements."""
    num_devices = 1 if shard is None else shard.num_devices
    positions = jnp.arange(plan.program.batch_size // num_devices)
    if shard is not None:  # this device's elements follow those of the ones before
        device = lax.axis_index(shard.axis_names).astype(positions.dtype)
        positions = positions + device * positions.shape[0]
    return positions


# At most this many elements, spread evenly over the batch, give a variance's
# shift: each is evaluated once more (up to its level, from the inputs when the
# boundaries are not kept).
SAMPLE = 256


def _shifts(
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
    element = _element_fn(plan, (SHIFT, level), fixed, results)

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


def _loop(
    plan: Plan,
    chunk_fn: Callable[[Any, int], ChunkOutput],
    batch: tuple[list[Array], list[int]],
    options: LoopOptions,
    shard: BatchSharding | None,
    level: int,
    spares: list[Array] | None = None,
    relay: list[int] | None = None,
    carried: list[int] | None = None,
) -> tuple[ChunkOutput, list[Array]]:
    """`chunk_fn` over this device's elements (`batch`: the mapped leaves and
    their axes, with each element's position in the whole batch), in the
    library's loop, reported as loop `level` of the plan's, writing into
    `spares` where it can, with the tangents of the outputs at the positions
    `carried` in the loop's carry; and the mapped leaves at the positions
    `relay`, as the loop relays them."""
    positions = _positions(plan, shard)
    batch_size = positions.shape[0]
    inputs = (list(batch[0]), positions)
    in_axes = (list(batch[1]), 0)
    loops = plan.num_passes + 1
    label = None if loops == 1 else f"loop {level} of {loops}"
    return run_in_chunks(
        chunk_fn,
        inputs,
        in_axes,
        batch_size=batch_size,
        options=options,
        loop=label,
        spares=spares or (),
        relay=relay or (),
        carried=carried or (),
    )


def _results(
    plan: Plan,
    level: int,
    acc: list[Any],
    gathered: list[Array],
    shifts: dict[Any, Array],
) -> dict[int, list[Array]]:
    program = plan.program
    eqns = program.jaxpr.eqns
    accs, rows = iter(acc), iter(gathered)
    moments = {moment.variance: moment for moment in plan.moments.get(level, [])}
    means = {moment.mean: moment.m for moment in plan.moments.get(level, [])}
    # The sums of the means' operands about the shifts, by the mean's `psum`.
    about: dict[int, Array] = {}
    out = {}
    for i in plan.at_level(level):
        eqn = eqns[i]
        parts = [
            next(rows) if kind(eqn) == "gather" else next(accs) for _ in eqn.invars
        ]
        n = program.batch_size
        if i in means:  # summed about a shift, which adds back in the end
            about[i] = parts[0]
            shift = strong(shifts[means[i]])
            parts = [typed(parts[0] + n * shift, eqn.invars[0].aval)]
        if i in moments:  # summed about a shift: its mean's result corrects it
            moment = moments[i]
            m_eqn = eqns[moment.m_eqn]
            (m,) = bind(m_eqn, [out[moment.mean][0], m_eqn.invars[1].val])
            shift = strong(shifts[moment.m])
            offset = about[moment.mean]
            summed = moment.correct(parts[0], offset, strong(m), shift, n)
            parts = [typed(summed, eqn.invars[0].aval)]
        out[i] = finish(eqn, parts, program.axis_name, program.batch_size)
    return out


def plan_staged(
    fun: ElementFn,
    mapped: list[jax.ShapeDtypeStruct],
    unmapped: list[jax.ShapeDtypeStruct],
    *,
    batch_size: int,
    axis_name: Hashable,
    api: str,
    keep: int = 0,
) -> Plan:
    """The plan of `fun` (see `run_staged`) for one element like `mapped`, traced
    outside any `shard_map`, keeping its stage boundaries if `keep`; raises what
    cannot be staged exactly."""
    program = staged_program(fun, mapped, unmapped, axis_name, batch_size, api)
    plan = make_plan(program, keep)
    check_custom_rules(program, api)
    return plan


def forward(
    plan: Plan,
    consts: list[Any],
    unmapped: list[Array],
    batch: tuple[list[Array], list[int]],
    options: LoopOptions,
    shard: BatchSharding | None,
    sum_match: bool = False,
) -> tuple[list[Array], list[Array], dict[int, list[Array]]]:
    """The passes and the final loop of `plan`, over `batch` (the mapped leaves
    and their axes; this device's shard of them with `shard`): the mapped outputs
    (the batch on axis 0), the unmapped ones as traced (summed over the batch
    where they vary, with `sum_match`), and the results of every level's
    collectives. `consts` are the program's (inputs of the `shard_map`, when
    sharded). Derivatives: `_derivative.py`."""
    fixed = list(consts) + list(unmapped)
    results: dict[int, list[Array]] = {}
    buffers: Buffers = {}
    free: list[Array] = []  # buffers no later stage reads
    for level in range(1, plan.num_passes + 1):
        spares = _spares(plan, level, buffers, free)
        found, written = _pass(
            plan, level, fixed, dict(results), batch, buffers, spares, options, shard
        )
        results.update(found)
        buffers.update(written)
    inputs = _stage_inputs(plan, FINAL, batch, buffers)
    out_mapped, out_unmapped = _final(
        plan, fixed, results, inputs, options, shard, sum_match
    )
    return out_mapped, out_unmapped, results


def _final(
    plan: Plan,
    fixed: list[Any],
    results: dict[int, list[Array]],
    batch: tuple[list[Array], list[int]],
    options: LoopOptions,
    shard: BatchSharding | None,
    sum_match: bool,
) -> tuple[list[Array], list[Array]]:
    """The outputs: the library's loop over the batch (the mapped leaves and
    their axes, the kept values' buffers among them), reading every level's
    results.

    The unmapped outputs (`out_axes=None`) are the loop's unbatched outputs, so
    that `jax.vmap`'s own batching rules say whether they vary (a loop or a `cond`
    that carries a mapped value beside an unmapped one), as without chunks; one
    that varies raises `VaryingUnmappedOutput`, or with `sum_match` is a sum that
    the loop accumulates (`_summed.py`).
    """
    num_mapped = plan.program.num_mapped_out
    varies: list[bool] = []

    evaluate = _element_fn(plan, FINAL, fixed, results)

    def _element(_m: list[Array], _position: Array) -> tuple[list[Any], ...]:
        out = evaluate(_m, _position)
        if not sum_match:
            return out[:num_mapped], [], out[num_mapped:]
        summed, unbatched, varies[:] = split_varying(out[num_mapped:], _position)
        return out[:num_mapped], summed, unbatched

    def _chunk_fn(inputs: tuple[list[Array], Array], size: int) -> ChunkOutput:
        del size
        vmapped = jax.vmap(_element, in_axes=(batch[1], 0), out_axes=(0, 0, None))
        try:
            out, summed, unbatched = vmapped(*inputs)
        except ValueError as e:
            path = batched_none_output(e)
            if path is None or path[:1] != (2,):
                raise
            raise VaryingUnmappedOutput(path[1] if len(path) > 1 else 0) from None
        summed = as_sums(summed)
        leaves = list(out) + summed
        kinds = (None,) * len(out) + ("sum",) * len(summed)
        return ChunkOutput(leaves, (0,) * len(leaves), unbatched, None, kinds)

    out, _ = _loop(plan, _chunk_fn, batch, options, shard, plan.num_passes + 1)
    out_mapped, summed = out.batched[:num_mapped], out.batched[num_mapped:]
    if shard is not None:
        summed = [across("sum", x, shard.axis_names) for x in summed]
    if not sum_match:
        return list(out_mapped), list(out.unbatched)
    return list(out_mapped), merge_varying(varies, summed, list(out.unbatched))
