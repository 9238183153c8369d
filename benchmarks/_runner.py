"""Measuring every peer on one workload configuration, interleaved.

For one (workload, batch size, chunk size) all peers are compiled first, then run
once each for peak RSS and once for the correctness check against `jax.vmap`, then
timed in interleaved rounds (peer order rotating each round), so that a change in
the machine's load hits every peer alike and the ratios stay meaningful.
"""

import math
import platform
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from _measure import (
    compile_fn,
    CompileCounter,
    lower_seconds,
    median_seconds,
    rss_delta_bytes,
)
from _peers import Peer
from _workloads import Workload


def build_program(w: Workload, peer: Peer, k: int) -> Callable[..., Any]:
    """The jittable program `peer` runs for workload `w` at chunk size `k`."""

    def mapped_call(*args: Any) -> Any:
        if peer.filtered and w.filter_form is not None:
            fun, in_axes, args = w.filter_form(args)
        else:
            fun, in_axes = w.element, w.in_axes
        return peer.make(fun, in_axes, w.out_axes, k)(*args)

    if w.objective == "grad":

        def grad_program(params: Any, *rest: Any) -> Any:
            loss = lambda _params: jnp.sum(mapped_call(_params, *rest))
            return jax.grad(loss)(params)

        return grad_program
    return mapped_call


def chunk_temp_bytes(w: Workload, vmap: Peer, k: int) -> int:
    """The temporaries of `jax.vmap` at batch size `k`: one chunk's working set."""
    return compile_fn(build_program(w, vmap, k), *w.make_args(k)).temp_bytes


def _max_rel_error(out: Any, ref: Any) -> float:
    """Largest error over all leaves, relative to the largest reference value."""
    if jtu.tree_structure(out) != jtu.tree_structure(ref):
        return math.inf
    worst = 0.0
    for o, r in zip(jtu.tree_leaves(out), jtu.tree_leaves(ref)):
        o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
        if o.shape != r.shape:
            return math.inf
        scale = max(float(np.max(np.abs(r), initial=0.0)), 1e-30)
        worst = max(worst, float(np.max(np.abs(o - r), initial=0.0)) / scale)
    return worst


# float32 results of chunked and unchunked maps differ by rounding only (matmuls
# of different shapes, sums in a different order); 1e-4 of the largest value.
TOLERANCE = 1e-4


def _compile(program: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    lower_s = lower_seconds(program, *args)
    compiled = compile_fn(lambda *a: program(*a), *args)
    return compiled, lower_s, compiled.compile_seconds


def refine_compile_times(
    w: Workload, peers: list[Peer], configs: list[dict[str, Any]], repeats: int
) -> None:
    """Re-measures trace+lower and compile times, interleaving batch sizes and
    peers, and keeps the fastest of `repeats` (load only ever adds time)."""
    for _ in range(repeats - 1):
        for config in configs:
            args = w.make_args(config["batch_size"])
            for peer in peers:
                row = config["peers"][peer.key]
                if "skipped" in row:
                    continue
                program = build_program(w, peer, config["chunk_size"])
                _, lower_s, compile_s = _compile(program, args)
                row["lower_s"] = min(row["lower_s"], lower_s)
                row["compile_s"] = min(row["compile_s"], compile_s)


def _measure_peer(
    w: Workload, peer: Peer, n: int, k: int, args: tuple[Any, ...], ref: Any
) -> tuple[dict[str, Any], Any]:
    if peer.max_chunks is not None and -(-n // k) > peer.max_chunks:
        return {"skipped": f"more than {peer.max_chunks} chunks"}, None
    program = build_program(w, peer, k)
    compiled, lower_s, compile_s = _compile(program, args)
    executable = compiled.executable
    rss = rss_delta_bytes(executable, *args)
    error = _max_rel_error(executable(*args), ref)
    row = {
        "hlo_instructions": _hlo_instructions(executable),
        "temp_bytes": compiled.temp_bytes,
        "output_bytes": compiled.output_bytes,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "rss_delta_bytes": rss,
        "max_rel_error": error if math.isfinite(error) else None,
        "correct": error <= TOLERANCE,
    }
    return row, executable


def _hlo_instructions(executable: Any) -> int:
    """Instructions in the optimised HLO: compile work, independent of the load."""
    return len(re.findall(r"^\s+(?:ROOT )?%\S+ = ", executable.as_text(), re.M))


def time_interleaved(
    executables: dict[str, Any], args: tuple[Any, ...], warmup: int, repeats: int
) -> dict[str, list[float]]:
    keys = list(executables)
    times: dict[str, list[float]] = {key: [] for key in keys}
    for r in range(warmup + repeats):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            start = time.perf_counter()
            jax.block_until_ready(executables[key](*args))
            if r >= warmup:
                times[key].append(time.perf_counter() - start)
    return times


def _zero_fill_seconds(program: Callable[..., Any], args: tuple[Any, ...]) -> float:
    """The time to write zeros over outputs of `program`'s shapes: what a map that
    preallocates its outputs (a scan carry, or `lax.map`'s stacked results) pays
    on the CPU before the first chunk, and an unchunked `jax.vmap` does not."""
    shapes = jax.eval_shape(program, *args)
    fill = jax.jit(lambda: jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    return median_seconds(fill, warmup=1, repeats=5)


def measure_config(
    w: Workload,
    peers: list[Peer],
    n: int,
    k: int,
    *,
    section: str,
    warmup: int,
    repeats: int,
) -> dict[str, Any]:
    """Every peer's memory, compile time, time and correctness at (`n`, `k`)."""
    args = w.make_args(n)
    vmap = next(p for p in peers if p.key == "vmap")
    result: dict[str, Any] = {"workload": w.key, "section": section}
    result |= {"batch_size": n, "chunk_size": k}
    # The reference result, and the floor: outputs at `n` + temporaries at `k`.
    reference = compile_fn(build_program(w, vmap, k), *args)
    ref = reference.executable(*args)
    temp_k = chunk_temp_bytes(w, vmap, k)
    result |= {"floor_bytes": reference.output_bytes + temp_k}
    result |= {"vmap_chunk_temp_bytes": temp_k}
    # A gradient summed over chunks needs a running sum beside each chunk's own
    # contribution: one extra output-sized buffer that an unchunked map never has.
    result |= {"accumulator_bytes": reference.output_bytes * (w.objective == "grad")}
    rows, executables = {}, {}
    for peer in peers:
        rows[peer.key], executable = _measure_peer(w, peer, n, k, args, ref)
        if executable is not None:
            executables[peer.key] = executable
    del ref
    for key, times in time_interleaved(executables, args, warmup, repeats).items():
        rows[key]["time_s"] = statistics.median(times)
        # Each round's time, in the same order for every peer: paired ratios.
        rows[key]["times_s"] = [round(t, 6) for t in times]
    result["zero_fill_s"] = _zero_fill_seconds(build_program(w, vmap, k), args)
    result["peers"] = rows
    return result


def eager_calls(w: Workload, peer: Peer, k: int, counter: CompileCounter) -> dict:
    """Traces, compilations and wall time of un-jitted calls, first and second."""
    args = w.make_args(w.sizes.batch_size)
    if w.filter_form is not None:
        fun, in_axes, args = w.filter_form(args)
    else:
        fun, in_axes = w.element, w.in_axes
    mapped = peer.make(fun, in_axes, w.out_axes, k)
    if w.objective == "grad":
        params, rest = args[0], args[1:]
        loss = lambda _params: jnp.sum(mapped(_params, *rest))
        call = lambda: eqx.filter_grad(loss)(params)
    else:
        call = lambda: mapped(*args)
    calls = []
    for _ in range(3):
        before = counter.snapshot()
        start = time.perf_counter()
        jax.block_until_ready(call())
        seconds = time.perf_counter() - start
        after = counter.snapshot()
        calls.append(
            {
                "seconds": seconds,
                "traces": after[0] - before[0],
                "compiles": after[1] - before[1],
                "compile_s": after[2] - before[2],
            }
        )
    return {"workload": w.key, "peer": peer.key, "chunk_size": k, "calls": calls}


def jit_repeated_calls(w: Workload, peer: Peer, k: int, counter: CompileCounter):
    """Traces and compilations of a `jax.jit`-ed program's 2nd and 3rd calls."""
    args = w.make_args(w.sizes.batch_size)
    jitted = jax.jit(build_program(w, peer, k))
    jax.block_until_ready(jitted(*args))
    before = counter.snapshot()
    for _ in range(2):
        jax.block_until_ready(jitted(*args))
    after = counter.snapshot()
    return {"traces": after[0] - before[0], "compiles": after[1] - before[1]}


def cpu_model() -> str:
    """The machine's CPU model, for a benchmark's header."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
