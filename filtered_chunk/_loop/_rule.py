"""The loop over chunks, with a JVP rule that keeps reverse mode linear in the batch.

[`run_in_chunks`][] hands its loop to [`scan_chunks`][]. Evaluated, it is one
`lax.scan` that slices each chunk out of the inputs (scan constants) and writes its
outputs into full-size buffers (scan carries) in place: peak memory is the outputs
plus one chunk's working set. The evaluated loop holds no `jax.checkpoint`, which
only matters to differentiation (and which `checkify` cannot transform): the JVP
rule below is where each step is checkpointed.

Differentiating that loop as written is correct but slow. Reverse mode transposes
the input slices into updates of a full-size cotangent carry and the in-place writes
into reads-then-zeroings of another, and XLA (measured on CPU) copies such a carry
on every step: the gradient of `jnp.sin` over 65,536 x 64 elements in chunks of 64
took 2.6 s against 34 ms for `jax.vmap`, growing as `batch_size**2 / chunk_size`.
So the loop carries a custom JVP rule (via `eqx.filter_custom_jvp`, which keeps
forward mode, `jvp`, `jacfwd` and `hessian`, working): its scan computes the primal
chunks as above, but takes the input tangents as scanned inputs (`xs`, the tangent
sliced into a stack of chunks outside the loop) and returns the output tangents as
scanned outputs (`ys`, reassembled outside). The transpose of a scanned input is a
scanned output and vice versa, so the reverse pass does `O(chunk_size)` work per
step. Tangents of the arrays the chunk function closes over (parameters) stay scan
constants, so their cotangents are summed in the reverse scan's carry rather than
stacked per chunk. To be a custom rule's argument, those arrays are hoisted out of
the chunk function with `eqx.filter_closure_convert`.

A row that two steps compute (the overlap of the last step with `remainder=
"overlap"`) gets half its cotangent on each copy, which is exact for any
transpose that is linear in the cotangent, as JAX's primitives' are. A
`jax.custom_vjp` backward pass is the user's code and need not be (gradient
clipping is not): where the chunk function holds one, `run_in_chunks` passes a
function at the leftover's size (`rest_fn`) and the derivative evaluates only the
rows that no whole chunk covers, so that every row is computed once, as under
`jax.vmap` (`tests/test_derivatives.py`, the tests of a `custom_vjp`). The
evaluated loop keeps its one overlapping step.

An input that the loop *relays* (`run_in_chunks(..., relay=...)`: a stage
boundary that a later loop reads again) is returned as it is, and its tangent
rides the scan's carry instead of being split into a stack: each step reads its
rows, and it leaves the loop as the relayed output's tangent. The transposed loop
then carries the cotangent that the later loops accumulated and adds each step's
rows into it in place, so a boundary that `n` loops read has one batch-sized
cotangent, not `n` that XLA keeps alive to sum after the last
(`tests/test_collectives_boundaries.py`,
`test_kept_cotangent_memory_does_not_grow_with_readers`).

A written output that the caller names (`run_in_chunks(..., carried=...)`: a
stage boundary kept for the next loop) has its tangent in the scan's carry,
which starts from the tangent of the spare it is written into (a dead value
that an earlier loop relayed), if any (`_carried`). The transposed loop reads
the output's cotangent from the carry and zeroes it as it goes, and the zeros go
back through the earlier loop's relay: a chain of loops passes two cotangent
buffers back and forth, where each loop would otherwise make a batch-sized
cotangent in memory of its own (`tests/test_collectives_boundaries.py`,
`test_kept_cotangents_share_two_buffers`).

A cotangent through the loop has the weak type that the chunk function's transpose
gives it, as under `jax.vmap`, not one that the loop's slices, sums or checkpoint
impose: each tangent passes `_weak_types.fork`/`join` where it enters and leaves
the loop (`tests/test_derivatives.py::test_weak_types_of_derivatives_match_jax`).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Int, PyTree

from .._custom_types import CheckpointSpec, InputArray, is_none
from .._reporting import report_step
from .._structs import inexact
from ._accumulate import sum_rows, zeros_like as _zeros_like
from ._schedule import Schedule
from ._weak_types import (
    fork_output,
    fork_outputs,
    fork_tree,
    is_weak as _weak,
    join,
    join_tree,
    strong_and_weak,
)


ArraysFn = Callable[[PyTree[Array]], tuple[list[Array], PyTree[Array]]]


def _as_arrays(tree: PyTree[Any]) -> PyTree[Array]:
    # `eqx.filter_closure_convert` replays a jaxpr, which returns a literal output
    # (a constant) as a Python scalar subclass; make it an array (weak as before).
    return jtu.tree_map(
        lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), tree
    )


def checkpointed(fn: Callable[..., Any], checkpoint: CheckpointSpec) -> Callable:
    """`fn` rematerialised in reverse mode (with a policy), or `fn` itself."""
    if checkpoint is False:
        return fn
    policy = None if checkpoint is True else checkpoint
    # `prevent_cse=False` is safe (and faster) inside a scan: see `jax.checkpoint`.
    return eqx.filter_checkpoint(fn, policy=policy, prevent_cse=False)


def _jvp_step(
    fn: ArraysFn,
    t_fn: Any,
    inputs: PyTree[InputArray],
    start: Int[Array, ""],
    t_chunk: PyTree[Array | None],
    loop: Schedule,
) -> tuple[Any, Any]:
    """One chunk's outputs and their tangents (`None` where the tangent is zero),
    each a strongly and a weakly typed copy (`strong_and_weak`)."""
    primals, tangents = (fn, loop.slice(inputs, start)), (t_fn, t_chunk)
    has_tangent = jtu.tree_map(lambda t: t is not None, tangents, is_leaf=is_none)
    diff, nondiff = eqx.partition(primals, has_tangent)
    t_diff = eqx.filter(tangents, has_tangent, is_leaf=is_none)

    def _call(_diff: Any) -> Any:
        _fn, _chunk = eqx.combine(_diff, nondiff)
        return _as_arrays(_fn(_chunk))

    out, t_out = jax.jvp(_call, (diff,), (t_diff,))
    # Two copies of each tangent, for the weak type of its cotangent (`fork`).
    t_out = jtu.tree_map(
        lambda x, t: strong_and_weak(t) if inexact(x) else None, out, t_out
    )
    return out, t_out


@eqx.filter_custom_jvp
def scan_chunks(
    fn: ArraysFn,
    inputs: PyTree[InputArray],
    buffers: list[Array],
    unbatched: PyTree[Array],
    rest_fn: ArraysFn | None,
    *,
    loop: Schedule,
) -> tuple[list[Array], PyTree[Array], list[Array]]:
    """Runs `fn` on each step's chunk of `inputs`, writing its batched outputs
    into `buffers` with `loop.write`; returns the buffers, the last step's
    unbatched outputs and the inputs that the loop relays (`loop.relay`:
    returned as they are, for a later loop to read; see `_run_jvp`).

    `fn` holds the arrays it closes over as its PyTree leaves (made by
    `eqx.filter_closure_convert`), so that they are arguments of the custom JVP
    rule and get tangents. `rest_fn`, `fn` at the size of the rows that no whole
    chunk covers, makes the derivative evaluate them apart rather than in an
    overlapping step (see the module's docstring); pass `None` rather than omit
    it: `eqx.filter_custom_jvp` fills in no defaults.
    """
    del rest_fn  # only for the derivative (`_run_jvp`)
    # No `jax.checkpoint` here: this loop is only ever evaluated (differentiation
    # goes through `_run_jvp`, which checkpoints), and a `checkpoint` in a program
    # that is never differentiated only gets in other transformations' way
    # (`checkify` cannot transform one in jax 0.10).
    last = loop.batch_size - loop.chunk_size

    def _body(carry: tuple[Any, Any, Any], _: None) -> tuple[Any, None]:
        # Counting the steps in the carry, rather than reading a start per step
        # from an array, compiles to one kernel fewer (benchmarks/).
        _buffers, _, index = carry
        start = jnp.minimum(index * loop.chunk_size, last)
        _chunk, _unbatched = _as_arrays(fn(loop.slice(inputs, start)))
        _buffers = loop.write(_buffers, _chunk, start, loop.first_new(start))
        # After the write: the report reads the written buffers, so it follows the
        # step's work.
        report_step(loop.reporter, start, loop.chunk_size, (_buffers, _unbatched))
        return (_buffers, _unbatched, index + 1), None

    # The default integer type, as in `loop.starts()`: `checkify` compares the
    # index with shapes of that type, which strict dtype promotion requires.
    init = (buffers, unbatched, jnp.zeros((), int))
    (buffers, unbatched, _), _ = lax.scan(_body, init, length=loop.num_steps)
    return buffers, unbatched, _relayed(jtu.tree_leaves(inputs), loop)


def _relayed(leaves: list[Any], loop: Schedule) -> list[Any]:
    return [leaves[i] for i in loop.relay]


@scan_chunks.def_jvp
def _run_jvp(
    primals: tuple[Any, ...], tangents: tuple[Any, ...], *, loop: Schedule
) -> tuple[Any, Any]:
    fn, inputs, buffers, unbatched, rest_fn = primals
    t_fn, t_inputs, t_buffers, _, t_rest_fn = tangents
    # The outputs whose tangents ride carries (`_carried`), each from its buffer's
    # tangent (where the buffer has one: see `_carried`) or from zeros.
    into = _carried(buffers, loop)
    # Every other buffer is zeros made by `run_in_chunks`, or a spare without
    # tangent: never perturbed.
    assert all(t is None or j in into for j, t in enumerate(t_buffers))
    # With a function at the leftover's size, the whole chunks are scanned and the
    # leftover is evaluated on its own: no row is computed twice.
    apart = rest_fn is not None and loop.num_steps > loop.num_whole
    steps = loop.without_overlap() if apart else loop
    # Each tangent reaches the steps, the first step again (for the unbatched
    # outputs) and the leftover: its cotangent keeps the weak type they give it
    # (`_weak_types.py`).
    shapes = [(steps.num_steps, 0), (0,)] + ([(0,)] if apart else [])
    (t_fn, t_inputs), steps_probes, first_probes, *rest_probes = fork_tree(
        (t_fn, t_inputs), shapes
    )
    # A relayed input's tangent rides the carry, each step reading its rows, and
    # leaves the loop as the relayed output's: in reverse mode the cotangent that
    # the later loops give it is carried back through this loop's transpose,
    # each step adding its rows' in place, rather than each loop making a
    # batch-sized cotangent of its own for XLA to sum after them all (which keeps
    # them all alive: `benchmarks/cotangent_reads.py`). Every other tangent is
    # a scanned input, split into a stack of chunks. Below, each input's tangent
    # (`None`: none) and axis (`in_axes` is a prefix of the inputs).
    t_def = jtu.tree_structure(inputs)
    t_leaves = t_def.flatten_up_to(t_inputs)
    axes = t_def.flatten_up_to(
        jtu.tree_map(lambda a, x: jtu.tree_map(lambda _: a, x), loop.in_axes, inputs)
    )
    t_relay = _relayed(t_leaves, loop)
    t_written = [
        _zeros_like(buffers[j]) if t_buffers[j] is None else t_buffers[j] for j in into
    ]
    t_chunks = jtu.tree_unflatten(
        t_def,
        [
            None if t is None or i in loop.relay else steps.split(t, axis)
            for i, (t, axis) in enumerate(zip(t_leaves, axes, strict=True))
        ],
    )
    rows = lambda t, start, i: lax.dynamic_slice_in_dim(  # noqa: E731
        t, start, steps.chunk_size, axes[i], allow_negative_indices=False
    )

    def _with_rows(_t_chunk: Any, carried: list[tuple[int, Any]]) -> Any:
        # Rows of carried tangents (input position, rows), among the chunks'.
        if not carried:
            return _t_chunk
        leaves = t_def.flatten_up_to(_t_chunk)
        for i, t in carried:
            if t is not None:
                leaves[i] = t
        return jtu.tree_unflatten(t_def, leaves)

    def _with_relayed(_t_chunk: Any, _t_relay: list[Any], start: Any) -> Any:
        # Each relayed tangent's rows at `start`, among the chunks' tangents.
        return _with_rows(
            _t_chunk,
            [
                (i, None if t is None else rows(t, start, i))
                for i, t in zip(loop.relay, _t_relay, strict=True)
            ],
        )

    step = checkpointed(_jvp_step, loop.checkpoint)
    # The tangents of accumulated sums are summed in the carry, as their primals
    # are: their size, not the batch's (`_accumulate.py`).
    t_sums = [
        _zeros_like(b) if which == "sum" and inexact(b) else None
        for b, which in zip(buffers, loop.kinds, strict=True)
    ]

    def _body(carry: tuple[Any, ...], xs: tuple[Any, ...]) -> tuple[Any, Any]:
        _buffers, _, _t_sums, _t_relay, _t_written = carry
        start, _t_chunk, _probes = xs
        _t_chunk = _with_relayed(_t_chunk, _t_relay, start)
        _t_fn, _t_chunk = join_tree((t_fn, _t_chunk), _probes)
        (_chunk, _unbatched), (_t_out, _) = step(
            fn, _t_fn, inputs, start, _t_chunk, loop
        )
        _buffers = loop.write(_buffers, _chunk, start, steps.first_new(start))
        # Its operands are primal values: reverse mode reports in the forward pass.
        report_step(loop.reporter, start, loop.chunk_size, (_buffers, _unbatched))
        _t_out, _out_probes = fork_outputs(_t_out)
        _t_sums = [
            acc if acc is None else acc + steps.row_sum(t, axis, start)
            for acc, t, axis in zip(_t_sums, _t_out, loop.axes, strict=True)
        ]
        _t_out = [None if k is not None else t for t, k in zip(_t_out, loop.kinds)]
        _t_written = [
            _write_rows(t, _t_out[j], start, steps, loop.axes[j])
            for j, t in zip(into, _t_written, strict=True)
        ]
        _t_out = [None if j in into else t for j, t in enumerate(_t_out)]
        # `+ 0`, which XLA removes, so that JAX does not see the carry pass through
        # unchanged: it would hoist it out of the loop, and the transposed loop
        # would start its cotangent from zeros rather than from the later loops'.
        _t_relay = [None if t is None else t + 0 for t in _t_relay]
        carry = (_buffers, _unbatched, _t_sums, _t_relay, _t_written)
        return carry, (_t_out, _out_probes)

    init = (buffers, unbatched, t_sums, t_relay, t_written)
    (buffers, unbatched, t_sums, t_relay, t_written), (t_stacks, out_probes) = lax.scan(
        _body, init, (steps.starts(), t_chunks, steps_probes)
    )
    # An accumulated sum's tangent is its carry; a running maximum's is zero; a
    # carried one's is its carry (see `_covered`).
    t_stacks = [t if s is None else s for t, s in zip(t_stacks, t_sums, strict=True)]
    for j, t in zip(into, t_written, strict=True):
        t_stacks[j] = t
    if rest_fn is not None and apart:
        buffers, t_rows, out_probes = _leftover(
            step,
            rest_fn,
            t_rest_fn,
            (inputs, t_inputs),
            rest_probes[0],
            buffers,
            (t_stacks, out_probes),
            loop,
            tuple(into),
        )
    else:
        t_rows = [
            None
            if t is None
            else t
            if which is not None
            else _covered(t, steps, axis)
            if j in into
            else loop.merge(t, axis)
            for j, (t, axis, which) in enumerate(
                zip(t_stacks, loop.axes, loop.kinds, strict=True)
            )
        ]
    t_buffers = [
        _zero_tangent(b) if t is None else join(t, probe, _weak(b))
        for t, probe, b in zip(t_rows, out_probes, buffers, strict=True)
    ]
    t_first = jtu.tree_map(lambda t: None if t is None else t[0], t_chunks)
    t_first = _with_relayed(t_first, t_relay, jnp.array(0))
    t_first = join_tree((t_fn, t_first), first_probes)
    t_unbatched = _unbatched_tangents(step, fn, inputs, t_first, unbatched, loop)
    t_unbatched = jtu.tree_map(
        lambda u, t: _zero_tangent(u) if t is None else join(*fork_output(t), _weak(u)),
        unbatched,
        t_unbatched,
    )
    relayed = _relayed(jtu.tree_leaves(inputs), loop)
    t_relayed = [
        _zero_tangent(x) if t is None else t
        for x, t in zip(relayed, t_relay, strict=True)
    ]
    return (buffers, unbatched, relayed), (t_buffers, t_unbatched, t_relayed)


def _carried(buffers: list[Array], loop: Schedule) -> tuple[int, ...]:
    """The written outputs whose tangents ride carries: those that
    `loop.carried` names, written (not accumulated), inexact and not weak.

    XLA gives each loop's outputs memory of their own, but writes a loop's carry
    in place. A written output's tangent, a scanned output, is transposed into a
    cotangent split into chunks, a scanned input; in a chain of loops that each
    read a batch-sized value and write the next (stage boundaries kept), each
    transposed loop would make one more batch-sized cotangent, all alive at
    once. So such an output's tangent is written into a carry, which starts
    from its buffer's tangent where the caller passes a buffer with one (a dead
    value that an earlier loop relayed, of the same type: its rows are all
    written over), else from zeros. In reverse mode the transposed loop reads
    the output's cotangent from that carry and zeroes it as it goes; the zeros
    go back, through the earlier loop's relay, to start the carry in which the
    earlier loop's transpose adds the cotangent of the value it read. A chain
    then passes two cotangent buffers back and forth, in place.

    Two carries, not one that the read value's cotangent is written over the
    kept one's in: the transposed step would read the output's cotangent from
    the carry that it writes the input's into, so under forward mode over
    reverse (`jax.hessian`) a constant cotangent (a loss that is a plain sum)
    would have a tangent of zeros rather than none, and `0 * inf` make `nan` of
    an infinite derivative where `jax.vmap` keeps it (`tests/test_nonfinite.py`).
    """
    return tuple(
        j
        for j, (b, which) in enumerate(zip(buffers, loop.kinds, strict=True))
        if j in loop.carried and which is None and inexact(b) and not _weak(b)
    )


def _write_rows(carry: Array, t: Any, start: Any, steps: Schedule, axis: int) -> Array:
    """A step's rows `t` of an output's tangent written into `carry` at `start`.

    A row that an overlapping last step computes again gets the mean of its two
    copies (the carry's rows before the step, and `t`), as `Schedule.merge`
    gives it."""
    assert t is not None  # an inexact output's tangent
    if steps.overlaps:
        last = steps.batch_size - steps.chunk_size
        twice = steps.num_whole * steps.chunk_size - last  # the overlap's rows
        old = lax.dynamic_slice_in_dim(carry, start, twice, axis)
        mean = 0.5 * (old + lax.slice_in_dim(t, 0, twice, axis=axis))
        mixed = jnp.concatenate(
            [mean, lax.slice_in_dim(t, twice, None, axis=axis)], axis
        )
        # A scalar predicate: a residual of a step, not a chunk of them.
        t = lax.select_n(start == last, t, mixed)
    return lax.dynamic_update_slice_in_dim(
        carry, t, start, axis, allow_negative_indices=False
    )


def _covered(t: Array, steps: Schedule, axis: int) -> Array:
    """A carried tangent, zero in the rows that no step writes (a separate
    remainder's, which `run_in_chunks` evaluates in a loop of its own), as
    `Schedule.merge` leaves them: the carry started from a buffer's tangent."""
    covered = steps.num_steps * steps.chunk_size
    if covered >= steps.batch_size:
        return t
    shape = list(t.shape)
    shape[axis] = steps.batch_size - covered
    rest = jnp.zeros(shape, t.dtype)
    return lax.dynamic_update_slice_in_dim(t, rest, covered, axis)


def _zero_tangent(x: Array) -> Any:
    """The zero tangent of an output that has none (an integer one, a running
    maximum): explicit, since Equinox 0.13.1 makes one with an API that JAX 0.10
    removed."""
    if inexact(x):
        return _zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _leftover(
    step: Callable[..., Any],
    rest_fn: ArraysFn,
    t_rest_fn: Any,
    inputs_and_tangents: tuple[PyTree[InputArray], PyTree[InputArray | None]],
    probes: Any,
    buffers: list[Array],
    scanned: tuple[list[Any], list[Any]],
    loop: Schedule,
    carried: tuple[int, ...],
) -> tuple[list[Array], list[Any], list[Any]]:
    """The leftover's rows, evaluated apart: written into `buffers`, their
    tangents after the whole chunks' (`scanned`: stacks and their probes, or for
    the outputs at the positions `carried`, a carried tangent, whose leftover rows
    are still its spare's)."""
    inputs, t_inputs = inputs_and_tangents
    rest = loop.leftover()
    covered = loop.num_whole * loop.chunk_size
    start = jnp.asarray(covered)
    t_rest_fn, fn_probes = fork_tree(t_rest_fn, [(0,)])
    t_rest = jtu.tree_map(
        lambda axis, t: (
            None if t is None else lax.slice_in_dim(t, covered, None, axis=axis)
        ),
        loop.in_axes,
        t_inputs,
        is_leaf=is_none,
    )
    t_rest_fn, t_rest = join_tree((t_rest_fn, t_rest), (fn_probes, probes[1]))
    (chunk, _), (t_out, _) = step(rest_fn, t_rest_fn, inputs, start, t_rest, rest)
    buffers = loop.write(buffers, chunk, start, None)
    report_step(loop.reporter, start, rest.chunk_size, buffers)
    t_out, rest_probes = fork_outputs(t_out)
    whole = loop.without_overlap()
    t_rows, probes_out = [], []
    for j, (t, probe, t_last, last_probe, axis, which) in enumerate(
        zip(*scanned, t_out, rest_probes, loop.axes, loop.kinds, strict=True)
    ):
        if t is None:
            t_rows.append(None)
            probes_out.append(None)
            continue
        # Both probes see the cotangent of the whole output.
        if j in carried:
            t = lax.dynamic_update_slice_in_dim(t, t_last, covered, axis)
            t_rows.append(join(t, probe))
        elif which is None:
            t_rows.append(join(whole.merge(t, axis, t_last), probe))
        else:  # an accumulated sum: the carry's and the leftover's rows
            t_rows.append(join(t + sum_rows(t_last, axis), probe))
        probes_out.append(last_probe)
    return buffers, t_rows, probes_out


def _unbatched_tangents(
    step: Callable[..., Any],
    fn: ArraysFn,
    inputs: PyTree[InputArray],
    t_first: tuple[Any, PyTree[InputArray | None]],
    unbatched: PyTree[Array],
    loop: Schedule,
) -> PyTree[InputArray | None]:
    """The tangents of the unbatched outputs, from the first step alone.

    Every step computes the same unbatched outputs, and the loop returns the last
    step's. Taking their tangents from the loop would give every other step a
    zero cotangent in reverse mode, and `0 * inf = nan` (an infinite derivative
    w.r.t. a parameter). So they come from one more evaluation of the first step
    (only of what the unbatched outputs need, under `jit`), whose transpose is the
    only one to see their cotangent.
    """
    if not any(inexact(u) for u in jtu.tree_leaves(unbatched)):
        return jtu.tree_map(lambda _: None, unbatched)
    t_fn, t_chunk = t_first
    _, (_, t_unbatched) = step(fn, t_fn, inputs, jnp.array(0), t_chunk, loop)
    return t_unbatched
