"""Timing the chunk sizes that fit a budget. The speed model (`_model.py`) reads
bytes, blind to some of what sets the speed: an MLP's weights are reused by every
element of a chunk, so its gradient ran fastest at chunks several times the model's
size (`benchmarks/budget.py`, workload (f)). By default (`MemoryBudget(...,
tune=None)`) on CPU the sizes are timed where that costs at most
`max(FLOOR_SECONDS, SEARCH_FACTOR * the search's own seconds)` more; with
`tune=True` always, on any device; with `tune=False` never. The choice is stored
(`_store.py`): later processes reuse it, so it does not vary between them.
"""

import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from ._free_memory import available_bytes


# The sizes timed: a geometric ladder of this many, plus the model's own size.
LADDER = 5
# Interleaved rounds after the warm-up, stopping early before they would take
# more than `SECONDS` with the warm-ups (but after at least `MIN_ROUNDS`). A run shorter
# than `SAMPLE` seconds is repeated within its sample, so that a sample outlasts
# the timer's noise.
ROUNDS = 5
MIN_ROUNDS = 2
SECONDS = 4.0
SAMPLE = 0.01
# A size the default's descent times runs twice more where that takes at most
# this many seconds (else once): one run can be a fifth slower or faster.
SAMPLE_WITHIN = 0.5
# The default's descent goes on from sizes this much slower than the fastest: a
# plateau of sizes within it is walked, not taken for a minimum.
TIE = 0.25
# The default's bound on what timing adds to a search, in seconds: the compilations
# of the sizes timed and their runs.
FLOOR_SECONDS = 4.0
SEARCH_FACTOR = 0.5
# Whether `tune=None` times at all (the tests turn it off where they check the
# model, and on where they check the default).
BY_DEFAULT = True


def mode(tune: bool | None, backend: str) -> str | None:
    """`"always"` (`tune=True`), `"bounded"` (the default, on CPU) or `None`."""
    if tune is None:
        return "bounded" if BY_DEFAULT and backend == "cpu" else None
    return "always" if tune else None


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


def seconds(run: Callable[[], Any], repeats: int = 1) -> float:
    """The mean seconds of `repeats` runs."""
    begin = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(run())
    return (time.perf_counter() - begin) / repeats


def _repeats(first: float) -> int:
    """How many runs of `first` seconds one sample takes to outlast `SAMPLE`."""
    return min(max(math.ceil(SAMPLE / first), 1), 100)


def sample(run: Callable[[], Any], within: float = SAMPLE_WITHIN) -> float:
    """The fastest of two more runs after a first one (which can pay for
    first-use costs), each repeated to outlast the timer's noise (`SAMPLE`), where
    the two take at most `within` seconds at the first's speed; else the first."""
    first = max(seconds(run), 1e-6)
    repeats = _repeats(first)
    more = 2 if 2 * first * repeats <= within else 0
    return min((seconds(run, repeats) for _ in range(more)), default=first)


def time_each(
    runs: dict[int, Callable[[], Any]],
    budget: float | None = None,
    min_rounds: int = MIN_ROUNDS,
    warm: dict[int, float] | None = None,
) -> dict[int, float]:
    """The fastest seconds of a run of each, after a warm-up, in up to `ROUNDS`
    interleaved rounds (the order rotating), stopping before the warm-ups and
    rounds would take more than `budget` seconds (`SECONDS` by default), after at
    least `min_rounds`.
    `warm`: the seconds of warm-up runs already made, by size; with `min_rounds=0`
    a size no round reached is timed by its warm-up. The fastest, not the median:
    what else runs only ever adds time, and in a few rounds one slow round moves a
    median."""
    budget = SECONDS if budget is None else budget
    start = time.perf_counter()
    warm = dict(warm or {})
    warm |= {k: seconds(run) for k, run in runs.items() if k not in warm}  # warm-ups
    warm = {k: max(t, 1e-6) for k, t in warm.items()}
    repeats = {k: _repeats(t) for k, t in warm.items()}
    keys = sorted(runs)
    times: dict[int, list[float]] = {k: [] for k in keys}
    expected = sum(warm[k] * repeats[k] for k in keys)  # the seconds of a round
    for r in range(ROUNDS):
        if r >= min_rounds and time.perf_counter() - start + expected > budget:
            break
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            times[k].append(seconds(runs[k], repeats[k]))
    return {k: min(t) if t else warm[k] for k, t in times.items()}


def neighbours(k: int, largest: int, at_most: Callable[[int], int]) -> list[int]:
    """The sizes a descent from `k` may time: `k` and the powers of two from an
    eighth of it to eight times it, rounded down to sizes that run, at most
    `largest`, ascending.

    Powers of two rather than `k` doubled and halved: where the chunk is a
    dimension of a matrix product, XLA's CPU kernels run it fastest at a power of
    two. Workload (k) of `benchmarks/budget.py` (each query's kernel row against
    16,384 points), `jax.vmap` per element in four processes: 30-35 us at 64,
    39-52 at 63, 44-54 at 41; the model's size there is 41, whose doublings
    never reach 64."""
    powers = [2**j for j in range(max(k, 1).bit_length() + 4)]
    steps = [k, *(p for p in powers if k <= 8 * p and p <= 8 * k)]
    return sorted({at_most(max(1, min(largest, s))) for s in steps})


def bounded(
    k: int,
    ladder: list[int],
    measure: Callable[[int], int],
    run: Callable[[int], Callable[[], Any]],
    limit: int,
    allowance: float,
    per_size: float,
    argument_bytes: int,
) -> dict[int, float] | None:
    """The default's timing, within `allowance` seconds after the model's size `k`
    is timed: a descent along `ladder` (ascending, holding `k`) from the fastest
    size so far to its untimed neighbours (the larger first), and from those
    within `TIE` of it (a plateau, where one run's noise could stop a
    descent), each while it fits the budget (`measure`: its bytes) and the time
    left (its compilation, `per_size` seconds, and two runs at the speed of the
    fastest so far); each size the fastest of up to three runs (`sample`). Then
    rounds while time is left; where the rounds make another size the fastest
    and it has untimed neighbours, the descent goes on from it. Empty (the
    model's choice stands) where fewer than two sizes fit the bound; `None` (the
    same, but not stored: a later process may have the room) where a copy of the
    arguments beside the budget could crowd the free memory."""
    if argument_bytes + limit > available_bytes() // 2:
        return None
    warm = {k: sample(run(k))}  # also makes the example arguments
    end = time.perf_counter() + allowance
    refused: set[int] = set()
    tie = 1 + TIE  # a plateau: within this factor of the fastest

    def _untimed(sizes: list[int]) -> list[int]:
        # Each size's neighbours on the ladder, the larger first, not yet tried.
        near: list[int] = []
        for t in sizes:
            i = ladder.index(t)
            near += ladder[i + 1 : i + 2] + ladder[max(i - 1, 0) : i]
        return [s for s in near if s not in warm and s not in refused]

    while True:
        descended = False
        while True:
            # The untimed neighbours of the sizes within `TIE` of the
            # fastest, the fastest's first: a descent that also walks a plateau.
            fastest = min(warm.values())
            order = sorted(warm, key=lambda t: (warm[t], t))
            near = _untimed([t for t in order if warm[t] <= fastest * tie])
            if not near:
                break
            s = near[0]
            if end - time.perf_counter() < per_size + 2 * max(fastest, SAMPLE):
                break
            if measure(s) <= limit:
                warm[s] = sample(run(s))
                descended = True
            else:
                refused.add(s)
        if len(warm) < 2:
            return {}
        runs = {s: run(s) for s in warm}
        budget = max(end - time.perf_counter(), 0.0)
        times = time_each(runs, budget, min_rounds=0, warm=warm)
        # The rounds may find another fastest than the single samples did.
        best = min(times, key=lambda s: (times[s], s))
        if not descended or not _untimed([best]):
            return times
        warm = dict(times)
