"""Benchmarks what a memory budget costs a training script at each start: the first
process on a machine, and a later one that finds the choice stored.

    python benchmarks/first_call.py           # full: benchmarks/results/first_call.md
    python benchmarks/first_call.py --quick   # CI: two small programs, checks

Each program is the user's own step, `jax.jit(...).lower(...).compile()`, in a
fresh Python process; the budget chooses while the step is traced. Three
processes a program, one after another, sharing a store folder of their own
(`FILTERED_CHUNK_CACHE_DIR`): the first finds it empty and searches (and, on CPU,
times); the second and third find the choice stored. Reported: the seconds of
the whole lower-and-compile (the step's own compilation included), the budget's
own `ChunkSizeChoice.compilations` and `.seconds`, and the chunk size, which must
be the same in every process (the script exits non-zero otherwise, or where a
later process searched or compiled anything to check the stored choice). Then,
as a reference, the same step with the chosen size fixed (and the stage
boundaries the budget kept), in as many fresh processes as later ones.

The programs (XLA's default flags):

- DP-SGD: the clipped per-example gradient sum of `dp_sgd.py` (its MLP, with
  `sum_match=True`), `MemoryBudget("64MiB")`, N = 20,000;
- a BatchNorm training step: `jax.grad` of the loss of `collectives.py`'s
  BatchNorm MLP (two blocks of 128, `axis_name`), `MemoryBudget("8MiB")`,
  N = 8,192;
- the same network with eight blocks under `jax.grad`, at a quarter of the
  memory of `jax.vmap`'s gradient.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from _measure import compile_fn, MIB
from _runner import cpu_model

import filtered_chunk as fc


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PROGRAMS = ("dp_sgd", "batchnorm_step", "batchnorm_8_blocks")
PROCESSES = 3


def _dp_sgd(quick: bool, fixed: int | None) -> tuple[Any, tuple[Any, ...], str]:
    import dp_sgd

    args = dp_sgd._args(2000 if quick else 20000)
    budget = "4MiB" if quick else "64MiB"
    spec = fc.MemoryBudget(budget) if fixed is None else fixed
    return jax.jit(dp_sgd._sum_match(spec)), args, budget  # pyright: ignore[reportArgumentType]


def _batchnorm(
    depth: int, quick: bool, fixed: int | None, keep: bool | int | None
) -> tuple[Any, tuple[Any, ...], str]:
    import collectives

    params, static, x, _, _ = collectives._network("mlp", depth, quick)
    axes: dict[str, Any] = dict(in_axes=(0, None), out_axes=(0, None), axis_name="i")

    def step(chunk_size: Any, keep_boundaries: bool | int | None = None) -> Any:
        def loss(_params: Any, _x: jax.Array) -> jax.Array:
            model, state = eqx.combine(_params, static)
            if chunk_size is None:
                out = eqx.filter_vmap(model, **axes)(_x, state)
            else:
                out = fc.filter_chunked_vmap(
                    model,
                    chunk_size=chunk_size,
                    keep_boundaries=keep_boundaries,
                    **axes,
                )(_x, state)
            return jnp.sum(out[0] ** 2)

        return jax.jit(jax.grad(loss))

    if fixed is not None:
        return step(fixed, keep), (params, x), ""
    if depth == 2:
        budget = "1MiB" if quick else "8MiB"
        size = budget
    else:
        whole = compile_fn(step(None), params, x, count="budget").temp_plus_output
        size = whole // 4
        budget = f"{size / MIB:.1f} MiB (a quarter of `jax.vmap`'s)"
    return step(fc.MemoryBudget(size)), (params, x), budget


def child(name: str, fixed: int | None, keep: bool | int | None) -> dict[str, Any]:
    """One process: the program's budget chosen while its step compiles; or
    (`fixed`) the step at that chunk size, keeping the stage boundaries the
    budget kept (`keep`), without a budget."""
    quick = os.environ.get("FIRST_CALL_QUICK") == "1"
    if name == "dp_sgd":
        step, args, budget = _dp_sgd(quick, fixed)
    else:
        depth = 2 if name == "batchnorm_step" else 8
        step, args, budget = _batchnorm(depth, quick, fixed, keep)
    start = time.perf_counter()
    step.lower(*args).compile()
    seconds = time.perf_counter() - start
    if fixed is not None:
        return dict(seconds=seconds)
    (choice,) = fc.suggest_chunk_sizes(step, *args)  # cached: compiles nothing
    return dict(
        budget=budget,
        seconds=seconds,
        chunk_size=choice.chunk_size,
        stored=choice.stored,
        compilations=choice.compilations,
        choice_seconds=choice.seconds,
        model=choice.model,
        keep_boundaries=choice.keep_boundaries,
    )


def measure(name: str, quick: bool) -> list[dict[str, Any]]:
    """`PROCESSES` processes with the budget, then as many with its choice fixed
    (each `fixed` in the first's record, which the table compares with)."""
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, FILTERED_CHUNK_CACHE_DIR=folder)
        env["FIRST_CALL_QUICK"] = "1" if quick else "0"

        def _process(*extra: str) -> dict[str, Any]:
            out = subprocess.run(
                [sys.executable, __file__, "--child", name, *extra],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            return json.loads(out.strip().splitlines()[-1])

        runs = [_process() for _ in range(PROCESSES)]
        fixed = ["--fixed", str(runs[0]["chunk_size"])]
        fixed += ["--keep", json.dumps(runs[0]["keep_boundaries"])]
        runs[0]["fixed"] = [_process(*fixed)["seconds"] for _ in runs[1:]]
    return runs


def markdown(results: dict[str, list[dict[str, Any]]], command: str) -> str:
    lines = [
        "# What a memory budget costs each start of a script",
        "",
        f"`{command}` on {cpu_model()}, {os.cpu_count()} cores, jax "
        f"{jax.__version__}, filtered_chunk {fc.__version__}, XLA's default "
        f"flags. Each program in {PROCESSES} fresh "
        "processes, one after another, sharing a store folder: the first "
        "searches, the later ones find the choice stored. Seconds: the step's "
        "`jax.jit(...).lower(...).compile()`, its own compilation included; the "
        "budget's share in brackets (`ChunkSizeChoice.seconds`). Fixed: the same "
        "step with the chosen size given as `chunk_size` (and the stage "
        "boundaries the budget kept as `keep_boundaries`), in as many fresh "
        "processes as later ones; the ratio is the later processes' median "
        "seconds over the fixed ones'.",
        "",
        "| program | budget | chunk size | first process | later processes | "
        "fixed | later / fixed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        first, later = runs[0], runs[1:]

        def cell(run: dict[str, Any]) -> str:
            n = run["compilations"]
            return (
                f"{run['seconds']:.1f} s ({run['choice_seconds']:.1f} s, "
                f"{n} compilation{'' if n == 1 else 's'})"
            )

        fixed = first["fixed"]
        ratio = statistics.median(r["seconds"] for r in later) / statistics.median(
            fixed
        )
        lines.append(
            f"| {name} | {first['budget']} | {first['chunk_size']} "
            f"({first['model']}) | {cell(first)} | "
            + "; ".join(cell(r) for r in later)
            + " | "
            + "; ".join(f"{t:.1f} s" for t in fixed)
            + f" | {ratio:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast CI mode")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--fixed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--keep", type=json.loads, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="folder for the table and JSON")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.fixed, args.keep)))
        return 0
    programs = PROGRAMS[:2] if args.quick else PROGRAMS
    results = {name: measure(name, args.quick) for name in programs}
    failures = []
    for name, runs in results.items():
        print(name, json.dumps(runs))
        first, later = runs[0], runs[1:]
        if first["stored"] or any(not r["stored"] for r in later):
            failures.append(f"{name}: stored {[r['stored'] for r in runs]}")
        if len({r["chunk_size"] for r in runs}) > 1:
            failures.append(f"{name}: chunk sizes {[r['chunk_size'] for r in runs]}")
        if any(r["compilations"] > 0 for r in later):
            # Its program lowered as stored: nothing to compile (`_store.py`).
            failures.append(f"{name}: a later process compiled to check its choice")
    command = "python benchmarks/first_call.py" + (" --quick" if args.quick else "")
    table = markdown(results, command)
    print(table)
    out = args.out or (Path(tempfile.mkdtemp()) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_call.md").write_text(table)
    (out / "first_call.json").write_text(json.dumps(results, indent=1) + "\n")
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
