"""The speed model: which of the chunk sizes that fit a budget to run. On CPU a
chunk whose working set stays in the caches runs faster than the whole batch in one
`vmap`, and faster than chunks of one or two elements (`benchmarks/budget.py`): the
chunk size is capped to keep `element_bytes * chunk_size` within `cache_bytes()`, at
least one element. Elsewhere the largest size that fits runs (unmeasured: no
accelerator was at hand).
"""

import functools as ft
import os
from pathlib import Path

import jax


# The working set a chunk is sized to: a quarter of the level-3 cache, within two
# and eight level-2 caches of one core. Fitted on `benchmarks/budget.py`'s twelve
# workloads (1 MiB level-2, 32 MiB level-3 cache): each ran fastest, or within its
# timing noise of fastest, with a working set of 4-16 MiB, whether one element
# needed 33 KiB (chunks of 128-256) or 4 MiB (chunks of one or two). Twice the
# level-2 cache alone left the chunks 2-8 times too small.
L2_FACTORS = (2, 8)
L3_FRACTION = 4
# Never fewer elements per chunk than this where the staged engine keeps stage
# boundaries to fit a budget (`_keep.keep_if_fits`): below, the loop's per-step
# overhead outweighs the passes saved.
MIN_CHUNK = 8
DEFAULT_CACHE_BYTES = 2**20
_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def _parse_size(text: str) -> int | None:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    return int(digits) * scale if digits.isdecimal() else None


def _cache_sizes() -> dict[int, int]:
    """One core's data caches by level: from sysfs, else `os.sysconf`."""
    sizes = {}
    for index in sorted(_CACHE_DIR.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Unified", "Data") and size:
            sizes[level] = size
    for level in () if sizes else (2, 3):
        try:
            size = os.sysconf(f"SC_LEVEL{level}_CACHE_SIZE")
        except (ValueError, OSError, AttributeError):
            size = 0
        if size > 0:
            sizes[level] = size
    return sizes


@ft.cache
def cache_bytes() -> int:
    """The working set the model sizes a chunk to (`L2_FACTORS`, `L3_FRACTION`),
    from the level-2 cache (else `DEFAULT_CACHE_BYTES`) and the level-3 cache."""
    sizes = _cache_sizes()
    lo, hi = (f * sizes.get(2, DEFAULT_CACHE_BYTES) for f in L2_FACTORS)
    return min(max(sizes.get(3, 0) // L3_FRACTION, lo), hi)


def backend() -> str:
    """The platform the call runs on (`"cpu"`, `"gpu"`, `"tpu"`)."""
    return jax.default_backend()


def cache_cap(element_bytes: int) -> int | None:
    """The largest chunk size to run (`None`: the largest that fits)."""
    if backend() != "cpu" or element_bytes <= 0:
        return None
    return max(cache_bytes() // element_bytes, 1)
