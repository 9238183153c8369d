"""Probes, in plain JAX, what reverse mode allocates for a batch-sized buffer that
several loops read: the memory behind kept stage boundaries under `jax.grad`.

    python benchmarks/cotangent_reads.py    # prints a Markdown table (about 15 s)

`n` `lax.scan`s (checkpointed bodies, as the library's loop) each read one buffer
`B = tanh(x)` of 8,192 x 128 float32 (4 MiB), chunk by chunk, either as a scanned
input or through the scan's carry; the program is `jax.grad` of the sum of their
results with respect to `x` and each loop's weights. XLA's temporaries grow by one
buffer a reader when `B` is a scanned input: each loop's transpose allocates its
own cotangent of `B`, and XLA sums them in one fusion after every backward loop.
Two controls: the gradient with respect to the weights alone (no cotangent of `B`,
no growth), and an `optimization_barrier` tying `B` to each reader's result, so
that each backward loop would wait for the partial sum of the later ones (no
change: XLA removes the barriers before it fuses). Through the carry they are far
larger, as each step's carry is saved for the backward pass. Each gradient is
checked against the first case's (the largest difference relative to its largest
entry is printed). `accumulating_transpose.py` measures the remedy. See
`benchmarks/README.md` (BatchNorm networks).
"""

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from _measure import compile_fn, median_seconds, MIB


N, D, K = 8192, 128, 512


def chunk(rows, w):
    """What each reader computes of one chunk of `B`."""
    return jnp.sum(jnp.tanh(rows @ w))


def scanned(b, w):
    """A reader: `b` as a scanned input, each step checkpointed."""

    @jax.checkpoint
    def body(acc, rows):
        return acc + chunk(rows, w), None

    return lax.scan(body, 0.0, b.reshape(N // K, K, D))[0]


def relative_difference(got, want):
    """The largest difference of two PyTrees, relative to each leaf's largest
    entry in `want`."""
    return max(
        float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    )


def _carried(b, w):
    @jax.checkpoint
    def body(carry, i):
        acc, buffer = carry
        rows = lax.dynamic_slice_in_dim(buffer, i * K, K)
        return (acc + chunk(rows, w), buffer), None

    return lax.scan(body, (0.0, b), jnp.arange(N // K))[0][0]


def _loss(read, n, barrier):
    def loss(x, ws):
        b = jnp.tanh(x)
        total = 0.0
        for i in range(n):
            y = read(b, ws[i])
            if barrier:
                b, y = lax.optimization_barrier((b, y))
            total = total + y
        return total

    return loss


def main() -> None:
    print(
        "| read as | gradient of | loops reading B | temporaries MiB | time ms "
        "| difference |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    x = jr.normal(jr.key(0), (N, D))
    cases = (
        ("scanned input", scanned, False, (0, 1), "x and weights"),
        ("scanned input", scanned, False, 1, "weights only"),
        ("scanned input, barrier", scanned, True, (0, 1), "x and weights"),
        ("carry", _carried, False, (0, 1), "x and weights"),
    )
    plain = {}  # the first case's gradients, by `(n, argnums)`
    for name, read, barrier, argnums, wrt in cases:
        for n in (1, 2, 4, 8):
            ws = jr.normal(jr.key(1), (n, D, D)) / 10
            grad = jax.grad(_loss(read, n, barrier), argnums=argnums)
            compiled = compile_fn(grad, x, ws)
            seconds = median_seconds(compiled.executable, x, ws, repeats=5)
            got = compiled.executable(x, ws)
            want = plain.setdefault((n, argnums), got)
            difference = relative_difference(got, want)
            print(
                f"| {name} | {wrt} | {n} | {compiled.temp_bytes / MIB:.1f} | "
                f"{seconds * 1e3:.1f} | {difference:.1e} |"
            )


if __name__ == "__main__":
    main()
