"""The one chunking core: run a chunk function over a batch, `chunk_size` at a time.

Every public transform (the chunked vmap, the chunked apply, chunked Jacobians) is
a *chunk function* handed to [`run_in_chunks`][]. A chunk function takes the
mapped inputs sliced to `size` elements along their mapped axes and returns

- `batched`: arrays holding the `size` elements along the axes in `batched_axes`;
- `unbatched`: arrays that do not depend on the batch (`out_axes=None`);
- `static`: an `eqx.Module` (typically `eqx.internal.Static`) with everything else.

Memory design (see `shared/MEASUREMENTS.md`): one `lax.scan` writes each chunk into
preallocated outputs with `lax.dynamic_update_slice`, slicing its inputs with
`lax.dynamic_slice` inside the (optionally checkpointed) body. With
`remainder="overlap"` the last of `ceil(batch_size / chunk_size)` steps starts at
`batch_size - chunk_size`, recomputing fewer than `chunk_size` elements, so the
remainder never needs a second working set or a concatenation.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Int, PyTree


class ChunkOutput(NamedTuple):
    batched: PyTree[Array]
    batched_axes: tuple[int, ...]
    unbatched: PyTree[Array]
    static: Any


ChunkFn = Callable[[PyTree[Array], int], ChunkOutput]
CheckpointSpec = bool | Callable[..., Any]


def slice_inputs(
    inputs: PyTree[Array],
    in_axes: PyTree[int | None],
    start: Int[Array, ""] | int,
    size: int,
) -> PyTree[Array]:
    """Slices `size` elements starting at `start` along each leaf's mapped axis."""

    def _slice(axis: int, x: Array) -> Array:
        return lax.dynamic_slice_in_dim(x, start, size, axis=axis)

    return jtu.tree_map(_slice, in_axes, inputs)


def _zeros(struct: jax.ShapeDtypeStruct) -> Array:
    return jnp.zeros(struct.shape, struct.dtype)


def _grow(struct: jax.ShapeDtypeStruct, axis: int, batch_size: int) -> Array:
    shape = list(struct.shape)
    shape[axis] = batch_size
    return jnp.zeros(shape, struct.dtype)


def _write(buffers: list[Array], chunk: list[Array], axes: tuple[int, ...], start):
    return [
        lax.dynamic_update_slice_in_dim(buf, c, start, axis=axis)
        for buf, c, axis in zip(buffers, chunk, axes, strict=True)
    ]


def _maybe_checkpoint(fn: Callable[..., Any], checkpoint: CheckpointSpec):
    if checkpoint is False:
        return fn
    policy = None if checkpoint is True else checkpoint
    # `prevent_cse=False` is safe (and faster) inside a scan: see `jax.checkpoint`.
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


def run_in_chunks(
    chunk_fn: ChunkFn,
    inputs: PyTree[Array],
    in_axes: PyTree[int | None],
    *,
    batch_size: int,
    chunk_size: int,
    remainder: str,
    checkpoint: CheckpointSpec,
) -> ChunkOutput:
    """Evaluates `chunk_fn` over the whole batch in chunks of `chunk_size`.

    Requires `0 < chunk_size < batch_size`; returns what `chunk_fn(inputs,
    batch_size)` would, with the batched outputs at full batch size.
    """
    assert 0 < chunk_size < batch_size
    num_chunks, leftover = divmod(batch_size, chunk_size)

    def _step(size: int) -> Callable[[PyTree[Array], Any], tuple[Any, Any]]:
        def _arrays(_inputs: PyTree[Array], start: Any) -> tuple[Any, Any]:
            # Slice inside the checkpointed region, so that reverse mode saves the
            # (already live) inputs rather than a copy of every chunk.
            out = chunk_fn(slice_inputs(_inputs, in_axes, start, size), size)
            return jtu.tree_leaves(out.batched), out.unbatched

        return _maybe_checkpoint(_arrays, checkpoint)

    shapes = eqx.filter_eval_shape(
        lambda _inputs: chunk_fn(
            slice_inputs(_inputs, in_axes, 0, chunk_size), chunk_size
        ),
        inputs,
    )
    axes = shapes.batched_axes
    buffers = [
        _grow(s, a, batch_size)
        for s, a in zip(jtu.tree_leaves(shapes.batched), axes, strict=True)
    ]
    unbatched = jtu.tree_map(_zeros, shapes.unbatched)
    step = _step(chunk_size)
    overlap = remainder == "overlap" and leftover != 0
    num_steps = num_chunks + 1 if overlap else num_chunks

    def _body(carry: tuple[Any, Any], index: Int[Array, ""]) -> tuple[Any, None]:
        _buffers, _ = carry
        start = index * chunk_size
        if overlap:
            start = jnp.minimum(start, batch_size - chunk_size)
        _chunk, _unbatched = step(inputs, start)
        return (_write(_buffers, _chunk, axes, start), _unbatched), None

    (buffers, unbatched), _ = lax.scan(
        _body, (buffers, unbatched), jnp.arange(num_steps)
    )
    if leftover != 0 and not overlap:
        start = batch_size - leftover
        _chunk, unbatched = _step(leftover)(inputs, start)
        buffers = _write(buffers, _chunk, axes, start)
    batched = jtu.tree_unflatten(jtu.tree_structure(shapes.batched), buffers)
    return ChunkOutput(batched, axes, unbatched, shapes.static)
