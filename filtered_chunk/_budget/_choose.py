"""A memory budget's choice for one call: the same in every process
(`_hosts.py`), cached in memory, else read from disk where its program is still
the one stored (`_store.py`), else searched (`_search.py`) and refined (the
boundaries a staged call keeps: `_keep.py`), then stored.
"""

import dataclasses
import time
from collections.abc import Callable, Hashable
from typing import Any

from jaxtyping import PyTree

from . import _hosts, _model, _store, _timing
from ._counts import remember
from ._program import ChunkedProgram, compilations, Lowered
from ._search import search
from ._values import ChunkSizeChoice, MemoryBudget


_chosen: dict[Hashable, ChunkSizeChoice] = {}


@dataclasses.dataclass(frozen=True)
class Budgeted:
    """A budgeted call: `run(chunk_size, tree)` (`None`: the whole batch of
    `batch_size`) for `budget`; `options`, what else changes the program;
    `refine`, what `_search.search`'s choice becomes (staged collectives keeping
    boundaries: `_keep.refined`); `program`, the program a choice runs, lowered
    (`_counts.program_at`)."""

    run: Callable[[int | None, Any], Any]
    tree: PyTree[Any]
    batch_size: int
    budget: MemoryBudget
    remainder: str
    options: Hashable
    api: str
    refine: Callable[[ChunkSizeChoice], ChunkSizeChoice]
    program: Callable[[ChunkSizeChoice], Lowered]


def choose_chunk_size(call: Budgeted) -> ChunkSizeChoice:
    """The chunk size for `call`, as `_search.search` chooses it, then refined.
    Cached on the unchunked program, traced once; stored on disk with the
    program it runs, and taken by a later process where that is still its
    program (`_store.py`); the same in every process (`_hosts.py`)."""
    budget = call.budget
    if budget.tune and _hosts.several():
        raise ValueError(
            f"`{call.api}(..., chunk_size={budget!r})`: `tune=True` times chunk "
            "sizes by running them, which under `jax.distributed` every process "
            "would have to do alike. With several processes the speed model "
            "chooses: give `tune=None` or `False`, or a fixed `chunk_size`."
        )
    program = ChunkedProgram(call.run, call.tree)
    shapes = [(s.shape, str(s.dtype)) for s in program.structs]
    what = repr((call.api, call.batch_size, call.remainder, budget, shapes))
    return _hosts.choose_everywhere(
        budget.resolve(), what, lambda limit: _choose(call, program, limit)
    )


def _choose(call: Budgeted, program: ChunkedProgram, limit: int) -> ChunkSizeChoice:
    """`choose_chunk_size` for `limit` bytes, in this process."""
    batch_size, budget, options = call.batch_size, call.budget, call.options
    start, compiled = time.perf_counter(), compilations()
    timing = None if _hosts.several() else _timing.mode(budget.tune, _model.backend())
    base, layers = program.key()
    reverse = any(layer.kind == "reverse" for layer in layers)
    # What a stored choice is keyed by: no callable's identity, which no later
    # process shares (its program is checked when it is read).
    stored_as = None if base is None else (base[0], *base[2:])
    stored_as = (stored_as, batch_size, call.remainder, options, limit, bool(timing))
    machine = (_model.backend(), _model.cache_bytes())  # the model reads
    base = None if base is None else (base, batch_size, call.remainder, options)
    choice_key = None if base is None else (base, limit, budget.tune, machine)
    if choice_key in _chosen:
        return _chosen[choice_key]
    name = None if base is None else _store.key(stored_as)
    cost = lambda: dict(  # noqa: E731
        compilations=compilations() - compiled, seconds=time.perf_counter() - start
    )
    found = _store.read(name)
    # `tune=True` times an untimed choice (the bound left no time) anew.
    if found is not None:
        chosen, stored = found
        if (
            chosen.budget == limit
            and (timing != "always" or chosen.times)
            and _still(call.program, chosen, stored, name)
        ):
            chosen = dataclasses.replace(chosen, stored=True, **cost())
            remember(_chosen, choice_key, chosen)
            return chosen
    searched, lowered, storable = search(
        program,
        base,
        batch_size=batch_size,
        limit=limit,
        remainder=call.remainder,
        timing=timing,
        reverse=reverse,
        api=call.api,
        budget=budget,
    )
    chosen = call.refine(searched)
    if (chosen.chunk_size, chosen.bytes) != (searched.chunk_size, searched.bytes):
        lowered = call.program(chosen)  # another program, which `refine` measured
    storing = storable and name is not None and _store.directory() is not None
    entry = _entry(lowered) if storing else None  # counted in the cost
    chosen = dataclasses.replace(chosen, **cost())
    if entry is not None:
        _store.write(name, chosen, entry)
    remember(_chosen, choice_key, chosen)
    return chosen


def _entry(lowered: Lowered) -> _store.Program:
    """What the store holds of `lowered`: its bytes (one compilation) and its hash."""
    return _store.Program(lowered.compiled()[0].total, lowered.fingerprint())


def _still(
    program: Callable[[ChunkSizeChoice], Lowered],
    chosen: ChunkSizeChoice,
    stored: _store.Program,
    name: str | None,
) -> bool:
    """Whether a stored choice's program is still the one stored: lowered the
    same (`_store.py`: no compilation), or else compiled to the bytes stored
    (then stored with its new hash). Not where an entry edited by hand names a
    program that cannot be made (a search then raises whatever the call itself
    raises)."""
    try:
        lowered = program(chosen)
        if lowered.fingerprint() == stored.fingerprint:
            return True
        now = _entry(lowered)  # the hash, computed once, is the new one
    except Exception:
        return False
    if now.bytes != stored.bytes:
        return False
    _store.write(name, chosen, now)
    return True
