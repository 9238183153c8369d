"""Property tests over random PyTrees, axes, batch sizes and chunk sizes."""

from typing import Any, NamedTuple

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import filtered_chunk as fc

from .helpers import tree_allclose
from .transforms import DERIVATIVES


class _Case(NamedTuple):
    tree: dict[str, Any]
    in_axes: tuple[Any, ...]
    out_axes: dict[str, Any]
    chunk_size: int
    other_chunk_size: int
    remainder: str


@st.composite
def _cases(draw: st.DrawFn) -> _Case:
    batch_size = draw(st.integers(0, 9))
    dtype = draw(st.sampled_from((np.float32, np.float64)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    leaves, axes = [], []
    for i in range(draw(st.integers(1, 3))):
        shape = draw(st.lists(st.integers(1, 4), max_size=2))
        axis = None
        if i == 0 or draw(st.booleans()):  # at least one mapped leaf
            axis = draw(st.integers(-len(shape) - 1, len(shape)))
            shape.insert(axis % (len(shape) + 1), batch_size)
        leaves.append(rng.standard_normal(shape).astype(dtype))
        axes.append(axis)
    first_rank = leaves[0].ndim  # the rank of a mapped output `first`
    out_axes = {
        "total": draw(st.sampled_from((0, -1))),
        "first": draw(st.integers(-first_rank, first_rank - 1)),
        "const": None,
        "tag": None,
    }
    tree = {"leaves": tuple(leaves), "tag": "name", "n": 3}
    in_axes = ({"leaves": tuple(axes), "tag": None, "n": None},)
    return _Case(
        tree,
        in_axes,
        out_axes,
        draw(st.integers(1, 12)),
        draw(st.integers(1, 12)),
        draw(st.sampled_from(("overlap", "separate"))),
    )


def _f(tree):
    leaves = tree["leaves"]
    total = sum(jnp.sum(jnp.sin(leaf)) for leaf in leaves)
    const = jnp.asarray(tree["n"], leaves[0].dtype)
    return {
        "total": total,
        "first": jnp.tanh(leaves[0]) * total,
        "const": const,
        "tag": tree["tag"],
    }


def _chunked(case: _Case, chunk_size: int) -> Any:
    return fc.filter_chunked_vmap(
        _f,
        in_axes=case.in_axes,
        out_axes=case.out_axes,
        chunk_size=chunk_size,
        remainder=case.remainder,  # pyright: ignore[reportArgumentType]
    )


# `_f`'s `total` sums sines of order one, which can cancel to near zero: compiled
# in one program, float32 rounds them otherwise than the eager oracle does (seen:
# -0.00283185 against -0.00283174), so the tolerance is absolute too.
ATOL = 1e-6


def _oracle(case: _Case) -> Any:
    return eqx.filter_vmap(_f, in_axes=case.in_axes, out_axes=case.out_axes)


@given(_cases())
def test_matches_filter_vmap(case):
    expected = _oracle(case)(case.tree)
    assert tree_allclose(
        _chunked(case, case.chunk_size)(case.tree), expected, atol=ATOL
    )


@given(_cases())
def test_chunk_size_does_not_change_result(case):
    a = _chunked(case, case.chunk_size)(case.tree)
    b = _chunked(case, case.other_chunk_size)(case.tree)
    assert tree_allclose(a, b, atol=ATOL)


@given(_cases())
def test_chunk_at_least_batch_is_filter_vmap(case):
    batch_size = max(
        np.shape(x)[a]
        for x, a in zip(case.tree["leaves"], case.in_axes[0]["leaves"])
        if a is not None
    )
    chunk_size = batch_size + case.chunk_size - 1  # >= batch_size
    expected = _oracle(case)(case.tree)
    actual = _chunked(case, max(chunk_size, 1))(case.tree)
    assert tree_allclose(actual, expected, rtol=0.0, atol=0.0)


@given(_cases())
def test_shapes_match(case):
    expected = eqx.filter_eval_shape(_oracle(case), case.tree)
    actual = eqx.filter_eval_shape(_chunked(case, case.chunk_size), case.tree)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    assert tree_allclose(actual, expected)


@given(_cases(), st.data())
def test_numpy_leaves_under_jit(case, data):
    # Under `jit`, the NumPy leaves that the caller closes over reach the chunking
    # core as NumPy arrays next to traced ones (the first leaf, always mapped, is
    # one of them); the package runs type-checked under pytest.
    leaves = case.tree["leaves"]
    traced = [False] + [data.draw(st.booleans()) for _ in leaves[1:]]
    chunked = _chunked(case, case.chunk_size)

    @eqx.filter_jit
    def run(_traced, n):
        it = iter(_traced)
        tree_leaves = tuple(next(it) if t else x for x, t in zip(leaves, traced))
        return chunked(dict(case.tree, leaves=tree_leaves, n=n))

    actual = run([jnp.asarray(x) for x, t in zip(leaves, traced) if t], jnp.asarray(3))
    assert tree_allclose(actual, _oracle(case)(case.tree), atol=ATOL)


def _derivative(mode: str, h: Any, leaves: Any, tangents: Any) -> Any:
    """`mode` of `h` (leaves -> arrays) at `leaves`, with `tangents` as the tangents
    and the cotangents where a mode takes them."""
    loss = lambda _leaves: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(h(_leaves)))
    if mode == "grad":
        return jax.grad(loss)(leaves)
    if mode == "value_and_grad":
        return jax.value_and_grad(loss)(leaves)
    if mode == "vjp":
        out, pullback = jax.vjp(h, leaves)
        return out, pullback(jax.tree.map(jnp.cos, out))
    if mode == "jvp":
        return jax.jvp(h, (leaves,), (tangents,))
    if mode == "linearize":
        out, push = jax.linearize(h, leaves)
        return out, push(tangents)
    if mode == "hessian":
        return jax.hessian(loss)(leaves)
    return getattr(jax, mode)(h)(leaves)


@pytest.mark.parametrize("mode", DERIVATIVES)
@settings(max_examples=3)  # per mode: each example compiles several programs
@given(_cases(), st.booleans())
def test_numpy_leaves_through_every_derivative(mode, case, jit):
    # The differentiated leaves (the first always, a mapped one) are NumPy arrays,
    # so that outside `jit` the primals reach the derivative rules as NumPy arrays;
    # the package runs type-checked under pytest, so a too narrow annotation fails.
    leaves = case.tree["leaves"]
    tangents = tuple(np.cos(x) for x in leaves)

    def _h(transform: Any) -> Any:
        def h(_leaves: Any) -> Any:
            out = transform(dict(case.tree, leaves=_leaves))
            return out["total"], out["first"]

        return h

    run = jax.jit(_derivative, static_argnums=(0, 1)) if jit else _derivative
    actual = run(mode, _h(_chunked(case, case.chunk_size)), leaves, tangents)
    expected = _derivative(mode, _h(_oracle(case)), leaves, tangents)
    assert tree_allclose(actual, expected, rtol=1e-4, atol=1e-6)


_k = lambda x, p: jnp.sin(x * p[None, :]) * jnp.sum(p)
_OTHER_TRANSFORMS = {
    # name: (chunked transform of `_k` at a chunk size, oracle)
    "apply": (
        lambda c, r: fc.filter_chunked_apply(
            _k, in_axes=(0, None), chunk_size=c, remainder=r
        ),
        _k,
    ),
    "chunked_jacrev": (
        lambda c, r: fc.chunked_jacrev(_k, (0, 1), chunk_size=c, remainder=r),
        jax.jacrev(_k, (0, 1)),
    ),
    "chunked_jacfwd": (
        lambda c, r: fc.chunked_jacfwd(_k, (0, 1), chunk_size=c, remainder=r),
        jax.jacfwd(_k, (0, 1)),
    ),
    "filter_chunked_jacrev": (
        lambda c, r: fc.filter_chunked_jacrev(_k, chunk_size=c, remainder=r),
        eqx.filter_jacrev(_k),
    ),
    "filter_chunked_jacfwd": (
        lambda c, r: fc.filter_chunked_jacfwd(_k, chunk_size=c, remainder=r),
        eqx.filter_jacfwd(_k),
    ),
}


@pytest.mark.parametrize("mode", DERIVATIVES)
@pytest.mark.parametrize("name", sorted(_OTHER_TRANSFORMS))
def test_numpy_leaves_through_every_derivative_of_every_transform(name, mode):
    # As above, for the transforms other than the chunked vmap: NumPy inputs
    # (mapped and unmapped) reach each derivative rule type-checked. Every pair
    # runs (a draw would skip some), at a batch of 5 in chunks of 2: a remainder.
    rng = np.random.default_rng(DERIVATIVES.index(mode))
    leaves = (
        rng.standard_normal((5, 2)).astype(np.float32),
        rng.standard_normal(2).astype(np.float32),
    )
    tangents = tuple(np.cos(x) for x in leaves)
    build, oracle = _OTHER_TRANSFORMS[name]
    remainder = ("overlap", "separate")[len(name) % 2]
    chunked = build(2, remainder)
    actual = _derivative(mode, lambda _leaves: chunked(*_leaves), leaves, tangents)
    expected = _derivative(mode, lambda _leaves: oracle(*_leaves), leaves, tangents)
    assert tree_allclose(actual, expected, rtol=1e-4, atol=1e-6)


def _collective(tree):
    out = _f(tree)
    return {**out, "first": out["first"] - jax.lax.pmean(out["first"], "i")}


@given(_cases(), st.booleans())
def test_sum_match_and_collectives_match_filter_vmap(case, collective):
    # `total` varies over the batch: marked `None`, it is summed; `const` does
    # not vary and is returned as it is. With a collective across chunks, the
    # staged passes compute it.
    batch_size = max(
        np.shape(x)[a]
        for x, a in zip(case.tree["leaves"], case.in_axes[0]["leaves"])
        if a is not None
    )
    if collective and batch_size == 0:
        collective = False  # the mean of no elements is `nan`
    f = _collective if collective else _f
    kwargs: dict[str, Any] = dict(
        in_axes=case.in_axes,
        out_axes={**case.out_axes, "total": None},
        axis_name="i" if collective else None,
        sum_match=True,
    )
    expected = eqx.filter_vmap(f, **kwargs)(case.tree)
    actual = fc.filter_chunked_vmap(
        f, chunk_size=case.chunk_size, remainder=case.remainder, **kwargs
    )(case.tree)
    assert tree_allclose(actual, expected, rtol=1e-4, atol=1e-5)


@given(_cases(), st.data())
def test_valid_elements_match_filter_vmap_on_them(case, data):
    # `valid` with a random mask (or count) is `eqx.filter_vmap` on the valid
    # elements alone, written at their positions, with zeros elsewhere.
    axes = case.in_axes[0]["leaves"]
    leaves = case.tree["leaves"]
    batch_size = np.shape(leaves[0])[axes[0]]
    mask = np.array(
        data.draw(st.lists(st.booleans(), min_size=batch_size, max_size=batch_size)),
        dtype=bool,
    )
    chunked = _chunked(case, case.chunk_size)
    if data.draw(st.booleans()):
        mask = np.arange(batch_size) < int(mask.sum())
        actual = chunked.valid(int(mask.sum()))(case.tree)
    else:
        actual = chunked.valid(mask=mask)(case.tree)
    index = np.flatnonzero(mask)
    sliced = tuple(
        x if a is None else np.take(x, index, axis=a) for x, a in zip(leaves, axes)
    )
    expected = _oracle(case)({**case.tree, "leaves": sliced})
    assert actual["tag"] == expected["tag"]
    assert tree_allclose(actual["const"], expected["const"])
    for key in ("total", "first"):
        a, e = np.asarray(actual[key]), np.asarray(expected[key])
        axis = case.out_axes[key] % a.ndim
        assert a.dtype == e.dtype and a.shape[axis] == batch_size
        assert tree_allclose(np.take(a, index, axis=axis), e, atol=ATOL)
        np.testing.assert_array_equal(np.take(a, np.flatnonzero(~mask), axis=axis), 0)
