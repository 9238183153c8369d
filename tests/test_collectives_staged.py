"""The staged evaluation of collectives across chunks, against `jax.vmap`."""

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from hypothesis import given, settings

import filtered_chunk as fc

from .helpers import batchings, same_nonfinite, tree_allclose
from .meters import recorder
from .staged_cases import num_passes, staged_call, vmap_call


K = 3
# With a batch of at most `K`, both remainders are one `jax.vmap`; 11 is prime.
SIZES = (0, 1, K - 1, K, K + 1, 2 * K + 1, 11)
REMAINDERS = ("overlap", "separate")
CASES = batchings(SIZES, K)


def _all_collectives(m, u):
    (x,), (w,) = m, u
    n = lax.axis_size("i")
    mean = lax.pmean(x, "i")
    var = lax.pmean((x - mean) ** 2, "i")
    top = lax.pmax(x, "i")
    low = lax.pmin(x, "i")
    gathered = lax.all_gather(x, "i")
    tiled = lax.all_gather(x * w, "i", tiled=True, axis=0)
    index = lax.axis_index("i").astype(x.dtype)
    shifted = lax.ppermute(x, "i", [(j, (j + 1) % n) for j in range(n)])
    square = jnp.outer(jnp.ones(n), x)  # `n` rows: one per element
    scattered = lax.psum_scatter(square * x[None], "i", scatter_dimension=0)
    tiled_scatter = lax.psum_scatter(square, "i", scatter_dimension=0, tiled=True)
    exchanged = lax.all_to_all(square * x[None], "i", 0, 0)
    out = [
        (x - mean) * lax.rsqrt(var + 1.0),
        jnp.exp(x - top) / lax.psum(jnp.exp(x - top), "i"),
        low + gathered.sum(0) + tiled.sum(),
        index * x + n,
        shifted,
        scattered,
        tiled_scatter,
        exchanged,
    ]
    return out, [mean * w, lax.psum(w, "i")]


@pytest.mark.parametrize("batch_size, remainder", CASES)
@pytest.mark.parametrize("keep", (False, True))
def test_every_collective_matches_vmap(batch_size, remainder, keep, getkey):
    # With the stage boundaries kept too (`keep_boundaries=True`): each pass
    # writes what later passes read, rather than them recomputing it.
    x = jr.normal(getkey(), (batch_size, 2))
    w = jnp.array(1.5)
    fun = _all_collectives if batch_size else _no_shuffles
    expected = vmap_call(fun, [x], [w])
    actual = staged_call(fun, [x], [w], K, remainder, keep_boundaries=keep)
    assert tree_allclose(actual, expected)


def _no_shuffles(m, u):
    # With no elements, `ppermute` and `all_to_all` have nothing to shuffle.
    (x,), (w,) = m, u
    return [lax.pmean(x, "i") * x, lax.axis_index("i").astype(x.dtype) * x], [
        lax.psum(w, "i")
    ]


@pytest.mark.parametrize(
    "collective",
    [
        lambda x: lax.psum(x, "i"),
        lambda x: lax.pmean(x, "i"),
        lambda x: lax.all_gather(x, "i", axis=1),
        lambda x: lax.all_gather(x, "i", axis=1, tiled=True),
        lambda x: lax.ppermute(x, "i", [(0, 3), (3, 1), (1, 0), (2, 4), (4, 2)]),
        lambda x: lax.psum_scatter(x, "i", scatter_dimension=1, tiled=True),
        lambda x: lax.all_to_all(x, "i", 1, 0, tiled=True),
        lambda x: x * lax.axis_index("i").astype(x.dtype),
        lambda x: x * lax.psum(1, "i"),
    ],
)
@pytest.mark.parametrize("chunk_size", (2,))
def test_each_collective_and_its_gradient(collective, chunk_size, getkey):
    x = jr.normal(getkey(), (5, 3, 10))
    fun = lambda m, u: ([jnp.sin(collective(m[0]))], [])
    expected = vmap_call(fun, [x], [])
    assert tree_allclose(staged_call(fun, [x], [], chunk_size), expected)
    ct = jr.normal(getkey(), expected[0][0].shape)
    loss = lambda run: lambda _x: jnp.sum(run(fun, [_x], [])[0][0] * ct)
    expected_grad = jax.grad(loss(vmap_call))(x)
    staged = lambda f, m, u: staged_call(f, m, u, chunk_size)
    assert tree_allclose(jax.grad(loss(staged))(x), expected_grad)


@pytest.mark.parametrize("chunk_size", (1, 2, 3))
def test_collective_of_a_constant_inside_grad(chunk_size):
    # JAX's `testPpermuteBatcherTrivial` (jax#8688): the gradient's transpose
    # permutes a constant cotangent, a literal operand of the collective.
    perm = [[0, 1], [1, 0]]
    fun = jax.grad(lambda v: lax.ppermute(v, "i", perm=perm))
    x = jnp.array([1.0, 2.0])
    expected = jax.vmap(fun, axis_name="i")(x)
    chunked = fc.filter_chunked_vmap(fun, axis_name="i", chunk_size=chunk_size)
    assert tree_allclose(chunked(x), expected)
    summed = lambda v: lax.psum(v, "i") * 2.0  # a `psum` of a literal likewise
    fun = jax.grad(lambda v: summed(v) + lax.ppermute(v, "i", perm=perm))
    chunked = fc.filter_chunked_vmap(fun, axis_name="i", chunk_size=chunk_size)
    assert tree_allclose(chunked(x), jax.vmap(fun, axis_name="i")(x))


@pytest.mark.parametrize("collective", ("pmax", "pmin"))
@pytest.mark.parametrize("chunk_size", (1, 2))
def test_pmax_pmin_values_and_no_derivative(collective, chunk_size, getkey):
    # Ties across chunks. `jax.vmap` defines no derivative of `pmax`/`pmin` and
    # raises; so does the staged one. Of the collective of a `stop_gradient`, both
    # differentiate the rest, in reverse and forward mode.
    x = jr.normal(getkey(), (5, 3, 10))
    x = x.at[3, 0].set(x[1, 0]).at[1, 1].set(jnp.max(x[:, 1]) + 1)
    x = x.at[4, 1].set(x[1, 1]).at[2, 2].set(x[0, 2]).at[4, 2].set(x[0, 2])
    reduce = lambda y: getattr(lax, collective)(y, "i")
    fun = lambda m, u: ([jnp.sin(reduce(m[0]))], [])
    assert tree_allclose(staged_call(fun, [x], [], chunk_size), vmap_call(fun, [x], []))
    ct = jr.normal(getkey(), x.shape)
    staged = lambda f, m, u: staged_call(f, m, u, chunk_size)
    loss = lambda run, f: lambda _x: jnp.sum(run(f, [_x], [])[0][0] * ct)
    match = f"Differentiation rule for '{collective}' not implemented"
    for run in (vmap_call, staged):
        with pytest.raises(NotImplementedError, match=match):
            jax.grad(loss(run, fun))(x)
        with pytest.raises(NotImplementedError, match=match):
            jax.jvp(loss(run, fun), (x,), (ct,))
    shifted = lambda m, u: ([jnp.sin(m[0] - reduce(lax.stop_gradient(m[0])))], [])
    expected = jax.grad(loss(vmap_call, shifted))(x)
    assert tree_allclose(jax.grad(loss(staged, shifted))(x), expected)
    jvp = lambda run: jax.jvp(loss(run, shifted), (x,), (ct,))
    assert tree_allclose(jvp(staged), jvp(vmap_call))


def test_levels_countnum_passes(getkey):
    x = jr.normal(getkey(), (7, 2))
    softmax = lambda m, u: ([jnp.exp(m[0] - lax.pmax(m[0], "i"))], [])
    assert num_passes(softmax, [x], [], 3) == 1
    normalised = lambda m, u: (
        [softmax(m, u)[0][0] / lax.psum(softmax(m, u)[0][0], "i")],
        [],
    )
    assert num_passes(normalised, [x], [], 3) == 2
    # `axis_index`, `axis_size` and collectives of unmapped values cost no pass.
    free = lambda m, u: (
        [m[0] * lax.axis_index("i").astype(m[0].dtype) + lax.psum(u[0], "i")],
        [],
    )
    assert num_passes(free, [x], [jnp.array(2.0)], 3) == 0
    two = lambda m, u: ([m[0] * lax.psum(m[0], "i") * lax.pmax(m[0] ** 2, "i")], [])
    assert num_passes(two, [x], [], 3) == 1  # independent collectives share a pass


def _normalised_loss(m, u):
    (x,), (w,) = m, u
    z = jnp.tanh(x @ w)
    weight = jnp.exp(z) / lax.psum(jnp.exp(z), "i")
    centred = z - lax.pmean(z, "i")
    return [weight * centred**2], []


@pytest.mark.parametrize("batch_size, remainder", [(7, "overlap"), (11, "separate")])
def test_normalised_loss_derivatives(batch_size, remainder, getkey):
    x = jr.normal(getkey(), (batch_size, 3))
    w = jr.normal(getkey(), (3, 2))

    def loss(run):
        def _loss(_x, _w):
            return jnp.sum(run(_normalised_loss, [_x], [_w])[0][0])

        return _loss

    staged = lambda f, m, u: staged_call(f, m, u, K, remainder)
    grads = jax.grad(loss(staged), argnums=(0, 1))(x, w)
    assert tree_allclose(grads, jax.grad(loss(vmap_call), argnums=(0, 1))(x, w))
    jac = lambda run: jax.jacrev(lambda _w: run(_normalised_loss, [x], [_w])[0][0])
    assert tree_allclose(jac(staged)(w), jac(vmap_call)(w))
    tx, tw = jr.normal(getkey(), x.shape), jr.normal(getkey(), w.shape)
    jvp = lambda run: jax.jvp(loss(run), (x, w), (tx, tw))
    assert tree_allclose(jvp(staged), jvp(vmap_call))
    jitted = jax.jit(lambda _x, _w: loss(staged)(_x, _w))
    assert tree_allclose(jitted(x, w), loss(vmap_call)(x, w))


class _MLP(eqx.Module):
    layers: tuple
    norms: tuple

    def __init__(self, mode, key):
        keys = jr.split(key, 3)
        self.layers = tuple(
            eqx.nn.Linear(a, b, key=k) for a, b, k in zip((3, 8, 8), (8, 8, 2), keys)
        )
        self.norms = tuple(
            eqx.nn.BatchNorm(8, "batch", mode=mode, momentum=0.5) for _ in range(2)
        )

    def __call__(self, x, state):
        for layer, norm in zip(self.layers[:-1], self.norms):
            x, state = norm(jax.nn.relu(layer(x)), state)
        return self.layers[-1](x), state


@pytest.mark.parametrize(
    "mode, remainder", [("ema", "overlap"), ("batch", "overlap"), ("batch", "separate")]
)
def test_batch_norm_training(mode, remainder, getkey):
    model, state = eqx.nn.make_with_state(_MLP)(mode, getkey())
    x = jr.normal(getkey(), (11, 3))
    params, static = eqx.partition((model, state), eqx.is_array)
    leaves, treedef = jax.tree.flatten(params)

    def fun(m, u):
        _model, _state = eqx.combine(jax.tree.unflatten(treedef, u), static)
        y, new_state = _model(m[0], _state)
        return [y], jax.tree.leaves(new_state)

    expected = eqx.filter_vmap(
        model, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
    )(x, state)
    y, new_state = staged_call(fun, [x], leaves, 4, remainder, axis_name="batch")
    assert tree_allclose(y[0], expected[0])
    assert tree_allclose(new_state, jax.tree.leaves(expected[1]))

    inexact = [jnp.issubdtype(u.dtype, jnp.inexact) for u in leaves]

    def loss(run):
        def _loss(_diff):
            _it = iter(_diff)
            _leaves = [next(_it) if d else u for d, u in zip(inexact, leaves)]
            return jnp.sum(run(fun, [x], _leaves)[0][0] ** 2)

        return _loss

    leaves_ = leaves
    leaves = [u for d, u in zip(inexact, leaves_) if d]
    leaves, diff = leaves_, leaves

    staged = lambda f, m, u: staged_call(f, m, u, 4, remainder, axis_name="batch")
    oracle = lambda f, m, u: vmap_call(f, m, u, axis_name="batch")
    expected = jax.jit(jax.grad(loss(oracle)))(diff)  # the oracle under `jit`
    assert tree_allclose(jax.grad(loss(staged))(diff), expected)


def test_under_outer_vmap_and_outer_names(getkey):
    x = jr.normal(getkey(), (4, 7, 2))

    def fun(m, u):
        (x,) = m
        both = lax.psum(x, ("i", "j"))
        outer = lax.pmax(x, "j")
        return [x * both - outer + lax.pmean(x * outer, ("j", "i"))], []

    expected = jax.vmap(lambda _x: vmap_call(fun, [_x], []), axis_name="j")(x)
    for remainder in REMAINDERS:
        staged = lambda _x: staged_call(fun, [_x], [], 3, remainder)
        actual = jax.vmap(staged, axis_name="j")(x)
        assert tree_allclose(actual, expected)


def test_outer_vmap_of_unnamed_axis(getkey):
    x = jr.normal(getkey(), (3, 8, 2))
    w = jr.normal(getkey(), (3, 2))
    fun = lambda m, u: ([m[0] * lax.pmean(m[0] * u[0], "i")], [lax.pmax(u[0], "i")])
    expected = jax.vmap(lambda _x, _w: vmap_call(fun, [_x], [_w]))(x, w)
    actual = jax.vmap(lambda _x, _w: staged_call(fun, [_x], [_w], 3))(x, w)
    assert tree_allclose(actual, expected)


def test_select_of_cond_with_varying_predicate(getkey):
    x = jr.normal(getkey(), (7, 2))
    branch = lambda y: lax.psum(y, "i") * y
    other = lambda y: lax.pmean(jnp.sin(y), "i") + y
    fun = lambda m, u: ([lax.cond(m[0][0] > 0, branch, other, m[0])], [])
    assert tree_allclose(staged_call(fun, [x], [], 2), vmap_call(fun, [x], []))
    # The gradient of `jax.vmap` of this `cond` is wrong in jax 0.10 (it disagrees
    # with finite differences); that of the `select` it stands for is right.
    where = lambda m, u: ([jnp.where(m[0][0] > 0, branch(m[0]), other(m[0]))], [])
    assert tree_allclose(staged_call(where, [x], [], 2), vmap_call(fun, [x], []))
    loss = lambda run, f: lambda _x: jnp.sum(run(f, [_x], [])[0][0] ** 2)
    staged = lambda f, m, u: staged_call(f, m, u, 2)
    expected = jax.grad(loss(vmap_call, where))(x)
    assert tree_allclose(jax.grad(loss(staged, fun))(x), expected)
    step = 1e-6 * jnp.zeros_like(x).at[1, 0].set(1.0)
    difference = (
        loss(vmap_call, fun)(x + step) - loss(vmap_call, fun)(x - step)
    ) / 2e-6
    assert jnp.allclose(expected[1, 0], difference, rtol=1e-4)


def test_inlines_jit_and_checkpoint(getkey):
    x = jr.normal(getkey(), (7, 2))
    inner = jax.jit(lambda y: y / lax.psum(jnp.abs(y), "i"))
    fun = lambda m, u: (
        [jax.checkpoint(lambda y: inner(y) * lax.pmean(y, "i"))(m[0])],
        [],
    )
    assert tree_allclose(staged_call(fun, [x], [], 3), vmap_call(fun, [x], []))


def test_chunk_at_least_batch_is_one_vmap(getkey):
    x = jr.normal(getkey(), (4, 2))
    for chunk_size in (4, 9):
        actual = staged_call(_all_collectives, [x], [jnp.array(1.0)], chunk_size)
        assert tree_allclose(actual, vmap_call(_all_collectives, [x], [jnp.array(1.0)]))


_OPS = (
    *("psum", "pmean", "pmax", "pmin", "gather", "shift", "index", "sin", "times_x"),
    "std",  # a variance about the batch's mean, in its mean's pass
    "root",  # `sqrt` of the input, which is 0 at some elements: infinite derivatives
)


def _compose(ops):
    def fun(m, u):
        (x,) = m
        y = x
        for op in ops:
            if op == "gather":
                y = y + lax.all_gather(y, "i").mean(0)
            elif op == "shift":
                n = lax.axis_size("i")
                y = y - lax.ppermute(y, "i", [(j, (j + 1) % n) for j in range(n)])
            elif op == "index":
                y = y + 0.1 * lax.axis_index("i").astype(y.dtype)
            elif op == "sin":
                y = jnp.sin(y)
            elif op == "times_x":
                y = y * x
            elif op == "root":
                y = y + jnp.sqrt(x)
            elif op == "pmean":
                y = y - lax.pmean(y, "i")
            elif op == "std":
                mean = lax.pmean(y, "i")
                y = y + jnp.sqrt(lax.pmean((y - mean) ** 2, "i"))
            else:
                y = y + getattr(lax, op)(y, "i") * 0.5
        return [y], []

    return fun


@st.composite
def _cases(draw):
    ops = draw(st.lists(st.sampled_from(_OPS), min_size=1, max_size=5))
    batch_size = draw(st.integers(1, 9))
    chunk_size = draw(st.integers(1, 10))
    remainder = draw(st.sampled_from(REMAINDERS))
    keep = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # Data far from zero too, where a variance's rounding shows; non-negative,
    # with zeros where `sqrt` has an infinite derivative.
    offset = draw(st.sampled_from((0.0, 1e3)))
    x = np.abs(offset + rng.standard_normal((batch_size, 2)))
    x = np.where(rng.random(x.shape) < 0.3, 0.0, x)
    return tuple(ops), chunk_size, remainder, keep, x


# Each example compiles a few loops over the batch: fewer than the `ci` profile's.
@settings(max_examples=min(settings().max_examples, 40))
@given(_cases())
def test_random_compositions_match_vmap(case):
    ops, chunk_size, remainder, keep, x = case
    fun = _compose(ops)
    expected = vmap_call(fun, [jnp.asarray(x)], [])
    actual = staged_call(
        fun, [jnp.asarray(x)], [], chunk_size, remainder, keep_boundaries=keep
    )
    assert same_nonfinite(actual, expected, rtol=1e-6)
    if {"pmax", "pmin"} & set(ops):  # JAX defines no derivative of either
        return
    # The gradient of a weighted sum, infinite where `sqrt`'s derivative is,
    # `nan` only where `jax.vmap`'s is.
    weights = jnp.linspace(0.5, 1.5, x.shape[0])[:, None]
    grad = lambda run: jax.grad(lambda _x: jnp.sum(weights * run(_x)[0][0]))  # noqa: E731
    staged = lambda _x: staged_call(  # noqa: E731
        fun, [_x], [], chunk_size, remainder, keep_boundaries=keep
    )
    expected = grad(lambda _x: vmap_call(fun, [_x], []))(jnp.asarray(x))
    assert same_nonfinite(grad(staged)(jnp.asarray(x)), expected, rtol=1e-4)


def test_mapped_axis_and_constant_outputs(getkey):
    x = jr.normal(getkey(), (2, 7))  # the batch on axis 1
    fun = lambda m, u: (
        [m[0] / lax.psum(m[0], "i"), 1.0, jnp.array(2, jnp.int32)],
        [lax.pmax(m[0], "i"), 3.0],
    )
    out = staged_call(fun, [x], [], 3, in_axes=1)
    expected = jax.vmap(
        lambda _x: fun([_x], []), in_axes=1, out_axes=(0, None), axis_name="i"
    )(x)
    assert tree_allclose(out, expected)
    assert num_passes(fun, [x], [], 3, in_axes=1) == 1


def test_closed_over_parameters_get_gradients(getkey):
    # The transforms close `fun` over the unmapped arguments: under `jax.grad`
    # (and `jit`), those are tracers that the staged program must differentiate.
    x = jr.normal(getkey(), (7, 3))
    w = jr.normal(getkey(), (3,))

    def loss(run):
        def _loss(_w):
            fun = lambda m, u: ([m[0] * _w / lax.psum(jnp.exp(m[0] @ _w), "i")], [])
            return jnp.sum(run(fun, [x], [])[0][0] ** 2)

        return _loss

    staged = lambda f, m, u: staged_call(f, m, u, 3, "separate")
    assert tree_allclose(jax.grad(loss(staged))(w), jax.grad(loss(vmap_call))(w))


def test_custom_rules_without_collectives_are_honoured(getkey):
    @jax.custom_vjp
    def clip_gradient(y):
        return y

    clip_gradient.defvjp(lambda y: (y, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))

    @jax.custom_jvp
    def rule_only(y):
        return jnp.sin(y)

    rule_only.defjvp(lambda p, t: (rule_only(p[0]), 3.0 * t[0]))

    x = jr.normal(getkey(), (7, 2))
    fun = lambda m, u: (
        [clip_gradient(m[0]) * rule_only(m[0]) / lax.psum(m[0] ** 2, "i")],
        [],
    )
    loss = lambda run: lambda _x: jnp.sum(run(fun, [_x], [])[0][0])
    # `"separate"`: with `"overlap"`, the library's loop gives each copy of a
    # recomputed row half its cotangent, which a clipping rule does not respect.
    staged = lambda f, m, u: staged_call(f, m, u, 3, "separate")
    assert tree_allclose(jax.grad(loss(staged))(x), jax.grad(loss(vmap_call))(x))


def test_callbacks_run_in_the_final_pass_only():
    calls = []
    x = jnp.arange(14.0).reshape(7, 2)

    def fun(m, u):
        jax.debug.callback(lambda _: calls.append(1), m[0])
        return [m[0] / lax.psum(m[0], "i") - lax.pmax(m[0], "i")], []

    vmap_call(fun, [x], [])
    assert len(calls) == 7
    calls.clear()
    staged_call(fun, [x], [], 3, "separate")
    assert len(calls) == 7  # once per element, though there are three loops


@pytest.mark.parametrize("mode, remainder", [("ema", "separate"), ("batch", "overlap")])
@pytest.mark.parametrize("jit", (False, True))
def test_public_call_matches_filter_vmap(mode, remainder, jit, getkey):
    # `filter_chunked_vmap` with `eqx.nn.BatchNorm` in training: the outputs and
    # the new `eqx.nn.State` are `eqx.filter_vmap`'s, and so is the gradient.
    model, state = eqx.nn.make_with_state(_MLP)(mode, getkey())
    x = jr.normal(getkey(), (9, 3))
    check_public_call(model, state, x, "batch", jit, chunk_size=4, remainder=remainder)


def check_public_call(model, state, x, axis_name, jit, **options):
    """`filter_chunked_vmap(model, **options)` of a model with state against
    `eqx.filter_vmap`: the outputs, the new state and the gradient w.r.t. the
    model, eagerly or under `jit`."""
    kwargs: dict = dict(in_axes=(0, None), out_axes=(0, None), axis_name=axis_name)
    chunked_of = lambda m: fc.filter_chunked_vmap(m, **options, **kwargs)
    oracle_of = lambda m: eqx.filter_vmap(m, **kwargs)
    # The oracle under `jit` always (its eager derivative compiles each operation).
    expected = eqx.filter_jit(oracle_of(model))(x, state)
    call = eqx.filter_jit(chunked_of(model)) if jit else chunked_of(model)
    assert tree_allclose(call(x, state), expected)

    def loss(m, apply):
        out, _ = apply(m)(x, state)
        return jnp.sum(jnp.tanh(out))

    grad = eqx.filter_grad(loss)
    actual = eqx.filter_jit(grad)(model, chunked_of) if jit else grad(model, chunked_of)
    assert tree_allclose(actual, eqx.filter_jit(grad)(model, oracle_of))


@pytest.mark.parametrize("jit", (False, True))
def test_closing_over_state_under_grad(jit, getkey):
    # A `fun` that closes over an `eqx.nn.State`, which `state.set` replaces in
    # the first trace that gets that far, differentiated eagerly or under `jit`:
    # `fun` is looked at once with the axis unbound (which stops at the first
    # collective) and traced once, never again for the derivative (the eager
    # call evaluates its traced program under `jax.grad`: `_eager.py`).
    model, state = eqx.nn.make_with_state(_MLP)("batch", getkey())
    x = jr.normal(getkey(), (9, 3))
    traces = []

    def loss(m, s, vmap, **options):
        def fun(u):
            traces.append(None)
            return m(u, s)

        out, _ = vmap(fun, out_axes=(0, None), axis_name="batch", **options)(x)
        return jnp.sum(jnp.tanh(out))

    copy = lambda: jax.tree.map(lambda a: a, state)  # noqa: E731
    grad = eqx.filter_grad(loss)
    chunked = eqx.filter_jit(grad) if jit else grad
    actual = chunked(model, copy(), fc.filter_chunked_vmap, chunk_size=4)
    assert len(traces) == 2
    expected = eqx.filter_jit(grad)(model, copy(), eqx.filter_vmap)
    assert tree_allclose(actual, expected)


@pytest.mark.parametrize("remainder", REMAINDERS)
def test_pargmax_from_levels(remainder, getkey):
    # The position of the batch's maximum, composed of `pmax`, `axis_index` and
    # `pmin` (the first of ties): two dependent levels, through the public call.
    def pargmax(x):
        top = lax.pmax(x, "i")
        index = lax.axis_index("i")
        return lax.pmin(jnp.where(x == top, index, lax.axis_size("i")), "i")

    x = jr.normal(getkey(), (11, 4)).at[7, 1].set(9.0).at[2, 1].set(9.0)
    expected = eqx.filter_vmap(pargmax, axis_name="i")(x)
    chunked = fc.filter_chunked_vmap(
        pargmax, axis_name="i", chunk_size=K, remainder=remainder
    )
    assert tree_allclose(chunked(x), expected)
    assert bool(jnp.all(expected[0] == jnp.argmax(x, axis=0).astype(jnp.int32)))


@pytest.mark.parametrize("remainder", REMAINDERS)
@pytest.mark.parametrize("jit", (False, True))
def test_progress_reports_every_loop(remainder, jit):
    # A softmax over the batch takes three loops (`pmax`, then `psum`, then the
    # outputs): each reports as one run of the meter, labelled with its loop, and
    # counts every element once.
    meter = recorder()
    softmax = lambda x: (
        jnp.exp(x - lax.pmax(x, "i")) / lax.psum(jnp.exp(x - lax.pmax(x, "i")), "i")
    )
    x = jnp.linspace(-1.0, 1.0, 22).reshape(11, 2)
    chunked = fc.filter_chunked_vmap(
        softmax, axis_name="i", chunk_size=K, remainder=remainder, progress_meter=meter
    )
    out = (jax.jit(chunked) if jit else chunked)(x)
    assert tree_allclose(out, eqx.filter_vmap(softmax, axis_name="i")(x))
    opens = [i for i, e in enumerate(meter.events) if e[0] == "open"]
    labels = [f"filter_chunked_vmap (loop {k} of 3)" for k in (1, 2, 3)]
    assert [meter.events[i] for i in opens] == [("open", s, 11) for s in labels]
    for start, end in zip(opens, [*opens[1:], len(meter.events)]):
        one = meter.events[start:end]
        counts = [e[1] for e in one[1:-1]]
        assert one[-1] == ("close",) and counts[-1] == 11
        assert all(a < b for a, b in zip(counts, counts[1:]))
