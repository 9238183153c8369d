"""What the staged evaluation of collectives refuses, and how it says so."""

import jax
import jax.lax as lax
import jax.numpy as jnp
import pytest

import filtered_chunk as fc

from .staged_cases import staged_call


def _refused(fun, match, x=None):
    x = jnp.ones((5, 2)) if x is None else x
    with pytest.raises(ValueError, match=match):
        staged_call(fun, [x], [], 2)


def test_refuses_collective_in_loops():
    def scan(m, u):
        step = lambda c, _: (lax.psum(c, "i") * 0.5, None)
        return [lax.scan(step, m[0], length=2)[0]], []

    _refused(scan, r"`lax.psum`.*inside a `lax.scan` body.*Move the collective")

    def loop(m, u):
        body = lambda c: lax.pmax(c, "i") - 1.0
        return [lax.while_loop(lambda c: c[0] > 0, body, m[0])], []

    _refused(loop, r"`lax.pmax`.*inside a `lax.while_loop` body")


def test_refuses_cond_with_invariant_predicate():
    def fun(m, u):
        return [lax.cond(u[0] > 0, lambda y: lax.psum(y, "i"), lambda y: y, m[0])], []

    with pytest.raises(ValueError, match=r"`lax.psum`.*`lax.cond`.*same for every"):
        staged_call(fun, [jnp.ones((5, 2))], [jnp.array(1.0)], 2)


def test_refuses_collective_in_custom_rules():
    @jax.custom_vjp
    def scaled(y):
        return 2 * y

    scaled.defvjp(lambda y: (2 * y, None), lambda _, g: (lax.psum(g, "i"),))
    _refused(
        lambda m, u: ([scaled(m[0])], []),
        r"`lax.psum`.*only by a custom derivative rule.*custom_vjp",
    )

    @jax.custom_jvp
    def normalise(y):
        return y / lax.psum(y, "i")

    normalise.defjvp(lambda p, t: (normalise(p[0]), t[0]))
    _refused(
        lambda m, u: ([normalise(m[0])], []),
        r"`lax.psum`.*custom-derivative function 'normalise'.*rule would be lost",
    )


def test_refuses_groups_and_gathers_over_several_names():
    groups = lambda m, u: ([lax.psum(m[0], "i", axis_index_groups=[[0, 1]])], [])
    with pytest.raises(NotImplementedError, match=r"`lax.psum`.*`axis_index_groups`"):
        staged_call(groups, [jnp.ones((4, 2))], [], 2)
    x = jnp.ones((2, 5, 2))
    gather = lambda m, u: ([lax.all_gather(m[0], ("i", "j")).sum()], [])
    with pytest.raises(ValueError, match=r"`lax.all_gather`.*names other axes"):
        jax.vmap(lambda _x: staged_call(gather, [_x], [], 2), axis_name="j")(x)


def test_varying_unmapped_output():
    fun = lambda m, u: ([], [m[0] * lax.psum(m[0], "i")])
    with pytest.raises(ValueError, match=r"gives `None` for `output\[1\]\[0\]`"):
        staged_call(fun, [jnp.ones((5, 2))], [], 2)


def test_refuses_collective_in_a_custom_jvp_rule():
    @jax.custom_jvp
    def f(y):
        return 2 * y

    f.defjvp(lambda p, t: (f(p[0]), lax.pmean(t[0], "i")))
    _refused(
        lambda m, u: ([f(m[0]) * lax.psum(m[0], "i")], []),
        r"`lax.psum`.*only by a custom derivative rule",
    )


def test_public_call_names_a_varying_unmapped_output():
    f = lambda x: {"w": x * lax.psum(x, "i")}
    chunked = fc.filter_chunked_vmap(f, out_axes=None, axis_name="i", chunk_size=2)
    with pytest.raises(ValueError, match=r"gives `None` for `output\['w'\]`"):
        chunked(jnp.ones((5, 2)))
