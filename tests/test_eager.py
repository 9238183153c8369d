"""Eager (outside `jit`) chunked calls: what they return, raise and compile."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import tree_allclose


def _vmap(fun, chunk_size, remainder, **kwargs):
    return fc.filter_chunked_vmap(
        fun, chunk_size=chunk_size, remainder=remainder, **kwargs
    )


def _apply(fun, chunk_size, remainder, **kwargs):
    return fc.filter_chunked_apply(
        fun, chunk_size=chunk_size, remainder=remainder, **kwargs
    )


_CLOSED = jnp.arange(3.0)


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("chunk_size", (None, 3))
@pytest.mark.parametrize(
    "value",
    (np.float64(1e-12), np.full(2, 1e-12, np.float64), np.int8(3), _CLOSED),
    ids=("np-scalar", "np-array", "np-int8", "closed-over-jax"),
)
def test_untraced_unmapped_outputs_come_back_as_they_are(value, chunk_size, remainder):
    # A NumPy float64 must not become a float32 (or any) `jax.Array`.
    x = jnp.arange(10.0)
    f = lambda x: (x * 2, value)
    out_axes = (0, None)
    expected = eqx.filter_vmap(f, out_axes=out_axes)(x)
    actual = _vmap(f, chunk_size, remainder, out_axes=out_axes)(x)
    assert tree_allclose(actual, expected)
    assert type(actual[1]) is type(value) and np.all(actual[1] == value)
    expected = f(x)
    actual = _apply(f, chunk_size, remainder, out_axes=out_axes)(x)
    assert tree_allclose(actual, expected)
    assert actual[1] is value


@pytest.mark.parametrize("make", (_vmap, _apply))
@pytest.mark.parametrize("chunk_size", (None, 3))
def test_equinox_runtime_errors_surface(make, chunk_size):
    f = lambda x: eqx.error_if(x, x > 5, "too big")
    with pytest.raises(eqx.EquinoxRuntimeError, match="too big"):
        eqx.filter_jit(eqx.filter_vmap(f))(jnp.arange(10.0))
    with pytest.raises(eqx.EquinoxRuntimeError, match="too big"):
        make(f, chunk_size, "overlap")(jnp.arange(10.0))
    assert tree_allclose(
        make(f, chunk_size, "overlap")(jnp.arange(5.0)), jnp.arange(5.0)
    )
