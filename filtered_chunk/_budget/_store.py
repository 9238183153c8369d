"""The timed choices of memory budgets, kept on disk so that a later process on the
same machine reuses them, as JAX's compilation cache reuses compiled programs: a
choice timed once is then the same in every process (`_search.py`), and costs no
timing again. Only the timed size is kept, never the bytes: the search measures
those anew each time, so a stale or mistaken entry can cost speed, never memory.

The folder is `FILTERED_CHUNK_CACHE_DIR` if set (an empty value turns the store
off), else `filtered_chunk` in `XDG_CACHE_HOME` (`~/.cache` by default). One small
JSON file an entry, named by a hash of the program, the budget and the machine.
Failures to read or write are ignored: the search then times as without a store.
"""

import functools as ft
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from . import _model


ENVIRONMENT = "FILTERED_CHUNK_CACHE_DIR"
_FORMAT = 1


def directory() -> Path | None:
    """The store's folder (`None`: turned off)."""
    chosen = os.environ.get(ENVIRONMENT)
    if chosen is not None:
        return Path(chosen).expanduser() if chosen.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "filtered_chunk"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@ft.cache
def machine() -> tuple[str, ...]:
    """What the speed of a program depends on beyond the program: the processor,
    the cores this process may use, the devices, and the versions that compile."""
    import filtered_chunk

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    devices = jax.devices()
    return (
        _cpu_name(),
        str(cores or os.cpu_count()),
        str(_model.cache_bytes()),
        f"{devices[0].platform}:{devices[0].device_kind}x{len(devices)}",
        jax.__version__,
        getattr(jax.lib, "__version__", ""),
        filtered_chunk.__version__,
    )


def key(parts: Sequence[Any]) -> str | None:
    """The entry's name for `parts` (their `repr`s and the machine's), or `None` when
    a `repr` holds an object's address, which no later process shares."""
    text = repr((_FORMAT, *parts, machine()))
    if " at 0x" in text:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def read(name: str | None) -> tuple[int, tuple[tuple[int, float], ...]] | None:
    """The chunk size stored under `name` and the times it was chosen from."""
    folder = directory()
    if name is None or folder is None:
        return None
    try:
        entry = json.loads((folder / f"{name}.json").read_text())
        times = tuple((int(k), float(t)) for k, t in entry["times"])
        return int(entry["chunk_size"]), times
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(name: str | None, chunk_size: int, times: dict[int, float]) -> None:
    """Stores a timed choice under `name` (atomically: a reader never sees half)."""
    folder = directory()
    if name is None or folder is None:
        return
    entry = {"chunk_size": chunk_size, "times": sorted(times.items())}
    temporary = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=folder, suffix=".tmp", delete=False
        ) as f:
            temporary = Path(f.name)
            json.dump(entry, f)
        os.replace(temporary, folder / f"{name}.json")
    except OSError:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
