"""What the budget tests share: the memory oracle, independent of the library's
search (`jax.jit` of the public transform at a fixed chunk size, compiled, read with
`memory_analysis()`), and the check that a choice is the largest that fits."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

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


def nbytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jtu.tree_leaves(tree))


def derivative_bytes(fn: Callable[..., Any], p: Any, *rest: Any) -> int:
    """What a budget counts for `fn` differentiated w.r.t. its first argument, as
    `jax.grad`/`jax.linearize` run it: the larger of its pullback of a cotangent
    and its linearisation applied to a tangent, plus the bytes of that cotangent
    or tangent. Both are arguments of the compiled program, as a real loss's
    cotangent is not a constant XLA could fold."""
    out = jax.eval_shape(fn, p, *rest)
    ct = jtu.tree_map(lambda o: np.zeros(o.shape, o.dtype), out)

    def _pullback(_ct: Any, _p: Any, *_rest: Any) -> Any:
        y, pullback = jax.vjp(lambda q: fn(q, *_rest), _p)
        return y, pullback(_ct)

    def _linearised(_t: Any, _p: Any, *_rest: Any) -> Any:
        y, push = jax.linearize(lambda q: fn(q, *_rest), _p)
        return y, push(_t)

    return max(
        compiled_bytes(_pullback, ct, p, *rest) + nbytes(ct),
        compiled_bytes(_linearised, p, p, *rest) + nbytes(p),
    )


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


def nonlinear_element(x: Any) -> Any:
    """A `d x d` temporary per element, its output one row of it: non-linear."""
    return jnp.tanh(jnp.outer(x, x)) @ x
