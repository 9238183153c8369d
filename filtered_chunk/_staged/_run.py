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
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._custom_types import ChunkOutput, LoopOptions
from .._jax_compat import batched_none_output
from .._loop import Chain, run_in_chunks
from .._mesh import BatchSharding
from .._sharding import across
from .._summed import as_sums, merge_varying, split_varying
from ._element import element_fn, positions
from ._passes import kind, level_results, strong
from ._plan import check_custom_rules, FINAL, make_plan, Plan, SHIFT
from ._program import staged_program
from ._shifts import shifted_means, shifts as find_shifts


ElementFn = Callable[[list[Array], list[Array]], tuple[list[Any], list[Any], Any]]


class VaryingUnmappedOutput(ValueError):
    """An output marked `out_axes=None` varies over the batch: `index` is its
    position among the unmapped outputs."""

    def __init__(self, index: int):
        super().__init__(
            "`run_staged` gives `None` for an output that varies over the batch."
        )
        self.index = index


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
        shifts = find_shifts(
            plan, level, fixed, results, probe, options.chunk_size, shard
        )
    element = element_fn(plan, level, fixed, results, shifts)
    num_written = len(plan.writes[level])
    # The operand of the mean of each variance summed about a shift is summed
    # about that shift too (`Moment.correct`, `level_results`).
    about = {j: shifts[m] for j, m in shifted_means(plan, level).items()}
    chunk_fn = _operands_fn(element, inputs[1], operands, num_written, about)
    relay = _relay(plan, level, len(batch[0]))
    # The kept values' tangents ride the loop's carry, from their spares'
    # (`Chain.carried`): after the operands' rows (a
    # maximum's or minimum's and its carrier's, for one with tangents).
    first = sum(2 if w not in ("gather", "sum") and c else 1 for w, _, c in operands)
    carried = list(range(first, first + num_written))
    chain = Chain(spares, relay, carried)
    out, relayed = _loop(plan, chunk_fn, inputs, options, shard, level, chain)
    acc, gathered, written = _unpacked(out, operands, num_written, shard)
    kept = dict(zip(plan.writes[level], written, strict=True))
    reads = plan.reads[level]
    kept |= {reads[i - len(batch[0])]: x for i, x in zip(relay, relayed, strict=True)}
    return level_results(plan, level, acc, gathered, shifts), kept


Operand = tuple[str, Any, bool]  # its accumulator kind, aval, and carrier


def _operands_fn(
    element: Callable[[list[Array], Array], list[Any]],
    in_axes: list[int],
    operands: list[Operand],
    num_written: int,
    about: dict[int, Array],
) -> Callable[[Any, int], ChunkOutput]:
    """The chunk function of a pass: each operand's rows (gathered rows written,
    a reduction's accumulated; `about[j]` subtracted from operand `j`'s), each
    running maximum's or minimum's carrier where it has tangents, then the kept
    values it writes."""

    def _chunk_fn(_inputs: tuple[list[Array], Array], size: int) -> ChunkOutput:
        del size
        rows = jax.vmap(element, in_axes=(in_axes, 0))(*_inputs)
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

    return _chunk_fn


def _unpacked(
    out: ChunkOutput,
    operands: list[Operand],
    num_written: int,
    shard: BatchSharding | None,
) -> tuple[list[Any], list[Array], list[Array]]:
    """What a pass's loop gives (`_operands_fn`), unpacked: the accumulators (a
    maximum's or minimum's paired with its carrier, or zeros), the gathered
    rows and the kept values' buffers. On a sharded batch the accumulators are
    combined across the devices and the rows gathered."""
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
    return acc, gathered, list(written)


def _loop(
    plan: Plan,
    chunk_fn: Callable[[Any, int], ChunkOutput],
    batch: tuple[list[Array], list[int]],
    options: LoopOptions,
    shard: BatchSharding | None,
    level: int,
    chain: Chain = Chain(),
) -> tuple[ChunkOutput, list[Array]]:
    """`chunk_fn` over this device's elements (`batch`: the mapped leaves and
    their axes, with each element's position in the whole batch), in the
    library's loop, reported as loop `level` of the plan's, sharing memory with
    the other passes' loops as `chain` says; and the mapped leaves that the loop
    relays."""
    at = positions(plan, shard)
    batch_size = at.shape[0]
    inputs = (list(batch[0]), at)
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
        chain=chain,
    )


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

    evaluate = element_fn(plan, FINAL, fixed, results)

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
