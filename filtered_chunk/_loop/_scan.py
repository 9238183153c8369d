"""The loop over chunks as evaluated: one `lax.scan` that slices each chunk out of
the inputs (scan constants) and writes its outputs into full-size buffers (scan
carries) in place, so that peak memory is the outputs plus one chunk's working
set.

The evaluated loop holds no `jax.checkpoint`, which only matters to
differentiation (and which `checkify` cannot transform): the loop's JVP rule
(`_rule.py`) is where each step is checkpointed.
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Int, PyTree

from .._custom_types import CheckpointSpec, InputArray
from .._reporting import report_step
from ._schedule import Schedule


ArraysFn = Callable[[PyTree[Array]], tuple[list[Array], PyTree[Array]]]


def as_arrays(tree: PyTree[Any]) -> PyTree[Array]:
    """`tree` with every leaf an array (weakly typed where it was a Python scalar).

    `eqx.filter_closure_convert` replays a jaxpr, which returns a literal output
    (a constant) as a Python scalar subclass."""
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


def scan(
    fn: ArraysFn,
    inputs: PyTree[InputArray],
    buffers: list[Array],
    unbatched: PyTree[Array],
    loop: Schedule,
    until: Int[Array, ""] | None = None,
) -> tuple[list[Array], PyTree[Array]]:
    """Runs `fn` on each step's chunk of `inputs`, writing its batched outputs
    into `buffers` with `loop.write`; returns the buffers and the last step's
    unbatched outputs. With `until`, only the first `until` steps run (a
    `lax.while_loop`; `until` is the same for every element of a `vmap` around
    it, so that the loop stays one)."""
    last = loop.batch_size - loop.chunk_size

    def _body(carry: tuple[Any, Any, Any], _: None = None) -> tuple[Any, None]:
        # Counting the steps in the carry, rather than reading a start per step
        # from an array, compiles to one kernel fewer (benchmarks/).
        _buffers, _, index = carry
        start = jnp.minimum(index * loop.chunk_size, last)
        _chunk, _unbatched = as_arrays(fn(loop.slice(inputs, start)))
        _buffers = loop.write(_buffers, _chunk, start, loop.first_new(start))
        # After the write: the report reads the written buffers, so it follows the
        # step's work.
        report_step(loop.reporter, start, loop.chunk_size, (_buffers, _unbatched))
        return (_buffers, _unbatched, index + 1), None

    # The default integer type, as in `loop.starts()`: `checkify` compares the
    # index with shapes of that type, which strict dtype promotion requires.
    init = (buffers, unbatched, jnp.zeros((), int))
    if until is None:
        (buffers, unbatched, _), _ = lax.scan(_body, init, length=loop.num_steps)
        return buffers, unbatched
    buffers, unbatched, _ = lax.while_loop(
        lambda carry: carry[2] < until, lambda carry: _body(carry)[0], init
    )
    if loop.reporter is not None:
        # The steps skipped count as done: the last report closes the meter.
        report = lambda: report_step(  # noqa: E731
            loop.reporter, jnp.asarray(last), loop.chunk_size, (buffers, unbatched)
        )
        lax.cond(until < loop.num_steps, report, lambda: None)
    return buffers, unbatched


def relayed(leaves: list[Any], relay: Sequence[int]) -> list[Any]:
    """The leaves at the positions that a loop relays (`Chain.relay`)."""
    return [leaves[i] for i in relay]
