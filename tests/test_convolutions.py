"""Convolutions inside the loop: bound in the layout of XLA's fast CPU kernels
(`filtered_chunk/_convolutions.py`), with `jax.vmap`'s values and derivatives."""

import re

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc

from .helpers import tree_allclose


def _layers(key):
    keys = jr.split(key, 6)
    return {
        "conv1d": (eqx.nn.Conv1d(3, 4, 3, stride=2, padding=1, key=keys[0]), (3, 9)),
        "conv2d": (
            eqx.nn.Conv2d(3, 4, 3, dilation=2, padding="SAME", key=keys[1]),
            (3, 8, 8),
        ),
        "conv3d": (eqx.nn.Conv3d(2, 3, 2, key=keys[2]), (2, 4, 4, 4)),
        "groups": (eqx.nn.Conv2d(4, 6, 3, groups=2, key=keys[3]), (4, 6, 6)),
        "transpose": (
            eqx.nn.ConvTranspose2d(3, 2, 3, stride=2, key=keys[4]),
            (3, 5, 5),
        ),
    }


def _nhwc(x, w):
    # Flax's layout: the image `(H, W, C)`, the kernel `(H, W, I, O)`.
    y = lax.conv_general_dilated(
        x[None], w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.tanh(y[0])


@pytest.mark.parametrize("name", ["conv1d", "conv2d", "conv3d", "groups", "transpose"])
def test_equinox_convolutions_match_filter_vmap(name, getkey):
    layer, shape = _layers(getkey())[name]
    x = jr.normal(getkey(), (7, *shape))

    def loss(vmap):
        return lambda m, _x: jnp.sum(jnp.sin(vmap(m)(_x)))

    # Chunks of 3 of 7: an overlapping last chunk.
    chunked = lambda m: fc.filter_chunked_vmap(m, chunk_size=3)  # noqa: E731
    assert tree_allclose(
        eqx.filter_jit(chunked(layer))(x),
        eqx.filter_vmap(layer)(x),
        rtol=1e-5,
        atol=1e-6,
    )
    grad = lambda vmap: eqx.filter_grad(loss(vmap))  # noqa: E731
    assert tree_allclose(
        grad(chunked)(layer, x), grad(eqx.filter_vmap)(layer, x), rtol=1e-4, atol=1e-5
    )


def test_derivatives_of_every_order(getkey):
    w = jr.normal(getkey(), (3, 3, 2, 3))
    x = jr.normal(getkey(), (5, 4, 4, 2))
    chunked = fc.filter_chunked_vmap(_nhwc, in_axes=(0, None), chunk_size=2)
    oracle = jax.vmap(_nhwc, in_axes=(0, None))
    loss = lambda f: lambda _x, _w: jnp.sum(f(_x, _w) ** 2)  # noqa: E731
    for argnums in (0, 1):
        assert tree_allclose(
            jax.grad(loss(chunked), argnums)(x, w),
            jax.grad(loss(oracle), argnums)(x, w),
            rtol=1e-4,
            atol=1e-5,
        )
    tangents = (jr.normal(getkey(), x.shape), jr.normal(getkey(), w.shape))
    jvp = lambda f: jax.jvp(f, (x, w), tangents)  # noqa: E731
    assert tree_allclose(jvp(chunked), jvp(oracle), rtol=1e-4, atol=1e-5)
    # Forward over reverse, and an outer `jax.vmap` (the primitive's batching).
    small = x[:2, :2, :2]
    hessian = lambda f: jax.hessian(lambda _w: loss(f)(small, _w))(w)  # noqa: E731
    assert tree_allclose(hessian(chunked), hessian(oracle), rtol=1e-4, atol=1e-4)
    ws = jnp.stack([w, 2 * w])
    outer = lambda f: jax.vmap(lambda _w: f(x, _w))(ws)  # noqa: E731
    assert tree_allclose(outer(chunked), outer(oracle), rtol=1e-5, atol=1e-6)
    per_example = lambda f: jax.vmap(jax.grad(loss(f), 1), in_axes=(0, None))  # noqa: E731
    assert tree_allclose(
        per_example(chunked)(x[:, None], w),
        per_example(oracle)(x[:, None], w),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dtypes(dtype, getkey):
    w = jr.normal(getkey(), (3, 3, 2, 3), dtype)
    x = jr.normal(getkey(), (5, 4, 4, 2), dtype)
    chunked = fc.filter_chunked_vmap(_nhwc, in_axes=(0, None), chunk_size=2)
    out, expected = chunked(x, w), jax.vmap(_nhwc, in_axes=(0, None))(x, w)
    assert out.dtype == expected.dtype == dtype
    assert tree_allclose(
        out.astype(jnp.float32), expected.astype(jnp.float32), rtol=2e-2, atol=2e-2
    )


_CONV = re.compile(r"convolution\(.*dim_labels=([\w>-]+)")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU layout")
def test_convolutions_in_the_loop_are_canonical(getkey):
    # The compiled program of the chunked CNN and of its gradient: every
    # convolution in XLA's canonical CPU layout (input, kernel and output
    # labels `b...f`, `...io`, `b...f`), where JAX's NCHW convolution and its
    # derivatives inside a loop would keep `bf01_oi01->bf01` and the like.
    layer = eqx.nn.Conv2d(3, 4, 3, key=getkey())
    x = jr.normal(getkey(), (8, 3, 6, 6))
    chunked = fc.filter_chunked_vmap(layer, chunk_size=2)
    grad = eqx.filter_grad(
        lambda m, _x: jnp.sum(fc.filter_chunked_vmap(m, chunk_size=2)(_x))
    )
    for fn in (lambda _x: chunked(_x), lambda _x: grad(layer, _x)):
        text = str(jax.jit(fn).lower(x).compile().as_text())
        labels = _CONV.findall(text)
        assert labels
        assert all(label == "b01f_01io->b01f" for label in labels), labels
