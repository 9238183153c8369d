from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc

from .helpers import tree_allclose


@pytest.mark.parametrize("batch_size", (0, 1, 2, 3, 4, 5, 7))
@pytest.mark.parametrize("chunk_size", (1, 2, 3, 8))
@pytest.mark.parametrize("out_axis", (0, 1, -1))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_matches_filter_vmap(batch_size, chunk_size, out_axis, remainder, getkey):
    x = jr.normal(getkey(), (batch_size, 3))
    f = lambda x, n: (jnp.outer(x, x) * n, "static")
    kwargs: dict[str, Any] = dict(in_axes=(0, None), out_axes=eqx.if_array(out_axis))
    expected = eqx.filter_vmap(f, **kwargs)(x, 2.0)
    actual = fc.filter_chunked_vmap(
        f, chunk_size=chunk_size, remainder=remainder, **kwargs
    )(x, 2.0)
    assert tree_allclose(actual, expected)
