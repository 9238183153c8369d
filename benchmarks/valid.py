"""Benchmarks a call on the valid elements of a padded batch
(`filter_chunked_vmap(...).valid(count)`): its time against the full batch and
against a chunked call on just the valid elements, evaluated and under
`jax.grad`, with XLA's memory of each.

    python benchmarks/valid.py           # prints a Markdown table
    python benchmarks/valid.py --quick   # CI: small sizes; checks the values

Workload: a per-example MLP (64 -> 256 -> 256 -> 64, tanh) over N = 16,384
inputs in chunks of 256, the loss the sum of its outputs' squares. Three
programs, each compiled once with XLA's default flags:

- `full`: the chunked call on all N elements;
- `valid`: `.valid(count)` on the same padded batch, `count` an argument of the
  program (a quarter of N valid, and the others for the table);
- `exact`: the chunked call on the first `count` elements only, compiled for
  that size.

Times are medians of interleaved rounds after a warm-up, in one process. Targets
(issue 48): at a quarter valid, `valid` at most 0.35x `full`'s time and at most
1.15x `exact`'s.
"""

import argparse
import statistics
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from _measure import compile_fn, MIB

import filtered_chunk as fc


def _programs(n: int, k: int, count: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each program's executable and arguments, for evaluation and gradients."""
    mlp = eqx.nn.MLP(64, 64, 256, 2, activation=jnp.tanh, key=jr.key(0))
    params, static = eqx.partition(mlp, eqx.is_array)
    x = jr.normal(jr.key(1), (n, 64))
    chunked = fc.filter_chunked_vmap(
        lambda p, x: eqx.combine(p, static)(x), in_axes=(None, 0), chunk_size=k
    )

    def _loss(out: jax.Array) -> jax.Array:
        return jnp.sum(out**2)

    calls = {
        "full": lambda p, x, c: chunked(p, x),
        "valid": lambda p, x, c: chunked.valid(c)(p, x),
        "exact": lambda p, x, c: chunked(p, x),
    }
    sizes = {"full": n, "valid": n, "exact": count}
    programs, arguments = {}, {}
    for mode in ("eval", "grad"):
        for name, call in calls.items():
            fn = call
            if mode == "grad":
                fn = jax.grad(lambda p, x, c, call=call: _loss(call(p, x, c)))
            args = (params, x[: sizes[name]], jnp.int32(count))
            programs[mode, name] = compile_fn(fn, *args)
            arguments[mode, name] = args
    return programs, arguments


def _check(programs: dict[str, Any], arguments: dict[str, Any], count: int) -> None:
    """`valid` equals `exact` on the valid elements, and is 0 elsewhere."""
    for mode in ("eval", "grad"):
        valid = programs[mode, "valid"].executable(*arguments[mode, "valid"])
        exact = programs[mode, "exact"].executable(*arguments[mode, "exact"])
        if mode == "eval":
            assert np.all(np.asarray(valid[count:]) == 0)
            valid = valid[:count]
        for a, e in zip(jax.tree.leaves(valid), jax.tree.leaves(exact)):
            np.testing.assert_allclose(a, e, rtol=2e-4, atol=1e-5)


def _timed(programs: dict[str, Any], arguments: dict[str, Any], rounds: int) -> Any:
    """Median seconds of each program, in interleaved rounds after a warm-up."""
    times: dict[Any, list[float]] = {key: [] for key in programs}
    keys = list(programs)
    for r in range(rounds + 2):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            start = time.perf_counter()
            jax.block_until_ready(programs[key].executable(*arguments[key]))
            if r >= 2:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=15)
    a = parser.parse_args()
    n, k = (1024, 64) if a.quick else (16_384, 256)
    fractions = (0.25,) if a.quick else (0.0, 0.25, 0.5, 1.0)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, N = {n}, k = {k}")
    print()
    print("| valid | mode | valid / full | valid / exact | MiB full | MiB valid |")
    print("| --- | --- | --- | --- | --- | --- |")
    failed = []
    for fraction in fractions:
        count = int(n * fraction)
        programs, arguments = _programs(n, k, count)
        _check(programs, arguments, count)
        if a.quick:
            continue
        # `exact` at no element is no program worth timing.
        if count == 0:
            programs = {key: p for key, p in programs.items() if key[1] != "exact"}
        seconds = _timed(programs, arguments, a.rounds)
        for mode in ("eval", "grad"):
            full, valid = seconds[mode, "full"], seconds[mode, "valid"]
            exact = seconds.get((mode, "exact"))
            vs_exact = "-" if exact is None else f"{valid / exact:.2f}"
            mib = [
                programs[mode, name].temp_plus_output / MIB
                for name in ("full", "valid")
            ]
            print(
                f"| {fraction:.2f} | {mode} | {valid / full:.2f} | {vs_exact} | "
                f"{mib[0]:.1f} | {mib[1]:.1f} |"
            )
            if fraction == 0.25 and (valid / full > 0.35 or valid / exact > 1.15):
                failed.append(f"{mode}: {valid / full:.2f}x full, {vs_exact}x exact")
    if a.quick:
        print("values checked")
    if failed:
        print("targets missed:", "; ".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
