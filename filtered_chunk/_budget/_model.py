"""The speed model: which of the chunk sizes that fit a budget to run. On CPU a
chunk whose working set stays in the core's cache runs faster than the whole batch
in one `vmap` (`benchmarks/budget.py`): the chunk size is capped to keep
`element_bytes * chunk_size` within `CACHE_FACTOR` level-2 caches, at least
`MIN_CHUNK`, unless one element overflows it (nothing stays in cache; larger chunks
run fewer operations). Elsewhere the largest size that fits runs (unmeasured: no
accelerator was at hand).
"""

import functools as ft
import os
from pathlib import Path

import jax


CACHE_FACTOR = 2
# Never fewer elements per chunk than this (unless the budget forces it): below,
# the loop's per-step overhead outweighs what the cache saves.
MIN_CHUNK = 8
DEFAULT_CACHE_BYTES = 2**20
_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def _parse_size(text: str) -> int | None:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    return int(digits) * scale if digits.isdecimal() else None


@ft.cache
def cache_bytes() -> int:
    """One core's level-2 cache: from sysfs, else `os.sysconf`, else the default."""
    for index in sorted(_CACHE_DIR.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
        except OSError:
            continue
        if level == "2" and kind in ("Unified", "Data") and size:
            return size
    try:
        size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        size = 0
    return size if size > 0 else DEFAULT_CACHE_BYTES


def backend() -> str:
    """The platform the call runs on (`"cpu"`, `"gpu"`, `"tpu"`)."""
    return jax.default_backend()


def cache_cap(element_bytes: int) -> int | None:
    """The largest chunk size to run (`None`: the largest that fits)."""
    if backend() != "cpu":
        return None
    target = CACHE_FACTOR * cache_bytes()
    if element_bytes <= 0 or element_bytes > target:
        return None
    return max(target // element_bytes, MIN_CHUNK)
