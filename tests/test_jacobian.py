"""`chunked_jacrev`/`chunked_jacfwd` against `jax.jacrev`/`jax.jacfwd`, and the
filtered variants against `eqx.filter_jacrev`/`eqx.filter_jacfwd`."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc

from .helpers import tree_allclose


def _f(x, y, scale):
    """PyTree in, PyTree out: 7 outputs, 8 inputs in `x`, 2 in `y`."""
    return {
        "a": jnp.sin(x["p"]) * y[0] * scale,
        "b": jnp.sum(x["q"] ** 2) * y[1],
    }


def _inputs(getkey):
    x = {"p": jr.normal(getkey(), (2, 3)), "q": jr.normal(getkey(), (2,))}
    return x, jr.normal(getkey(), (2,)), 2.0


PAIRS = ((fc.chunked_jacrev, jax.jacrev), (fc.chunked_jacfwd, jax.jacfwd))
IDS = ("jacrev", "jacfwd")


@pytest.mark.parametrize("chunked, oracle", PAIRS, ids=IDS)
@pytest.mark.parametrize("chunk_size", (1, 2, 3, 6, 7, 8, 11, None))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("argnums", (0, (0, 1), -2))
def test_matches_jax(chunked, oracle, chunk_size, remainder, argnums, getkey):
    args = _inputs(getkey)
    jac = chunked(_f, argnums, chunk_size=chunk_size, remainder=remainder)(*args)
    assert tree_allclose(jac, oracle(_f, argnums)(*args))


@pytest.mark.parametrize("chunked, oracle", PAIRS, ids=IDS)
@pytest.mark.parametrize("checkpoint", (True, False))
def test_under_jit_and_keywords(chunked, oracle, checkpoint, getkey):
    x, y, _ = _inputs(getkey)
    f = lambda x, y, *, scale: _f(x, y, scale)
    jac = jax.jit(chunked(f, chunk_size=3, checkpoint=checkpoint))(x, y, scale=3.0)
    assert tree_allclose(jac, oracle(f)(x, y, scale=3.0))


@pytest.mark.parametrize("chunked, oracle", PAIRS, ids=IDS)
def test_scalars_empty_and_dtypes(chunked, oracle, getkey):
    cases: list[tuple[Any, tuple[Any, ...]]] = [
        (lambda x: x * 2, (3.0,)),
        (jnp.sin, (jnp.zeros((0, 2)),)),
        (lambda x: x.astype(jnp.float64) ** 2, (jr.normal(getkey(), (4,), "float32"),)),
        (lambda x: (jnp.outer(x, x), jnp.sum(x)), (jr.normal(getkey(), (3,)),)),
        (lambda x: (x, x.astype(jnp.float32)), (jr.normal(getkey(), (3,)),)),
    ]
    for f, args in cases:
        with jax.numpy_dtype_promotion("standard"):  # JAX mixes the outputs' dtypes
            expected = oracle(f)(*args)
        assert tree_allclose(chunked(f, chunk_size=2)(*args), expected)


@pytest.mark.parametrize("chunked, oracle", PAIRS, ids=IDS)
def test_has_aux(chunked, oracle, getkey):
    f = lambda x: (jnp.sin(x), {"sum": jnp.sum(x)})
    x = jr.normal(getkey(), (5,))
    actual = chunked(f, has_aux=True, chunk_size=2)(x)
    assert tree_allclose(actual, oracle(f, has_aux=True)(x))


@pytest.mark.parametrize("chunked, oracle", PAIRS, ids=IDS)
def test_holomorphic(chunked, oracle, getkey):
    z = jax.lax.complex(jr.normal(getkey(), (3,)), jr.normal(getkey(), (3,)))
    f = lambda z: jnp.concatenate([z**2, jnp.sin(z)])
    actual = chunked(f, holomorphic=True, chunk_size=4)(z)
    assert tree_allclose(actual, oracle(f, holomorphic=True)(z))


def test_allow_int_and_integer_outputs(getkey):
    f = lambda x, n: x * n.astype(x.dtype)
    args = (jr.normal(getkey(), (3,)), jnp.arange(3))
    actual = fc.chunked_jacrev(f, (0, 1), allow_int=True, chunk_size=2)(*args)
    assert tree_allclose(actual, jax.jacrev(f, (0, 1), allow_int=True)(*args))
    g = lambda x: (x, jnp.arange(2))
    actual = fc.chunked_jacfwd(g, chunk_size=2)(args[0])
    assert tree_allclose(actual, jax.jacfwd(g)(args[0]))


def test_hessians_and_derivatives_of_jacobians(getkey):
    f = lambda x: jnp.sum(jnp.sin(x) ** 3) * jnp.sum(x)
    x = jr.normal(getkey(), (7,))
    hessian = jax.hessian(f)(x)
    rev, fwd = fc.chunked_jacrev, fc.chunked_jacfwd
    assert tree_allclose(fwd(rev(f, chunk_size=3), chunk_size=2)(x), hessian)
    assert tree_allclose(rev(rev(f, chunk_size=3), chunk_size=2)(x), hessian)
    assert tree_allclose(rev(fwd(f, chunk_size=3), chunk_size=4)(x), hessian)
    g = lambda jacobian: lambda x: jnp.sum(jacobian(jnp.sin)(x) ** 2)
    assert tree_allclose(jax.grad(g(rev(chunk_size=3)))(x), jax.grad(g(jax.jacrev))(x))


def test_rows_and_columns_chunk_size_at_a_time(getkey):
    x = jr.normal(getkey(), (10,))
    for transform, size in ((fc.chunked_jacrev, 3), (fc.chunked_jacfwd, 4)):
        jaxpr = str(jax.make_jaxpr(transform(jnp.sin, chunk_size=size))(x))
        assert f"length={-(-10 // size)}" in jaxpr


class _Model(eqx.Module):
    w: jax.Array
    n: jax.Array
    act: Any = eqx.field(static=True)

    def __call__(self, x):
        return self.act(self.w @ x) * self.n.astype(x.dtype)


@pytest.mark.parametrize(
    "chunked, oracle",
    (
        (fc.filter_chunked_jacrev, eqx.filter_jacrev),
        (fc.filter_chunked_jacfwd, eqx.filter_jacfwd),
    ),
    ids=IDS,
)
@pytest.mark.parametrize("has_aux", (False, True))
def test_filtered_variants(chunked, oracle, has_aux, getkey):
    model = _Model(jr.normal(getkey(), (4, 3)), jnp.arange(4), jnp.tanh)
    x = jr.normal(getkey(), (3,))

    def f(m, x, *, scale):
        return (scale * m(x), jnp.sum(x)) if has_aux else scale * m(x)

    actual = chunked(f, has_aux=has_aux, chunk_size=3)(model, x, scale=2.0)
    expected = oracle(f, has_aux=has_aux)(model, x, scale=2.0)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("chunked, oracle", PAIRS, ids=IDS)
def test_same_errors_as_jax(chunked, oracle):
    cases = [
        ((jnp.arange(3),), {}, TypeError, r"real.*inputs.*`args\[0\]` has dtype int"),
        (
            (jnp.ones(2),),
            dict(argnums=2),
            ValueError,
            "refers to positional argument 2",
        ),
        ((jnp.ones(2),), dict(holomorphic=True), TypeError, "complex inputs"),
        (("a",), {}, TypeError, "not a valid JAX type"),
    ]
    f = lambda x: x * 2
    for args, kwargs, error, match in cases:
        with pytest.raises(error):
            oracle(f, **kwargs)(*args)
        with pytest.raises(error, match=match):
            chunked(f, chunk_size=2, **kwargs)(*args)


def test_reverse_mode_needs_real_outputs():
    f = lambda x: x.astype(jnp.complex128)
    with pytest.raises(TypeError):
        jax.jacrev(f)(jnp.ones(2))
    with pytest.raises(TypeError, match="real floating-point outputs.*`output`"):
        fc.chunked_jacrev(f, chunk_size=1)(jnp.ones(2))


@pytest.mark.parametrize(
    "transform",
    (
        fc.chunked_jacrev,
        fc.chunked_jacfwd,
        fc.filter_chunked_jacrev,
        fc.filter_chunked_jacfwd,
    ),
)
def test_bad_arguments(transform):
    with pytest.raises(ValueError, match=r"chunk_size=...\)` must be a positive"):
        transform(jnp.sin, chunk_size=0)
    with pytest.raises(ValueError, match=r"remainder=...\)` must be one of"):
        transform(jnp.sin, remainder="pad")
    with pytest.raises(TypeError):
        transform(jnp.sin, chunk_size=2.0)
