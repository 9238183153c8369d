"""Chunking a sharded batch: per-device memory, time and collectives, on 8 devices.

    python benchmarks/sharding.py            # full run: writes docs/sharding_table.md
    python benchmarks/sharding.py --quick    # CI: small sizes, fails if a check fails

Runs on 8 simulated CPU devices (`--xla_force_host_platform_device_count=8`). Each
workload maps an MLP over a batch split over the mesh axis `"batch"`, with the
parameters replicated, and compares `filter_chunked_vmap` (chunk size per device)
with `jax.lax.map(batch_size=)` and `jax.vmap` on the same sharded batch:

- per-device temporaries from XLA's `memory_analysis()` of the SPMD program;
- the median steady-state time (8 devices share this machine's cores, so read
  time ratios, not absolute times);
- the number of collectives (all-gather, all-reduce, all-to-all, reduce-scatter,
  collective-permute) in the compiled program: a gradient's reduction over the
  replicated parameters is one per parameter, and expected.
"""

import argparse
import os
import re
import sys
from pathlib import Path


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from _measure import compile_fn, median_seconds, MIB  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import filtered_chunk as fc  # noqa: E402


ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "sharding_table.md"
COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)"
    r"(-start)?\("
)


def count_collectives(compiled) -> int:
    return len(COLLECTIVE.findall(compiled.executable.as_text()))


def mlp(params, x):
    w1, w2 = params
    return jnp.tanh(x @ w1) @ w2


def make_inputs(mesh, batch, hidden):
    key1, key2, key3 = jr.split(jr.key(0), 3)
    params = (
        jr.normal(key1, (64, hidden), jnp.float32) / 8,
        jr.normal(key2, (hidden, 16), jnp.float32) / 32,
    )
    x = jr.normal(key3, (batch, 64), jnp.float32)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    return params, jax.device_put(x, NamedSharding(mesh, P("batch")))


def forward_methods(chunk_size):
    chunked = fc.filter_chunked_vmap(
        mlp, in_axes=(None, 0), chunk_size=chunk_size, spmd_axis_name="batch"
    )
    return {
        "filter_chunked_vmap": chunked,
        "lax.map(batch_size=)": lambda p, x: jax.lax.map(
            lambda xi: mlp(p, xi), x, batch_size=chunk_size
        ),
        "jax.vmap": jax.vmap(mlp, in_axes=(None, 0)),
    }


def gradient_methods(chunk_size):
    return {
        name: jax.grad(lambda p, x, fn=fn: jnp.sum(fn(p, x)))
        for name, fn in forward_methods(chunk_size).items()
    }


def measure(mesh, name, fn, params, x, repeats):
    with jax.set_mesh(mesh):
        compiled = compile_fn(fn, params, x)
        seconds = median_seconds(compiled.executable, params, x, repeats=repeats)
        out = compiled.executable(params, x)
    return {
        "method": name,
        "temp_mib": compiled.temp_bytes / MIB,
        "output_mib": compiled.output_bytes / MIB,
        "seconds": seconds,
        "collectives": count_collectives(compiled),
        "out": out,
    }


def explicit_lax_map_refuses(batch, hidden, chunk_size):
    """`lax.map(batch_size=)` on a batch split in explicit-sharding mode."""
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Explicit,))
    params, x = make_inputs(mesh, batch, hidden)
    fn = forward_methods(chunk_size)["lax.map(batch_size=)"]
    try:
        with jax.set_mesh(mesh):
            jax.jit(fn).lower(params, x)
    except Exception as e:  # the error class is JAX's business
        return f"refuses ({type(e).__name__})"
    return "runs"


def run_workload(title, methods, batch, hidden, repeats):
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
    params, x = make_inputs(mesh, batch, hidden)
    rows = [measure(mesh, name, fn, params, x, repeats) for name, fn in methods]
    reference = rows[-1]["out"]  # jax.vmap
    for row in rows:
        same = jax.tree.map(
            lambda a, b: np.allclose(a, b, rtol=1e-4, atol=1e-4),
            jax.device_get(row["out"]),
            jax.device_get(reference),
        )
        row["correct"] = all(jax.tree.leaves(same))
        row["title"] = title
    return rows


def checks(rows):
    """What CI insists on: right values, and no collective on the forward batch."""
    problems = [
        f"{r['title']}: {r['method']} is wrong" for r in rows if not r["correct"]
    ]
    for r in rows:
        if r["method"] != "filter_chunked_vmap":
            continue
        allowed = 0 if r["title"].startswith("forward") else 2  # one per parameter
        if r["collectives"] > allowed:
            problems.append(
                f"{r['title']}: filter_chunked_vmap has {r['collectives']} "
                f"collectives, expected at most {allowed}"
            )
    return problems


def table(rows, chunk_size, refusal, command):
    lines = [
        f"Measured with `{command}` on 8 simulated CPU devices (jax "
        f"{jax.__version__}), chunk size {chunk_size} per device. Memory is per "
        "device; the time ratio is `filter_chunked_vmap`'s time over the method's.",
        "",
        "| workload | method | temporaries / device (MiB) | output / device (MiB) "
        "| time (ms) | time ratio | collectives |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ours = _ours(rows, r)
        lines.append(
            f"| {r['title']} | `{r['method']}` | {r['temp_mib']:.1f} | "
            f"{r['output_mib']:.2f} | {r['seconds'] * 1e3:.0f} | "
            f"{ours['seconds'] / r['seconds']:.2f} | {r['collectives']} |"
        )
    lines += [
        "",
        f"In explicit-sharding mode `jax.lax.map(batch_size=)` {refusal}; "
        "`filter_chunked_vmap` finds the batch's mesh axis by itself there.",
    ]
    return "\n".join(lines) + "\n"


def _ours(rows, row):
    """`filter_chunked_vmap`'s row for the same workload as `row`."""
    return next(
        r
        for r in rows
        if r["title"] == row["title"] and r["method"] == "filter_chunked_vmap"
    )


def ratios(rows):
    for r in rows:
        ours = _ours(rows, r)
        if r is not ours:
            temp = ours["temp_mib"] / max(r["temp_mib"], 1e-9)
            time = ours["seconds"] / r["seconds"]
            print(f"{r['title']}, vs {r['method']}: temporaries x{temp:.3f}, ", end="")
            print(f"time x{time:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    args = parser.parse_args()
    if args.quick:
        batch, hidden, chunk_size, repeats = 8 * 256, 512, 32, 3
    else:
        batch, hidden, chunk_size, repeats = 8 * 4096, 4096, 256, 7
    forward = list(forward_methods(chunk_size).items())
    reverse = list(gradient_methods(chunk_size).items())
    rows = run_workload(
        f"forward, MLP 64-{hidden}-16, batch {batch}", forward, batch, hidden, repeats
    )
    rows += run_workload(
        f"gradient, MLP 64-{hidden}-16, batch {batch}", reverse, batch, hidden, repeats
    )
    refusal = explicit_lax_map_refuses(batch, hidden, chunk_size)
    command = "python benchmarks/sharding.py" + (" --quick" if args.quick else "")
    text = table(rows, chunk_size, refusal, command)
    print(text)
    ratios(rows)
    if not args.quick:
        TABLE.write_text(text)
        print(f"wrote {TABLE.relative_to(ROOT)}")
    problems = checks(rows)
    for p in problems:
        print("FAILED:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
