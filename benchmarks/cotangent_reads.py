"""Probes, in plain JAX, what reverse mode allocates for a batch-sized buffer that
several loops read: the memory behind kept stage boundaries under `jax.grad`.

    python benchmarks/cotangent_reads.py    # prints a Markdown table (about 20 s)

`n` `lax.scan`s (checkpointed bodies, as the library's loop) each read one buffer
`B = tanh(x)` of 8,192 x 128 float32 (4 MiB), chunk by chunk, either as a scanned
input or through the scan's carry; the program is `jax.grad` of the sum of their
results with respect to `x` and each loop's weights. XLA's temporaries grow by one
buffer a reader when `B` is a scanned input: each loop's transpose allocates its
own cotangent of `B`. Through the carry they are far larger, as each step's carry
is saved for the backward pass. See `benchmarks/README.md` (BatchNorm networks).
"""

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from _measure import compile_fn, median_seconds, MIB


N, D, K = 8192, 128, 512


def _scanned(b, w):
    @jax.checkpoint
    def body(acc, rows):
        return acc + jnp.sum(jnp.tanh(rows @ w)), None

    return lax.scan(body, 0.0, b.reshape(N // K, K, D))[0]


def _carried(b, w):
    @jax.checkpoint
    def body(carry, i):
        acc, buffer = carry
        rows = lax.dynamic_slice_in_dim(buffer, i * K, K)
        return (acc + jnp.sum(jnp.tanh(rows @ w)), buffer), None

    return lax.scan(body, (0.0, b), jnp.arange(N // K))[0][0]


def main() -> None:
    print("| read as | loops reading B | temporaries MiB | time ms |")
    print("| --- | --- | --- | --- |")
    x = jr.normal(jr.key(0), (N, D))
    for name, read in (("scanned input", _scanned), ("carry", _carried)):
        for n in (1, 2, 4, 8):
            ws = jr.normal(jr.key(1), (n, D, D)) / 10

            def loss(_x, _ws, _read=read, _n=n):
                b = jnp.tanh(_x)
                return sum(_read(b, _ws[i]) for i in range(_n))

            compiled = compile_fn(jax.grad(loss, argnums=(0, 1)), x, ws)
            seconds = median_seconds(compiled.executable, x, ws, repeats=5)
            print(
                f"| {name} | {n} | {compiled.temp_bytes / MIB:.1f} | "
                f"{seconds * 1e3:.1f} |"
            )


if __name__ == "__main__":
    main()
