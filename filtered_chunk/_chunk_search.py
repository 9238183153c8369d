"""Choosing the chunk size for a memory budget, by compiling the call.

What a chunked call allocates beyond its arguments (XLA's temporary plus output
bytes of the compiled program) is close to affine in the chunk size over a range
of sizes whose schedule keeps its shape: the outputs are allocated at full batch
size, and one chunk's working set grows linearly with it. Between such ranges it
jumps: the whole batch is one `vmap`, and with `remainder="separate"` a size
above half the batch runs one chunk and the remainder side by side (XLA unrolls
a loop of one step). So the chunk size is searched by compiling the call on
abstract shapes (`jax.jit(...).lower(...).compile().memory_analysis()`), never
by running it, as the transformations around it run it (`_budget_program.py`):
the whole batch first (if it fits, nothing is chunked), then one element per
chunk (if that does not fit, nothing does), then each range from the largest
down: its ends, and if only its smallest size fits, sizes in between guessed by
secant interpolation, each guess checked together with its neighbour
(bisecting when the guesses keep missing on one side). That finds the largest
size measured to fit whose next size up measurably does not; the speed model
(`_chunk_model.py`) may then cap it at a smaller size, which runs only if it too
is measured to fit, all within `MAX_COMPILATIONS` sizes. Measurements are cached
on the traced program (as `_eager.py` keys compiled programs), choices on that
and the machine the model reads, so a repeated call compiles nothing for the
search.
"""

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.tree_util as jtu
from jaxtyping import PyTree

from . import _chunk_model, _chunk_timing
from ._budget import ChunkSizeChoice, format_bytes, MemoryBudget
from ._budget_program import has_reverse, Layer, layers_of, transformed
from ._eager import program_key


# A search measures at most this many sizes: the whole batch, one element, the
# ends of each further segment of sizes (`_segments`), then pairs of guesses, and
# one more for the speed model's size (`_chunk_model.py`). Each size compiles one
# program; under a reverse-mode transformation, two when the first fits
# (`choose_chunk_size`).
MAX_COMPILATIONS = 12


@dataclasses.dataclass(frozen=True)
class _Measured:
    temp: int
    output: int
    fed: int = 0  # the tangents or cotangents a derivative feeds in

    @property
    def total(self) -> int:
        return self.temp + self.output + self.fed


_MAX_ENTRIES = 256
_measured: dict[Hashable, _Measured] = {}
_chosen: dict[Hashable, ChunkSizeChoice] = {}


def _remember(cache: dict[Hashable, Any], key: Hashable | None, value: Any) -> None:
    if key is None:
        return
    cache[key] = value
    while len(cache) > _MAX_ENTRIES:
        del cache[next(iter(cache))]


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    aval = jax.typeof(x)
    sharding = None
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        if len(x.sharding.device_set) > 1:
            sharding = x.sharding  # per-device bytes, as the call runs
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding
    )


def _key_of(struct: jax.ShapeDtypeStruct) -> Hashable:
    return (struct.shape, str(struct.dtype), struct.weak_type, struct.sharding)


class _Program:
    """The chunked call at any chunk size, as a function of abstract inputs."""

    def __init__(self, run: Callable[[int | None, Any], Any], tree: PyTree[Any]):
        dynamic, self.static = eqx.partition(tree, eqx.is_array)
        self.leaves, self.treedef = jtu.tree_flatten(dynamic)
        self.run = run
        self.structs = [_struct(x) for x in self.leaves]
        self.examples: dict[Hashable, Any] = {}  # shared by the programs timed

    def trace(self, k: int | None) -> Any:
        """The jaxpr at `k` (its constants may be an outer transformation's
        tracers, or arrays the call closes over)."""

        def _fn(_leaves: list[Any]) -> Any:
            tree = eqx.combine(jtu.tree_unflatten(self.treedef, _leaves), self.static)
            return jtu.tree_leaves(eqx.filter(self.run(k, tree), eqx.is_array))

        return jax.make_jaxpr(_fn)(self.structs)

    def key(self) -> tuple[Hashable | None, tuple[Layer, ...]]:
        """What the measurements depend on (the traced program, unchunked, and
        its callables' identities; the inputs' types; the transformations around
        it), and those transformations."""
        closed = self.trace(None)
        layers = layers_of([*closed.consts, *self.leaves])
        try:
            key = (
                str(closed.jaxpr),
                tuple(program_key(closed.jaxpr, evaluated_only=False)),
                tuple(_key_of(_struct(x)) for x in closed.consts),
                tuple(_key_of(s) for s in self.structs),  # with their shardings
                layers,
            )
            hash(key)
        except TypeError:
            return None, layers
        return key, layers

    def compile(
        self, k: int | None, linearize: bool = False
    ) -> tuple[_Measured, Callable[[], Any]]:
        """XLA's temporary and output bytes of the call at chunk size `k` as the
        transformations around it run it (reverse mode as a linearisation if
        `linearize`), plus the bytes they feed in (`_budget_program.py`); and a
        function that runs the compiled program on example arguments
        (`_chunk_timing.py`), made on its first call."""
        closed = self.trace(k)
        consts = list(closed.consts)
        layers = layers_of([*consts, *self.leaves])

        def _forward(leaves: list[Any]) -> list[Any]:
            return jax.core.eval_jaxpr(
                closed.jaxpr, leaves[: len(consts)], *leaves[len(consts) :]
            )

        structs = [_struct(x) for x in consts] + self.structs
        fn, structs, fed = transformed(_forward, structs, layers, linearize)
        compiled = jax.jit(fn).lower(structs).compile()
        analysis = compiled.memory_analysis()
        assert analysis is not None
        measured = _Measured(
            int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes), fed
        )
        arguments: list[Any] = []

        def _run() -> Any:
            if not arguments:
                known = [*consts, *self.leaves]
                examples = _chunk_timing.example_arguments(
                    structs, known, self.examples
                )
                arguments.append(examples)
            return compiled(arguments[0])

        return measured, _run


class _Sizes:
    """The chunk sizes worth trying for a batch: with `remainder="overlap"` only
    balanced ones, `ceil(batch_size / num_steps)` (any other size runs as the
    balanced size with its number of steps); with `"separate"` every size."""

    def __init__(self, batch_size: int, remainder: str):
        self.n, self.balanced = batch_size, remainder == "overlap"

    def at_most(self, x: int) -> int:
        """The largest size not above `x` (`1 <= x <= batch_size`)."""
        if not self.balanced:
            return x
        return -(-self.n // -(-self.n // x))

    def above(self, k: int) -> int:
        """The smallest size above `k` (`k < batch_size`)."""
        if not self.balanced:
            return k + 1
        steps = -(-self.n // (k + 1))
        size = -(-self.n // steps)
        return size if size > k else -(-self.n // (steps - 1))

    def below(self, k: int) -> int:
        """The largest size below `k` (`k > 1`)."""
        return self.at_most(k - 1)


def _too_small(api: str, budget: MemoryBudget, limit: int, smallest: _Measured):
    fed = (
        f" and {smallest.fed} bytes are the tangents or cotangents that the "
        "derivative around the call feeds in,"
        if smallest.fed
        else ","
    )
    return ValueError(
        f"`{api}(..., chunk_size={budget!r})`: the memory budget of {limit} bytes "
        f"({format_bytes(limit)}) is too small for this call. Even one element per "
        "chunk (one row or column, for a Jacobian) needs "
        f"{smallest.total} bytes ({format_bytes(smallest.total)}) of temporaries "
        f"and outputs, of which {smallest.output} bytes are outputs{fed} "
        "allocated at full batch size whatever the chunk size. Give a budget of at "
        f"least {smallest.total} bytes, or make the outputs smaller (map fewer "
        "elements per call, or return less)."
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
        [] if sizes.balanced or two_steps + 1 > n - 1 else [(two_steps + 1, n - 1)]
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


def _search(
    measure: Callable[[int], _Measured],
    sizes: _Sizes,
    limit: int,
    on_too_small: Callable[[_Measured], Exception],
    spent: Callable[[], int],
) -> int:
    """The largest size measured to fit `limit` whose next size up does not (or the
    batch size, or after `MAX_COMPILATIONS` sizes the largest found to fit),
    searching each segment of sizes (`_segments`) from the largest down."""
    bytes_at = lambda k: measure(k).total  # noqa: E731
    segments = _segments(sizes)
    if bytes_at(sizes.n) <= limit:
        return sizes.n
    if sizes.n == 1 or bytes_at(1) > limit:
        raise on_too_small(measure(1))
    for lo, hi in segments[1:]:
        # Within a segment the bytes are close to affine in the size, so if
        # neither end fits, nothing between does.
        if bytes_at(hi) <= limit:
            return hi
        if lo < hi and bytes_at(lo) <= limit:
            return _secant(bytes_at, sizes, limit, (lo, hi), spent)
    raise AssertionError("one element per chunk fits")  # the last segment's `lo`


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
    return k if k >= _chunk_model.MIN_CHUNK else sizes.above(_chunk_model.MIN_CHUNK - 1)


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
    (`_chunk_model.py`) at a smaller size that also fits as measured."""
    program = _Program(run, tree)
    limit = budget.resolve()
    base, layers = program.key()
    machine = (_chunk_model.backend(), _chunk_model.cache_bytes())  # the model reads
    base = None if base is None else (base, batch_size, remainder, options)
    choice_key = (base, limit, budget.tune, machine)
    chosen = _chosen.get(choice_key) if base is not None else None
    if chosen is not None:
        return chosen
    tried: dict[int, _Measured] = {}
    runs: dict[int, Callable[[], Any]] = {}  # to time, with `tune`

    def _once(k: int, linearize: bool) -> _Measured:
        key = None if base is None else (base, k, linearize)
        found = _measured.get(key) if key is not None else None
        if found is None:
            found, run = program.compile(None if k >= batch_size else k, linearize)
            _remember(_measured, key, found)
            if budget.tune and not linearize:  # the program that runs, to time
                runs[k] = run
        return found

    def _run_at(k: int) -> Callable[[], Any]:
        # Compiled anew where the measurement came from the cache (which keeps
        # no compiled programs).
        if k not in runs:
            runs[k] = program.compile(None if k >= batch_size else k)[1]
        return runs[k]

    def _measure(k: int, full: bool = False) -> _Measured:
        # Reverse mode runs as a pullback (`grad`) or a linearisation
        # (`linearize`): both must fit, and the second is only worth compiling
        # when the first does (or `full`, for what a size needs).
        if k not in tried or full:
            found = _once(k, False)
            if has_reverse(layers) and (full or found.total <= limit):
                found = max(found, _once(k, True), key=lambda m: m.total)
            tried[k] = found
        return tried[k]

    sizes = _Sizes(batch_size, remainder)
    too_small = lambda _: _too_small(api, budget, limit, _measure(1, True))  # noqa: E731
    # One size is kept back for the model's.
    largest = _search(_measure, sizes, limit, too_small, lambda: len(tried) + 1)
    element = _element_bytes({s: m.total for s, m in tried.items()}, sizes)
    cap = _chunk_model.cache_cap(element)
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
        ladder = _chunk_timing.ladder(max(k // 2, 1), largest, sizes.at_most)
        fitting = [s for s in sorted({*ladder, k}) if _measure(s).total <= limit]
        times = _chunk_timing.time_each({s: _run_at(s) for s in fitting})
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
