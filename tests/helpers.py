import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def remainders(batch_size: int, chunk_size: int | None) -> tuple[str, ...]:
    """The `remainder` modes that differ at these sizes: both where the chunk size
    leaves a remainder (smaller than the batch, not dividing it); else only the
    default, since both run the same program
    (`test_remainder.py::test_modes_without_a_remainder_are_one_program`)."""
    if chunk_size is not None and chunk_size < batch_size and batch_size % chunk_size:
        return ("overlap", "separate")
    return ("overlap",)


def chunkings(
    batch_size: int, chunk_sizes: Iterable[int | None]
) -> list[tuple[int | None, str]]:
    """`(chunk_size, remainder)` for each chunk size and each mode that differs
    (`remainders`), for a grid over a batch of `batch_size`."""
    return [(k, r) for k in chunk_sizes for r in remainders(batch_size, k)]


def batchings(batch_sizes: Iterable[int], chunk_size: int) -> list[tuple[int, str]]:
    """`(batch_size, remainder)` for each batch size and each mode that differs
    (`remainders`), for a grid at one chunk size."""
    return [(n, r) for n in batch_sizes for r in remainders(n, chunk_size)]


def tree_allclose(x: Any, y: Any, *, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """Same structure, Python types, shapes, dtypes and (close) values."""
    if jax.default_backend() == "gpu":
        atol = max(atol, 1e-3)
    return bool(eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol))


def same_nonfinite(actual: Any, expected: Any, *, rtol: float = 1e-5) -> bool:
    """Same `nan`s, same infinities (with sign), close finite values."""

    def _finite(x: Any) -> Any:
        return jnp.where(jnp.isfinite(x), x, 0)

    def _masks(x: Any) -> Any:
        return jnp.isnan(x), jnp.isposinf(x), jnp.isneginf(x)

    masks = jtu.tree_map(_masks, (actual, expected))
    same_masks = jtu.tree_map(lambda a, b: bool(jnp.all(a == b)), *masks)
    finite = jtu.tree_map(_finite, (actual, expected))
    return all(jtu.tree_leaves(same_masks)) and tree_allclose(*finite, rtol=rtol)


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
    """Collects one entry per XLA compilation (JAX's monitoring events) while
    active: `compiles == []` when nothing compiled."""
    compiles: list[str] = []

    def _listen(event: str, duration_secs: float, **kwargs: Any) -> None:
        del duration_secs, kwargs
        if event == _BACKEND_COMPILE:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(_listen)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(_listen)


def scan_counts(eqn: Any) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a `scan` equation of a jaxpr: parameters of
    their own up to JAX 0.10; from JAX 0.11, the sizes of the groups of its
    `ft_in` (constants, carry, scanned inputs)."""
    params = eqn.params
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
