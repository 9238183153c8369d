"""Convolutions inside the loop in the layout of XLA's fast CPU kernels.

XLA's CPU backend runs a convolution with its fast (Eigen) kernel only in a
canonical layout: the input `(batch, spatial..., feature)`, the kernel
`(spatial..., in, out)`, the output as the input. Its pass that rewrites every
other convolution into that layout, with transposes around it
(`ConvCanonicalization`, `xla/service/cpu/conv_canonicalization.cc`), visits the
entry computation only: a convolution inside a `while` body keeps the layout
that JAX gave it (Equinox's `(batch, feature, spatial...)`, or the ones that
JAX's derivative rules give the gradients) and runs a generic kernel, an order
of magnitude slower (`benchmarks/layers.py`). The loop over chunks is such a
body.

So the loop's chunk function has each of its convolutions bound as
`canonical_conv_p`: the same operation, with the same parameters, abstract
evaluation, batching and derivatives as `lax.conv_general_dilated_p` (JAX's own
rules, whose convolutions are bound as `canonical_conv_p` again), lowered on
CPU as XLA's pass would rewrite it at the top level, and elsewhere as
`lax.conv_general_dilated_p` itself.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.lax as lax
import numpy as np
from jax.interpreters import ad, batching, mlir


_conv_p = lax.conv_general_dilated_p

canonical_conv_p = jex.Primitive("chunked_conv_general_dilated")


def _abstract_eval(lhs: Any, rhs: Any, **params: Any) -> Any:
    return _conv_p.abstract_eval(lhs, rhs, **params)


canonical_conv_p.def_effectful_abstract_eval(_abstract_eval)


def _canonical(lhs: Any, rhs: Any, **params: Any) -> Any:
    """The convolution with its operands and result transposed into the
    canonical layout and back, as XLA's pass writes it."""
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    n = len(lhs_spec)
    lhs_order = (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])
    rhs_order = (*rhs_spec[2:], rhs_spec[1], rhs_spec[0])
    out_order = (out_spec[0], *out_spec[2:], out_spec[1])
    spatial = tuple(range(1, n - 1))
    canonical = lax.ConvDimensionNumbers(
        lhs_spec=(0, n - 1, *spatial),
        rhs_spec=(n - 1, n - 2, *range(n - 2)),
        out_spec=(0, n - 1, *spatial),
    )
    out = _conv_p.bind(
        lax.transpose(lhs, lhs_order),
        lax.transpose(rhs, rhs_order),
        **(params | dict(dimension_numbers=canonical)),
    )
    return lax.transpose(out, tuple(int(i) for i in np.argsort(out_order)))


def _plain(lhs: Any, rhs: Any, **params: Any) -> Any:
    return _conv_p.bind(lhs, rhs, **params)


# Outside `jit`, the convolution on its own is a program's entry computation,
# which XLA's pass visits.
canonical_conv_p.def_impl(_plain)

mlir.register_lowering(canonical_conv_p, mlir.lower_fun(_plain, multiple_results=False))
mlir.register_lowering(
    canonical_conv_p,
    mlir.lower_fun(_canonical, multiple_results=False),
    platform="cpu",
)


def _rebound(closed: Any, args: Sequence[Any]) -> list[Any]:
    """Evaluates `closed` on `args`, each of its convolutions (at any depth of
    its sub-jaxprs) bound as `canonical_conv_p`."""
    from ._staged._program import bind  # noqa: PLC0415 (a cycle otherwise)

    closed = canonical_convolutions(closed)
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env |= dict(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        env |= dict(zip(eqn.outvars, bind(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in jaxpr.outvars]


def _jax_rules() -> tuple[tuple[Any, Any], Any] | None:
    """JAX's own rules for the convolution: its transposes w.r.t. each operand
    (`ad.defbilinear`'s), and its batching; `None` where a JAX release keeps
    them elsewhere (then the loop leaves its convolutions as they are)."""
    transpose = ad.primitive_transposes.get(_conv_p)
    batch = getattr(batching, "fancy_primitive_batchers", {}).get(_conv_p)
    rules = getattr(transpose, "args", ())[:2]
    if batch is None or len(rules) != 2 or not all(map(callable, rules)):
        return None
    return (rules[0], rules[1]), batch


_RULES = _jax_rules()
_TRANSPOSES, _BATCH = _RULES if _RULES is not None else ((None, None), None)


def _transpose(which: int, ct: Any, lhs: Any, rhs: Any, **params: Any) -> Any:
    """JAX's transpose of the convolution w.r.t. `lhs` (`which = 0`) or `rhs`,
    its own convolutions bound as `canonical_conv_p`. The operand w.r.t. which
    it transposes is only read for its type."""
    rule = _TRANSPOSES[which]
    assert rule is not None  # `canonical_convolutions` checks it
    other = rhs if which == 0 else lhs

    def _rule(_ct: Any, _other: Any) -> Any:
        operands = (lhs, _other) if which == 0 else (_other, rhs)
        return rule(_ct, *operands, **params)

    (out,) = _rebound(jax.make_jaxpr(_rule)(ct, other), [ct, other])
    return out


ad.defbilinear(
    canonical_conv_p,
    lambda ct, lhs, rhs, **params: _transpose(0, ct, lhs, rhs, **params),
    lambda ct, lhs, rhs, **params: _transpose(1, ct, lhs, rhs, **params),
)


def _batch(
    axis_data: Any, args: Sequence[Any], dims: Sequence[Any], **params: Any
) -> Any:
    """JAX's batching of the convolution, its convolutions bound as
    `canonical_conv_p`."""
    rule = _BATCH
    assert rule is not None  # `canonical_convolutions` checks it
    out_dims = []

    def _rule(*_args: Any) -> Any:
        out, out_dim = rule(axis_data, _args, dims, **params)
        out_dims.append(out_dim)
        return out

    (out,) = _rebound(jax.make_jaxpr(_rule)(*args), list(args))
    return out, out_dims[0]


batching.fancy_primitive_batchers[canonical_conv_p] = _batch


def _rewritten(value: Any) -> Any:
    if isinstance(value, jex.ClosedJaxpr):
        return canonical_convolutions(value)
    if isinstance(value, jex.Jaxpr):
        return _rewrite_jaxpr(value)
    if isinstance(value, tuple):
        new = tuple(_rewritten(v) for v in value)
        return value if all(a is b for a, b in zip(new, value)) else new
    return value


def _rewrite_jaxpr(jaxpr: Any) -> Any:
    """`jaxpr` itself where it holds no convolution."""
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        params = {k: _rewritten(v) for k, v in eqn.params.items()}
        conv = eqn.primitive is _conv_p
        if conv or any(params[k] is not v for k, v in eqn.params.items()):
            primitive = canonical_conv_p if conv else eqn.primitive
            eqn = eqn.replace(primitive=primitive, params=params)
            changed = True
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def in_loop(primitive: Any) -> Any:
    """The primitive that a loop body binds for `primitive`: `canonical_conv_p`
    for a convolution, else `primitive` itself."""
    if primitive is _conv_p and _RULES is not None:
        return canonical_conv_p
    return primitive


def canonical_convolutions(jaxpr: Any) -> Any:
    """`jaxpr` (a `Jaxpr` or `ClosedJaxpr`) with each `lax.conv_general_dilated`
    in it, and in the jaxprs of its equations' parameters (`jit`, `checkpoint`,
    `scan`, `cond`, ...), bound as `canonical_conv_p`; `jaxpr` itself where it
    holds none."""
    if _RULES is None:
        return jaxpr
    if isinstance(jaxpr, jex.Jaxpr):
        return _rewrite_jaxpr(jaxpr)
    inner = _rewrite_jaxpr(jaxpr.jaxpr)
    return jaxpr if inner is jaxpr.jaxpr else jaxpr.replace(jaxpr=inner)
