"""The chunked map against its oracles: `eqx.filter_vmap`, `jax.vmap`, `lax.map`."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import chunkings, tree_allclose


@pytest.mark.parametrize(
    "batch_size, chunk_size, remainder",
    [(n, *c) for n in (0, 1, 2, 3, 4, 7) for c in chunkings(n, (1, 3, 8))],
)
@pytest.mark.parametrize("out_axis", (0, 1, -1))
def test_matches_filter_vmap(batch_size, chunk_size, out_axis, remainder, getkey):
    x = jr.normal(getkey(), (batch_size, 3))
    f = lambda x, n: (jnp.outer(x, x) * n, "static")
    kwargs: dict[str, Any] = dict(in_axes=(0, None), out_axes=eqx.if_array(out_axis))
    expected = eqx.filter_vmap(f, **kwargs)(x, 2.0)
    actual = fc.filter_chunked_vmap(
        f, chunk_size=chunk_size, remainder=remainder, **kwargs
    )(x, 2.0)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("in_axis", (0, 1, -1, None))
@pytest.mark.parametrize("chunk_size", (2, 5))
def test_matches_jax_vmap(in_axis, chunk_size, getkey):
    x = jr.normal(getkey(), (5, 5, 5))
    y = jr.normal(getkey(), (5, 3))
    f = lambda x, y: (jnp.tanh(x) * y[0], y * 2)
    in_axes = (in_axis, 0)
    expected = jax.vmap(f, in_axes=in_axes)(x, y)
    actual = fc.filter_chunked_vmap(f, in_axes=in_axes, chunk_size=chunk_size)(x, y)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("batch_size", (1, 2, 3, 4, 7))
def test_matches_lax_map(batch_size, getkey):
    x = jr.normal(getkey(), (batch_size, 4))
    f = lambda x: (jnp.sum(x**2), jnp.cumsum(x))
    expected = jax.lax.map(f, x, batch_size=3)
    actual = fc.filter_chunked_vmap(f, chunk_size=3)(x)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize(
    "dtype", (jnp.float32, jnp.float64, jnp.int32, jnp.int64, jnp.bool_)
)
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_dtypes(dtype, remainder, getkey):
    x = jr.randint(getkey(), (7, 3), -5, 5).astype(dtype)
    f = lambda x: (x, x[::-1], jnp.any(x.astype(bool)), x.astype(jnp.float32))
    expected = eqx.filter_vmap(f)(x)
    actual = fc.filter_chunked_vmap(f, chunk_size=3, remainder=remainder)(x)
    assert tree_allclose(actual, expected)


def test_pytree_with_non_array_leaves(getkey):
    tree = {
        "w": jr.normal(getkey(), (5, 3)),
        "b": (jr.normal(getkey(), (5,)), "name", None, 3),
        "f": jnp.tanh,
    }

    def f(t):
        return {"y": t["f"](t["w"]) * t["b"][0], "tag": t["b"][1], "n": t["b"][3]}

    expected = eqx.filter_vmap(f)(tree)
    actual = fc.filter_chunked_vmap(f, chunk_size=2)(tree)
    assert tree_allclose(actual, expected)
    assert type(actual["n"]) is int


def test_numpy_inputs(getkey):
    x = np.asarray(jr.normal(getkey(), (5, 3)))
    y = np.float64(2.5)
    f = lambda x, y: x * y
    in_axes = (0, None)
    expected = eqx.filter_vmap(f, in_axes=in_axes)(x, y)
    actual = fc.filter_chunked_vmap(f, in_axes=in_axes, chunk_size=2)(x, y)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("chunk_size", (2, 3))
def test_prng_keys_in_and_out(chunk_size, getkey):
    keys = jr.split(getkey(), 7)

    def f(key):
        k1, k2 = jr.split(key)
        return jr.normal(k1, (2,)), k2

    expected = eqx.filter_vmap(f)(keys)
    actual = fc.filter_chunked_vmap(f, chunk_size=chunk_size)(keys)
    assert tree_allclose(actual, expected)
    assert jnp.issubdtype(actual[1].dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize("chunk_size", (None, 5, 9))
def test_chunk_at_least_batch_is_filter_vmap(chunk_size, getkey):
    x = jr.normal(getkey(), (5, 3))
    marker = object()
    seen = []

    def f(x, y, m):
        seen.append((y, m))
        return x * y, m

    in_axes = (0, None, None)
    y = np.float64(3.0)
    expected = eqx.filter_vmap(f, in_axes=in_axes)(x, y, marker)
    actual = fc.filter_chunked_vmap(f, in_axes=in_axes, chunk_size=chunk_size)(
        x, y, marker
    )
    assert tree_allclose(actual, expected)
    # Unmapped leaves are closed over unchanged, as in `eqx.filter_vmap`.
    assert all(s[0] is y and s[1] is marker for s in seen)


def test_three_forms(getkey):
    x = jr.normal(getkey(), (5, 2))

    def f(x):
        return jnp.sin(x)

    expected = eqx.filter_vmap(f)(x)
    called = fc.filter_chunked_vmap(f, chunk_size=2)
    bare = fc.filter_chunked_vmap(f)
    factory = fc.filter_chunked_vmap(chunk_size=2)(f)
    for g in (called, bare, factory):
        assert tree_allclose(g(x), expected)
    assert all(isinstance(g, eqx.Module) for g in (called, bare, factory))

    @fc.filter_chunked_vmap
    def decorated(x):
        return jnp.sin(x)

    @fc.filter_chunked_vmap(chunk_size=3)
    def decorated_with_args(x):
        return jnp.sin(x)

    assert tree_allclose(decorated(x), expected)
    assert tree_allclose(decorated_with_args(x), expected)
