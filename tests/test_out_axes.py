"""`out_axes`: where the batch axis goes in each output, or `None` for none."""

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import tree_allclose


def _outputs(x, w):
    return {
        "outer": jnp.outer(x, w),  # rank 2 per element, so rank 3 mapped
        "vec": x * w,
        "unbatched": w * 2,
    }


@pytest.mark.parametrize("out_axis", (0, 1, 2, -1, -2, -3))
@pytest.mark.parametrize("chunk_size", (2, 3))
def test_int_out_axes(out_axis, chunk_size, getkey):
    x = jr.normal(getkey(), (5, 3))
    w = jr.normal(getkey(), (3,))
    f = lambda x, w: jnp.outer(x, w)
    kwargs: dict[str, Any] = dict(in_axes=(0, None), out_axes=out_axis)
    expected = eqx.filter_vmap(f, **kwargs)(x, w)
    actual = fc.filter_chunked_vmap(f, chunk_size=chunk_size, **kwargs)(x, w)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize(
    "out_axes",
    (
        eqx.if_array(1),
        eqx.if_array(-1),
        lambda x: x.ndim if eqx.is_array(x) else None,
        {"outer": 2, "vec": -1, "unbatched": None},
        {"outer": eqx.if_array(1), "vec": None, "unbatched": 1},
    ),
)
def test_spec_forms(out_axes, getkey):
    x = jr.normal(getkey(), (5, 3))
    w = jr.normal(getkey(), (3,))
    f = _outputs
    if isinstance(out_axes, dict) and out_axes["vec"] is None:
        f = lambda x, w: {**_outputs(x, w), "vec": w}
    kwargs: dict[str, Any] = dict(in_axes=(0, None), out_axes=out_axes)
    expected = eqx.filter_vmap(f, **kwargs)(x, w)
    actual = fc.filter_chunked_vmap(f, chunk_size=2, **kwargs)(x, w)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("chunk_size", (None, 2))
def test_non_array_outputs_unchanged(chunk_size, getkey):
    x = jr.normal(getkey(), (5,))
    marker = object()
    f = lambda x: (x, 3, 2.5, "name", None, marker, jnp.sin)
    expected = eqx.filter_vmap(f)(x)
    actual = fc.filter_chunked_vmap(f, chunk_size=chunk_size)(x)
    assert tree_allclose(actual, expected)
    assert type(actual[1]) is int and type(actual[2]) is float
    assert actual[5] is marker and actual[6] is jnp.sin


@pytest.mark.parametrize("out_axis", (0, 1, -1))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_unbatched_output_is_broadcast(out_axis, remainder, getkey):
    x = jr.normal(getkey(), (5,))
    w = jr.normal(getkey(), (2, 3))
    f = lambda x, w: (w, x)  # `w` does not depend on the batch
    kwargs: dict[str, Any] = dict(in_axes=(0, None), out_axes=(out_axis, 0))
    expected = eqx.filter_vmap(f, **kwargs)(x, w)
    actual = fc.filter_chunked_vmap(f, chunk_size=2, remainder=remainder, **kwargs)(
        x, w
    )
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("jit", (False, True))
def test_out_axes_none_returned_once(remainder, jit, getkey):
    x = jr.normal(getkey(), (7, 2))
    w = jr.normal(getkey(), (2, 3))
    f = lambda x, w: (x @ w, jnp.tanh(w), jnp.arange(3))
    kwargs: dict[str, Any] = dict(in_axes=(0, None), out_axes=(0, None, None))
    expected = eqx.filter_vmap(f, **kwargs)(x, w)
    actual = fc.filter_chunked_vmap(f, chunk_size=3, remainder=remainder, **kwargs)
    actual = (jax.jit(actual) if jit else actual)(x, w)
    assert tree_allclose(actual, expected)
    assert actual[1].shape == (2, 3)


@pytest.mark.parametrize("chunk_size", (None, 2))
@pytest.mark.parametrize("out_axis", (0, -1))
def test_python_scalar_output_with_int_axis(chunk_size, out_axis, getkey):
    # `jax.vmap` broadcasts a Python scalar output to a (weakly typed) array.
    x = jr.normal(getkey(), (5,))
    f = lambda x: (x, 3, 2.5, True)
    expected = eqx.filter_vmap(f, out_axes=out_axis)(x)
    actual = fc.filter_chunked_vmap(f, out_axes=out_axis, chunk_size=chunk_size)(x)
    assert tree_allclose(actual, expected)
    weak = lambda t: [getattr(leaf, "weak_type", None) for leaf in jax.tree.leaves(t)]
    assert weak(actual) == weak(expected)


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_weak_types_kept(remainder):
    x = jnp.full((5,), 2.0)  # a weakly typed input
    f = lambda x: (jnp.asarray(2.0), jnp.asarray(1), x * 3, jnp.asarray(3.0))
    kwargs: dict[str, Any] = dict(out_axes=(0, 0, 0, None))
    expected = eqx.filter_vmap(f, **kwargs)(x)
    actual = fc.filter_chunked_vmap(f, chunk_size=2, remainder=remainder, **kwargs)(x)
    assert tree_allclose(actual, expected)
    assert [a.weak_type for a in actual] == [e.weak_type for e in expected]


def test_prng_key_output_axis(getkey):
    keys = jr.split(getkey(), 5)
    f = lambda k: jr.split(k, 3)
    expected = eqx.filter_vmap(f, out_axes=1)(keys)
    actual = fc.filter_chunked_vmap(f, out_axes=1, chunk_size=2)(keys)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("chunk_size", (None, 2))
@pytest.mark.parametrize(
    "out_axes",
    (True, False, lambda _: np.int64(1), lambda _: True, {"a": True, "b": np.int64}),
    ids=("True", "False", "callable-np.int64", "callable-True", "mixed"),
)
def test_out_axes_take_any_integer_as_equinox(out_axes, chunk_size, getkey):
    if isinstance(out_axes, dict):
        out_axes = {"a": True, "b": lambda _: np.int64(-1)}
        f = lambda x: {"a": x, "b": x * 2}
    else:
        f = lambda x: x
    x = jr.normal(getkey(), (5, 3))
    with warnings.catch_warnings():
        # Equinox keeps a NumPy axis in a static field, and warns about it.
        warnings.simplefilter("ignore", UserWarning)
        expected = eqx.filter_vmap(f, out_axes=out_axes)(x)
    actual = fc.filter_chunked_vmap(f, out_axes=out_axes, chunk_size=chunk_size)(x)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("chunk_size", (None, 2))
def test_bool_axis_size_is_an_int(chunk_size):
    f = lambda: jnp.ones(2)
    expected = eqx.filter_vmap(f, in_axes=None, axis_size=True)()
    actual = fc.filter_chunked_vmap(
        f, in_axes=None, axis_size=True, chunk_size=chunk_size
    )()
    assert tree_allclose(actual, expected)
