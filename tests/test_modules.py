"""The wrapper as an `eqx.Module`, methods, and ensembles of Modules."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import filtered_chunk as fc

from .helpers import tree_allclose


def _make(key):
    return eqx.nn.MLP(2, 3, 4, 1, key=key)


def test_wrapper_metadata():
    def f(x):
        """Docstring of f."""
        return x

    g = fc.filter_chunked_vmap(f, chunk_size=2)
    assert isinstance(g, eqx.Module)
    assert g.__wrapped__ is f  # pyright: ignore[reportAttributeAccessIssue]
    assert g.__name__ == "f"  # pyright: ignore[reportAttributeAccessIssue]
    assert g.__qualname__ == f.__qualname__  # pyright: ignore[reportAttributeAccessIssue]
    assert g.__doc__ == "Docstring of f."
    assert g.__module__ == f.__module__


def test_ensemble_built_with_the_map(getkey):
    chunk_size = 3  # 7 members: two chunks and a remainder
    keys = jr.split(getkey(), 7)
    x = jr.normal(getkey(), (2,))
    xs = jr.normal(getkey(), (7, 2))
    expected = eqx.filter_vmap(_make)(keys)
    ensemble = fc.filter_chunked_vmap(_make, chunk_size=chunk_size)(keys)
    assert tree_allclose(ensemble, expected)

    evaluate = lambda model, x: model(x)
    shared: dict[str, Any] = dict(in_axes=(eqx.if_array(0), None))
    assert tree_allclose(
        fc.filter_chunked_vmap(evaluate, chunk_size=chunk_size, **shared)(ensemble, x),
        eqx.filter_vmap(evaluate, **shared)(expected, x),
    )
    assert tree_allclose(
        fc.filter_chunked_vmap(evaluate, chunk_size=chunk_size)(ensemble, xs),
        eqx.filter_vmap(evaluate)(expected, xs),
    )


class _Ensemble(eqx.Module):
    mlps: eqx.nn.MLP
    name: str

    @fc.filter_chunked_vmap(in_axes=(eqx.if_array(0), None), chunk_size=2)
    def chunked(self, x):
        """Evaluates every member."""
        return self.mlps(x), self.name

    @eqx.filter_vmap(in_axes=(eqx.if_array(0), None))
    def oracle(self, x):
        return self.mlps(x), self.name


def test_method_decorated_in_class_body(getkey):
    ensemble = _Ensemble(eqx.filter_vmap(_make)(jr.split(getkey(), 5)), "ens")
    x = jr.normal(getkey(), (2,))
    assert tree_allclose(ensemble.chunked(x), ensemble.oracle(x))
    # Accessed on the class, the wrapper is unbound; `self` is passed explicitly.
    assert isinstance(_Ensemble.__dict__["chunked"], eqx.Module)
    assert tree_allclose(_Ensemble.chunked(ensemble, x), ensemble.oracle(x))
    assert _Ensemble.chunked.__doc__ == "Evaluates every member."
    # Under `filter_jit`, and with keywords.
    jitted = eqx.filter_jit(lambda e, x: e.chunked(x=x))(ensemble, x)
    assert tree_allclose(jitted, ensemble.oracle(x))


class _Holder(eqx.Module):
    fn: Callable[..., Any]
    scale: jax.Array


def test_wrapper_as_module_field(getkey):
    mlp = _make(getkey())
    x = jr.normal(getkey(), (5, 2))
    holder = _Holder(fc.filter_chunked_vmap(mlp, chunk_size=2), jnp.array(2.0))
    oracle = _Holder(eqx.filter_vmap(mlp), jnp.array(2.0))

    def loss(h, x):
        return jnp.sum(h.fn(x) ** 2) * h.scale

    actual = eqx.filter_jit(eqx.filter_value_and_grad(loss))(holder, x)
    expected = eqx.filter_value_and_grad(loss)(oracle, x)
    # The MLP inside the wrapper is a leaf of the holder: its gradient comes back.
    assert tree_allclose(actual[0], expected[0])
    assert tree_allclose(actual[1].fn.__wrapped__, expected[1].fn.__wrapped__)
    assert tree_allclose(actual[1].scale, expected[1].scale)
