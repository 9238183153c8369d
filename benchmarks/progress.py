"""The cost of a progress meter: steady time with and without one, under `jit`.

    python benchmarks/progress.py            # chunks of about 0.25, 1 and 4 ms
    python benchmarks/progress.py --quick    # CI: fewer sizes and repeats
    python benchmarks/progress.py --chunk-ms 1 --repeats 101   # one size, precisely

Each workload maps a small MLP over a batch with `filter_chunked_vmap`, at chunk
sizes chosen so that one chunk takes a given time, and times the jitted call
without a meter and with meters whose host methods do nothing (so that only the
callbacks' own cost is measured): one with the default `max_updates` (at most
100 reports per call) and one that reports after every chunk. They are timed
alternately, `--repeats` times each after a warm-up, and the medians of the pairs'
ratios are compared (wall time, and CPU time of all threads). A second table
times one host callback per step of an otherwise empty `lax.scan`: the primitive
the loop uses, against `jax.debug.callback`. Exits non-zero if a result differs
from `jax.vmap`'s; never fails on timing.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import filtered_chunk as fc
from filtered_chunk import _reporting


class SilentMeter(fc.AbstractProgressMeter):
    """Does nothing on the host: what remains is the callback's cost."""

    def open(self, label: str, total: int) -> None:
        del label, total

    def update(self, state: Any, done: int) -> None:
        del state, done

    def close(self, state: Any) -> None:
        del state


class SilentEveryChunk(SilentMeter):
    """Reports after every chunk, however many there are."""

    max_updates = 10**9


def mlp(params: Any, x: jax.Array) -> jax.Array:
    w1, w2 = params
    return jnp.tanh(x @ w1) @ w2


def once(fn: Callable[..., Any], *args: Any) -> tuple[float, float]:
    """Wall time and process CPU time (all threads) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - wall, time.process_time() - cpu


def paired(
    a: Callable[..., Any], b: Callable[..., Any], args: Any, repeats: int
) -> tuple[float, float, float, float]:
    """`a(*args)` and `b(*args)` timed alternately after a warm-up: the median
    wall and CPU times of `a`, and the medians of the pairs' wall time and CPU time
    ratios `b / a` (pairing cancels the drift of a shared machine's load)."""
    for _ in range(2):
        once(a, *args), once(b, *args)
    walls, cpus, wall_ratios, cpu_ratios = [], [], [], []
    for _ in range(repeats):
        (wall_a, cpu_a), (wall_b, cpu_b) = once(a, *args), once(b, *args)
        walls.append(wall_a)
        cpus.append(cpu_a)
        wall_ratios.append(wall_b / wall_a)
        cpu_ratios.append(cpu_b / cpu_a)
    return (
        statistics.median(walls),
        statistics.median(cpus),
        statistics.median(wall_ratios),
        statistics.median(cpu_ratios),
    )


def chunk_for(target: float, params: Any, x: jax.Array) -> int:
    """A chunk size whose chunk takes about `target` seconds."""
    size = 64
    while True:
        f = jax.jit(jax.vmap(mlp, in_axes=(None, 0)))
        # The fastest of a few runs: the least disturbed by other work.
        seconds = min([once(f, params, x[:size])[0] for _ in range(6)][1:])
        if seconds >= target or size >= x.shape[0] // 8:
            return size
        size = min(x.shape[0] // 8, max(size + 1, int(size * target / seconds)))


def overheads(quick: bool, repeats: int, targets: list[float]) -> bool:
    hidden = 256
    batch = 2**14 if quick else 2**16
    key1, key2, key3 = jr.split(jr.key(0), 3)
    params = (
        jr.normal(key1, (hidden, hidden)) / hidden**0.5,
        jr.normal(key2, (hidden, hidden)) / hidden**0.5,
    )
    x = jr.normal(key3, (batch, hidden))
    expected = jax.vmap(mlp, in_axes=(None, 0))(params, x)
    ok = True
    print(f"MLP {hidden}x{hidden} on {batch} elements, {jax.default_backend()}")
    print(
        f"{'meter':>11} {'chunk':>6} {'steps':>6} {'reports':>8} "
        f"{'wall ms/chunk':>14} {'CPU ms/chunk':>13} {'wall overhead':>14} "
        f"{'CPU overhead':>13}"
    )
    for target in targets:
        chunk = chunk_for(target / 1e3, params, x)
        build = lambda meter: jax.jit(
            fc.filter_chunked_vmap(
                mlp, in_axes=(None, 0), chunk_size=chunk, progress_meter=meter
            )
        )
        plain = build(None)
        steps = -(-batch // chunk)
        for name, meter in (("default", SilentMeter()), ("every", SilentEveryChunk())):
            metered = build(meter)
            ok &= bool(np.allclose(metered(params, x), expected, atol=1e-5))
            wall, cpu, wall_ratio, cpu_ratio = paired(
                plain, metered, (params, x), repeats
            )
            stride = -(-steps // meter.max_updates)
            reports = len(range(0, steps - 1, stride)) + 1
            print(
                f"{name:>11} {chunk:>6} {steps:>6} {reports:>8} "
                f"{1e3 * wall / steps:>14.3f} {1e3 * cpu / steps:>13.3f} "
                f"{100 * (wall_ratio - 1):>13.2f}% {100 * (cpu_ratio - 1):>12.2f}%"
            )
    return ok


def callback_costs(repeats: int) -> None:
    steps = 1000
    reporter = _reporting.Reporter(SilentMeter(), "bench", 2 * steps, 1, steps, 1, 1)

    def loop(kind: str) -> Callable[[jax.Array], jax.Array]:
        def body(carry: Any, _: None) -> tuple[Any, None]:
            i, y = carry
            y = jnp.sin(y)
            if kind == "chunk_progress":
                _reporting.report_step(reporter, i, 1, y)
            elif kind == "jax.debug.callback":
                jax.debug.callback(lambda *_: None, i, y[0])
            return (i + 1, y), None

        return jax.jit(lambda x: lax.scan(body, (jnp.int32(0), x), length=steps)[0][1])

    x = jnp.ones(8)
    empty = loop("none")
    print(f"\nOne host callback per step of an empty scan ({steps} steps)")
    for kind in ("chunk_progress", "jax.debug.callback"):
        wall, cpu, wall_ratio, cpu_ratio = paired(empty, loop(kind), (x,), repeats)
        print(
            f"{kind:>20}: {1e6 * wall * (wall_ratio - 1) / steps:6.1f} us per step "
            f"(wall), {1e6 * cpu * (cpu_ratio - 1) / steps:6.1f} us (CPU)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--chunk-ms",
        type=float,
        nargs="+",
        default=None,
        help="the chunk durations to measure (default: 0.25 1 4, or 1 with --quick)",
    )
    args = parser.parse_args()
    repeats = args.repeats or (7 if args.quick else 21)
    targets = args.chunk_ms or ([1.0] if args.quick else [0.25, 1.0, 4.0])
    ok = overheads(args.quick, repeats, targets)
    callback_costs(repeats)
    if not ok:
        print("A result differs from jax.vmap's.")
        sys.exit(1)


if __name__ == "__main__":
    main()
