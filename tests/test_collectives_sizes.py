"""What `fun` reads of the mapped axis is the whole batch's, at any chunk size:
`lax.axis_size`, `psum` of a constant, read in Python or reaching any output, and
collectives of every dtype and of no elements, against `eqx.filter_vmap`."""

from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import chunkings, tree_allclose


N = 10
# Chunk sizes around the batch of 10: one element, leftovers of one (3) and two
# (4), a balanced size of the overlapping remainder (6 runs as 5), past the batch.
CHUNK_SIZES = (1, 3, 4, 6, 11)
REMAINDERS = ("overlap", "separate")
XS = jnp.linspace(0.5, 2.0, N)


def _both(f, *args, **kwargs):
    """`f` chunked, called and jitted, against `eqx.filter_vmap`."""
    expected = eqx.filter_vmap(f, axis_name="i", **kwargs.pop("vmap", {}))(*args)
    chunked = fc.filter_chunked_vmap(f, axis_name="i", **kwargs)
    assert tree_allclose(chunked(*args), expected)
    assert tree_allclose(eqx.filter_jit(chunked)(*args), expected)


@pytest.mark.parametrize("chunk_size, remainder", chunkings(N, CHUNK_SIZES))
def test_axis_size_reaching_a_non_array_output(chunk_size, remainder):
    # A Python int, returned beside the mapped output: no array shows it.
    f = lambda x: (x * 2, lax.axis_size("i"))
    chunked = fc.filter_chunked_vmap(
        f, axis_name="i", chunk_size=chunk_size, remainder=remainder
    )
    out = chunked(XS)
    assert out[1] == N and type(out[1]) is int
    assert tree_allclose(out, eqx.filter_vmap(f, axis_name="i")(XS))


@pytest.mark.parametrize("chunk_size, remainder", chunkings(N, CHUNK_SIZES))
def test_psum_of_a_constant_reaching_an_unmapped_output(chunk_size, remainder):
    h = lambda x: (x, lax.psum(2.0, "i"))
    kwargs: dict[str, Any] = dict(out_axes=(0, None))
    _both(h, XS, chunk_size=chunk_size, remainder=remainder, vmap=kwargs, **kwargs)
    out = fc.filter_chunked_vmap(
        h, axis_name="i", chunk_size=chunk_size, remainder=remainder, **kwargs
    )(XS)
    assert float(out[1]) == 2.0 * N


@pytest.mark.parametrize("chunk_size", (1, 2, 3))
@pytest.mark.parametrize("jit", (False, True))
def test_caches_depend_on_axis_env(chunk_size, jit):
    # JAX's own `vmap` test of the same name: nothing mapped, the size given.
    f = lambda: lax.psum(1, "i")
    g = jax.jit(f) if jit else f
    chunked = fc.filter_chunked_vmap(
        g, axis_name="i", axis_size=3, out_axes=None, chunk_size=chunk_size
    )
    assert int(chunked()) == 3
    expected = jax.vmap(f, axis_name="i", axis_size=3, out_axes=None)()
    assert int(chunked()) == int(expected)
    other = fc.filter_chunked_vmap(
        g, axis_name="i", axis_size=5, out_axes=None, chunk_size=chunk_size
    )
    assert int(other()) == 5  # a cached trace at another size is not reused


_READ_IN_PYTHON = {
    "min": lambda x: x * min(lax.axis_size("i"), 6),
    "branch": lambda x: x * 2 if lax.axis_size("i") > 3 else x,
    "range": lambda x: sum(x * k for k in range(lax.axis_size("i"))),
}


@pytest.mark.parametrize("name", _READ_IN_PYTHON)
@pytest.mark.parametrize("chunk_size, remainder", chunkings(N, CHUNK_SIZES))
def test_axis_size_read_in_python(name, chunk_size, remainder):
    f = _READ_IN_PYTHON[name]
    _both(f, XS, chunk_size=chunk_size, remainder=remainder)
    grad = lambda m: jax.grad(lambda x: jnp.sum(jnp.sin(m(f, axis_name="i")(x))))
    chunked = lambda fn, **kw: fc.filter_chunked_vmap(  # noqa: E731
        fn, chunk_size=chunk_size, remainder=remainder, **kw
    )
    assert tree_allclose(grad(chunked)(XS), grad(eqx.filter_vmap)(XS))


@pytest.mark.parametrize("chunk_size, remainder", chunkings(N, (2, 3, 4)))
def test_axis_size_with_an_impure_trace(chunk_size, remainder):
    # Random numbers drawn when traced make every trace differ: the size read
    # beside them is still the batch's.
    rng = np.random.default_rng(0)

    def f(x):
        return x * lax.axis_size("i") + 0.0 * rng.standard_normal()

    out = fc.filter_chunked_vmap(
        f, axis_name="i", chunk_size=chunk_size, remainder=remainder
    )(XS)
    assert tree_allclose(out, XS * N)


def test_axis_size_in_a_custom_vjp_backward_pass():
    # A backward pass runs outside the map, where the axis is unbound: as under
    # `eqx.filter_vmap`, reading its size there raises.
    @jax.custom_vjp
    def scale(x):
        return x

    scale.defvjp(lambda x: (x, None), lambda _, g: (g * lax.axis_size("i"),))
    loss = lambda m: lambda x: jnp.sum(m(scale, axis_name="i")(x))
    chunked = lambda fn, **kw: fc.filter_chunked_vmap(fn, chunk_size=3, **kw)
    with pytest.raises(NameError, match="unbound axis name"):
        jax.grad(loss(eqx.filter_vmap))(XS)
    with pytest.raises(NameError, match="unbound axis name"):
        jax.grad(loss(chunked))(XS)


@pytest.mark.parametrize("dtype", (jnp.int8, jnp.uint8, jnp.int16))
@pytest.mark.parametrize("remainder", REMAINDERS)
def test_small_integer_collectives_wrap_around(dtype, remainder):
    # XLA sums in the operand's dtype, wrapping around as `jax.vmap` does (the
    # sum of these int8 values is 70, of their int16 ones 1,350, past 127).
    x = (jnp.arange(N) * 30).astype(dtype)
    for f in (
        lambda x: x - lax.psum(x, "i"),
        lambda x: lax.pmean(x, "i"),
        lambda x: lax.psum(x, "i") + lax.pmax(x, "i") - lax.pmin(x, "i") + 0 * x,
    ):
        _both(f, x, chunk_size=3, remainder=remainder)
    x2 = (jnp.arange(N * N) * 7).astype(dtype).reshape(N, N)
    _both(lambda e: lax.psum_scatter(e, "i"), x2, chunk_size=3, remainder=remainder)


def _carried(kind):
    """A mapped value and an unmapped one carried side by side by `kind`."""

    def f(x, w):
        if kind == "fori_loop":
            y, w2 = lax.fori_loop(0, 3, lambda i, c: (c[0] * 2, c[1] + 1.0), (x, w))
        elif kind == "scan":
            (y, w2), _ = lax.scan(
                lambda c, _: ((c[0] * 2, c[1] + 1.0), None), (x, w), None, 3
            )
        elif kind == "while_loop":
            y, w2, _ = lax.while_loop(
                lambda c: c[2] < 3,
                lambda c: (c[0] * 2, c[1] + 1.0, c[2] + 1),
                (x, w, 0),
            )
        else:  # a `cond` on an unmapped flag
            y, w2 = lax.cond(w > 0, lambda: (x * 2, w + 1.0), lambda: (x, w))
        return y / lax.psum(y, "i"), w2

    return f


@pytest.mark.parametrize("kind", ("fori_loop", "scan", "while_loop", "cond"))
@pytest.mark.parametrize("chunk_size, remainder", chunkings(N, (1, 3, 10)))
def test_unmapped_output_carried_beside_a_mapped_value(kind, chunk_size, remainder):
    kwargs: dict[str, Any] = dict(in_axes=(0, None), out_axes=(0, None))
    f = _carried(kind)
    w = jnp.asarray(1.5)
    _both(f, XS, w, chunk_size=chunk_size, remainder=remainder, vmap=kwargs, **kwargs)
    loss = lambda m: lambda x, w: jnp.sum(m(f, axis_name="i", **kwargs)(x, w)[0] ** 2)
    chunked = lambda fn, **kw: fc.filter_chunked_vmap(  # noqa: E731
        fn, chunk_size=chunk_size, remainder=remainder, **kw
    )
    tangents = (jnp.cos(XS), jnp.asarray(0.3))
    jvp = lambda m: jax.jvp(loss(m), (XS, w), tangents)  # noqa: E731
    assert tree_allclose(jvp(chunked), jax.jit(lambda: jvp(eqx.filter_vmap))())
    if kind != "while_loop":  # no reverse mode, as in JAX
        expected = jax.jit(jax.grad(loss(eqx.filter_vmap), argnums=(0, 1)))(XS, w)
        actual = jax.grad(loss(chunked), argnums=(0, 1))(XS, w)
        assert tree_allclose(actual, expected)


@pytest.mark.parametrize("chunk_size", (1, 3, 9))
def test_an_unmapped_output_that_varies_is_named(chunk_size):
    # Carried beside the mapped value, and changed by it: `jax.vmap` refuses it.
    def f(x, w):
        y, w2 = lax.fori_loop(0, 3, lambda i, c: (c[0] * 2, c[1] + c[0]), (x, w))
        return y / lax.psum(y, "i"), {"w": w2}

    kwargs: dict[str, Any] = dict(in_axes=(0, None), out_axes=(0, None))
    with pytest.raises(ValueError):
        eqx.filter_vmap(f, axis_name="i", **kwargs)(XS, 1.5)
    chunked = fc.filter_chunked_vmap(f, axis_name="i", chunk_size=chunk_size, **kwargs)
    with pytest.raises(
        ValueError, match=r"gives `None` for `output\[1\]\['w'\]`, but it varies"
    ):
        chunked(XS, 1.5)


_EMPTY = {
    "all_gather": lambda x: lax.all_gather(x, "i"),
    "all_gather_tiled": lambda x: lax.all_gather(x, "i", axis=0, tiled=True),
    "ppermute": lambda x: lax.ppermute(x, "i", [(j, (j + 1) % N) for j in range(N)]),
    "psum": lambda x: x - lax.psum(x, "i"),
    "pmax": lambda x: lax.pmax(x, "i"),
}


@pytest.mark.parametrize("name", _EMPTY)
@pytest.mark.parametrize("chunk_size, remainder", chunkings(N, (1, 3, 4)))
def test_operands_of_no_elements(name, chunk_size, remainder):
    _both(_EMPTY[name], jnp.zeros((N, 0)), chunk_size=chunk_size, remainder=remainder)
