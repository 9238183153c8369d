"""Collectives over `axis_name`: exact with one chunk, refused across chunks."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc

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
_NAMES = {
    "psum": "psum",
    "pmean": "psum",  # `pmean` is a `psum` divided by the axis size
    "pmax": "pmax",
    "all_gather": "all_gather",
    "axis_index": "axis_index",
    "axis_size": "axis_size",
    "psum-of-constant": "axis_size",
    "psum-in-jit-and-cond": "psum",
}


@pytest.mark.parametrize("name", _COLLECTIVES)
def test_refused_across_chunks(name):
    f = _COLLECTIVES[name]
    x = jnp.arange(1.0, 17.0).reshape(8, 2)
    chunked = fc.filter_chunked_vmap(f, axis_name="i", chunk_size=3)
    match = (
        rf"`filter_chunked_vmap\(\.\.\., axis_name='i'\)`: the function uses the "
        rf"collective\(s\) `{_NAMES[name]}` over 'i', but the batch of 8 is split "
        r"into 3 chunks of `chunk_size=3`"
    )
    with pytest.raises(ValueError, match=match):
        chunked(x)
    with pytest.raises(ValueError, match=match):
        jax.jit(chunked)(x)


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
    outer = fc.filter_chunked_vmap(chunked, axis_name="j", chunk_size=3)
    assert tree_allclose(outer(x), expected)
    with pytest.raises(ValueError, match=r"collective\(s\) `psum` over 'j'"):
        fc.filter_chunked_vmap(chunked, axis_name="j", chunk_size=2)(x)
