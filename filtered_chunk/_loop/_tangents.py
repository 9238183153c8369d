"""The tangents of the loop's outputs that its JVP rule's scan does not give
(`_rule.py`): a carried tangent's rows, those of a leftover evaluated apart, and
those of the unbatched outputs."""

from collections.abc import Callable
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from .._custom_types import InputArray, is_none
from .._reporting import report_step
from .._structs import inexact
from ._accumulate import sum_rows, zeros_like as _zeros_like
from ._scan import ArraysFn
from ._schedule import Schedule
from ._weak_types import fork_outputs, fork_tree, join, join_tree


def write_rows(carry: Array, t: Any, start: Any, steps: Schedule, axis: int) -> Array:
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


def covered(t: Array, steps: Schedule, axis: int) -> Array:
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


def zero_tangent(x: Array) -> Any:
    """The zero tangent of an output that has none (an integer one, a running
    maximum): explicit, since Equinox 0.13.1 makes one with an API that JAX 0.10
    removed."""
    if inexact(x):
        return _zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def leftover(
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


def unbatched_tangents(
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
