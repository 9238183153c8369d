"""How much memory a device has free, for `"auto"` and fractional budgets: what JAX
reports on an accelerator (`memory_stats()`). On CPU `MemAvailable` is the host's
even inside a container (Docker, Kubernetes, Slurm), whose own limit is usually far
smaller and kills its processes past it; so the memory cgroups (v2 and v1, the
process's and every one above it) count too: limit minus use, not counting the page
cache the kernel reclaims first (`inactive_file`), as container runtimes do not.
"""

import os
from typing import Any

import jax


# cgroup v1 writes "no limit" as the largest multiple of the page size.
_NO_LIMIT = 2**62


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _field(path: str, name: str) -> int | None:
    """The number after `name` on a line of `path` (`meminfo`, `memory.stat`)."""
    for line in _read(path).splitlines():
        fields = line.split()
        if len(fields) > 1 and fields[0] == name and fields[1].isdigit():
            return int(fields[1])
    return None


def _mounts(root: str) -> dict[str, tuple[str, str]]:
    """The memory cgroup mounts, `{"v2" or "v1": (root in hierarchy, mount point)}`."""
    found: dict[str, tuple[str, str]] = {}
    for line in _read(os.path.join(root, "proc/self/mountinfo")).splitlines():
        fields = line.split()
        sep = fields.index("-") if "-" in fields else 0
        if sep < 5 or len(fields) < sep + 4:
            continue
        version = {"cgroup2": "v2", "cgroup": "v1"}.get(fields[sep + 1])
        options = fields[sep + 3].split(",")
        if version == "v2" or (version == "v1" and "memory" in options):
            found.setdefault(version, (fields[3], fields[4]))
    return found


def _groups(root: str) -> dict[str, str]:
    """The process's memory cgroups, `{"v2" or "v1": path in the hierarchy}`."""
    found: dict[str, str] = {}
    for line in _read(os.path.join(root, "proc/self/cgroup")).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            found["v2"] = parts[2]
        elif "memory" in parts[1].split(","):
            found["v1"] = parts[2]
    return found


def _number(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


_FILES = {
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def _cgroup_free(root: str) -> int | None:
    """The least that a memory cgroup of this process, or one above it, has left."""
    mounts, groups = _mounts(root), _groups(root)
    if not mounts:  # no mountinfo: the usual mount points
        mounts = {"v2": ("/", "/sys/fs/cgroup"), "v1": ("/", "/sys/fs/cgroup/memory")}
    free: list[int] = []
    for version, (mount_root, mount_point) in mounts.items():
        if version not in groups:
            continue
        relative = os.path.relpath(groups[version], mount_root)
        # A group outside the mount (a container seeing the host's path) is the mount.
        parts = [] if relative.startswith("..") else relative.split(os.sep)
        parts = [p for p in parts if p not in ("", ".")]
        limit_file, usage_file, inactive = _FILES[version]
        for depth in range(len(parts), -1, -1):
            directory = os.path.join(root, mount_point.lstrip("/"), *parts[:depth])
            limit = _number(_read(os.path.join(directory, limit_file)))
            usage = _number(_read(os.path.join(directory, usage_file)))
            if limit is None or usage is None or limit >= _NO_LIMIT:
                continue  # "max", missing, or v1's "no limit"
            inactive_bytes = _field(os.path.join(directory, "memory.stat"), inactive)
            used = max(usage - (inactive_bytes or 0), 0)
            free.append(max(limit - used, 0))
    return min(free) if free else None


def system_available_bytes(root: str = "/") -> int:
    """The least of `MemAvailable` and what this process's memory cgroups have left,
    reading `/proc` and `/sys` under `root` (tests give a directory of fakes)."""
    meminfo = _field(os.path.join(root, "proc/meminfo"), "MemAvailable:")
    meminfo = None if meminfo is None else meminfo * 1024  # kB
    figures = [x for x in (meminfo, _cgroup_free(root)) if x is not None]
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(figures, default=pages)


def available_bytes(device: Any = None) -> int:
    """The memory `device` (the default device) has free: `bytes_limit - bytes_in_use`
    where JAX reports them (accelerators), else `system_available_bytes()`."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return system_available_bytes()
