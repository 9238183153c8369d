"""The five workloads of the benchmark, each at a quick and a full size.

A workload is a per-element function over arrays (`element`, with `in_axes` of `0`
or `None` per argument and `out_axes` of `0` or `None` per output), so that every
peer can map it. Workloads built on an `eqx.nn.MLP` also give a *filter form*: the
same computation written as an Equinox user would hand it to
`filter_chunked_vmap` or `eqx.filter_vmap`, with the Module itself as an argument.
The benchmarked programs always take arrays only (the Module's arrays), so that
`jax.jit(...).lower(...)` sees the same arguments for every peer.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np


@dataclass(frozen=True)
class Sizes:
    """The batch sizes and chunk sizes one workload is measured at."""

    batch_size: int
    chunk_sizes: tuple[int, ...]
    # Scaling: the batch grows 1x, 4x, 16x at this fixed chunk size.
    scaling_base: int
    scaling_chunk: int


@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    description: str
    element: Callable[..., Any]
    in_axes: tuple[int | None, ...]
    make_args: Callable[[int], tuple[Any, ...]]
    sizes: Sizes
    out_axes: Any = 0
    # "map": the program is the mapped function; "grad": the gradient w.r.t. the
    # first argument of the sum of the mapped function.
    objective: str = "map"
    # (args) -> (fun, in_axes, args) for the filtered peers; `None`: use `element`.
    filter_form: (
        Callable[[tuple[Any, ...]], tuple[Any, Any, tuple[Any, ...]]] | None
    ) = field(default=None)


def _normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    # NumPy draws: `jax.random` would compile a kernel per shape, seconds in all.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _mlp(
    in_size: int, width: int, out_size: int, depth: int, seed: int, members: int = 0
) -> Any:
    """An `eqx.nn.MLP` (`members` of them stacked, if not 0) with random weights.

    The structure comes from `eqx.filter_eval_shape`, the values from NumPy, so
    nothing is compiled; the values do not matter beyond being of a sane scale.
    """
    make = lambda: eqx.nn.MLP(in_size, out_size, width, depth, key=jr.key(0))
    template = eqx.filter_eval_shape(make)
    rng = np.random.default_rng(seed)

    def fill(leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        shape = ((members,) if members else ()) + leaf.shape
        scale = 1 / np.sqrt(leaf.shape[-1]) if len(leaf.shape) == 2 else 0.1
        return jnp.asarray(rng.uniform(-scale, scale, shape).astype(np.float32))

    return jtu.tree_map(fill, template)


# (a) A pairwise kernel: each query against every reference point. `jax.vmap`
# materialises the (batch, references) matrix of kernel values.
def pairwise_kernel(num_refs: int, dim: int, sizes: Sizes) -> Workload:
    refs = _normal(1, (num_refs, dim))
    weights = _normal(2, (num_refs,)) * (1 / num_refs)

    def element(query: jax.Array, refs: jax.Array, weights: jax.Array) -> jax.Array:
        sq_dist = jnp.sum((query - refs) ** 2, axis=-1)
        return jnp.exp(-0.5 * sq_dist / dim) @ weights

    def make_args(n: int) -> tuple[Any, ...]:
        return _normal(3, (n, dim)), refs, weights

    return Workload(
        "a",
        "pairwise kernel",
        f"Gaussian-kernel regression: each of N queries ({dim}-dim) against "
        f"{num_refs} reference points, reduced to one value per query.",
        element,
        (0, None, None),
        make_args,
        sizes,
    )


def _module_form(static: Any, in_axes: tuple[Any, ...]) -> Callable[..., Any]:
    """The filter form: rebuild the Module from its arrays and map it directly."""

    def form(args: tuple[Any, ...]) -> tuple[Any, Any, tuple[Any, ...]]:
        model = eqx.combine(args[0], static)
        return _call_module, in_axes, (model, *args[1:])

    return form


def _call_module(model: Any, x: jax.Array) -> jax.Array:
    return model(x)


# (b) Evaluation of an MLP with a wide hidden layer: `jax.vmap` materialises the
# (batch, width) activations.
def wide_mlp(in_size: int, width: int, out_size: int, sizes: Sizes) -> Workload:
    params, static = eqx.partition(_mlp(in_size, width, out_size, 1, 4), eqx.is_array)

    def element(p: Any, x: jax.Array) -> jax.Array:
        return eqx.combine(p, static)(x)

    return Workload(
        "b",
        "MLP evaluation",
        f"`eqx.nn.MLP` {in_size} -> {width} -> {out_size} evaluated on N inputs.",
        element,
        (None, 0),
        lambda n: (params, _normal(5, (n, in_size))),
        sizes,
        filter_form=_module_form(static, (None, 0)),
    )


def _squared_error(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum((model(x) - y) ** 2)


# (c) Per-example gradients: the output holds one gradient per example, so the
# output itself dominates and any copy of it shows.
def per_example_grads(in_size: int, width: int, sizes: Sizes) -> Workload:
    params, static = eqx.partition(_mlp(in_size, width, 1, 2, 6), eqx.is_array)

    def element(p: Any, x: jax.Array, y: jax.Array) -> Any:
        loss = lambda _p: _squared_error(eqx.combine(_p, static), x, y)
        return jax.grad(loss)(p)

    def filtered(model: Any, x: jax.Array, y: jax.Array) -> Any:
        return eqx.filter_grad(_squared_error)(model, x, y)

    def form(args: tuple[Any, ...]) -> tuple[Any, Any, tuple[Any, ...]]:
        return filtered, (None, 0, 0), (eqx.combine(args[0], static), *args[1:])

    def make_args(n: int) -> tuple[Any, ...]:
        x = _normal(7, (n, in_size))
        return params, x, _normal(8, (n, 1))

    return Workload(
        "c",
        "per-example gradients",
        f"The gradient of a squared error for each of N examples, w.r.t. the "
        f"parameters of an `eqx.nn.MLP` {in_size} -> {width} -> {width} -> 1.",
        element,
        (None, 0, 0),
        make_args,
        sizes,
        filter_form=form,
    )


# (d) The gradient w.r.t. shared parameters of a loss summed over a chunked map:
# the map is differentiated (reverse mode), the output is one gradient.
def shared_grad(in_size: int, width: int, out_size: int, sizes: Sizes) -> Workload:
    params, static = eqx.partition(_mlp(in_size, width, out_size, 1, 9), eqx.is_array)

    def element(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return _squared_error(eqx.combine(p, static), x, y)

    def form(args: tuple[Any, ...]) -> tuple[Any, Any, tuple[Any, ...]]:
        return _squared_error, (None, 0, 0), (eqx.combine(args[0], static), *args[1:])

    def make_args(n: int) -> tuple[Any, ...]:
        x = _normal(10, (n, in_size))
        return params, x, _normal(11, (n, out_size))

    return Workload(
        "d",
        "gradient through the map",
        f"`jax.grad` w.r.t. the parameters of an `eqx.nn.MLP` {in_size} -> {width} "
        f"-> {out_size} of a squared error summed over N mapped examples.",
        element,
        (None, 0, 0),
        make_args,
        sizes,
        objective="grad",
        filter_form=form,
    )


# (e) An ensemble: N stacked MLPs (one Module whose arrays have a leading member
# axis) evaluated on shared inputs. The second output, the standardised inputs,
# does not depend on the member: `out_axes=None` returns it once.
def ensemble(in_size: int, width: int, out_size: int, points: int, sizes: Sizes):
    template = _mlp(in_size, width, out_size, 1, 12)
    static = eqx.filter(template, eqx.is_array, inverse=True)
    inputs = _normal(13, (points, in_size))
    largest = max(sizes.batch_size, 16 * sizes.scaling_base)
    members = eqx.filter(_mlp(in_size, width, out_size, 1, 14, largest), eqx.is_array)

    def _member(model: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = (x - jnp.mean(x, axis=0)) / jnp.std(x, axis=0)
        return jax.vmap(model)(x), x

    def element(p: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _member(eqx.combine(p, static), x)

    def form(args: tuple[Any, ...]) -> tuple[Any, Any, tuple[Any, ...]]:
        model = eqx.combine(args[0], static)
        return _member, (eqx.if_array(0), None), (model, args[1])

    def make_args(n: int) -> tuple[Any, ...]:
        # Slice in NumPy: an eager `x[:n]` would compile once per `n`.
        return jtu.tree_map(lambda x: jnp.asarray(np.asarray(x)[:n]), members), inputs

    return Workload(
        "e",
        "ensemble, `out_axes=None`",
        f"N stacked `eqx.nn.MLP` {in_size} -> {width} -> {out_size} members (one "
        f"Module, `in_axes=eqx.if_array(0)`) on {points} shared inputs; the "
        "standardised inputs are a second output with `out_axes=None`.",
        element,
        (0, None),
        make_args,
        sizes,
        out_axes=(0, None),
        filter_form=form,
    )


def workloads(quick: bool) -> list[Workload]:
    """The workloads at the quick (CI) or the full size."""
    if quick:
        return [
            pairwise_kernel(1024, 32, Sizes(512, (32, 100), 256, 64)),
            wide_mlp(32, 1024, 8, Sizes(512, (32, 100), 256, 64)),
            per_example_grads(32, 64, Sizes(256, (16, 26), 128, 32)),
            shared_grad(32, 1024, 8, Sizes(512, (32, 100), 256, 64)),
            ensemble(16, 128, 4, 256, Sizes(64, (16, 20), 32, 8)),
        ]
    chunks = (16, 64, 100, 256, 1000)
    return [
        pairwise_kernel(8192, 64, Sizes(2048, chunks, 512, 128)),
        wide_mlp(64, 8192, 16, Sizes(4096, chunks, 1024, 256)),
        per_example_grads(64, 256, Sizes(1024, (16, 26, 64, 100, 256), 256, 64)),
        shared_grad(64, 4096, 16, Sizes(2048, chunks, 512, 128)),
        ensemble(64, 256, 16, 256, Sizes(256, (16, 20, 64, 100), 64, 16)),
    ]
