"""How much memory a device has free, for `"auto"` and fractional budgets.

On an accelerator JAX reports it (`memory_stats()`). On CPU the system's
`MemAvailable` (`/proc/meminfo`) is the host's, even inside a container (Docker,
Kubernetes, Slurm with cgroups), whose own limit is usually far smaller and
whose processes are killed when they pass it. So the container's memory cgroup
counts too: its limit minus its use, for the process's own group (from
`/proc/self/cgroup`, located through the cgroup mounts of `/proc/self/mountinfo`)
and every group above it, in cgroup v2 (`memory.max`, `memory.current`) and v1
(`memory.limit_in_bytes`, `memory.usage_in_bytes`). The page cache that the
kernel would reclaim first (`inactive_file`) is not counted as used, as
container runtimes do not. The free memory is the smallest of these figures.
"""

import os
from typing import Any

import jax


# cgroup v1 writes "no limit" as the largest multiple of the page size.
_NO_LIMIT = 2**62


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _meminfo(root: str) -> int | None:
    text = _read(os.path.join(root, "proc/meminfo")) or ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _mounts(root: str) -> dict[str, tuple[str, str]]:
    """The memory cgroup mounts, `{"v2" or "v1": (root in the hierarchy, mount
    point)}`, from `/proc/self/mountinfo` (see `man 5 proc`)."""
    found: dict[str, tuple[str, str]] = {}
    text = _read(os.path.join(root, "proc/self/mountinfo")) or ""
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4 or sep < 5:
            continue
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2":
            found.setdefault("v2", (fields[3], fields[4]))
        elif fstype == "cgroup" and "memory" in options:
            found.setdefault("v1", (fields[3], fields[4]))
    return found


def _groups(root: str) -> dict[str, str]:
    """The process's memory cgroups, `{"v2" or "v1": path in the hierarchy}`."""
    found: dict[str, str] = {}
    text = _read(os.path.join(root, "proc/self/cgroup")) or ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            found["v2"] = parts[2]
        elif "memory" in parts[1].split(","):
            found["v1"] = parts[2]
    return found


def _number(text: str | None) -> int | None:
    text = None if text is None else text.strip()
    return int(text) if text and text.isdigit() else None


def _inactive_file(directory: str, key: str) -> int:
    text = _read(os.path.join(directory, "memory.stat")) or ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


_FILES = {
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def _cgroup_free(root: str) -> int | None:
    """The least that a memory cgroup of this process, or one above it, has left
    (`None` if no group has a limit)."""
    mounts, groups = _mounts(root), _groups(root)
    if not mounts:  # no mountinfo: the usual mount points
        mounts = {"v2": ("/", "/sys/fs/cgroup"), "v1": ("/", "/sys/fs/cgroup/memory")}
    free: list[int] = []
    for version, (mount_root, mount_point) in mounts.items():
        group = groups.get(version)
        if group is None:
            continue
        relative = os.path.relpath(group, mount_root)
        # A group outside the mount (a container seeing the host's path): the
        # mount is then the container's own group.
        parts = [] if relative.startswith("..") else relative.split(os.sep)
        parts = [p for p in parts if p not in ("", ".")]
        limit_file, usage_file, inactive = _FILES[version]
        for depth in range(len(parts), -1, -1):
            directory = os.path.join(root, mount_point.lstrip("/"), *parts[:depth])
            limit = _number(_read(os.path.join(directory, limit_file)))
            usage = _number(_read(os.path.join(directory, usage_file)))
            if limit is None or usage is None or limit >= _NO_LIMIT:
                continue  # "max", missing, or v1's "no limit"
            used = max(usage - _inactive_file(directory, inactive), 0)
            free.append(max(limit - used, 0))
    return min(free) if free else None


def system_available_bytes(root: str = "/") -> int:
    """The memory the system has available to this process: the smallest of
    `MemAvailable` and what its memory cgroups have left. `root` is where the
    `/proc` and `/sys` trees are read from (tests give a directory of fakes)."""
    figures = [x for x in (_meminfo(root), _cgroup_free(root)) if x is not None]
    if figures:
        return min(figures)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_bytes(device: Any = None) -> int:
    """The memory `device` (the default device) has free: `bytes_limit -
    bytes_in_use` where JAX reports them (accelerators), else what the system
    has available to this process (`system_available_bytes`)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return system_available_bytes()
