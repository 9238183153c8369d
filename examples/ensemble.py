"""Evaluate an ensemble of Equinox MLPs over a large batch, chunked and unchunked.

Every one of `--members` MLPs sees every one of `--batch-size` inputs. With
`equinox.filter_vmap` all hidden activations of the whole batch are live at once;
`filtered_chunk.filter_chunked_vmap` evaluates `--chunk-size` inputs at a time, so
its temporary memory is one chunk's. The script prints XLA's compiled memory figures
for both, their steady-state run times, and checks that the results agree.

    python examples/ensemble.py [--batch-size 16384] [--chunk-size 512]
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import filtered_chunk as fc


MIB = 2**20


def make_ensemble(key: jax.Array, members: int, width: int) -> eqx.nn.MLP:
    """An ensemble of MLPs stacked along a leading axis, built with the map itself."""
    make = lambda k: eqx.nn.MLP(64, 1, width, depth=2, key=k)
    return fc.filter_chunked_vmap(make, chunk_size=4)(jr.split(key, members))


def evaluate(ensemble: eqx.nn.MLP, x: jax.Array) -> jax.Array:
    """Every member of the ensemble on one input: shape `(members,)`."""
    return eqx.filter_vmap(lambda model: model(x)[0])(ensemble)


def measure(name: str, fn, params, xs) -> tuple[jax.Array, int]:
    compiled = jax.jit(fn).lower(params, xs).compile()
    memory = compiled.memory_analysis()
    out = compiled(params, xs).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        compiled(params, xs).block_until_ready()
        times.append(time.perf_counter() - start)
    temp = int(memory.temp_size_in_bytes)
    print(
        f"{name:36s} temporaries {temp / MIB:8.1f} MiB   output "
        f"{memory.output_size_in_bytes / MIB:6.2f} MiB   "
        f"time {statistics.median(times) * 1e3:7.1f} ms"
    )
    return out, temp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    model_key, data_key = jr.split(jr.key(0))
    ensemble = make_ensemble(model_key, args.members, args.width)
    xs = jr.normal(data_key, (args.batch_size, 64))
    params, static = eqx.partition(ensemble, eqx.is_array)

    def unchunked(params, xs):
        return eqx.filter_vmap(evaluate, in_axes=(None, 0))(
            eqx.combine(params, static), xs
        )

    def chunked(params, xs):
        return fc.filter_chunked_vmap(
            evaluate, in_axes=(None, 0), chunk_size=args.chunk_size
        )(eqx.combine(params, static), xs)

    print(
        f"{args.members} MLPs (64 -> {args.width} -> {args.width} -> 1) on "
        f"{args.batch_size} inputs, {jax.devices()[0].platform.upper()}"
    )
    expected, vmap_temp = measure("equinox.filter_vmap", unchunked, params, xs)
    label = f"filter_chunked_vmap(chunk_size={args.chunk_size})"
    actual, chunked_temp = measure(label, chunked, params, xs)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    ratio = vmap_temp / max(chunked_temp, 1)
    print(f"results agree; filter_vmap needs {ratio:.1f}x the temporary memory.")
    assert jnp.shape(actual) == (args.batch_size, args.members)


if __name__ == "__main__":
    main()
