"""`in_axes`: which axis of each input is the batch, or `None` to broadcast it."""

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import tree_allclose


def _f(x, y, z):
    return {"x": jnp.cumsum(x), "y": y[0] * jnp.sum(x), "z": jnp.sum(z) + y[1]}


@pytest.mark.parametrize(
    "in_axes",
    (
        (0, 0, 0),
        (1, -2, -1),
        (-1, 0, None),
        (None, 1, 0),
        (eqx.if_array(1), 0, eqx.if_array(-1)),
        lambda leaf: leaf.ndim - 1 if eqx.is_array(leaf) else None,
    ),
)
def test_axes_match_jax_vmap(in_axes, getkey):
    x = jr.normal(getkey(), (5, 5))
    y = jr.normal(getkey(), (5, 5, 5))
    z = jr.normal(getkey(), (5, 5))
    expected = eqx.filter_vmap(_f, in_axes=in_axes)(x, y, z)
    actual = fc.filter_chunked_vmap(_f, in_axes=in_axes, chunk_size=2)(x, y, z)
    assert tree_allclose(actual, expected)
    if isinstance(in_axes, tuple) and all(
        type(a) in (int, type(None)) for a in in_axes
    ):
        assert tree_allclose(actual, jax.vmap(_f, in_axes=in_axes)(x, y, z))


def test_prefix_tree(getkey):
    params = {"w": jr.normal(getkey(), (3, 5)), "b": jr.normal(getkey(), (3,))}
    x = jr.normal(getkey(), (5, 3))
    f = lambda p, x: p["w"].T @ x + jnp.sum(p["b"])
    in_axes = ({"w": 1, "b": None}, 0)
    expected = eqx.filter_vmap(f, in_axes=in_axes)(params, x)
    actual = fc.filter_chunked_vmap(f, in_axes=in_axes, chunk_size=2)(params, x)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("chunk_size", (2, None))
def test_dict_in_axes(chunk_size, getkey):
    x = jr.normal(getkey(), (5, 3))
    w = jr.normal(getkey(), (3,))

    def f(x, w, scale):
        return x @ w * scale

    in_axes = dict(w=None)
    expected = eqx.filter_vmap(f, in_axes=in_axes)(x, w, 2.0)
    actual = fc.filter_chunked_vmap(f, in_axes=in_axes, chunk_size=chunk_size)(
        x, w, 2.0
    )
    assert tree_allclose(actual, expected)


def test_numpy_and_prng_key_leaves(getkey):
    x = np.asarray(jr.normal(getkey(), (3, 5)))
    keys = jr.split(getkey(), (1, 5))  # mapped along axis 1, like any array
    scale = np.float64(0.5)  # a NumPy scalar is an array: map it only with `None`
    f = lambda x, k, s: x * s + jr.normal(k[0], ())
    in_axes = (eqx.if_array(-1), 1, None)
    expected = eqx.filter_vmap(f, in_axes=in_axes)(x, keys, scale)
    actual = fc.filter_chunked_vmap(f, in_axes=in_axes, chunk_size=2)(x, keys, scale)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("chunk_size", (None, 2))
def test_unmapped_leaves_are_closed_over(chunk_size, getkey):
    x = jr.normal(getkey(), (5,))
    w = jr.normal(getkey(), (3,))
    marker = object()
    seen = []

    def f(x, w, m):
        seen.append((w, m))
        return x * w

    g = fc.filter_chunked_vmap(f, in_axes=(0, None, None), chunk_size=chunk_size)
    expected = eqx.filter_vmap(f, in_axes=(0, None, None))(x, w, marker)
    assert tree_allclose(g(x, w, marker), expected)
    assert seen and all(m is marker for _, m in seen)
    if chunk_size is None:
        assert all(s is w for s, _ in seen)
    else:
        # Documented: an eager call that chunks is compiled with `eqx.filter_jit`,
        # so the unmapped array reaches `fun` as a tracer.
        assert all(isinstance(s, jax.core.Tracer) for s, _ in seen[2:])


@pytest.mark.parametrize("chunk_size", (None, 2, 3))
def test_axis_size_when_nothing_is_mapped(chunk_size, getkey):
    w = jr.normal(getkey(), (3,))
    f = lambda w: (w * 2, jnp.sum(w))
    expected = eqx.filter_vmap(f, in_axes=None, axis_size=5)(w)
    actual = fc.filter_chunked_vmap(
        f, in_axes=None, axis_size=5, chunk_size=chunk_size
    )(w)
    assert tree_allclose(actual, expected)


def test_axis_size_consistent_with_inputs(getkey):
    x = jr.normal(getkey(), (5, 3))
    expected = eqx.filter_vmap(jnp.sum, axis_size=5)(x)
    actual = fc.filter_chunked_vmap(jnp.sum, axis_size=5, chunk_size=2)(x)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("bound", (False, True))
def test_fun_is_never_mapped(bound, getkey):
    # The MLP's weights have a leading axis of size 5 too: they must not be mapped.
    mlp = eqx.nn.MLP(5, 2, 5, 1, key=getkey())
    fun = mlp.__call__ if bound else mlp
    x = jr.normal(getkey(), (5, 5))
    expected = eqx.filter_vmap(fun)(x)
    actual = fc.filter_chunked_vmap(fun, chunk_size=2)(x)
    assert tree_allclose(actual, expected)
    assert tree_allclose(actual, jax.vmap(mlp)(x))


def _numpy_only(leaf):
    return 0 if isinstance(leaf, np.ndarray) else None


@pytest.mark.parametrize("chunk_size", (None, 3))
def test_in_axes_callable_sees_the_callers_leaves(chunk_size):
    # Resolved once, on the leaves as passed: a NumPy array is mapped, a JAX array
    # is not, also when the chunked call is compiled (and `fun` sees tracers).
    f = lambda x, y: x + y
    x, y = np.arange(30.0).reshape(10, 3), jnp.ones(3)
    expected = eqx.filter_vmap(f, in_axes=_numpy_only)(x, y)
    actual = fc.filter_chunked_vmap(f, in_axes=_numpy_only, chunk_size=chunk_size)
    assert tree_allclose(actual(x, y), expected)
    g = lambda x, y: x + y[None]
    apply = fc.filter_chunked_apply(g, in_axes=_numpy_only, chunk_size=chunk_size)
    assert tree_allclose(apply(x, y), g(x, y))
