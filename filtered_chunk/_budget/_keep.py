"""What a budget's choice becomes for a call with `axis_name` (`refined`), the
one place that decides which stage boundaries a staged call keeps: the whole
batch where it fits, else the chunk size chosen without them (`_search.py`), then
the most passes' boundaries that fit beside it, at that size or a smaller one
(`keep_if_fits`).
"""

import dataclasses
import functools as ft
import math
from collections.abc import Callable
from typing import NamedTuple

from . import _model
from ._search import Sizes
from ._values import ChunkSizeChoice


# At most this many compilations choose which stage boundaries to keep.
KEEP_COMPILATIONS = 8


class Staged(NamedTuple):
    """The transform's answers about its staged collectives: `measure(k, n,
    limit)`, the bytes of the program at `k` keeping the boundaries of every
    `n`-th pass, to compare with `limit` (`measure_bytes`); `cost(keep, k)`,
    the passes before the final loop at `k` keeping `keep` (`keep_boundaries`),
    the bytes they keep and their work against `fun` once an element (`(0, 0,
    1.0)`: not staged)."""

    measure: Callable[[int, int, int], int]
    cost: Callable[[bool | int | None, int], tuple[int, int, float]]


def refined(
    choice: ChunkSizeChoice,
    *,
    batch_size: int,
    remainder: str,
    keep: bool | int | None,
    staged: Staged | None,
) -> ChunkSizeChoice:
    """`choice` (`_search.search`'s, which keeps no boundaries) as the call runs
    it: keeping `keep`'s boundaries, or (`None`) those that fit; `staged` is
    `None` for a call without `axis_name`.

    With `axis_name`, a batch that fits whole runs whole: one `vmap`. Split,
    collectives across chunks would cost passes over the batch, which the speed
    model (a chunk's working set in cache) does not see. Else the choice reports
    its passes, the bytes it keeps and its work."""
    choice = dataclasses.replace(
        choice, keep_boundaries=False if keep is None else keep
    )
    if staged is None:
        return choice
    if choice.largest >= batch_size:
        whole = dict(choice.tried)[batch_size]
        return dataclasses.replace(choice, chunk_size=batch_size, bytes=whole)
    if keep is None:
        passes, _, _ = staged.cost(None, choice.chunk_size)
        measure = lambda k, n: staged.measure(k, n, choice.budget)  # noqa: E731
        size = choice.chunk_size
        kept = lambda n: staged.cost(True if n == 1 else n, size)[1]  # noqa: E731
        choice = keep_if_fits(choice, measure, passes, batch_size, remainder, kept)
    passes, kept_bytes, work = staged.cost(choice.keep_boundaries, choice.chunk_size)
    return dataclasses.replace(
        choice, passes=passes, boundary_bytes=kept_bytes, work=work
    )


def keep_if_fits(
    choice: ChunkSizeChoice,
    measure: Callable[[int, int], int],
    passes: int,
    batch_size: int,
    remainder: str,
    kept_bytes: Callable[[int], int],
) -> ChunkSizeChoice:
    """`choice` with the staged collectives (`passes` passes before the final
    loop) keeping the most boundaries that fit the budget (`measure(k, n)`: the
    bytes of the program at `k` keeping those of every `n`-th pass;
    `kept_bytes(n)`: the bytes of those boundaries, for the whole batch).

    Every pass's; else every `n`-th pass's, for `n` the estimate of where the
    buffers' bytes fit beside the part of `choice`'s bytes that is not per element
    (were they to fall as `1 / n`), then for the next `n` that keeps fewer; else
    only the middle pass's (`n = passes // 2 + 1`, which halves the work of
    recomputing). Of the `n` that keep as many passes' boundaries (`passes //
    n`), the smallest, whose passes recompute least: of 8 passes, every 3rd
    keeps two, as every 4th does. Each at the chosen size, or else at a smaller
    one (`_fit_beside`), at least `MIN_CHUNK`; else `choice` as it is. At most
    eight compilations; none for an `n` whose boundaries alone do not fit beside
    the part of `choice`'s bytes that is not per element, since no size would."""
    if passes == 0:
        return choice
    spent = [0]

    def _measure(size: int, every: int) -> int:
        spent[0] += 1
        return measure(size, every)

    k = choice.chunk_size
    fixed = max(choice.bytes - max(choice.element_bytes, 1) * k, 0)
    possible = lambda n: fixed + kept_bytes(n) <= choice.budget  # noqa: E731
    kept = _measure(k, 1) if possible(1) else choice.bytes + kept_bytes(1)
    extra, room = kept - choice.bytes, max(choice.budget - fixed, 1)
    estimate, middle = max(2, math.ceil(extra / room)), passes // 2 + 1
    distinct = [n for n in range(2, passes + 1) if passes // n < passes // (n - 1)]
    at = max([i for i, n in enumerate(distinct) if n <= estimate], default=0)
    tries = [1] + [n for n in distinct[at : at + 2] if n < middle] + [middle]
    for every in sorted(set(tries)):
        if spent[0] >= KEEP_COMPILATIONS:
            break
        if not possible(every):
            continue
        found = kept if every == 1 else _measure(k, every)
        fit = _fit_beside(
            choice,
            found,
            ft.partial(lambda n, size: _measure(size, n), every),
            Sizes(batch_size, remainder),
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
    sizes: Sizes,
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
