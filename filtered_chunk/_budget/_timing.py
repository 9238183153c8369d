"""Timing the chunk sizes that fit a budget, for `MemoryBudget(..., tune=True)`. The
speed model (`_model.py`) reads bytes, blind to some of what sets the speed: an
MLP's weights are reused by every element of a chunk, so its gradient ran fastest
at chunks several times the model's size (`benchmarks/budget.py`, workload (f)).
Only when asked: timings vary from run to run, the model's choice does not.
"""

import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np


# The sizes timed: a geometric ladder of this many, plus the model's own size.
LADDER = 5
# Interleaved rounds after the warm-up, stopping early once the rounds have taken
# `SECONDS` (but after at least `MIN_ROUNDS`). A run shorter than `SAMPLE` seconds
# is repeated within its sample, so that a sample outlasts the timer's noise.
ROUNDS = 5
MIN_ROUNDS = 2
SECONDS = 4.0
SAMPLE = 0.01


def ladder(lo: int, hi: int, at_most: Callable[[int], int]) -> list[int]:
    """`LADDER` sizes from `lo` to `hi` (`1 <= lo <= hi`), evenly spaced on a log
    scale and rounded down to sizes that run (`at_most`), without repeats."""
    steps = [lo * (hi / lo) ** (i / (LADDER - 1)) for i in range(LADDER)]
    sizes = [at_most(max(1, min(hi, math.floor(k + 1e-9)))) for k in steps]
    return sorted({*sizes, hi})


def _example_keys(struct: jax.ShapeDtypeStruct) -> jax.Array:
    impl: list[Any] = []

    def _data(keys: jax.Array) -> jax.Array:
        impl.append(jax.random.key_impl(keys))
        return jax.random.key_data(keys)

    data = jax.eval_shape(_data, struct)
    zeros = jnp.zeros(data.shape, data.dtype)
    return jax.random.wrap_key_data(zeros, impl=impl[0])


def example_value(struct: jax.ShapeDtypeStruct, seed: int) -> Any:
    """An array of `struct`'s type: standard normal for floating types, zeros
    otherwise (keys of zeros)."""
    dtype = struct.dtype
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        value = _example_keys(struct)
    elif jnp.issubdtype(dtype, jnp.inexact):
        rng = np.random.default_rng(seed)
        value = rng.standard_normal(struct.shape).astype(dtype)
    else:
        value = np.zeros(struct.shape, dtype)
    sharding = getattr(struct, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else value


def example_arguments(
    structs: Sequence[Any], known: Sequence[Any], made: dict[Hashable, Any]
) -> list[Any]:
    """Arguments for a compiled program: the concrete arrays of `known` (by position),
    else example values, made eagerly even under a trace and shared through `made`
    (by shape, dtype and sharding): one copy each for the programs of a search."""
    arguments = [*known, *[None] * (len(structs) - len(known))]
    with jax.ensure_compile_time_eval():
        for i, s in enumerate(structs):
            k = arguments[i]
            if not isinstance(k, jax.Array) or isinstance(k, jax.core.Tracer):
                key = (s.shape, str(s.dtype), getattr(s, "sharding", None))
                if key not in made:
                    made[key] = example_value(s, len(made))
                arguments[i] = made[key]
    return arguments


def _seconds(run: Callable[[], Any], repeats: int) -> float:
    begin = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(run())
    return (time.perf_counter() - begin) / repeats


def time_each(runs: dict[int, Callable[[], Any]]) -> dict[int, float]:
    """The fastest seconds of a run of each, after a warm-up, in up to `ROUNDS`
    interleaved rounds (the order rotating). The fastest, not the median: what else
    runs only ever adds time, and in a few rounds one slow round moves a median."""
    warm = {k: max(_seconds(run, 1), 1e-6) for k, run in runs.items()}  # warm-ups
    repeats = {k: min(max(math.ceil(SAMPLE / t), 1), 100) for k, t in warm.items()}
    keys = sorted(runs)
    times: dict[int, list[float]] = {k: [] for k in keys}
    start = time.perf_counter()
    for r in range(ROUNDS):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            times[k].append(_seconds(runs[k], repeats[k]))
        if r + 1 >= MIN_ROUNDS and time.perf_counter() - start > SECONDS:
            break
    return {k: min(t) for k, t in times.items()}
