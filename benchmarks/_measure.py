"""Measurement primitives shared by every benchmark script.

Memory comes from XLA's compiled `memory_analysis()` (deterministic); time is the
median of several steady-state runs after a warm-up; compile time is the wall time
of `lower(...).compile()`. Peak RSS is the process high-water mark, so it is only
meaningful for the first, largest workload of a process.
"""

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from filtered_chunk._fusions import uncounted


MIB = 2**20


@dataclass(frozen=True)
class Compiled:
    """What XLA says a jitted function needs, and how long compiling it took."""

    temp_bytes: int
    output_bytes: int
    argument_bytes: int
    compile_seconds: float
    executable: Any

    @property
    def temp_plus_output(self) -> int:
        return self.temp_bytes + self.output_bytes


# XLA's CPU backend runs some fusions through YNNPACK (on by default), which keep
# buffers `memory_analysis()` does not count: `jax.vmap` of a whole MLP can show no
# temporaries at all. `compile_fn` reads, by `count`:
# - `"own"`: XLA's count of the program that runs;
# - `"budget"`: every buffer, as a memory budget counts them (`Lowered.full` in
#   `filtered_chunk/_budget/_program.py`): plus what the fusions keep
#   (`filtered_chunk/_fusions.py`) and, where one uses a product's result further,
#   at least the same program compiled with them off;
# - `"fusions off"`: the same program compiled with the fusions off alone, where
#   XLA counts what its own emitters need: the figures `collectives.py`,
#   `dp_sgd.py` and `layers.py` publish (it can be below `"own"`).
# The executable that runs (and is timed) keeps XLA's defaults.
_FUSIONS_OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compile_fn(fn: Callable[..., Any], *args: Any, count: str = "own") -> Compiled:
    """Compiles `jax.jit(fn)` for `args` with XLA's default flags and reads its
    memory analysis, as `count` says (above; the last two on CPU only)."""
    lowered = jax.jit(fn).lower(*args)
    start = time.perf_counter()
    executable = lowered.compile()
    seconds = time.perf_counter() - start
    analysis = executable.memory_analysis()
    temp, output = int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes)
    cpu = jax.default_backend() == "cpu"
    found = uncounted(str(executable.as_text())) if cpu and count == "budget" else None
    if found is not None:
        temp += found.bytes
    if cpu and (count == "fusions off" or (found is not None and found.dots)):
        options: Any = _FUSIONS_OFF
        off = lowered.compile(compiler_options=options).memory_analysis()
        off_temp, off_output = off.temp_size_in_bytes, off.output_size_in_bytes
        if count == "fusions off" or off_temp + off_output > temp + output:
            temp, output = int(off_temp), int(off_output)
    return Compiled(
        temp_bytes=temp,
        output_bytes=output,
        argument_bytes=int(analysis.argument_size_in_bytes),
        compile_seconds=seconds,
        executable=executable,
    )


def median_seconds(
    fn: Callable[..., Any], *args: Any, warmup: int = 2, repeats: int = 7
) -> float:
    """Median wall time of `fn(*args)`, after `warmup` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def lower_seconds(fn: Callable[..., Any], *args: Any) -> float:
    """Wall time of tracing and lowering a fresh `jax.jit(fn)` for `args`."""
    start = time.perf_counter()
    jax.jit(lambda *a: fn(*a)).lower(*args)
    return time.perf_counter() - start


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_delta_bytes(fn: Callable[..., Any], *args: Any) -> int | None:
    """How far the resident set grows while `fn(*args)` runs (its peak minus the
    resident set before the call), or `None` where Linux's per-process high-water
    mark cannot be reset (`/proc/self/clear_refs`)."""
    before = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        return None
    jax.block_until_ready(fn(*args))
    peak = _status_kib("VmHWM")
    if before is None or peak is None:
        return None
    return max(peak - before, 0) * 1024


class CompileCounter:
    """Counts JAX traces and XLA compilations (via `jax.monitoring` events)."""

    _TRACE = "/jax/core/compile/jaxpr_trace_duration"
    _COMPILE = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.traces = 0
        self.compiles = 0
        self.compile_seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, seconds: float, **kwargs: Any) -> None:
        del kwargs
        if event == self._TRACE:
            self.traces += 1
        elif event == self._COMPILE:
            self.compiles += 1
            self.compile_seconds += seconds

    def snapshot(self) -> tuple[int, int, float]:
        return self.traces, self.compiles, self.compile_seconds
