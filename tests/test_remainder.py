"""Batches that `chunk_size` does not divide, in both `remainder` modes."""

from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc

from .helpers import remainders, tree_allclose


def _boundary_sizes(chunk_size: int) -> tuple[int, ...]:
    k = chunk_size
    return (k - 1, k, k + 1, 2 * k, 2 * k + 1)


@pytest.mark.parametrize(
    "chunk_size,batch_size",
    [(k, n) for k in (2, 3) for n in _boundary_sizes(k)],
)
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_boundary_sizes(chunk_size, batch_size, remainder, getkey):
    x = jr.normal(getkey(), (2, batch_size))
    w = jr.normal(getkey(), (2,))

    def f(x, w):
        return {"y": jnp.sin(x) * w, "w": w.sum(), "name": "f"}

    kwargs: dict[str, Any] = dict(
        in_axes=(1, None), out_axes={"y": 1, "w": None, "name": None}
    )
    expected = eqx.filter_vmap(f, **kwargs)(x, w)
    actual = fc.filter_chunked_vmap(
        f, chunk_size=chunk_size, remainder=remainder, **kwargs
    )(x, w)
    assert tree_allclose(actual, expected)


def test_modes_without_a_remainder_are_one_program():
    # The grids of the other tests run `remainder="separate"` only where a chunk
    # size leaves a remainder (`helpers.remainders`): elsewhere both modes trace to
    # the same program, evaluated and differentiated, with a collective across
    # chunks (the staged passes) or without (the plain loop), and chunked `apply`'s.
    def f(x, w):
        y = jnp.sin(x) * w
        return y - lax.pmean(y, "i"), jnp.cos(x)

    g = lambda x, w: jnp.sin(x) * w  # noqa: E731

    def programs(batch_size, chunk_size, remainder):
        kwargs: dict[str, Any] = dict(
            in_axes=(0, None), chunk_size=chunk_size, remainder=remainder
        )
        staged = fc.filter_chunked_vmap(f, axis_name="i", **kwargs)
        plain = fc.filter_chunked_vmap(g, **kwargs)
        applied = fc.filter_chunked_apply(g, **kwargs)
        maps = (staged, plain, applied)
        first = lambda m: lambda x, w: jax.tree.leaves(m(x, w))[0]  # noqa: E731
        loss = lambda m: lambda x, w: jnp.sum(jnp.sin(first(m)(x, w)) ** 2)  # noqa: E731
        grads = [jax.grad(loss(m), argnums=(0, 1)) for m in maps]
        args = (jnp.linspace(0.5, 2.0, batch_size), jnp.asarray(1.5))
        return [str(jax.make_jaxpr(h)(*args)) for h in (*maps, *grads)]

    checked = 0
    for batch_size in (0, 1, 2, 4, 6):
        for chunk_size in range(1, batch_size + 2):
            if remainders(batch_size, chunk_size) == ("overlap",):
                overlap = programs(batch_size, chunk_size, "overlap")
                assert overlap == programs(batch_size, chunk_size, "separate")
                checked += 1
    assert checked == 15


@pytest.mark.parametrize("batch_size", (4, 5, 7))
def test_modes_agree(batch_size, getkey):
    x = jr.normal(getkey(), (batch_size, 3))
    f = lambda x: (jnp.cumsum(x), jnp.linalg.norm(x))
    overlap = fc.filter_chunked_vmap(f, chunk_size=3, remainder="overlap")(x)
    separate = fc.filter_chunked_vmap(f, chunk_size=3, remainder="separate")(x)
    assert tree_allclose(overlap, separate)


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_remainder_is_not_padded(remainder, getkey):
    # Zero-padding the remainder would give `log(0)` in the forward pass and a NaN
    # in the gradient with respect to `w`, even though the outputs are sliced off.
    x = jr.uniform(getkey(), (7,), minval=1.0, maxval=2.0)
    w = jnp.array(1.5)

    def loss(w, vmap):
        return vmap(lambda x, w: jnp.log(w * x), in_axes=(0, None))(x, w).sum()

    chunked = lambda f, in_axes: fc.filter_chunked_vmap(
        f, in_axes=in_axes, chunk_size=3, remainder=remainder
    )
    expected = jax.value_and_grad(loss)(w, eqx.filter_vmap)
    actual = jax.value_and_grad(loss)(w, chunked)
    assert tree_allclose(actual, expected)
    assert jnp.isfinite(actual[1])
