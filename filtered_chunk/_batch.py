"""The batch a plan hands over, and how it runs: [`run_batch`][], after the one
collective analysis (`_staged/_analysis.py`), runs one `vmap`, the loop
(`_loop/`) or the staged loops (`_staged/`), per device if the batch is sharded
(`_sharding.py`)."""

import functools as ft
from collections.abc import Callable
from typing import Any

from jaxtyping import PyTree

from ._custom_types import Batch as Batch, ChunkFn, ChunkOutput, InputArray, LoopOptions
from ._gate import gated, unpadded
from ._loop import reduced, run_in_chunks
from ._mesh import BatchSharding
from ._sharding import run_sharded
from ._staged import (
    collective_mode,
    NONE,
    output_shapes,
    plan_staged_vmap,
    run_staged_vmap,
    STAGED,
    StagedVmap,
    WHOLE,
)
from ._staged._cost import plan_cost
from ._wrapper import ChunkOptions, kept_every


def _collectives(
    batch: Batch,
    chunk_size: int | None,
    options: ChunkOptions,
    sharding: BatchSharding | None,
) -> str:
    """What collectives over `axis_name` make of the batch (`_staged/_analysis.py`)."""
    if batch.element is None:
        return NONE
    return collective_mode(
        ft.partial(batch.element, batch.closed),
        batch.mapped,
        batch.in_axes,
        options.axis_name,
        batch_size=batch.size,
        chunk_size=chunk_size,
        sharding=sharding,
    )


def staged_cost(
    batch: Batch,
    chunk_size: int,
    options: ChunkOptions,
    sharding: BatchSharding | None = None,
) -> tuple[int, int, float]:
    """The passes over the batch that staged collectives take before the final
    loop at `chunk_size` with `options.keep_boundaries`, the bytes of the values
    they keep for the whole batch, and the estimated work of the loops against
    evaluating `fun` once for each element (`_staged/_cost.py`); `(0, 0, 1.0)`
    if the batch is not staged."""
    if _collectives(batch, chunk_size, options, sharding) != STAGED:
        return 0, 0, 1.0
    plan = _plan(batch, options).plan
    kept, work = plan_cost(plan, chunk_size)
    return plan.num_passes, kept * batch.size, work


def run_batch(
    batch: Batch,
    chunk_size: int | None,
    options: ChunkOptions,
    sharding: BatchSharding | None = None,
) -> ChunkOutput:
    """`batch.chunk` over the batch: one `vmap`, or the loop over chunks of
    `chunk_size`, or the staged loops for collectives over `axis_name`; on each
    device's shard if `sharding` splits it."""
    collectives = _collectives(batch, chunk_size, options, sharding)
    uneven = sharding is not None and batch.size % sharding.num_devices
    if uneven and collectives == NONE:
        # Split over devices that do not divide it: padded, its padding skipped.
        gate = gated(batch, batch.size, 0, sharding)
        out = run_batch(gate, chunk_size, options, sharding)
        return unpadded(out, batch.size, sharding)
    if collectives == WHOLE:
        # One `vmap` of the whole batch, as `eqx.filter_vmap`: XLA computes a
        # collective across the devices.
        return _run_local(batch, None, options)
    if collectives == STAGED:
        assert chunk_size is not None
        local, closed, shapes = _staged(batch, chunk_size, options, sharding)
    else:
        # What the batch closes over is an input of `local`: inside `shard_map`,
        # closing over tracers breaks its transpose.
        on_device = batch._replace(closed=None, mapped=None, size=0)
        local = ft.partial(_on_device, on_device, chunk_size, options)
        closed, shapes = batch.closed, ft.partial(batch.chunk, batch.closed)
    if sharding is None:
        return local(closed, batch.mapped, batch.size)
    # Each device runs `local` on its own shard: see `_sharding.py`.
    return run_sharded(
        local,
        closed,
        shapes,
        batch.mapped,
        batch.in_axes,
        batch_size=batch.size,
        sharding=sharding,
        api=options.api,
        check_vma=batch.check_vma and collectives != STAGED,
        elements=batch.size - batch.padding,
    )


def _on_device(
    batch: Batch, chunk_size: int | None, options: ChunkOptions, *local: Any
) -> ChunkOutput:
    """`_run_local` on one device's `closed, mapped, size`."""
    closed, mapped, size = local
    return _run_local(
        batch._replace(closed=closed, mapped=mapped, size=size), chunk_size, options
    )


def _loop_options(chunk_size: int, options: ChunkOptions) -> LoopOptions:
    o = options
    return LoopOptions(chunk_size, o.remainder, o.checkpoint, o.progress_meter, o.api)


def _run_local(
    batch: Batch, chunk_size: int | None, options: ChunkOptions
) -> ChunkOutput:
    """One `vmap` of the batch, or the loop over its chunks."""
    chunk_fn: ChunkFn = ft.partial(batch.chunk, batch.closed)
    if chunk_size is None:
        return reduced(chunk_fn(batch.mapped, batch.size))
    if batch.check is not None and chunk_size < batch.size:
        batch.check(batch.closed, batch.mapped, chunk_size)
    leading = batch.leading
    out, _ = run_in_chunks(
        chunk_fn,
        batch.mapped,
        batch.in_axes,
        batch_size=batch.size,
        options=_loop_options(chunk_size, options),
        leading=None if leading is None else leading(batch.closed, batch.mapped),
    )
    return out


def _staged(
    batch: Batch,
    chunk_size: int,
    options: ChunkOptions,
    sharding: BatchSharding | None,
) -> tuple[Callable[..., ChunkOutput], list[Any], Callable[..., ChunkOutput]]:
    """The staged loops (`_staged/`) as `run_sharded` takes a local run: the run,
    what it closes over (the plan's constants, inputs of `shard_map`), and its
    output's shapes at a shard's size.

    The call is planned once, for the whole batch and outside any `shard_map`.
    """
    staged = _plan(batch, options)
    loop = _loop_options(chunk_size, options)

    def _local(consts: list[Any], mapped: PyTree[InputArray], _: int) -> ChunkOutput:
        return run_staged_vmap(staged, consts, mapped, loop, sharding)

    shapes = lambda _, size: output_shapes(staged, size)  # noqa: E731
    return _local, staged.plan.program.consts, shapes


def _plan(batch: Batch, options: ChunkOptions) -> StagedVmap:
    """The staged plan of the batch, planned once for the whole batch and outside
    any `shard_map`."""
    assert batch.element is not None
    return plan_staged_vmap(
        ft.partial(batch.element, batch.closed),
        batch.mapped,
        batch.in_axes,
        batch_size=batch.size,
        axis_name=options.axis_name,
        api=options.api,
        sum_match=batch.sum_match,
        keep=kept_every(options.keep_boundaries),
    )
