"""The bytes of a chunked call's programs (`_program.py`) at each chunk size,
counted only as far as a comparison with a budget needs (`Counts.measure`): first
the program that runs as XLA counts it, a lower bound; where that fits, with
every buffer counted (on CPU, where XLA's YNNPACK fusions keep buffers its count
leaves out, compiled once more with them off), then under reverse mode the
linearisation too. Cached in memory on the traced program, for every search of
this process.
"""

import time
from collections.abc import Callable, Hashable
from typing import Any

from jaxtyping import PyTree

from ._program import ChunkedProgram, linearisation, Lowered, Measured


_MAX_ENTRIES = 256
measured: dict[Hashable, Measured | None] = {}  # `None`: no linearisation


def remember(cache: dict[Hashable, Any], key: Hashable | None, value: Any) -> None:
    if key is not None:
        cache[key] = value
    while len(cache) > _MAX_ENTRIES:
        del cache[next(iter(cache))]


class Counts:
    """The bytes of `program`'s sizes (`None`: the whole batch), counted as far as a
    comparison with a limit needs (`measure`), cached in memory under `base`, with
    the programs lowered here kept to compile and run (`lowered`) and the
    seconds spent."""

    def __init__(self, program: ChunkedProgram, base: Hashable | None, reverse: bool):
        self.program, self.base, self.reverse = program, base, reverse
        self.lowered: dict[int | None, Lowered] = {}
        self.seconds = 0.0

    def lowered_at(self, k: int | None) -> Lowered:
        """The program at `k` that runs (under reverse mode, the pullback)."""
        if k not in self.lowered:
            self.lowered[k] = self.program.lower(k)
        return self.lowered[k]

    def run(self, k: int | None) -> Callable[[], Any]:
        """The program at `k` compiled as it runs, to time."""
        begin = time.perf_counter()
        run = self.lowered_at(k).compiled()[1]
        self.seconds += time.perf_counter() - begin
        return run

    def count(self, k: int | None, what: str) -> Measured | None:
        """The bytes at `k` of the program that runs, `"first"` as XLA counts it
        (a lower bound, one compilation, needed to run it anyway) or `"full"`
        (`Lowered.full`); or of the call as a `"linearisation"` (`None`: it has
        none)."""
        key = None if self.base is None else (self.base, k, what)
        if key in measured:
            return measured[key]
        begin = time.perf_counter()
        if what == "linearisation":
            found = linearisation(self.program, k)
        elif what == "full":
            found = self.lowered_at(k).full()
        else:
            found = self.lowered_at(k).compiled()[0]
        self.seconds += time.perf_counter() - begin
        remember(measured, key, found)
        return found

    def measure(
        self, k: int | None, limit: int, full: bool = False
    ) -> tuple[Measured, bool]:
        """The bytes at `k` to compare with `limit`, and whether they are complete:
        the first count, a lower bound; where that is within `limit` (or `full`)
        the program that runs counted in full, then under reverse mode the
        larger with the linearisation (both must fit), each only while the bytes
        so far fit."""
        found = self.count(k, "first")
        assert found is not None
        for what in ("full", "linearisation")[: 1 + self.reverse]:
            if found.total > limit and not full:
                return found, False
            other = self.count(k, what)
            if other is not None and other.total > found.total:
                found = other
        return found, True


def _counts_of(
    run: Callable[[int | None, Any], Any], tree: PyTree[Any], k: int | None
) -> Counts:
    """The counts of `run(k, tree)`, cached on the program traced at `k`: programs
    that trace alike compile once."""
    program = ChunkedProgram(run, tree)
    base, layers = program.key(k)
    return Counts(program, base, any(layer.kind == "reverse" for layer in layers))


def measure_bytes(
    run: Callable[[int | None, Any], Any],
    tree: PyTree[Any],
    k: int | None,
    limit: int,
) -> int:
    """The bytes a search measures for `run(k, tree)` at one size, to compare with
    `limit` (`Counts.measure`, as in `search`)."""
    return _counts_of(run, tree, k).measure(k, limit)[0].total


def program_at(
    run: Callable[[int | None, Any], Any], tree: PyTree[Any], k: int | None
) -> Lowered:
    """`run(k, tree)` lowered as the program that runs (under reverse mode, its
    pullback): the one program a stored choice is checked by."""
    return ChunkedProgram(run, tree).lower(k)
