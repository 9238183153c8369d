"""Collectives over `axis_name` through the public transform: exact with one chunk
and across chunks (staged), refused where only a derivative rule holds them.

The staged evaluation itself is tested in `test_collectives_staged.py`."""

from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc

from .budgets import compiled_bytes
from .helpers import tree_allclose


_COLLECTIVES = {
    "psum": lambda x: x / lax.psum(x, "i"),
    "pmean": lambda x: x - lax.pmean(x, "i"),
    "pmax": lambda x: lax.pmax(x, "i"),
    "all_gather": lambda x: lax.all_gather(x, "i"),
    "axis_index": lambda x: x * lax.axis_index("i").astype(x.dtype),
    # Read from the axis size when tracing: no collective in the jaxpr.
    "axis_size": lambda x: x * lax.axis_size("i"),
    "psum-of-constant": lambda x: x * lax.psum(1, "i"),
    "psum-in-jit-and-cond": lambda x: jax.jit(
        lambda y: lax.cond(y[0] > 0, lambda z: lax.psum(z, "i"), lambda z: z, y)
    )(x),
}


@pytest.mark.parametrize("name", _COLLECTIVES)
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_exact_across_chunks(name, remainder):
    f = _COLLECTIVES[name]
    x = jnp.arange(1.0, 17.0).reshape(8, 2)
    expected = eqx.filter_vmap(f, axis_name="i")(x)
    chunked = fc.filter_chunked_vmap(
        f, axis_name="i", chunk_size=3, remainder=remainder
    )
    assert tree_allclose(chunked(x), expected)
    assert tree_allclose(jax.jit(chunked)(x), expected)


@pytest.mark.parametrize("name", _COLLECTIVES)
@pytest.mark.parametrize("chunk_size", (None, 8))
def test_one_chunk_matches_filter_vmap(name, chunk_size):
    f = _COLLECTIVES[name]
    x = jnp.arange(1.0, 17.0).reshape(8, 2)
    expected = eqx.filter_vmap(f, axis_name="i")(x)
    actual = fc.filter_chunked_vmap(f, axis_name="i", chunk_size=chunk_size)(x)
    assert tree_allclose(actual, expected)


def test_no_collective_is_chunked(getkey):
    x = jr.normal(getkey(), (8, 2))
    f = lambda x: jnp.sin(x) * lax.pmean(2.0, "i")  # does not read the axis
    expected = eqx.filter_vmap(f, axis_name="i")(x)
    actual = fc.filter_chunked_vmap(f, axis_name="i", chunk_size=3)(x)
    assert tree_allclose(actual, expected)


def test_collective_over_an_outer_axis(getkey):
    x = jr.normal(getkey(), (3, 8))
    inner = lambda e: e + lax.psum(e, "j")
    chunked = fc.filter_chunked_vmap(inner, axis_name="i", chunk_size=3)
    oracle = eqx.filter_vmap(inner, axis_name="i")
    expected = jax.vmap(oracle, axis_name="j")(x)
    assert tree_allclose(jax.vmap(chunked, axis_name="j")(x), expected)
    for chunk_size in (3, 2):  # the outer map in one chunk, then staged
        outer = fc.filter_chunked_vmap(chunked, axis_name="j", chunk_size=chunk_size)
        assert tree_allclose(outer(x), expected)


@jax.custom_vjp
def _sync_vjp(x):
    return x


_sync_vjp.defvjp(lambda x: (x, None), lambda _, g: (lax.psum(g, "i"),))


@jax.custom_jvp
def _sync_jvp(x):
    return x


@_sync_jvp.defjvp
def _sync_jvp_rule(primals, tangents):
    return primals[0], lax.psum(tangents[0], "i")


_CUSTOM_RULES = {"custom_vjp": _sync_vjp, "custom_jvp": _sync_jvp}
_REFUSED = (
    r"`filter_chunked_vmap\(\.\.\., axis_name='i'\)`: the collective\(s\) "
    r"`lax.psum` over 'i' are performed only by a custom derivative rule"
)


@pytest.mark.parametrize("rule", _CUSTOM_RULES)
@pytest.mark.parametrize("jit", (False, True))
def test_collective_in_a_custom_derivative_rule_is_refused(rule, jit):
    # The example: only the derivative holds the collective.
    f = _CUSTOM_RULES[rule]
    xs = jnp.linspace(0.5, 2.0, 10)
    grad = jax.grad(
        lambda x: fc.filter_chunked_vmap(f, axis_name="i", chunk_size=3)(x).sum()
    )
    with pytest.raises(ValueError, match=_REFUSED):
        (jax.jit(grad) if jit else grad)(xs)
    oracle = jax.grad(lambda x: eqx.filter_vmap(f, axis_name="i")(x).sum())
    one_chunk = jax.grad(
        lambda x: fc.filter_chunked_vmap(f, axis_name="i", chunk_size=10)(x).sum()
    )
    assert tree_allclose(one_chunk(xs), oracle(xs))


@pytest.mark.parametrize("rule", _CUSTOM_RULES)
@pytest.mark.parametrize("closed_over", (False, True))
def test_collective_in_a_parameter_only_rule_is_refused(rule, closed_over):
    # The rule applies to an unmapped parameter, argument or closed over.
    f = _CUSTOM_RULES[rule]
    xs, w = jnp.linspace(0.5, 2.0, 10), jnp.array(1.5)
    if closed_over:
        chunked = lambda w: fc.filter_chunked_vmap(
            lambda x: f(w) * x, axis_name="i", chunk_size=3
        )(xs)
    else:
        chunked = lambda w: fc.filter_chunked_vmap(
            lambda w, x: f(w) * x, in_axes=(None, 0), axis_name="i", chunk_size=3
        )(w, xs)
    with pytest.raises(ValueError, match=_REFUSED):
        jax.grad(lambda w: chunked(w).sum())(w)


@pytest.mark.parametrize("jit", (False, True))
def test_no_false_positive_without_collectives(jit, getkey):
    # Derivatives of plain functions (and of a custom rule without collectives)
    # hold no collective; a non-differentiable function is no error either.
    x, w = jr.normal(getkey(), (10,)), jnp.array(0.7)
    plain = lambda w, x: jnp.sin(w * x) * jax.nn.relu(x)
    custom = lambda w, x: jax.nn.softplus(w * x) + jnp.linalg.norm(x * w)
    for f in (plain, custom):
        kwargs: dict[str, Any] = dict(in_axes=(None, 0), axis_name="i")
        chunked = fc.filter_chunked_vmap(f, chunk_size=3, **kwargs)
        loss = lambda m: lambda w: jnp.sum(m(w, x) ** 2)
        grad = jax.grad(loss(chunked))
        expected = jax.grad(loss(eqx.filter_vmap(f, **kwargs)))(w)
        assert tree_allclose((jax.jit(grad) if jit else grad)(w), expected)
    count = lambda n: lax.while_loop(lambda i: i < n, lambda i: i + 1, 0)
    n = jnp.arange(10)
    expected = eqx.filter_vmap(count, axis_name="i")(n)
    assert tree_allclose(
        fc.filter_chunked_vmap(count, axis_name="i", chunk_size=3)(n), expected
    )


# Shapes that only work at the full axis size: the collective must be found before
# tracing `fun` at any other size.
_SIZED = {
    "all_gather": (lambda e: lax.all_gather(e, "i").reshape(20)[:2] + e, (10, 2)),
    "all_to_all": (lambda e: lax.all_to_all(e, "i", 0, 0), (10, 10)),
    "psum_scatter": (lambda e: lax.psum_scatter(e, "i"), (10, 10)),
}


@pytest.mark.parametrize("name", _SIZED)
@pytest.mark.parametrize("jit", (False, True))
def test_size_dependent_shapes_are_exact(name, jit):
    f, shape = _SIZED[name]
    x = jnp.arange(float(np.prod(shape))).reshape(shape)
    chunked = fc.filter_chunked_vmap(f, axis_name="i", chunk_size=3)
    expected = eqx.filter_vmap(f, axis_name="i")(x)
    assert tree_allclose((jax.jit(chunked) if jit else chunked)(x), expected)


def test_numpy_random_numbers_at_trace_time_are_not_axis_size():
    # Two traces at the same size already differ: that says nothing about the size.
    rng = np.random.default_rng(0)
    f = lambda e: e * rng.uniform(1.0, 2.0)
    x = jnp.arange(1.0, 21.0).reshape(10, 2)
    out = fc.filter_chunked_vmap(f, axis_name="i", chunk_size=3)(x)
    # One trace-time number for the whole batch, as `eqx.filter_vmap` draws.
    scale = out[0, 0] / x[0, 0]
    assert tree_allclose(out, x * scale)
    expected = eqx.filter_vmap(f, axis_name="i")(x)
    assert tree_allclose(out.shape, expected.shape)


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_budget_measures_the_staged_program(remainder, getkey):
    # The budget's search compiles the staged loops: the call fits, evaluated and
    # under `jax.grad`, with every value the user varies an argument.
    x = jr.normal(getkey(), (48, 24))
    f = lambda e: jnp.tanh(jnp.outer(e, e)) @ e / lax.psum(jnp.sum(e**2), "i")
    loss = lambda g: lambda x: jnp.sum(g(x) ** 2)
    whole = fc.filter_chunked_vmap(f, axis_name="i")
    budget = compiled_bytes(jax.grad(loss(whole)), x) // 2
    chunked = fc.filter_chunked_vmap(
        f, axis_name="i", chunk_size=fc.MemoryBudget(budget), remainder=remainder
    )
    assert compiled_bytes(chunked, x) <= budget
    assert compiled_bytes(jax.grad(loss(chunked)), x) <= budget
    assert tree_allclose(chunked(x), eqx.filter_vmap(f, axis_name="i")(x))
    expected = jax.grad(loss(eqx.filter_vmap(f, axis_name="i")))(x)
    assert tree_allclose(jax.grad(loss(chunked))(x), expected)
