"""`sum_match=True`: an `out_axes=None` output that varies over the batch is summed,
as `eqx.filter_vmap(..., sum_match=True)` (that is, `jax.vmap`) sums it."""

from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import batchings, tree_allclose
from .meters import check_one_call, recorder


K = 3
SUM: dict[str, Any] = dict(sum_match=True)
# Batch sizes around the chunk size, and chunk sizes around the batch size.
SIZES = (0, 1, K - 1, K, K + 1, 2 * K + 1, 10)


def per_example(w, x):
    """A mapped output, a summed one per dtype, one that does not vary, a Python
    scalar and a non-array."""
    return {
        "mapped": x * w,
        "sum": jnp.sin(x) * w,
        "vector": jnp.outer(x, w[:2]).ravel(),
        "int8": (x * 4.0).astype(jnp.int8),
        "bool": x > 0,
        "uint32": jnp.abs(x * 10.0).astype(jnp.uint32),
        "float16": x.astype(jnp.float16),
        "complex": lax.complex(x, w).astype(jnp.complex64),
        "same": w * 2,
        "python": 3.0,
        "name": "static",
    }


NAMES = ("mapped", "sum", "vector", "int8", "bool", "uint32", "float16", "complex")
OUT_AXES = {k: 0 if k == "mapped" else None for k in NAMES + ("same", "python", "name")}
KWARGS: dict[str, Any] = dict(in_axes=(None, 0), out_axes=OUT_AXES, sum_match=True)


def close(actual: Any, expected: Any, rtol: float = 1e-5) -> bool:
    float16 = ("float16",)
    a = {k: v for k, v in actual.items() if k not in float16}
    e = {k: v for k, v in expected.items() if k not in float16}
    # A float16 sum rounds at every partial sum.
    ok16 = actual["float16"].dtype == expected["float16"].dtype and np.allclose(
        actual["float16"], expected["float16"], rtol=1e-2, atol=1e-2
    )
    return tree_allclose(a, e, rtol=rtol, atol=1e-5) and ok16


@pytest.mark.parametrize("batch_size, remainder", batchings(SIZES, K))
def test_matches_filter_vmap(batch_size, remainder, getkey):
    w = jr.normal(getkey(), (2,))
    x = jr.normal(getkey(), (batch_size, 2))
    expected = eqx.filter_vmap(per_example, **KWARGS)(w, x)
    for chunk_size in (1, K, batch_size + 1):
        chunked = fc.filter_chunked_vmap(
            per_example, chunk_size=chunk_size, remainder=remainder, **KWARGS
        )
        assert close(chunked(w, x), expected)
        # (`jax.jit` hashes a function: a dict of axes is not, as in Equinox.)
        assert close(eqx.filter_jit(lambda w, x: chunked(w, x))(w, x), expected)


def test_unmapped_output_that_does_not_vary_is_returned_once(getkey):
    w = jr.normal(getkey(), (3,))
    x = jr.normal(getkey(), (7, 3))
    f = lambda w, x: (x, w * 2, jnp.float32(1.0))
    kwargs: dict[str, Any] = dict(in_axes=(None, 0), out_axes=(0, None, None))
    expected = eqx.filter_vmap(f, **kwargs, **SUM)(w, x)
    actual = fc.filter_chunked_vmap(f, chunk_size=2, sum_match=True, **kwargs)(w, x)
    assert tree_allclose(actual, expected)
    # Without it, an unmapped output that varies raises, as in `eqx.filter_vmap`.
    g = lambda w, x: (x, x.sum())
    with pytest.raises(ValueError, match="out_axes"):
        fc.filter_chunked_vmap(g, chunk_size=2, in_axes=(None, 0), out_axes=(0, None))(
            w, x
        )


def test_weak_types_match(getkey):
    x = lax.full((7,), 2.0)  # weakly typed
    f = lambda x: (x * 2, x, 1.0 * x)
    kwargs: dict[str, Any] = dict(out_axes=(0, None, None), sum_match=True)
    expected = eqx.filter_vmap(f, **kwargs)(x)
    for chunk_size in (2, 3, 7):
        actual = fc.filter_chunked_vmap(f, chunk_size=chunk_size, **kwargs)(x)
        assert tree_allclose(actual, expected)
        for a, e in zip(actual, expected):
            assert jax.typeof(a).weak_type == jax.typeof(e).weak_type


def _loss(chunked: Any, w: Any, x: Any) -> Any:
    out = chunked(w, x)
    return jnp.sum(out["sum"]) + jnp.sum(out["vector"] ** 2) + jnp.sum(out["mapped"])


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_derivatives_match(remainder, getkey):
    w = jr.normal(getkey(), (2,))
    x = jr.normal(getkey(), (10, 2))
    f = lambda w, x: {k: v for k, v in per_example(w, x).items() if k != "name"}
    kwargs = {**KWARGS, "out_axes": {k: v for k, v in OUT_AXES.items() if k != "name"}}
    oracle = eqx.filter_vmap(f, **kwargs)
    chunked = fc.filter_chunked_vmap(f, chunk_size=K, remainder=remainder, **kwargs)
    grad = jax.grad(_loss, argnums=(1, 2))
    assert tree_allclose(grad(chunked, w, x), grad(oracle, w, x), rtol=1e-4)
    jitted = jax.jit(lambda w, x: grad(chunked, w, x))
    assert tree_allclose(jitted(w, x), grad(oracle, w, x), rtol=1e-4)
    tangents = (jnp.ones_like(w), jnp.ones_like(x))
    jvp = lambda g: jax.jvp(lambda *a: g(*a)["sum"], (w, x), tangents)[1]
    assert tree_allclose(jvp(chunked), jvp(oracle), rtol=1e-4)


def test_infinite_derivative_stays_infinite():
    # The overlapping last chunk recomputes row 0 of it: each copy gets half of
    # its cotangent, so `sqrt`'s infinite derivative at zero is not `0 * inf`.
    x = jnp.array([1.0, 2.0, 3.0, 0.0, 5.0])
    f = lambda x: (x, jnp.sqrt(x))
    kwargs: dict[str, Any] = dict(out_axes=(0, None), sum_match=True)
    expected = jax.grad(lambda x: eqx.filter_vmap(f, **kwargs)(x)[1])(x)
    for chunk_size in (2, 3, 4):
        chunked = fc.filter_chunked_vmap(f, chunk_size=chunk_size, **kwargs)
        actual = jax.grad(lambda x: chunked(x)[1])(x)
        assert np.isinf(actual[3]) and np.allclose(actual, expected), (
            chunk_size,
            actual,
        )


def test_outer_vmap_and_nested_maps(getkey):
    w = jr.normal(getkey(), (4, 2))
    x = jr.normal(getkey(), (7, 2))
    f = lambda w, x: (x * w, jnp.sum(jnp.sin(x) * w))
    kwargs: dict[str, Any] = dict(in_axes=(None, 0), out_axes=(0, None), sum_match=True)
    oracle = eqx.filter_vmap(f, **kwargs)
    chunked = fc.filter_chunked_vmap(f, chunk_size=3, **kwargs)
    outer = lambda g: jax.vmap(g, in_axes=(0, None))(w, x)
    assert tree_allclose(outer(chunked), outer(oracle))
    # A chunked map summing inside another.
    inner = lambda w, x: chunked(w, x)[1]
    nested = fc.filter_chunked_vmap(
        inner, in_axes=(0, None), out_axes=None, chunk_size=3, sum_match=True
    )
    expected = eqx.filter_vmap(
        lambda w, x: oracle(w, x)[1], in_axes=(0, None), out_axes=None, **SUM
    )(w, x)
    assert tree_allclose(nested(w, x), expected, rtol=1e-4)


def test_module_ensemble_gradient_sum(getkey):
    # Per-example gradients of a model, summed in one map (DP-SGD's sum of
    # clipped gradients).
    model = eqx.nn.MLP(3, 1, 8, 2, key=getkey())
    x = jr.normal(getkey(), (11, 3))
    y = jr.normal(getkey(), (11,))

    def clipped(model, x, y):
        loss = lambda m: (m(x)[0] - y) ** 2
        g = eqx.filter_grad(loss)(model)
        norm = jnp.sqrt(sum(jnp.sum(v**2) for v in jax.tree.leaves(g)))
        return jax.tree.map(lambda v: v * jnp.minimum(1.0, 0.5 / norm), g)

    kwargs: dict[str, Any] = dict(in_axes=(None, 0, 0), out_axes=None, sum_match=True)
    expected = eqx.filter_vmap(clipped, **kwargs)(model, x, y)
    for chunk_size in (2, 4, 11):
        actual = fc.filter_chunked_vmap(clipped, chunk_size=chunk_size, **kwargs)(
            model, x, y
        )
        assert tree_allclose(actual, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_with_collectives_across_chunks(remainder, getkey):
    x = jr.normal(getkey(), (10, 2))
    f = lambda x: (x - lax.pmean(x, "i"), jnp.sum((x - lax.pmean(x, "i")) ** 2))
    kwargs: dict[str, Any] = dict(out_axes=(0, None), axis_name="i", sum_match=True)
    oracle = eqx.filter_vmap(f, **kwargs)
    for chunk_size in (1, 3, 4, 11):
        chunked = fc.filter_chunked_vmap(
            f, chunk_size=chunk_size, remainder=remainder, **kwargs
        )
        assert tree_allclose(chunked(x), oracle(x), rtol=1e-4, atol=1e-6)
        grad = lambda g: jax.grad(lambda x: g(x)[1])(x)
        assert tree_allclose(grad(chunked), grad(oracle), rtol=1e-4, atol=1e-5)


def test_with_budget_and_progress(getkey):
    x = jr.normal(getkey(), (64, 8))
    f = lambda x: (x, jnp.outer(x, x))
    kwargs: dict[str, Any] = dict(out_axes=(0, None), sum_match=True)
    expected = eqx.filter_vmap(f, **kwargs)(x)
    chunked = fc.filter_chunked_vmap(f, chunk_size="auto", **kwargs)
    assert tree_allclose(chunked(x), expected, rtol=1e-4)
    meter = recorder()
    reported = fc.filter_chunked_vmap(f, chunk_size=16, progress_meter=meter, **kwargs)
    assert tree_allclose(jax.jit(reported)(x), expected, rtol=1e-4)
    check_one_call(meter, "filter_chunked_vmap", 64)


def test_summed_output_costs_its_own_size():
    # The sum is an accumulator of the loop: no batch-sized buffer, evaluated or
    # differentiated (XLA's compiled memory analysis; exact, not timed).
    def temporaries(n: int, grad: bool) -> int:
        f = lambda w, x: jnp.outer(jnp.tanh(x @ w), x)
        chunked = fc.filter_chunked_vmap(
            f, in_axes=(None, 0), out_axes=None, chunk_size=16, sum_match=True
        )
        fn = (
            (lambda w, x: jax.grad(lambda w: chunked(w, x).sum())(w))
            if grad
            else chunked
        )
        w, x = jnp.ones((32, 32)), jnp.ones((n, 32))
        analysis = jax.jit(fn).lower(w, x).compile().memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes

    for grad in (False, True):
        small, large = temporaries(64, grad), temporaries(4096, grad)
        # The inputs' own bytes aside, nothing grows with the batch.
        assert large <= 1.1 * small + (4096 - 64) * 32 * 4 * grad, (grad, small, large)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU fusions")
def test_rows_are_summed_by_a_contraction_on_cpu():
    # With XLA's default flags, its CPU backend sums wide rows over their
    # leading axis in a slow YNNPACK fusion (`filtered_chunk/_loop/
    # _accumulate.py`, `sum_rows`): the loop sums rows of 2**15 elements by a
    # contraction with ones (the function has no reduction of its own), and
    # narrower ones by a reduction; the values and the gradient are `jax.vmap`'s.
    f = lambda w, x: jnp.outer(jnp.tanh(x @ w), x)
    chunked = fc.filter_chunked_vmap(
        f, in_axes=(None, 0), out_axes=None, chunk_size=16, sum_match=True
    )
    w = jnp.ones((256, 128)) / 256  # rows of 128 x 256 = 2**15 elements
    x = jnp.linspace(-1.0, 1.0, 40 * 256).reshape(40, 256)
    grad = lambda _w, _x: jax.grad(lambda v: jnp.sum(chunked(v, _x) ** 2))(_w)  # noqa: E731
    text = str(jax.jit(chunked).lower(w, x).compile().as_text())
    assert " dot(" in text and " reduce(" not in text
    narrow = str(jax.jit(chunked).lower(w[:, :8], x).compile().as_text())
    assert " reduce(" in narrow
    oracle = lambda _w, _x: jnp.sum(jax.vmap(f, in_axes=(None, 0))(_w, _x), 0)  # noqa: E731
    assert tree_allclose(chunked(w, x), oracle(w, x), rtol=1e-5)
    oracle_grad = jax.grad(lambda v: jnp.sum(oracle(v, x) ** 2))
    assert tree_allclose(grad(w, x), oracle_grad(w), rtol=1e-5)


def test_bad_sum_match_raises():
    with pytest.raises(TypeError):
        fc.filter_chunked_vmap(jnp.sin, sum_match="yes")  # pyright: ignore


def test_nothing_mapped_but_the_axis(getkey):
    w = jr.normal(getkey(), (3,))
    f = lambda w: (w * lax.axis_index("i").astype(w.dtype), w)
    kwargs: dict[str, Any] = dict(
        in_axes=None, out_axes=None, axis_name="i", axis_size=7, sum_match=True
    )
    expected = eqx.filter_vmap(f, **kwargs)(w)
    for chunk_size in (2, 7, None):
        actual = fc.filter_chunked_vmap(f, chunk_size=chunk_size, **kwargs)(w)
        assert tree_allclose(actual, expected)
