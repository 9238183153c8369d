"""`Chunked.valid`: a call on the valid elements of a batch only, given by a
traced count or mask, against `eqx.filter_vmap` on those elements alone."""

import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import count_compiles, remainders
from .meters import check_one_call, recorder


def _fun(mlp: eqx.nn.MLP, x: jax.Array, scale: float) -> Any:
    """Mapped outputs of several dtypes and axes, an unmapped one, a non-array."""
    y = mlp(x) * scale
    return {
        "y": y,
        "norm": (jnp.sum(y**2), jnp.argmax(y)),
        "flag": y[0] > 0,
        "weak": 2.0,
        "width": mlp.width_size,
        "bias": mlp.layers[-1].bias,
    }


_OUT_AXES = {
    "y": 1,
    "norm": 0,
    "flag": 0,
    "weak": 0,
    "width": None,
    "bias": None,
}


@pytest.fixture(scope="module")
def mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(3, 2, 8, 2, key=jr.key(0))


def _inputs(batch_size: int) -> jax.Array:
    return jr.normal(jr.key(1), (batch_size, 3)) * 10.0 + 100.0


def _padded(x: jax.Array, valid: np.ndarray) -> jax.Array:
    """`x` with every invalid row NaN, infinity or huge."""
    poison = jnp.array([jnp.nan, jnp.inf, -1e38])[jnp.arange(x.shape[0]) % 3]
    return jnp.where(valid[:, None], x, poison[:, None])


def _check(actual: Any, args: tuple[Any, ...], valid: np.ndarray, fill: Any = 0):
    """`actual` is `eqx.filter_vmap` on the valid rows at their positions, `fill`
    at the others: values, dtypes, weak types and structure."""
    mlp, x, scale = args
    vmapped = eqx.filter_vmap(_fun, in_axes=(None, 0, None), out_axes=_OUT_AXES)
    expected = vmapped(mlp, x[valid], scale)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    index = np.flatnonzero(valid)
    for key, axis in _OUT_AXES.items():
        for a, e in zip(jax.tree.leaves(actual[key]), jax.tree.leaves(expected[key])):
            if not isinstance(e, jax.Array):
                assert a == e
                continue
            assert jax.typeof(a).dtype == jax.typeof(e).dtype, key
            assert jax.typeof(a).weak_type == jax.typeof(e).weak_type, key
            if axis is None:
                np.testing.assert_array_equal(a, e)
                continue
            a = np.moveaxis(np.asarray(a), axis, 0)
            e = np.moveaxis(np.asarray(e), axis, 0)
            assert a.shape[0] == valid.shape[0]
            np.testing.assert_allclose(a[index], e, rtol=1e-5, atol=1e-5)
            rest = a[~valid]
            np.testing.assert_array_equal(rest, np.full_like(rest, fill))


def _chunked(chunk_size: int | None, remainder: Any = "overlap", **kw: Any) -> Any:
    return fc.filter_chunked_vmap(
        _fun,
        in_axes=(None, 0, None),
        out_axes=_OUT_AXES,
        chunk_size=chunk_size,
        remainder=remainder,
        **kw,
    )


def _cases() -> list[tuple[int, int | None, str]]:
    out: list[tuple[int, int | None, str]]
    k = 4
    sizes = (0, 1, k - 1, k, k + 1, 2 * k + 1)
    out = [(n, k, r) for n in sizes for r in remainders(n, k)]
    return out + [(5, 16, "overlap"), (6, None, "overlap"), (9, 1, "overlap")]


@pytest.mark.parametrize("batch_size, chunk_size, remainder", _cases())
def test_count_against_filter_vmap(
    mlp: eqx.nn.MLP, batch_size: int, chunk_size: int | None, remainder: str
) -> None:
    chunked = _chunked(chunk_size, remainder)
    x = _inputs(batch_size)
    for count in sorted({0, 1, batch_size // 2, batch_size - 1, batch_size}):
        if count < 0:
            continue
        valid = np.arange(batch_size) < count
        args = (mlp, _padded(x, valid), 0.5)
        _check(chunked.valid(count)(*args), (mlp, x, 0.5), valid)


@pytest.mark.parametrize("batch_size, chunk_size", [(9, 4), (12, 4), (7, 16)])
def test_mask_against_filter_vmap(
    mlp: eqx.nn.MLP, batch_size: int, chunk_size: int
) -> None:
    chunked = _chunked(chunk_size)
    x = _inputs(batch_size)
    rng = np.random.default_rng(batch_size)
    masks = [rng.random(batch_size) < p for p in (0.0, 0.3, 0.7, 1.0)]
    for valid in masks:
        args = (mlp, _padded(x, valid), 0.5)
        _check(chunked.valid(mask=jnp.asarray(valid))(*args), (mlp, x, 0.5), valid)


@pytest.mark.parametrize("fill", (-1, np.float32(-1.5), np.int8(-1), np.bool_(True)))
def test_fill(mlp: eqx.nn.MLP, fill: Any) -> None:
    # A NumPy scalar too (Equinox warned that an array was made static: an error
    # here), converted to each output's dtype as a Python one is.
    x = _inputs(7)
    valid = np.arange(7) < 3
    out = _chunked(2).valid(3, fill=fill)(mlp, x, 0.5)
    _check(out, (mlp, x, 0.5), valid, fill=fill)


def test_count_out_of_range_is_clipped(mlp: eqx.nn.MLP) -> None:
    x = _inputs(6)
    chunked = _chunked(4)
    _check(chunked.valid(-3)(mlp, x, 0.5), (mlp, x, 0.5), np.zeros(6, bool))
    _check(chunked.valid(100)(mlp, x, 0.5), (mlp, x, 0.5), np.ones(6, bool))


@pytest.mark.parametrize(
    "count, valid",
    (
        (2**31, 6),  # a Python int past int32: wrapped around, it was negative
        (2**40, 6),  # wrapped around to 0
        (np.int64(2**32 + 3), 6),  # wrapped around to 3
        (np.uint32(2**32 - 1), 6),
        (np.uint64(2**63 + 5), 6),
        (np.int64(-(2**40)), 0),
        (np.uint8(255), 6),
        (np.int8(-128), 0),
        (np.int16(4), 4),
    ),
)
@pytest.mark.parametrize("traced", (False, True))
def test_count_of_any_integer_type_is_clipped_not_wrapped(
    mlp: eqx.nn.MLP, count: Any, valid: int, traced: bool
) -> None:
    # The count is clipped to `[0, batch size]` in its own type, then converted:
    # a count past int32's range, converted first, wrapped around.
    x = _inputs(6)
    chunked = _chunked(4)
    run = lambda n: chunked.valid(n)(mlp, x, 0.5)  # noqa: E731
    if traced:
        # Traced in its own type (the tests run with 64-bit types on).
        out = jax.jit(run)(jnp.asarray(count, jnp.asarray(count).dtype))
    else:
        out = run(count)
    _check(out, (mlp, x, 0.5), np.arange(6) < valid)


def test_one_compilation_for_every_count_and_mask(mlp: eqx.nn.MLP) -> None:
    x = _inputs(50)
    chunked = _chunked(8)
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 51, 100)
    masks = rng.random((100, 50)) < rng.random((100, 1))
    by_count = eqx.filter_jit(lambda n, x: chunked.valid(n)(mlp, x, 0.5))
    by_mask = eqx.filter_jit(lambda m, x: chunked.valid(mask=m)(mlp, x, 0.5))
    eager = lambda n: chunked.valid(n)(mlp, x, 0.5)  # noqa: E731
    eager_mask = lambda m: chunked.valid(mask=m)(mlp, x, 0.5)  # noqa: E731
    by_count(jnp.asarray(counts[0]), x)
    by_mask(jnp.asarray(masks[0]), x)
    eager(0)
    eager_mask(masks[0])
    with count_compiles() as compiles:
        for n, m in zip(counts, masks, strict=True):
            by_count(jnp.asarray(n), x)
            by_mask(jnp.asarray(m), x)
        # Eagerly (each call traced), a count of any integer type.
        for i, (n, m) in enumerate(zip(counts[:12], masks[:12], strict=True)):
            eager([int(n), n, np.int8(n), jnp.asarray(n)][i % 4])
            eager_mask(m if i % 2 else jnp.asarray(m))
    assert compiles == []


def _loss(chunked: Any, inputs: Any, n: Any) -> jax.Array:
    mlp, x = inputs
    out = chunked.valid(n)(mlp, x, 0.5)
    return jnp.sum(jnp.sin(out["y"])) + jnp.sum(out["norm"][0])


def _oracle_loss(inputs: Any) -> jax.Array:
    mlp, x = inputs
    out = eqx.filter_vmap(_fun, in_axes=(None, 0, None), out_axes=_OUT_AXES)(
        mlp, x, 0.5
    )
    return jnp.sum(jnp.sin(out["y"])) + jnp.sum(out["norm"][0])


@pytest.mark.parametrize("remainder", ["overlap", "separate"])
def test_grad_ignores_padding(mlp: eqx.nn.MLP, remainder: str) -> None:
    x = _inputs(11)
    chunked = _chunked(4, remainder)
    # One program for every count: the count is an argument.
    grad = eqx.filter_jit(eqx.filter_grad(ft.partial(_loss, chunked)))
    for count in (0, 1, 4, 5, 9):
        valid = np.arange(11) < count
        g_mlp, g_x = grad((mlp, _padded(x, valid)), jnp.asarray(count))
        e_mlp, e_x = eqx.filter_grad(_oracle_loss)((mlp, x[valid]))
        for a, e in zip(jax.tree.leaves(g_mlp), jax.tree.leaves(e_mlp)):
            np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g_x[valid], e_x, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(g_x[~valid], 0.0)


def test_jvp_ignores_padding(mlp: eqx.nn.MLP) -> None:
    x = _inputs(10)
    valid = np.arange(10) < 6
    chunked = _chunked(4)
    t = jnp.full_like(x, jnp.nan)  # a tangent at an invalid row reaches nothing
    t = jnp.where(valid[:, None], 1.0, t)

    def _y(x: jax.Array) -> jax.Array:
        return chunked.valid(6)(mlp, x, 0.5)["y"]

    primal, tangent = jax.jit(lambda x, t: jax.jvp(_y, (x,), (t,)))(
        _padded(x, valid), t
    )
    expected = jax.jvp(
        lambda x: eqx.filter_vmap(_fun, in_axes=(None, 0, None), out_axes=_OUT_AXES)(
            mlp, x, 0.5
        )["y"],
        (x[:6],),
        (t[:6],),
    )
    np.testing.assert_allclose(primal[:, :6], expected[0], rtol=1e-5)
    np.testing.assert_allclose(tangent[:, :6], expected[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(tangent[:, 6:], 0.0)


def test_outer_vmap(mlp: eqx.nn.MLP) -> None:
    xs = jnp.stack([_inputs(9), _inputs(9) + 1.0])
    chunked = _chunked(4)
    counts = jnp.array([3, 9])
    batched = jax.vmap(lambda x, n: chunked.valid(n)(mlp, x, 0.5)["y"])(xs, counts)
    shared = jax.vmap(lambda x: chunked.valid(5)(mlp, x, 0.5)["y"])(xs)
    for i in range(2):
        n = int(counts[i])
        expected = eqx.filter_vmap(_fun, in_axes=(None, 0, None), out_axes=_OUT_AXES)
        np.testing.assert_allclose(
            batched[i][:, :n], expected(mlp, xs[i][:n], 0.5)["y"], rtol=1e-5
        )
        np.testing.assert_allclose(
            shared[i][:, :5], expected(mlp, xs[i][:5], 0.5)["y"], rtol=1e-5
        )
        np.testing.assert_array_equal(batched[i][:, n:], 0.0)


def test_sum_match_sums_valid_elements_only() -> None:
    def f(w: jax.Array, x: jax.Array) -> Any:
        # `sqrt` at 0 has an infinite derivative: no `0 * inf` from a padded row.
        return jnp.sum(jnp.sqrt(w * x)), w

    w = jnp.array([2.0, 0.0])
    x = jnp.stack([jnp.linspace(0.0, 1.0, 11), jnp.ones(11)], axis=1)
    valid = np.arange(11) < 7
    padded = jnp.where(valid[:, None], x, jnp.nan)
    chunked = fc.filter_chunked_vmap(
        f, in_axes=(None, 0), out_axes=None, chunk_size=3, sum_match=True
    )
    oracle = jax.vmap(f, in_axes=(None, 0), out_axes=None, sum_match=True)
    out = chunked.valid(7)(w, padded)
    np.testing.assert_allclose(out[0], oracle(w, x[:7])[0], rtol=1e-6)
    np.testing.assert_array_equal(out[1], w)
    grad = jax.jit(jax.grad(lambda w, x: chunked.valid(7)(w, x)[0], argnums=(0, 1)))
    g_w, g_x = grad(w, padded)
    e_w, e_x = jax.grad(lambda w, x: oracle(w, x)[0], argnums=(0, 1))(w, x[:7])
    np.testing.assert_allclose(g_w, e_w, rtol=1e-5)
    np.testing.assert_allclose(g_x[:7], e_x, rtol=1e-5)
    np.testing.assert_array_equal(g_x[7:], 0.0)


def test_unmapped_output_that_varies_raises_as_filter_vmap() -> None:
    f = lambda x: x + 1.0  # noqa: E731
    chunked = fc.filter_chunked_vmap(f, out_axes=None, chunk_size=2)
    with pytest.raises(ValueError) as oracle:
        eqx.filter_vmap(f, out_axes=None)(jnp.ones(5))
    with pytest.raises(type(oracle.value)):
        chunked.valid(3)(jnp.ones(5))


def test_skipped_chunks_evaluate_nothing() -> None:
    seen: list[int] = []

    def f(x: jax.Array) -> jax.Array:
        jax.debug.callback(lambda: seen.append(1))
        return x * 2.0

    chunked = fc.filter_chunked_vmap(f, chunk_size=4)
    run = jax.jit(lambda x, n: chunked.valid(n)(x))
    x = jnp.arange(40.0)
    for count, chunks in ((0, 0), (1, 1), (4, 1), (5, 2), (40, 10)):
        seen.clear()
        out = run(x, count)
        jax.effects_barrier()
        assert len(seen) == chunks, count  # once per chunk, not per element
        np.testing.assert_array_equal(out, jnp.where(jnp.arange(40) < count, x * 2, 0))
    # Under an outer `vmap` of differing counts: the chunks where one of its
    # elements has a valid element, once each.
    outer = jax.jit(jax.vmap(lambda x, n: chunked.valid(n)(x)))
    for counts, chunks in (((0, 0), 0), ((1, 5), 2), ((0, 40), 10), ((13, 2), 4)):
        seen.clear()
        out = outer(jnp.stack([x, -x]), jnp.array(counts))
        jax.effects_barrier()
        assert len(seen) == chunks, counts
        for sign, count, row in zip((1, -1), counts, out):
            expected = jnp.where(jnp.arange(40) < count, sign * x * 2, 0)
            np.testing.assert_array_equal(row, expected)


@pytest.mark.parametrize("remainder", ["overlap", "separate"])
def test_loop_stops_after_the_last_valid_chunk(remainder: Any) -> None:
    # Evaluated, the steps after the last valid element's do not run at all (a
    # skipped step is not free: benchmarks/valid.py): the progress meter, told
    # after each step, hears of the steps that ran, then of the whole batch.
    meter = recorder()
    chunked = fc.filter_chunked_vmap(
        lambda x: x * 2.0, chunk_size=4, remainder=remainder, progress_meter=meter
    )
    run = jax.jit(lambda x, n: chunked.valid(n, fill=-1.0)(x))
    x = jnp.arange(1.0, 39.0)  # 38 elements: 9 whole chunks and 2 left over
    # The steps that ran, then the report that closes the meter (the last step
    # of the whole chunks, with `remainder="separate"`).
    every = list(range(4, 40 if remainder == "overlap" else 36, 4))
    for count, ran in ((0, [4]), (1, [4]), (4, [4]), (5, [4, 8]), (37, every)):
        meter.events.clear()
        out = run(x, count)
        jax.effects_barrier()
        assert meter.counts() == [*ran, 38], count
        check_one_call(meter, "filter_chunked_vmap", 38)
        np.testing.assert_array_equal(out, jnp.where(jnp.arange(38) < count, x * 2, -1))
    # Under an outer `vmap`, the steps of the element with the most.
    outer = jax.jit(jax.vmap(lambda x, n: chunked.valid(n, fill=-1.0)(x)))
    meter.events.clear()
    out = outer(jnp.stack([x, -x]), jnp.array([2, 9]))
    jax.effects_barrier()
    assert meter.counts()[:3] == [4, 8, 12]
    for sign, count, row in zip((1, -1), (2, 9), out):
        expected = jnp.where(jnp.arange(38) < count, sign * x * 2, -1)
        np.testing.assert_array_equal(row, expected)


def test_random_numbers_per_element_do_not_depend_on_chunking() -> None:
    def sample(key: jax.Array, index: jax.Array) -> jax.Array:
        return jr.normal(jr.fold_in(key, index), (3,))

    key = jr.key(0)
    index = jnp.arange(20)
    full = fc.filter_chunked_vmap(sample, in_axes=(None, 0), chunk_size=7)(key, index)
    for chunk_size, count in ((3, 20), (8, 11), (20, 5)):
        chunked = fc.filter_chunked_vmap(
            sample, in_axes=(None, 0), chunk_size=chunk_size
        )
        out = chunked.valid(count)(key, index)
        np.testing.assert_array_equal(out[:count], full[:count])


def test_errors(mlp: eqx.nn.MLP) -> None:
    chunked = _chunked(4)
    x = _inputs(6)
    with pytest.raises(TypeError, match="exactly one of"):
        chunked.valid()
    with pytest.raises(TypeError, match="exactly one of"):
        chunked.valid(3, mask=jnp.ones(6, bool))
    with pytest.raises(TypeError, match=r"count=.*integer scalar.*float"):
        chunked.valid(3.0)
    with pytest.raises(TypeError, match=r"count=.*integer scalar"):
        chunked.valid(jnp.array([3]))
    with pytest.raises(TypeError, match=r"mask=.*boolean vector.*int"):
        chunked.valid(mask=jnp.ones(6, int))
    with pytest.raises(ValueError, match=r"mask=.*batch's shape \(6,\).*\(5,\)"):
        chunked.valid(mask=jnp.ones(5, bool))(mlp, x, 0.5)
    with pytest.raises(TypeError, match="fill"):
        chunked.valid(3, fill=jnp.ones(2))
    with pytest.raises(TypeError, match="already restricted"):
        chunked.valid(3).valid(2)
    with pytest.raises(ValueError, match="axis_name='batch'"):
        _chunked(4, axis_name="batch").valid(3)(mlp, x, 0.5)
    with pytest.raises(ValueError, match="needs a batch"):
        fc.filter_chunked_vmap(lambda: 1.0, chunk_size=2).valid(1)()
    with pytest.raises(TypeError, match="only available on `filter_chunked_vmap`"):
        fc.chunked_jacrev(jnp.sin, chunk_size=2).valid(1)  # pyright: ignore


def _layer(w: jax.Array, x: jax.Array) -> Any:
    """Vectorised over the leading axis of `x`; one output does not depend on it."""
    return jnp.sqrt(jnp.abs(x @ w)), jnp.sum(w)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 20])
def test_apply_against_fun_on_valid_elements(chunk_size: int) -> None:
    w = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    x = jnp.linspace(-2.0, 2.0, 33).reshape(11, 3)
    apply = fc.filter_chunked_apply(
        _layer, in_axes=(None, 0), out_axes=(0, None), chunk_size=chunk_size
    )

    def _run(w: jax.Array, x: jax.Array, count: Any, mask: Any) -> Any:
        restricted = apply.valid(count) if mask is None else apply.valid(mask=mask)
        return restricted(w, x)

    def _loss(w: jax.Array, x: jax.Array, count: Any, mask: Any) -> Any:
        return jnp.sum(_run(w, x, count, mask)[0] ** 3)

    # One program for every count, one for every mask.
    run, grad = jax.jit(_run), jax.jit(jax.grad(_loss, argnums=(0, 1)))
    rng = np.random.default_rng(chunk_size)
    cases = [(np.arange(11) < n, n) for n in (0, 1, 4, 11)]
    cases += [(rng.random(11) < 0.5, None), (np.zeros(11, bool), None)]
    for valid, count in cases:
        padded = jnp.where(valid[:, None], x, jnp.nan)
        mask = None if count is not None else valid
        out = run(w, padded, count, mask)
        expected = _layer(w, x[valid])
        np.testing.assert_allclose(out[0][valid], expected[0], rtol=1e-6)
        np.testing.assert_array_equal(out[0][~valid], 0.0)
        np.testing.assert_array_equal(out[1], expected[1])
        g_w, g_x = grad(w, padded, count, mask)
        e_w, e_x = jax.grad(lambda w, x: jnp.sum(_layer(w, x)[0] ** 3), argnums=(0, 1))(
            w, x[valid]
        )
        np.testing.assert_allclose(g_w, e_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g_x[valid], e_x, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(g_x[~valid], 0.0)


class _Scaled(eqx.Module):
    w: jax.Array

    @fc.filter_chunked_vmap(in_axes=(None, 0), chunk_size=2)
    def root(self, x: jax.Array) -> jax.Array:
        return jnp.sqrt(x * self.w)

    @eqx.filter_vmap(in_axes=(None, 0))
    def oracle(self, x: jax.Array) -> jax.Array:
        return jnp.sqrt(x * self.w)


def test_bound_method() -> None:
    # `model.method` binds the instance: its `valid` keeps it bound.
    model = _Scaled(jnp.array(2.0))
    x = jnp.array([1.0, 4.0, 0.5, jnp.nan, 3.0])
    mask = np.array([True, True, False, False, True])
    for valid, restricted in (
        (np.arange(5) < 3, model.root.valid(3)),
        (mask, model.root.valid(mask=mask)),
    ):
        out = restricted(x)
        np.testing.assert_array_equal(out[valid], model.oracle(x[valid]))
        np.testing.assert_array_equal(out[~valid], 0.0)
    run = eqx.filter_jit(lambda m, x, n: m.root.valid(n)(x))
    np.testing.assert_array_equal(run(model, x, 2)[:2], model.oracle(x[:2]))
    grad = eqx.filter_grad(lambda m, x: m.root.valid(3)(x).sum())(model, x)
    expected = eqx.filter_grad(lambda m, x: m.oracle(x).sum())(model, x[:3])
    np.testing.assert_allclose(grad.w, expected.w, rtol=1e-6)
    assert isinstance(model.root, eqx.Partial)
