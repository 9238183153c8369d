"""Memory budgets as a `chunk_size`, and what a search reports."""

import math
import operator
import re
from typing import Any, Literal, SupportsIndex, TypeAlias

import equinox as eqx
import numpy as np

from ._free_memory import available_bytes


# "auto" budgets this share of the memory the device reports free: XLA's estimate
# leaves out the allocator's fragmentation and what runs beside the call.
AUTO_FRACTION = 0.8
_UNITS = {"": 1, "b": 1} | {
    f"{prefix}{binary}b": base**power
    for power, prefix in enumerate("kmgt", 1)
    for binary, base in (("", 10**3), ("i", 2**10))
}
_NUMBERS = int | float | np.integer | np.floating
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def format_bytes(num: int) -> str:
    """`num` bytes in binary units, for messages (`"3.2 MiB"`)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= scale:
            return f"{num / scale:.1f} {unit}"
    return f"{num} B"


def _parse_bytes(text: str) -> int:
    match = _SIZE.match(text)
    unit = match[2].lower() if match else None
    if match is None or unit not in _UNITS:
        auto = text.strip().lower() == "auto"
        hint = (
            " For 80% of the free memory write `chunk_size='auto'` (or "
            f"`MemoryBudget({AUTO_FRACTION})`)."
        )
        raise ValueError(
            f"`MemoryBudget({text!r})`: a size string is a number and a unit, such "
            "as `'4GiB'`, `'512MiB'` or `'1.5GB'` (units B, KB, MB, GB, TB and "
            f"KiB, MiB, GiB, TiB).{hint if auto else ''}"
        )
    size = float(match[1]) * _UNITS[unit]
    if not math.isfinite(size):  # `int` of an infinite float is an `OverflowError`
        raise ValueError(
            f"`MemoryBudget({text!r})`: the size is too large to be a number of "
            "bytes; give a size such as `'4GiB'`."
        )
    return int(size)


class MemoryBudget(eqx.Module):
    """A memory budget for a chunked call: given as `chunk_size` to any chunked
    transform, it chooses a chunk size whose compiled program fits: on CPU the
    fastest of a few such sizes, timed on this machine (`tune`), else the largest.

    The budget bounds what the chunked call allocates beyond its arguments: XLA's
    temporary plus output bytes (`memory_analysis()`) of the compiled program that
    runs. Under `jax.grad`/`jax.vjp`/`jax.linearize` that is the larger of the
    backward pass (forward and backward, with the transform's `checkpoint` setting,
    as `jax.value_and_grad(..., has_aux=True)` of a loss of the outputs runs it, the
    cotangent computed from them) and the linearisation (none where `fun` holds a
    `jax.custom_vjp`); under `jax.jvp`/`jax.jacfwd` the forward-mode program (primal
    and tangent outputs). Tangents are arguments, their bytes counted. The call is
    compiled on abstract shapes at a few chunk sizes (usually four to seven, at most
    twelve; two programs a size under reverse mode) when the transform is first
    called with those shapes, inside or outside `jax.jit`; the choice is cached, so
    later calls compile nothing more for it. One element per chunk is not assumed
    to need the least: where neither it nor the other ends of the ranges searched
    fit, a few sizes between are measured before the budget is refused.

    **Arguments:**

    - `size`: the budget, as one of
        - an integer number of bytes, such as `2**30`;
        - a string with a unit, such as `"4GiB"`, `"512MiB"` or `"1.5GB"` (KB, MB,
          GB, TB are powers of 1000; KiB, MiB, GiB, TiB powers of 1024);
        - a float in `(0, 1]`: that fraction of the memory the default device has
          free when the call is traced (on an accelerator `bytes_limit -
          bytes_in_use` from `jax.Device.memory_stats()`; on CPU the least of the
          system's available memory and what the process's memory cgroups have
          left, so that a container's limit counts).

    - `tune`: keyword-only. How to choose among the sizes that fit:
        - `None` (the default): on CPU, by timing them where that is cheap: from
          the speed model's size (see `ChunkSizeChoice`'s `model`), a descent
          along that size and the powers of two within three doublings of it
          (a matrix product over the chunk runs fastest at one), each
          measured to fit, compiled, and run on random inputs of the call's
          shapes (its own concrete arrays where it has them): the larger
          neighbour of the fastest so far first, then the smaller, until both
          neighbours of the fastest are timed; the fastest run wins. The timing
          adds at most about four seconds, or half as long as the search itself
          took if that is longer (the search compiles the call at a few sizes),
          beyond timing the model's size, which tells how long a run takes: each
          size is timed (the fastest of up to three runs) only while its
          compilation and two runs fit the time left.
          Where not even two sizes fit, or where a copy of the call's arguments
          beside the budget would take more than half the free memory, the speed
          model chooses. On GPU/TPU the largest size that fits.
        - `True`: always by timing, on any device, without that bound (up to
          five interleaved rounds, stopping after about four seconds).
        - `False`: by the speed model alone, never timed: the same choice in
          every process, at no cost beyond the search.

        Under `jax.distributed` (more than one process) sizes are never timed:
        the speed model chooses (and `tune=True` is an error).

    **Stored choices.** Every choice is stored on disk and reused by later
    processes on the same machine for the same program, budget and versions:
    a later process traces the program the choice runs and takes the choice
    where that program is the one stored, compiling nothing (where it is traced
    otherwise, as after a change to a custom derivative's backward pass, it
    compiles it once, and searches again where it no longer needs the bytes
    stored), so a training script pays the search once, not at every start,
    and its timed choice does not vary between runs. A timed choice serves
    `tune=None` and `tune=True`; an untimed one (the model's, where the bound left
    no time to time two sizes) is timed anew by `tune=True`. The folder is
    `FILTERED_CHUNK_CACHE_DIR` if set (set it to an empty string to store
    nothing), else `filtered_chunk` in `XDG_CACHE_HOME` (`~/.cache`); delete it
    to search anew. A float budget is stored for the bytes it resolves to
    (rounded down to 1/32 of a power of two), so the entry holds while the free
    memory moves a little.

    **Several processes.** Under `jax.distributed` every process runs the same
    choice: the budget is the smallest that any process
    resolves (for a float, the least free memory), process 0 chooses (from its
    own store, or by a search), and the others take its choice. Every process
    must make the same budgeted calls in the same order, as an SPMD program
    does; a process that waits more than ten minutes for the others raises a
    `RuntimeError`.

    `chunk_size="auto"` is `MemoryBudget(0.8)`, leaving room for what XLA's estimate
    does not count (the allocator's fragmentation, other live arrays).

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
    tune: bool | None = eqx.field(static=True)

    def __init__(self, size: Any, *, tune: bool | None = None):  # checked by value
        if tune is not None and not isinstance(tune, bool | np.bool_):
            raise TypeError(
                f"`MemoryBudget(..., tune=...)` must be `None`, `True` or `False`, "
                f"got {type(tune).__name__} object {tune!r}."
            )
        self.tune = None if tune is None else bool(tune)
        if isinstance(size, str):
            self.bytes, self.fraction = _parse_bytes(size), None
        elif isinstance(size, bool) or not isinstance(size, _NUMBERS):
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
            # A number without a unit below one byte (`'0.5'`) meant a fraction.
            unitless = isinstance(size, str) and not any(map(str.isalpha, size))
            fraction = float(size) if unitless else 0
            hint = " For a fraction of the free memory write `MemoryBudget({!r})`."
            raise ValueError(
                f"`MemoryBudget(size)` must be at least one byte, got {size!r}."
                f"{hint.format(fraction) if fraction else ''}"
            )

    def __repr__(self) -> str:
        size = self.fraction if self.bytes is None else self.bytes
        tune = "" if self.tune is None else f", tune={self.tune}"
        return f"MemoryBudget({size}{tune})"

    def resolve(self) -> int:
        """The budget in bytes (for a fraction, of the memory free now)."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        # Round down to 1/32 of a power of two: the free memory moves a little
        # between calls, and the budget should keep its cache entry.
        free = self.fraction * available_bytes()
        step = 2 ** max(math.floor(math.log2(max(free, 1))) - 5, 0)
        return max(int(free // step * step), 1)


# What `chunk_size` accepts; builders check it by value (`normalise_chunk_size`).
ChunkSizeSpec: TypeAlias = int | SupportsIndex | Literal["auto"] | MemoryBudget | None


def _string_hint(text: str) -> str:
    """The `chunk_size` a string likely meant, where that works: `'auto'` in any case,
    an integer for digits (`'3'` as a budget is 3 bytes), a budget for a unit."""
    if text.strip().lower() == "auto":
        return " Write `chunk_size='auto'` (lower case)."
    if text.strip().isdecimal() and int(text) > 0:
        return f" For chunks of {int(text)} elements write `chunk_size={int(text)}`."
    match = _SIZE.match(text)
    if match and match[2] and match[2].lower() in _UNITS and _parse_bytes(text):
        return f" For a memory budget write `chunk_size=fc.MemoryBudget({text!r})`."
    return ""


def normalise_chunk_size(chunk_size: Any, api: str) -> "int | MemoryBudget | None":
    """`chunk_size` as the transforms hold it, or the error for a bad one."""
    if chunk_size is None or isinstance(chunk_size, MemoryBudget):
        return chunk_size
    expected = (
        f"`{api}(..., chunk_size=...)` must be a positive integer, `None`, `'auto'` "
        "or a `filtered_chunk.MemoryBudget`, got"
    )
    if isinstance(chunk_size, str):
        if chunk_size == "auto":
            return MemoryBudget(AUTO_FRACTION)
        raise ValueError(f"{expected} {chunk_size!r}.{_string_hint(chunk_size)}")
    is_bool = isinstance(chunk_size, bool | np.bool_)
    if not is_bool and getattr(type(chunk_size), "__index__", None) is None:
        kind = type(chunk_size).__name__
        raise TypeError(f"{expected} {kind} object {chunk_size!r}.")
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

    - `chunk_size`: the chosen chunk size, measured to fit and the speed model's
        choice among those that fit (`model`). The batch size (or the number of
        Jacobian rows/columns) evaluates the whole batch in one `vmap`.
    - `bytes`: XLA's temporary plus output bytes of the program at that size.
    - `budget`: the budget in bytes.
    - `tried`: `(chunk_size, bytes)` for every size compiled by the search, by size.
        A size's bytes are counted only as far as its comparison with the budget
        needed: in full (as `bytes`) for the sizes chosen, timed or reported as
        `largest`; for the others, a lower bound, enough to show they do not
        fit where they do not (XLA's count of the program that runs, without
        the buffers of CPU fusions it leaves out or, under reverse mode, the
        linearisation).
    - `largest`: the largest size measured to fit (whose next size up does not).
    - `model`: how `chunk_size` was chosen among the sizes that fit:
        - `"timed"`: the fastest of the sizes in `times` (`MemoryBudget(...,
          tune=None)` on CPU, or `tune=True`);
        - `"cache"`: the speed model, on CPU: the chunk size is capped to keep
          `chunk_size * element_bytes` within `cache_bytes`, at least one
          element, and runs if it fits as measured (else `largest`). With
          `tune=None`, where timing would cost more than its bound;
        - `"largest"`: by default on GPU/TPU.
    - `element_bytes`: the model's working set per element: the slope of the bytes
        over the sizes tried that run two or more steps, else the whole batch's
        bytes over its size.
    - `cache_bytes`: the working set the model sizes a chunk to (`None` for
        `"largest"`): a quarter of the level-3 cache the system reports, within
        two and eight times one core's level-2 cache. On a machine with 1 MiB of
        level-2 and 32 MiB of level-3 cache that is 8 MiB, where the workloads of
        `benchmarks/budget.py` ran fastest or within their timing noise of it.
    - `working_set`: `(chunk_size, chunk_size * element_bytes)`, the model's figure
        for every size tried.
    - `times`: for `"timed"`, `(chunk_size, seconds)` for every size timed (its
        fastest run), by size; the fastest is `chunk_size`. Empty otherwise.
    - `stored`: whether the choice was read from disk, made by an earlier
        process for the same program, budget and machine (see `MemoryBudget`),
        rather than searched in this one. A stored choice is used only where its
        program is still the one stored, or compiled again needs the bytes
        stored.
    - `keep_boundaries`: what the call runs with as `keep_boundaries`: with
        collectives across chunks, `True` where every pass over the batch keeps
        the per-element values the next resumes from, in buffers that `bytes`
        counts, an int `n` where every `n`-th pass does, `False` where none
        does. Unless `filter_chunked_vmap(..., keep_boundaries=...)` says, the
        most that fit the budget are kept: every pass's, else every `n`-th
        pass's for an `n` estimated from their bytes or the next `n` that keeps
        fewer, else only the middle pass's, at the size chosen without them or at
        a smaller size (at least 8) where their bytes fit beside the rest (at
        most eight compilations more, none for boundaries whose own bytes could
        not fit at any size).
    - `passes`: with collectives across chunks, the passes over the batch before
        the final loop (the call runs `passes + 1` loops); `0` otherwise.
    - `boundary_bytes`: the bytes of the values that those passes keep (see
        `keep_boundaries`), for the whole batch: under reverse mode all of them
        are residuals; evaluated, two or three passes' are alive at once.
        `bytes` includes what of them the program holds.
    - `work`: the estimated work of the call's loops against evaluating `fun`
        once for each element, from the equations of `fun` (matrix products and
        convolutions by their floating-point operations, other operations by
        the elements they produce), not measured: about `1.0` with every pass's
        boundaries kept, more the more each pass recomputes (a BatchNorm network
        of eight layers: about 5 recomputing). `1.0` without collectives across
        chunks.
    - `compilations`, `seconds`: what the choice cost the process that made it:
        the programs XLA compiled for it (under reverse mode two for a size
        that fits: its pullback and its linearisation) and the
        seconds from the start of the search (tracing, compiling, timing) to the
        choice. For a stored choice, the check of its program (no compilation
        where it is traced as stored).

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
        print(choice.chunk_size, choice.largest, choice.model, choice.working_set)
        assert (choice.chunk_size, choice.bytes) in choice.tried
        assert choice.chunk_size <= choice.largest
        ```
    """

    chunk_size: int
    bytes: int
    budget: int
    tried: tuple[tuple[int, int], ...]
    largest: int
    model: Literal["cache", "largest", "timed"]
    element_bytes: int
    cache_bytes: int | None
    working_set: tuple[tuple[int, int], ...]
    times: tuple[tuple[int, float], ...] = ()
    stored: bool = False
    keep_boundaries: bool | int = False
    passes: int = 0
    boundary_bytes: int = 0
    work: float = 1.0
    compilations: int = 0
    seconds: float = 0.0
