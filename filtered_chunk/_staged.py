"""Collectives over the mapped axis across chunks, exactly: staged evaluation.

A collective over `axis_name` needs the whole batch, but a chunked loop sees one
chunk at a time. [`run_staged`][] evaluates `fun` in passes over the batch instead
(`_staged_plan.py` says which): pass `s` is one chunked loop that computes only the
operands of the collectives of level `s`, with the results of lower levels as
unmapped values, and accumulates them across chunks (`_staged_passes.py`); the last
pass is the library's loop ([`run_in_chunks`][]), computing the mapped outputs, and
the unmapped outputs are computed once. So `psum`, `pmean`, `pmax`, `pmin`,
`axis_index`, `axis_size`, `all_gather`, `ppermute`, `psum_scatter` and `all_to_all`
give `jax.vmap`'s results (up to the order of floating-point sums), with a working
set of one chunk per pass plus the collectives' results and gather buffers.

Cost: `num_passes + 1` loops, each recomputing what its level needs (a dependency
depth of `d` costs up to `d + 1` evaluations of the prefix of `fun`). Every pass's
chunks are rematerialised in reverse mode (`checkpoint`), which keeps gradients
bounded too: without it, the residuals of every pass's chunks would be kept.
"""

import functools as ft
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, PyTree

from ._axes import describe
from ._chunking import balanced_chunk_size, ChunkOutput, run_in_chunks
from ._custom_types import CheckpointSpec, InputArray, keep_untraced
from ._derivatives import checkpointed
from ._progress import AbstractProgressMeter
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
    UNMAPPED,
    VaryingUnmappedOutput,
)
from ._staged_program import axis_names, bind, staged_program, struct


ElementFn = Callable[[list[Array], list[Array]], tuple[list[Any], list[Any], Any]]


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
) -> dict[int, list[Array]]:
    """The results of the level's collectives, from one chunked loop.

    The chunks are scanned over as stacked inputs (`xs`), so that reverse mode
    transposes them into stacked cotangents, with no batch-sized carry.
    """
    batch_size = plan.program.batch_size
    if remainder == "overlap":
        chunk_size = balanced_chunk_size(batch_size, chunk_size)
    whole, leftover = divmod(batch_size, chunk_size)
    operands = _operands(plan, level)
    reductions = [(w, a) for _, w, a in operands if w != "gather"]
    step = checkpointed(ft.partial(_chunk, plan, level), checkpoint)
    positions = jnp.arange(batch_size)
    stack = lambda x: x[: whole * chunk_size].reshape(whole, chunk_size, *x.shape[1:])  # noqa: E731

    def _body(acc: list[Any], xs: tuple[list[Array], Array]) -> tuple[Any, Any]:
        partial, gathered = step(fixed, results, *xs, None)
        return [
            combine(w, a, p) for (w, _), a, p in zip(reductions, acc, partial)
        ], gathered

    init = [initial(w, a) for w, a in reductions]
    xs = ([stack(x) for x in mapped], stack(positions))
    acc, gathered = lax.scan(_body, init, xs)
    gathered = [g.reshape(whole * chunk_size, *g.shape[2:]) for g in gathered]
    if leftover:
        overlap = remainder == "overlap"
        start = batch_size - chunk_size if overlap else whole * chunk_size
        mask = None
        if overlap:  # the rows that earlier chunks computed count once
            mask = jnp.asarray(np.arange(start, batch_size) >= whole * chunk_size)
        rest = ([x[start:] for x in mapped], positions[start:])
        partial, last = step(fixed, results, *rest, mask)
        acc = [combine(w, a, p) for (w, _), a, p in zip(reductions, acc, partial)]
        skip = chunk_size - leftover if overlap else 0
        gathered = [jnp.concatenate([g, x[skip:]]) for g, x in zip(gathered, last)]
    return _results(plan, level, acc, gathered)


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
    that leaf). `progress_meter` (labelled `api`) counts the final pass.

    Returns `(mapped_out, unmapped_out, aux, num_passes)`: the mapped outputs with
    the batch on axis 0; the unmapped outputs, which must not vary over the batch
    (else `VaryingUnmappedOutput`), those that no trace computed as they are (as
    `jax.vmap` returns them); `aux` from tracing `fun`; and the number of passes
    before the final one. Raises a `ValueError` naming the collective where it
    cannot be computed exactly (see `_staged_program.py`).
    """
    if in_axes is not None:
        mapped = [jnp.moveaxis(x, a, 0) for x, a in zip(mapped, in_axes, strict=True)]
    if not 0 < chunk_size < batch_size:
        return _one_vmap(fun, mapped, unmapped, batch_size, axis_name)
    elements = [
        jax.ShapeDtypeStruct(x.shape[1:], x.dtype, weak_type=jax.typeof(x).weak_type)
        for x in mapped
    ]
    program = staged_program(
        fun, elements, [struct(x) for x in unmapped], axis_name, batch_size, api
    )
    plan = make_plan(program, api)
    check_custom_rules(program, api)
    fixed = list(program.consts) + list(unmapped)
    results: dict[int, list[Array]] = {}
    options: dict[str, Any] = dict(
        chunk_size=chunk_size, remainder=remainder, checkpoint=checkpoint
    )
    for level in range(1, plan.num_passes + 1):
        results.update(_pass(plan, level, fixed, dict(results), mapped, **options))
    out_mapped = _final(plan, fixed, results, mapped, progress_meter, api, **options)
    args = _with_mapped(plan, fixed, [None] * program.num_mapped_in)
    out_unmapped = _evaluate(plan, UNMAPPED, args, results, None)
    out_unmapped = [
        value if untraced else x
        for x, (untraced, value) in zip(out_unmapped, program.kept, strict=True)
    ]
    return out_mapped, out_unmapped, program.aux, plan.num_passes


def _final(
    plan: Plan,
    fixed: list[Any],
    results: dict[int, list[Array]],
    mapped: list[Array],
    progress_meter: AbstractProgressMeter | None,
    api: str,
    **options: Any,
) -> list[Array]:
    """The mapped outputs: the library's loop, reading every level's results."""
    batch_size = plan.program.batch_size

    def _chunk_fn(inputs: tuple[list[Array], Array], size: int) -> ChunkOutput:
        del size
        _mapped, _positions = inputs

        def _element(_m: list[Array], _position: Array) -> list[Any]:
            _args = _with_mapped(plan, fixed, _m)
            return _evaluate(plan, FINAL, _args, results, _position)

        out = jax.vmap(_element)(_mapped, _positions)
        return ChunkOutput(out, (0,) * len(out), [], None)

    inputs = (list(mapped), jnp.arange(batch_size))
    in_axes = ([0] * len(mapped), 0)
    out = run_in_chunks(
        _chunk_fn,
        inputs,
        in_axes,
        batch_size=batch_size,
        progress_meter=progress_meter,
        api=api,
        **options,
    )
    return list(out.batched)


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


def run_staged_vmap(
    element: Callable[[PyTree[Array]], tuple[Any, Any, Any]],
    mapped: PyTree[InputArray],
    in_axes: PyTree[int | None],
    *,
    batch_size: int,
    chunk_size: int,
    remainder: str,
    checkpoint: CheckpointSpec,
    axis_name: Hashable,
    progress_meter: AbstractProgressMeter | None = None,
    api: str = "filter_chunked_vmap",
) -> ChunkOutput:
    """What `run_in_chunks` returns for `filter_chunked_vmap`'s chunk function,
    with the collectives over `axis_name` staged: the call for the dispatch.

    `element(mapped)` is `fun` on one element (`mapped` the mapped leaves without
    their batch axis), returning `(out_mapped, out_unmapped_arrays,
    Static((out_unmapped_static, out_axes)))`, as `_chunked_vmap._evaluate` does;
    `mapped` and `in_axes` are the call's mapped leaves and their axes.
    """
    leaves, treedef = jtu.tree_flatten(mapped)
    paths: list[str] = []

    def _fun(_mapped: list[Array], _unmapped: list[Array]) -> Any:
        del _unmapped
        out_mapped, out_unmapped, static = element(jtu.tree_unflatten(treedef, _mapped))
        flat, unmapped_def = jtu.tree_flatten_with_path(out_unmapped)
        paths[:] = [describe("output", path) for path, _ in flat]
        m, mapped_def = jtu.tree_flatten(out_mapped)
        return m, [x for _, x in flat], (mapped_def, unmapped_def, static)

    try:
        out_mapped, out_unmapped, aux, _ = run_staged(
            _fun,
            leaves,
            [],
            batch_size=batch_size,
            chunk_size=chunk_size,
            remainder=remainder,
            checkpoint=checkpoint,
            axis_name=axis_name,
            in_axes=list(jtu.tree_leaves(in_axes)),
            api=api,
            progress_meter=progress_meter,
        )
    except VaryingUnmappedOutput as e:
        raise ValueError(
            f"`{api}(..., out_axes=...)` gives `None` for `{paths[e.index]}`, but it "
            "varies over the batch. An output marked `None` must not depend on the "
            "mapped inputs; give it an integer out axis to map it instead."
        ) from None
    mapped_def, unmapped_def, static = aux
    out_static, out_axes = static.value
    axes = tuple(jtu.tree_leaves(out_axes))
    moved = [jnp.moveaxis(x, 0, a) for x, a in zip(out_mapped, axes, strict=True)]
    # What no trace computed is returned as it is (`jax.vmap` does the same).
    out_unmapped, kept = keep_untraced(jtu.tree_unflatten(unmapped_def, out_unmapped))
    out_static = eqx.combine(out_static, kept)
    return ChunkOutput(
        jtu.tree_unflatten(mapped_def, moved), axes, out_unmapped, out_static
    )
