"""Memory budgets on every transform, and under `jit`, `grad` and `vmap`: the
choice fits (by the oracle), the result equals the unchunked one, and
`fc.suggest_chunk_size` reports the same choice."""

import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from hypothesis import given, Phase, settings

import filtered_chunk as fc

from .budgets import (
    check_largest,
    compiled_bytes,
    derivative_bytes,
    nonlinear_element,
)
from .helpers import tree_allclose
from .transforms import DERIVATIVES, TRANSFORMS


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
    bytes_at = lambda k: derivative_bytes(mapped(k), p, x)  # noqa: E731
    budget = bytes_at(None) // 4
    chunked = mapped(fc.MemoryBudget(budget))
    loss = lambda _p, g: jnp.sum(g(_p, x) ** 2)
    expected = jax.grad(loss)(p, jax.vmap(f, in_axes=(None, 0)))
    assert tree_allclose(jax.grad(loss)(p, chunked), expected, rtol=1e-4)
    (choice,) = choices
    check_largest(bytes_at, choice, budget, 200)
    # The forward program alone would allow a larger chunk.
    forward = fc.suggest_chunk_size(chunked, p, x)
    assert forward.largest > choice.largest
    assert tree_allclose(
        jax.jit(jax.grad(loss), static_argnums=1)(p, chunked), expected, rtol=1e-4
    )


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_grad_of_a_nonlinear_loss_fits(remainder, choices):
    # The cotangent of a real loss is not constant: the search must not let XLA
    # fold it away, as it would an all-ones cotangent (issue 14, item 1).
    xs = jr.normal(jr.key(0), (29, 48), jnp.float32)
    g = fc.filter_chunked_vmap(
        nonlinear_element, chunk_size=fc.MemoryBudget(900_000), remainder=remainder
    )
    loss = lambda x: jnp.sum(g(x) ** 2)  # noqa: E731
    assert compiled_bytes(jax.grad(loss), xs) <= 900_000
    assert compiled_bytes(jax.value_and_grad(loss), xs) <= 900_000
    assert choices[0].chunk_size < 29
    expected = jax.grad(lambda x: jnp.sum(jax.vmap(nonlinear_element)(x) ** 2))(xs)
    assert tree_allclose(jax.jit(jax.grad(loss))(xs), expected, rtol=1e-4)


def test_jvp_fits_or_the_budget_is_too_small():
    # Forward mode allocates the primal and the tangent outputs (issue 14, item 2).
    w = jnp.linspace(0, 1, 4096, dtype=jnp.float32)
    h = lambda x: jnp.tanh(x * w)  # noqa: E731
    xs = jnp.linspace(0, 1, 256, dtype=jnp.float32)
    ts = jnp.linspace(-1, 1, 256, dtype=jnp.float32)

    def jvp(budget: int) -> Callable[..., Any]:
        g = fc.filter_chunked_vmap(h, chunk_size=fc.MemoryBudget(budget))
        return lambda x, t: jax.jvp(g, (x,), (t,))

    # The two outputs alone are 8 MiB: a budget of 4.3 MB cannot be met.
    with pytest.raises(ValueError, match="is too small for this call"):
        jax.jit(jvp(4_300_000))(xs, ts)
    for budget in (8_500_000, 9_000_000):
        assert compiled_bytes(jvp(budget), xs, ts) <= budget
        expected = jax.jvp(jax.vmap(h), (xs,), (ts,))
        assert tree_allclose(jax.jit(jvp(budget))(xs, ts), expected)


_ACTIVATIONS = (jnp.tanh, jnp.sin, jax.nn.softplus, jax.nn.silu)


def _random_element(activations: tuple[int, ...]) -> Callable[..., Any]:
    a, b = (_ACTIVATIONS[i] for i in activations)

    def _element(p: Any, x: Any) -> Any:
        h = a(jnp.outer(x, x) @ p)  # a `width x width` temporary per element
        return b(h @ x + p[0]) * jnp.mean(p)

    return _element


def _user_program(transform: str, g: Callable[..., Any]) -> Callable[..., Any]:
    """The user's call of `transform` through the chunked map `g(p, xs)`; `v` is
    the cotangent (`vjp`) or the tangent (`jvp`, `linearize`) they give."""
    loss = lambda p, xs: jnp.sum(g(p, xs) ** 2)  # noqa: E731

    def _program(p: Any, xs: Any, v: Any) -> Any:
        of_p = lambda q: g(q, xs)  # noqa: E731
        if transform == "vjp":
            y, pullback = jax.vjp(of_p, p)
            return y, pullback(v)
        if transform == "jvp":
            return jax.jvp(of_p, (p,), (v,))
        if transform == "linearize":
            y, push = jax.linearize(of_p, p)
            return y, push(v)
        if transform == "jacfwd":
            return jax.jacfwd(of_p)(p)
        return getattr(jax, transform)(loss)(p, xs)

    return _program


# Each example compiles a dozen programs: two per transform and remainder. The
# case is drawn from the seed, so that even the first (seed 0) is a random one.
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("transform", DERIVATIVES)
@settings(max_examples=1, phases=(Phase.explicit, Phase.generate))
@given(seed=st.integers(0, 2**32 - 1))
def test_every_transform_fits_the_budget(transform, remainder, seed):
    # The memory oracle is the user's own program, compiled with every value
    # they would vary (parameters, batch, cotangent, tangent) as an argument.
    combo = (DERIVATIVES.index(transform), remainder == "separate")
    rng = np.random.default_rng([seed, *combo])
    batch_size, width = int(rng.integers(2, 25)), int(rng.integers(8, 17))
    where = float(rng.uniform())
    element = _random_element(tuple(rng.choice(len(_ACTIVATIONS), 2)))
    p = rng.standard_normal((width, width)).astype(np.float32)
    xs = rng.standard_normal((batch_size, width)).astype(np.float32)
    v = rng.standard_normal((batch_size, width) if transform == "vjp" else p.shape)
    v = v.astype(np.float32)

    def program(chunk_size: Any) -> Callable[..., Any]:
        g = fc.filter_chunked_vmap(
            element, in_axes=(None, 0), chunk_size=chunk_size, remainder=remainder
        )
        return _user_program(transform, g)

    with pytest.raises(ValueError, match="needs") as info:
        jax.jit(program(fc.MemoryBudget(1)))(p, xs, v)
    needs = int(re.search(r"needs (\d+) bytes", str(info.value)).group(1))  # pyright: ignore
    whole = compiled_bytes(program(None), p, xs, v)
    budget = int(needs + where * max(whole - needs, needs))
    compiled = jax.jit(program(fc.MemoryBudget(budget))).lower(p, xs, v).compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None
    # The budget bounds the chunked call; around it the user's program holds a
    # few scalars of its own (the loss, `jacrev`'s one-element basis).
    outside = 64
    assert (
        analysis.temp_size_in_bytes + analysis.output_size_in_bytes <= budget + outside
    )
    expected = jax.jit(_user_program(transform, jax.vmap(element, in_axes=(None, 0))))
    actual = compiled(p, xs, v)
    assert tree_allclose(actual, expected(p, xs, v), rtol=1e-4, atol=1e-5)


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


@jax.custom_vjp
def _clip_gradient(x: Any) -> Any:
    return x


def _clip_gradient_fwd(x: Any) -> tuple[Any, None]:
    return x, None


def _clip_gradient_bwd(_: None, g: Any) -> tuple[Any]:
    return (jnp.clip(g, -1.0, 1.0),)


_clip_gradient.defvjp(_clip_gradient_fwd, _clip_gradient_bwd)


def _clipped(x: Any) -> Any:
    # Forward the identity, backward the clipped cotangent: no forward mode.
    return _clip_gradient(jnp.tanh(jnp.outer(x, x)) @ x)


def _clipped_with_control_flow(x: Any) -> Any:
    h = _clipped(x)
    count = jax.lax.while_loop(
        lambda c: c[1] < 4.0,
        lambda c: (c[0] + 1, 2 * c[1] + 1.0),
        (0, jax.lax.stop_gradient(jnp.abs(h[0]))),
    )[0]
    h = jax.lax.scan(lambda c, _: (jnp.sin(c) * 2, None), h, None, length=2)[0]
    h = jax.lax.cond(jnp.sum(h) > 0, lambda v: 2 * v, lambda v: v, h)
    return h * jnp.asarray(count, h.dtype)


@pytest.mark.parametrize("fun", (_clipped, _clipped_with_control_flow))
@pytest.mark.parametrize("transform", ("vmap", "apply"))
def test_grad_through_a_custom_vjp(fun, transform, choices, getkey):
    # A `custom_vjp` has no linearisation: the transformation around the call
    # is a pullback, measured alone (issue 23, item 8).
    xs = jr.normal(getkey(), (40, 16))

    def mapped(k: Any) -> Callable[..., Any]:
        if transform == "vmap":
            return fc.filter_chunked_vmap(fun, chunk_size=k)
        return fc.filter_chunked_apply(jax.vmap(fun), chunk_size=k)

    grad = lambda g: jax.grad(lambda x: jnp.sum(g(x) ** 2))  # noqa: E731
    budget = compiled_bytes(grad(mapped(None)), xs) // 2
    program = grad(mapped(fc.MemoryBudget(budget)))
    assert compiled_bytes(program, xs) <= budget
    (choice,) = choices
    assert choice.chunk_size < 40
    actual = jax.jit(program)(xs)
    assert tree_allclose(actual, grad(eqx.filter_vmap(fun))(xs))
    assert tree_allclose(actual, jax.jit(grad(mapped(choice.chunk_size)))(xs))


def _wide_element(w: Any, x: Any) -> Any:
    # A `width x width` temporary per element, as in an MLP of width 128.
    h = jnp.tanh(x @ w[0])
    return jnp.tanh(jnp.outer(h, h) @ w[1]).sum(0)


@pytest.mark.parametrize("remainder", ("separate", "overlap"))
def test_under_jit_grad_the_chosen_size_fits(remainder, choices, getkey):
    # The program that runs computes its cotangent from the call's outputs, so
    # its backward pass waits for the whole forward pass; with a separate
    # remainder that keeps the remainder's working set live beside the loop's.
    # Fed in as an independent argument, the cotangent let XLA schedule the
    # remainder's backward pass right after its forward pass, and the search
    # measured up to 40% less than the program needs (issue 23, item 10).
    w = (jr.normal(getkey(), (32, 128)), jr.normal(getkey(), (128, 32)))
    xs = jr.normal(getkey(), (29, 32))

    def program(k: Any) -> Callable[..., Any]:
        g = fc.filter_chunked_vmap(
            _wide_element, in_axes=(None, 0), chunk_size=k, remainder=remainder
        )
        return jax.grad(lambda x, _w: jnp.sum(g(_w, x) ** 2))

    whole = compiled_bytes(program(None), xs, w)
    for fraction in (0.1, 0.14, 0.17, 0.25, 0.3):
        budget = int(fraction * whole)
        # The user's own compiled program, at the chosen size.
        assert compiled_bytes(program(fc.MemoryBudget(budget)), xs, w) <= budget
        assert choices[-1].chunk_size < 29
    expected = program(None)(xs, w)
    actual = jax.jit(program(fc.MemoryBudget(int(0.1 * whole))))(xs, w)
    assert tree_allclose(actual, expected)
