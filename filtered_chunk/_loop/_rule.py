"""The loop's JVP rule, which keeps reverse mode linear in the batch.

[`run_in_chunks`][] hands its loop to [`scan_chunks`][], evaluated as one
`lax.scan` (`_scan.py`). Differentiating that loop as written is correct but
slow. Reverse mode transposes the input slices into updates of a full-size
cotangent carry and the in-place writes into reads-then-zeroings of another, and
XLA (measured on CPU) copies such a carry on every step: the gradient of
`jnp.sin` over 65,536 x 64 elements in chunks of 64 took 2.6 s against 34 ms for
`jax.vmap`, growing as `batch_size**2 / chunk_size`.

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
"overlap"`) gets half its cotangent on each copy, which is exact for any transpose
that is linear in the cotangent, as JAX's primitives' are. A `jax.custom_vjp`
backward pass is the user's code and need not be (gradient clipping is not):
where the chunk function holds one, `run_in_chunks` passes a function at the
leftover's size (`rest_fn`) and the derivative evaluates only the rows that no
whole chunk covers, so that every row is computed once, as under `jax.vmap`
(`tests/test_derivatives.py`, the tests of a `custom_vjp`). The evaluated loop
keeps its one overlapping step, and may stop early (`until`); the derivative
runs every step, since JAX transposes no loop of a traced length.

An input that the loop *relays* (`Chain.relay`: a stage boundary that a later
loop reads again) is returned as it is, and its tangent rides the scan's carry
instead of being split into a stack: each step reads its rows, and it leaves
the loop as the relayed output's tangent. The transposed loop then carries the
cotangent that the later loops accumulated and adds each step's rows into it in
place, so a boundary that `n` loops read has one batch-sized cotangent, not `n`
that XLA keeps alive to sum after the last (`tests/test_collectives_boundaries.py`,
`test_kept_cotangent_memory_does_not_grow_with_readers`).

A written output that the caller names (`Chain.carried`: a
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

import dataclasses
import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Int, PyTree

from .._custom_types import InputArray, is_none
from .._reporting import report_step
from .._structs import inexact
from ._accumulate import zeros_like as _zeros_like
from ._scan import ArraysFn, as_arrays, checkpointed, relayed, scan
from ._schedule import Schedule
from ._tangents import (
    covered,
    leftover,
    unbatched_tangents,
    write_rows,
    zero_tangent,
)
from ._weak_types import (
    fork_output,
    fork_outputs,
    fork_tree,
    is_weak as _weak,
    join,
    join_tree,
    strong_and_weak,
)


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
        return as_arrays(_fn(_chunk))

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
    until: Int[Array, ""] | None,
    *,
    loop: Schedule,
) -> tuple[list[Array], PyTree[Array], list[Array]]:
    """Runs `fn` on each step's chunk of `inputs` (the first `until` steps, if
    not `None`), writing its batched outputs into `buffers` with `loop.write`;
    returns the buffers, the last step's unbatched outputs and the inputs that
    the loop relays (`loop.relay`: returned as they are, for a later loop).

    `fn` holds the arrays it closes over as its PyTree leaves (made by
    `eqx.filter_closure_convert`), so that they are arguments of the custom JVP
    rule and get tangents. `rest_fn`, `fn` at the size of the rows that no whole
    chunk covers, makes the derivative evaluate them apart rather than in an
    overlapping step (see the module's docstring). Pass `None` rather than omit
    either: `eqx.filter_custom_jvp` fills in no defaults."""
    del rest_fn  # only for the derivative (`_run_jvp`)
    buffers, unbatched = scan(fn, inputs, buffers, unbatched, loop, until)
    return buffers, unbatched, relayed(jtu.tree_leaves(inputs), loop.relay)


@scan_chunks.def_jvp
def _run_jvp(
    primals: tuple[Any, ...], tangents: tuple[Any, ...], *, loop: Schedule
) -> tuple[Any, Any]:
    fn, inputs, buffers, unbatched, rest_fn, _ = primals  # every step, `until` or not
    t_fn, t_inputs, t_buffers, _, t_rest_fn, _ = tangents
    # The outputs whose tangents ride carries (`_carried`), each from its buffer's
    # tangent (where the buffer has one: see `_carried`) or from zeros.
    into = _carried(buffers, loop)
    # Every other buffer is zeros made by `run_in_chunks`, or a spare without
    # tangent: never perturbed.
    assert all(t is None or j in into for j, t in enumerate(t_buffers))
    # With a function at the leftover's size, the whole chunks are scanned and the
    # leftover is evaluated on its own: no row is computed twice.
    apart = rest_fn is not None and loop.num_steps > loop.num_whole
    # Each tangent reaches the steps, the first step again (for the unbatched
    # outputs) and the leftover: its cotangent keeps the weak type they give it
    # (`_weak_types.py`).
    rule = _Rule(fn, inputs, loop, loop.without_overlap() if apart else loop, into)
    shapes = [(rule.steps.num_steps, 0), (0,)] + ([(0,)] if apart else [])
    (t_fn, t_inputs), steps_probes, first_probes, *rest_probes = fork_tree(
        (t_fn, t_inputs), shapes
    )
    t_relay, t_written, t_chunks = rule.tangents(t_inputs, buffers, t_buffers)
    step = checkpointed(_jvp_step, loop.checkpoint)
    buffers, unbatched, t_relay, t_stacks, out_probes = rule.scan(
        step,
        t_fn,
        (buffers, unbatched),
        (t_relay, t_written, t_chunks),
        steps_probes,
    )
    if rest_fn is not None and apart:
        buffers, t_rows, out_probes = leftover(
            step,
            rest_fn,
            t_rest_fn,
            (inputs, t_inputs),
            rest_probes[0],
            buffers,
            (t_stacks, out_probes),
            loop,
            into,
        )
    else:
        t_rows = rule.merged(t_stacks)
    t_buffers = [
        zero_tangent(b) if t is None else join(t, probe, _weak(b))
        for t, probe, b in zip(t_rows, out_probes, buffers, strict=True)
    ]
    t_first = jtu.tree_map(lambda t: None if t is None else t[0], t_chunks)
    t_first = rule.with_relayed(t_first, t_relay, jnp.array(0))
    t_first = join_tree((t_fn, t_first), first_probes)
    t_unbatched = unbatched_tangents(step, fn, inputs, t_first, unbatched, loop)
    t_unbatched = jtu.tree_map(
        lambda u, t: zero_tangent(u) if t is None else join(*fork_output(t), _weak(u)),
        unbatched,
        t_unbatched,
    )
    out_relayed = relayed(jtu.tree_leaves(inputs), loop.relay)
    t_relayed = [
        zero_tangent(x) if t is None else t
        for x, t in zip(out_relayed, t_relay, strict=True)
    ]
    return (buffers, unbatched, out_relayed), (t_buffers, t_unbatched, t_relayed)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """What the steps of the JVP rule's loop share: the chunk function `fn` (its
    arrays as leaves), the loop's `inputs`, the loop as the caller wrote it
    (`loop`), the steps the rule scans (`steps`: without the overlapping one
    where the leftover is evaluated apart) and the outputs whose tangents ride
    carries (`into`: `_carried`)."""

    fn: ArraysFn
    inputs: PyTree[InputArray]
    loop: Schedule
    steps: Schedule
    into: tuple[int, ...]

    @ft.cached_property
    def _treedef(self) -> Any:
        return jtu.tree_structure(self.inputs)

    @ft.cached_property
    def _axes(self) -> list[int]:
        """Each input leaf's mapped axis (`in_axes` is a prefix of the inputs)."""
        in_axes = jtu.tree_map(
            lambda a, x: jtu.tree_map(lambda _: a, x), self.loop.in_axes, self.inputs
        )
        return self._treedef.flatten_up_to(in_axes)

    def tangents(
        self, t_inputs: Any, buffers: list[Array], t_buffers: list[Any]
    ) -> tuple[list[Any], list[Array], Any]:
        """The input tangents as the loop carries or scans them, and the carries
        of the written outputs' tangents (`into`: from the buffers' tangents, or
        zeros).

        A relayed input's tangent rides the carry, each step reading its rows,
        and leaves the loop as the relayed output's: in reverse mode the
        cotangent that the later loops give it is carried back through this
        loop's transpose, each step adding its rows' in place, rather than each
        loop making a batch-sized cotangent of its own for XLA to sum after them
        all (which keeps them all alive: `benchmarks/cotangent_reads.py`). Every
        other tangent is a scanned input, split into a stack of chunks (`None`:
        none)."""
        t_leaves = self._treedef.flatten_up_to(t_inputs)
        axes = self._axes
        t_relay = relayed(t_leaves, self.loop.relay)
        t_written = [
            _zeros_like(buffers[j]) if t_buffers[j] is None else t_buffers[j]
            for j in self.into
        ]
        t_chunks = jtu.tree_unflatten(
            self._treedef,
            [
                None if t is None or i in self.loop.relay else self.steps.split(t, axis)
                for i, (t, axis) in enumerate(zip(t_leaves, axes, strict=True))
            ],
        )
        return t_relay, t_written, t_chunks

    def with_relayed(self, t_chunk: Any, t_relay: list[Any], start: Any) -> Any:
        """Each relayed tangent's rows at `start`, among the chunk's tangents."""
        if not self.loop.relay:
            return t_chunk
        axes = self._axes
        leaves = self._treedef.flatten_up_to(t_chunk)
        for i, t in zip(self.loop.relay, t_relay, strict=True):
            if t is not None:
                leaves[i] = lax.dynamic_slice_in_dim(
                    t,
                    start,
                    self.steps.chunk_size,
                    axes[i],
                    allow_negative_indices=False,
                )
        return jtu.tree_unflatten(self._treedef, leaves)

    def scan(
        self,
        step: Any,
        t_fn: Any,
        primals: tuple[list[Array], PyTree[Array]],
        carried: tuple[list[Any], list[Array], Any],
        probes: Any,
    ) -> tuple[list[Array], PyTree[Array], list[Any], list[Any], list[Any]]:
        """The loop's steps with their tangents: the buffers, the unbatched
        outputs, the relayed tangents, each output's tangent (a stack of
        chunks; an accumulated sum's or a carried one's, whole) and the
        probes of its weak type."""
        buffers, unbatched = primals
        t_relay, t_written, t_chunks = carried
        loop, steps, into = self.loop, self.steps, self.into
        # The tangents of accumulated sums are summed in the carry, as their
        # primals are: their size, not the batch's (`_accumulate.py`).
        t_sums = [
            _zeros_like(b) if which == "sum" and inexact(b) else None
            for b, which in zip(buffers, loop.kinds, strict=True)
        ]

        def _body(carry: tuple[Any, ...], xs: tuple[Any, ...]) -> tuple[Any, Any]:
            _buffers, _, _t_sums, _t_relay, _t_written = carry
            start, _t_chunk, _probes = xs
            _t_chunk = self.with_relayed(_t_chunk, _t_relay, start)
            _t_fn, _t_chunk = join_tree((t_fn, _t_chunk), _probes)
            (_chunk, _unbatched), (_t_out, _) = step(
                self.fn, _t_fn, self.inputs, start, _t_chunk, loop
            )
            _buffers = loop.write(_buffers, _chunk, start, steps.first_new(start))
            # Its operands are primal values: reverse mode reports in the forward
            # pass.
            report_step(loop.reporter, start, loop.chunk_size, (_buffers, _unbatched))
            _t_out, _out_probes = fork_outputs(_t_out)
            _t_sums = [
                acc if acc is None else acc + steps.row_sum(t, axis, start)
                for acc, t, axis in zip(_t_sums, _t_out, loop.axes, strict=True)
            ]
            _t_out = [None if k is not None else t for t, k in zip(_t_out, loop.kinds)]
            _t_written = [
                write_rows(t, _t_out[j], start, steps, loop.axes[j])
                for j, t in zip(into, _t_written, strict=True)
            ]
            _t_out = [None if j in into else t for j, t in enumerate(_t_out)]
            # `+ 0`, which XLA removes, so that JAX does not see the carry pass
            # through unchanged: it would hoist it out of the loop, and the
            # transposed loop would start its cotangent from zeros rather than
            # from the later loops'.
            _t_relay = [None if t is None else t + 0 for t in _t_relay]
            carry = (_buffers, _unbatched, _t_sums, _t_relay, _t_written)
            return carry, (_t_out, _out_probes)

        init = (buffers, unbatched, t_sums, t_relay, t_written)
        (buffers, unbatched, t_sums, t_relay, t_written), (t_stacks, out_probes) = (
            lax.scan(_body, init, (steps.starts(), t_chunks, probes))
        )
        # An accumulated sum's tangent is its carry; a running maximum's is zero;
        # a carried one's is its carry (see `covered`).
        t_stacks = [
            t if s is None else s for t, s in zip(t_stacks, t_sums, strict=True)
        ]
        for j, t in zip(into, t_written, strict=True):
            t_stacks[j] = t
        return buffers, unbatched, t_relay, t_stacks, out_probes

    def merged(self, t_stacks: list[Any]) -> list[Any]:
        """Each output's tangent from the scan's (no leftover evaluated apart)."""
        loop, steps = self.loop, self.steps
        return [
            None
            if t is None
            else t
            if which is not None
            else covered(t, steps, axis)
            if j in self.into
            else loop.merge(t, axis)
            for j, (t, axis, which) in enumerate(
                zip(t_stacks, loop.axes, loop.kinds, strict=True)
            )
        ]


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
