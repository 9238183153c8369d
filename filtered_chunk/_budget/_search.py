"""Choosing the chunk size for a memory budget, by compiling the call on abstract
shapes (`memory_analysis()`, never running it) as the transformations around it run
it (`_program.py`). The bytes are close to affine in the chunk size over each range
of sizes whose schedule keeps its shape (`_segments`), the outputs being allocated
at full batch size. So the whole batch is measured first, then one element per
chunk, then each range's ends from the largest down, with guesses between where only
its smallest size fits (`_secant`). One element per chunk need not be the smallest
program (a collective's staged program, or XLA's schedule of a small derivative,
can need more, issue 23, item 7): where no range's ends fit, sizes across the
smallest range are measured (`_probes`) before the budget is refused. Measurements
are cached on the traced program, choices also on the machine the model reads;
timed choices (`_timing.py`) are also stored on disk (`_store.py`).
"""

import dataclasses
import functools as ft
import math
import time
from collections.abc import Callable, Hashable
from typing import Any

from jaxtyping import PyTree

from .._loop import Steps
from . import _model, _store, _timing
from ._free_memory import available_bytes
from ._program import argument_bytes, ChunkedProgram, linearisation, Measured
from ._values import ChunkSizeChoice, format_bytes, MemoryBudget


# The sizes a search measures at most (the whole batch, one element, the segments'
# ends, guesses or probes, the model's size); two programs each under reverse mode.
MAX_COMPILATIONS = 12
# At most this many compilations choose which stage boundaries to keep.
KEEP_COMPILATIONS = 8


_MAX_ENTRIES = 256
_measured: dict[Hashable, Measured | None] = {}  # `None`: no linearisation
_chosen: dict[Hashable, ChunkSizeChoice] = {}


def _remember(cache: dict[Hashable, Any], key: Hashable | None, value: Any) -> None:
    if key is not None:
        cache[key] = value
    while len(cache) > _MAX_ENTRIES:
        del cache[next(iter(cache))]


class _Sizes:
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


def _too_small(
    api: str,
    budget: MemoryBudget,
    limit: int,
    tried: dict[int, Measured],
    n: int,
    reverse: bool = False,
) -> ValueError:
    """The refusal of a budget no size fits, for a batch of `n`: below the outputs,
    or what the smallest program measured needs, with (`reverse`) the loss assumed."""
    k = min(tried, key=lambda s: (tried[s].total, s))
    smallest = tried[k]
    head = (
        f"`{api}(..., chunk_size={budget!r})`: the memory budget of {limit} bytes "
        f"({format_bytes(limit)}) is too small for this call."
    )
    outputs = f"{smallest.output} bytes ({format_bytes(smallest.output)})"
    fix = "make the outputs smaller (map fewer elements per call, or return less)."
    fed = (
        f", and {smallest.fed} bytes are the tangents that the derivative around "
        "the call feeds in"
        if smallest.fed
        else ""
    )
    if smallest.output > limit:
        return ValueError(
            f"{head} Its outputs alone need {outputs}, allocated at full batch "
            f"size whatever the chunk size{fed}, so no chunk size fits. Give a "
            "budget larger than the outputs (the whole batch at once needs "
            f"{tried[n].total} bytes), or {fix}"
        )
    which = (
        "Even one element per chunk (one row or column, for a Jacobian)"
        if k == 1
        else "The smallest program measured, the whole batch at once,"
        if k == n
        else f"The smallest program measured, at {k} elements per chunk (rows or "
        "columns, for a Jacobian),"
    )
    measured = ", ".join(f"{s}: {tried[s].total}" for s in sorted(tried))
    return ValueError(
        f"{head} {which} needs {smallest.total} bytes "
        f"({format_bytes(smallest.total)}) of temporaries and outputs, of which "
        f"{outputs} are outputs, allocated at full batch size whatever the chunk "
        f"size{fed}. The chunk sizes measured (`chunk_size: bytes`) were "
        f"{measured}: none fits.{_ASSUMED if reverse else ''} Give a budget of at "
        f"least {smallest.total} bytes, or {fix}"
    )


_ASSUMED = (
    " Under reverse mode each size is measured as the larger of two programs, "
    "since `jax.grad` and `jax.linearize` cannot be told apart when the call is "
    "traced: the linearisation applied to a tangent (its bytes counted), and the "
    "backward pass with the cotangent computed from the call's outputs, as a "
    "loss that reads them computes it (the program of "
    "`jax.value_and_grad(loss, has_aux=True)` returning the outputs too). A "
    "`jax.grad` whose cotangent XLA folds into a constant (a plain `jnp.sum` of "
    "the outputs) needs less, but the search cannot see the loss."
)


def _segments(sizes: _Sizes) -> list[tuple[int, int]]:
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


def _secant(
    bytes_at: Callable[[int], int],
    sizes: _Sizes,
    limit: int,
    bracket: tuple[int, int],
    spent: Callable[[], int],
) -> int:
    """`_search` in `bracket = (lo, hi)` of one segment (`lo` fits, `hi` does not)."""
    lo, hi = bracket
    moved = ""
    while sizes.above(lo) < hi and spent() < MAX_COMPILATIONS:
        # A secant guess, checked with its neighbour; but bisect when the last
        # two guesses moved the same end (the bytes are far from affine there).
        bisect = moved[-2:] in ("ll", "hh")
        if bisect:
            guess = (lo + hi) / 2
        else:
            slope = (bytes_at(hi) - bytes_at(lo)) / (hi - lo)
            guess = lo + (limit - bytes_at(lo)) / slope if slope > 0 else hi - 1
        k = sizes.at_most(min(max(int(guess), sizes.above(lo)), hi - 1))
        k = max(k, sizes.above(lo))
        fits = bytes_at(k) <= limit
        lo, hi, moved = (k, hi, moved + "l") if fits else (lo, k, moved + "h")
        neighbour = sizes.above(k) if fits else sizes.below(k)
        if not bisect and lo < neighbour < hi and spent() < MAX_COMPILATIONS:
            fits = bytes_at(neighbour) <= limit
            lo, hi = (neighbour, hi) if fits else (lo, neighbour)
    return lo


def _probes(sizes: _Sizes, bracket: tuple[int, int], count: int) -> list[int]:
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
    sizes: _Sizes,
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


def _element_bytes(measured: dict[int, int], sizes: _Sizes) -> int:
    """One element's share of a chunk's working set: the slope of the bytes over the
    sizes measured that run two or more steps, else the whole batch's mean."""
    lo, hi = _segments(sizes)[-1]
    steps = sorted(k for k in measured if lo <= k <= hi and k < sizes.n)
    if len(steps) >= 2:
        a, b = steps[0], steps[-1]
        return max(-(-(measured[b] - measured[a]) // (b - a)), 0)
    k = max(measured)
    return -(-measured[k] // k)


def _model_size(sizes: _Sizes, cap: int) -> int:
    """The size the model runs for a cap: the largest not above it that runs two or
    more steps."""
    return sizes.at_most(min(cap, _segments(sizes)[-1][1]))


def _with_linearisation(
    found: Measured,
    linear: Callable[[], Measured | None],
    reverse: bool,
    limit: int,
    full: bool = False,
) -> tuple[Measured, bool]:
    """`found` (a size's program as compiled, under reverse mode its pullback)
    with, under reverse mode, its linearisation's bytes where larger, and whether
    both were measured. Both must fit, so the linearisation (`linear()`, `None`
    under a `jax.custom_vjp`) compiles only if the pullback is within `limit`, or
    if `full`: over it, the pullback alone says that the size does not fit."""
    if not reverse:
        return found, True
    if found.total > limit and not full:
        return found, False
    other = linear()
    return found if other is None else max(found, other, key=lambda m: m.total), True


def measure_bytes(
    run: Callable[[int | None, Any], Any], tree: PyTree[Any], k: int, limit: int
) -> int:
    """The bytes a search measures for `run(k, tree)` at one size, to compare with
    `limit`: under reverse mode the larger of the call's pullback and its
    linearisation, the second compiled only if the first is within `limit`
    (`_with_linearisation`, as in `choose_chunk_size`). Cached on the program
    traced at `k`: programs that trace alike compile once."""
    program = ChunkedProgram(run, tree)
    base, layers = program.key(k)

    def _once(what: str, measure: Callable[[], Measured | None]) -> Measured | None:
        key = None if base is None else (base, what)
        if key in _measured:
            return _measured[key]
        found = measure()
        _remember(_measured, key, found)
        return found

    found = _once("pullback", lambda: program.compile(k)[0])
    assert found is not None
    reverse = any(layer.kind == "reverse" for layer in layers)
    linear = lambda: _once("linearisation", lambda: linearisation(program, k))  # noqa: E731
    return _with_linearisation(found, linear, reverse, limit)[0].total


def keep_if_fits(
    choice: ChunkSizeChoice,
    measure: Callable[[int, int], int],
    passes: int,
    batch_size: int,
    remainder: str,
) -> ChunkSizeChoice:
    """`choice` with the staged collectives (`passes` passes before the final
    loop) keeping the most boundaries that fit the budget (`measure(k, n)`: the
    bytes of the program at `k` keeping those of every `n`-th pass).

    Every pass's; else every `n`-th pass's, for `n` the estimate of where the
    buffers' bytes fit beside the part of `choice`'s bytes that is not per element
    (were they to fall as `1 / n`), then for the next `n` that keeps fewer; else
    only the middle pass's (`n = passes // 2 + 1`, which halves the work of
    recomputing). Of the `n` that keep as many passes' boundaries (`passes //
    n`), the smallest, whose passes recompute least: of 8 passes, every 3rd
    keeps two, as every 4th does. Each at the chosen size, or else at a smaller
    one (`_fit_beside`), at least `MIN_CHUNK`; else `choice` as it is. At most
    eight compilations."""
    if passes == 0:
        return choice
    spent = [0]

    def _measure(size: int, every: int) -> int:
        spent[0] += 1
        return measure(size, every)

    k = choice.chunk_size
    kept = _measure(k, 1)
    fixed = max(choice.bytes - max(choice.element_bytes, 1) * k, 0)
    extra, room = kept - choice.bytes, max(choice.budget - fixed, 1)
    estimate, middle = max(2, math.ceil(extra / room)), passes // 2 + 1
    distinct = [n for n in range(2, passes + 1) if passes // n < passes // (n - 1)]
    at = max([i for i, n in enumerate(distinct) if n <= estimate], default=0)
    tries = [1] + [n for n in distinct[at : at + 2] if n < middle] + [middle]
    for every in sorted(set(tries)):
        if spent[0] >= KEEP_COMPILATIONS:
            break
        found = kept if every == 1 else _measure(k, every)
        fit = _fit_beside(
            choice,
            found,
            ft.partial(lambda n, size: _measure(size, n), every),
            _Sizes(batch_size, remainder),
            lambda: spent[0] < KEEP_COMPILATIONS,
        )
        if fit is not None:
            size, found = fit
            keep = True if every == 1 else every
            return dataclasses.replace(
                choice, chunk_size=size, bytes=found, keep_boundaries=keep
            )
    return choice


def _fit_beside(
    choice: ChunkSizeChoice,
    found: int,
    measure: Callable[[int], int],
    sizes: _Sizes,
    left: Callable[[], bool],
) -> tuple[int, int] | None:
    """`(size, bytes)` of a program that needs `found` bytes at the chosen size
    where it fits the budget: at that size; else at the size where its bytes
    beyond `choice`'s fit beside the rest (near-affine in the size:
    `choice.element_bytes` an element); else, that size measured, at the size
    where the line through the two measurements meets the budget (the
    program's own bytes an element: a pass that recomputes fewer layers has a
    smaller working set an element than `choice`'s). `None` where it does not,
    or where a size would fall below `MIN_CHUNK`, or `left()` says no more
    compilations."""
    k, budget = choice.chunk_size, choice.budget
    if found <= budget:
        return k, found
    slope = max(choice.element_bytes, 1)
    room = budget - (found - choice.bytes) - (choice.bytes - slope * k)
    size = sizes.at_most(max(min(room // slope, k), 1))
    for _ in range(2):
        if size >= k or size < _model.MIN_CHUNK or not left():
            return None
        smaller = measure(size)
        if smaller <= budget:
            return size, smaller
        if smaller >= found:
            return None
        slope = (found - smaller) / (k - size)
        k, found = size, smaller
        size = sizes.at_most(max(k - math.ceil((found - budget) / slope), 1))
    return None


def _fits(
    k: int,
    sizes: _Sizes,
    largest: int,
    measure: Callable[[int], Measured],
    limit: int,
) -> bool:
    """Whether a stored size is one the loop runs at, and fits as measured now."""
    runs_at = 1 <= k <= largest and sizes.at_most(k) == k
    return runs_at and measure(k).total <= limit


def _neighbours(k: int, largest: int, at_most: Callable[[int], int]) -> list[int]:
    """The sizes a descent from `k` may time: `k` doubled and halved up to three
    times, rounded down to sizes that run, at most `largest`, ascending."""
    steps = [k * 2.0**j for j in range(-3, 4)]
    return sorted({at_most(max(1, min(largest, math.floor(s)))) for s in steps})


def _bounded(
    k: int,
    ladder: list[int],
    measure: Callable[[int], Measured],
    run: Callable[[int], Callable[[], Any]],
    limit: int,
    allowance: float,
    per_size: float,
    argument_bytes: int,
) -> dict[int, float] | None:
    """The default's timing, within `allowance` seconds after the model's size `k`
    is timed: a descent along `ladder` (ascending, holding `k`) from the fastest
    size so far to its untimed neighbours (the larger first), and from those
    within `_timing.TIE` of it (a plateau, where one run's noise could stop a
    descent), each while it fits the budget and the time left (its compilation,
    `per_size` seconds, and two runs at the speed of the fastest so far); each
    size the fastest of up to three runs (`_timing.sample`). Then rounds while
    time is left; where the rounds make another size the fastest and it has
    untimed neighbours, the descent goes on from it. Empty (the model's choice
    stands) where fewer than two sizes fit the bound; `None` (the same, but not
    stored: a later process may have the room) where a copy of the arguments
    beside the budget could crowd the free memory."""
    if argument_bytes + limit > available_bytes() // 2:
        return None
    warm = {k: _timing.sample(run(k))}  # also makes the example arguments
    end = time.perf_counter() + allowance
    refused: set[int] = set()
    tie = 1 + _timing.TIE  # a plateau: within this factor of the fastest

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
            # The untimed neighbours of the sizes within `_timing.TIE` of the
            # fastest, the fastest's first: a descent that also walks a plateau.
            fastest = min(warm.values())
            order = sorted(warm, key=lambda t: (warm[t], t))
            near = _untimed([t for t in order if warm[t] <= fastest * tie])
            if not near:
                break
            s = near[0]
            if end - time.perf_counter() < per_size + 2 * max(fastest, _timing.SAMPLE):
                break
            if measure(s).total <= limit:
                warm[s] = _timing.sample(run(s))
                descended = True
            else:
                refused.add(s)
        if len(warm) < 2:
            return {}
        runs = {s: run(s) for s in warm}
        budget = max(end - time.perf_counter(), 0.0)
        times = _timing.time_each(runs, budget, min_rounds=0, warm=warm)
        # The rounds may find another fastest than the single samples did.
        best = min(times, key=lambda s: (times[s], s))
        if not descended or not _untimed([best]):
            return times
        warm = dict(times)


def choose_chunk_size(
    run: Callable[[int | None, Any], Any],
    tree: PyTree[Any],
    *,
    batch_size: int,
    budget: MemoryBudget,
    remainder: str,
    options: Hashable,
    api: str,
    refine: Callable[[ChunkSizeChoice], ChunkSizeChoice] | None = None,
) -> ChunkSizeChoice:
    """The chunk size for `run(chunk_size, tree)` (`None`: the whole batch): the
    largest measured to fit `budget`, or the speed model's if smaller and fitting,
    or (`_timing.mode`) the fastest of a few that fit, timed or stored; then
    `refine`d (staged collectives keeping boundaries: `keep_if_fits`), which
    `options` must tell apart. Cached on the unchunked program, traced once."""
    start = time.perf_counter()
    program = ChunkedProgram(run, tree)
    limit = budget.resolve()
    timing = _timing.mode(budget.tune, _model.backend())
    base, layers = program.key()
    # What a stored timing is keyed by: no callable's identity, which no later
    # process shares (a timing is only ever a speed, never a byte count).
    stored_as = None if base is None else (base[0], *base[2:])
    stored_as = (stored_as, batch_size, remainder, options, limit)
    reverse = any(layer.kind == "reverse" for layer in layers)
    machine = (_model.backend(), _model.cache_bytes())  # the model reads
    base = None if base is None else (base, batch_size, remainder, options)
    choice_key = None if base is None else (base, limit, budget.tune, machine)
    if choice_key in _chosen:
        return _chosen[choice_key]
    tried: dict[int, Measured] = {}
    complete: set[int] = set()  # sizes measured as every program they run
    runs: dict[int, Callable[[], Any]] = {}  # to time
    compiling = [0.0]  # seconds, for the default's bound
    chunk = lambda k: None if k >= batch_size else k  # noqa: E731

    def _once(k: int, linearize: bool) -> Measured | None:
        key = None if base is None else (base, k, linearize)
        if key in _measured:
            return _measured[key]
        begin = time.perf_counter()
        if linearize:
            found = linearisation(program, chunk(k))
        else:
            found, run = program.compile(chunk(k))
            if timing:  # the program that runs, to time
                runs[k] = run
        compiling[0] += time.perf_counter() - begin
        _remember(_measured, key, found)
        return found

    def _run(k: int) -> Callable[[], Any]:
        # Sizes measured from the cache, which keeps no compiled programs, compile.
        if k not in runs:
            begin = time.perf_counter()
            runs[k] = program.compile(chunk(k))[1]
            compiling[0] += time.perf_counter() - begin
        return runs[k]

    def _measure(k: int, full: bool = False) -> Measured:
        # Reverse mode is a pullback or a linearisation: `_with_linearisation`.
        if k not in tried or full:
            found = _once(k, False)
            assert found is not None
            found, both = _with_linearisation(
                found, lambda: _once(k, True), reverse, limit, full
            )
            if both:
                complete.add(k)
            tried[k] = found
        return tried[k]

    def _refusal() -> ValueError:
        # Both programs of the smallest (the second may make another the smallest).
        while (k := min(tried, key=lambda s: (tried[s].total, s))) not in complete:
            _measure(k, True)
        return _too_small(api, budget, limit, tried, batch_size, reverse)

    sizes = _Sizes(batch_size, remainder)
    # One size is kept back for the model's.
    largest = _search(_measure, sizes, limit, _refusal, lambda: len(tried) + 1)
    element = _element_bytes({s: m.total for s, m in tried.items()}, sizes)
    cap = _model.cache_cap(element)
    k = largest
    capped = largest if cap is None or cap >= largest else _model_size(sizes, cap)
    if capped < largest and (capped in tried or len(tried) < MAX_COMPILATIONS):
        k = capped if _measure(capped).total <= limit else largest
    times: dict[int, float] = {}
    stored = False
    if timing:
        name = _store.key(stored_as) if base is not None else None
        found = _store.read(name)
        # `tune=True` times whatever a bound left untimed.
        untimed = found is not None and not found[1] and timing == "always"
        if found and not untimed and _fits(found[0], sizes, largest, _measure, limit):
            (k, old), stored = found, True
            times = dict(old)
        else:
            if timing == "always":  # sizes from half the model's to the largest
                ladder = _timing.ladder(max(k // 2, 1), largest, sizes.at_most)
                fitting = [
                    s for s in sorted({*ladder, k}) if _measure(s).total <= limit
                ]
                times = _timing.time_each({s: _run(s) for s in fitting})
                store = bool(times)
            else:
                # A descent from the model's size, within a bound.
                spent = time.perf_counter() - start
                allowance = max(_timing.FLOOR_SECONDS, _timing.SEARCH_FACTOR * spent)
                per_size = compiling[0] / max(len(tried), 1)
                arguments = sum(map(argument_bytes, program.structs))
                ladder = _neighbours(k, largest, sizes.at_most)
                bounded = _bounded(
                    k, ladder, _measure, _run, limit, allowance, per_size, arguments
                )
                # A model's size that the bound left untimed is stored too, so
                # that a later process does not try again (its time is the same).
                store = bounded is not None
                times = bounded or {}
            if times:
                k = min(times, key=lambda s: (times[s], s))
            if store:
                _store.write(name, k, times)
    chosen = ChunkSizeChoice(
        k,
        tried[k].total,
        limit,
        tuple((s, tried[s].total) for s in sorted(tried)),
        largest=largest,
        model="timed" if times else "largest" if cap is None else "cache",
        stored=stored,
        element_bytes=element,
        cache_bytes=machine[1] if cap is not None else None,
        working_set=tuple((s, s * element) for s in sorted(tried)),
        times=tuple(sorted(times.items())),
    )
    if refine is not None:
        chosen = refine(chosen)
    _remember(_chosen, choice_key, chosen)
    return chosen
