"""Benchmarks DP-SGD's sum of clipped per-example gradients: memory and time.

    python benchmarks/dp_sgd.py           # full: benchmarks/results/dp_sgd.{md,json}
    python benchmarks/dp_sgd.py --quick   # CI: small sizes, a temporary folder

The workload: an MLP 32 -> 256 -> 256 -> 1 (tanh, no biases: 73,984 parameters)
with a squared-error loss, on N = 4,096 examples; each example's gradient is
scaled to norm at most C, and the scaled gradients are summed (DP-SGD's clipped
sum; the noise, added to the sum afterwards, is left out). Every implementation
computes that sum, in chunks of K = 256 examples where it chunks:

- `jax.vmap`: every per-example gradient (N x 73,984 floats), clipped, summed;
- `optax.microbatching.micro_grad`: microbatches of K, with `transform_fn`
  clipping each per-example gradient and a `SUM` accumulator;
- two maps, the recipe of the Recipes page: one chunked map computes the
  per-example gradient norms, then `jax.grad` of the loss weighted by the clip
  factors, through a second chunked map;
- psum: one chunked map whose function returns
  `jax.lax.psum(clipped gradient, "i")`, with `out_axes=None` and `axis_name="i"`;
- `sum_match=True`: one chunked map with `out_axes=None` whose batch-varying
  output is summed, as `jax.vmap(..., sum_match=True)` does. Reported as not
  available where this version of the library has no such option.

The parameters, inputs, targets and C are all arguments of the compiled program,
so XLA cannot constant-fold any of them. Memory: the temporaries and outputs of
XLA's `memory_analysis()` (deterministic), beside those of `jax.vmap` at N = K
(one chunk's working set, not timed). Every result is checked against
`jax.vmap`'s before anything is timed (the largest difference at most 1e-4 of
its largest value, as in `run.py`); a mismatch makes the script exit non-zero.
Time: after a warm-up, interleaved rounds (the order rotating each round); the
median time per method, and its ratio to `jax.vmap`, the median over rounds of
the same round's ratio. On a shared machine read the ratios as +-10-30%.

XLA's flags are its defaults, as users run it (the table says what the
environment set). The memory is that of each program compiled with XLA's
YNNPACK fusions off, whose scratch `memory_analysis()` does not count
(`_measure.compile_fn(..., count="fusions off")`); the program timed is the default one.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.lax as lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _measure import compile_fn, MIB  # noqa: E402
from _runner import cpu_model, time_interleaved  # noqa: E402

import filtered_chunk as fc  # noqa: E402


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SIZES = (32, 256, 256, 1)
CLIP = 10.0  # about a third of the per-example norms are below it: the rest clip
TOLERANCE = 1e-4
VMAP = "jax.vmap"
Params = list[jax.Array]
Program = Callable[[Params, jax.Array, jax.Array, jax.Array], Params]
Row = dict[str, Any]


def _normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _args(batch_size: int) -> tuple[Params, jax.Array, jax.Array, jax.Array]:
    """The parameters, inputs, targets and clip norm: the program's arguments."""
    params = [
        _normal(i, (a, b)) / np.sqrt(a)
        for i, (a, b) in enumerate(zip(SIZES, SIZES[1:]))
    ]
    xs = _normal(10, (batch_size, SIZES[0]))
    ys = _normal(11, (batch_size,))
    return params, xs, ys, jnp.asarray(CLIP, jnp.float32)


def _loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    for w in params[:-1]:
        x = jnp.tanh(x @ w)
    return ((x @ params[-1])[0] - y) ** 2


def _norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(tree)))


def _clip(grads: Any, clip: jax.Array) -> Any:
    scale = jnp.minimum(1.0, clip / _norm(grads))
    return [scale * g for g in grads]


def _clipped_grad(
    params: Params, x: jax.Array, y: jax.Array, clip: jax.Array
) -> Params:
    """One example's gradient, scaled to norm at most `clip`."""
    return _clip(jax.grad(_loss)(params, x, y), clip)


def _grad_norm(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    return _norm(jax.grad(_loss)(params, x, y))


def _vmap(chunk_size: int) -> Program:
    del chunk_size
    mapped = jax.vmap(_clipped_grad, in_axes=(None, 0, 0, None))
    return lambda p, xs, ys, c: [jnp.sum(g, axis=0) for g in mapped(p, xs, ys, c)]


def _micro_grad(chunk_size: int) -> Program:
    # Imported here: optax is an optional dependency (the `bench` extra).
    import optax.microbatching as microbatching

    def program(params: Params, xs: jax.Array, ys: jax.Array, clip: jax.Array):
        grad_fn = microbatching.micro_grad(
            _loss,
            argnums=0,
            batch_argnums=(1, 2),
            keep_batch_dim=False,  # `_loss` takes one example, not a batch of one
            microbatch_size=chunk_size,
            accumulator=microbatching.AccumulationType.SUM,
            transform_fn=lambda g: _clip(g, clip),
        )
        return grad_fn(params, xs, ys)[0]

    return program


def _two_maps(chunk_size: int) -> Program:
    """The recipe: per-example norms, then the gradient of a weighted loss."""
    norms = fc.filter_chunked_vmap(
        _grad_norm, in_axes=(None, 0, 0), chunk_size=chunk_size
    )
    losses = fc.filter_chunked_vmap(_loss, in_axes=(None, 0, 0), chunk_size=chunk_size)

    def program(params: Params, xs: jax.Array, ys: jax.Array, clip: jax.Array):
        scale = lax.stop_gradient(jnp.minimum(1.0, clip / norms(params, xs, ys)))
        return jax.grad(lambda _p: jnp.sum(scale * losses(_p, xs, ys)))(params)

    return program


def _psum(chunk_size: int) -> Program:
    return fc.filter_chunked_vmap(
        lambda *args: lax.psum(_clipped_grad(*args), "i"),
        in_axes=(None, 0, 0, None),
        out_axes=None,
        axis_name="i",
        chunk_size=chunk_size,
    )


def _sum_match(chunk_size: int) -> Program:
    # Passed through a dict: the option is new, and type checkers of older
    # versions of the library would reject the keyword.
    options: dict[str, Any] = {"sum_match": True}
    return fc.filter_chunked_vmap(
        _clipped_grad,
        in_axes=(None, 0, 0, None),
        out_axes=None,
        chunk_size=chunk_size,
        **options,
    )


METHODS: dict[str, Callable[[int], Program]] = {
    VMAP: _vmap,
    "optax.microbatching.micro_grad": _micro_grad,
    "two maps (norms, then a weighted loss gradient)": _two_maps,
    'filter_chunked_vmap + lax.psum(..., "i"), out_axes=None': _psum,
    "filter_chunked_vmap(..., out_axes=None, sum_match=True)": _sum_match,
}


def _unavailable(name: str, error: Exception) -> str | None:
    """Why `name` cannot run here, or `None` if `error` is a real failure."""
    if isinstance(error, ModuleNotFoundError) and error.name in (
        "optax",
        "optax.microbatching",
    ):
        return "needs optax 0.2.7 or later (`pip install -e '.[bench]'`)"
    if name.endswith("sum_match=True)") and isinstance(error, TypeError):
        if "sum_match" in str(error):
            return f"not available in this version: `TypeError: {error}`"
    return None


def _max_rel_error(out: Any, ref: Any) -> float:
    """Largest difference over all leaves, relative to the largest reference value."""
    if jax.tree.structure(out) != jax.tree.structure(ref):
        return float("inf")
    worst = 0.0
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
        if o.shape != r.shape:
            return float("inf")
        scale = max(float(np.max(np.abs(r))), 1e-30)
        worst = max(worst, float(np.max(np.abs(o - r))) / scale)
    return worst


def _compile(name: str, chunk_size: int, args: tuple[Any, ...]) -> tuple[Row, Any]:
    """`name`'s memory row and executable, or a row saying why it is missing."""
    try:
        compiled = compile_fn(METHODS[name](chunk_size), *args, count="fusions off")
    except (ModuleNotFoundError, TypeError) as error:
        reason = _unavailable(name, error)
        if reason is None:
            raise
        return {"method": name, "unavailable": reason}, None
    row = {
        "method": name,
        "temp_bytes": compiled.temp_bytes,
        "output_bytes": compiled.output_bytes,
        "compile_s": compiled.compile_seconds,
    }
    return row, compiled.executable


def measure(
    batch_size: int, chunk_size: int, warmup: int, repeats: int
) -> dict[str, Any]:
    """Every method's memory, correctness and interleaved time."""
    args = _args(batch_size)
    rows, executables = [], {}
    for name in METHODS:
        row, executables[name] = _compile(name, chunk_size, args)
        rows.append(row)
        print(f"compiled {name}: {row.get('unavailable', 'ok')}", flush=True)
    executables = {k: e for k, e in executables.items() if e is not None}
    reference = executables[VMAP](*args)
    for row in rows:
        if row["method"] in executables:
            error = _max_rel_error(executables[row["method"]](*args), reference)
            row |= {"max_rel_error": error, "correct": error <= TOLERANCE}
    norms = jax.jit(jax.vmap(_grad_norm, in_axes=(None, 0, 0)))(*args[:3])
    clipped = float(jnp.mean(norms > CLIP))
    times = time_interleaved(executables, args, warmup, repeats)
    for row in rows:
        if row["method"] in times:
            own, base = times[row["method"]], times[VMAP]
            row["time_s"] = statistics.median(own)
            row["times_s"] = [round(t, 6) for t in own]
            row["time_vs_vmap"] = statistics.median(a / b for a, b in zip(own, base))
    one_chunk = compile_fn(_vmap(chunk_size), *_args(chunk_size), count="fusions off")
    return {
        "rows": rows,
        "one_chunk_temp_bytes": one_chunk.temp_bytes,
        "one_chunk_output_bytes": one_chunk.output_bytes,
        "clipped_fraction": clipped,
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _meta(command: str, batch_size: int, chunk_size: int) -> dict[str, Any]:
    device = jax.devices()[0]
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores; JAX backend "
        f"{device.platform}",
        "versions": f"jax {jax.__version__}, equinox {eqx.__version__}, "
        f"optax {_version('optax')}, python {platform.python_version()}",
        "batch_size": batch_size,
        "chunk_size": chunk_size,
        "parameters": sum(a * b for a, b in zip(SIZES, SIZES[1:])),
        "clip": CLIP,
        "xla_flags": os.environ.get("XLA_FLAGS", "").strip(),
        "load_before": round(os.getloadavg()[0], 2),
    }


def _cells(row: Row, vmap_bytes: int) -> str:
    if "unavailable" in row:
        return f"| `{row['method']}` | {row['unavailable']} | | | | | |"
    memory = row["temp_bytes"] + row["output_bytes"]
    return (
        f"| `{row['method']}` | {row['temp_bytes'] / MIB:,.2f} "
        f"| {row['output_bytes'] / MIB:.2f} | {memory / vmap_bytes:.3f}x "
        f"| {row['time_s'] * 1e3:,.1f} | {row['time_vs_vmap']:.2f}x "
        f"| {row['max_rel_error']:.1e} |"
    )


def markdown(results: dict[str, Any]) -> str:
    meta, rows = results["meta"], results["rows"]
    vmap = next(r for r in rows if r["method"] == VMAP)
    vmap_bytes = vmap["temp_bytes"] + vmap["output_bytes"]
    lines = [
        f"Command: `{meta['command']}` ({meta['date']}; {meta['machine']}; "
        f"{meta['versions']}; {meta['runtime_s']:.0f} s; load average "
        f"{meta['load_before']} before, {meta['load_after']} after).",
        "",
        f"N = {meta['batch_size']:,} examples, K = {meta['chunk_size']}, "
        f"{meta['parameters']:,} parameters, C = {meta['clip']:g} "
        f"({results['clipped_fraction']:.0%} of the gradients clipped); "
        f"{meta['repeats']} interleaved rounds after {meta['warmup']} of warm-up; "
        f"`XLA_FLAGS={meta['xla_flags']}`.",
        "",
        "| method | temporaries (MiB) | outputs (MiB) | memory vs `jax.vmap` "
        "| median (ms) | time vs `jax.vmap` | max rel. error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_cells(r, vmap_bytes) for r in rows]
    chunk = results["one_chunk_temp_bytes"] + results["one_chunk_output_bytes"]
    lines.append(
        f"| one chunk: `jax.vmap` at N = K (not timed) "
        f"| {results['one_chunk_temp_bytes'] / MIB:,.2f} "
        f"| {results['one_chunk_output_bytes'] / MIB:.2f} "
        f"| {chunk / vmap_bytes:.3f}x | | | |"
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--out", type=Path, help="folder for the table and JSON")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 15)")
    options = parser.parse_args()
    start = time.perf_counter()
    n, k, warmup, repeats = (512, 128, 1, 3) if options.quick else (4096, 256, 2, 15)
    repeats = options.repeats or repeats
    command = "python benchmarks/dp_sgd.py" + (" --quick" if options.quick else "")
    command += f" --repeats {options.repeats}" if options.repeats else ""
    meta = _meta(command, n, k) | {"warmup": warmup, "repeats": repeats}
    results: dict[str, Any] = {"meta": meta} | measure(n, k, warmup, repeats)
    meta |= {
        "runtime_s": time.perf_counter() - start,
        "load_after": round(os.getloadavg()[0], 2),
    }
    default = options.quick or options.repeats
    out = options.out or (
        Path(tempfile.mkdtemp(prefix="fc_dp_sgd_")) if default else RESULTS
    )
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    (out / "dp_sgd.md").write_text(table)
    (out / "dp_sgd.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table)
    print(f"Table and JSON written to {out}", file=sys.stderr)
    wrong = [r["method"] for r in results["rows"] if r.get("correct") is False]
    for name in wrong:
        print(f"WRONG: {name} differs from jax.vmap's result", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
