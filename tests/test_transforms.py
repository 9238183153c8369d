"""Composition with `jit`, autodiff, `vmap` and itself; tracing and compiling once."""

from typing import Any

import equinox as eqx
import jax
import jax.monitoring
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc

from .helpers import count_compiles, tree_allclose


def _f(x, w):
    return jnp.tanh(x @ w), jnp.sum(jnp.log1p(x**2)), jnp.cos(w)


def _maps(chunk_size, remainder: Any = "overlap"):
    kwargs: dict[str, Any] = dict(in_axes=(0, None), out_axes=(0, 0, None))
    chunked = fc.filter_chunked_vmap(
        _f, chunk_size=chunk_size, remainder=remainder, **kwargs
    )
    return chunked, eqx.filter_vmap(_f, **kwargs)


def _inputs(getkey, batch_size=5):
    return jr.normal(getkey(), (batch_size, 3)), jr.normal(getkey(), (3, 2))


@pytest.mark.parametrize("jit", (jax.jit, eqx.filter_jit))
def test_jit(jit, getkey):
    x, w = _inputs(getkey)
    chunked, oracle = _maps(2)
    assert tree_allclose(jit(chunked)(x, w), oracle(x, w))


@pytest.mark.parametrize("chunk_size", (2, 5))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_grad_and_vjp(chunk_size, remainder, getkey):
    x, w = _inputs(getkey)
    chunked, oracle = _maps(chunk_size, remainder)
    loss = lambda m: lambda x, w: sum(jnp.sum(o**2) for o in m(x, w))
    grads = jax.grad(loss(chunked), argnums=(0, 1))(x, w)
    assert tree_allclose(grads, jax.grad(loss(oracle), argnums=(0, 1))(x, w))

    out, pullback = jax.vjp(chunked, x, w)
    out_, pullback_ = jax.vjp(oracle, x, w)
    assert tree_allclose(out, out_)
    cotangent = jax.tree.map(lambda o: jr.normal(getkey(), o.shape, o.dtype), out)
    assert tree_allclose(pullback(cotangent), pullback_(cotangent))


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_jvp(remainder, getkey):
    x, w = _inputs(getkey)
    tangents = (jr.normal(getkey(), x.shape), jr.normal(getkey(), w.shape))
    chunked, oracle = _maps(2, remainder)
    actual = jax.jvp(chunked, (x, w), tangents)
    assert tree_allclose(actual, jax.jvp(oracle, (x, w), tangents))


def test_vmap_of_chunked_map(getkey):
    x = jr.normal(getkey(), (4, 5, 3))
    w = jr.normal(getkey(), (4, 3, 2))
    chunked, oracle = _maps(2)
    assert tree_allclose(jax.vmap(chunked)(x, w), jax.vmap(oracle)(x, w))
    in_axes = (1, None)
    assert tree_allclose(
        jax.vmap(chunked, in_axes=in_axes)(x, w[0]),
        jax.vmap(oracle, in_axes=in_axes)(x, w[0]),
    )


def test_chunked_map_inside_chunked_map(getkey):
    x = jr.normal(getkey(), (4, 5, 3))
    w = jr.normal(getkey(), (3, 2))
    chunked, oracle = _maps(2)
    outer = fc.filter_chunked_vmap(chunked, in_axes=(0, None), chunk_size=3)
    expected = eqx.filter_vmap(oracle, in_axes=(0, None))(x, w)
    assert tree_allclose(outer(x, w), expected)
    grad = lambda m: jax.grad(lambda w: jnp.sum(m(x, w)[0]))(w)
    assert tree_allclose(grad(outer), grad(eqx.filter_vmap(oracle, in_axes=(0, None))))


def test_chunking_per_example_gradients(getkey):
    x, w = _inputs(getkey, batch_size=7)
    per_example = jax.grad(lambda w, x: jnp.sum(_f(x, w)[0]))
    in_axes = (None, 0)
    expected = eqx.filter_vmap(per_example, in_axes=in_axes)(w, x)
    actual = fc.filter_chunked_vmap(per_example, in_axes=in_axes, chunk_size=3)(w, x)
    assert tree_allclose(actual, expected)


def test_jit_does_not_retrace(getkey):
    x, w = _inputs(getkey)
    chunked, oracle = _maps(2)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def run(x, w, tag):
        del tag
        return chunked(x, w)

    for _ in range(3):
        actual = run(x + 1.0, w, "same static leaf")
    assert tree_allclose(actual, oracle(x + 1.0, w))  # pyright: ignore[reportPossiblyUnboundVariable]


def test_eager_calls_do_not_recompile(getkey):
    x, w = _inputs(getkey)
    x2 = x * 2.0
    traces = []

    def f(x, w, scale):
        traces.append(None)
        return _f(x, w)[0] * scale

    chunked = fc.filter_chunked_vmap(f, in_axes=(0, None, None), chunk_size=2)
    chunked(x, w, 2.0)
    with count_compiles() as compiles:
        for x_ in (x, x2, x):
            out = chunked(x_, w, 2.0)
    assert compiles == []
    # Eager calls trace again (that is how closed-over values stay fresh), but
    # a bounded number of times per call.
    assert len(traces) <= 4 * 4
    expected = eqx.filter_vmap(f, in_axes=(0, None, None))(x, w, 2.0)
    assert tree_allclose(out, expected)  # pyright: ignore[reportPossiblyUnboundVariable]
    # A new value of a static (non-array) leaf does compile again, as in `jit`.
    with count_compiles() as compiles:
        chunked(x, w, 3.0)
    assert len(compiles) == 1


def test_eager_calls_see_new_closed_over_values(getkey):
    # `jax.jit` would cache on the function and reuse the first call's `scale`
    # and `w`; an eager chunked call must behave like `eqx.filter_vmap` instead.
    x = jr.normal(getkey(), (5, 3))
    state = {"scale": 2.0, "w": jnp.ones(3)}
    f = lambda x: jnp.dot(x, state["w"]) * state["scale"]
    chunked = fc.filter_chunked_vmap(f, chunk_size=2)
    for scale, w in ((2.0, jnp.ones(3)), (3.0, jnp.ones(3)), (3.0, jnp.arange(3.0))):
        state.update(scale=scale, w=w)
        assert tree_allclose(chunked(x), eqx.filter_vmap(f)(x))


def test_eager_calls_reuse_the_compilation_for_new_closed_over_arrays(getkey):
    x = jr.normal(getkey(), (5, 3))
    state = {"w": jnp.ones(3)}
    chunked = fc.filter_chunked_vmap(lambda x: jnp.dot(x, state["w"]), chunk_size=2)
    chunked(x)
    with count_compiles() as compiles:
        state["w"] = jnp.arange(3.0)
        out = chunked(x)
    assert compiles == []
    assert tree_allclose(out, x @ jnp.arange(3.0))
