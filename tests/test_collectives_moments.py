"""A variance about a mean over the batch, summed in the mean's pass about a shift
(`filtered_chunk/_staged/_moments.py`), against `eqx.filter_vmap`: one pass per
BatchNorm where there were two, the same values and derivatives, and exactly the
functions of that form recognised."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import tree_allclose
from .staged_cases import num_passes, staged_call, vmap_call


K = 4


class _Net(eqx.Module):
    """`depth` blocks of `Linear`, ReLU and `BatchNorm(mode="batch")`."""

    layers: tuple
    norms: tuple

    def __init__(self, depth, width, key, dtype=None):
        keys = jr.split(key, depth + 1)
        sizes = (3,) + (width,) * depth + (2,)
        self.layers = tuple(
            eqx.nn.Linear(a, b, key=k, dtype=dtype)
            for a, b, k in zip(sizes, sizes[1:], keys)
        )
        self.norms = tuple(
            eqx.nn.BatchNorm(width, "i", mode="batch", dtype=dtype)
            for _ in range(depth)
        )

    def __call__(self, x, state):
        for layer, norm in zip(self.layers[:-1], self.norms):
            x, state = norm(jax.nn.relu(layer(x)), state)
        return self.layers[-1](x), state


_KWARGS: dict = dict(in_axes=(0, None), out_axes=(0, None), axis_name="i")


def _model_call(depth):
    def fun(m, u):
        (x,), (model, state) = m, u
        out, new_state = model(x, state)
        return [out], jax.tree.leaves(new_state)

    return fun


@pytest.mark.parametrize("depth", (1, 3))
def test_one_pass_per_batch_norm(depth, getkey):
    # Each BatchNorm's mean and variance take one pass, not two.
    model, state = eqx.nn.make_with_state(_Net)(depth, 5, getkey())
    x = jr.normal(getkey(), (10, 3))
    assert num_passes(_model_call(depth), [x], [model, state], K) == depth


@pytest.mark.parametrize("batch_size", (1, K - 1, K, K + 1, 2 * K + 1))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("keep", (False, True))
def test_batch_norm_values_state_and_gradients(batch_size, remainder, keep, getkey):
    model, state = eqx.nn.make_with_state(_Net)(2, 5, getkey())
    # Far from zero, so that a variance summed about a poor shift would show.
    x = 30.0 + jr.normal(getkey(), (batch_size, 3))
    options = dict(chunk_size=K, remainder=remainder, keep_boundaries=keep)
    chunked_of = lambda m: fc.filter_chunked_vmap(m, **options, **_KWARGS)
    oracle_of = lambda m: eqx.filter_vmap(m, **_KWARGS)
    assert tree_allclose(
        eqx.filter_jit(chunked_of(model))(x, state), oracle_of(model)(x, state)
    )

    def loss(m, apply):
        out, _ = apply(m)(x, state)
        return jnp.sum(jnp.tanh(out))

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    assert tree_allclose(grad(model, chunked_of), grad(model, oracle_of))


def _by_hand(kind):
    """A normalisation whose variance about the batch's mean is written as `kind`;
    each keeps its mean and variance in one pass."""

    def fun(m, u):
        (x,), (w,) = m, u
        y = jnp.tanh(x * w) + x
        if kind == "conv":  # channels first, the mean over the other axes
            mean = lax.pmean(jnp.mean(y, axis=(1, 2)), "i")
            d = y - mean[:, None, None]
            var = lax.pmean(jnp.mean(d * jnp.conj(d), axis=(1, 2)), "i")
            out = d * lax.rsqrt(var + 1.0)[:, None, None]
            return [out], [mean, var]
        mean = lax.pmean(y, "i")
        if kind == "square":
            var = lax.pmean(jnp.square(y - mean), "i")
        elif kind == "power":
            var = lax.pmean((y - mean) ** 2, "i")
        elif kind == "conj":  # complex: the squared modulus
            var = lax.pmean((y - mean) * jnp.conj(y - mean), "i")
        else:  # a sum over the positions, not a mean: scaled by their number
            mean = lax.pmean(jnp.mean(y), "i")
            var = lax.pmean(jnp.sum((y - mean) ** 2), "i")
        return [(y - mean) / jnp.sqrt(var + 1.0)], [mean, var]

    return fun


@pytest.mark.parametrize(
    "kind, shape, dtype",
    [
        ("conv", (3, 4, 5), jnp.float64),
        ("square", (3,), jnp.float64),
        ("power", (3,), jnp.complex128),
        ("conj", (3,), jnp.complex128),
        ("conv", (3, 4, 5), jnp.complex128),
        ("sum", (3,), jnp.float64),
        ("conv", (3, 4, 5), jnp.float32),
    ],
)
@pytest.mark.parametrize("batch_size", (K - 1, 2 * K + 1))
def test_written_by_hand(kind, shape, dtype, batch_size, getkey):
    x = jr.normal(getkey(), (batch_size, *shape), dtype) + 7.0
    w = jr.normal(getkey(), shape, dtype)
    fun = _by_hand(kind)
    if batch_size > K:
        # Complex means are divided part by part from jax 0.12.1: still one pass.
        assert num_passes(fun, [x], [w], K) == 1
    expected = vmap_call(fun, [x], [w])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=1e-10)
    assert tree_allclose(staged_call(fun, [x], [w], K), expected, **tol)

    def loss(_x, _w, apply):
        out, unmapped = apply(_x, _w)
        return jnp.sum(jnp.abs(out[0]) ** 2) + sum(
            jnp.sum(jnp.abs(u)) for u in unmapped
        )

    chunked = lambda _x, _w: staged_call(fun, [_x], [_w], K)
    oracle = lambda _x, _w: vmap_call(fun, [_x], [_w])
    grads = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
    assert tree_allclose(grads(x, w, chunked), grads(x, w, oracle), **tol)


def _not_a_variance(kind):
    def fun(m, u):
        (x,), (w,) = m, u
        y = x * w
        mean = lax.pmean(y, "i")
        if kind == "other values":  # the deviations of other values from the mean
            var = lax.pmean((x - mean) ** 2, "i")
        elif kind == "cubed":
            var = lax.pmean((y - mean) ** 3, "i")
        elif kind == "mean over fewer axes":  # the means over different axes
            mean = lax.pmean(jnp.mean(y, axis=0), "i")[None]
            var = lax.pmean(jnp.mean((y - mean) ** 2), "i")
        elif kind == "sum, not mean":  # `psum`: not the mean it deviates from
            mean = lax.psum(y, "i")
            var = lax.pmean((y - mean) ** 2, "i")
        else:  # a product of the deviations of two values
            var = lax.pmean((y - mean) * (x - mean), "i")
        return [(y - mean) * var], []

    return fun


@pytest.mark.parametrize(
    "kind",
    ["other values", "cubed", "mean over fewer axes", "sum, not mean", "two values"],
)
def test_other_forms_keep_their_own_pass(kind, getkey):
    # Where the cross terms need not vanish, the variance takes its own pass.
    x = jr.normal(getkey(), (2 * K + 1, 2, 3)) + 5.0
    w = jr.normal(getkey(), (2, 3))
    fun = _not_a_variance(kind)
    assert num_passes(fun, [x], [w], K) == 2
    assert tree_allclose(staged_call(fun, [x], [w], K), vmap_call(fun, [x], [w]))


@pytest.mark.parametrize("offset", (0.0, 1e3, 1e5))
@pytest.mark.parametrize("order", ("random", "sorted"))
def test_rounding_far_from_zero(offset, order, getkey):
    # In float32, with values `offset` away from zero: the error against float64
    # is within a few times `jax.vmap`'s own, where `E[y^2] - E[y]^2` (what a
    # single pass without a shift would compute) loses every digit at 1e5; also
    # for a batch sorted so that its first chunks are unlike the rest.
    model, state = eqx.nn.make_with_state(_Net)(2, 6, getkey(), dtype=jnp.float32)
    x = (offset + jr.normal(getkey(), (200, 3))).astype(jnp.float32)
    if order == "sorted":
        x = x[jnp.argsort(x[:, 0])]
    wide = lambda t: jax.tree.map(
        lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, t
    )
    exact = eqx.filter_vmap(wide(model), **_KWARGS)(wide(x), wide(state))[0]
    vmapped = eqx.filter_vmap(model, **_KWARGS)(x, state)[0]
    chunked = fc.filter_chunked_vmap(model, chunk_size=5, **_KWARGS)(x, state)[0]
    error = lambda y: float(jnp.max(jnp.abs(y.astype(jnp.float64) - exact)))
    assert error(chunked) <= 4 * error(vmapped) + 1e-5

    # The first BatchNorm's input, as a single pass would compute its variance.
    y = jax.nn.relu(jax.vmap(model.layers[0])(x))
    naive = (jnp.mean(y * y, 0) - jnp.mean(y, 0) ** 2).astype(jnp.float64)
    variance = jnp.var(wide(y), 0)
    if offset == 1e5:
        assert float(jnp.max(jnp.abs(naive - variance))) > float(jnp.max(variance))


def test_jvp_outer_vmap_and_hessian(getkey):
    fun = _by_hand("conv")
    x = jr.normal(getkey(), (3, 2 * K + 1, 2, 2, 3)) + 4.0
    w = jr.normal(getkey(), (2, 2, 3))
    tx = jr.normal(getkey(), x.shape)

    def out_of(apply):
        return lambda _x, _w: apply(_x, _w)[0][0]

    chunked = out_of(lambda _x, _w: staged_call(fun, [_x], [_w], K))
    oracle = out_of(lambda _x, _w: vmap_call(fun, [_x], [_w]))
    # An outer `vmap` over the first axis, forward mode through it.
    outer = lambda f: jax.vmap(f, in_axes=(0, None))
    jvp = lambda f: jax.jvp(lambda _x: outer(f)(_x, w), (x,), (tx,))
    assert tree_allclose(jvp(chunked), jvp(oracle), rtol=1e-9)
    # Second derivatives w.r.t. the unmapped weights: the shift has none, and the
    # identity holds for every input, so they are `jax.vmap`'s.
    scalar = lambda f: lambda _w: jnp.sum(jnp.sin(f(x[0], _w)))
    hess = lambda f: jax.hessian(scalar(f))(w)
    assert tree_allclose(hess(chunked), hess(oracle), rtol=1e-8, atol=1e-10)


def test_shift_is_not_kept(getkey):
    # With boundaries kept, the values the pass computes about the shift (the
    # deviations) are not written for the final pass, which recomputes them about
    # the mean: every output is `jax.vmap`'s, including the deviations themselves.
    def fun(m, u):
        (x,), _ = m, u
        mean = lax.pmean(x, "i")
        d = x - mean
        var = lax.pmean(d * d, "i")
        return [d, d * lax.rsqrt(var + 1.0)], [var]

    x = jr.normal(getkey(), (2 * K + 1, 3)) + 100.0
    expected = vmap_call(fun, [x], [])
    actual = staged_call(fun, [x], [], K, keep_boundaries=True)
    assert tree_allclose(actual, expected)
    assert np.all(np.abs(np.asarray(actual[0][0]).mean(0)) < 1e-9)


@pytest.mark.parametrize("keep", (False, True))
def test_inside_cond_and_scan(keep, getkey):
    # The BatchNorm MLP (a pass a BatchNorm) inside `lax.cond` (both branches)
    # and a `lax.scan` whose carry shifts the next step's inputs: values, the new
    # state and gradients through both, under `jit`.
    model, state = eqx.nn.make_with_state(_Net)(2, 5, getkey())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = 20.0 + jr.normal(getkey(), (7, 3))
    options = dict(chunk_size=3, keep_boundaries=keep)

    def program(wrap):
        def _loss(_params, c):
            call = wrap(eqx.combine(_params, static))
            out, new_state = lax.cond(
                c > 0, lambda: call(x, state), lambda: call(2 * x, state)
            )

            def _step(carry, scale):
                y, _ = call(x * scale + carry, state)
                return carry + y.mean(), y

            _, ys = lax.scan(_step, 0.0, jnp.array([1.0, 0.5]))
            return jnp.sum(out**2) + jnp.sum(jnp.sin(ys)), (out, new_state, ys)

        return jax.jit(jax.value_and_grad(_loss, has_aux=True))

    chunked = program(lambda m: fc.filter_chunked_vmap(m, **options, **_KWARGS))
    oracle = program(lambda m: eqx.filter_vmap(m, **_KWARGS))
    for c in (1.0, -1.0):
        assert tree_allclose(chunked(params, c), oracle(params, c))


def test_weakly_typed_input():
    # JAX converts a weakly typed `y` to a strong one where it meets the strong
    # result of a `psum` (`y - m`): the deviations are of the same values, and
    # the variance takes its mean's pass.
    def fun(m, u):
        (x,), _ = m, u
        return [lax.pmean((x - lax.pmean(x, "i")) ** 2, "i") * x], []

    x = lax.full((2 * K + 1,), 30.5).at[::3].set(32.0)
    assert jax.typeof(x).weak_type
    assert num_passes(fun, [x], [], K) == 1
    assert tree_allclose(staged_call(fun, [x], [], K), vmap_call(fun, [x], []))


def _var(x):
    m = lax.pmean(x, "i")
    return lax.pmean((x - m) ** 2, "i")


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.float64))
@pytest.mark.parametrize("value", (0.1, 3.3, 1e4 + 0.1))
def test_variance_of_a_constant_batch_is_not_negative(dtype, value):
    # Each term of the written form is a square, so its mean is never negative
    # and a standard deviation never NaN (the shifted sum less its correction
    # once gave -1.4e-16 here); it is rounding alone, as `jax.vmap`'s.
    std = lambda x: jnp.sqrt(_var(x))
    eps = float(jnp.finfo(dtype).eps)
    for batch_size, chunk_size in ((10, 3), (13, 1), (100, 7)):
        x = jnp.full((batch_size,), value, dtype)
        out = fc.filter_chunked_vmap(std, axis_name="i", chunk_size=chunk_size)(x)
        assert out.dtype == dtype and bool(jnp.all(jnp.isfinite(out)))
        assert float(jnp.max(out)) <= 4 * eps * value
        assert num_passes(lambda m, u: ([_var(m[0])], []), [x], [], chunk_size) == 1


@pytest.mark.parametrize("dtype, offset", ((jnp.float32, 1e4), (jnp.float64, 1e8)))
@pytest.mark.parametrize("chunk_size", (1, 7, 256))
def test_variance_far_from_zero(dtype, offset, chunk_size):
    # A small spread far from zero, in random order: the variance's error against
    # float64 is `jax.vmap`'s, plus that of adding the chunks' partial sums one
    # after another (`docs/collectives.md`). It was first order in the mean's
    # rounding: 2.3e-3 at chunks of 1 in float32, where `jax.vmap` has 1.1e-6.
    x = jnp.asarray(offset + np.random.default_rng(0).standard_normal(1000), dtype)
    exact = float(np.var(np.asarray(x, np.float64)))
    error = lambda v: abs(float(v[0]) - exact) / exact
    vmapped = error(jax.vmap(_var, axis_name="i")(x))
    chunked = fc.filter_chunked_vmap(_var, axis_name="i", chunk_size=chunk_size)(x)
    num_chunks = -(-1000 // chunk_size)
    eps = float(jnp.finfo(dtype).eps)
    assert error(chunked) <= vmapped + 2 * eps * num_chunks**0.5
