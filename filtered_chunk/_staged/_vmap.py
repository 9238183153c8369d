"""Staged collectives, `filter_chunked_vmap`'s face: its call's PyTrees flattened
into the staged program's inputs and outputs, and back.
"""

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from equinox.internal import Static
from jaxtyping import Array, PyTree

from .._axes import describe, varying_unmapped
from .._custom_types import ChunkOutput, InputArray, keep_untraced, LoopOptions
from .._mesh import BatchSharding
from .._structs import element_struct
from ._derivative import run_differentiable
from ._plan import Plan
from ._run import plan_staged, VaryingUnmappedOutput


class StagedVmap(NamedTuple):
    """`filter_chunked_vmap`'s call, planned (`plan_staged_vmap`)."""

    plan: Plan
    in_axes: list[int]  # of the mapped leaves
    sum_match: bool = False  # the unmapped outputs that vary are summed


def plan_staged_vmap(
    element: Callable[[PyTree[Array]], tuple[Any, Any, Any]],
    mapped: PyTree[InputArray],
    in_axes: PyTree[int | None],
    *,
    batch_size: int,
    axis_name: Hashable,
    api: str,
    sum_match: bool = False,
    keep: int = 0,
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
        _fun,
        elements,
        [],
        batch_size=batch_size,
        axis_name=axis_name,
        api=api,
        keep=keep,
    )
    return StagedVmap(plan, axes, sum_match)


def run_staged_vmap(
    staged: StagedVmap,
    consts: list[Any],
    mapped: PyTree[InputArray],
    options: LoopOptions,
    shard: BatchSharding | None = None,
) -> ChunkOutput:
    """What `run_in_chunks` returns for `filter_chunked_vmap`'s chunk function,
    from its staged plan: `consts` are the plan's (`staged.plan.program.consts`,
    or what `shard_map` made of them), `mapped` the call's mapped leaves (this
    device's shard of them with `shard`)."""
    batch = (jtu.tree_leaves(mapped), staged.in_axes)
    try:
        out_mapped, out_unmapped = run_differentiable(
            staged.plan, consts, [], batch, options, shard, staged.sum_match
        )
    except VaryingUnmappedOutput as e:
        paths = staged.plan.program.aux[3]
        where = f"`{paths[e.index]}`" if e.index < len(paths) else "an output"
        raise varying_unmapped(options.api, where) from None
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
    mapped = jtu.tree_unflatten(mapped_def, moved)
    if staged.sum_match:  # as `_chunked_vmap._summed_output`, already summed
        rest, kept = keep_untraced(list(out_unmapped))
        where = (out_static, kept, [False] * len(rest), unmapped_def)
        return ChunkOutput((mapped, []), axes, rest, Static(where))
    # What no trace computed is returned as it is (`jax.vmap` does the same).
    out_unmapped, kept = keep_untraced(jtu.tree_unflatten(unmapped_def, out_unmapped))
    out_static = eqx.combine(out_static, kept)
    return ChunkOutput(mapped, axes, out_unmapped, out_static)
