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


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
