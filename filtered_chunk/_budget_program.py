"""The program a memory budget measures: the chunked call as the transformations
around it will run it.

A chunked call chooses its chunk size when it is traced, and under `jax.grad` or
`jax.jvp` what then runs is not the call but its derivative. The transformations
are read off the tracers of the call's inputs (and of the arrays it closes over),
innermost first, and replayed on the traced call before it is compiled:

- a `LinearizeTracer` (`jax.grad`, `value_and_grad`, `vjp`, `jacrev`,
  `linearize`) is reverse mode or a linearisation, and which one cannot be told
  from the primal trace: the call is measured both as its pullback (`jax.vjp`)
  and as its linearisation (`jax.linearize`) applied to tangents, and the larger
  counts;
- a `JVPTracer` (`jax.jvp`, `jacfwd`) is forward mode: the call is measured as
  `jax.jvp`, its primal and tangent outputs, pushing as many tangents at once as
  the tracer carries (`jacfwd` and `hessian` push a batch of basis vectors);
- a `BatchTracer` (an outer `jax.vmap`) is looked through: the budget holds per
  element of the outer map.

Every value the transformation feeds in (cotangents, tangents) is an argument of
the measured program, never a constant such as ones, which XLA would fold away:
a real loss's cotangent is not constant. Their bytes are counted as well, since
the surrounding program allocates them for the call (the cotangent of the
call's outputs under `jax.grad`, the basis under `jacfwd`).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp

from ._jax_compat import transformations_tracing


Program = Callable[[list[Any]], list[Any]]


@dataclasses.dataclass(frozen=True)
class Layer:
    """One transformation around the call: `"reverse"` or `"forward"`, the leaves
    it differentiates, and (forward) how many tangents it pushes at once."""

    kind: str
    mask: tuple[bool, ...]
    batch: int | None = None


def _inexact(x: Any) -> bool:
    return bool(jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact))


def _chain(x: Any) -> list[tuple[Any, str, int | None]]:
    """The transformations tracing `x`, innermost first, as `(trace, kind, batch)`."""
    if not isinstance(x, jax.core.Tracer) or not _inexact(x):
        return []
    return transformations_tracing(x)


def layers_of(leaves: list[Any]) -> tuple[Layer, ...]:
    """The transformations around a call with these input leaves, innermost first."""
    chains = [_chain(x) for x in leaves]
    order: list[tuple[Any, str, int | None]] = []
    for chain in sorted(chains, key=len, reverse=True):
        for entry in chain:
            if all(entry[0] is not seen[0] for seen in order):
                order.append(entry)
    return tuple(
        Layer(kind, tuple(any(trace is c[0] for c in ch) for ch in chains), batch)
        for trace, kind, batch in order
    )


def _plain(x: Any, batch: int | None = None) -> jax.ShapeDtypeStruct:
    shape = tuple(x.shape) if batch is None else (batch, *x.shape)
    sharding = getattr(x, "sharding", None) if batch is None else None
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)


def _differentiable(
    fn: Program, base: list[Any], mask: list[bool], inexact: list[bool]
):
    """`fn` as a function of its masked inputs, returning its inexact outputs and,
    as auxiliary data, the others."""

    def _fn(_diff: list[Any]) -> tuple[list[Any], list[Any]]:
        it = iter(_diff)
        outs = fn([next(it) if m else x for x, m in zip(base, mask, strict=True)])
        return (
            [o for o, i in zip(outs, inexact, strict=True) if i],
            [o for o, i in zip(outs, inexact, strict=True) if not i],
        )

    return _fn, [x for x, m in zip(base, mask, strict=True) if m]


def _apply(
    fn: Program, structs: list[Any], layer: Layer, linearize: bool
) -> tuple[Program, list[Any]]:
    """`fn` under `layer`: its arguments extended by what the layer feeds in."""
    n = len(structs)
    mask = [*layer.mask, *[False] * (n - len(layer.mask))]
    outs = jax.eval_shape(fn, structs)
    inexact = [_inexact(o) for o in outs]
    if layer.kind == "reverse" and not linearize:
        extra = [_plain(o) for o, i in zip(outs, inexact, strict=True) if i]
    else:
        extra = [_plain(s, layer.batch) for s, m in zip(structs, mask) if m]

    def _program(args: list[Any]) -> list[Any]:
        f, diff = _differentiable(fn, args[:n], mask, inexact)
        fed = args[n:]
        if layer.kind == "reverse" and not linearize:
            out, pullback, others = jax.vjp(f, diff, has_aux=True)
            return [*out, *others, *pullback(fed)[0]]
        if layer.kind == "reverse":
            out, push, others = jax.linearize(f, diff, has_aux=True)
            return [*out, *others, *push(fed)]
        _jvp = lambda t: jax.jvp(f, (diff,), (t,), has_aux=True)  # noqa: E731
        if layer.batch is not None:
            _jvp = jax.vmap(_jvp, out_axes=(None, 0, None))
        out, tangents, others = _jvp(fed)
        return [*out, *others, *tangents]

    return _program, [*structs, *extra]


def transformed(
    fn: Program, structs: list[Any], layers: tuple[Layer, ...], linearize: bool
) -> tuple[Program, list[Any], int]:
    """`fn` as `layers` run it (reverse layers as pullbacks, or as linearisations
    if `linearize`), its argument structs, and the bytes of the arguments the
    layers feed in (counted as the call's)."""
    num_leaves = len(structs)
    for layer in layers:
        fn, structs = _apply(fn, structs, layer, linearize)
    return fn, structs, sum(_bytes(s) for s in structs[num_leaves:])


def _bytes(s: jax.ShapeDtypeStruct) -> int:
    sharding = s.sharding
    shape = s.shape if sharding is None else sharding.shard_shape(s.shape)
    return math.prod(shape) * jnp.dtype(s.dtype).itemsize


def has_reverse(layers: tuple[Layer, ...]) -> bool:
    return any(layer.kind == "reverse" for layer in layers)
