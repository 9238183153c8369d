"""Property tests over random PyTrees, axes, batch sizes and chunk sizes."""

from typing import Any, NamedTuple

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given

import filtered_chunk as fc

from .helpers import tree_allclose


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


def _oracle(case: _Case) -> Any:
    return eqx.filter_vmap(_f, in_axes=case.in_axes, out_axes=case.out_axes)


@given(_cases())
def test_matches_filter_vmap(case):
    expected = _oracle(case)(case.tree)
    assert tree_allclose(_chunked(case, case.chunk_size)(case.tree), expected)


@given(_cases())
def test_chunk_size_does_not_change_result(case):
    a = _chunked(case, case.chunk_size)(case.tree)
    b = _chunked(case, case.other_chunk_size)(case.tree)
    assert tree_allclose(a, b)


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
    assert tree_allclose(actual, _oracle(case)(case.tree))
