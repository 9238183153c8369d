"""Benchmarks eager (un-jitted) chunked calls of functions that make new Python
objects on every trace: compilations per call and time per call.

    python benchmarks/eager.py           # prints a Markdown table
    python benchmarks/eager.py --quick   # CI: fewer calls; fails on a recompile

An eager chunked call is traced on every call and runs a compiled program cached
on what was traced (`filtered_chunk/_eager.py`). Each construct below puts a new
Python object into the traced program on every trace (a `custom_vjp`'s rules, a
callback's closure, an inner `jit`'s constants); none may cost a compilation per
call. Each row: XLA compilations per call after warm-up, the median time of
eager calls of `filter_chunked_vmap(fun, chunk_size=16)` over 64 elements, and
of `eqx.filter_vmap(fun)` (which compiles nothing it has compiled before, but runs
op by op). With `--grad`, also `jax.grad` of the sum of each, eagerly: that cannot
use the cache (its inputs are tracers), so it compiles on every call.

Then the resident memory of a loop that makes a new program on every call, as an
optimisation or sweep loop does: `c = float(i)` changes, and
`filter_chunked_vmap(lambda a: a * c + 1.0, chunk_size=16)(x)` is a new program
each time (`c` is a constant of it; a cached one would return a stale value, which
is checked). The cache holds 64 programs, so after the first 100 calls the
resident set must stay flat: `--quick` fails if it grows by more than
`MAX_GROWTH_KB` per call.
"""

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _measure import CompileCounter

import filtered_chunk as fc


@jax.custom_vjp
def _sin_vjp(x: jax.Array) -> jax.Array:
    return jnp.sin(x)


_sin_vjp.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


@jax.custom_jvp
def _sin_jvp(x: jax.Array) -> jax.Array:
    return jnp.sin(x)


_sin_jvp.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
_W = jnp.arange(3.0)


def _checkpointed_loop(x: jax.Array) -> jax.Array:
    body = lambda c: (c[0] + 1, c[1] * 1.1)
    loop = eqx.internal.while_loop
    return loop(lambda c: c[0] < 3, body, (0, x), max_steps=4, kind="checkpointed")[1]


def _pure_callback(x: jax.Array) -> jax.Array:
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(
        lambda v: np.asarray(v) * 2, shape, x, vmap_method="sequential"
    )


CONSTRUCTS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "plain `jnp.sin(x) * 2`": lambda x: jnp.sin(x) * 2,
    "user `custom_vjp`": _sin_vjp,
    "user `custom_jvp`": _sin_jvp,
    "`jax.debug.callback` of a lambda": lambda x: (
        jax.debug.callback(lambda v: None, x),
        x * 2,
    )[1],
    "`jax.pure_callback` of a lambda": _pure_callback,
    '`eqx.internal.while_loop(kind="checkpointed")`': _checkpointed_loop,
    "inner `jax.jit` closing over an array": lambda x: jax.jit(lambda y: y * _W)(x),
    "inner `eqx.filter_jit` closing over an array": lambda x: eqx.filter_jit(
        lambda y: y * _W
    )(x),
}


def _median_ms(call: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(call())
    jax.block_until_ready(call())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(repeats: int, grad: bool) -> list[dict[str, Any]]:
    counter = CompileCounter()
    x = jnp.linspace(0.0, 1.0, 64 * 3).reshape(64, 3)
    rows = []
    for name, fun in CONSTRUCTS.items():
        chunked = fc.filter_chunked_vmap(fun, chunk_size=16)
        before = counter.snapshot()[1]
        fc_ms = _median_ms(lambda: chunked(x), repeats)
        # The first of the `repeats + 2` calls may compile; later ones must not.
        compiles = (counter.snapshot()[1] - before - 1) / (repeats + 1)
        row = dict(name=name, compiles=max(compiles, 0.0), fc_ms=fc_ms)
        row["eqx_ms"] = _median_ms(lambda: eqx.filter_vmap(fun)(x), repeats)
        if grad and "callback" not in name:  # callbacks have no derivative
            loss = lambda m: jax.grad(lambda _x: m(_x).sum())(x)
            row["grad_fc_ms"] = _median_ms(lambda: loss(chunked), repeats)
            row["grad_eqx_ms"] = _median_ms(lambda: loss(eqx.filter_vmap(fun)), repeats)
        rows.append(row)
    return rows


# Far above the allocator's noise, far below what a program costs (about 1.8 MB).
MAX_GROWTH_KB = 300
_FILLED = 100  # calls after which the program cache (64 programs) is full


def _resident_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:  # not Linux: the peak, which is as flat as the current
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**20 if sys.platform == "darwin" else 2**10)


def resident_growth(calls: int) -> dict[str, float]:
    """Resident memory of `calls` eager calls with a new closure value each."""
    x = jnp.arange(64.0)
    filled = 0.0
    start = time.perf_counter()
    for i in range(calls):
        c = float(i)
        out = fc.filter_chunked_vmap(lambda a: a * c + 1.0, chunk_size=16)(x)
        if not bool(jnp.all(out == x * c + 1.0)):
            raise AssertionError(f"call {i} ran a stale program")
        if i + 1 == _FILLED:
            filled = _resident_mb()
    end = _resident_mb()
    per_call_ms = (time.perf_counter() - start) / calls * 1e3
    growth_kb = (end - filled) * 2**10 / (calls - _FILLED)
    return dict(
        calls=calls, filled=filled, end=end, growth_kb=growth_kb, ms=per_call_ms
    )


def memory_table(row: dict[str, float]) -> str:
    return "\n".join(
        (
            f"| calls, new closure each | resident after {_FILLED} calls (MB) | "
            "at the end (MB) | growth per call after them (KB) | time per call (ms) |",
            "|---|---|---|---|---|",
            f"| {row['calls']:.0f} | {row['filled']:.0f} | {row['end']:.0f} | "
            f"{row['growth_kb']:.1f} | {row['ms']:.0f} |",
        )
    )


def table(rows: list[dict[str, Any]]) -> str:
    grad = any("grad_fc_ms" in r for r in rows)
    head = "| construct | compiles per call | fc (ms) | eqx.filter_vmap (ms) |"
    rule = "|---|---|---|---|"
    if grad:
        head += " `jax.grad`, fc (ms) | `jax.grad`, eqx (ms) |"
        rule += "---|---|"
    lines = [head, rule]
    for r in rows:
        line = f"| {r['name']} | {r['compiles']:.1f} | {r['fc_ms']:.1f} | "
        line += f"{r['eqx_ms']:.1f} |"
        if grad:
            g = (r.get("grad_fc_ms"), r.get("grad_eqx_ms"))
            line += "".join(" - |" if v is None else f" {v:.1f} |" for v in g)
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, for CI")
    parser.add_argument("--grad", action="store_true", help="also eager jax.grad")
    args = parser.parse_args()
    rows = measure(repeats=3 if args.quick else 10, grad=args.grad)
    print(table(rows))
    memory = resident_growth(calls=_FILLED + 64 if args.quick else 1000)
    print()
    print(memory_table(memory))
    status = 0
    recompiling = [r["name"] for r in rows if r["compiles"] > 0]
    if recompiling:
        print("Recompiled on every eager call:", ", ".join(recompiling))
        status = 1
    if memory["growth_kb"] > MAX_GROWTH_KB:
        print(f"Resident memory grew by more than {MAX_GROWTH_KB} KB per call.")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
