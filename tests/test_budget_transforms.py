"""Memory budgets on every transform, and under `jit`, `grad` and `vmap`: the
choice fits (by the oracle), the result equals the unchunked one, and
`fc.suggest_chunk_size` reports the same choice."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc

from .budgets import check_largest, compiled_bytes, vjp_program
from .helpers import tree_allclose
from .transforms import TRANSFORMS


def _apply_fun(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p) @ p.T


@pytest.mark.parametrize("name", ("chunked_jacrev", "chunked_jacfwd"))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_jacobians_fit_the_budget(name, remainder, choices, getkey):
    chunked, oracle = TRANSFORMS[name].builder, TRANSFORMS[name].oracle
    f = lambda p, x: jnp.tanh(jnp.outer(x @ p, x @ p)).ravel()
    p, x = jr.normal(getkey(), (4, 6)), jr.normal(getkey(), (4,))
    bytes_at = lambda k: compiled_bytes(  # noqa: E731
        chunked(f, chunk_size=k, remainder=remainder), p, x
    )
    total = 36 if chunked is fc.chunked_jacrev else 24
    budget = (bytes_at(1) + bytes_at(None)) // 2
    jacobian = chunked(f, chunk_size=fc.MemoryBudget(budget), remainder=remainder)
    assert tree_allclose(jacobian(p, x), oracle(f)(p, x))
    (choice,) = choices
    check_largest(bytes_at, choice, budget, total, remainder)


@pytest.mark.parametrize("name", ("filter_chunked_jacrev", "filter_chunked_jacfwd"))
def test_filtered_jacobians_fit_the_budget(name, choices, getkey):
    chunked, oracle = TRANSFORMS[name].builder, TRANSFORMS[name].oracle
    model = eqx.nn.Linear(8, 30, key=getkey())
    f = lambda m, x: jnp.tanh(m(x)) ** 2
    x = jr.normal(getkey(), (8,))
    bytes_at = lambda k: compiled_bytes(chunked(f, chunk_size=k), model, x)  # noqa: E731
    total = 30 if chunked is fc.filter_chunked_jacrev else 270
    budget = (bytes_at(1) + bytes_at(None)) // 2
    jacobian = chunked(f, chunk_size=fc.MemoryBudget(budget))
    assert tree_allclose(jacobian(model, x), oracle(f)(model, x))
    (choice,) = choices
    check_largest(bytes_at, choice, budget, total)
    assert fc.suggest_chunk_size(jacobian, model, x) == choice


def test_apply_fits_the_budget(choices, getkey):
    p, x = jr.normal(getkey(), (8, 128)), jr.normal(getkey(), (200, 8))
    bytes_at = lambda k: compiled_bytes(  # noqa: E731
        fc.filter_chunked_apply(_apply_fun, in_axes=(None, 0), chunk_size=k), p, x
    )
    budget = bytes_at(None) // 3
    chunked = fc.filter_chunked_apply(
        _apply_fun, in_axes=(None, 0), chunk_size=fc.MemoryBudget(budget)
    )
    assert tree_allclose(chunked(p, x), _apply_fun(p, x))
    (choice,) = choices
    check_largest(bytes_at, choice, budget, 200)
    structs = (
        jax.ShapeDtypeStruct(p.shape, p.dtype),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
    )
    assert fc.suggest_chunk_size(chunked, *structs) == choice


def test_under_grad_the_differentiated_program_fits(choices, getkey):
    p, x = jr.normal(getkey(), (8, 128)), jr.normal(getkey(), (200, 8))
    f = lambda p, x: jnp.tanh(x @ p) @ p.T
    mapped = lambda k: fc.filter_chunked_vmap(f, in_axes=(None, 0), chunk_size=k)  # noqa: E731
    bytes_at = lambda k: compiled_bytes(vjp_program(mapped(k)), p, x)  # noqa: E731
    budget = bytes_at(None) // 4
    chunked = mapped(fc.MemoryBudget(budget))
    loss = lambda _p, g: jnp.sum(g(_p, x) ** 2)
    expected = jax.grad(loss)(p, jax.vmap(f, in_axes=(None, 0)))
    assert tree_allclose(jax.grad(loss)(p, chunked), expected, rtol=1e-4)
    (choice,) = choices
    check_largest(bytes_at, choice, budget, 200)
    # The forward program alone would allow a larger chunk.
    forward = fc.suggest_chunk_size(chunked, p, x)
    assert forward.chunk_size > choice.chunk_size
    assert tree_allclose(
        jax.jit(jax.grad(loss), static_argnums=1)(p, chunked), expected, rtol=1e-4
    )


def test_under_jit_and_vmap(choices, getkey):
    x = jr.normal(getkey(), (3, 50, 16))
    f = lambda v: jnp.tanh(jnp.outer(v, v)) @ v
    budget = fc.MemoryBudget("64KiB")
    chunked = fc.filter_chunked_vmap(f, chunk_size=budget)
    expected = jax.vmap(jax.vmap(f))(x)
    assert tree_allclose(jax.jit(chunked)(x[0]), expected[0])
    # Under an outer `vmap` the budget holds per element of the outer map.
    assert tree_allclose(jax.vmap(chunked)(x), expected)
    assert choices[0] == choices[1]
    assert (
        compiled_bytes(
            fc.filter_chunked_vmap(f, chunk_size=choices[0].chunk_size), x[0]
        )
        <= 2**16
    )


def test_batch_that_cannot_be_chunked():
    chunked = fc.filter_chunked_vmap(jnp.sin, chunk_size="auto")
    assert tree_allclose(chunked(jnp.ones((0, 3))), jnp.sin(jnp.ones((0, 3))))
    with pytest.raises(ValueError, match="no batch to split"):
        fc.suggest_chunk_size(chunked, jnp.ones((0, 3)))
    nothing = fc.filter_chunked_vmap(lambda: 1.0, chunk_size="auto", axis_size=3)
    assert tree_allclose(nothing(), eqx.filter_vmap(lambda: 1.0, axis_size=3)())


def test_bound_method(getkey):
    class Model(eqx.Module):
        w: jax.Array

        @fc.filter_chunked_vmap(in_axes=(None, 0), chunk_size=fc.MemoryBudget("1MiB"))
        def __call__(self, x):
            return jnp.tanh(jnp.outer(x, self.w)) @ self.w

    model, x = Model(jr.normal(getkey(), (64,))), jr.normal(getkey(), (100, 8))
    assert tree_allclose(
        model(x), jax.vmap(lambda v: jnp.tanh(jnp.outer(v, model.w)) @ model.w)(x)
    )
    assert fc.suggest_chunk_size(model.__call__, x).bytes <= 2**20
