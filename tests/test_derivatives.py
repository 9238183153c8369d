"""Derivatives through `filter_chunked_vmap` against `eqx.filter_vmap`'s, and their
memory: rematerialised chunks, linear reverse mode, accumulated parameter
cotangents."""

import functools as ft
import itertools
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import batchings, remainders, scan_counts, tree_allclose
from .meters import check_one_call, recorder


CHUNK = 3
BATCH_SIZES = (0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1)
CHECKPOINTS: tuple[Any, ...] = (
    True,
    False,
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
)


def _f(params, x):
    """Per element: two outputs, one with out axis 1, and one unmapped output."""
    w, b = params
    h = jnp.tanh(x @ w + b)
    return {"h": h, "s": jnp.sum(jnp.sin(h) * x[:2])}, jnp.sum(w**2)


_AXES: dict[str, Any] = dict(in_axes=(None, 0), out_axes=({"h": 1, "s": 0}, None))


def _maps(chunk_size, remainder: Any = "overlap", checkpoint: Any = True):
    chunked = fc.filter_chunked_vmap(
        _f, chunk_size=chunk_size, remainder=remainder, checkpoint=checkpoint, **_AXES
    )
    return chunked, eqx.filter_vmap(_f, **_AXES)


def _inputs(getkey, batch_size):
    w, b = jr.normal(getkey(), (3, 2)), jr.normal(getkey(), (2,))
    return (w, b), jr.normal(getkey(), (batch_size, 3))


def _loss(vmapped, cotangent):
    def _scalar(params, x):
        out = vmapped(params, x)
        return sum(jnp.vdot(o, c) for o, c in zip(jtu.tree_leaves(out), cotangent))

    return _scalar


def _cotangent(getkey, out):
    return [jr.normal(getkey(), o.shape, o.dtype) for o in jtu.tree_leaves(out)]


@pytest.mark.parametrize(
    "batch_size, chunk_size, checkpoint, remainder",
    [
        (n, k, c, r)
        for n in BATCH_SIZES
        for k, c in [(CHUNK, c) for c in CHECKPOINTS] + [(8, True)]
        for r in remainders(n, k)
    ],
)
def test_grad_matches_filter_vmap(
    batch_size, chunk_size, remainder, checkpoint, getkey
):
    params, x = _inputs(getkey, batch_size)
    chunked, oracle = _maps(chunk_size, remainder, checkpoint)
    cotangent = _cotangent(getkey, oracle(params, x))
    grad = jax.grad(_loss(chunked, cotangent), argnums=(0, 1))(params, x)
    # The oracle under `jit` (its eager derivative compiles each operation).
    expected = jax.jit(jax.grad(_loss(oracle, cotangent), argnums=(0, 1)))(params, x)
    assert tree_allclose(grad, expected)


@pytest.mark.parametrize(
    "batch_size, remainder",
    batchings((1, CHUNK + 1, 2 * CHUNK + 1), CHUNK),
)
def test_vjp_and_jvp_match_filter_vmap(batch_size, remainder, getkey):
    params, x = _inputs(getkey, batch_size)
    chunked, oracle = _maps(CHUNK, remainder)
    out, pullback = jax.vjp(chunked, params, x)
    expected, pullback_ = jax.vjp(oracle, params, x)
    assert tree_allclose(out, expected)
    cotangent = jtu.tree_map(lambda o: jr.normal(getkey(), o.shape, o.dtype), out)
    assert tree_allclose(pullback(cotangent), pullback_(cotangent))

    tangents = jtu.tree_map(lambda p: jr.normal(getkey(), p.shape), (params, x))
    primal_tangent = jax.jvp(chunked, (params, x), tangents)
    assert tree_allclose(primal_tangent, jax.jvp(oracle, (params, x), tangents))


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize(
    "transform", (jax.jacrev, jax.jacfwd, jax.hessian), ids=("jacrev", "jacfwd", "hess")
)
def test_jacobians_and_hessian_match_filter_vmap(remainder, transform, getkey):
    params, x = _inputs(getkey, 2 * CHUNK + 1)
    chunked, oracle = _maps(CHUNK, remainder)
    fn = lambda m: lambda w, x: m((w, params[1]), x)[0]["s"]
    actual = transform(fn(chunked), argnums=(0, 1))(params[0], x)
    assert tree_allclose(actual, transform(fn(oracle), argnums=(0, 1))(params[0], x))


def test_third_derivative(getkey):
    x = jr.uniform(getkey(), (2 * CHUNK + 1,), minval=0.5, maxval=2.0)
    fn = lambda m: lambda w: jnp.sum(m(lambda w, x: jnp.sin(w * x) / x, w, x))
    chunked = fc.filter_chunked_vmap(
        lambda f, w, x: f(w, x), in_axes=(None, None, 0), chunk_size=CHUNK
    )
    oracle = eqx.filter_vmap(lambda f, w, x: f(w, x), in_axes=(None, None, 0))
    third = lambda m: jax.grad(jax.grad(jax.grad(fn(m))))
    w = jnp.array(0.7)
    assert tree_allclose(third(chunked)(w), third(oracle)(w))
    assert tree_allclose(
        jax.jacfwd(jax.jacrev(jax.grad(fn(chunked))))(w),
        jax.jacfwd(jax.jacrev(jax.grad(fn(oracle))))(w),
    )


@pytest.mark.parametrize("batch_size", (CHUNK + 1, 2 * CHUNK + 1))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_gradient_not_poisoned_by_padding(batch_size, remainder, getkey):
    # Zero-padding the remainder would give `log(w * 0)` and a NaN gradient.
    x = jr.uniform(getkey(), (batch_size,), minval=0.5, maxval=2.0)
    loss = lambda m: lambda w: jnp.sum(m(lambda w, x: jnp.log(w * x), w, x))
    kwargs: dict[str, Any] = dict(in_axes=(None, None, 0))
    call = lambda f, w, x: f(w, x)
    chunked = fc.filter_chunked_vmap(
        call, chunk_size=CHUNK, remainder=remainder, **kwargs
    )
    grad = jax.grad(loss(chunked))(jnp.array(1.5))
    assert jnp.isfinite(grad)
    assert tree_allclose(grad, jax.grad(loss(eqx.filter_vmap(call, **kwargs)))(1.5))


def _mixed(tree, x):
    w, n, flag, name, scale = tree
    y = jnp.tanh(w * x) * n.astype(w.dtype) * scale
    return jnp.where(flag, y, -y), name


def test_no_cotangents_for_integer_boolean_and_static_inputs(getkey):
    tree = (jr.normal(getkey(), (3,)), jnp.arange(3), jnp.array(True), "name", 2)
    x = (jr.normal(getkey(), (7, 3)), jnp.arange(7))
    in_axes = (None, (0, 0))
    kwargs: dict[str, Any] = dict(in_axes=in_axes, out_axes=(0, None))
    f = lambda tree, x: _mixed(tree, x[0] + x[1].astype(x[0].dtype))
    chunked = fc.filter_chunked_vmap(f, chunk_size=CHUNK, **kwargs)
    oracle = eqx.filter_vmap(f, **kwargs)
    loss = lambda m: lambda tree, x: jnp.sum(m(tree, x)[0] ** 2)
    grads = eqx.filter_grad(loss(chunked))(tree, x)
    assert tree_allclose(grads, eqx.filter_grad(loss(oracle))(tree, x))
    assert grads[1:] == (None, None, None, None)


def test_per_example_gradients_of_chunked_map(getkey):
    params, x = _inputs(getkey, 2 * CHUNK + 1)
    per_example = lambda p, x: jnp.sum(_f(p, x)[0]["h"] ** 2)
    grads = fc.filter_chunked_vmap(
        jax.grad(per_example), in_axes=(None, 0), chunk_size=CHUNK
    )(params, x)
    expected = jax.vmap(jax.grad(per_example), in_axes=(None, 0))(params, x)
    assert tree_allclose(grads, expected)
    # And `jax.vmap` of the gradient of a chunked map.
    chunked, oracle = _maps(CHUNK)
    loss = lambda m: lambda p, x: sum(jnp.sum(o**2) for o in jtu.tree_leaves(m(p, x)))
    stacked = jtu.tree_map(lambda p: jnp.stack([p, 2 * p]), params)
    per_params = lambda m: jax.vmap(jax.grad(loss(m)), in_axes=(0, None))
    assert tree_allclose(
        per_params(chunked)(stacked, x), per_params(oracle)(stacked, x)
    )


def _reverse_scans(jaxpr: Any) -> list[Any]:
    """Every reverse-direction `scan` (a transposed loop) in a closed jaxpr."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and eqn.params["reverse"]:
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found.extend(_reverse_scans(inner))
    return found


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_reverse_loop_carries_no_batch_sized_array(remainder, getkey):
    # Transposing the plain loop would carry full-size input and output cotangents
    # (copied by XLA on every step: quadratic time), and stack the parameters'
    # cotangents per chunk. The loop's JVP rule makes them scanned inputs/outputs,
    # and keeps the parameters' cotangents summed in the carry.
    batch_size, chunk_size = 37, 4
    params, x = _inputs(getkey, batch_size)
    chunked, _ = _maps(chunk_size, remainder)
    cotangent = _cotangent(getkey, _maps(chunk_size)[1](params, x))
    grad = jax.grad(_loss(chunked, cotangent), argnums=(0, 1))
    scans = _reverse_scans(jax.make_jaxpr(grad)(params, x).jaxpr)
    # One loop, and with `"separate"` one more (of one step) for the remainder.
    assert len(scans) == (1 if remainder == "overlap" else 2)
    for scan in scans:
        num_consts, num_carry = scan_counts(scan)
        carries = scan.invars[num_consts : num_consts + num_carry]
        assert all(batch_size not in v.aval.shape for v in carries)
        param_shapes = {p.shape for p in params}
        assert {v.aval.shape for v in carries} >= param_shapes
        stacked = [v.aval.shape[1:] for v in scan.outvars[num_carry:]]
        assert not param_shapes & set(stacked)


def _temp_bytes(fn, *args) -> int:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    assert analysis is not None
    return int(analysis.temp_size_in_bytes)


@pytest.mark.parametrize("checkpoint", (True, False))
def test_gradient_memory_is_flat_in_batch_size(checkpoint, getkey):
    def _grad_temp(batch_size):
        params = (jr.normal(getkey(), (16, 256)), jr.normal(getkey(), (256,)))
        x = jr.normal(getkey(), (batch_size, 16))
        f = lambda p, x: jnp.sum(jnp.tanh(jnp.tanh(x @ p[0] + p[1])))
        chunked = fc.filter_chunked_vmap(
            f, in_axes=(None, 0), chunk_size=32, checkpoint=checkpoint
        )
        return _temp_bytes(jax.grad(lambda p: jnp.sum(chunked(p, x))), params)

    small, large = _grad_temp(256), _grad_temp(4096)
    if checkpoint:
        # One chunk's residuals whatever the batch size; what grows is the one
        # number per element of the output.
        assert large - small <= 4 * (4096 - 256) * 8
    else:
        assert large > 8 * small


def test_checkpoint_policy_saves_chosen_residuals(getkey):
    # Saving the matmuls' outputs keeps one of them per element: more memory than
    # full rematerialisation, less than saving everything, same values.
    params = (jr.normal(getkey(), (16, 256)), jr.normal(getkey(), (256,)))
    x = jr.normal(getkey(), (1024, 16))
    f = lambda p, x: jnp.sum(jnp.sin(jnp.tanh(x @ p[0] + p[1]) @ p[0].T))
    temps, grads = [], []
    for checkpoint in CHECKPOINTS:
        g = fc.filter_chunked_vmap(
            f, in_axes=(None, 0), chunk_size=32, checkpoint=checkpoint
        )
        loss = lambda p: jnp.sum(g(p, x))
        temps.append(_temp_bytes(jax.grad(loss), params))
        grads.append(jax.grad(loss)(params))
    assert tree_allclose(grads[0], grads[1]) and tree_allclose(grads[0], grads[2])
    remat, save_all, policy = temps
    assert remat < policy < save_all


@pytest.mark.parametrize(
    "batch_size, remainder",
    batchings((CHUNK + 1, 2 * CHUNK + 1, 2 * CHUNK), CHUNK),
)
def test_derivatives_keep_weak_types(batch_size, remainder):
    x = jax.lax.broadcast(jnp.asarray(1.5), (batch_size,))
    assert jax.typeof(x).weak_type
    f = lambda v: (jnp.sin(v), 3.0 * v)
    chunked = fc.filter_chunked_vmap(f, chunk_size=CHUNK, remainder=remainder)
    oracle = eqx.filter_vmap(f)

    def loss(g, v):
        a, b = g(v)
        return jnp.sum(a) + jnp.sum(b)

    grads = (
        jax.grad(loss, argnums=1)(chunked, x),
        jax.grad(loss, argnums=1)(oracle, x),
    )
    tangents = (jax.jvp(chunked, (x,), (x,))[1], jax.jvp(oracle, (x,), (x,))[1])
    for actual, expected in (grads, tangents):
        assert tree_allclose(actual, expected)
        weak = lambda t: jtu.tree_map(lambda a: jax.typeof(a).weak_type, t)
        assert weak(actual) == weak(expected)
    assert jax.typeof(grads[1]).weak_type


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_numpy_primals_and_tangents_reach_the_rules(remainder):
    # Outside `jit`, `jax.grad`/`jax.jvp` hand the derivative rules the caller's
    # NumPy arrays (and JAX's own zero tangents, a NumPy subclass); the package
    # runs type-checked under pytest.
    s = np.array([[0.1], [0.2], [0.3]])
    f = lambda s: jnp.sum(jnp.sin(s))
    chunked = fc.filter_chunked_vmap(f, chunk_size=2, remainder=remainder)
    loss = lambda g: lambda s: jnp.sum(g(s))
    expected = jax.grad(loss(jax.vmap(f)))(s)
    assert tree_allclose(jax.grad(loss(chunked))(s), expected)
    tangent = np.cos(s)
    expected = jax.jvp(jax.vmap(f), (s,), (tangent,))
    assert tree_allclose(jax.jvp(chunked, (s,), (tangent,)), expected)


def _weak_types(tree: Any) -> list[bool]:
    return [jax.typeof(t).weak_type for t in jtu.tree_leaves(tree)]


def _derivatives(g: Any, p: Any, x: Any) -> tuple[Any, ...]:
    """`grad`, `vjp` with a strong cotangent, `jvp`, of `g(p, x)` (summed)."""
    out, pullback = jax.vjp(g, p, x)
    strong = jtu.tree_map(lambda o: jnp.ones(o.shape, o.dtype), out)
    loss = lambda p, x: sum(jnp.sum(o) for o in jtu.tree_leaves(g(p, x)))
    return (
        jax.grad(loss, (0, 1))(p, x),
        pullback(strong),
        jax.jvp(g, (p, x), (p, x))[1],
    )


@pytest.mark.parametrize(
    "remainder, checkpoint, batch_size, run",
    (
        # A remainder after two steps, eager; one step and a remainder, separate;
        # no remainder and no checkpoint. Under `jit` (one compilation, where eager
        # derivatives compile each primitive) the types are the traced program's,
        # as eager.
        pytest.param("overlap", True, 2 * CHUNK + 1, lambda f: f, id="eager"),
        pytest.param("separate", True, CHUNK + 1, jax.jit, id="separate-jit"),
        pytest.param("overlap", False, 2 * CHUNK, jax.jit, id="unchecked-jit"),
    ),
)
def test_weak_types_of_derivatives_match_jax(remainder, checkpoint, batch_size, run):
    # Issue 14 item 5. The whole grid: weak or strong, mapped `x` or unmapped `p`,
    # grad, vjp with a strong cotangent, and jvp, against `eqx.filter_vmap`. JAX
    # types a cotangent as the chunk function's transpose does, not like its
    # primal; the loop's slices, its sum over steps and its checkpoint must not
    # change that.
    funs = (
        (lambda p, x: jnp.tanh(x @ jnp.diag(p)), 0),  # a transpose with no weak type
        (lambda p, x: p * x, 0),  # one that keeps its operand's
        (lambda p, x: (p * x, jnp.sin(p) * 2.0), (0, None)),  # and an unbatched output
    )
    full = lambda weak, shape: (
        lax.broadcast(jnp.asarray(0.7), shape) if weak else jnp.full(shape, 0.7, float)
    )
    wrong = []
    for (f, out_axes), p_weak, x_weak in itertools.product(
        funs, (False, True), (False, True)
    ):
        p, x = full(p_weak, (3,)), full(x_weak, (batch_size, 3))
        chunked = fc.filter_chunked_vmap(
            f,
            in_axes=(None, 0),
            out_axes=out_axes,
            chunk_size=CHUNK,
            remainder=remainder,
            checkpoint=checkpoint,
        )
        oracle = eqx.filter_vmap(f, in_axes=(None, 0), out_axes=out_axes)
        derivatives = lambda g: run(ft.partial(_derivatives, g))(p, x)  # noqa: E731
        expected, actual = derivatives(oracle), derivatives(chunked)
        assert tree_allclose(actual, expected)  # the values are right
        if _weak_types(actual) != _weak_types(expected):
            wrong.append((f, p_weak, x_weak, _weak_types(actual)))
    assert not wrong


@jax.custom_vjp
def _clip_gradient(x):
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


@jax.custom_vjp
def _sqrt_with_clipped_gradient(x):
    return jnp.sqrt(x)


_sqrt_with_clipped_gradient.defvjp(
    lambda x: (jnp.sqrt(x), x),
    lambda x, g: (jnp.clip(g, -1.0, 1.0) * 0.5 / jnp.sqrt(x),),
)


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("batch_size", (2, 3, 4, 7, 8))
def test_custom_vjp_backward_not_linear_in_the_cotangent(remainder, batch_size):
    # Gradient clipping (JAX's own custom_vjp example) is not linear in the
    # cotangent: a row computed twice (the overlapping last chunk) must still get
    # its whole cotangent once, for a mapped input and an unmapped parameter.
    f = lambda p, x: 3.0 * _clip_gradient(jnp.sin(x * p))
    p, xs = jnp.asarray(2.0), jnp.linspace(0.0, 1.0, batch_size)

    def loss(vmap):
        return lambda p, x: jnp.sum(vmap(f, in_axes=(None, 0))(p, x) * 5.0)

    expected = jax.grad(loss(eqx.filter_vmap), argnums=(0, 1))(p, xs)
    chunked = ft.partial(fc.filter_chunked_vmap, chunk_size=3, remainder=remainder)
    actual = jax.grad(loss(chunked), argnums=(0, 1))(p, xs)
    assert tree_allclose(actual, expected)
    assert _weak_types(actual) == _weak_types(expected)
    # The same through the other transforms' loop.
    apply = lambda g, in_axes: fc.filter_chunked_apply(
        jax.vmap(g, in_axes=in_axes), in_axes=in_axes, chunk_size=3, remainder=remainder
    )
    assert tree_allclose(jax.grad(loss(apply), argnums=(0, 1))(p, xs), expected)


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_custom_vjp_with_an_infinite_derivative(remainder):
    # The derivative of sqrt at zero is infinite: no copy of a row may get a zero
    # cotangent (`0 * inf = nan`), with or without a custom_vjp in the function.
    for g in (_sqrt_with_clipped_gradient, jnp.sqrt):
        f = lambda p, x, g=g: g(x + p)
        p, xs = jnp.asarray(0.0), jnp.zeros(7)
        loss = lambda vmap, f=f: lambda p, x: jnp.sum(vmap(f, in_axes=(None, 0))(p, x))
        expected = jax.grad(loss(eqx.filter_vmap), argnums=(0, 1))(p, xs)
        chunked = ft.partial(fc.filter_chunked_vmap, chunk_size=3, remainder=remainder)
        actual = jax.grad(loss(chunked), argnums=(0, 1))(p, xs)
        assert not jnp.isnan(expected[0]) and jnp.isinf(expected[0])
        assert tree_allclose(actual, expected)


def test_custom_vjp_derivative_reports_progress_in_order():
    # The leftover, evaluated apart in the derivative, is the last step reported.
    meter = recorder()
    f = lambda x: _clip_gradient(jnp.sin(x))
    chunked = fc.filter_chunked_vmap(f, chunk_size=3, progress_meter=meter)
    x = jnp.linspace(0.0, 1.0, 10)
    loss = lambda vmap: lambda x: jnp.sum(vmap(x) ** 2)
    expected = jax.grad(loss(jax.vmap(f)))(x)
    assert tree_allclose(jax.jit(jax.grad(loss(chunked)))(x), expected)
    check_one_call(meter, "filter_chunked_vmap", 10)
    assert meter.counts() == [3, 6, 9, 10]


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_gradient_for_a_weakly_typed_parameter_is_strong(remainder):
    # Issue 14 item 5's examples: `x @ p` transposes to a strong cotangent for a
    # weakly typed unmapped `p`, as unchunked.
    p, x = jnp.full((3, 2), 0.5), jnp.ones((10, 3))
    assert jax.typeof(p).weak_type
    f = lambda p, x: jnp.tanh(x @ p)
    chunked = (
        fc.filter_chunked_apply(
            f, in_axes=(None, 0), chunk_size=4, remainder=remainder
        ),
        fc.filter_chunked_vmap(f, in_axes=(None, 0), chunk_size=3, remainder=remainder),
    )
    for g, oracle in zip(chunked, (f, eqx.filter_vmap(f, in_axes=(None, 0)))):
        grad = jax.grad(lambda p: jnp.sum(g(p, x)))(p)
        expected = jax.grad(lambda p: jnp.sum(oracle(p, x)))(p)
        assert tree_allclose(grad, expected)
        assert not jax.typeof(expected).weak_type
        assert not jax.typeof(grad).weak_type
