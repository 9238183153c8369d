"""One of two processes sharing a batch under `jax.distributed` (CPU, loopback).

Run by `test_sharding.py::test_two_processes`, as
`python tests/sharding_multihost.py PROCESS_ID PORT`. Each process has 2 CPU devices,
so the mesh spans 4 devices in two processes; each checks its own shards of the
output and of the gradient against NumPy, and that the forward program has no
collective. It prints `OK` last if every check passed.
"""

import os
import re
import sys


os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import filtered_chunk as fc  # noqa: E402


def main(process_id: int, port: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = jax.make_mesh((4,), ("batch",))
    # 20 elements on 4 devices: 5 per device, chunks of 2 leave a remainder.
    xs = np.linspace(-1.0, 1.0, 40, dtype=np.float32).reshape(20, 2)
    ws = np.array([1.0, 2.0], np.float32)
    x = jax.make_array_from_callback(
        xs.shape, NamedSharding(mesh, P("batch")), xs.__getitem__
    )
    w = jax.make_array_from_callback(ws.shape, NamedSharding(mesh, P()), ws.__getitem__)
    f = lambda w, x: jnp.sin(x * w).sum()
    chunked = fc.filter_chunked_vmap(f, in_axes=(None, 0), chunk_size=2)
    expected = np.sin(xs * ws).sum(1)
    expected_grad = (np.cos(xs * ws) * xs).sum(0)

    for out in (chunked(w, x), jax.jit(chunked)(w, x)):  # outside and under `jit`
        assert out.sharding.spec == P("batch"), out.sharding
        for shard in out.addressable_shards:
            np.testing.assert_allclose(shard.data, expected[shard.index], rtol=1e-5)
    hlo = jax.jit(chunked).lower(w, x).compile().as_text() or ""
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)
    grad = jax.jit(jax.grad(lambda w, x: chunked(w, x).sum()))(w, x)
    for shard in grad.addressable_shards:
        np.testing.assert_allclose(shard.data, expected_grad, rtol=1e-5)
    check_progress(process_id, f, w, x)
    check_budget(process_id, mesh)
    jax.distributed.shutdown()
    print("OK", flush=True)


class Counts(fc.AbstractProgressMeter):
    def open(self, label, total):
        COUNTS.append(("open", total))

    def update(self, state, done):
        COUNTS.append(done)

    def close(self, state):
        COUNTS.append("close")


COUNTS: list = []


def check_progress(process_id: int, f, w, x) -> None:
    """One meter for the global batch, shown by the process with the first shard:
    5 elements per device in overlapping chunks of 2 end at 2, 4 and 5, times 4."""
    metered = fc.filter_chunked_vmap(
        f, in_axes=(None, 0), chunk_size=2, progress_meter=Counts()
    )
    jax.block_until_ready(metered(w, x))
    expected = [("open", 20), 8, 16, 20, "close"] if process_id == 0 else []
    assert COUNTS == expected, COUNTS


def check_budget(process_id: int, mesh) -> None:
    """One choice on both processes, for the smaller free memory: at
    `MemoryBudget(0.5)` process 1 has room for half the whole batch's gradient
    program, process 0 for all of it."""
    from filtered_chunk._budget import _values

    rows = np.linspace(-1.0, 1.0, 20 * 128, dtype=np.float32).reshape(20, 128)
    x = jax.make_array_from_callback(
        rows.shape, NamedSharding(mesh, P("batch")), rows.__getitem__
    )
    f = lambda v: jnp.tanh(jnp.outer(v, v)) @ v  # 64 KiB of working set each
    step = lambda chunked: jax.jit(jax.grad(lambda _x: jnp.sum(chunked(_x) ** 2)))
    everything = fc.filter_chunked_vmap(f, chunk_size=fc.MemoryBudget(2**40))
    (whole,) = fc.suggest_chunk_sizes(step(everything), x)
    assert whole.chunk_size == 5, whole  # 5 elements a device
    free = 8 * whole.bytes if process_id == 0 else whole.bytes
    _values.available_bytes = lambda device=None: free
    chunked = fc.filter_chunked_vmap(f, chunk_size=fc.MemoryBudget(0.5))
    grad = step(chunked)(x)
    expected = jax.grad(lambda v: jnp.sum(f(v) ** 2))
    for shard in grad.addressable_shards:
        for i, row in zip(range(20)[shard.index[0]], shard.data):
            np.testing.assert_allclose(row, expected(rows[i]), rtol=1e-4, atol=1e-6)
    (choice,) = fc.suggest_chunk_sizes(step(chunked), x)
    # Process 1's budget (half the whole's), never timed across processes.
    assert choice.budget <= whole.bytes // 2 < choice.budget * 33 / 32, choice
    assert choice.bytes <= choice.budget and choice.chunk_size < 5, choice
    assert choice.model == "cache", choice
    print("CHOICE", choice.chunk_size, choice.bytes, choice.budget, flush=True)
    # A refusal on one process is a refusal on both; `tune=True` is refused.
    _values.available_bytes = lambda device=None: 1 if process_id else 2**40
    for refused in (fc.MemoryBudget(0.5), fc.MemoryBudget(2**40, tune=True)):
        try:
            fc.suggest_chunk_size(fc.filter_chunked_vmap(f, chunk_size=refused), x)
        except ValueError as e:
            assert "too small" in str(e) or "tune=True" in str(e), e
        else:
            raise AssertionError(f"{refused} was not refused")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
