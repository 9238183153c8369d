"""A progress meter that records what it is told, for the progress tests."""

import collections
import itertools
import time
from typing import Any

import filtered_chunk as fc


_LOGS: dict[str, list[tuple[Any, ...]]] = collections.defaultdict(list)
_names = itertools.count()


class Recorder(fc.AbstractProgressMeter):
    """Appends `("open", label, total)`, `("update", done, time)` and `("close",)`
    to the log named `name` (a hashable field, as meters should have)."""

    name: str
    label: str | None = None

    def open(self, label: str, total: int) -> int:
        _LOGS[self.name].append(("open", label, total))
        return total

    def update(self, state: int, done: int) -> None:
        assert 0 < done <= state
        _LOGS[self.name].append(("update", done, time.perf_counter()))

    def close(self, state: int) -> None:
        del state
        _LOGS[self.name].append(("close",))

    @property
    def events(self) -> list[tuple[Any, ...]]:
        return _LOGS[self.name]

    def counts(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "update"]


def recorder(label: str | None = None) -> Recorder:
    return Recorder(f"meter{next(_names)}", label)


def check_one_call(meter: Recorder, label: str, total: int, calls: int = 1) -> None:
    """`calls` calls, each opened once, updated with increasing counts up to
    `total` (never past it), and closed once."""
    events = meter.events
    opens = [i for i, e in enumerate(events) if e[0] == "open"]
    assert len(opens) == calls and opens[0] == 0, events
    for start, end in zip(opens, [*opens[1:], len(events)]):
        one = events[start:end]
        assert one[0] == ("open", label, total), events
        assert one[-1] == ("close",), events
        counts = [e[1] for e in one[1:-1]]
        assert all(e[0] == "update" for e in one[1:-1]), events
        assert counts and counts[-1] == total, events
        assert all(a < b for a, b in zip(counts, counts[1:])), events
