"""Choosing `chunk_size` from a memory budget: `MemoryBudget`, `"auto"` and
`suggest_chunk_size`.

What a chunked call allocates beyond its arguments (XLA's temporary plus output
bytes of the compiled program) is close to affine in the chunk size: the outputs
are allocated at full batch size, and one chunk's working set grows linearly with
it. So the chunk size is searched by compiling the call on abstract shapes
(`jax.jit(...).lower(...).compile().memory_analysis()`), never by running it: the
whole batch first (if it fits, nothing is chunked), then one element per chunk
(if that does not fit, nothing does), then sizes in between guessed by secant
interpolation of the measured bytes, each guess checked together with its
neighbour so that the answer is a measured size that fits whose next size up
measurably does not. Measurements and choices are cached on the traced program,
so a repeated call compiles nothing for the search.
"""

import dataclasses
import math
import operator
import os
import re
from collections.abc import Callable, Hashable
from typing import Any, Literal, SupportsIndex, TypeAlias

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax._src.interpreters import ad
from jaxtyping import PyTree

from ._eager import _callables, _InnerConstants


# "auto" budgets this share of the memory the device reports free: XLA's estimate
# leaves out the allocator's fragmentation and what runs beside the call.
AUTO_FRACTION = 0.8
# A search compiles the whole batch, one element, then pairs of guesses.
MAX_COMPILATIONS = 10
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def format_bytes(num: int) -> str:
    """`num` bytes in binary units, for messages (`"3.2 MiB"`)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= scale:
            return f"{num / scale:.1f} {unit}"
    return f"{num} B"


def _parse_bytes(text: str) -> int:
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"`MemoryBudget({text!r})`: a size string is a number and a unit, such "
            "as `'4GiB'`, `'512MiB'` or `'1.5GB'` (units B, KB, MB, GB, TB and "
            "KiB, MiB, GiB, TiB)."
        )
    return int(float(match.group(1)) * _UNITS[unit])


class MemoryBudget(eqx.Module):
    """A memory budget for a chunked call: give it as `chunk_size` to any chunked
    transform, and the largest chunk size whose compiled program fits is chosen.

    The budget bounds what the chunked call allocates beyond its arguments: XLA's
    temporary plus output bytes (`memory_analysis()`) of the compiled program that
    runs. Under `jax.grad`/`jax.vjp` that is the differentiated program (forward and
    backward, with the transform's `checkpoint` setting). The chunk size is found
    by compiling the call at a few chunk sizes on abstract shapes (usually four
    compilations, at most ten) when the transform is first called with those
    shapes, inside or outside `jax.jit`; the choice is cached, so later calls
    compile nothing more for it.

    **Arguments:**

    - `size`: the budget, as one of
        - an integer number of bytes, such as `2**30`;
        - a string with a unit, such as `"4GiB"`, `"512MiB"` or `"1.5GB"` (decimal
          units KB, MB, GB, TB are powers of 1000; binary KiB, MiB, GiB, TiB of
          1024);
        - a float in `(0, 1]`: that fraction of the memory the default device has
          free when the call is traced (`bytes_limit - bytes_in_use` from
          `jax.Device.memory_stats()` on an accelerator, the system's available
          memory on CPU).

    `chunk_size="auto"` is `MemoryBudget(0.8)`: 80% of the free memory, leaving
    room for what XLA's estimate does not count (the allocator's fragmentation,
    other live arrays).

    !!! example

        ```python
        import jax.numpy as jnp
        import filtered_chunk as fc

        def f(x):
            return jnp.sum(jnp.tanh(jnp.outer(x, x)))  # a 256 x 256 temporary

        xs = jnp.ones((1000, 256))
        chunked = fc.filter_chunked_vmap(f, chunk_size=fc.MemoryBudget("16MiB"))
        assert jnp.allclose(chunked(xs), jnp.sum(jnp.tanh(1.0)) * 256**2)
        choice = fc.suggest_chunk_size(chunked, xs)
        assert choice.bytes <= 16 * 2**20
        print(choice.chunk_size, choice.bytes)
        ```
    """

    bytes: int | None = eqx.field(static=True)
    fraction: float | None = eqx.field(static=True)

    def __init__(self, size: Any):  # `int | float | str`, checked by value
        if isinstance(size, str):
            self.bytes, self.fraction = _parse_bytes(size), None
        elif isinstance(size, bool) or not isinstance(
            size, int | float | np.integer | np.floating
        ):
            raise TypeError(
                "`MemoryBudget(size)` takes a number of bytes (an integer), a string "
                "such as `'4GiB'`, or a fraction of the free memory (a float in "
                f"`(0, 1]`), got {type(size).__name__} object {size!r}."
            )
        elif isinstance(size, float | np.floating):
            if not 0 < size <= 1:
                raise ValueError(
                    "`MemoryBudget(size)` with a float is a fraction of the free "
                    f"memory and must be in `(0, 1]`, got {size!r}. Give a number of "
                    "bytes as an integer (`int(4e9)`) or a string (`'4GB'`)."
                )
            self.bytes, self.fraction = None, float(size)
        else:
            self.bytes, self.fraction = operator.index(size), None
        if self.bytes is not None and self.bytes < 1:
            raise ValueError(
                f"`MemoryBudget(size)` must be at least one byte, got {size!r}."
            )

    def __repr__(self) -> str:
        return f"MemoryBudget({self.fraction if self.bytes is None else self.bytes})"

    def resolve(self) -> int:
        """The budget in bytes (for a fraction, of the memory free now)."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        # Round down to 1/32 of a power of two, so that a budget read from the
        # free memory, which moves a little between calls, keeps its cache entry.
        free = self.fraction * available_bytes()
        step = 2 ** max(math.floor(math.log2(max(free, 1))) - 5, 0)
        return max(int(free // step * step), 1)


# What `chunk_size` accepts: an integer (anything `operator.index` takes), `None`,
# `"auto"` or a `MemoryBudget`. Builders check it by value (`normalise_chunk_size`).
ChunkSizeSpec: TypeAlias = int | SupportsIndex | Literal["auto"] | MemoryBudget | None


def available_bytes(device: Any = None) -> int:
    """The memory `device` (the default device) has free: `bytes_limit -
    bytes_in_use` where JAX reports them, else the system's available memory."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def normalise_chunk_size(chunk_size: Any, api: str) -> "int | MemoryBudget | None":
    """`chunk_size` as the transforms hold it, or the error for a bad one."""
    if chunk_size is None or isinstance(chunk_size, MemoryBudget):
        return chunk_size
    if isinstance(chunk_size, str):
        if chunk_size == "auto":
            return MemoryBudget(AUTO_FRACTION)
        raise ValueError(
            f"`{api}(..., chunk_size=...)` must be a positive integer, `None`, "
            f"`'auto'` or a `filtered_chunk.MemoryBudget`, got {chunk_size!r}. For a "
            f"memory budget write `chunk_size=fc.MemoryBudget({chunk_size!r})`."
        )
    is_bool = isinstance(chunk_size, bool | np.bool_)
    if not is_bool and getattr(type(chunk_size), "__index__", None) is None:
        raise TypeError(
            f"`{api}(..., chunk_size=...)` must be a positive integer, `None`, "
            "`'auto'` or a `filtered_chunk.MemoryBudget`, got "
            f"{type(chunk_size).__name__} object {chunk_size!r}."
        )
    # A bool is an int to Python, but never a size.
    size = -1 if is_bool else operator.index(chunk_size)
    if size < 1:
        raise ValueError(
            f"`{api}(..., chunk_size=...)` must be a positive integer or `None`, "
            f"got {chunk_size!r}."
        )
    return size


class ChunkSizeChoice(eqx.Module):
    """What [`filtered_chunk.suggest_chunk_size`][] reports.

    - `chunk_size`: the chosen chunk size: the largest measured to fit. It is the
        batch size (or the number of Jacobian rows/columns) when the whole batch
        fits, which evaluates it in one `vmap`.
    - `bytes`: XLA's temporary plus output bytes of the program at that size.
    - `budget`: the budget in bytes.
    - `tried`: `(chunk_size, bytes)` for every size compiled by the search, by size.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtered_chunk as fc

        f = lambda x: jnp.tanh(jnp.outer(x, x)) @ x
        chunked = fc.filter_chunked_vmap(f, chunk_size=fc.MemoryBudget("1MiB"))
        choice = fc.suggest_chunk_size(chunked, jnp.ones((500, 64)))
        for chunk_size, num_bytes in choice.tried:
            fits = "fits" if num_bytes <= choice.budget else "too large"
            print(f"chunk_size={chunk_size}: {num_bytes} bytes, {fits}")
        assert (choice.chunk_size, choice.bytes) in choice.tried
        ```
    """

    chunk_size: int
    bytes: int
    budget: int
    tried: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class _Measured:
    temp: int
    output: int

    @property
    def total(self) -> int:
        return self.temp + self.output


_MAX_ENTRIES = 256
_measured: dict[Hashable, _Measured] = {}
_chosen: dict[Hashable, ChunkSizeChoice] = {}


def _remember(cache: dict[Hashable, Any], key: Hashable | None, value: Any) -> None:
    if key is None:
        return
    cache[key] = value
    while len(cache) > _MAX_ENTRIES:
        del cache[next(iter(cache))]


def _differentiated(x: Any) -> bool:
    """Whether `x` is traced by `jax.grad`/`jax.vjp`/`jax.jvp` (maybe under other
    transformations): then the program that runs is the differentiated one."""
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, ad.JVPTracer | getattr(ad, "LinearizeTracer", ad.JVPTracer)):
            return bool(jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact))
        x = getattr(x, "val", None)
    return False


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
        leaves, self.treedef = jtu.tree_flatten(dynamic)
        self.run = run
        self.structs = [_struct(x) for x in leaves]
        self.mask = [_differentiated(x) for x in leaves]
        self.num_compilations = 0

    def trace(self, k: int | None) -> Any:
        """The jaxpr at `k` (its constants may be an outer transformation's
        tracers, or arrays the call closes over)."""

        def _fn(_leaves: list[Any]) -> Any:
            tree = eqx.combine(jtu.tree_unflatten(self.treedef, _leaves), self.static)
            return jtu.tree_leaves(eqx.filter(self.run(k, tree), eqx.is_array))

        return jax.make_jaxpr(_fn)(self.structs)

    def key(self) -> Hashable | None:
        """What the measurements depend on: the traced program (unchunked, and its
        callables' identities), the inputs' types, what is differentiated."""
        closed = self.trace(None)
        try:
            key = (
                str(closed.jaxpr),
                tuple(_callables(closed.jaxpr)),
                tuple(_key_of(_struct(x)) for x in closed.consts),
                tuple(_differentiated(x) for x in closed.consts),
                tuple(self.mask),
            )
            hash(key)
        except (TypeError, _InnerConstants):
            return None
        return key

    def measure(self, k: int | None) -> _Measured:
        """XLA's temporary and output bytes of the call at chunk size `k`."""
        closed = self.trace(k)
        consts = list(closed.consts)
        mask = [_differentiated(x) for x in consts] + self.mask
        fn = _as_program(closed.jaxpr, len(consts), mask)
        structs = [_struct(x) for x in consts] + self.structs
        self.num_compilations += 1
        analysis = jax.jit(fn).lower(structs).compile().memory_analysis()
        assert analysis is not None
        return _Measured(
            int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes)
        )


def _as_program(jaxpr: Any, num_consts: int, mask: list[bool]) -> Callable:
    """The function measured: `jaxpr`'s evaluation, or with a differentiated input
    its evaluation and pullback (of ones), as `jax.grad` runs it."""

    def _forward(leaves: list[Any]) -> list[Any]:
        return jax.core.eval_jaxpr(jaxpr, leaves[:num_consts], *leaves[num_consts:])

    if not any(mask):
        return _forward

    def _vjp(leaves: list[Any]) -> Any:
        def _diff(_diff_leaves: list[Any]) -> tuple[list[Any], list[Any]]:
            it = iter(_diff_leaves)
            full = [next(it) if m else x for x, m in zip(leaves, mask, strict=True)]
            outs = _forward(full)
            inexact = [bool(jnp.issubdtype(o.dtype, jnp.inexact)) for o in outs]
            return (
                [o for o, i in zip(outs, inexact) if i],
                [o for o, i in zip(outs, inexact) if not i],
            )

        diff = [x for x, m in zip(leaves, mask, strict=True) if m]
        outs, pullback, others = jax.vjp(_diff, diff, has_aux=True)
        return outs, others, pullback([jnp.ones_like(o) for o in outs])

    return _vjp


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
    return ValueError(
        f"`{api}(..., chunk_size={budget!r})`: the memory budget of {limit} bytes "
        f"({format_bytes(limit)}) is too small for this call. Even one element per "
        "chunk (one row or column, for a Jacobian) needs "
        f"{smallest.total} bytes ({format_bytes(smallest.total)}) of temporaries "
        f"and outputs, of which {smallest.output} bytes are outputs, "
        "allocated at full batch size whatever the chunk size. Give a budget of at "
        f"least {smallest.total} bytes, or make the outputs smaller (map fewer "
        "elements per call, or return less)."
    )


def _search(
    measure: Callable[[int], _Measured],
    sizes: _Sizes,
    limit: int,
    on_too_small: Callable[[_Measured], Exception],
) -> int:
    """The largest size measured to fit `limit` whose next size up does not (or the
    batch size, or after `MAX_COMPILATIONS` the largest found to fit)."""
    n = sizes.n
    bytes_at = lambda k: measure(k).total  # noqa: E731
    if bytes_at(n) <= limit:
        return n
    if n == 1 or bytes_at(1) > limit:
        raise on_too_small(measure(1))
    lo, hi, count, moved = 1, n, 2, ""
    while sizes.above(lo) < hi and count < MAX_COMPILATIONS:
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
        count += 1
        fits = bytes_at(k) <= limit
        lo, hi, moved = (k, hi, moved + "l") if fits else (lo, k, moved + "h")
        neighbour = sizes.above(k) if fits else sizes.below(k)
        if not bisect and lo < neighbour < hi:
            count += 1
            if bytes_at(neighbour) <= limit:
                lo = neighbour
            else:
                hi = neighbour
    return lo


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
    """The largest chunk size for which `run(chunk_size, tree)` (the chunked call;
    `None` for the whole batch) fits `budget`, measured by compiling it."""
    program = _Program(run, tree)
    limit = budget.resolve()
    base = program.key()
    base = None if base is None else (base, batch_size, remainder, options)
    chosen = _chosen.get((base, limit)) if base is not None else None
    if chosen is not None:
        return chosen
    tried: dict[int, _Measured] = {}

    def _measure(k: int) -> _Measured:
        if k in tried:
            return tried[k]
        key = None if base is None else (base, k)
        found = _measured.get(key) if key is not None else None
        if found is None:
            found = program.measure(None if k >= batch_size else k)
            _remember(_measured, key, found)
        tried[k] = found
        return found

    sizes = _Sizes(batch_size, remainder)
    too_small = lambda m: _too_small(api, budget, limit, m)  # noqa: E731
    k = _search(_measure, sizes, limit, too_small)
    chosen = ChunkSizeChoice(
        k, tried[k].total, limit, tuple((s, tried[s].total) for s in sorted(tried))
    )
    _remember(_chosen, None if base is None else (base, limit), chosen)
    return chosen


def suggest_chunk_size(fun: Callable[..., Any], /, *args: Any, **kwargs: Any):
    """Reports the chunk size a chunked transform built with a memory budget would
    choose for these arguments, without running anything.

    **Arguments:**

    - `fun`: a chunked transform whose `chunk_size` is a
        [`filtered_chunk.MemoryBudget`][] or `"auto"`, as built by
        [`filtered_chunk.filter_chunked_vmap`][], `filter_chunked_apply`,
        `chunked_jacrev`, `chunked_jacfwd`, `filter_chunked_jacrev` or
        `filter_chunked_jacfwd`.
    - `*args`, `**kwargs`: what `fun` would be called with. Arrays may be given as
        `jax.ShapeDtypeStruct`s: only their shapes and dtypes are used.

    **Returns:**

    A [`filtered_chunk.ChunkSizeChoice`][]: the chosen `chunk_size`, its measured
    `bytes`, the `budget` in bytes, and the `(chunk_size, bytes)` pairs `tried`.
    The search is the one a call makes (for the program without differentiation),
    and shares its cache: the call compiles nothing more to choose.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtered_chunk as fc

        def f(x):
            return jnp.sum(jnp.tanh(jnp.outer(x, x)))

        chunked = fc.filter_chunked_vmap(f, chunk_size=fc.MemoryBudget("16MiB"))
        xs = jax.ShapeDtypeStruct((100_000, 256), jnp.float32)
        choice = fc.suggest_chunk_size(chunked, xs)
        print(choice.chunk_size, choice.bytes, choice.tried)
        assert choice.bytes <= choice.budget == 16 * 2**20
        # Fix the number once: a plain `chunk_size` searches nothing.
        fixed = fc.filter_chunked_vmap(f, chunk_size=choice.chunk_size)
        ```
    """
    if isinstance(fun, eqx.Partial):  # a bound method: `self` comes first
        args, fun = (*fun.args, *args), fun.func
    choose = getattr(fun, "_choose", None)
    budget = getattr(fun, "_budget", None)
    if choose is None or not isinstance(budget, MemoryBudget):
        raise TypeError(
            "`suggest_chunk_size(fun, ...)` takes a chunked transform built with a "
            "memory budget, such as `fc.filter_chunked_vmap(f, "
            "chunk_size=fc.MemoryBudget('4GiB'))` or `chunk_size='auto'`, got "
            f"{fun!r}."
        )
    found: list[ChunkSizeChoice | None] = []

    def _choose(_args: Any, _kwargs: Any) -> None:
        found.append(choose(_args, _kwargs))

    eqx.filter_eval_shape(_choose, args, kwargs)
    if found[0] is None:
        raise ValueError(
            "`suggest_chunk_size`: the call has no batch to split (nothing is "
            "mapped, or the batch is empty), so there is no chunk size to choose."
        )
    return found[0]
