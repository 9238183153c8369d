"""`filter_chunked_apply` against a plain call of the vectorised function."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import batchings, chunkings, scan_counts, tree_allclose


CHUNK = 3
BATCH_SIZES = (0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1)


def _model(params, x, z, name):
    """Vectorised over the batch: rows of `x`, columns of `z`."""
    w, b = params
    h = jnp.tanh(x @ w + b[None])
    return {"h": h, "hz": (h * z.T).T, "norm": jnp.sum(w**2)}, name


_AXES: dict[str, Any] = dict(
    in_axes=(None, 0, 1, None), out_axes=({"h": 0, "hz": -1, "norm": None}, None)
)


def _inputs(getkey, batch_size):
    params = (jr.normal(getkey(), (3, 2)), jr.normal(getkey(), (2,)))
    x = jr.normal(getkey(), (batch_size, 3))
    return params, x, jr.normal(getkey(), (2, batch_size))


@pytest.mark.parametrize(
    "batch_size, chunk_size, remainder",
    [(n, *c) for n in BATCH_SIZES for c in chunkings(n, (CHUNK, 8, None))],
)
def test_matches_plain_call(batch_size, chunk_size, remainder, getkey):
    params, x, z = _inputs(getkey, batch_size)
    chunked = fc.filter_chunked_apply(
        _model, chunk_size=chunk_size, remainder=remainder, **_AXES
    )
    assert tree_allclose(chunked(params, x, z, "s"), _model(params, x, z, "s"))


@pytest.mark.parametrize(
    "batch_size, remainder",
    batchings((1, CHUNK + 1, 2 * CHUNK + 1), CHUNK),
)
@pytest.mark.parametrize(
    "checkpoint", (True, False, jax.checkpoint_policies.dots_saveable)
)
def test_gradients_match_plain_call(batch_size, remainder, checkpoint, getkey):
    params, x, z = _inputs(getkey, batch_size)
    chunked = fc.filter_chunked_apply(
        _model, chunk_size=CHUNK, remainder=remainder, checkpoint=checkpoint, **_AXES
    )

    def loss(f):
        return lambda p, x, z: sum(jnp.sum(o**2) for o in jtu.tree_leaves(f(p, x, z)))

    f = lambda p, x, z: chunked(p, x, z, "s")[0]
    oracle = lambda p, x, z: _model(p, x, z, "s")[0]
    # Eager at the largest batch; under `jit` (one compilation) at the others.
    run = (lambda g: g) if batch_size == 2 * CHUNK + 1 else jax.jit
    grad = lambda f: run(jax.grad(loss(f), (0, 1, 2)))(params, x, z)  # noqa: E731
    assert tree_allclose(grad(f), grad(oracle))
    tangents = jtu.tree_map(lambda a: jr.normal(getkey(), a.shape), (params, x, z))
    jvp = lambda f: run(lambda *t: jax.jvp(f, (params, x, z), t))(*tangents)  # noqa: E731
    assert tree_allclose(jvp(f), jvp(oracle))


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_gradient_not_poisoned_by_padding(remainder, getkey):
    x = jr.uniform(getkey(), (2 * CHUNK + 1,), minval=0.5, maxval=2.0)
    f = lambda w, x: jnp.log(w * x)
    chunked = fc.filter_chunked_apply(
        f, in_axes=(None, 0), chunk_size=CHUNK, remainder=remainder
    )
    grad = jax.grad(lambda w: jnp.sum(chunked(w, x)))(jnp.array(1.5))
    assert jnp.isfinite(grad)
    assert tree_allclose(grad, jax.grad(lambda w: jnp.sum(f(w, x)))(jnp.array(1.5)))


def test_hessian_and_jacobians(getkey):
    params, x, z = _inputs(getkey, 2 * CHUNK + 1)
    chunked = fc.filter_chunked_apply(_model, chunk_size=CHUNK, **_AXES)
    f = lambda m: lambda w, x: jnp.sum(m((w, params[1]), x, z, "s")[0]["hz"] ** 3)
    for transform in (jax.hessian, jax.jacfwd, jax.jacrev):
        actual = transform(f(chunked), argnums=(0, 1))(params[0], x)
        assert tree_allclose(actual, transform(f(_model), argnums=(0, 1))(params[0], x))


def test_no_cotangents_for_integer_boolean_and_static_inputs(getkey):
    f = lambda w, n, flag, x, name: jnp.where(
        flag, w[None] * x, n[None].astype(x.dtype) * x
    )
    args = (jr.normal(getkey(), (3,)), jnp.arange(3), jnp.array(False))
    x = jr.normal(getkey(), (7, 3))
    chunked = fc.filter_chunked_apply(
        f, in_axes=(None, None, None, 0, None), chunk_size=2
    )
    loss = lambda m: lambda args, x: jnp.sum(m(*args, x, "static") ** 2)
    grads = eqx.filter_grad(loss(chunked))(args, x)
    assert tree_allclose(grads, eqx.filter_grad(loss(f))(args, x))
    assert grads[1:] == (None, None)


def test_rows_are_evaluated_chunk_size_at_a_time(getkey):
    seen = []
    f = lambda x: jax.debug.callback(lambda x: seen.append(x.shape), x) or 2 * x
    out = fc.filter_chunked_apply(f, chunk_size=4)(jr.normal(getkey(), (10, 2)))
    assert out.shape == (10, 2)
    assert seen == [(4, 2)] * 3


def test_under_jit_vmap_and_decorator(getkey):
    @fc.filter_chunked_apply(chunk_size=2)
    def double(x):
        return 2 * x

    x = jr.normal(getkey(), (3, 5, 2))
    assert tree_allclose(jax.jit(double)(x[0]), 2 * x[0])
    assert tree_allclose(jax.vmap(double)(x), 2 * x)


def test_method_and_module(getkey):
    class Linear(eqx.Module):
        w: jax.Array

        @fc.filter_chunked_apply(in_axes=(None, 0), chunk_size=2)
        def __call__(self, x):
            return x @ self.w

    model = Linear(jr.normal(getkey(), (3, 4)))
    x = jr.normal(getkey(), (5, 3))
    assert tree_allclose(model(x), x @ model.w)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    expected = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(model.w)
    assert tree_allclose(grads.w, expected)


def test_nothing_mapped_is_a_plain_call():
    f = lambda a, b: (a + b, "s")
    assert fc.filter_chunked_apply(f, chunk_size=2)(1.0, 2.0) == (3.0, "s")


def test_reverse_loop_carries_no_batch_sized_array(getkey):
    from .test_derivatives import _reverse_scans

    params, x, z = _inputs(getkey, 37)
    chunked = fc.filter_chunked_apply(_model, chunk_size=4, **_AXES)
    loss = lambda p, x: jnp.sum(chunked(p, x, z, "s")[0]["h"] ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x)
    (scan,) = _reverse_scans(jaxpr.jaxpr)
    start, num_carry = scan_counts(scan)
    carries = scan.invars[start : start + num_carry]
    assert all(37 not in v.aval.shape for v in carries)


def test_output_marked_none_must_not_depend_on_the_batch(getkey):
    f = lambda x: (x, {"mean": jnp.mean(x)})
    chunked = fc.filter_chunked_apply(f, out_axes=(0, None), chunk_size=2)
    with pytest.raises(ValueError, match=r"`None` for `output\[1\]\['mean'\]`"):
        chunked(jr.normal(getkey(), (5,)))
    # Not chunked, the output is exact: no error.
    x = jr.normal(getkey(), (2,))
    assert tree_allclose(chunked(x), f(x))


def test_output_without_the_chunk_along_its_axis(getkey):
    chunked = fc.filter_chunked_apply(lambda x: x.T, chunk_size=2)
    with pytest.raises(ValueError, match=r"returned `output` with shape \(3, 2\)"):
        chunked(jr.normal(getkey(), (5, 3)))
    with pytest.raises(ValueError, match="out of|with shape"):
        fc.filter_chunked_apply(lambda x: x, out_axes=2, chunk_size=2)(jnp.ones((5,)))


_SIZE_DEPENDENT = {
    "array-from-shape": lambda x: (x * 2, jnp.asarray(x.shape[0], jnp.float32)),
    "shape-from-shape": lambda x: (x * 2, jnp.zeros(x.shape[0])),
    "numpy-from-shape": lambda x: (x * 2, np.float32(x.shape[0])),
    "python-int": lambda x: (x * 2, x.shape[0]),
    "constant-from-shape": lambda x: (x * 2, jnp.sum(jnp.arange(x.shape[0] * 1.0))),
}


@pytest.mark.parametrize("jit", (False, True))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("f", _SIZE_DEPENDENT.values(), ids=_SIZE_DEPENDENT.keys())
def test_output_marked_none_must_not_depend_on_the_chunk_size(f, remainder, jit):
    # Chunked, each would be the chunk's size rather than the batch's: no silent
    # wrong value.
    x = jnp.ones((10, 3))
    chunked = fc.filter_chunked_apply(
        f, out_axes=(0, None), chunk_size=3, remainder=remainder
    )
    call = jax.jit(chunked) if jit else chunked
    with pytest.raises(ValueError, match=r"`None` for `output\[1\]`, but it depends "):
        call(x)
    # Unchunked (a chunk as large as the batch): exactly the plain call.
    unchunked = fc.filter_chunked_apply(f, out_axes=(0, None), chunk_size=10)
    assert tree_allclose(unchunked(x), f(x))


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_output_marked_none_may_use_unmapped_inputs_and_constants(remainder, getkey):
    x, w = jr.normal(getkey(), (10, 3)), jr.normal(getkey(), (3,))
    table = np.linspace(0.0, 1.0, 4)

    def f(x, w):
        return x @ w, (jnp.sum(w**2), np.float32(2.0), jnp.asarray(table), "s", 3)

    chunked = fc.filter_chunked_apply(
        f, in_axes=(0, None), out_axes=(0, None), chunk_size=3, remainder=remainder
    )
    assert tree_allclose(chunked(x, w), f(x, w))
    assert tree_allclose(eqx.filter_jit(chunked)(x, w), eqx.filter_jit(f)(x, w))


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_transposed_chunks_are_detected(remainder):
    # A (3, 3) chunk transposed has 3 rows: the chunk's size, at this size only.
    X = jnp.ones((10, 3))
    chunked = fc.filter_chunked_apply(lambda x: x.T, chunk_size=3, remainder=remainder)
    with pytest.raises(ValueError, match=r"returned `output` with shape \(3, 4\)"):
        chunked(X)
    with pytest.raises(ValueError, match=r"returned `output` with shape \(3, 4\)"):
        jax.jit(chunked)(X)
    square = fc.filter_chunked_apply(
        lambda x: {"a": x, "b": x[:, :, None] * x[:, None, :]},
        out_axes={"a": 0, "b": 2},
        chunk_size=3,
    )
    with pytest.raises(ValueError, match=r"`output\['b'\]` with shape \(4, 3, 3\)"):
        square(X)


def test_non_array_output_with_an_axis():
    chunked = fc.filter_chunked_apply(lambda x: (x, "s"), out_axes=0, chunk_size=2)
    with pytest.raises(TypeError, match=r"`output\[1\]` is str object 's'"):
        chunked(jnp.ones(5))


@pytest.mark.parametrize(
    "kwargs, match",
    (
        (dict(chunk_size=0), "chunk_size=...\\)` must be a positive integer"),
        (dict(chunk_size=True), "chunk_size=...\\)` must be a positive integer"),
        (dict(remainder="pad"), "remainder=...\\)` must be one of"),
        (dict(in_axes=(True,)), "Booleans are not axes"),
    ),
)
def test_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fc.filter_chunked_apply(lambda x: x, **kwargs)


def test_inconsistent_batch_sizes():
    chunked = fc.filter_chunked_apply(lambda x, y: x + y, chunk_size=2)
    with pytest.raises(ValueError, match="inconsistent sizes along the mapped axes"):
        chunked(jnp.ones(4), jnp.ones(5))
    with pytest.raises(ValueError):
        jax.vmap(lambda x, y: x + y)(jnp.ones(4), jnp.ones(5))
