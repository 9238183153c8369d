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
- `batchnorm`: an MLP with two `eqx.nn.BatchNorm` layers (four dependent `pmean`s).

Each is measured evaluated and under `jax.grad` w.r.t. the parameters. Memory is
XLA's temporaries plus outputs from `memory_analysis()`; the floor is that of
`jax.vmap` over one chunk plus the program's outputs. Under `jax.grad` the mapped
output (batch-sized, also shown) and its cotangent are temporaries of the program,
which the floor does not count, and so is, per loop, the sum of the parameters'
cotangents over its chunks (the reverse scan's carry). The check (which `--quick`
runs in CI): the staged program stays within 1.05x of the floor plus, under
`jax.grad`, those buffers, and below `jax.vmap`'s memory. Time ratios are noisy on
a shared machine.

XLA's CPU backend runs a whole MLP inside one YNNPACK fusion, whose scratch memory
`memory_analysis()` does not count (`jax.vmap` of the softmax workload shows 64
bytes of temporaries); the fusion is turned off here, so that both sides show
their working sets.
"""

import argparse
import functools as ft
import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_experimental_ynn_fusion_type="
)

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


def _loops(fn, *args):
    """The `lax.scan`s of `fn`'s program: one per loop over the batch."""

    def count(jaxpr):
        found = 0
        for eqn in jaxpr.eqns:
            found += eqn.primitive.name == "scan"
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
        compiled = compile_fn(fn, params, _x)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
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


if __name__ == "__main__":
    main()
