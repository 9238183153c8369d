"""The choices of memory budgets, kept on disk so that a later process on the same
machine reuses them, as JAX's compilation cache reuses compiled programs: a budget
searched (and timed) once is then the same in every process (`_choose.py`). Each
entry holds the bytes of the program the choice runs, as compiled, and a hash of
that program as lowered. A later process lowers the program it runs and takes the
choice where the hash is the same (XLA compiles the same text on the same machine,
versions and flags, which the entry's name holds, to the same bytes); where it
differs (another build of this library with the same version, a custom
derivative's backward pass changed, which the traced program that names the entry
does not show), it compiles the program and takes the choice where the bytes are
those stored. A stale or mistaken entry can cost a search, never memory.

The folder is `FILTERED_CHUNK_CACHE_DIR` if set (an empty value turns the store
off), else `filtered_chunk` in `XDG_CACHE_HOME` (`~/.cache` by default). One small
JSON file an entry, named by a hash of the program, the budget and the machine.
Failures to read or write are ignored: the search then runs as without a store.
"""

import dataclasses
import functools as ft
import hashlib
import json
import os
import platform
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax

from . import _model
from ._values import ChunkSizeChoice


ENVIRONMENT = "FILTERED_CHUNK_CACHE_DIR"
_FORMAT = 3  # entries of format 1 held only a timed size; of 2, no hash


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
        os.environ.get("XLA_FLAGS", ""),
    )


def key(parts: Sequence[Any]) -> str | None:
    """The entry's name for `parts` (their `repr`s and the machine's), or `None` when
    a `repr` holds an object's address, which no later process shares (a jaxpr's
    text masks those of its callbacks, `0xXXXXXXXXXXXX`: a program that calls
    back to Python is stored, checked by its lowered text, which numbers its
    callbacks)."""
    text = repr((_FORMAT, *parts, machine()))
    if re.search(r"\bat 0x[0-9a-fA-F]+\b", text):
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def encode(choice: ChunkSizeChoice) -> dict[str, Any]:
    """`choice` as a JSON object (`decode` reads it back)."""
    return {f.name: getattr(choice, f.name) for f in dataclasses.fields(choice)}


def _pairs(value: Any, kind: Callable[[Any], Any]) -> tuple[tuple[int, Any], ...]:
    return tuple((_integer(k), kind(v)) for k, v in value)


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(value)
    return value


def decode(entry: Any) -> ChunkSizeChoice:
    """The choice `encode` wrote, from its JSON object; `ValueError` where `entry`
    is not one."""
    try:
        keep = entry["keep_boundaries"]
        choice = ChunkSizeChoice(
            chunk_size=_integer(entry["chunk_size"]),
            bytes=_integer(entry["bytes"]),
            budget=_integer(entry["budget"]),
            tried=_pairs(entry["tried"], _integer),
            largest=_integer(entry["largest"]),
            model=entry["model"],
            element_bytes=_integer(entry["element_bytes"]),
            cache_bytes=None
            if entry["cache_bytes"] is None
            else _integer(entry["cache_bytes"]),
            working_set=_pairs(entry["working_set"], _integer),
            times=_pairs(entry["times"], float),
            stored=bool(entry["stored"]),
            keep_boundaries=keep if isinstance(keep, bool) else _integer(keep),
            passes=_integer(entry["passes"]),
            boundary_bytes=_integer(entry["boundary_bytes"]),
            work=float(entry["work"]),
            compilations=_integer(entry["compilations"]),
            seconds=float(entry["seconds"]),
        )
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a stored choice: {e}") from None
    keep = choice.keep_boundaries
    counts = (choice.bytes, choice.budget, choice.passes, choice.compilations)
    if (
        choice.model not in ("cache", "largest", "timed")
        or choice.chunk_size < 1
        or min(counts) < 0
        or (not isinstance(keep, bool) and keep < 2)
    ):
        raise ValueError(f"not a stored choice: {choice}")
    return choice


class Program(NamedTuple):
    """What a stored choice's program was: its bytes as compiled (`Lowered.compiled`),
    and the hash of its text as lowered (`Lowered.fingerprint`)."""

    bytes: int
    fingerprint: str


def read(name: str | None) -> tuple[ChunkSizeChoice, Program] | None:
    """The choice stored under `name` and its program, if any (`None` also where
    the entry is unreadable)."""
    folder = directory()
    if name is None or folder is None:
        return None
    try:
        entry = json.loads((folder / f"{name}.json").read_text())
        fingerprint = entry["fingerprint"]
        if not isinstance(fingerprint, str):
            raise ValueError(fingerprint)
        return decode(entry["choice"]), Program(_integer(entry["bytes"]), fingerprint)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(name: str | None, choice: ChunkSizeChoice, program: Program) -> None:
    """Stores `choice` and its program under `name` (atomically: a reader never
    sees half)."""
    folder = directory()
    if name is None or folder is None:
        return
    entry = {"choice": encode(choice), **program._asdict()}
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
