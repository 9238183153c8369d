"""Running the staged evaluation, and its oracle `jax.vmap`, in the tests."""

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from filtered_chunk._collectives import element_struct
from filtered_chunk._custom_types import CheckpointSpec, LoopOptions
from filtered_chunk._progress import AbstractProgressMeter
from filtered_chunk._staged import plan_staged, run_plan
from filtered_chunk._staged_program import struct


ElementFn = Callable[[list[Array], list[Array]], tuple[list[Any], list[Any], Any]]


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
    options = LoopOptions(chunk_size, remainder, checkpoint, progress_meter, api)
    out_mapped, out_unmapped = run_plan(
        plan, plan.program.consts, unmapped, (mapped, axes), options, None
    )
    return out_mapped, out_unmapped, plan.program.aux, plan.num_passes


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


def staged_call(fun, mapped, unmapped, chunk_size, remainder="overlap", **kwargs):
    """`run_staged` on a `fun(mapped, unmapped) -> (mapped_out, unmapped_out)`."""
    batch_size = mapped[0].shape[0]
    auxes = []

    # Under `jit`, as the chunked transforms run it: eagerly, every operation
    # would compile on its own.
    @jax.jit
    def _run(_mapped, _unmapped):
        out_mapped, out_unmapped, aux, _ = run_staged(
            lambda m, u: (*fun(m, u), "aux"),
            _mapped,
            _unmapped,
            batch_size=batch_size,
            chunk_size=chunk_size,
            remainder=remainder,
            checkpoint=kwargs.get("checkpoint", True),
            axis_name=kwargs.get("axis_name", "i"),
        )
        auxes.append(aux)
        return out_mapped, out_unmapped

    out = _run(list(mapped), list(unmapped))
    assert auxes == ["aux"]
    return out


def vmap_call(fun, mapped, unmapped, axis_name="i"):
    return jax.vmap(
        lambda m: fun(m, unmapped), out_axes=(0, None), axis_name=axis_name
    )(list(mapped))
