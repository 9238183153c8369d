"""The free memory `"auto"` budgets on CPU: the smallest of `MemAvailable` and what
the process's memory cgroups (v1 and v2, its own group and those above it) have
left, read from a directory of fake `/proc` and `/sys` files."""

import pathlib
from typing import Any

import jax.numpy as jnp
import pytest

import filtered_chunk as fc
import filtered_chunk._budget._free_memory as free_memory
import filtered_chunk._budget._values as budget_module


GIB = 2**30
HOST = 32 * GIB  # what the host's `/proc/meminfo` reports available


def _write(root: pathlib.Path, path: str, text: str) -> None:
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


def _group(root: pathlib.Path, path: str, limit: Any, usage: Any, v1: bool = False):
    """A memory cgroup's limit and usage files (cgroup v2, or v1)."""
    names = ("limit_in_bytes", "usage_in_bytes") if v1 else ("max", "current")
    _write(root, f"{path}/memory.{names[0]}", f"{limit}\n")
    _write(root, f"{path}/memory.{names[1]}", f"{usage}\n")


def _fake_proc(root: pathlib.Path, cgroup: str, mountinfo: str) -> None:
    _write(root, "proc/meminfo", f"MemTotal: 1 kB\nMemAvailable: {HOST // 1024} kB\n")
    _write(root, "proc/self/cgroup", cgroup)
    _write(root, "proc/self/mountinfo", mountinfo)


_V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
_V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "36 31 0:33 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
)


def test_no_cgroup_limit_is_meminfo(tmp_path):
    _fake_proc(tmp_path, "0::/\n", _V2_MOUNT)
    _group(tmp_path, "sys/fs/cgroup", "max", "123")
    assert free_memory.system_available_bytes(str(tmp_path)) == HOST


def test_cgroup_v2_container_limit(tmp_path):
    # A container limited to 2 GiB on a 32 GiB host, 0.5 GiB of it in use (and
    # 0.25 GiB of page cache that the kernel reclaims first).
    _fake_proc(tmp_path, "0::/\n", _V2_MOUNT)
    _group(tmp_path, "sys/fs/cgroup", f"{2 * GIB}", f"{GIB // 2}")
    _write(tmp_path, "sys/fs/cgroup/memory.stat", f"anon 1\ninactive_file {GIB // 4}\n")
    expected = 2 * GIB - (GIB // 2 - GIB // 4)
    assert free_memory.system_available_bytes(str(tmp_path)) == expected


def test_cgroup_v2_follows_the_process_group_and_its_parents(tmp_path):
    # No cgroup namespace: the process's own group is nested; its parent holds
    # the tighter limit, the group itself has none.
    _fake_proc(tmp_path, "0::/kubepods/pod1/ctr\n", _V2_MOUNT)
    base = "sys/fs/cgroup/kubepods"
    _group(tmp_path, f"{base}/pod1/ctr", "max", f"{GIB}")
    _group(tmp_path, f"{base}/pod1", f"{3 * GIB}", f"{GIB}")
    _group(tmp_path, f"{base}", f"{16 * GIB}", f"{2 * GIB}")
    # Another group's limit, not this process's: ignored.
    _group(tmp_path, "sys/fs/cgroup/other", "1", "0")
    assert free_memory.system_available_bytes(str(tmp_path)) == 2 * GIB


def test_cgroup_v1_container_limit(tmp_path):
    # cgroup v1, the container's group bind-mounted at the mount point (its
    # path as the host names it is the mount's root), next to other controllers.
    cgroup = "9:cpu:/docker/abc\n4:memory:/docker/abc\n0::/\n"
    mounts = _V1_MOUNTS.replace(
        " / /sys/fs/cgroup/memory", " /docker/abc /sys/fs/cgroup/memory"
    )
    _fake_proc(tmp_path, cgroup, mounts)
    group = "sys/fs/cgroup/memory"
    _group(tmp_path, f"{group}", f"{2 * GIB}", f"{GIB}", v1=True)
    _write(tmp_path, f"{group}/memory.stat", "inactive_file 9\ntotal_inactive_file 0\n")
    assert free_memory.system_available_bytes(str(tmp_path)) == GIB


def test_cgroup_v1_unlimited_group_under_a_limited_parent(tmp_path):
    _fake_proc(tmp_path, "4:memory:/slurm/job7\n", _V1_MOUNTS)
    group = "sys/fs/cgroup/memory/slurm"
    _group(tmp_path, f"{group}/job7", "9223372036854771712", f"{GIB}", v1=True)
    _group(tmp_path, f"{group}", f"{4 * GIB}", f"{3 * GIB}", v1=True)
    assert free_memory.system_available_bytes(str(tmp_path)) == GIB


def test_meminfo_smaller_than_the_cgroup(tmp_path):
    _fake_proc(tmp_path, "0::/\n", _V2_MOUNT)
    _group(tmp_path, "sys/fs/cgroup", f"{64 * GIB}", "0")
    assert free_memory.system_available_bytes(str(tmp_path)) == HOST


def test_unreadable_files_fall_back(tmp_path):
    # No mountinfo: the usual mount point; garbage is ignored, never a crash.
    _write(tmp_path, "proc/meminfo", f"MemAvailable: {HOST // 1024} kB\n")
    _write(tmp_path, "proc/self/cgroup", "garbage\n0::/\n")
    _group(tmp_path, "sys/fs/cgroup", f"{GIB}", "not a number")
    assert free_memory.system_available_bytes(str(tmp_path)) == HOST
    _write(tmp_path, "sys/fs/cgroup/memory.current", f"{GIB // 2}\n")
    assert free_memory.system_available_bytes(str(tmp_path)) == GIB // 2
    # Nothing at all: the system's own figure, a positive number of bytes.
    assert free_memory.system_available_bytes(str(tmp_path / "empty")) > 0


def test_auto_budgets_the_container_limit(tmp_path, monkeypatch):
    _fake_proc(tmp_path, "0::/\n", _V2_MOUNT)
    _group(tmp_path, "sys/fs/cgroup", f"{2 * GIB}", "0")
    real = free_memory.system_available_bytes
    monkeypatch.setattr(
        free_memory, "system_available_bytes", lambda: real(str(tmp_path))
    )
    if budget_module.available_bytes() != 2 * GIB:
        pytest.skip("the default device reports its own memory (an accelerator)")
    auto = fc.filter_chunked_vmap(jnp.sin, chunk_size="auto").budget
    assert auto is not None
    assert auto.resolve() == int(0.8 * 2 * GIB) // 2**25 * 2**25
