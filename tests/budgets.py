"""What the budget tests share: the memory oracle, independent of the library's
search (`jax.jit` of the public transform at a fixed chunk size, compiled, read with
`memory_analysis()`), and the check that a choice is the largest that fits."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

import filtered_chunk as fc


def memory_analysis(fn: Callable[..., Any], *args: Any) -> Any:
    """XLA's memory analysis of `fn` compiled for `args`, with its non-array
    arguments (Python scalars) fixed, as a chunked call runs it."""
    dynamic, static = eqx.partition(args, eqx.is_array)
    program = lambda _dynamic: fn(*eqx.combine(_dynamic, static))  # noqa: E731
    analysis = jax.jit(program).lower(dynamic).compile().memory_analysis()
    assert analysis is not None
    return analysis


def compiled_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """XLA's temporary plus output bytes of `fn` compiled for `args`."""
    analysis = memory_analysis(fn, *args)
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def vjp_program(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` and its pullback (of ones) w.r.t. its first argument: what runs when
    `fn` is differentiated w.r.t. it."""

    def _program(p: Any, *rest: Any) -> Any:
        out, pullback = jax.vjp(lambda _p: fn(_p, *rest), p)
        return out, pullback(jtu.tree_map(jnp.ones_like, out))

    return _program


def next_size_up(batch_size: int, k: int, remainder: str) -> int | None:
    """The next chunk size that runs differently; `None` once the batch is reached.
    With `remainder="overlap"` that is the balanced size with one step fewer."""
    if k >= batch_size:
        return None
    if remainder == "separate":
        return k + 1
    steps = -(-batch_size // k)
    return -(-batch_size // (steps - 1))


def check_largest(
    bytes_at: Callable[[int | None], int],
    choice: fc.ChunkSizeChoice,
    budget: int,
    batch_size: int,
    remainder: str = "overlap",
) -> None:
    """The chosen size fits (by the oracle) and the next size up does not."""
    k = choice.chunk_size
    assert choice.budget == budget
    assert bytes_at(k if k < batch_size else None) == choice.bytes <= budget
    up = next_size_up(batch_size, k, remainder)
    if up is not None:
        assert bytes_at(up if up < batch_size else None) > budget
