"""Layer kinds that users map, inside the chunk loop: time and memory against
`jax.vmap` and `jax.lax.map(batch_size=)`, with XLA's default flags.

    python benchmarks/layers.py           # full: benchmarks/results/layers.md
    python benchmarks/layers.py --quick   # CI: small sizes, checks values only

Each kind maps one element's function over a batch of `N` elements, with the
parameters unmapped: an MLP, Equinox's `Conv1d` and `Conv2d` (channels first,
as Equinox writes them), a convolution with channels last (as Flax writes it),
multi-head attention over 32 tokens, a layer norm, a Gaussian kernel of each
element against the whole batch (the batch closed over), a real FFT, a GRU over
32 steps (an inner `lax.scan`), and a sort. Each runs evaluated and under
`jax.grad` of `sum(out ** 2)` w.r.t. the parameters, as `jax.vmap`, as
`jax.lax.map(batch_size=k)` and as `filter_chunked_vmap(chunk_size=k)`, at `k`
of 64, 256 and 1,024, and at the default budget's choice (`chunk_size="auto"`,
searched afresh: its store is a temporary folder). Under `jax.grad` one more
column, `checkpoint=False` at 256, shows what rematerialising each chunk costs
where the forward pass dominates (sort, FFT, the pairwise kernel): it keeps
every chunk's residuals, as `lax.map` does. Every result is checked against
`jax.vmap`'s first (the largest difference at most 1e-4 of its largest value);
a mismatch exits non-zero.

Time: after a warm-up, interleaved rounds, each timing every program of the
kind and mode once (the median of three calls); a program's ratio is the
median over rounds of its time over `jax.vmap`'s in the same round. Memory:
XLA's temporaries plus outputs from `memory_analysis()`, of the program compiled
with YNNPACK's fusions off, whose scratch it does not count
(`_measure.compile_fn(..., count="fusions off")`). XLA's flags are its defaults
(`XLA_FLAGS` is not set here); the table's header says what the environment set.
"""

import argparse
import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from _measure import compile_fn, MIB
from _runner import cpu_model

import filtered_chunk as fc


Kind = Callable[[Any, int], tuple[Callable[[Any, Any], Any], Any, Any]]
DEFAULT = 'chunked "auto"'
NO_REMAT = "chunked, checkpoint=False,"


def _mlp(key, n):
    model = eqx.nn.MLP(64, 64, 256, 2, key=key)
    return lambda m, x: m(x), model, jr.normal(key, (n, 64))


def _conv1d(key, n):
    model = eqx.nn.Sequential(
        [eqx.nn.Conv1d(8, 16, 5, key=key), eqx.nn.Lambda(jax.nn.relu)]
    )
    return lambda m, x: m(x), model, jr.normal(key, (n, 8, 128))


def _conv2d(key, n):
    k1, k2 = jr.split(key)
    model = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(3, 16, 3, key=k1),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Conv2d(16, 16, 3, key=k2),
        ]
    )
    return lambda m, x: m(x), model, jr.normal(key, (n, 3, 32, 32))


def _conv2d_nhwc(key, n):
    k1, k2 = jr.split(key)
    w = (jr.normal(k1, (3, 3, 3, 16)) / 5, jr.normal(k2, (3, 3, 16, 16)) / 12)

    def conv(x, kernel):
        dn = ("NHWC", "HWIO", "NHWC")
        return lax.conv_general_dilated(
            x[None], kernel, (1, 1), "SAME", dimension_numbers=dn
        )[0]

    return (
        lambda p, x: conv(jax.nn.relu(conv(x, p[0])), p[1]),
        w,
        jr.normal(key, (n, 32, 32, 3)),
    )


def _attention(key, n):
    model = eqx.nn.MultiheadAttention(4, 64, key=key)
    return lambda m, x: m(x, x, x), model, jr.normal(key, (n, 32, 64))


def _layernorm(key, n):
    model = (eqx.nn.LayerNorm(256), eqx.nn.Linear(256, 256, key=key))
    return lambda m, x: m[1](m[0](x)), model, jr.normal(key, (n, 256))


def _pairwise(key, n):
    x = jr.normal(key, (n, 16))
    w = jr.normal(jr.fold_in(key, 1), (n,))

    def kernel(scale, xi):  # against the whole batch, closed over
        return jnp.exp(-scale * jnp.sum((xi - x) ** 2, axis=-1)) @ w

    return kernel, jnp.array(0.5), x


def _fft(key, n):
    w = jr.normal(key, (513,))
    return lambda p, x: jnp.abs(jnp.fft.rfft(x)) * p, w, jr.normal(key, (n, 1024))


def _scan(key, n):
    cell = eqx.nn.GRUCell(16, 64, key=key)

    def run(c, xs):
        return lax.scan(lambda h, xt: (c(xt, h), None), jnp.zeros(64), xs)[0]

    return run, cell, jr.normal(key, (n, 32, 16))


def _sort(key, n):
    w = jr.normal(key, (1024,))
    return lambda p, x: jnp.sort(x * p), w, jr.normal(key, (n, 1024))


KINDS: dict[str, Kind] = {
    "MLP": _mlp,
    "Conv1d (Equinox)": _conv1d,
    "Conv2d (Equinox, NCHW)": _conv2d,
    "Conv2d (NHWC)": _conv2d_nhwc,
    "attention": _attention,
    "layer norm": _layernorm,
    "pairwise kernel": _pairwise,
    "FFT": _fft,
    "GRU (inner scan)": _scan,
    "sort": _sort,
}


def _programs(fun, params, x, sizes, mode):
    """Each method's function of `(params, x)`, by label."""
    params, static = eqx.partition(params, eqx.is_inexact_array)

    def element(p, xi):
        return fun(eqx.combine(p, static), xi)

    maps = {"jax.vmap": lambda p, _x: jax.vmap(element, in_axes=(None, 0))(p, _x)}
    for k in sizes:
        maps[f"lax.map {k}"] = lambda p, _x, k=k: lax.map(
            lambda xi: element(p, xi), _x, batch_size=k
        )
        maps[f"chunked {k}"] = lambda p, _x, k=k: fc.filter_chunked_vmap(
            element, in_axes=(None, 0), chunk_size=k
        )(p, _x)
    maps[DEFAULT] = lambda p, _x: fc.filter_chunked_vmap(
        element, in_axes=(None, 0), chunk_size="auto"
    )(p, _x)
    if mode == "grad":
        k = sizes[len(sizes) // 2]
        maps[f"{NO_REMAT} {k}"] = lambda p, _x: fc.filter_chunked_vmap(
            element, in_axes=(None, 0), chunk_size=k, checkpoint=False
        )(p, _x)
        maps = {
            name: jax.grad(lambda p, _x, f=f: jnp.sum(f(p, _x) ** 2))
            for name, f in maps.items()
        }
    return maps, params


def _close(actual, expected):
    leaves = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    for a, e in leaves:
        scale = float(jnp.max(jnp.abs(e))) or 1.0
        if float(jnp.max(jnp.abs(a - e))) > 1e-4 * scale:
            return False
    return True


def _time(fn, *args):
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(name, kind, mode, n, sizes, rounds, quick):
    fun, params, x = kind(jr.key(0), n)
    maps, params = _programs(fun, params, x, sizes, mode)
    compiled = {
        label: compile_fn(f, params, x, count="fusions off")
        for label, f in maps.items()
    }
    expected = compiled["jax.vmap"].executable(params, x)
    for label, c in compiled.items():
        if not _close(c.executable(params, x), expected):
            raise SystemExit(f"{name} {mode} {label}: differs from jax.vmap")
    if quick:
        return []
    ratios: dict[str, list[float]] = {label: [] for label in compiled}
    for r in range(rounds):
        labels = list(compiled)
        labels = labels[r % len(labels) :] + labels[: r % len(labels)]
        seconds = {
            label: _time(compiled[label].executable, params, x) for label in labels
        }
        for label in compiled:
            ratios[label].append(seconds[label] / seconds["jax.vmap"])
    return [
        (name, mode, label, statistics.median(ratios[label]), c.temp_plus_output / MIB)
        for label, c in compiled.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, sizes, rounds = (64, (16,), 1) if args.quick else (2048, (64, 256, 1024), 5)
    # The default budget's first calls are first ever, as on a fresh machine.
    os.environ["FILTERED_CHUNK_CACHE_DIR"] = tempfile.mkdtemp(prefix="fc_choices_")
    start = time.perf_counter()
    rows = []
    for name, kind in KINDS.items():
        for mode in ("evaluate", "grad"):
            size = n // 4 if name.startswith("Conv2d") and not args.quick else n
            rows += _measure(name, kind, mode, size, sizes, rounds, args.quick)
            print(f"{name} {mode}: ok", flush=True)
    if args.quick:
        return
    labels = ["jax.vmap"] + [f"{m} {k}" for k in sizes for m in ("lax.map", "chunked")]
    labels += [DEFAULT, f"{NO_REMAT} {sizes[len(sizes) // 2]}"]
    header = "| kind | mode | " + " | ".join(f"`{label}`" for label in labels) + " |"
    now = datetime.datetime.now(datetime.UTC)
    machine = cpu_model()
    flags = os.environ.get("XLA_FLAGS", "")
    lines = [
        f"Command: `python benchmarks/layers.py` ({now:%Y-%m-%d %H:%M} UTC; "
        f"{machine}, {os.cpu_count()} cores; jax {jax.__version__}; "
        f"{time.perf_counter() - start:.0f} s; `XLA_FLAGS={flags}`).",
        "",
        f"Time against `jax.vmap` (median over {rounds} interleaved rounds), then "
        "XLA's temporaries plus outputs in MiB; N = 2,048 (512 for the Conv2d kinds).",
        "",
        header,
        "|" + " --- |" * (len(labels) + 2),
    ]
    by = {(r[0], r[1], r[2]): r for r in rows}
    for name in KINDS:
        for mode in ("evaluate", "grad"):
            cells = [
                f"{by[name, mode, label][3]:.2f}x, {by[name, mode, label][4]:.1f}"
                if (name, mode, label) in by
                else ""
                for label in labels
            ]
            lines.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).parent / "results" / "layers.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
