"""Infinite and `nan` derivatives through chunked maps equal `jax.vmap`'s: the rows
that the overlapping last chunk recomputes, and the unbatched outputs that every
chunk recomputes, must not turn `inf` into `nan` (`0 * inf`) in reverse mode."""

import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import same_nonfinite as _same


# (batch size, chunk size): overlapping rows at 6-7, 4-5 and 7 with "overlap".
SIZES = ((10, 4), (7, 3), (9, 2))
REMAINDERS = ("overlap", "separate")


def _inputs(batch_size: int) -> Any:
    """Zeros at positions 0, 3, 4, 7, 8: in and out of every overlap of `SIZES`."""
    x = jnp.linspace(0.5, 2.0, batch_size)
    return jnp.where(jnp.arange(batch_size) % 4 % 3 == 0, 0.0, x)


def _vmaps(f: Callable, chunk_size: int, remainder: Any, **kwargs: Any) -> Any:
    chunked = fc.filter_chunked_vmap(
        f, chunk_size=chunk_size, remainder=remainder, **kwargs
    )
    return chunked, eqx.filter_vmap(f, **kwargs)


def _jit(transform: Callable[..., Any]) -> Callable[..., Any]:
    """`transform` under `jit` for the chunked map (one compilation is faster than
    dispatching every operation); the oracle runs op by op, since XLA turns the
    products `0 * inf` of a Jacobian's unit vectors into zeros only sometimes."""

    def _transform(m: Any, *args: Any) -> Any:
        if isinstance(m, eqx.Module) and hasattr(m, "_chunk_size"):
            return jax.jit(ft.partial(transform, m))(*args)
        return transform(m, *args)

    return _transform


def _cases(transforms: Any, everywhere: tuple[str, ...]) -> list[Any]:
    """Each transform at the first size, and those in `everywhere` at all sizes."""
    return [
        (t, sizes)
        for t in transforms
        for sizes in (SIZES if t in everywhere else SIZES[:1])
    ]


_TRANSFORMS: dict[str, Callable[..., Any]] = {
    "grad": lambda m, x: jax.grad(lambda x: jnp.sum(m(x)))(x),
    "vjp": lambda m, x: jax.vjp(m, x)[1](jnp.linspace(0.5, 1.5, x.shape[0]))[0],
    "jacrev": lambda m, x: jax.jacrev(m)(x),
    "hessian": lambda m, x: jax.hessian(lambda x: jnp.sum(m(x)))(x),
    "chunked_jacrev": lambda m, x: fc.chunked_jacrev(m, chunk_size=3)(x),
}
_TRANSFORMS = {name: _jit(t) for name, t in _TRANSFORMS.items()}


@pytest.mark.parametrize("transform, sizes", _cases(_TRANSFORMS, ("grad", "vjp")))
@pytest.mark.parametrize("remainder", REMAINDERS)
def test_infinite_input_derivative(transform, remainder, sizes):
    batch_size, chunk_size = sizes
    x = _inputs(batch_size)
    chunked, oracle = _vmaps(jnp.sqrt, chunk_size, remainder)
    # `jax.jacrev` is the oracle of `chunked_jacrev` (XLA simplifies `0 * inf`
    # from its unit vectors when `fun` is not a loop).
    of_oracle = "jacrev" if transform == "chunked_jacrev" else transform
    expected = _TRANSFORMS[of_oracle](oracle, x)
    assert jnp.any(jnp.isinf(expected))
    assert _same(_TRANSFORMS[transform](chunked, x), expected)


@pytest.mark.parametrize("jit", (False, True))
def test_issue_example(jit):
    x = jnp.linspace(0.5, 2.0, 10).at[6].set(0.0)
    loss = lambda m: lambda x: m(jnp.sqrt)(x).sum()
    grad = jax.grad(loss(lambda f: fc.filter_chunked_vmap(f, chunk_size=4)))
    grad = jax.jit(grad) if jit else grad
    assert jnp.isposinf(grad(x)[6])
    assert _same(grad(x), jax.grad(loss(eqx.filter_vmap))(x))


_PARAM_TRANSFORMS: dict[str, Callable[..., Any]] = {
    "grad": lambda m, w, x: jax.grad(lambda w: jnp.sum(m(w, x)))(w),
    "jacrev": lambda m, w, x: jax.jacrev(m)(w, x),
    "hessian": lambda m, w, x: jax.hessian(lambda w: jnp.sum(m(w, x)))(w),
    "chunked_jacrev": lambda m, w, x: fc.chunked_jacrev(m, chunk_size=3)(w, x),
}
_PARAM_TRANSFORMS = {name: _jit(t) for name, t in _PARAM_TRANSFORMS.items()}


@pytest.mark.parametrize("transform, sizes", _cases(_PARAM_TRANSFORMS, ("grad",)))
@pytest.mark.parametrize("remainder", REMAINDERS)
def test_infinite_parameter_derivative(transform, remainder, sizes):
    batch_size, chunk_size = sizes
    x, w = _inputs(batch_size), jnp.array(0.0)
    f = lambda w, x: jnp.sqrt(x + w)
    chunked, oracle = _vmaps(f, chunk_size, remainder, in_axes=(None, 0))
    of_oracle = "jacrev" if transform == "chunked_jacrev" else transform
    expected = _PARAM_TRANSFORMS[of_oracle](oracle, w, x)
    assert not jnp.all(jnp.isfinite(expected))
    assert _same(_PARAM_TRANSFORMS[transform](chunked, w, x), expected)


@pytest.mark.parametrize(
    "transform, sizes",
    [("grad", s) for s in SIZES + ((8, 4),)] + [("hessian", (10, 4))],
)
@pytest.mark.parametrize("remainder", REMAINDERS)
def test_infinite_derivative_of_unbatched_output(transform, remainder, sizes):
    # Every chunk computes the unbatched output; only one may see its cotangent.
    batch_size, chunk_size = sizes
    x, w = jnp.linspace(0.5, 2.0, batch_size), jnp.array(0.0)
    f = lambda w, x: (x * w, jnp.sqrt(w))
    kwargs: dict[str, Any] = dict(in_axes=(None, 0), out_axes=(0, None))
    chunked, oracle = _vmaps(f, chunk_size, remainder, **kwargs)
    loss = lambda m: lambda w: m(w, x)[1] + jnp.sum(m(w, x)[0])
    take = jax.grad if transform == "grad" else jax.hessian
    expected = jax.jit(take(loss(oracle)))(w)
    assert jnp.isinf(expected)
    assert _same(jax.jit(take(loss(chunked)))(w), expected)


@pytest.mark.parametrize("transform, sizes", _cases(("vjp", "jacrev"), ("vjp",)))
@pytest.mark.parametrize("remainder", REMAINDERS)
def test_nan_stays_where_vmap_has_it(transform, remainder, sizes, getkey):
    batch_size, chunk_size = sizes
    x = jr.normal(getkey(), (batch_size, 2))
    x = jnp.where((jnp.arange(batch_size) % 4 % 3 == 0)[:, None], jnp.nan, x)
    f = lambda x: jnp.sin(x) * x[0]
    chunked, oracle = _vmaps(f, chunk_size, remainder)
    take = _TRANSFORMS[transform]
    if transform == "vjp":
        take = _jit(lambda m, x: jax.vjp(m, x)[1](jnp.ones_like(x))[0])
    expected = take(oracle, x)
    assert jnp.any(jnp.isnan(expected)) and not jnp.all(jnp.isnan(expected))
    assert _same(take(chunked, x), expected)


@pytest.mark.parametrize("remainder", REMAINDERS)
@pytest.mark.parametrize("sizes", SIZES)
def test_forward_tangents_unchanged(remainder, sizes, getkey):
    # The overlapping rows' tangents are the mean of two equal copies: exact, up
    # to the last bit that XLA may round differently in a program compiled
    # apart from the oracle's (jax 0.12.1 does, in a row no step overlaps).
    batch_size, chunk_size = sizes
    x = _inputs(batch_size)
    t = jr.normal(getkey(), (batch_size,))
    chunked, oracle = _vmaps(lambda x: jnp.sqrt(x) * jnp.sin(x), chunk_size, remainder)
    actual, expected = jax.jvp(chunked, (x,), (t,)), jax.jvp(oracle, (x,), (t,))
    assert _same(actual, expected)
    finite = jnp.isfinite(expected[1])
    np.testing.assert_array_max_ulp(actual[1][finite], expected[1][finite], maxulp=1)


@pytest.mark.parametrize("remainder", REMAINDERS)
@pytest.mark.parametrize("sizes", SIZES)
def test_infinite_derivative_through_collectives(remainder, sizes):
    # The staged passes run on the same loop, with its derivative rule: an
    # infinite derivative before a `pmean` across chunks stays infinite.
    batch_size, chunk_size = sizes
    x = _inputs(batch_size)
    f = lambda x: jnp.sqrt(x) - jax.lax.pmean(x, "i")
    kwargs: dict[str, Any] = dict(axis_name="i")
    chunked = fc.filter_chunked_vmap(
        f, chunk_size=chunk_size, remainder=remainder, **kwargs
    )
    oracle = eqx.filter_vmap(f, **kwargs)
    weights = jnp.arange(1.0, batch_size + 1.0)
    grad = lambda g: jax.grad(lambda x: jnp.sum(g(x) * weights))(x)
    expected = grad(oracle)
    assert jnp.any(jnp.isinf(expected))
    assert _same(grad(chunked), expected)


def _read_twice(x, c):
    # `h` reaches the output directly and through `pmean(h)`: the derivative of
    # `sqrt` at 0 meets the sum of both cotangents under `jax.vmap`.
    h = jnp.sqrt(x)
    return (h - jax.lax.pmean(h, "i")) * c


def _read_twice_case(keep: Any, chunk_size: int, remainder: Any) -> Any:
    x = jnp.array([0.0, 1.0, 2.0, 3.0, 4.0, 0.5, 1.5])
    c = jnp.linspace(1.0, 2.0, 7)
    chunked = fc.filter_chunked_vmap(
        _read_twice,
        axis_name="i",
        chunk_size=chunk_size,
        remainder=remainder,
        keep_boundaries=keep,
    )
    oracle = eqx.filter_vmap(_read_twice, axis_name="i")
    loss = lambda f: lambda _x: jnp.sum(f(_x, c))
    return x, loss(chunked), loss(oracle)


@pytest.mark.parametrize("remainder", REMAINDERS)
@pytest.mark.parametrize("chunk_size", (3, 4, 7))
def test_infinite_derivative_of_a_kept_boundary(remainder, chunk_size):
    # Kept, `h`'s cotangents from the pass and the final loop add in its buffer
    # before `sqrt`'s derivative: `-inf`, as `jax.vmap` gives; so does one
    # chunk (7) under `jax.hessian`.
    x, chunked, oracle = _read_twice_case(True, chunk_size, remainder)
    assert jnp.isneginf(jax.grad(oracle)(x)[0])
    assert _same(jax.grad(chunked)(x), jax.grad(oracle)(x))
    if chunk_size == 7:
        assert _same(jax.hessian(chunked)(x), jax.hessian(oracle)(x))


@pytest.mark.parametrize("remainder", REMAINDERS)
@pytest.mark.parametrize("chunk_size", (3, 4))
@pytest.mark.parametrize("keep", (False, 5))
def test_infinite_derivative_of_a_recomputed_boundary(keep, chunk_size, remainder):
    # Recomputed by the pass and the final loop (`keep_boundaries=5` keeps
    # nothing of one pass), `h`'s two cotangents add before `sqrt`'s derivative,
    # as under `jax.vmap`: each element's tangent goes through the whole program
    # in one loop (`_staged/_derivative.py`). First and second order.
    x, chunked, oracle = _read_twice_case(keep, chunk_size, remainder)
    assert jnp.isneginf(jax.grad(oracle)(x)[0])
    assert _same(jax.grad(chunked)(x), jax.grad(oracle)(x))
    assert jnp.isposinf(jax.hessian(oracle)(x)[0, 0])
    assert _same(jax.hessian(chunked)(x), jax.hessian(oracle)(x))
    jacobian = lambda f: jax.jacfwd(jax.jacrev(f))(x)
    assert _same(jacobian(chunked), jacobian(oracle))
    tangent = jnp.linspace(1.0, 2.0, 7)
    jvp = lambda f: jax.jvp(f, (x,), (tangent,))
    assert _same(jvp(chunked), jvp(oracle))


def _read_twice_summed(x, c):
    # `_read_twice`, and a sum over the batch of the same (`sum_match=True`).
    y = _read_twice(x, c)
    return y, 2.0 * y


@pytest.mark.parametrize("remainder", REMAINDERS)
@pytest.mark.parametrize("keep", (False, True))
def test_infinite_derivative_with_sum_match(keep, remainder):
    # The summed outputs' tangents come from the same loops as the mapped
    # ones' (`_staged/_derivative.py`): recomputed, `h`'s cotangents add before
    # `sqrt`'s derivative, as under `jax.vmap` (`nan` when the loops were
    # differentiated one by one).
    x = jnp.array([0.0, 1.0, 2.0, 3.0, 4.0, 0.5, 1.5])
    c = jnp.linspace(1.0, 2.0, 7)
    chunked = fc.filter_chunked_vmap(
        _read_twice_summed,
        out_axes=(0, None),
        axis_name="i",
        chunk_size=3,
        remainder=remainder,
        sum_match=True,
        keep_boundaries=keep,
    )

    def oracle(_x, _c):
        y, s = jax.vmap(_read_twice_summed, axis_name="i")(_x, _c)
        return y, jnp.sum(s, axis=0)

    loss = lambda f: lambda _x: jnp.sum(f(_x, c)[0]) + f(_x, c)[1]  # noqa: E731
    assert jnp.isneginf(jax.grad(loss(oracle))(x)[0])
    assert _same(jax.grad(loss(chunked))(x), jax.grad(loss(oracle))(x))
    assert _same(jax.hessian(loss(chunked))(x), jax.hessian(loss(oracle))(x))
    tangent = jnp.linspace(1.0, 2.0, 7)
    jvp = lambda f: jax.jvp(loss(f), (x,), (tangent,))  # noqa: E731
    assert _same(jvp(chunked), jvp(oracle))


def _chain(x, w):
    # Three kept values in a chain, `a`, `b` and `h`, each written by a pass and
    # read by the next stage; `h`'s pass writes its tangent into that of `a`,
    # which no later stage reads (`_loop/_rule.py`, `_carried`). `sqrt` at 0 is
    # in the last pass, under a cotangent that does not depend on `x`.
    a = 2.0 * x
    b = jnp.tanh(a - jax.lax.pmean(a, "i"))
    h = jnp.sqrt(x) + 0.5 * (b - jax.lax.pmean(b, "i"))
    return (h - jax.lax.pmean(h, "i")) * w


@pytest.mark.parametrize("remainder", REMAINDERS)
@pytest.mark.parametrize("chunk_size", (3, 6))
@pytest.mark.parametrize("chain", (False, True))
def test_hessian_through_kept_boundaries(chain, chunk_size, remainder):
    # Forward over reverse through kept values, each loop's transpose reading
    # the cotangent of the value it kept from one carry and adding that of the
    # value it read into another: a constant cotangent has no tangent, and
    # `sqrt''(0)` stays infinite, as under `jax.vmap` (`nan` when one carry
    # held both: `0 * inf`).
    if chain:
        x = jnp.array([0.0, 1.0, 2.0, 3.0, 4.0, 0.5, 0.0])
        w = jnp.linspace(1.0, 2.0, 7)
        kwargs: dict[str, Any] = dict(axis_name="i", in_axes=(0, 0))
        chunked = fc.filter_chunked_vmap(
            _chain,
            chunk_size=chunk_size,
            remainder=remainder,
            keep_boundaries=True,
            **kwargs,
        )
        oracle = eqx.filter_vmap(_chain, **kwargs)
        loss = lambda f: lambda _x: jnp.sum(f(_x, w))
        chunked, oracle = loss(chunked), loss(oracle)
    else:
        x, chunked, oracle = _read_twice_case(True, chunk_size, remainder)
    expected = jax.hessian(oracle)(x)
    assert jnp.isinf(expected[0, 0])
    assert _same(jax.jit(jax.hessian(chunked))(x), expected)
    jacobian = lambda f: jax.jacfwd(jax.jacrev(f))(x)
    assert _same(jacobian(chunked), jacobian(oracle))
