"""The one chunking core: run a chunk function over a batch, `chunk_size` at a time.

Every public transform (the chunked vmap, the chunked apply, chunked Jacobians) is
a *chunk function* handed to [`run_in_chunks`][]. A chunk function takes the
mapped inputs sliced to `size` elements along their mapped axes and returns

- `batched`: arrays holding the `size` elements along the axes in `batched_axes`;
- `unbatched`: arrays that do not depend on the batch (`out_axes=None`);
- `static`: an `eqx.Module` (typically `eqx.internal.Static`) with everything else.

Memory design: one `lax.scan` writes each chunk into preallocated outputs with
`lax.dynamic_update_slice`, slicing its inputs with `lax.dynamic_slice` inside the
body (checkpointed when differentiated: see `_rule.py`). With
`remainder="overlap"` the `ceil(batch_size / chunk_size)` steps use even chunks of
at most `chunk_size` elements (`balanced_chunk_size`) and the last starts at
`batch_size` minus that size, recomputing fewer elements than there are steps, so
the remainder never needs a second working set or a concatenation. Both alternatives
cost memory: XLA does not share the loop body's buffers with a separate remainder
evaluated after the loop (a second working set: 1.90x the floor on the MLP of
`benchmarks/run.py` at `K = 100`, against 1.01x for the overlapping chunk), and
concatenating the scanned part with the remainder copies every output (as
`jax.lax.map(batch_size=)` does: 1.98x on its per-example gradients).
`tests/test_schedule.py` pins the one scan.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .._convolutions import canonical_convolutions
from .._custom_types import ChunkFn, ChunkOutput, InputArray, Leading, LoopOptions
from .._jax_compat import without_const_values
from .._jaxprs import holds_custom_vjp
from .._reporting import quiet, report_step, reporter
from .._structs import full
from ._accumulate import combine, identity, new_rows, reduce_rows
from ._rule import scan_chunks
from ._scan import relayed
from ._schedule import Schedule, slice_rest, Steps


def _write_one(buffer: Array, chunk: Array, axis: int, start: Any) -> Array:
    if not jax.typeof(buffer).weak_type:
        # `start` is never negative: skipping JAX's wrap-around of negative
        # indices saves a kernel per loop, and compile time (benchmarks/).
        return lax.dynamic_update_slice_in_dim(
            buffer, chunk, start, axis=axis, allow_negative_indices=False
        )
    # `dynamic_update_slice` drops a weak type; a scatter keeps its operand's.
    rows = jnp.arange(chunk.shape[axis], dtype=jnp.result_type(start))
    index = (slice(None),) * axis + (start + rows,)
    return buffer.at[index].set(chunk)


def _write(
    buffers: list[Array],
    chunk: list[Array],
    layout: tuple[tuple[int, ...], tuple[str | None, ...]],
    start: Any,
    first_new: Any = None,
) -> list[Array]:
    """The chunk at `start` written into its buffers or folded into its
    accumulators (`layout`: each output's axis and kind), the rows before
    `first_new` (an earlier step's, if not `None`) left out of them."""
    out = []
    for buf, c, axis, which in zip(buffers, chunk, *layout, strict=True):
        if which is None:
            out.append(_write_one(buf, c, axis, start))
            continue
        size = c.shape[axis]
        mask = None if first_new is None else new_rows(start, first_new, size)
        out.append(combine(which, buf, reduce_rows(which, c, axis, mask)))
    return out


def _buffer(
    struct: jax.ShapeDtypeStruct, axis: int, which: str | None, size: int, fill: Any = 0
):
    """Where an output of `size` rows goes: a buffer (holding `fill` until a
    step writes a row), or an empty accumulator."""
    if which is not None:
        return identity(which, struct, axis)
    # A weakly typed buffer keeps the weak type that `jax.vmap` keeps (for
    # outputs made of Python scalars); `_write_one` keeps it.
    shape = struct.shape[:axis] + (size,) + struct.shape[axis + 1 :]
    return full(struct, shape, fill)


def _reuse(
    buffers: list[Array],
    kinds: tuple[str | None, ...],
    spares: Sequence[Array],
    carried: Sequence[int],
) -> list[Array]:
    """`buffers`, each written one replaced by a spare of its exact type, while
    spares are left. Its rows are all written over, so the spare's tangent is
    none, except for the outputs at the positions `carried`, whose tangents
    the loop writes into the spare's (`_rule.py`, `_carried`)."""
    left = list(spares)
    out = []
    for j, (buf, which) in enumerate(zip(buffers, kinds, strict=True)):
        found = [i for i, x in enumerate(left) if jax.typeof(x) == jax.typeof(buf)]
        if which is None and found:
            buf = left.pop(found[0])
            buf = buf if j in carried else lax.stop_gradient(buf)
        out.append(buf)
    return out


def reduced(out: ChunkOutput) -> ChunkOutput:
    """A chunk function's output for the whole batch in one step: its accumulated
    outputs reduced over their rows, as the loop reduces them."""
    if out.reduce is None:
        return out
    leaves, treedef = jtu.tree_flatten(out.batched)
    leaves = [
        x if which is None else reduce_rows(which, x, axis, None)
        for x, axis, which in zip(leaves, out.batched_axes, out.kinds(), strict=True)
    ]
    return out._replace(batched=jtu.tree_unflatten(treedef, leaves))


def _convert(
    chunk_fn: ChunkFn,
    inputs: PyTree[InputArray],
    in_axes: PyTree[int | None],
    size: int,
) -> tuple[Callable[[PyTree[Array]], tuple[Any, Any]], ChunkOutput]:
    """`chunk_fn` at `size` elements, closure-converted for the loop (see
    `scan_chunks`), and its output's shapes, axes and static part.

    Both come from one trace of `chunk_fn` (that of `eqx.filter_closure_convert`),
    so that `fun` is traced once per loop.
    """
    shapes: list[ChunkOutput] = []

    def _chunk_arrays(chunk: PyTree[Array]) -> tuple[list[Array], PyTree[Array]]:
        out = chunk_fn(chunk, size)
        batched, unbatched = jax.eval_shape(lambda: (out.batched, out.unbatched))
        shapes.append(out._replace(batched=batched, unbatched=unbatched))
        return jtu.tree_leaves(out.batched), out.unbatched

    # An example chunk (dead code under `jit`) carries the inputs' full types:
    # dtype, weak type, sharding, varying manual axes.
    example = jtu.tree_map(
        lambda axis, x: lax.dynamic_slice_in_dim(x, jnp.array(0), size, axis=axis),
        in_axes,
        inputs,
    )
    fn = eqx.filter_closure_convert(_chunk_arrays, example)
    if hasattr(fn, "jaxpr"):
        # Convolutions in the layout of XLA's fast CPU kernels, which it gives
        # only those outside any loop (`_convolutions.py`).
        jaxpr = canonical_convolutions(without_const_values(getattr(fn, "jaxpr")))
        fn = eqx.tree_at(lambda f: getattr(f, "jaxpr"), fn, jaxpr)
    if not shapes:  # not traced (never so for a closure, which this is)
        eqx.filter_eval_shape(_chunk_arrays, example)
    return fn, shapes[0]


class Chain(NamedTuple):
    """What a loop in a chain of loops (a staged call's passes, each reading
    values that an earlier one kept) shares with the others, so that the kept
    values cost memory once rather than once per loop.

    - `spares`: arrays the caller no longer needs. A written output of exactly
      a spare's type is written into it rather than into a new buffer (every
      row is overwritten). XLA gives each loop's outputs memory of their own,
      even once they are dead, but writes a loop's carry in place: so a caller
      running loops one after another keeps the memory of the dead ones in use.
    - `relay`: positions, among the leaves of the loop's inputs, of inputs
      that the loop returns as they are: a later loop that reads one of them
      again should read the returned array. In reverse mode its cotangent then
      accumulates through the loops that read it, one batch-sized buffer in
      all, where each loop would otherwise make one of its own and XLA keep
      them all alive to sum them (`_rule.py`).
    - `carried`: positions, among the batched outputs, of written ones whose
      tangents ride the loop's carry (`_rule.py`, `_carried`), started from the
      tangent of the spare written into, if any: in reverse mode each loop of a
      chain that reads a kept value and keeps the next then passes two
      cotangent buffers back and forth, where each would otherwise make one of
      its own. For outputs that later loops read, not the call's own.
    """

    spares: Sequence[Array] = ()
    relay: Sequence[int] = ()
    carried: Sequence[int] = ()


def run_in_chunks(
    chunk_fn: ChunkFn,
    inputs: PyTree[InputArray],
    in_axes: PyTree[int | None],
    *,
    batch_size: int,
    options: LoopOptions,
    loop: str | None = None,
    chain: Chain = Chain(),
    leading: Leading | None = None,
) -> tuple[ChunkOutput, list[Array]]:
    """Evaluates `chunk_fn` over the whole batch in chunks of `options.chunk_size`.

    Returns what `chunk_fn(inputs, batch_size)` would, with the batched outputs
    at full batch size and the accumulated ones reduced over the batch
    (`reduced`); with `chunk_size >= batch_size`, that one `vmap`. Each step
    reports to the options' progress meter (labelled with their `api`, and
    `loop` if one of several): see `_reporting.py`. Also returns the inputs
    that the loop relays (`chain`: what it shares with the loops before and
    after it). With `leading`, only the steps that hold the leading rows it
    names are evaluated (`_scan.py`).
    """
    if options.chunk_size >= batch_size:
        return _one_vmap(chunk_fn, inputs, batch_size, options, loop, chain.relay)
    steps = Steps.of(batch_size, options.chunk_size, options.remainder)
    found = reporter(options.progress_meter, options.api, steps, loop)
    chunk_fn = quiet(chunk_fn, found)  # nested chunked calls do not report
    chunk_size, num_steps, leftover = steps.chunk_size, steps.num_steps, steps.leftover
    fn, shapes = _convert(chunk_fn, inputs, in_axes, chunk_size)
    axes, kinds = shapes.batched_axes, shapes.kinds()
    layout = (axes, kinds)
    structs = jtu.tree_leaves(shapes.batched)
    fill = 0 if leading is None else leading.fill
    buffers = [
        _buffer(s, a, k, batch_size, fill)
        for s, a, k in zip(structs, *layout, strict=True)
    ]
    if leading is None:  # a spare holds no `fill`: only where every row is written
        buffers = _reuse(buffers, kinds, chain.spares, chain.carried)
    unbatched = jtu.tree_map(lambda s: full(s, s.shape), shapes.unbatched)

    # The derivative of an overlapping last step gives each copy of a recomputed
    # row half its cotangent, which only a backward pass linear in the cotangent
    # sums back exactly: with a `custom_vjp`, it evaluates the leftover apart.
    rest_fn = None
    overlap = num_steps * chunk_size > batch_size
    if overlap and holds_custom_vjp(getattr(fn, "jaxpr", None)):
        rest_fn, _ = _convert(chunk_fn, inputs, in_axes, batch_size % chunk_size)

    def _schedule(
        total: int, size: int, steps: int, found: Any, relay: Sequence[int] = ()
    ) -> Schedule:
        # Steps at `i * size`, the last clamped to end at the batch's end; the
        # loop's JVP rule keeps reverse mode linear in the batch, and checkpoints
        # each step only when differentiated: see `_rule.py`.
        write = lambda _b, _c, start, first: _write(_b, _c, layout, start, first)  # noqa: E731
        return Schedule(
            in_axes,
            axes,
            total,
            size,
            steps,
            options.checkpoint,
            write,
            found,
            kinds,
            tuple(relay),
            tuple(chain.carried),
        )

    whole = _schedule(batch_size, chunk_size, num_steps, found, chain.relay)
    until = None if leading is None else _steps_for(leading.rows, whole)
    buffers, unbatched, relayed = scan_chunks(
        fn, inputs, buffers, unbatched, rest_fn, until, loop=whole
    )
    if leftover != 0:
        one = _schedule(leftover, leftover, 1, None)
        rest = (chunk_fn, inputs, in_axes, structs)
        buffers, unbatched = _separate_rest(rest, buffers, unbatched, one, batch_size)
    batched = jtu.tree_unflatten(jtu.tree_structure(shapes.batched), buffers)
    return shapes._replace(batched=batched, unbatched=unbatched), relayed


def _steps_for(rows: Any, loop: Schedule) -> Array:
    """The number of the loop's steps that hold the first `rows` rows; at least
    one, which computes the unbatched outputs."""
    size = loop.chunk_size
    rows = jnp.asarray(rows).astype(int)
    return jnp.clip((rows + size - 1) // size, 1, loop.num_steps)


def _one_vmap(
    chunk_fn: ChunkFn,
    inputs: PyTree[InputArray],
    batch_size: int,
    options: LoopOptions,
    loop: str | None,
    relay: Sequence[int],
) -> tuple[ChunkOutput, list[Array]]:
    """`run_in_chunks` of a batch not split into chunks: one `vmap`, which
    reports nothing, unless it is one of a call's loops (a staged pass on a
    shard): then it reports one step."""
    steps = Steps(batch_size, batch_size, 1, 0)
    meter = options.progress_meter if batch_size and loop else None
    found = reporter(meter, options.api, steps, loop)
    out = reduced(quiet(chunk_fn, found)(inputs, batch_size))
    report_step(found, jnp.asarray(0), batch_size, out.batched)
    return out, relayed(jtu.tree_leaves(inputs), relay)


def _separate_rest(
    call: tuple[ChunkFn, PyTree[InputArray], PyTree[int | None], list[Any]],
    buffers: list[Array],
    unbatched: PyTree[Array],
    one: Schedule,
    batch_size: int,
) -> tuple[list[Array], PyTree[Array]]:
    """The rows after the whole chunks (`remainder="separate"`: `one`, a loop
    of one step on its own slice of the batch, so that it gets the same
    derivative rule as the loop over whole chunks), written after theirs into
    `buffers` (`call`: the chunk function, its inputs, their axes and the
    outputs' types). An accumulator combines the whole chunks' and its own."""
    chunk_fn, inputs, in_axes, structs = call
    leftover = one.batch_size
    start = batch_size - leftover
    rest = jtu.tree_map(
        lambda axis, x: slice_rest(x, start, leftover, axis), in_axes, inputs
    )
    fn, _ = _convert(chunk_fn, rest, in_axes, leftover)
    layout = (one.axes, one.kinds)
    rest_buffers = [
        _buffer(s, a, k, leftover) for s, a, k in zip(structs, *layout, strict=True)
    ]
    rest_buffers, unbatched, _ = scan_chunks(
        fn, rest, rest_buffers, unbatched, None, None, loop=one
    )
    buffers = [
        _write_one(b, r, a, start) if k is None else combine(k, b, r)
        for b, r, a, k in zip(buffers, rest_buffers, *layout, strict=True)
    ]
    return buffers, unbatched
