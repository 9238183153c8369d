"""Collectives over the mapped axis across chunks, exactly: staged evaluation.

A collective over `axis_name` needs the whole batch, but a chunked loop sees one
chunk at a time. [`run_staged`][] evaluates `fun` in passes over the batch instead
(`_staged_plan.py` says which): pass `s` is one chunked loop that computes only the
operands of the collectives of level `s`, with the results of lower levels as
unmapped values, and accumulates them across chunks (`_staged_passes.py`); the last
pass is the library's loop ([`run_in_chunks`][]), computing every output (the
unmapped ones as its unbatched outputs, so that `jax.vmap` tells whether they
vary). `fun` is traced once, with the axis at the batch size, so every size it
reads (`lax.axis_size`, `psum` of a constant) is the batch's. So `psum`, `pmean`,
`pmax`, `pmin`, `axis_index`, `axis_size`, `all_gather`, `ppermute`,
`psum_scatter` and `all_to_all` give `jax.vmap`'s results (up to the order of
floating-point sums), with a working set of one chunk per pass plus the
collectives' results and gather buffers.

Cost: `num_passes + 1` loops, each recomputing what its level needs (a dependency
depth of `d` costs up to `d + 1` evaluations of the prefix of `fun`). Every pass's
chunks are rematerialised in reverse mode (`checkpoint`), which keeps gradients
bounded too: without it, the residuals of every pass's chunks would be kept.
"""

import functools as ft
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, PyTree

from ._axes import describe, varying_unmapped
from ._chunking import balanced_chunk_size, ChunkOutput, run_in_chunks
from ._collectives import axis_names, element_struct
from ._custom_types import CheckpointSpec, InputArray, keep_untraced
from ._derivatives import checkpointed
from ._jax_compat import batched_none_output
from ._progress import AbstractProgressMeter
from ._reporting import quiet, report_step, reporter
from ._staged_passes import (
    combine,
    finish,
    initial,
    kind,
    read,
    reduce_chunk,
    typed,
    unstaged,
)
from ._staged_plan import (
    check_custom_rules,
    FINAL,
    make_plan,
    Plan,
)
from ._staged_program import bind, staged_program, struct


ElementFn = Callable[[list[Array], list[Array]], tuple[list[Any], list[Any], Any]]


class VaryingUnmappedOutput(ValueError):
    """An output marked `out_axes=None` varies over the batch: `index` is its
    position among the unmapped outputs."""

    def __init__(self, index: int):
        super().__init__(
            "`run_staged` gives `None` for an output that varies over the batch."
        )
        self.index = index


class Shard(NamedTuple):
    """A batch split over devices, seen from inside `jax.shard_map`: each device
    stages its own elements, and each pass's accumulators are combined across
    the mesh axes `axis_names` (`num_devices` devices, the batch split in their
    order)."""

    axis_names: tuple[str, ...]
    num_devices: int


def _evaluate(
    plan: Plan,
    stage: Any,
    args: list[Any],
    results: dict[int, list[Array]],
    position: Any,
) -> list[Any]:
    """Stage `stage` of the program for one element (at `position` in the batch)."""
    program = plan.program
    jaxpr, axis_name = program.jaxpr, program.axis_name
    env = dict(zip(list(jaxpr.constvars) + list(jaxpr.invars), args, strict=True))
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
    return [
        typed(jnp.asarray(v.val), v.aval) if isinstance(v, jex.Literal) else env[v]
        for v in plan.targets[stage]
    ]


def _operands(plan: Plan, level: int) -> list[tuple[int, str, Any]]:
    """(equation, accumulator kind, operand aval) for each operand of the level."""
    eqns = plan.program.jaxpr.eqns
    return [
        (i, kind(eqns[i]), v.aval) for i in plan.at_level(level) for v in eqns[i].invars
    ]


def _chunk(
    plan: Plan,
    level: int,
    fixed: list[Any],
    results: dict[int, list[Array]],
    mapped: list[Array],
    positions: Array,
    mask: Bool[Array, " chunk"] | None,
) -> tuple[list[Any], list[Array]]:
    """One chunk of a pass: its accumulators and its rows of the gather buffers."""

    def _element(_mapped: list[Array], _position: Array) -> list[Any]:
        _args = _with_mapped(plan, fixed, _mapped)
        return _evaluate(plan, level, _args, results, _position)

    rows = jax.vmap(_element)(mapped, positions)
    partial, gathered = [], []
    for (_, which, _), x in zip(_operands(plan, level), rows, strict=True):
        if which == "gather":
            gathered.append(x)
        else:
            partial.append(reduce_chunk(which, x, mask))
    return partial, gathered


def _with_mapped(plan: Plan, fixed: list[Any], mapped: list[Any]) -> list[Any]:
    """The program's arguments: `fixed` is its consts then its unmapped inputs."""
    k = len(plan.program.consts)
    return fixed[:k] + list(mapped) + fixed[k:]


def _pass(
    plan: Plan,
    level: int,
    fixed: list[Any],
    results: dict[int, list[Array]],
    mapped: list[Array],
    *,
    chunk_size: int,
    remainder: str,
    checkpoint: CheckpointSpec,
    shard: Shard | None,
    progress_meter: AbstractProgressMeter | None,
    api: str,
) -> dict[int, list[Array]]:
    """The results of the level's collectives, from one chunked loop (on each
    device's shard, then across the devices, if `shard` says so).

    The chunks are scanned over as stacked inputs (`xs`), so that reverse mode
    transposes them into stacked cotangents, with no batch-sized carry.
    """
    batch_size = _local_size(plan, shard)
    loop = f"loop {level} of {plan.num_passes + 1}"
    found = reporter(progress_meter, api, batch_size, chunk_size, remainder, loop)
    if remainder == "overlap":
        chunk_size = balanced_chunk_size(batch_size, chunk_size)
    whole, leftover = divmod(batch_size, chunk_size)
    operands = _operands(plan, level)
    reductions = [(w, a) for _, w, a in operands if w != "gather"]
    # Nested chunked calls do not report.
    step = quiet(checkpointed(ft.partial(_chunk, plan, level), checkpoint), found)
    positions = _positions(batch_size, shard)
    overlap = remainder == "overlap" and leftover > 0
    # With an overlapping last chunk, it is one more step of the loop, whose rows
    # that the step before computed are masked out of every reduction (so that
    # every report is made inside the loop, in order).
    starts = np.arange(whole) * chunk_size
    masks = np.ones((whole, chunk_size), bool)
    if overlap:
        starts = np.append(starts, batch_size - chunk_size)
        new = np.arange(chunk_size) >= chunk_size - leftover
        masks = np.concatenate([masks, new[None]])

    def stack(x: Array) -> Array:
        chunks = x[: whole * chunk_size].reshape(whole, chunk_size, *x.shape[1:])
        if not overlap:
            return chunks
        return jnp.concatenate([chunks, x[batch_size - chunk_size :][None]])

    def _body(acc: list[Any], xs: tuple[Any, ...]) -> tuple[Any, Any]:
        start, mask, *_xs = xs
        partial, gathered = step(fixed, results, *_xs, mask if overlap else None)
        acc = [combine(w, a, p) for (w, _), a, p in zip(reductions, acc, partial)]
        report_step(found, start, chunk_size, acc)
        return acc, gathered

    init = [initial(w, a) for w, a in reductions]
    xs = (jnp.asarray(starts), jnp.asarray(masks))
    xs += ([stack(x) for x in mapped], stack(positions))
    acc, gathered = lax.scan(_body, init, xs)
    if overlap:  # the last step's new rows
        skip = chunk_size - leftover
        # Explicit sizes: `-1` is ambiguous for an operand of no elements.
        gathered = [
            jnp.concatenate(
                [g[:-1].reshape(whole * chunk_size, *g.shape[2:]), g[-1, skip:]]
            )
            for g in gathered
        ]
    else:
        gathered = [g.reshape(whole * chunk_size, *g.shape[2:]) for g in gathered]
    if leftover and not overlap:  # a separate remainder: reported by no loop
        start = whole * chunk_size
        rest = ([x[start:] for x in mapped], positions[start:])
        partial, last = step(fixed, results, *rest, None)
        acc = [combine(w, a, p) for (w, _), a, p in zip(reductions, acc, partial)]
        gathered = [jnp.concatenate([g, x]) for g, x in zip(gathered, last)]
    if shard is not None:
        acc = [_across(w, a, shard) for (w, _), a in zip(reductions, acc)]
        gathered = [lax.all_gather(g, shard.axis_names, tiled=True) for g in gathered]
    return _results(plan, level, acc, gathered)


def _local_size(plan: Plan, shard: Shard | None) -> int:
    """The number of elements this device evaluates."""
    num_devices = 1 if shard is None else shard.num_devices
    return plan.program.batch_size // num_devices


def _positions(size: int, shard: Shard | None) -> Array:
    """The positions in the whole batch of this device's `size` elements."""
    positions = jnp.arange(size)
    if shard is None:
        return positions
    device = lax.axis_index(shard.axis_names).astype(positions.dtype)
    return positions + device * size


def _across(which: str, acc: Any, shard: Shard) -> Any:
    """A pass's accumulator over the whole batch, from every device's."""
    names = shard.axis_names
    if which == "sum":
        return lax.psum(acc, names)
    top, carrier = acc
    best = (lax.pmax if which == "max" else lax.pmin)(top, names)
    if jnp.issubdtype(top.dtype, jnp.inexact):
        carrier = lax.psum(carrier, names)
    return best, carrier


def _results(
    plan: Plan, level: int, acc: list[Any], gathered: list[Array]
) -> dict[int, list[Array]]:
    program = plan.program
    accs, rows = iter(acc), iter(gathered)
    out = {}
    for i in plan.at_level(level):
        eqn = program.jaxpr.eqns[i]
        parts = [
            next(rows) if kind(eqn) == "gather" else next(accs) for _ in eqn.invars
        ]
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
) -> Plan:
    """The plan of `fun` (see `run_staged`) for one element like `mapped`, traced
    outside any `shard_map`; raises what cannot be staged exactly."""
    program = staged_program(fun, mapped, unmapped, axis_name, batch_size, api)
    plan = make_plan(program)
    check_custom_rules(program, api)
    return plan


def run_plan(
    plan: Plan,
    consts: list[Any],
    unmapped: list[Array],
    mapped: list[Array],
    in_axes: list[int],
    *,
    chunk_size: int,
    remainder: str,
    checkpoint: CheckpointSpec,
    progress_meter: AbstractProgressMeter | None,
    api: str,
    shard: Shard | None,
) -> tuple[list[Array], list[Any]]:
    """The passes and the final loop of `plan`, over `mapped` (the batch on
    `in_axes`; this device's shard of it with `shard`): the mapped outputs (the
    batch on axis 0) and the unmapped ones. `consts` are the program's (inputs of
    the `shard_map`, when sharded)."""
    fixed = list(consts) + list(unmapped)
    chunk_size = min(chunk_size, _local_size(plan, shard))  # a shard in one chunk
    results: dict[int, list[Array]] = {}
    options: dict[str, Any] = dict(
        chunk_size=chunk_size, remainder=remainder, checkpoint=checkpoint, shard=shard
    )
    # The passes scan over chunks stacked on axis 0 (a copy of a leaf mapped on
    # another axis, where there is a pass).
    stacked = [jnp.moveaxis(x, a, 0) for x, a in zip(mapped, in_axes, strict=True)]
    for level in range(1, plan.num_passes + 1):
        results.update(
            _pass(
                plan,
                level,
                fixed,
                dict(results),
                stacked,
                progress_meter=progress_meter,
                api=api,
                **options,
            )
        )
    out_mapped, out_unmapped = _final(
        plan, fixed, results, (mapped, in_axes), progress_meter, api, **options
    )
    out_unmapped = [
        value if untraced else x
        for x, (untraced, value) in zip(out_unmapped, plan.program.kept, strict=True)
    ]
    return out_mapped, out_unmapped


def run_staged(
    fun: ElementFn,
    mapped: list[Array],
    unmapped: list[Array],
    *,
    batch_size: int,
    chunk_size: int,
    remainder: str,
    checkpoint: CheckpointSpec,
    axis_name: Hashable,
    in_axes: list[int] | None = None,
    api: str = "filter_chunked_vmap",
    progress_meter: AbstractProgressMeter | None = None,
) -> tuple[list[Array], list[Any], Any, int]:
    """`jax.vmap(fun, axis_name=axis_name)` over `batch_size` elements, with its
    collectives over `axis_name` computed exactly across chunks of `chunk_size`.

    `fun(mapped, unmapped)` takes one element's mapped leaves and the unmapped
    leaves (lists of arrays) and returns `(mapped_out, unmapped_out, aux)`: lists
    of arrays and anything static. `mapped` holds the leaves with the batch on
    their `in_axes` (default: axis 0 of each; another axis costs one transpose of
    that leaf where there is a pass). `progress_meter` (labelled `api`) reports
    every loop.

    Returns `(mapped_out, unmapped_out, aux, num_passes)`: the mapped outputs with
    the batch on axis 0; the unmapped outputs, which must not vary over the batch
    (else `VaryingUnmappedOutput`), those that no trace computed as they are (as
    `jax.vmap` returns them); `aux` from tracing `fun`; and the number of passes
    before the final one. Raises a `ValueError` naming the collective where it
    cannot be computed exactly (see `_staged_program.py`).
    """
    axes = [0] * len(mapped) if in_axes is None else list(in_axes)
    if not 0 < chunk_size < batch_size:
        moved = [jnp.moveaxis(x, a, 0) for x, a in zip(mapped, axes, strict=True)]
        return _one_vmap(fun, moved, unmapped, batch_size, axis_name)
    elements = [element_struct(a, x) for x, a in zip(mapped, axes, strict=True)]
    unmapped_structs = [struct(x) for x in unmapped]
    plan = plan_staged(
        fun,
        elements,
        unmapped_structs,
        batch_size=batch_size,
        axis_name=axis_name,
        api=api,
    )
    out_mapped, out_unmapped = run_plan(
        plan,
        plan.program.consts,
        unmapped,
        mapped,
        axes,
        chunk_size=chunk_size,
        remainder=remainder,
        checkpoint=checkpoint,
        progress_meter=progress_meter,
        api=api,
        shard=None,
    )
    return out_mapped, out_unmapped, plan.program.aux, plan.num_passes


def _final(
    plan: Plan,
    fixed: list[Any],
    results: dict[int, list[Array]],
    batch: tuple[list[Array], list[int]],
    progress_meter: AbstractProgressMeter | None,
    api: str,
    **options: Any,
) -> tuple[list[Array], list[Array]]:
    """The outputs: the library's loop over the batch (the mapped leaves and
    their axes), reading every level's results.

    The unmapped outputs (`out_axes=None`) are the loop's unbatched outputs, so
    that `jax.vmap`'s own batching rules say whether they vary (a loop or a `cond`
    that carries a mapped value beside an unmapped one), as without chunks; one
    that varies raises `VaryingUnmappedOutput`.
    """
    shard = options.pop("shard")
    batch_size = _local_size(plan, shard)
    mapped, axes = batch
    num_mapped = plan.program.num_mapped_out

    def _element(_m: list[Array], _position: Array) -> tuple[list[Any], list[Any]]:
        _args = _with_mapped(plan, fixed, _m)
        out = _evaluate(plan, FINAL, _args, results, _position)
        return out[:num_mapped], out[num_mapped:]

    def _chunk_fn(inputs: tuple[list[Array], Array], size: int) -> ChunkOutput:
        del size
        vmapped = jax.vmap(_element, in_axes=(axes, 0), out_axes=(0, None))
        try:
            out, unbatched = vmapped(*inputs)
        except ValueError as e:
            path = batched_none_output(e)
            if path is None or path[:1] != (1,):
                raise
            raise VaryingUnmappedOutput(path[1] if len(path) > 1 else 0) from None
        return ChunkOutput(out, (0,) * len(out), unbatched, None)

    inputs = (list(mapped), _positions(batch_size, shard))
    loops = plan.num_passes + 1
    loop = None if loops == 1 else f"loop {loops} of {loops}"
    if options["chunk_size"] >= batch_size:  # a device's shard in one chunk
        found = reporter(
            progress_meter, api, batch_size, batch_size, options["remainder"], loop
        )
        out = quiet(_chunk_fn, found)(inputs, batch_size)
        report_step(found, jnp.asarray(0), batch_size, out.batched)
        return list(out.batched), list(out.unbatched)
    out = run_in_chunks(
        _chunk_fn,
        inputs,
        (list(axes), 0),
        batch_size=batch_size,
        progress_meter=progress_meter,
        api=api,
        loop=loop,
        **options,
    )
    return list(out.batched), list(out.unbatched)


def _one_vmap(
    fun: ElementFn,
    mapped: list[Array],
    unmapped: list[Array],
    batch_size: int,
    axis_name: Hashable,
) -> tuple[list[Array], list[Any], Any, int]:
    """The whole batch in one `jax.vmap`: no chunk to stage over."""
    aux = []

    def _fun(_mapped: list[Array]) -> tuple[list[Any], list[Any]]:
        out_mapped, out_unmapped, _aux = fun(_mapped, unmapped)
        aux.append(_aux)
        return list(out_mapped), list(out_unmapped)

    vmapped = jax.vmap(
        _fun, out_axes=(0, None), axis_name=axis_name, axis_size=batch_size
    )
    out_mapped, out_unmapped = vmapped(list(mapped))
    return out_mapped, out_unmapped, aux[0], 0


class StagedVmap(NamedTuple):
    """`filter_chunked_vmap`'s call, planned (`plan_staged_vmap`)."""

    plan: Plan
    in_axes: list[int]  # of the mapped leaves


def plan_staged_vmap(
    element: Callable[[PyTree[Array]], tuple[Any, Any, Any]],
    mapped: PyTree[InputArray],
    in_axes: PyTree[int | None],
    *,
    batch_size: int,
    axis_name: Hashable,
    api: str,
) -> StagedVmap:
    """The plan of `filter_chunked_vmap`'s call, with the collectives over
    `axis_name` staged; raises, before anything runs, what cannot be.

    `element(mapped)` is `fun` on one element (`mapped` the mapped leaves without
    their batch axis), returning `(out_mapped, out_unmapped_arrays,
    Static((out_unmapped_static, out_axes)))`, as `_chunked_vmap._evaluate` does;
    `mapped` and `in_axes` are the call's mapped leaves (of the whole batch, of
    `batch_size`) and their axes.
    """
    leaves, treedef = jtu.tree_flatten(mapped)
    axes = list(jtu.tree_leaves(in_axes))

    def _fun(_mapped: list[Array], _unmapped: list[Array]) -> Any:
        del _unmapped
        out_mapped, out_unmapped, static = element(jtu.tree_unflatten(treedef, _mapped))
        flat, unmapped_def = jtu.tree_flatten_with_path(out_unmapped)
        paths = tuple(describe("output", path) for path, _ in flat)
        m, mapped_def = jtu.tree_flatten(out_mapped)
        return m, [x for _, x in flat], (mapped_def, unmapped_def, static, paths)

    elements = [element_struct(a, x) for x, a in zip(leaves, axes, strict=True)]
    plan = plan_staged(
        _fun, elements, [], batch_size=batch_size, axis_name=axis_name, api=api
    )
    return StagedVmap(plan, axes)


def run_staged_vmap(
    staged: StagedVmap,
    consts: list[Any],
    mapped: PyTree[InputArray],
    *,
    chunk_size: int,
    remainder: str,
    checkpoint: CheckpointSpec,
    progress_meter: AbstractProgressMeter | None = None,
    api: str = "filter_chunked_vmap",
    shard: Shard | None = None,
) -> ChunkOutput:
    """What `run_in_chunks` returns for `filter_chunked_vmap`'s chunk function,
    from its staged plan: `consts` are the plan's (`staged.plan.program.consts`,
    or what `shard_map` made of them), `mapped` the call's mapped leaves (this
    device's shard of them with `shard`)."""
    try:
        out_mapped, out_unmapped = run_plan(
            staged.plan,
            consts,
            [],
            jtu.tree_leaves(mapped),
            staged.in_axes,
            chunk_size=chunk_size,
            remainder=remainder,
            checkpoint=checkpoint,
            progress_meter=progress_meter,
            api=api,
            shard=shard,
        )
    except VaryingUnmappedOutput as e:
        paths = staged.plan.program.aux[3]
        where = f"`{paths[e.index]}`" if e.index < len(paths) else "an output"
        raise varying_unmapped(api, where) from None
    return _vmap_output(staged, out_mapped, out_unmapped)


def output_shapes(staged: StagedVmap, size: int) -> ChunkOutput:
    """`run_staged_vmap`'s output for `size` elements, as zeros (for its shapes)."""
    program = staged.plan.program
    avals = [v.aval for v in program.jaxpr.outvars]
    zeros = lambda aval, *batch: jnp.zeros((*batch, *aval.shape), aval.dtype)  # noqa: E731
    k = program.num_mapped_out
    out_mapped = [zeros(aval, size) for aval in avals[:k]]
    out_unmapped = [
        value if untraced else zeros(aval)
        for aval, (untraced, value) in zip(avals[k:], program.kept, strict=True)
    ]
    return _vmap_output(staged, out_mapped, out_unmapped)


def _vmap_output(
    staged: StagedVmap, out_mapped: list[Array], out_unmapped: list[Any]
) -> ChunkOutput:
    mapped_def, unmapped_def, static, _ = staged.plan.program.aux
    out_static, out_axes = static.value
    axes = tuple(jtu.tree_leaves(out_axes))
    moved = [jnp.moveaxis(x, 0, a) for x, a in zip(out_mapped, axes, strict=True)]
    # What no trace computed is returned as it is (`jax.vmap` does the same).
    out_unmapped, kept = keep_untraced(jtu.tree_unflatten(unmapped_def, out_unmapped))
    out_static = eqx.combine(out_static, kept)
    return ChunkOutput(
        jtu.tree_unflatten(mapped_def, moved), axes, out_unmapped, out_static
    )
