"""Collectives across chunks with their stage boundaries kept
(`keep_boundaries=True`): each pass writes the per-element values that later passes
resume from, and reads those of earlier passes, against `eqx.filter_vmap`."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc

from .budgets import compiled_bytes
from .helpers import tree_allclose
from .test_collectives_staged import check_public_call


class _Net(eqx.Module):
    """`depth` blocks of `Linear`, ReLU and a `BatchNorm` in batch mode: two
    dependent `pmean`s per block."""

    layers: tuple
    norms: tuple

    def __init__(self, depth, key):
        keys = jr.split(key, depth + 1)
        sizes = (3,) + (6,) * depth + (2,)
        self.layers = tuple(
            eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes, sizes[1:], keys)
        )
        self.norms = tuple(eqx.nn.BatchNorm(6, "i", mode="batch") for _ in range(depth))

    def __call__(self, x, state):
        for layer, norm in zip(self.layers[:-1], self.norms):
            x, state = norm(jax.nn.relu(layer(x)), state)
        return self.layers[-1](x), state


_KWARGS: dict = dict(in_axes=(0, None), out_axes=(0, None), axis_name="i")


def _kept(fun, chunk_size, **kwargs):
    return fc.filter_chunked_vmap(
        fun, chunk_size=chunk_size, keep_boundaries=True, **_KWARGS, **kwargs
    )


@pytest.mark.parametrize(
    "batch_size, remainder, jit",
    [
        (1, "overlap", False),
        (3, "overlap", True),
        (4, "separate", True),
        (5, "overlap", False),
        (5, "separate", True),
        (9, "overlap", True),
        (9, "separate", False),
    ],
)
def test_batch_norm_matches_filter_vmap(batch_size, remainder, jit, getkey):
    # Outputs, the new `eqx.nn.State` and the gradient w.r.t. the model, at chunks
    # of 4 (batches of 1, k - 1, k, k + 1 and 2k + 1), eagerly and under `jit`.
    model, state = eqx.nn.make_with_state(_Net)(3, getkey())
    x = jr.normal(getkey(), (batch_size, 3))
    options = dict(chunk_size=4, remainder=remainder, keep_boundaries=True)
    check_public_call(model, state, x, "i", jit, **options)


def _dependent(x, w):
    h = jnp.tanh(x * w)
    mean = lax.pmean(h, "i")
    d = jnp.sin(h - mean)
    var = lax.pmean(d**2, "i")
    g = jnp.exp(d * lax.rsqrt(var + 1.0))
    return g / lax.psum(g, "i") + lax.all_gather(h, "i").sum(0), mean


def test_jvp_and_outer_vmap(getkey):
    x = jr.normal(getkey(), (2, 7, 3))
    w = jnp.array([0.5, 1.0, 2.0])
    kwargs: dict = dict(in_axes=(0, None), out_axes=(0, None), axis_name="i")
    oracle = eqx.filter_vmap(_dependent, **kwargs)
    kept = fc.filter_chunked_vmap(
        _dependent, chunk_size=3, keep_boundaries=True, **kwargs
    )
    tx, tw = jr.normal(getkey(), x.shape[1:]), jr.normal(getkey(), (3,))
    jvp = lambda f: jax.jvp(f, (x[0], w), (tx, tw))
    assert tree_allclose(jvp(kept), jvp(oracle))
    outer = lambda f: jax.vmap(f, in_axes=(0, None))(x, w)
    assert tree_allclose(outer(kept), outer(oracle))
    assert tree_allclose(jax.jit(lambda _x: outer(kept))(x), outer(oracle))


def _count(jaxpr, name):
    found = 0
    for eqn in jaxpr.eqns:
        found += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _count(sub, name)
    return found


@pytest.mark.parametrize("depth", (2, 4))
def test_each_layer_runs_once(depth, getkey):
    # Each `Linear` is one `dot_general` per element: with the boundaries kept,
    # the program holds one per layer, as `eqx.filter_vmap`'s, and one more per
    # BatchNorm, which evaluates its block on a sample for the shift of
    # its variance (`_staged/_moments.py`); recomputing, the block of level `s`
    # runs again in every later pass.
    model, state = eqx.nn.make_with_state(_Net)(depth, getkey())
    x = jr.normal(getkey(), (16, 3))

    def dots(chunked):
        return _count(jax.make_jaxpr(chunked)(x, state).jaxpr, "dot_general")

    oracle = eqx.filter_vmap(model, **_KWARGS)
    recomputed = fc.filter_chunked_vmap(model, chunk_size=4, **_KWARGS)
    assert dots(oracle) == depth + 1
    assert dots(_kept(model, 4)) == dots(oracle) + depth
    assert dots(recomputed) > 2 * depth + 1


def test_types_through_buffers(getkey):
    # A weak float and small integers written by one pass and read by the next
    # keep their types: the outputs are `eqx.filter_vmap`'s, weak type included.
    def fun(x, n):
        h = x * 1.5  # weak
        k = (n * 3).astype(jnp.int8)
        m = lax.pmean(h, "i")
        s = lax.psum(k, "i")
        out = h - m + k.astype(h.dtype), k * s, (n > 2) & (h > m)
        return (*out, h * 2.0)  # `h`, read from a buffer, is still weak

    x = lax.full((10,), 1.5)  # weakly typed
    n = jnp.arange(10, dtype=jnp.int16)
    expected = eqx.filter_vmap(fun, axis_name="i")(x, n)
    kept = fc.filter_chunked_vmap(
        fun, axis_name="i", chunk_size=3, keep_boundaries=True
    )
    assert jax.typeof(expected[3]).weak_type
    assert tree_allclose(kept(x, n), expected)


def test_keep_boundaries_must_be_a_bool_or_a_positive_int():
    for wrong in ("yes", 2.0, np.float32(1.0)):
        with pytest.raises(TypeError, match="keep_boundaries.*got"):
            fc.filter_chunked_vmap(jnp.sin, chunk_size=2, keep_boundaries=wrong)  # pyright: ignore[reportArgumentType]
    for every in (0, -2, np.int64(0)):
        with pytest.raises(ValueError, match="keep_boundaries.*positive integer.*got"):
            fc.filter_chunked_vmap(jnp.sin, chunk_size=2, keep_boundaries=every)


@pytest.mark.parametrize(
    "keep, same", [(np.int64(2), 2), (np.int32(1), True), (np.bool_(True), True)]
)
def test_keep_boundaries_takes_numpy_integers(keep, same, getkey):
    # Any integer type, as `chunk_size` takes: the same program as the Python
    # value's (the same layers run), with `eqx.filter_vmap`'s values.
    x, w = jr.normal(getkey(), (7, 3)), jnp.array([0.5, 1.0, 2.0])
    kwargs: dict = dict(in_axes=(0, None), out_axes=(0, None), axis_name="i")
    call = lambda k: fc.filter_chunked_vmap(
        _dependent, chunk_size=3, keep_boundaries=k, **kwargs
    )
    jaxpr = lambda k: str(jax.make_jaxpr(call(k))(x, w))
    assert jaxpr(keep) == jaxpr(same)
    assert tree_allclose(call(keep)(x, w), eqx.filter_vmap(_dependent, **kwargs)(x, w))


@pytest.mark.parametrize(
    "batch_size, remainder, every",
    [(1, "overlap", 2), (5, "overlap", 4), (9, "separate", 2), (9, "overlap", 3)],
)
def test_every_nth_pass_matches_filter_vmap(batch_size, remainder, every, getkey):
    # Three BatchNorm blocks: six passes, of which every `n`-th keeps its
    # boundaries and the others recompute from the latest kept; outputs, state and
    # gradients as `eqx.filter_vmap`'s, at chunks of 4.
    model, state = eqx.nn.make_with_state(_Net)(3, getkey())
    x = jr.normal(getkey(), (batch_size, 3))
    options = dict(chunk_size=4, remainder=remainder, keep_boundaries=every)
    check_public_call(model, state, x, "i", batch_size != 1, **options)


def test_every_nth_pass_inside_cond_and_scan(getkey):
    # A call keeping every 2nd pass's boundaries inside `lax.cond` (both branches)
    # and a `lax.scan` that feeds each step's output to the next's parameters:
    # values, an int8 and a bool output, and gradients through both, under `jit`.
    def f(x, w):
        y, mean = _dependent(x, w)
        return y, (mean * 4).astype(jnp.int8), mean > 0

    axes: dict = dict(in_axes=(0, None), out_axes=(0, None, None), axis_name="i")
    chunked = fc.filter_chunked_vmap(
        f, chunk_size=3, remainder="separate", keep_boundaries=2, **axes
    )
    vmapped = eqx.filter_vmap(f, **axes)
    x, w = jr.normal(getkey(), (7, 3)), jr.normal(getkey(), (3,))

    def program(fn):
        def _loss(_w):
            out = lax.cond(_w[0] > 0, lambda: fn(x, _w), lambda: fn(2 * x, _w))

            def _step(carry, scale):
                y, _, _ = fn(x * scale, _w * carry)
                return carry + y.mean(), y

            _, ys = lax.scan(_step, 1.0, jnp.array([1.0, 0.5]))
            return jnp.sum(out[0] ** 2) + jnp.sum(jnp.sin(ys)), (out, ys)

        return jax.jit(jax.value_and_grad(_loss, has_aux=True))

    for sign in (1, -1):
        w = w.at[0].set(sign * abs(w[0]))
        assert tree_allclose(program(chunked)(w), program(vmapped)(w))


def test_every_nth_pass_runs_fewer_layers_than_recomputing(getkey):
    # Four blocks (four passes, one per BatchNorm): the program holds fewer
    # `dot_general`s the more passes keep their boundaries, from recomputing
    # (`False`) to keeping them all.
    model, state = eqx.nn.make_with_state(_Net)(4, getkey())
    x = jr.normal(getkey(), (16, 3))

    def dots(keep):
        chunked = fc.filter_chunked_vmap(
            model, chunk_size=4, keep_boundaries=keep, **_KWARGS
        )
        return _count(jax.make_jaxpr(chunked)(x, state).jaxpr, "dot_general")

    found = [dots(keep) for keep in (False, 4, 3, 2, True)]
    assert found == sorted(found, reverse=True) and len(set(found)) == 5
    assert found[-1] == 5 + 4 and dots(1) == found[-1] and dots(64) == found[0]


def _wide(x, weights):
    """Blocks whose boundaries (6 values per element) are much smaller than their
    working set (64), each normalised over the batch."""
    for w1, w2 in weights:
        x = jnp.tanh(x @ w1) @ w2
        x = x - lax.pmean(x, "i")
        x = x * lax.rsqrt(lax.pmean(x**2, "i") + 1.0)
    return x


def _weights(key, depth):
    keys = jr.split(key, 2 * depth)
    return [
        (jr.normal(keys[2 * i], (6, 64)), jr.normal(keys[2 * i + 1], (64, 6)) / 8)
        for i in range(depth)
    ]


def _budgeted(budget, tune=None, **kwargs):
    return fc.filter_chunked_vmap(
        _wide,
        in_axes=(0, None),
        axis_name="i",
        chunk_size=fc.MemoryBudget(budget, tune=tune),
        **kwargs,
    )


def test_budget_keeps_boundaries_that_fit(getkey):
    # A budget that the kept boundaries fit, but not the whole batch: the choice
    # keeps them, and the call fits, runs each layer once and matches
    # `eqx.filter_vmap`.
    x, weights = jr.normal(getkey(), (256, 6)), _weights(getkey(), 3)
    budget = 100 * 1024
    oracle = eqx.filter_vmap(_wide, in_axes=(0, None), axis_name="i")
    assert compiled_bytes(oracle, x, weights) > budget
    choice = fc.suggest_chunk_size(_budgeted(budget), x, weights)
    assert choice.keep_boundaries and choice.chunk_size < 256
    assert compiled_bytes(_budgeted(budget), x, weights) == choice.bytes <= budget
    # Each layer once, and once more on a sample for its block's shift
    # (the variance is summed in its mean's pass: `_staged/_moments.py`).
    jaxpr = jax.make_jaxpr(_budgeted(budget))(x, weights).jaxpr
    assert _count(jaxpr, "dot_general") == 6 + 6
    assert tree_allclose(_budgeted(budget)(x, weights), oracle(x, weights))
    # What the choice reports: a pass a block, each keeping its block's output
    # (6 values an element, as `x`), and the work of `_wide` once, with the
    # shifts' samples (a chunk each, at most) besides.
    assert choice.passes == 3
    assert choice.boundary_bytes == 3 * x.size * x.dtype.itemsize
    assert 1.0 < choice.work < 1.0 + 2 * choice.chunk_size / 256
    # Recomputing, the passes evaluate blocks 1, 1-2 and 1-3, the final loop 1-3.
    recomputing = fc.suggest_chunk_size(
        _budgeted(budget, keep_boundaries=False), x, weights
    )
    assert (recomputing.passes, recomputing.boundary_bytes) == (3, 0)
    assert recomputing.work > 2.5


def test_budget_too_small_for_every_pass_keeps_fewer(getkey):
    # Under `jax.grad`, every kept boundary is a residual of the backward pass: a
    # budget below every pass's refuses `keep_boundaries=True`, and by default
    # keeps every `n`-th pass's, so the call fits, runs fewer layers than
    # recomputing and more than keeping them all, and matches `eqx.filter_vmap`.
    # Six blocks, the chunk size by the model (`tune=False`, no timing): three
    # blocks' recomputed gradient, whose tangents take one loop through all of
    # `fun` (`_staged/_derivative.py`), fitted this budget at every size tried.
    x, weights = jr.normal(getkey(), (256, 6)), _weights(getkey(), 6)
    budget = 160 * 1024
    loss = lambda run: lambda w: jnp.sum(jnp.sin(run(x, w)))
    with pytest.raises(ValueError, match="too small"):
        jax.grad(loss(_budgeted(budget, keep_boundaries=True, tune=False)))(weights)
    grad = jax.grad(loss(_budgeted(budget, tune=False)))
    assert compiled_bytes(grad, weights) <= budget

    def dots(run):
        return _count(jax.make_jaxpr(jax.grad(loss(run)))(weights).jaxpr, "dot_general")

    def fixed(keep):
        return fc.filter_chunked_vmap(
            _wide, in_axes=(0, None), axis_name="i", chunk_size=16, keep_boundaries=keep
        )

    assert dots(fixed(True)) < dots(_budgeted(budget, tune=False)) < dots(fixed(False))
    oracle = eqx.filter_vmap(_wide, in_axes=(0, None), axis_name="i")
    assert tree_allclose(grad(weights), jax.grad(loss(oracle))(weights))


def test_budget_runs_a_batch_that_fits_whole(getkey):
    # Split, collectives across chunks cost passes over the batch: a budget that
    # the whole batch fits runs it whole, as `eqx.filter_vmap`, whatever the
    # speed model's cap.
    x, weights = jr.normal(getkey(), (256, 6)), _weights(getkey(), 3)
    oracle = eqx.filter_vmap(_wide, in_axes=(0, None), axis_name="i")
    budget = compiled_bytes(oracle, x, weights)
    choice = fc.suggest_chunk_size(_budgeted(budget), x, weights)
    assert choice.chunk_size == 256 and choice.bytes <= budget
    assert not choice.keep_boundaries
    assert (choice.passes, choice.boundary_bytes, choice.work) == (0, 0, 1.0)


def test_kept_memory_does_not_grow_with_depth(getkey):
    # Evaluated, each pass writes into the buffers no later pass reads: the kept
    # values of a deeper network need no more memory (XLA would otherwise keep
    # every loop's output allocated: a buffer more a pass). Two blocks and four
    # (a pass each): one block has one pass, whose buffers no pass reuses.
    x = jr.normal(getkey(), (256, 6))
    boundary = x.size * x.dtype.itemsize  # one kept value of every element

    def kept_bytes(depth):
        chunked = fc.filter_chunked_vmap(
            _wide, in_axes=(0, None), axis_name="i", chunk_size=16, keep_boundaries=True
        )
        return compiled_bytes(chunked, x, _weights(getkey(), depth))

    shallow, deep = kept_bytes(2), kept_bytes(4)
    assert deep - shallow < boundary


@jax.custom_vjp
def _doubled(h):
    return 2.0 * h


_doubled.defvjp(lambda h: (2.0 * h, None), lambda _, ct: (2.0 * ct,))


def _reread(x, w, depth):
    # `h` is kept by the first pass and read by every later one (through a
    # `custom_vjp`, whose backward pass the leftover of an overlap runs apart).
    h = jnp.tanh(x * w)
    m = lax.pmean(h, "i")
    for _ in range(depth):
        m = lax.pmean(_doubled(h) * jnp.cos(m), "i")
    return h * m


@pytest.mark.parametrize(
    "batch_size, remainder",
    [(2, "overlap"), (7, "overlap"), (7, "separate"), (9, "overlap")],
)
def test_value_read_by_every_pass_derivatives(batch_size, remainder, getkey):
    # Each loop that reads a kept value relays it to the next, and in reverse mode
    # adds its cotangent into the one the later loops accumulated: gradients,
    # Hessian-vector products and an outer `vmap` of gradients as
    # `eqx.filter_vmap`'s, with chunks of 3 (one `vmap`, an overlap, a separate
    # remainder, whole chunks).
    x = jr.normal(getkey(), (batch_size, 4))
    w = jr.normal(getkey(), (4,))
    c = jr.normal(getkey(), (batch_size, 4))
    kwargs: dict = dict(in_axes=(0, None, None), axis_name="i")
    oracle = eqx.filter_vmap(_reread, **kwargs)
    kept = fc.filter_chunked_vmap(
        _reread, chunk_size=3, remainder=remainder, keep_boundaries=True, **kwargs
    )

    def grad(f):
        return jax.grad(lambda _x, _w: jnp.sum(c * f(_x, _w, 3)), argnums=(0, 1))

    assert tree_allclose(grad(kept)(x, w), grad(oracle)(x, w))
    assert tree_allclose(jax.jit(grad(kept))(x, w), grad(oracle)(x, w))
    tx, tw = jr.normal(getkey(), x.shape), jr.normal(getkey(), w.shape)
    hvp = lambda f: jax.jvp(grad(f), (x, w), (tx, tw))  # noqa: E731
    assert tree_allclose(hvp(kept), hvp(oracle))
    xs = jnp.stack([x, -x])
    outer = lambda f: jax.vmap(grad(f), in_axes=(0, None))(xs, w)  # noqa: E731
    assert tree_allclose(outer(kept), outer(oracle))


def test_kept_cotangent_memory_does_not_grow_with_readers(getkey):
    # Under `jax.grad`, a kept value read by `n` loops has one batch-sized
    # cotangent, which their transposed loops add into in place; were each to
    # make its own, XLA would sum them after the last, with all `n` alive (a
    # buffer more a reader: `benchmarks/cotangent_reads.py`).
    x = jr.normal(getkey(), (256, 8))
    w = jr.normal(getkey(), (8,))
    c = jr.normal(getkey(), x.shape)  # an argument: no constant cotangent to fold
    boundary = x.size * x.dtype.itemsize  # one kept value of every element

    def grad_bytes(depth):
        kept = fc.filter_chunked_vmap(
            lambda _x, _w: _reread(_x, _w, depth),
            in_axes=(0, None),
            axis_name="i",
            chunk_size=32,
            keep_boundaries=True,
        )
        loss = lambda _x, _w, _c: jnp.sum(_c * kept(_x, _w))  # noqa: E731
        return compiled_bytes(jax.grad(loss, argnums=(0, 1)), x, w, c)

    few, many = grad_bytes(1), grad_bytes(5)
    assert many - few < boundary


@pytest.mark.parametrize("chunk_size", (16, 24))
def test_kept_cotangents_share_two_buffers(chunk_size, getkey):
    # Under `jax.grad` every kept value is a residual, but the cotangents of a
    # chain of them pass two buffers back and forth: each transposed loop reads
    # the cotangent of the value it kept from one carry, zeroing it, and adds
    # that of the value it read into another, which started as the zeros of
    # the loop after it (`_loop/_rule.py`, `_carried`). Two more blocks of
    # `_wide` keep two more values (a pass each); with a cotangent buffer each,
    # as the loop's transpose would otherwise make them, they needed 5.2 (chunks
    # of 16) and 5.9 (24, an overlapping last chunk) boundaries more, against
    # 3.3 and 4.1 with two buffers (3.3 and 4.2 when one buffer was written
    # over in place, which made `nan` of infinite second derivatives).
    x = jr.normal(getkey(), (256, 6))
    c = jr.normal(getkey(), x.shape)  # an argument: no constant cotangent to fold
    boundary = x.size * x.dtype.itemsize  # one kept value of every element
    kept = fc.filter_chunked_vmap(
        _wide,
        in_axes=(0, None),
        axis_name="i",
        chunk_size=chunk_size,
        keep_boundaries=True,
    )
    loss = lambda _w, _c: jnp.sum(_c * kept(x, _w))  # noqa: E731
    key = getkey()
    shallow, deep = (
        compiled_bytes(jax.grad(loss), _weights(key, depth), c) for depth in (2, 4)
    )
    assert deep - shallow < (2 + 2.5) * boundary
    oracle = eqx.filter_vmap(_wide, in_axes=(0, None), axis_name="i")
    weights = _weights(key, 4)
    expected = jax.grad(lambda _w: jnp.sum(c * oracle(x, _w)))(weights)
    assert tree_allclose(jax.grad(loss)(weights, c), expected)


def _custom_first(x, w):
    # The first pass computes `h` through a `custom_vjp` (with an overlap, the
    # derivative evaluates the leftover rows apart) and keeps it; the second
    # keeps `g`: each one's tangent rides its loop's carry.
    h = _doubled(jnp.tanh(x * w))
    g = jnp.sin(h - lax.pmean(h, "i"))
    return g * lax.pmean(g, "i")


@pytest.mark.parametrize(
    "batch_size, remainder",
    [(2, "overlap"), (7, "overlap"), (7, "separate"), (9, "overlap"), (10, "overlap")],
)
def test_written_over_derivatives(batch_size, remainder, getkey):
    x = jr.normal(getkey(), (batch_size, 4))
    w = jr.normal(getkey(), (4,))
    c = jr.normal(getkey(), (batch_size, 4))
    kwargs: dict = dict(in_axes=(0, None), axis_name="i")
    oracle = eqx.filter_vmap(_custom_first, **kwargs)
    kept = fc.filter_chunked_vmap(
        _custom_first, chunk_size=3, remainder=remainder, keep_boundaries=True, **kwargs
    )

    def grad(f):
        return jax.grad(lambda _x, _w: jnp.sum(c * f(_x, _w)), argnums=(0, 1))

    assert tree_allclose(jax.jit(grad(kept))(x, w), grad(oracle)(x, w))
    # Forward mode over reverse (a `custom_vjp` takes no forward mode alone).
    tx, tw = jr.normal(getkey(), x.shape), jr.normal(getkey(), w.shape)
    hvp = lambda f: jax.jvp(grad(f), (x, w), (tx, tw))  # noqa: E731
    assert tree_allclose(hvp(kept), hvp(oracle))
