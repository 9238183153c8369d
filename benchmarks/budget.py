"""Benchmarks memory budgets: the chunk size chosen for a budget, against every
fixed chunk size that fits it.

    python benchmarks/budget.py           # full sizes: benchmarks/results/budget.*
    python benchmarks/budget.py --quick   # CI: small sizes, prints, fails if wrong

For each workload of `benchmarks/_workloads.py` and budgets of 1/8, 1/4, 1/2 and 1x
the memory of `jax.vmap` (XLA's temporary plus output bytes of the compiled
program), `filter_chunked_vmap(..., chunk_size=fc.MemoryBudget(budget))`:

- memory: the compiled program's temporary plus output bytes at the chosen size,
  which must not exceed the budget (the run fails otherwise, or if a result differs
  from `jax.vmap`'s);
- time: the steady-state time at the chosen size against the fastest fixed chunk
  size (powers of two and the workload's chunk sizes) that also fits: the three
  fastest picked in a first set of interleaved rounds (a shortlist: the first
  set's fastest is biased low, the least of many noisy medians), then each timed
  against the choice in rounds of their own, the fastest being the one the
  choice is slowest against. Each ratio is the median over rounds of the two
  programs' time ratio in the same round (target: within 1.10x). Each round runs
  the programs in order of size, the next round in reverse, so that none runs
  right after one of far more memory (which can make it three times as slow);
- time against the largest size that fits (what a budget chose before the speed
  model of `filtered_chunk/_budget/_model.py`) and, at 1x, against `jax.vmap`
  itself, each in rounds of the two programs alone;
- search cost: the first call of the jitted program with empty caches (the
  search with its timing, the program's compilation and the run), a repeat with
  a fresh `jax.jit` (the search is cached: only the outer program compiles), and
  the first call of a later process (the in-memory caches emptied, the timed
  choice stored on disk kept: it must choose the same size); the search's
  compilations and seconds are the differences;
- the same for `fc.MemoryBudget(budget, tune=False)`, the speed model alone,
  never timed: its size, its time against the fastest
  fitting fixed size (in the rounds that found it), and its search's
  compilations and seconds.

For the gradient workload (d) the program is `jax.grad` of the summed map, so the
budget applies to the differentiated chunked call. Two more workloads check the
budget under other transformations: (f) `jax.grad` of a non-linear loss of the
MLP's outputs (its cotangent depends on the outputs, so XLA cannot fold it as it
could a sum's), and (g) `jax.jvp` of the pairwise kernel w.r.t. the queries, a
tangent given as an argument (forward mode: primal and tangent outputs). And five
whose shape the others lack: (h) softmax attention of each query over a long
sequence; (i) a per-sample Monte Carlo estimate, a reduction over fixed draws
inside the mapped function; (j) two convolutions over each image; (k) an RBF
kernel row of each query against a large unmapped set of points; and (l) a large,
memory-bound temporary per element, so that the fastest chunks hold a few elements.
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _measure import compile_fn, CompileCounter, MIB
from _workloads import Sizes, Workload, workloads

import filtered_chunk as fc
import filtered_chunk._budget._choose as choose_module
import filtered_chunk._budget._counts as counts_module
import filtered_chunk._budget._store as store_module
import filtered_chunk._budget._timing as timing_module


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1)
TARGET = 1.10
SHORTLIST = 3  # the fixed sizes timed against the choice, fastest first
Row = dict[str, Any]


def program(w: Any, chunk_size: Any) -> Callable[..., Any]:
    """The workload's program with `filter_chunked_vmap` at `chunk_size`."""
    mapped = fc.filter_chunked_vmap(
        w.element, in_axes=w.in_axes, out_axes=w.out_axes, chunk_size=chunk_size
    )
    if w.objective == "grad":
        return lambda p, *rest: jax.grad(lambda _p: jnp.sum(mapped(_p, *rest)))(p)
    if w.objective == "grad_loss":
        loss = lambda p, *rest: jnp.sum(jnp.tanh(mapped(p, *rest)) ** 2)  # noqa: E731
        return jax.grad(loss)
    if w.objective == "jvp":
        # The tangent is the last argument.
        return lambda x, *rest: jax.jvp(
            lambda _x: mapped(_x, *rest[:-1]), (x,), (rest[-1],)
        )
    return mapped


def budget_workloads(quick: bool) -> list[Workload]:
    """The workloads of `_workloads.py`, (f) and (g) built on (b) and (a), and
    (h) to (l), of shapes the others lack."""
    base = workloads(quick)
    kernel, mlp = base[0], base[1]
    loss = dataclasses.replace(
        mlp,
        key="f",
        title="gradient of a non-linear loss",
        description="`jax.grad` w.r.t. the parameters of "
        "`sum(tanh(mlp(x)) ** 2)` over the N inputs of (b).",
        objective="grad_loss",
    )

    def _with_tangent(n: int) -> tuple[Any, ...]:
        queries, *rest = kernel.make_args(n)
        tangent = np.random.default_rng(8).standard_normal(queries.shape, np.float32)
        return queries, *rest, jnp.asarray(tangent)

    jvp = dataclasses.replace(
        kernel,
        key="g",
        title="`jax.jvp` of the kernel",
        description="`jax.jvp` of (a) w.r.t. the N queries, with a tangent.",
        make_args=_with_tangent,
        objective="jvp",
    )
    return [
        *base,
        loss,
        jvp,
        _attention(quick),
        _monte_carlo(quick),
        _convolution(quick),
        _kernel_density(quick),
        _gram_product(quick),
    ]


def _attention(quick: bool) -> Workload:
    """(h) One query's softmax attention over a long sequence of keys/values."""
    length, dim, n = (1024, 32, 512) if quick else (8192, 64, 2048)
    keys = jnp.asarray(np.random.default_rng(11).standard_normal((length, dim)))
    values = jnp.asarray(np.random.default_rng(12).standard_normal((length, dim)))

    def element(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax.nn.softmax(k @ q / math.sqrt(dim)) @ v

    def make_args(m: int) -> tuple[Any, ...]:
        q = np.random.default_rng(13).standard_normal((m, dim), np.float32)
        return jnp.asarray(q), keys.astype(jnp.float32), values.astype(jnp.float32)

    chunks = (16, 64, 100) if quick else (16, 64, 100, 256, 1000)
    return Workload(
        "h",
        "attention, long sequence",
        f"softmax attention of each of N queries ({dim}-dim) over {length} keys "
        "and values.",
        element,
        (0, None, None),
        make_args,
        Sizes(n, chunks, n // 4, n // 16),
    )


def _monte_carlo(quick: bool) -> Workload:
    """(i) A per-sample Monte Carlo estimate: a mean over draws inside `fun`."""
    draws, dim, n = (256, 16, 512) if quick else (2048, 32, 2048)
    noise = np.random.default_rng(14).standard_normal((draws, dim), np.float32)

    def element(theta: jax.Array, eps: jax.Array) -> jax.Array:
        x = theta + 0.1 * eps  # (draws, dim)
        value = jnp.sin(x @ theta) * jnp.exp(-0.5 * jnp.sum(x**2, axis=-1) / dim)
        return jnp.stack([jnp.mean(value), jnp.std(value)])

    def make_args(m: int) -> tuple[Any, ...]:
        theta = np.random.default_rng(15).standard_normal((m, dim), np.float32)
        return jnp.asarray(theta), jnp.asarray(noise)

    chunks = (16, 64, 100) if quick else (16, 64, 100, 256, 1000)
    return Workload(
        "i",
        "Monte Carlo estimator",
        f"per-sample mean and spread of a function over {draws} fixed normal "
        f"draws ({dim}-dim), a reduction inside `fun`.",
        element,
        (0, None),
        make_args,
        Sizes(n, chunks, n // 4, n // 16),
    )


def _convolution(quick: bool) -> Workload:
    """(j) Each image through two 3x3 convolutions: a per-image feature vector."""
    size, hidden, n = (16, 8, 256) if quick else (32, 16, 1024)
    # Channels last (NHWC images, HWIO kernels): XLA:CPU's fast convolution wants
    # this layout; in NCHW the convolutions inside the chunk loop run ~10x slower.
    dims = ("NHWC", "HWIO", "NHWC")
    rng = np.random.default_rng(16)
    kernel1, kernel2 = (
        jnp.asarray(rng.standard_normal((3, 3, c, hidden), np.float32) / (3 * c**0.5))
        for c in (3, hidden)
    )

    def conv(x: jax.Array, kernel: jax.Array) -> jax.Array:
        # A batch axis of 1: the map's batch becomes the convolution's.
        out = jax.lax.conv_general_dilated(
            x[None], kernel, (1, 1), "SAME", dimension_numbers=dims
        )
        return out[0]

    def element(image: jax.Array, k1: jax.Array, k2: jax.Array) -> jax.Array:
        features = conv(jnp.tanh(conv(image, k1)), k2)
        return jnp.mean(jax.nn.relu(features), axis=(0, 1))

    def make_args(m: int) -> tuple[Any, ...]:
        images = np.random.default_rng(17).standard_normal(
            (m, size, size, 3), np.float32
        )
        return jnp.asarray(images), kernel1, kernel2

    chunks = (16, 64, 100) if quick else (16, 64, 100, 256, 1000)
    return Workload(
        "j",
        "convolutions over images",
        f"two 3x3 convolutions (3 -> {hidden} -> {hidden} channels, `tanh` "
        f"between) over each of N {size}x{size} images, then a mean over pixels: "
        "one feature vector per image.",
        element,
        (0, None, None),
        make_args,
        Sizes(n, chunks, n // 4, n // 16),
    )


def _kernel_density(quick: bool) -> Workload:
    """(k) Each query's RBF kernel row against a large unmapped set of points."""
    points, dim, n = (2048, 16, 512) if quick else (16384, 64, 1024)
    refs = np.random.default_rng(18).standard_normal((points, dim), np.float32)
    values = np.random.default_rng(19).standard_normal((points,), np.float32)
    refs, values = jnp.asarray(refs), jnp.asarray(values)

    def element(q: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        sq_dist = jnp.sum(q**2) - 2 * (x @ q) + jnp.sum(x**2, axis=-1)
        logits = -0.5 * sq_dist / dim
        log_density = jax.nn.logsumexp(logits) - math.log(points)
        return jnp.stack([log_density, jax.nn.softmax(logits) @ y])

    def make_args(m: int) -> tuple[Any, ...]:
        q = np.random.default_rng(20).standard_normal((m, dim), np.float32)
        return jnp.asarray(q), refs, values

    chunks = (16, 64, 100) if quick else (16, 64, 100, 256, 1000)
    return Workload(
        "k",
        "kernel against a large operand",
        f"each of N queries ({dim}-dim) against {points} unmapped points "
        f"({points * dim * 4 / MIB:g} MiB): the log kernel density and the "
        "kernel-weighted mean of the points' values.",
        element,
        (0, None, None),
        make_args,
        Sizes(n, chunks, n // 4, n // 16),
    )


def _gram_product(quick: bool) -> Workload:
    """(l) A large, memory-bound temporary per element: the fastest chunk is small."""
    length, width, n = (256, 128, 64) if quick else (1024, 512, 256)
    w = np.random.default_rng(21).standard_normal((width,), np.float32)
    v = np.random.default_rng(22).standard_normal((width,), np.float32) / width
    w, v = jnp.asarray(w), jnp.asarray(v)

    def element(x: jax.Array, w: jax.Array, v: jax.Array) -> jax.Array:
        # Two products read the (length, width) features: XLA materialises them.
        features = jax.nn.relu(x[:, None] * w[None, :] - 1)
        return features.T @ (features @ v) / length

    def make_args(m: int) -> tuple[Any, ...]:
        x = np.random.default_rng(23).standard_normal((m, length), np.float32)
        return jnp.asarray(x), w, v

    chunks = (1, 2, 4, 8, 16) if quick else (1, 2, 4, 8, 16, 64)
    return Workload(
        "l",
        "large temporary per element",
        f"per element, features `F = relu(x w^T - 1)` of {length}x{width} "
        f"({length * width * 4 / MIB:g} MiB) and `F^T (F v)`: memory-bound, the "
        "fastest chunks on CPU hold a few elements.",
        element,
        (0, None, None),
        make_args,
        Sizes(n, chunks, n // 4, n // 16),
    )


def _clear_cache(store: bool = True) -> None:
    """Forgets the choices made: in memory (as a new process would), and with
    `store` also on disk."""
    counts_module.measured.clear()
    choose_module._chosen.clear()
    folder = store_module.directory()
    if store and folder is not None:
        for entry in folder.glob("*.json"):
            entry.unlink()


def _fixed_sizes(w: Any, quick: bool) -> list[int]:
    n = w.sizes.batch_size
    powers = [
        2**i for i in range(3 if quick else 2, int(math.log2(n)) + 1, 1 + 2 * quick)
    ]
    return sorted({k for k in (*powers, *w.sizes.chunk_sizes, n) if k <= n})


def _interleaved(
    calls: dict[str, Callable[[], Any]], repeats: int
) -> dict[str, list[float]]:
    """The times of `calls` (any that need far more memory than the others
    last), timed in rounds after a warm-up, each round in the reverse order of the
    one before: each program runs after one of like memory, or after itself, or
    before the larger one. A program run right after one that needs far more
    memory can take three times as long (measured: (l) at 1 element a chunk
    read 74 ms after `jax.vmap` and 24 ms elsewhere in the same rounds)."""
    keys, times = list(calls), {key: [] for key in calls}
    for r in range(repeats + 1):
        order = keys if r % 2 == 0 else keys[::-1]
        for key in order:
            start = time.perf_counter()
            jax.block_until_ready(calls[key]())
            if r:
                times[key].append(time.perf_counter() - start)
    return times


def _paired(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of `a`'s time over `b`'s in the same round: a change
    of the machine's load between rounds hits both."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def _max_rel_error(out: Any, ref: Any) -> float:
    worst = 0.0
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
        scale = max(float(np.max(np.abs(r), initial=0.0)), 1e-30)
        worst = max(worst, float(np.max(np.abs(o - r), initial=0.0)) / scale)
    return worst


def _search_cost(
    w: Any, budget: int, args: tuple[Any, ...], counter: Any, tune: bool | None
) -> Row:
    """Seconds and compilations of the first call of the jitted program (the
    search, the program's compilation, the run) with empty caches, and of a
    repeat with a fresh `jax.jit` (the search is cached: nothing but the program
    compiles); the search's share is the difference. With a timed choice, also
    the first call of a later process (`stored`: the in-memory caches emptied,
    the stored timing kept)."""
    _clear_cache()
    row: Row = {}
    for name in ("first", "repeat", "stored"):
        if name == "stored":
            _clear_cache(store=False)
        before = counter.snapshot()
        start = time.perf_counter()
        out = jax.jit(program(w, fc.MemoryBudget(budget, tune=tune)))(*args)
        jax.block_until_ready(out)
        after = counter.snapshot()
        row[f"{name}_call_s"] = time.perf_counter() - start
        row[f"{name}_call_compiles"] = after[1] - before[1]
        row[f"{name}_compile_s"] = after[2] - before[2]
        if name == "first":
            (row["choice"],) = choose_module._chosen.values()
            row["out"] = out
    row["search_compiles"] = row["first_call_compiles"] - row["repeat_call_compiles"]
    # Compile times vary run to run: the difference can dip below zero.
    row["search_compile_s"] = max(row["first_compile_s"] - row["repeat_compile_s"], 0)
    # The search's share of the first call: compiling, and timing if it times.
    row["search_s"] = max(row["first_call_s"] - row["repeat_call_s"], 0)
    row["stored_search_s"] = max(row["stored_call_s"] - row["repeat_call_s"], 0)
    (stored,) = choose_module._chosen.values()
    row["stored_same"] = stored.chunk_size == row["choice"].chunk_size
    return row


def measure_workload(w: Any, quick: bool, counter: Any, log: Callable) -> list[Row]:
    repeats = 3 if quick else 9
    n = w.sizes.batch_size
    args = w.make_args(n)
    vmap = compile_fn(program(w, None), *args)
    ref = vmap.executable(*args)
    vmap_bytes = vmap.temp_plus_output
    fixed = {}
    for k in _fixed_sizes(w, quick):
        compiled = compile_fn(program(w, k), *args)
        fixed[k] = compiled
    rows = []
    for fraction in FRACTIONS:
        budget = int(fraction * vmap_bytes)
        row: Row = {"workload": w.key, "title": w.title, "batch_size": n}
        row |= {"fraction": fraction, "budget": budget, "vmap_bytes": vmap_bytes}
        try:
            cost = _search_cost(w, budget, args, counter, None)
        except ValueError as e:
            needs = re.search(r"needs (\d+) bytes", str(e))
            row["error"] = int(needs.group(1)) if needs else str(e)
            log(f"({w.key}) {fraction:g}x: no chunk size fits")
            rows.append(row)
            continue
        choice = cost.pop("choice")
        k = choice.chunk_size
        error = _max_rel_error(cost.pop("out"), ref)
        # `MemoryBudget(budget, tune=False)`: the speed model alone, as before.
        modelled = _search_cost(w, budget, args, counter, False)
        model_choice = modelled.pop("choice")
        error = max(error, _max_rel_error(modelled.pop("out"), ref))
        at_k = compile_fn(program(w, k), *args)
        at_model = compile_fn(program(w, model_choice.chunk_size), *args)
        fits = {s: c for s, c in fixed.items() if c.temp_plus_output <= budget}
        chosen = lambda: at_k.executable(*args)  # noqa: E731
        modelled_call = lambda: at_model.executable(*args)  # noqa: E731
        largest = choice.largest
        known = {k: at_k, model_choice.chunk_size: at_model}
        at_largest = known.get(largest) or compile_fn(program(w, largest), *args)
        times = {}
        if fits:
            # A shortlist of the fastest fitting fixed sizes (a sweep in order of
            # size), then each timed against the choices in rounds of their own:
            # the fastest is the one the choice is slowest against.
            sweep = {s: c.executable for s, c in fits.items() if s != k} | {
                k: at_k.executable
            }
            pre = _interleaved(
                {str(s): (lambda e=sweep[s]: e(*args)) for s in sorted(sweep)},
                repeats,
            )
            ranked = sorted(pre, key=lambda s: statistics.median(pre[s]))
            shortlist = [int(s) for s in ranked if int(s) != k][:SHORTLIST] or [k]
            rounds = {
                s: _interleaved(
                    {"chosen": chosen, "model": modelled_call}
                    | {f"fixed {s}": lambda e=sweep[s]: e(*args)},
                    repeats,
                )
                for s in shortlist
            }
            best = max(
                shortlist, key=lambda s: _paired(rounds[s], "chosen", f"fixed {s}")
            )
            times = rounds[best]
            row["fastest_fixed"] = best
            row["fastest_fixed_s"] = statistics.median(times[f"fixed {best}"])
        else:
            times = _interleaved({"chosen": chosen, "model": modelled_call}, repeats)
        # The largest fitting size, unless it is the choice (the same program).
        row["vs_largest"] = 1.0
        pairs = (
            {"largest": lambda: at_largest.executable(*args)} if largest != k else {}
        )
        if fraction == 1:
            pairs["vmap"] = lambda: vmap.executable(*args)
        for name, call in pairs.items():
            found = _interleaved({"chosen": chosen, name: call}, repeats)
            row[f"vs_{name}"] = _paired(found, "chosen", name)
        row |= {"chunk_size": k, "choice_bytes": choice.bytes, "tried": choice.tried}
        row |= {"largest": largest, "model": choice.model, "times": choice.times}
        row |= {"element_bytes": choice.element_bytes}
        row.setdefault("vs_vmap", None)
        row |= {
            "bytes": at_k.temp_plus_output,
            "within_budget": at_k.temp_plus_output <= budget,
        }
        row |= {"time_s": statistics.median(times["chosen"]), "max_rel_error": error}
        row["correct"] = error <= 1e-4
        fixed_key = f"fixed {row.get('fastest_fixed')}"
        row["ratio"] = _paired(times, "chosen", fixed_key) if fits else None
        row |= cost
        row |= {
            "model_chunk_size": model_choice.chunk_size,
            "model_kind": model_choice.model,
            "model_bytes": at_model.temp_plus_output,
            "model_within_budget": at_model.temp_plus_output <= budget,
            "model_ratio": _paired(times, "model", fixed_key) if fits else None,
            "model_search_compiles": modelled["search_compiles"],
            "model_search_s": modelled["search_s"],
        }
        rows.append(row)
        log(
            f"({w.key}) {fraction:g}x vmap = {budget / MIB:.2f} MiB: K={k} "
            f"({choice.model}, largest {largest}), {row['bytes'] / MIB:.2f} MiB, "
            f"{row['ratio'] or math.nan:.2f}x the fastest fitting fixed "
            f"K={row.get('fastest_fixed')}, search {cost['search_compiles']} "
            f"compiles {cost['search_s']:.2f} s (stored: {cost['stored_search_s']:.2f}"
            f" s); model K={row['model_chunk_size']}, "
            f"{row['model_ratio'] or math.nan:.2f}x the fastest, search "
            f"{row['model_search_compiles']} compiles {row['model_search_s']:.2f} s"
        )
    return rows


def _ratio(r: Row, key: str) -> str:
    return "n/a" if r[key] is None else f"{r[key]:.2f}x"


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        f"Command: `{meta['command']}` ({meta['date']}; {meta['machine']}; "
        f"{meta['runtime_s']:.0f} s).",
        "",
        "| workload | N | budget (x vmap) | chosen K (how; largest fitting) | "
        "memory / budget | time vs fastest fitting K | time vs largest | time vs "
        "vmap | first call: search s (compiles) | later process: search s | "
        "model alone (`tune=False`): K, time vs fastest, search s (compiles) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| ({r['workload']}) {r['title']} | {r['batch_size']} | "
        head += f"{r['budget'] / MIB:.2f} MiB ({r['fraction']:g}x) | "
        if "error" in r:
            needs = r["error"]
            needs = f"{needs / MIB:.2f} MiB" if isinstance(needs, int) else needs
            lines.append(head + f"none fits: one element needs {needs} | | | | | | | |")
            continue
        fastest = _ratio(r, "ratio")
        fastest += f" (K={r['fastest_fixed']})" if r["ratio"] is not None else ""
        lines.append(
            head + f"{r['chunk_size']} ({r['model']}; {r['largest']}) | "
            f"{r['bytes'] / r['budget']:.2f} | {fastest} | {r['vs_largest']:.2f}x | "
            f"{_ratio(r, 'vs_vmap')} | {r['search_s']:.2f} ({r['search_compiles']}) | "
            f"{r['stored_search_s']:.2f} | {r['model_chunk_size']}, "
            f"{_ratio(r, 'model_ratio')}, {r['model_search_s']:.2f} "
            f"({r['model_search_compiles']}) |"
        )
    return "\n".join(lines) + "\n"


def failures(rows: list[Row]) -> list[str]:
    bad = []
    for r in rows:
        if "error" in r:
            continue
        where = f"({r['workload']}) at {r['fraction']:g}x"
        if not r["within_budget"]:
            bad.append(f"{where}: {r['bytes']} bytes over the budget of {r['budget']}")
        if not r["model_within_budget"]:
            bad.append(f"{where}, model: {r['model_bytes']} bytes over the budget")
        if not r["stored_same"]:
            bad.append(f"{where}: a later process chose another size")
        if not r["correct"]:
            bad.append(f"{where}: result differs from jax.vmap's")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast CI mode")
    parser.add_argument("--out", type=Path, help="folder for the table and JSON")
    parser.add_argument("--only", help="comma-separated workload keys, e.g. a,c")
    opts = parser.parse_args()
    start = time.perf_counter()

    def log(*parts: Any) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s]", *parts, flush=True)

    counter = CompileCounter()
    if opts.quick:  # a check that it runs: time each search's sizes briefly
        timing_module.FLOOR_SECONDS = 0.5
    # Timed choices are stored here, never in the user's cache.
    os.environ[store_module.ENVIRONMENT] = tempfile.mkdtemp(prefix="fc_choices_")
    only = set(opts.only.split(",")) if opts.only else None
    rows = []
    for w in budget_workloads(opts.quick):
        if only is None or w.key in only:
            rows += measure_workload(w, opts.quick, counter, log)
    command = "python benchmarks/budget.py" + (" --quick" if opts.quick else "")
    command += f" --only {opts.only}" if opts.only else ""
    device = jax.devices()[0]
    meta = {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"JAX {jax.__version__} on {device.platform} ({device.device_kind})",
        "runtime_s": time.perf_counter() - start,
    }
    out = opts.out or (
        Path(tempfile.mkdtemp(prefix="fc_budget_")) if opts.quick or only else RESULTS
    )
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, meta)
    (out / "budget.md").write_text(table)
    (out / "budget.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n"
    )
    print(table)
    log(f"Table and JSON written to {out}")
    for name, key in (("default", "ratio"), ("model alone", "model_ratio")):
        ratios = [r[key] for r in rows if r.get(key) is not None]
        log(
            f"{name}: time at the chosen size / fastest fitting fixed size: worst "
            f"{max(ratios, default=math.nan):.2f}x, median "
            f"{statistics.median(ratios) if ratios else math.nan:.2f}x; "
            f"{sum(t > TARGET for t in ratios)} of {len(ratios)} over {TARGET}x."
        )
    over_vmap = [r for r in rows if (r.get("vs_vmap") or 0) > 1]
    log(f"{len(over_vmap)} slower than jax.vmap at 1x.")
    costs = [(r["search_s"], r["model_search_s"]) for r in rows if "search_s" in r]
    if costs:
        log(
            "search seconds, first call: default "
            f"{min(c[0] for c in costs):.2f}-{max(c[0] for c in costs):.2f}, model "
            f"{min(c[1] for c in costs):.2f}-{max(c[1] for c in costs):.2f}"
        )
    bad = failures(rows)
    for line in bad:
        log("WRONG:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
