"""Collectives across chunks: memory, time and passes of the staged evaluation.

    python benchmarks/collectives.py           # full sizes (N = 262,144 / 32,768)
    python benchmarks/collectives.py --quick   # CI: small sizes, fails if a check fails

Each workload maps a function with collectives over the batch (`axis_name="i"`)
and compares `filter_chunked_vmap(..., axis_name="i", chunk_size=k)`, which stages
the collectives across chunks, with `jax.vmap(..., axis_name="i")` on the same
inputs, all of them arguments of the compiled program (nothing XLA can
constant-fold):

- `softmax`: an MLP's logits, then a softmax over the batch (`pmax`, then `psum`);
- `normalised`: a loss normalised by a `psum` over the batch;
- `batchnorm`: an MLP with two `eqx.nn.BatchNorm` layers (two dependent levels:
  each layer's mean and variance take one pass).

Each is measured evaluated and under `jax.grad` w.r.t. the parameters. Memory is
XLA's temporaries plus outputs from `memory_analysis()`; the floor is that of
`jax.vmap` over one chunk plus the program's outputs. Under `jax.grad` the mapped
output (batch-sized, also shown) and its cotangent are temporaries of the program,
which the floor does not count, and so is, per loop, the sum of the parameters'
cotangents over its chunks (the reverse scan's carry). The check (which `--quick`
runs in CI): the staged program stays within 1.05x of the floor plus, under
`jax.grad`, those buffers, and below `jax.vmap`'s memory. Time ratios are noisy on
a shared machine.

A second table measures BatchNorm networks, where each pass recomputes the layers
before its collectives unless the stage boundaries are kept (`keep_boundaries`):
an MLP of `L` blocks of `Linear`, ReLU and `BatchNorm(mode="batch")` (width 128,
N = 8,192, chunks of 512) at L = 2 and 8, and a small convolutional network (two
blocks of a 3x3 `Conv2d`, `BatchNorm` and ReLU over 16x16 images, N = 2,048, chunks
of 256). Each runs evaluated and under `jax.grad` of a loss of its outputs, at the
fixed chunk size recomputing (`False`) and keeping (`True`) the boundaries, and
with a memory budget (`jax.vmap`'s own memory; under `jax.grad` also a half and a
quarter of it), which chooses both. Time ratios are against `jax.vmap` in the same
run. `--quick` runs smaller sizes (and L = 4 for 8) and checks that keeping the
boundaries gives the same values, needs no more memory evaluated than three
boundaries beside the recomputing program, and that every budgeted program fits.

XLA's flags are its defaults, as users run it. XLA's CPU backend runs a whole MLP
inside one YNNPACK fusion, whose scratch memory `memory_analysis()` does not count
(`jax.vmap` of the softmax workload shows no temporaries): the memory columns are
those of each program compiled with YNNPACK's fusions off
(`_measure.compile_fn(..., count="fusions off")`), so that both sides show their
working sets; the program timed, and the one a budget chooses, are the default ones.
"""

import argparse
import functools as ft
import os
import statistics
import tempfile
import time

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.lax as lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
from _measure import compile_fn, median_seconds, MIB  # noqa: E402

import filtered_chunk as fc  # noqa: E402


def _mlp_params(key, sizes):
    keys = jr.split(key, len(sizes) - 1)
    return [
        (jr.normal(k, (a, b)) / a**0.5, jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def _softmax(x, params):
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    logits = x @ w + b
    # `jax.vmap` cannot differentiate `pmax`; the shift needs no derivative.
    e = jnp.exp(logits - lax.pmax(lax.stop_gradient(logits), "i"))
    return e / lax.psum(e, "i")


def _normalised(x, params):
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    loss = jnp.sum(x**2)
    return loss / lax.psum(loss, "i")


class _BatchNormMLP(eqx.Module):
    layers: tuple
    norms: tuple

    def __init__(self, width, key):
        keys = jr.split(key, 3)
        sizes = (16, width, width, 8)
        self.layers = tuple(
            eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes, sizes[1:], keys)
        )
        self.norms = tuple(eqx.nn.BatchNorm(width, "i", mode="batch") for _ in range(2))

    def __call__(self, x, state):
        for layer, norm in zip(self.layers[:-1], self.norms):
            x, state = norm(jax.nn.relu(layer(x)), state)
        return self.layers[-1](x), state


def _workload(name, key, quick):
    """`(element_fn(x, params) -> (mapped, unmapped), x, params, batch, chunk)`."""
    if name == "batchnorm":
        n, k, width = (4096, 256, 256) if quick else (32768, 1024, 256)
        model, state = eqx.nn.make_with_state(_BatchNormMLP)(width, key)
        params, static = eqx.partition((model, state), eqx.is_array)

        def fun(x, _params):
            _model, _state = eqx.combine(_params, static)
            y, new_state = _model(x, _state)
            return y, jax.tree.leaves(new_state)

        return fun, jr.normal(key, (n, 16)), params, n, k
    n, k = (8192, 512) if quick else (262144, 2048)
    params = _mlp_params(key, (16, 256, 256, 16))
    element = _softmax if name == "softmax" else _normalised
    return (lambda x, p: (element(x, p), [])), jr.normal(key, (n, 16)), params, n, k


def _vmapped(fun, x, params):
    return jax.vmap(lambda _x: fun(_x, params), out_axes=(0, None), axis_name="i")(x)


def _staged(fun, chunk_size, x, params):
    chunked = fc.filter_chunked_vmap(
        fun, in_axes=(0, None), out_axes=(0, None), axis_name="i", chunk_size=chunk_size
    )
    return chunked(x, params)


def _loops(fn, *args, names=("scan",)):
    """The `lax.scan`s of `fn`'s program (one per loop over the batch), or its
    equations of other primitives."""

    def count(jaxpr):
        found = 0
        for eqn in jaxpr.eqns:
            found += eqn.primitive.name in names
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        found += count(sub)
        return found

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def _loss(run):
    def _fn(params, x):
        y, unmapped = run(x, params)
        return jnp.sum(y**2) + sum(jnp.sum(u) for u in unmapped if u.dtype != bool)

    return _fn


def _inexact_grad(loss, params, x):
    diff, rest = eqx.partition(params, eqx.is_inexact_array)
    return jax.grad(lambda _d, _x: loss(eqx.combine(_d, rest), _x))(diff, x)


def _measure(name, mode, quick):
    fun, x, params, n, k = _workload(name, jr.key(0), quick)
    runs = {
        "vmap": ft.partial(_vmapped, fun),
        "staged": ft.partial(_staged, fun, k),
        "one chunk": ft.partial(_vmapped, fun),
    }
    loops = _loops(lambda _x, _p: _staged(fun, k, _x, _p), x, params)
    rows = {}
    for label, run in runs.items():
        _x = x[:k] if label == "one chunk" else x
        if mode == "grad":
            fn = lambda _p, _xx, _run=run: _inexact_grad(_loss(_run), _p, _xx)
        else:
            fn = lambda _p, _xx, _run=run: _run(_xx, _p)
        compiled = compile_fn(fn, params, _x, count="fusions off")
        seconds = median_seconds(compiled.executable, params, _x, repeats=3)
        rows[label] = (compiled, seconds)
    out_bytes = rows["staged"][0].output_bytes
    floor = rows["one chunk"][0].temp_bytes + out_bytes
    mapped = jax.eval_shape(lambda: _vmapped(fun, x, params)[0])
    mapped_mib = mapped.size * mapped.dtype.itemsize / MIB
    vmap_mib = rows["vmap"][0].temp_plus_output / MIB
    staged_mib = rows["staged"][0].temp_plus_output / MIB
    ratio = rows["staged"][1] / rows["vmap"][1]
    print(
        f"| {name} | {mode} | {n:,} | {k:,} | {loops} | {vmap_mib:,.1f} | "
        f"{staged_mib:,.1f} | {floor / MIB:,.1f} | {mapped_mib:,.1f} | {ratio:.1f}x |"
    )
    extra = 0.0
    if mode == "grad":  # the mapped output, its cotangent, a carry per loop
        carry = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(params))
        extra = 2 * mapped_mib + loops * carry / MIB
    target = 1.05 * (floor / MIB + extra)
    return vmap_mib, staged_mib, target


class _Network(eqx.Module):
    """`depth` blocks of a layer, ReLU and `BatchNorm(mode="batch")`, then a
    linear read-out: `Linear` layers on vectors, or 3x3 `Conv2d` layers on
    images (averaged over the pixels before the read-out)."""

    layers: tuple
    norms: tuple
    out: eqx.nn.Linear

    def __init__(self, name, depth, width, key):
        keys = jr.split(key, depth + 1)
        sizes = (16 if name == "mlp" else 3,) + (width,) * depth
        if name == "mlp":
            make = lambda a, b, k: eqx.nn.Linear(a, b, key=k)
        else:
            make = lambda a, b, k: eqx.nn.Conv2d(a, b, 3, padding=1, key=k)
        self.layers = tuple(make(a, b, k) for a, b, k in zip(sizes, sizes[1:], keys))
        self.norms = tuple(
            eqx.nn.BatchNorm(width, "i", mode="batch") for _ in sizes[1:]
        )
        self.out = eqx.nn.Linear(width, 8, key=keys[-1])

    def __call__(self, x, state):
        for layer, norm in zip(self.layers, self.norms):
            x, state = norm(jax.nn.relu(layer(x)), state)
        if x.ndim > 1:
            x = jnp.mean(x, axis=(1, 2))
        return self.out(x), state


def _network(name, depth, quick):
    """`(fun(params, x) -> outputs, params, x, chunk)` for the BatchNorm table."""
    if name == "mlp":
        n, k, width, shape = (
            (1024, 128, 32, (16,)) if quick else (8192, 512, 128, (16,))
        )
    else:
        n, k, width, shape = (
            (256, 64, 8, (3, 8, 8)) if quick else (2048, 256, 16, (3, 16, 16))
        )
    model, state = eqx.nn.make_with_state(_Network)(name, depth, width, jr.key(0))
    params, static = eqx.partition((model, state), eqx.is_inexact_array)
    x = jr.normal(jr.key(1), (n, *shape))
    # One boundary: a layer's float32 output for every element.
    boundary = 4 * n * width * (1 if name == "mlp" else shape[1] * shape[2])
    return params, static, x, k, boundary


def _boundaries(kept, size, batch_size):
    if size == batch_size:
        return "none: one `vmap`"
    return "kept" if kept is True else "recomputed" if kept is False else kept


def _networks(name, depth, mode, quick):
    params, static, x, k, boundary = _network(name, depth, quick)
    axes = dict(in_axes=(0, None), out_axes=(0, None), axis_name="i")

    def run(chunk_size, keep):
        # The outputs and the new state, as the call returns them.
        def _fn(_params, _x):
            model, state = eqx.combine(_params, static)
            if chunk_size is None:
                return eqx.filter_vmap(model, **axes)(_x, state)
            chunked = fc.filter_chunked_vmap(
                model, chunk_size=chunk_size, keep_boundaries=keep, **axes
            )
            return chunked(_x, state)

        if mode == "evaluate":
            return _fn
        return jax.grad(lambda _p, _x: jnp.sum(_fn(_p, _x)[0] ** 2))

    vmap = compile_fn(run(None, None), params, x, count="fusions off")
    budgets = [vmap.temp_plus_output]
    if mode == "grad":
        # Half: every pass's boundaries do not fit, every few passes' may.
        budgets += [vmap.temp_plus_output // 2, vmap.temp_plus_output // 4]
    settings = [(k, False, None), (k, True, None)]
    settings += [(fc.MemoryBudget(b), None, b) for b in budgets]
    outputs, used, rows = [], [], []
    for chunk_size, keep, budget in settings:
        fn = run(chunk_size, keep)
        start = time.perf_counter()
        compiled = compile_fn(fn, params, x, count="fusions off")
        first = time.perf_counter() - start
        outputs.append(compiled.executable(params, x))
        used.append(compiled.temp_plus_output)
        size, kept = chunk_size, keep
        if budget is not None:
            model, state = eqx.combine(params, static)
            chunked = fc.filter_chunked_vmap(model, chunk_size=chunk_size, **axes)
            if mode == "evaluate":
                choice = fc.suggest_chunk_size(chunked, x, state)
                size, kept = choice.chunk_size, choice.keep_boundaries
            else:
                # What the budget kept, told by the layers its program runs:
                # as many as keeping every pass's boundaries, as recomputing, or
                # between (every few passes' boundaries kept).
                size = f"budget of {budget / MIB:.1f} MiB"
                layers = (
                    "dot_general",
                    "conv_general_dilated",
                    "chunked_conv_general_dilated",  # in the loop (_convolutions.py)
                )
                dots = [
                    _loops(f, params, x, names=layers)
                    for f in (fn, run(k, True), run(k, False))
                ]
                kept = (
                    "kept (chosen)"
                    if dots[0] == dots[1]
                    else "recomputed (chosen)"
                    if dots[0] == dots[2]
                    else "some kept (chosen)"
                )
            if compiled.temp_plus_output > budget:
                raise SystemExit(f"{name} L={depth} {mode}: over its budget")
        loops = _loops(run(chunk_size, keep), params, x)
        rows.append((compiled, size, kept, loops, first))
    # Time against `jax.vmap` in interleaved rounds (each program's median of
    # three runs, `jax.vmap`'s in the same round), so that the machine's drift
    # falls on both sides of each ratio; the median of the rounds' ratios.
    executables = [vmap.executable] + [row[0].executable for row in rows]
    ratios = [[] for _ in rows]
    for _ in range(3):
        seconds = [median_seconds(e, params, x, repeats=3) for e in executables]
        for i in range(len(rows)):
            ratios[i].append(seconds[i + 1] / seconds[0])
    for (compiled, size, kept, loops, first), ratio in zip(rows, ratios, strict=True):
        print(
            f"| {name} L={depth} | {mode} | {x.shape[0]:,} | {size} | "
            f"{_boundaries(kept, size, x.shape[0])} | "
            f"{loops} | {compiled.temp_plus_output / MIB:,.1f} | "
            f"{vmap.temp_plus_output / MIB:,.1f} | "
            f"{statistics.median(ratio):.2f}x | {first:.1f} |"
        )
    # The same up to the order of float32 sums, relative to the largest value.
    # Under `jax.grad` at L = 8 rounding alone moves the gradient by 7.5e-4 of
    # its largest entry (`jax.vmap`'s own against float64, 2026-12-04).
    leaves = list(zip(jax.tree.leaves(outputs[0]), jax.tree.leaves(outputs[1])))
    scale = max(float(jnp.max(jnp.abs(a))) for a, _ in leaves)
    tolerance = (1e-4 if mode == "evaluate" else 2e-3) * scale
    if any(float(jnp.max(jnp.abs(a - b))) > tolerance for a, b in leaves):
        raise SystemExit(f"{name} L={depth} {mode}: kept boundaries differ")
    if mode == "evaluate" and used[1] > used[0] + 3 * boundary:
        raise SystemExit(f"{name} L={depth}: kept boundaries need more than three")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    # Budgets store their timed choices in this run's own folder: each first call
    # is a first ever, as on a fresh machine, and the user's store is untouched.
    os.environ["FILTERED_CHUNK_CACHE_DIR"] = tempfile.mkdtemp(prefix="fc_choices_")
    print(
        "| workload | mode | batch | chunk | loops | `jax.vmap` MiB | staged MiB "
        "| one chunk + outputs MiB | mapped output MiB | time staged / vmap |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for name in ("softmax", "normalised", "batchnorm"):
        for mode in ("evaluate", "grad"):
            vmap_mib, staged_mib, target = _measure(name, mode, quick)
            if staged_mib >= vmap_mib or staged_mib > target:
                raise SystemExit(
                    f"{name} {mode}: staged {staged_mib:.1f} MiB, against jax.vmap's "
                    f"{vmap_mib:.1f} MiB and the target of {target:.1f} MiB"
                )
    print(
        "\n| network | mode | batch | chunk_size | boundaries | loops | MiB "
        "| `jax.vmap` MiB | time / `jax.vmap` | first call s |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for name, depth in (("mlp", 2), ("mlp", 4 if quick else 8), ("conv", 2)):
        for mode in ("evaluate", "grad"):
            _networks(name, depth, mode, quick)


if __name__ == "__main__":
    main()
