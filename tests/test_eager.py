"""Eager (outside `jit`) chunked calls: what they return, raise and compile."""

import functools as ft
import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtered_chunk as fc
import filtered_chunk._eager as eager_module

from .helpers import chunkings, count_compiles, tree_allclose
from .transforms import JACOBIANS, TRANSFORMS


_MAPS = ("filter_chunked_vmap", "filter_chunked_apply")


_CLOSED = jnp.arange(3.0)


@pytest.mark.parametrize("chunk_size, remainder", chunkings(10, (None, 3)))
@pytest.mark.parametrize(
    "value",
    (np.float64(1e-12), np.full(2, 1e-12, np.float64), np.int8(3), _CLOSED),
    ids=("np-scalar", "np-array", "np-int8", "closed-over-jax"),
)
def test_untraced_unmapped_outputs_come_back_as_they_are(value, chunk_size, remainder):
    # A NumPy float64 must not become a float32 (or any) `jax.Array`.
    x = jnp.arange(10.0)
    f = lambda x: (x * 2, value)
    out_axes = (0, None)
    expected = eqx.filter_vmap(f, out_axes=out_axes)(x)
    vmap, apply = (TRANSFORMS[name].builder for name in _MAPS)
    actual = vmap(f, chunk_size=chunk_size, remainder=remainder, out_axes=out_axes)(x)
    assert tree_allclose(actual, expected)
    assert type(actual[1]) is type(value) and np.all(actual[1] == value)
    expected = f(x)
    actual = apply(f, chunk_size=chunk_size, remainder=remainder, out_axes=out_axes)(x)
    assert tree_allclose(actual, expected)
    assert actual[1] is value


@pytest.mark.parametrize("name", _MAPS)
@pytest.mark.parametrize("chunk_size", (None, 3))
def test_equinox_runtime_errors_surface(name, chunk_size):
    make = ft.partial(TRANSFORMS[name].builder, chunk_size=chunk_size)
    f = lambda x: eqx.error_if(x, x > 5, "too big")
    with pytest.raises(eqx.EquinoxRuntimeError, match="too big"):
        eqx.filter_jit(eqx.filter_vmap(f))(jnp.arange(10.0))
    with pytest.raises(eqx.EquinoxRuntimeError, match="too big"):
        make(f)(jnp.arange(10.0))
    x = jnp.arange(5.0)
    assert tree_allclose(make(f)(x), x)


@jax.custom_vjp
def _sin_vjp(x):
    return jnp.sin(x)


_sin_vjp.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


@jax.custom_jvp
def _sin_jvp(x):
    return jnp.sin(x)


_sin_jvp.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
_W = jnp.arange(3.0)


def _checkpointed_loop(x):
    body = lambda c: (c[0] + 1, c[1] * 1.5)
    init = (0, x)
    out = eqx.internal.while_loop(
        lambda c: c[0] < 2, body, init, max_steps=3, kind="checkpointed"
    )
    return out[1]


def _callback_returning(x):
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    # A new lambda on every trace, as users write it.
    return jax.pure_callback(
        lambda v: np.asarray(v) * 2, shape, x, vmap_method="sequential"
    )


# Each makes new Python objects (rules, closures, wrappers) on every trace.
_CONSTRUCTS = {
    "custom_vjp": _sin_vjp,
    "custom_jvp": _sin_jvp,
    "debug.callback": lambda x: (jax.debug.callback(lambda v: None, x), x * 2)[1],
    "debug.print": lambda x: (jax.debug.print("{x}", x=x[0]), x * 2)[1],
    "pure_callback": _callback_returning,
    "while_loop-checkpointed": _checkpointed_loop,
    "inner-jit-closing-over-array": lambda x: jax.jit(
        lambda y: y * jnp.broadcast_to(_W, y.shape)
    )(x),
    "inner-filter_jit-closing-over-array": lambda x: eqx.filter_jit(
        lambda y: y * jnp.broadcast_to(_W, y.shape)
    )(x),
}


@pytest.mark.parametrize("apply", (False, True))
@pytest.mark.parametrize("fun", _CONSTRUCTS.values(), ids=_CONSTRUCTS.keys())
def test_eager_calls_do_not_recompile_for_new_python_objects(fun, apply, capfd):
    # Every construct is elementwise, so also a function of a whole batch.
    make = fc.filter_chunked_apply if apply else fc.filter_chunked_vmap
    chunked = make(fun, chunk_size=2)
    x = jnp.linspace(0.0, 1.0, 15).reshape(5, 3)
    x2 = x + 1.0
    chunked(x)
    with count_compiles() as compiles:
        outs = [chunked(x_) for x_ in (x, x2, x)]
    assert compiles == []
    assert tree_allclose(outs[1], fun(x2) if apply else eqx.filter_vmap(fun)(x2))
    capfd.readouterr()  # what `jax.debug.print` printed


def test_callbacks_never_run_with_stale_closures():
    def make(scale, table):
        def fun(x):
            shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
            # Closes over `scale` and `table`: a new closure on every call of
            # `make`, with the same code.
            callback = lambda v: np.asarray(v) * scale + table
            return jax.pure_callback(callback, shape, x, vmap_method="sequential")

        return fun

    x = jnp.linspace(0.0, 1.0, 15).reshape(5, 3)
    table = np.ones(3)
    for scale in (2.0, 3.0, -0.0, 0.0, 3.0):
        fun = make(scale, table)
        expected = eqx.filter_vmap(fun)(x)
        assert tree_allclose(fc.filter_chunked_vmap(fun, chunk_size=2)(x), expected)
    table[:] = 5.0  # changed in place
    fun = make(3.0, table)
    expected = eqx.filter_vmap(fun)(x)
    assert tree_allclose(fc.filter_chunked_vmap(fun, chunk_size=2)(x), expected)


@pytest.mark.parametrize("jit", (jax.jit, eqx.filter_jit))
def test_inner_jit_never_runs_with_stale_constants(jit):
    state = {"w": jnp.arange(3.0), "c": 2.0}

    def fun(x):
        return jit(lambda y: y * state["w"] + state["c"])(x)

    x = jnp.linspace(0.0, 1.0, 15).reshape(5, 3)
    chunked = fc.filter_chunked_vmap(fun, chunk_size=2)
    for w, c in ((jnp.arange(3.0), 2.0), (jnp.ones(3), 2.0), (jnp.ones(3), 5.0)):
        state.update(w=w, c=c)
        assert tree_allclose(chunked(x), eqx.filter_vmap(fun)(x))


def test_custom_rules_stay_out_of_the_key_but_the_primal_does_not():
    def make(scale):
        @jax.custom_vjp
        def f(x):
            return x * scale

        f.defvjp(lambda x: (x * scale, None), lambda _, g: (g * scale,))
        return f

    x = jnp.linspace(0.0, 1.0, 15).reshape(5, 3)
    for scale in (2.0, 3.0):
        fun = make(scale)
        actual = fc.filter_chunked_vmap(fun, chunk_size=2)(x)
        assert tree_allclose(actual, eqx.filter_vmap(fun)(x))
        grad = lambda m: jax.grad(lambda x: m(fun)(x).sum())(x)
        assert tree_allclose(
            grad(ft.partial(fc.filter_chunked_vmap, chunk_size=2)),
            grad(eqx.filter_vmap),
        )


@pytest.mark.parametrize("chunk_size", (None, 2))
@pytest.mark.parametrize("name", JACOBIANS)
def test_untraced_aux_comes_back_as_it_is(name, chunk_size):
    ours, oracle = JACOBIANS[name].builder, JACOBIANS[name].oracle
    f = lambda x: (x**2, (np.float64(1e-12), jnp.sum(x)))
    x = jnp.linspace(0.0, 1.0, 5)
    expected = oracle(f, has_aux=True)(x)
    actual = ours(f, has_aux=True, chunk_size=chunk_size)(x)
    assert tree_allclose(actual, expected)
    assert type(actual[1][0]) is np.float64


def test_callbacks_never_write_into_a_previous_calls_objects():
    # A callback that appends to (or writes into) what it closes over must be this
    # call's callback: equal contents (two empty lists) are not the same object.
    x = jnp.linspace(0.0, 1.0, 15).reshape(5, 3)

    def make():
        log, buffer = [], np.zeros(3)

        def callback(v):
            log.append(None)
            buffer[:] = np.asarray(v)
            return np.asarray(v) * 2

        def fun(x):
            shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
            return jax.pure_callback(callback, shape, x, vmap_method="sequential")

        return fun, log, buffer

    for _ in range(3):
        fun, log, buffer = make()
        out = fc.filter_chunked_vmap(fun, chunk_size=2)(x)
        assert tree_allclose(out, x * 2)
        assert len(log) >= 5 and np.all(buffer != 0.0)


_LEAK_BUILDERS = (
    ft.partial(fc.filter_chunked_vmap, remainder="overlap"),
    ft.partial(fc.filter_chunked_vmap, remainder="separate"),
    fc.filter_chunked_apply,
    fc.chunked_jacrev,
    fc.chunked_jacfwd,
    fc.filter_chunked_jacrev,
    fc.filter_chunked_jacfwd,
)


@pytest.mark.parametrize("builder", _LEAK_BUILDERS, ids=range(len(_LEAK_BUILDERS)))
def test_eager_calls_leak_no_tracer(builder):
    # Users debug their own leaks under `jax.checking_leaks`: the eager path (its
    # trace, its program cache) must keep no tracer alive after a call.
    x = jnp.arange(10.0)
    f = lambda a: (jnp.sin(a) * 2.0, "static")
    chunked = builder(lambda a: f(a)[0], chunk_size=3)
    expected = builder(lambda a: f(a)[0], chunk_size=None)(x)
    with jax.checking_leaks():
        for _ in range(2):  # a program compiled, then one from the cache
            assert tree_allclose(chunked(x), expected)
            out, static = fc.filter_chunked_vmap(f, chunk_size=3)(x)
            assert static == "static"
        # Traced calls share one path (`_wrapper.py`); under `checking_leaks`
        # every operation compiles, so two plans are enough to cover it.
        if builder in (_LEAK_BUILDERS[0], fc.chunked_jacrev):
            jax.jvp(chunked, (x,), (x,))
            jax.vmap(chunked)(jnp.stack([x, x + 1.0]))
            jax.jit(chunked)(x)


def test_evicted_programs_are_freed(monkeypatch):
    # A loop making a new program per call (a closed-over Python scalar that
    # changes) must hold no more programs than the cache: what holds a compiled
    # program goes with its entry (benchmarks/eager.py measures the memory).
    monkeypatch.setattr(eager_module, "_MAX_PROGRAMS", 2)
    x = jnp.arange(8.0)

    def call(c: float) -> jax.Array:
        return fc.filter_chunked_vmap(lambda a: a * c, chunk_size=3)(x)

    assert tree_allclose(call(0.5), x * 0.5)
    newest = next(reversed(eager_module._programs.values()))
    program = weakref.ref(getattr(newest, "__wrapped__").args[0])  # its jaxpr
    del newest
    for c in (1.5, 2.5, 3.5):  # each a new program: the first is evicted
        assert tree_allclose(call(c), x * c)  # never a stale value
    gc.collect()
    assert program() is None
    assert len(eager_module._programs) == 2
