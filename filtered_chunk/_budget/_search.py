"""Choosing the chunk size for a memory budget, by compiling the call.

What a chunked call allocates beyond its arguments (XLA's temporary plus output
bytes of the compiled program) is close to affine in the chunk size over a range
of sizes whose schedule keeps its shape: the outputs are allocated at full batch
size, and one chunk's working set grows linearly with it. Between such ranges it
jumps: the whole batch is one `vmap`, and with `remainder="separate"` a size
above half the batch runs one chunk and the remainder side by side (XLA unrolls
a loop of one step). So the chunk size is searched by compiling the call on
abstract shapes (`jax.jit(...).lower(...).compile().memory_analysis()`), never
by running it, as the transformations around it run it (`_program.py`):
the whole batch first (if it fits, nothing is chunked), then one element per
chunk, then each range from the largest down: its ends, and if only its
smallest size fits, sizes in between guessed by secant interpolation, each guess
checked together with its neighbour (bisecting when the guesses keep missing on
one side). One element per chunk need not be the smallest program (a
collective's staged program, or XLA's schedule of a small derivative, can need
more there than at a few elements, issue 23, item 7): where no range's ends
fit, a few sizes across the smallest range are measured (`_probes`) before the
budget is refused, and the refusal lists every size measured. That finds the
largest size measured to fit whose next size up measurably does not; the speed model
(`_model.py`) may then cap it at a smaller size, which runs only if it too
is measured to fit, all within `MAX_COMPILATIONS` sizes. Measurements are cached
on the traced program (as `_eager.py` keys compiled programs), choices on that
and the machine the model reads, so a repeated call compiles nothing for the
search.
"""

import math
from collections.abc import Callable, Hashable
from typing import Any

from jaxtyping import PyTree

from .._loop import Steps
from . import _model, _timing
from ._program import ChunkedProgram, has_reverse, linearisation, Measured
from ._values import ChunkSizeChoice, format_bytes, MemoryBudget


# A search measures at most this many sizes: the whole batch, one element, the
# ends of each further segment of sizes (`_segments`), then pairs of guesses (or,
# where no end fits, `_probes`), and one more for the speed model's size
# (`_model.py`). Each size compiles one program; under a reverse-mode
# transformation, two when the first fits (`choose_chunk_size`).
MAX_COMPILATIONS = 12


_MAX_ENTRIES = 256
_measured: dict[Hashable, Measured | None] = {}  # `None`: no linearisation
_chosen: dict[Hashable, ChunkSizeChoice] = {}


def _remember(cache: dict[Hashable, Any], key: Hashable | None, value: Any) -> None:
    if key is None:
        return
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
    """The refusal of a budget that no size measured fits, of a batch of `n`:
    below the outputs, which no chunk size changes; else what the smallest
    program measured needs (the size needing the least need not be one element
    per chunk), every size measured, and (`reverse`) what the measurement of a
    backward pass assumes of the loss."""
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


# What the measurement of a backward pass assumes (`_program.py`).
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
    """The ranges of sizes `(smallest, largest)` over which the schedule keeps its
    shape, largest first: the whole batch; with `remainder="separate"`, one whole
    chunk and a remainder (XLA unrolls a loop of one step, so both are live at
    once: the bytes jump above half the batch); two or more steps."""
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
    """The largest size in `bracket = (lo, hi)` (`lo` fits, `hi` does not, both in
    one segment) measured to fit whose next size up does not, or after
    `MAX_COMPILATIONS` sizes the largest found to fit."""
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
            if bytes_at(neighbour) <= limit:
                lo = neighbour
            else:
                hi = neighbour
    return lo


def _probes(sizes: _Sizes, bracket: tuple[int, int], count: int) -> list[int]:
    """Up to `count` sizes strictly inside `bracket = (lo, hi)` to measure where
    neither end fits, largest first. By priority: the size above `lo` (one
    element can be the costly one), the largest size below `hi` that divides the
    batch (no overlapping step or remainder: under a derivative it can need less
    than its neighbours), then three sizes spaced geometrically across the
    range, each with the largest divisor of the batch not above it."""
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
    batch size, or after `MAX_COMPILATIONS` sizes the largest found to fit),
    searching each segment of sizes (`_segments`) from the largest down."""
    bytes_at = lambda k: measure(k).total  # noqa: E731
    segments = _segments(sizes)
    if bytes_at(sizes.n) <= limit:
        return sizes.n
    # The outputs exist at full batch size whatever the chunk size: a budget
    # below them is refused without compiling more.
    if sizes.n == 1 or measure(sizes.n).output > limit:
        raise on_too_small()
    bytes_at(1)  # the slope of the speed model's working set (`_element_bytes`)
    for lo, hi in segments[1:]:
        # Within a segment the bytes are close to affine in the size, so if
        # neither end fits, nothing between does; except in the smallest sizes.
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
    """One element's share of a chunk's working set: the slope of the bytes over
    the sizes measured that run two or more steps, else (only the whole batch was
    measured) its bytes over its size."""
    lo, hi = _segments(sizes)[-1]
    steps = sorted(k for k in measured if lo <= k <= hi and k < sizes.n)
    if len(steps) >= 2:
        a, b = steps[0], steps[-1]
        return max(-(-(measured[b] - measured[a]) // (b - a)), 0)
    k = max(measured)
    return -(-measured[k] // k)


def _model_size(sizes: _Sizes, cap: int) -> int:
    """The size the model runs for a cap on the chunk size: the largest size not
    above it that runs two or more steps, but not fewer than `MIN_CHUNK` elements
    (the smallest size from there up, where rounding to a balanced size falls
    below)."""
    k = sizes.at_most(min(cap, _segments(sizes)[-1][1]))
    return k if k >= _model.MIN_CHUNK else sizes.above(_model.MIN_CHUNK - 1)


def choose_chunk_size(
    run: Callable[[int | None, Any], Any],
    tree: PyTree[Any],
    *,
    batch_size: int,
    budget: MemoryBudget,
    remainder: str,
    options: Hashable,
    api: str,
) -> ChunkSizeChoice:
    """The chunk size to run `run(chunk_size, tree)` at (the chunked call; `None`
    for the whole batch): the largest that fits `budget`, measured by compiling it
    as the transformations around it run it, capped by the speed model
    (`_model.py`) at a smaller size that also fits as measured."""
    program = ChunkedProgram(run, tree)
    limit = budget.resolve()
    base, layers = program.key()
    machine = (_model.backend(), _model.cache_bytes())  # the model reads
    base = None if base is None else (base, batch_size, remainder, options)
    choice_key = (base, limit, budget.tune, machine)
    chosen = _chosen.get(choice_key) if base is not None else None
    if chosen is not None:
        return chosen
    tried: dict[int, Measured] = {}
    runs: dict[int, Callable[[], Any]] = {}  # to time, with `tune`

    def _once(k: int, linearize: bool) -> Measured | None:
        key = None if base is None else (base, k, linearize)
        if key is not None and key in _measured:
            return _measured[key]
        chunk = None if k >= batch_size else k
        if linearize:
            found = linearisation(program, chunk)
        else:
            found, run = program.compile(chunk)
            if budget.tune:  # the program that runs, to time
                runs[k] = run
        _remember(_measured, key, found)
        return found

    def _run_at(k: int) -> Callable[[], Any]:
        # Compiled anew where the measurement came from the cache (which keeps
        # no compiled programs).
        if k not in runs:
            runs[k] = program.compile(None if k >= batch_size else k)[1]
        return runs[k]

    def _measure(k: int, full: bool = False) -> Measured:
        # Reverse mode runs as a pullback (`grad`) or a linearisation
        # (`linearize`, none where `fun` holds a `jax.custom_vjp`): both must
        # fit, and the second is only worth compiling when the first does (or
        # `full`, for what a size needs).
        if k not in tried or full:
            found = _once(k, False)
            assert found is not None
            if not has_reverse(layers) or full or found.total <= limit:
                complete.add(k)
                linear = _once(k, True) if has_reverse(layers) else None
                if linear is not None:
                    found = max(found, linear, key=lambda m: m.total)
            tried[k] = found
        return tried[k]

    def _refusal() -> ValueError:
        # What the smallest program measured needs, with both of its programs
        # under reverse mode (the second may make another the smallest).
        while (k := min(tried, key=lambda s: (tried[s].total, s))) not in complete:
            _measure(k, True)
        reverse = has_reverse(layers)
        return _too_small(api, budget, limit, tried, batch_size, reverse)

    complete: set[int] = set()  # sizes measured as every program they run
    sizes = _Sizes(batch_size, remainder)
    # One size is kept back for the model's.
    largest = _search(_measure, sizes, limit, _refusal, lambda: len(tried) + 1)
    element = _element_bytes({s: m.total for s, m in tried.items()}, sizes)
    cap = _model.cache_cap(element)
    k = largest
    capped = largest if cap is None or cap >= largest else _model_size(sizes, cap)
    # The model's size, if it fits as measured (else the largest), within the
    # search's bound on the sizes measured.
    if capped < largest and (capped in tried or len(tried) < MAX_COMPILATIONS):
        if _measure(capped).total <= limit:
            k = capped
    times: dict[int, float] = {}
    if budget.tune:
        # Sizes from half the model's to the largest, each measured to fit.
        ladder = _timing.ladder(max(k // 2, 1), largest, sizes.at_most)
        fitting = [s for s in sorted({*ladder, k}) if _measure(s).total <= limit]
        times = _timing.time_each({s: _run_at(s) for s in fitting})
        k = min(times, key=lambda s: (times[s], s))
    chosen = ChunkSizeChoice(
        k,
        tried[k].total,
        limit,
        tuple((s, tried[s].total) for s in sorted(tried)),
        largest=largest,
        model="timed" if times else "largest" if cap is None else "cache",
        element_bytes=element,
        cache_bytes=machine[1] if cap is not None else None,
        working_set=tuple((s, s * element) for s in sorted(tried)),
        times=tuple(sorted(times.items())),
    )
    _remember(_chosen, None if base is None else choice_key, chosen)
    return chosen
