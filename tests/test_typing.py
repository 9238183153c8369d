"""Runtime type checking: of the user's function inside the map, and of our API."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jaxtyping
import pytest
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped

import filtered_chunk as fc

from .helpers import tree_allclose


@jaxtyped(typechecker=beartype)
def _pair(x: Float[Array, " d"], y: Float[Array, " d"]) -> Float[Array, ""]:
    return x @ y


@jaxtyped(typechecker=beartype)
def _bad_return(x: Float[Array, " d"]) -> Float[Array, " d"]:
    return x[:-1]


_MAPS = {
    "eager": lambda f: fc.filter_chunked_vmap(f, chunk_size=2),
    "unchunked": lambda f: fc.filter_chunked_vmap(f),
    "jit": lambda f: jax.jit(fc.filter_chunked_vmap(f, chunk_size=2)),
}


@pytest.mark.parametrize("how", _MAPS)
def test_annotated_fun_runs_per_element(how, getkey):
    x, y = jr.normal(getkey(), (2, 5, 3))
    assert tree_allclose(_MAPS[how](_pair)(x, y), eqx.filter_vmap(_pair)(x, y))


@pytest.mark.parametrize("how", _MAPS)
def test_shape_errors_reach_the_user(how, getkey):
    x = jr.normal(getkey(), (5, 3))
    y = jr.normal(getkey(), (5, 4))
    match = "typechecking parameter 'y'"
    with pytest.raises(jaxtyping.TypeCheckError, match=match):
        _MAPS[how](_pair)(x, y)
    with pytest.raises(jaxtyping.TypeCheckError, match=match):
        eqx.filter_vmap(_pair)(x, y)
    with pytest.raises(jaxtyping.TypeCheckError, match="return"):
        _MAPS[how](_bad_return)(x)


def test_annotated_method(getkey):
    class Model(eqx.Module):
        w: Float[Array, "batch d"]

        @fc.filter_chunked_vmap(chunk_size=2)
        @jaxtyped(typechecker=beartype)
        def score(self, x: Float[Array, " d"]) -> Float[Array, ""]:
            return jnp.dot(self.w, x)

    model = Model(jr.normal(getkey(), (5, 3)))
    x = jr.normal(getkey(), (5, 3))
    assert tree_allclose(model.score(x), jnp.sum(model.w * x, axis=1))
    with pytest.raises(jaxtyping.TypeCheckError):
        model.score(jr.normal(getkey(), (5, 3, 2)))


@pytest.mark.parametrize(
    "kwargs,name",
    (
        (dict(axis_size=3.0), "axis_size"),
        (dict(remainder=1), "remainder"),
        (dict(axis_name=["i"]), "axis_name"),
        (dict(checkpoint="yes"), "checkpoint"),
    ),
)
def test_bad_argument_type_names_the_parameter(kwargs, name):
    match = f"parameter '{re.escape(name)}'"
    with pytest.raises(TypeError, match=match):
        fc.filter_chunked_vmap(_pair, **kwargs)
    with pytest.raises(TypeError, match=match):
        fc.filter_chunked_vmap(**kwargs)


def test_fun_not_callable():
    with pytest.raises(TypeError, match="parameter 'fun'"):
        fc.filter_chunked_vmap(3)  # pyright: ignore[reportArgumentType,reportCallIssue]
    with pytest.raises(TypeError):
        eqx.filter_vmap(3)(jnp.ones(3))  # pyright: ignore[reportArgumentType,reportCallIssue]
