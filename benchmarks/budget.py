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
  size (powers of two and the workload's chunk sizes) that also fits, timed
  interleaved (target: within 1.10x);
- time against the largest size that fits (what a budget chose before the speed
  model of `filtered_chunk/_budget/_model.py`) and, at 1x, against `jax.vmap`
  itself, timed in the same rounds;
- search cost: the first call of the jitted program with an empty cache (the
  search, the program's compilation and the run), and a repeat with a fresh
  `jax.jit` (the search is cached: only the outer program compiles); the search's
  compilations and compile time are the difference;
- the same for `fc.MemoryBudget(budget, tune=True)`, which times a few sizes that
  fit: its size, its time against the fastest fitting fixed size (in the same
  rounds), and its search's compilations and seconds (timing included).

For the gradient workload (d) the program is `jax.grad` of the summed map, so the
budget applies to the differentiated chunked call. Two more workloads check the
budget under other transformations: (f) `jax.grad` of a non-linear loss of the
MLP's outputs (its cotangent depends on the outputs, so XLA cannot fold it as it
could a sum's), and (g) `jax.jvp` of the pairwise kernel w.r.t. the queries, a
tangent given as an argument (forward mode: primal and tangent outputs). And two
whose shape the others lack: (h) softmax attention of each query over a long
sequence, and (i) a per-sample Monte Carlo estimate, a reduction over fixed draws
inside the mapped function.
"""

import argparse
import dataclasses
import datetime
import json
import math
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
import filtered_chunk._budget._search as search_module


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1)
TARGET = 1.10
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
    """The workloads of `_workloads.py`, and (f) and (g) built on (b) and (a)."""
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
    return [*base, loss, jvp, _attention(quick), _monte_carlo(quick)]


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


def _clear_cache() -> None:
    search_module._measured.clear()
    search_module._chosen.clear()


def _fixed_sizes(w: Any, quick: bool) -> list[int]:
    n = w.sizes.batch_size
    powers = [
        2**i for i in range(3 if quick else 2, int(math.log2(n)) + 1, 1 + 2 * quick)
    ]
    return sorted({k for k in (*powers, *w.sizes.chunk_sizes, n) if k <= n})


def _interleaved(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median times of `calls`, timed in rounds (order rotating), after a warm-up."""
    keys, times = list(calls), {key: [] for key in calls}
    for r in range(repeats + 1):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        for key in order:
            start = time.perf_counter()
            jax.block_until_ready(calls[key]())
            if r:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def _max_rel_error(out: Any, ref: Any) -> float:
    worst = 0.0
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
        scale = max(float(np.max(np.abs(r), initial=0.0)), 1e-30)
        worst = max(worst, float(np.max(np.abs(o - r), initial=0.0)) / scale)
    return worst


def _search_cost(
    w: Any, budget: int, args: tuple[Any, ...], counter: Any, tune: bool = False
) -> Row:
    """Seconds and compilations of the first call of the jitted program (the
    search, the program's compilation, the run) with an empty cache, and of a
    repeat with a fresh `jax.jit` (the search is cached: nothing but the program
    compiles). The search's share is the difference."""
    _clear_cache()
    row: Row = {}
    for name in ("first", "repeat"):
        before = counter.snapshot()
        start = time.perf_counter()
        out = jax.jit(program(w, fc.MemoryBudget(budget, tune=tune)))(*args)
        jax.block_until_ready(out)
        after = counter.snapshot()
        row[f"{name}_call_s"] = time.perf_counter() - start
        row[f"{name}_call_compiles"] = after[1] - before[1]
        row[f"{name}_compile_s"] = after[2] - before[2]
    row["search_compiles"] = row["first_call_compiles"] - row["repeat_call_compiles"]
    # Compile times vary run to run: the difference can dip below zero.
    row["search_compile_s"] = max(row["first_compile_s"] - row["repeat_compile_s"], 0)
    (row["choice"],) = search_module._chosen.values()
    row["out"] = out
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
            cost = _search_cost(w, budget, args, counter)
        except ValueError as e:
            needs = re.search(r"needs (\d+) bytes", str(e))
            row["error"] = int(needs.group(1)) if needs else str(e)
            log(f"({w.key}) {fraction:g}x: no chunk size fits")
            rows.append(row)
            continue
        choice = cost.pop("choice")
        k = choice.chunk_size
        error = _max_rel_error(cost.pop("out"), ref)
        # `MemoryBudget(budget, tune=True)`: its search (with the timing) and size.
        tuned = _search_cost(w, budget, args, counter, tune=True)
        tuned_choice = tuned.pop("choice")
        error = max(error, _max_rel_error(tuned.pop("out"), ref))
        at_k = compile_fn(program(w, k), *args)
        at_tuned = compile_fn(program(w, tuned_choice.chunk_size), *args)
        fits = {s: c for s, c in fixed.items() if c.temp_plus_output <= budget}
        calls = {"chosen": lambda: at_k.executable(*args)}
        calls["tuned"] = lambda: at_tuned.executable(*args)
        largest = choice.largest
        if largest != k:  # what a budget chose before the speed model
            at_largest = compile_fn(program(w, largest), *args).executable
            calls["largest"] = lambda: at_largest(*args)
        if fraction == 1:
            calls["vmap"] = lambda: vmap.executable(*args)
        times = {}
        if fits:
            # The fastest fitting fixed size, then timed against the choice.
            sweep = {s: c.executable for s, c in fits.items() if s != k} | {
                k: at_k.executable
            }
            pre = _interleaved(
                {str(s): (lambda e=e: e(*args)) for s, e in sweep.items()},
                max(repeats // 2, 2),
            )
            best = int(min(pre, key=lambda s: pre[s]))
            calls[f"fixed {best}"] = lambda e=sweep[best]: e(*args)
            times = _interleaved(calls, repeats)
            row["fastest_fixed"] = best
            row["fastest_fixed_s"] = times[f"fixed {best}"]
        else:
            times = _interleaved(calls, repeats)
        row |= {"chunk_size": k, "choice_bytes": choice.bytes, "tried": choice.tried}
        row |= {"largest": largest, "model": choice.model}
        row |= {"element_bytes": choice.element_bytes}
        row["vs_largest"] = times["chosen"] / times.get("largest", times["chosen"])
        row["vs_vmap"] = times["chosen"] / times["vmap"] if "vmap" in times else None
        row |= {
            "bytes": at_k.temp_plus_output,
            "within_budget": at_k.temp_plus_output <= budget,
        }
        row |= {"time_s": times["chosen"], "max_rel_error": error}
        row["correct"] = error <= 1e-4
        row["ratio"] = times["chosen"] / row["fastest_fixed_s"] if fits else None
        row |= cost
        row |= {
            "tuned_chunk_size": tuned_choice.chunk_size,
            "tuned_times": tuned_choice.times,
            "tuned_bytes": at_tuned.temp_plus_output,
            "tuned_within_budget": at_tuned.temp_plus_output <= budget,
            "tuned_ratio": times["tuned"] / row["fastest_fixed_s"] if fits else None,
            "tuned_search_compiles": tuned["search_compiles"],
            # The search's share of the first call: compiling and timing.
            "tuned_search_s": max(tuned["first_call_s"] - tuned["repeat_call_s"], 0),
        }
        rows.append(row)
        log(
            f"({w.key}) {fraction:g}x vmap = {budget / MIB:.2f} MiB: K={k} "
            f"(largest {largest}, {row['vs_largest']:.2f}x its time), "
            f"{row['bytes'] / MIB:.2f} MiB, {row['ratio'] or math.nan:.2f}x the "
            f"fastest fitting fixed K={row.get('fastest_fixed')}, search "
            f"{cost['search_compiles']} compiles {cost['search_compile_s']:.2f} s; "
            f"tuned K={row['tuned_chunk_size']}, "
            f"{row['tuned_ratio'] or math.nan:.2f}x the fastest, search "
            f"{row['tuned_search_compiles']} compiles {row['tuned_search_s']:.2f} s"
        )
    return rows


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        f"Command: `{meta['command']}` ({meta['date']}; {meta['machine']}; "
        f"{meta['runtime_s']:.0f} s).",
        "",
        "| workload | N | budget (x vmap) | chosen K (largest fitting) | memory / "
        "budget | time vs fastest fitting K | time vs largest | time vs vmap | "
        "search: compiles, s | first call s (compiles) | repeat s (compiles) | "
        "tune=True: K, time vs fastest, search compiles, s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| ({r['workload']}) {r['title']} | {r['batch_size']} | "
        head += f"{r['budget'] / MIB:.2f} MiB ({r['fraction']:g}x) | "
        if "error" in r:
            needs = r["error"]
            needs = f"{needs / MIB:.2f} MiB" if isinstance(needs, int) else needs
            lines.append(
                head + f"none fits: one element needs {needs} | | | | | | | | |"
            )
            continue
        ratio = (
            "n/a"
            if r["ratio"] is None
            else f"{r['ratio']:.2f}x (K={r['fastest_fixed']})"
        )
        lines.append(
            head + f"{r['chunk_size']} ({r['largest']}) | "
            f"{r['bytes'] / r['budget']:.2f} | {ratio} | {r['vs_largest']:.2f}x | "
            + ("n/a" if r["vs_vmap"] is None else f"{r['vs_vmap']:.2f}x")
            + " | "
            f"{r['search_compiles']}, {r['search_compile_s']:.2f} | "
            f"{r['first_call_s']:.2f} ({r['first_call_compiles']}) | "
            f"{r['repeat_call_s']:.2f} ({r['repeat_call_compiles']}) | "
            f"{r['tuned_chunk_size']}, "
            + ("n/a" if r["tuned_ratio"] is None else f"{r['tuned_ratio']:.2f}x")
            + f", {r['tuned_search_compiles']}, {r['tuned_search_s']:.2f} |"
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
        if not r["tuned_within_budget"]:
            bad.append(f"{where}, tuned: {r['tuned_bytes']} bytes over the budget")
        if not r["correct"]:
            bad.append(f"{where}: result differs from jax.vmap's")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast CI mode")
    parser.add_argument("--out", type=Path, help="folder for the table and JSON")
    parser.add_argument("--only", help="comma-separated workload keys, e.g. a,c")
    opts = parser.parse_args()
    start = time.perf_counter()

    def log(*parts: Any) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s]", *parts, flush=True)

    counter = CompileCounter()
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
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
    missed = [r for r in rows if r.get("ratio") is not None and r["ratio"] > TARGET]
    over_vmap = [r for r in rows if (r.get("vs_vmap") or 0) > 1]
    log(
        f"Time at the chosen size / fastest fitting fixed size: worst "
        f"{max(ratios, default=math.nan):.2f}x, median "
        f"{statistics.median(ratios) if ratios else math.nan:.2f}x; "
        f"{len(missed)} of {len(ratios)} over the {TARGET}x target; "
        f"{len(over_vmap)} slower than jax.vmap at 1x."
    )
    tuned = [r["tuned_ratio"] for r in rows if r.get("tuned_ratio") is not None]
    log(
        f"With tune=True: worst {max(tuned, default=math.nan):.2f}x, median "
        f"{statistics.median(tuned) if tuned else math.nan:.2f}x; "
        f"{sum(t > TARGET for t in tuned)} of {len(tuned)} over the {TARGET}x target."
    )
    bad = failures(rows)
    for line in bad:
        log("WRONG:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
