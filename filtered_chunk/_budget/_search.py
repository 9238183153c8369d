"""Choosing the chunk size for a memory budget, by compiling the call on abstract
shapes (`memory_analysis()`, never running it) as the transformations around it run
it (`_program.py`). The bytes are close to affine in the chunk size over each range
of sizes whose schedule keeps its shape (`_segments`), the outputs being allocated
at full batch size. So the whole batch is measured first, then one element per
chunk, then each range's ends from the largest down, with guesses between where only
its smallest size fits (`_secant`). One element per chunk need not be the smallest
program (a collective's staged program, or XLA's schedule of a small derivative,
can need more, issue 23, item 7): where no range's ends fit, sizes across the
smallest range are measured (`_probes`) before the budget is refused. Each size is
measured only as far as its comparison with the budget needs, cached on the
traced program (`_counts.py`); the choices are cached and stored by `_choose.py`.
"""

import math
import time
from collections.abc import Callable, Hashable
from typing import Any

from .._loop import Steps
from . import _model, _timing
from ._counts import Counts
from ._program import argument_bytes, ChunkedProgram, Lowered, Measured
from ._refusal import too_small
from ._values import ChunkSizeChoice, MemoryBudget


# The sizes a search measures at most (the whole batch, one element, the segments'
# ends, guesses or probes, the model's size); two programs each under reverse mode.
MAX_COMPILATIONS = 12


class Sizes:
    """The chunk sizes worth trying for a batch: with `remainder="overlap"` only
    the sizes the loop runs at (`Steps`: any other size runs as the balanced size
    with its number of steps); with `"separate"` every size."""

    def __init__(self, batch_size: int, remainder: str):
        self.n, self.remainder = batch_size, remainder
        self.balanced = remainder == "overlap"

    def at_most(self, x: int) -> int:
        """The largest size not above `x` (`1 <= x <= batch_size`)."""
        return Steps.of(self.n, x, self.remainder).chunk_size

    def above(self, k: int) -> int:
        """The smallest size above `k` (`k < batch_size`)."""
        size = self.at_most(k + 1)
        if size > k:
            return size
        steps = Steps.of(self.n, k + 1, self.remainder).num_steps
        return -(-self.n // (steps - 1))

    def below(self, k: int) -> int:
        """The largest size below `k` (`k > 1`)."""
        return self.at_most(k - 1)


def _segments(sizes: Sizes) -> list[tuple[int, int]]:
    """The ranges `(smallest, largest)` of sizes whose schedule keeps its shape,
    largest first: the whole batch; with `"separate"` one chunk and a remainder (XLA
    unrolls a loop of one step: both live at once); two or more steps."""
    n = sizes.n
    if n == 1:
        return [(1, 1)]
    # The largest size with two steps: two whole chunks, or with an overlap.
    two_steps = -(-n // 2) if sizes.balanced else n // 2
    one_step = (
        []
        if sizes.remainder == "overlap" or two_steps + 1 > n - 1
        else [(two_steps + 1, n - 1)]
    )
    return [(n, n), *one_step, (1, two_steps)]


def _slope(bytes_at: Callable[[int], int], a: int, b: int) -> float:
    return (bytes_at(b) - bytes_at(a)) / (b - a)


def _secant(
    bytes_at: Callable[[int], int],
    sizes: Sizes,
    limit: int,
    bracket: tuple[int, int],
    spent: Callable[[], int],
) -> int:
    """`_search` in `bracket = (lo, hi)` of one segment (`lo` fits, `hi` does not)."""
    lo, hi = bracket
    moved = ""
    while sizes.above(lo) < hi and spent() < MAX_COMPILATIONS:
        # A secant guess, checked with its neighbour (one over the limit, where
        # the line through `lo` and it says the neighbour fits; else the next
        # guess, on that line, goes further); but bisect when the last two
        # guesses moved the same end (the bytes are far from affine there).
        bisect = moved[-2:] in ("ll", "hh")
        if bisect:
            guess = (lo + hi) / 2
        else:
            slope = _slope(bytes_at, lo, hi)
            guess = lo + (limit - bytes_at(lo)) / slope if slope > 0 else hi - 1
        k = sizes.at_most(min(max(int(guess), sizes.above(lo)), hi - 1))
        k = max(k, sizes.above(lo))
        fits = bytes_at(k) <= limit
        neighbour = sizes.above(k) if fits else sizes.below(k)
        near = fits or bytes_at(k) - _slope(bytes_at, lo, k) * (k - neighbour) <= limit
        lo, hi, moved = (k, hi, moved + "l") if fits else (lo, k, moved + "h")
        if near and not bisect and lo < neighbour < hi and spent() < MAX_COMPILATIONS:
            fits = bytes_at(neighbour) <= limit
            lo, hi = (neighbour, hi) if fits else (lo, neighbour)
    return lo


def _probes(sizes: Sizes, bracket: tuple[int, int], count: int) -> list[int]:
    """Up to `count` sizes inside `(lo, hi)`, largest first: the size above `lo` (one
    element can cost most), the batch's largest divisor below `hi` (no overlap or
    remainder: under a derivative it can cost less), then three spaced geometrically,
    each with a divisor below."""
    lo, hi = bracket
    small = [d for d in range(1, math.isqrt(sizes.n) + 1) if sizes.n % d == 0]
    divisors = sorted({*small, *(sizes.n // d for d in small)})
    divisor = lambda t: max(d for d in divisors if d <= max(t, 1))  # noqa: E731
    targets = [sizes.at_most(int(lo * (hi / lo) ** (i / 4))) for i in (2, 1, 3)]
    ladder = [sizes.above(lo), divisor(hi - 1)]
    ladder += [k for t in targets for k in (t, divisor(t))]
    inside = [k for k in dict.fromkeys(ladder) if lo < k < hi]
    return sorted(inside[: max(count, 0)], reverse=True)


def _search(
    measure: Callable[[int], Measured],
    sizes: Sizes,
    limit: int,
    on_too_small: Callable[[], Exception],
    spent: Callable[[], int],
) -> int:
    """The largest size measured to fit `limit` whose next size up does not (or the
    batch size, or the largest found within `MAX_COMPILATIONS` sizes)."""
    bytes_at = lambda k: measure(k).total  # noqa: E731
    segments = _segments(sizes)
    if bytes_at(sizes.n) <= limit:
        return sizes.n
    # No chunk size shrinks the full-batch outputs: refuse without compiling more.
    if sizes.n == 1 or measure(sizes.n).output > limit:
        raise on_too_small()
    bytes_at(1)  # the slope of the speed model's working set (`_element_bytes`)
    for lo, hi in segments[1:]:
        # Near-affine: if neither end fits, nothing between does (bar the smallest).
        if bytes_at(hi) <= limit:
            return hi
        if lo < hi and bytes_at(lo) <= limit:
            return _secant(bytes_at, sizes, limit, (lo, hi), spent)
    lo, hi = segments[-1]
    for k in _probes(sizes, (lo, hi), MAX_COMPILATIONS - spent()):
        if bytes_at(k) <= limit:
            return _secant(bytes_at, sizes, limit, (k, hi), spent)
        hi = k
    raise on_too_small()


def _element_bytes(measured: dict[int, int], sizes: Sizes) -> int:
    """One element's share of a chunk's working set: the slope of the bytes over the
    sizes measured that run two or more steps, else the whole batch's mean."""
    lo, hi = _segments(sizes)[-1]
    steps = sorted(k for k in measured if lo <= k <= hi and k < sizes.n)
    if len(steps) >= 2:
        a, b = steps[0], steps[-1]
        return max(-(-(measured[b] - measured[a]) // (b - a)), 0)
    k = max(measured)
    return -(-measured[k] // k)


def _model_size(sizes: Sizes, cap: int) -> int:
    """The size the model runs for a cap: the largest not above it that runs two or
    more steps."""
    return sizes.at_most(min(cap, _segments(sizes)[-1][1]))


class _Measurements:
    """The sizes' bytes as one search measures them (`tried`: each as far as
    measured, `complete` where every program it runs was counted in full), the
    programs to time, and the seconds spent compiling."""

    def __init__(
        self,
        program: ChunkedProgram,
        base: Hashable | None,
        batch_size: int,
        limit: int,
        reverse: bool,
        timing: str | None,
    ):
        self.counts = Counts(program, base, reverse)
        self.program, self.batch_size = program, batch_size
        self.limit, self.reverse, self.timing = limit, reverse, timing
        self.tried: dict[int, Measured] = {}
        self.complete: set[int] = set()

    @property
    def compiling(self) -> float:
        return self.counts.seconds

    def _chunk(self, k: int) -> int | None:
        return None if k >= self.batch_size else k

    def bound(self, k: int) -> Measured:
        """The bytes of size `k` as far as measured, at least XLA's count of the
        program that runs: a lower bound, over the budget enough to rule it out,
        that the search moves by."""
        if k not in self.tried:
            found = self.counts.count(self._chunk(k), "first")
            assert found is not None
            self.tried[k] = found
        return self.tried[k]

    def measure(self, k: int, full: bool = False) -> Measured:
        """The bytes of size `k` to compare with the limit (`Counts.measure`),
        complete where within it or if `full`."""
        if k not in self.complete:
            found, done = self.counts.measure(self._chunk(k), self.limit, full)
            self.tried[k] = found
            if done:
                self.complete.add(k)
        return self.tried[k]

    def run(self, k: int) -> Callable[[], Any]:
        """The compiled program of size `k`, to time."""
        return self.counts.run(self._chunk(k))

    def total(self, k: int) -> int:
        return self.measure(k).total

    def refusal(self, api: str, budget: MemoryBudget) -> ValueError:
        """The error for a budget that no size fits, from the smallest measured in
        full (which may make another the smallest)."""
        tried = self.tried
        while (k := min(tried, key=lambda s: (tried[s].total, s))) not in self.complete:
            self.measure(k, True)
        return too_small(api, budget, self.limit, tried, self.batch_size, self.reverse)


def search(
    program: ChunkedProgram,
    base: Hashable | None,
    *,
    batch_size: int,
    limit: int,
    remainder: str,
    timing: str | None,
    reverse: bool,
    api: str,
    budget: MemoryBudget,
) -> tuple[ChunkSizeChoice, Lowered, bool]:
    """The chunk size for `program` (keyed `base` in the in-memory caches): the
    largest measured to fit `limit`, or the speed model's if smaller and fitting,
    or (`timing`: `_timing.mode`) the fastest of a few that fit; its program,
    lowered (`_counts.program_at`); and whether a later process may reuse the
    choice (`_timed`)."""
    start = time.perf_counter()
    m = _Measurements(program, base, batch_size, limit, reverse, timing)
    sizes = Sizes(batch_size, remainder)
    # One size is kept back for the model's.
    refusal = lambda: m.refusal(api, budget)  # noqa: E731
    spent = lambda: len(m.tried) + 1  # noqa: E731
    # The search moves by lower bounds, and the size it finds is measured in
    # full. Where that does not fit, the bounds were loose where it matters (on
    # CPU XLA's count can leave out every temporary of a YNNPACK fusion; under
    # reverse mode a linearisation can need a third more than its pullback):
    # searched again by sizes measured in full where they fit.
    largest = _search(m.bound, sizes, limit, refusal, spent)
    if m.total(largest) > limit:
        largest = _search(m.measure, sizes, limit, refusal, spent)
    tried = m.tried
    element = _element_bytes({s: x.total for s, x in tried.items()}, sizes)
    cap = _model.cache_cap(element)
    k = largest
    capped = largest if cap is None or cap >= largest else _model_size(sizes, cap)
    if capped < largest and (capped in tried or len(tried) < MAX_COMPILATIONS):
        k = capped if m.total(capped) <= limit else largest
    times, storable = _timed(m, k, largest, sizes, time.perf_counter() - start)
    if times:
        k = min(times, key=lambda s: (times[s], s))
    chosen = ChunkSizeChoice(
        k,
        tried[k].total,
        limit,
        tuple((s, tried[s].total) for s in sorted(tried)),
        largest=largest,
        model="timed" if times else "largest" if cap is None else "cache",
        element_bytes=element,
        cache_bytes=_model.cache_bytes() if cap is not None else None,
        working_set=tuple((s, s * element) for s in sorted(tried)),
        times=tuple(sorted(times.items())),
    )
    return chosen, m.counts.lowered_at(m._chunk(k)), storable


def _timed(
    m: _Measurements, k: int, largest: int, sizes: Sizes, spent: float
) -> tuple[dict[int, float], bool]:
    """The times of the sizes that `m.timing` says to time (`_timing.mode`), by
    size, around the model's `k` and up to the `largest` that fits, `spent`
    seconds into the search; and whether a later process may reuse the choice
    (not where timing was skipped for want of free memory, which a later
    process may have)."""
    if m.timing == "always":  # sizes from half the model's to the largest
        ladder = _timing.ladder(max(k // 2, 1), largest, sizes.at_most)
        fitting = [s for s in sorted({*ladder, k}) if m.total(s) <= m.limit]
        return _timing.time_each({s: m.run(s) for s in fitting}), True
    if not m.timing:
        return {}, True
    # A descent from the model's size, within a bound.
    allowance = max(_timing.FLOOR_SECONDS, _timing.SEARCH_FACTOR * spent)
    per_size = m.compiling / max(len(m.tried), 1)
    arguments = sum(map(argument_bytes, m.program.structs))
    ladder = _timing.neighbours(k, largest, sizes.at_most)
    bounded = _timing.bounded(
        k, ladder, m.total, m.run, m.limit, allowance, per_size, arguments
    )
    return bounded or {}, bounded is not None
