"""Keyword arguments at call time, which `eqx.filter_vmap` does not accept."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc

from .helpers import tree_allclose


def _f(x, y, scale=2.0, *, shift):
    return x * y * scale + shift


def test_equinox_rejects_keywords(getkey):
    x = jr.normal(getkey(), (5,))
    with pytest.raises(RuntimeError, match="keyword arguments"):
        eqx.filter_vmap(_f)(x, x, shift=x)


@pytest.mark.parametrize("chunk_size", (None, 2))
def test_keywords_become_positional(chunk_size, getkey):
    x, y, shift = jr.normal(getkey(), (3, 5))
    g = fc.filter_chunked_vmap(_f, chunk_size=chunk_size)
    positional = lambda x, y, scale, shift: _f(x, y, scale, shift=shift)
    expected = eqx.filter_vmap(positional)(x, y, 2.0, shift)
    assert tree_allclose(g(x, y=y, shift=shift), expected)
    assert tree_allclose(g(shift=shift, y=y, x=x), expected)
    assert tree_allclose(g(x, y, 2.0, shift=shift), expected)


def test_dict_in_axes_names_keywords(getkey):
    x = jr.normal(getkey(), (5, 3))
    y = jr.normal(getkey(), (3,))
    shift = jr.normal(getkey(), (5, 3))
    scale = jnp.array(3.0)
    g = fc.filter_chunked_vmap(_f, in_axes=dict(y=None, scale=None), chunk_size=2)
    positional = lambda x, y, scale, shift: _f(x, y, scale, shift=shift)
    in_axes = (0, None, None, 0)
    expected = eqx.filter_vmap(positional, in_axes=in_axes)(x, y, scale, shift)
    assert tree_allclose(g(x, y=y, scale=scale, shift=shift), expected)


def test_tuple_in_axes_covers_positional_arguments(getkey):
    x = jr.normal(getkey(), (3, 5))
    y = jr.normal(getkey(), (3,))
    shift = jr.normal(getkey(), (5,))  # a keyword: gets `eqx.if_array(0)`
    g = fc.filter_chunked_vmap(_f, in_axes=(1, None), chunk_size=2)
    positional = lambda x, y, shift: _f(x, y, shift=shift)
    expected = eqx.filter_vmap(positional, in_axes=(1, None, 0))(x, y, shift)
    assert tree_allclose(g(x, y, shift=shift), expected)


def test_single_spec_covers_everything(getkey):
    x, y, shift = jr.normal(getkey(), (3, 2, 5))
    g = fc.filter_chunked_vmap(_f, in_axes=1, chunk_size=2)
    positional = lambda x, y, shift: _f(x, y, shift=shift)
    expected = eqx.filter_vmap(positional, in_axes=1)(x, y, shift)
    assert tree_allclose(g(x, y, shift=shift), expected)


def test_var_keywords(getkey):
    x, y = jr.normal(getkey(), (2, 5))

    def f(x, **kwargs):
        return x + kwargs["y"] * kwargs["c"]

    g = fc.filter_chunked_vmap(f, in_axes=dict(c=None), chunk_size=2)
    expected = eqx.filter_vmap(lambda x, y, c: x + y * c, in_axes=(0, 0, None))(
        x, y, jnp.array(2.0)
    )
    assert tree_allclose(g(x, y=y, c=jnp.array(2.0)), expected)


def test_dict_in_axes_names_var_positional(getkey):
    x, y, z = jr.normal(getkey(), (3, 5))

    def f(x, *rest):
        return x * rest[0] + rest[1]

    g = fc.filter_chunked_vmap(f, in_axes=dict(rest=None), chunk_size=2)
    expected = eqx.filter_vmap(f, in_axes=(0, None, None))(x, y[0], z[0])
    assert tree_allclose(g(x, y[0], z[0]), expected)
    g = fc.filter_chunked_vmap(f, in_axes=dict(x=None), chunk_size=2)
    expected = eqx.filter_vmap(f, in_axes=(None, 0, 0))(x[0], y, z)
    assert tree_allclose(g(x[0], y, z), expected)


def test_keyword_leaf_paths_in_errors(getkey):
    x = jr.normal(getkey(), (5,))
    # `y` is bound to its position; `shift` is keyword-only.
    match = r"`args\[0\]`: 5, `args\[1\]`: 5, `kwargs\['shift'\]`: 4"
    with pytest.raises(ValueError, match=match):
        fc.filter_chunked_vmap(_f, chunk_size=2)(x, y=x, shift=jnp.ones(4))
