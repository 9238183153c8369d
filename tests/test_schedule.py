"""The compiled schedule: one scan over the chunks, and how often `fun` is traced."""

from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import pytest

import filtered_chunk as fc


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(getattr(v, "jaxpr", None), "eqns"):
                yield v.jaxpr


def _eqns(jaxpr, *, into_scans):
    """Every equation of `jaxpr`, recursively; optionally not inside scans."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name != "scan" or into_scans:
            for sub in _subjaxprs(eqn):
                yield from _eqns(sub, into_scans=into_scans)


def _schedule(batch_size, chunk_size, remainder):
    f = lambda x: jnp.sin(x) * 2.0
    chunked = fc.filter_chunked_vmap(f, chunk_size=chunk_size, remainder=remainder)
    jaxpr = jax.make_jaxpr(chunked)(jnp.ones((batch_size, 3))).jaxpr
    scans = [e for e in _eqns(jaxpr, into_scans=True) if e.primitive.name == "scan"]
    outside = [e for e in _eqns(jaxpr, into_scans=False) if e.primitive.name == "sin"]
    return [e.params["length"] for e in scans], len(outside)


@pytest.mark.parametrize(
    "batch_size,chunk_size", ((6, 3), (7, 3), (8, 3), (9, 2), (5, 4), (2, 1))
)
def test_overlap_is_one_scan(batch_size, chunk_size):
    lengths, outside = _schedule(batch_size, chunk_size, "overlap")
    assert lengths == [-(-batch_size // chunk_size)]
    assert outside == 0


@pytest.mark.parametrize(
    "batch_size,chunk_size", ((6, 3), (7, 3), (8, 3), (9, 2), (5, 4), (2, 1))
)
def test_separate_remainder_path(batch_size, chunk_size):
    # The remainder is a loop of one step, with the same derivative rule.
    lengths, outside = _schedule(batch_size, chunk_size, "separate")
    assert lengths == [batch_size // chunk_size] + [1] * (batch_size % chunk_size > 0)
    assert outside == 0


@pytest.mark.parametrize("chunk_size", (None, 5, 8))
def test_no_scan_without_chunking(chunk_size):
    lengths, outside = _schedule(5, chunk_size, "overlap")
    assert lengths == []
    assert outside == 1


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_traces_do_not_grow_with_batch_size(remainder):
    counts = []
    for batch_size in (7, 70, 701):
        traces = []

        def f(x):
            traces.append(None)
            return jnp.cos(x)

        chunked = fc.filter_chunked_vmap(f, chunk_size=3, remainder=remainder)
        jax.make_jaxpr(chunked)(jnp.ones((batch_size, 2)))
        counts.append(len(traces))
    assert counts[0] == counts[1] == counts[2]
    assert counts[0] <= 3


def _count(remainder, call, body=jnp.sin, **kwargs):
    """How often `fun` (`body`, counted) is traced by one call of a chunked map
    (`call(chunked)`)."""
    traces = []

    def f(x):
        traces.append(None)
        return body(x)

    chunked = fc.filter_chunked_vmap(f, chunk_size=3, remainder=remainder, **kwargs)
    call(chunked)
    return len(traces)


_X = jnp.linspace(0.5, 2.0, 20).reshape(10, 2)
_CALLS = {
    "eager": lambda c: c(_X),
    "jit": lambda c: jax.jit(c)(_X),
    "grad": lambda c: jax.grad(lambda x: jnp.sum(c(x)))(_X),
    "jvp": lambda c: jax.jvp(c, (_X,), (_X,)),
    "vmap": lambda c: jax.vmap(c)(_X[None]),
}


@pytest.mark.parametrize("call", _CALLS)
def test_overlap_traces_fun_once(call):
    # `"overlap"`: once; `"separate"`: once more, at the remainder's size.
    assert _count("overlap", _CALLS[call]) == 1
    assert _count("separate", _CALLS[call]) == 2
    f = eqx.debug.assert_max_traces(jnp.sin, max_traces=1)
    _CALLS[call](fc.filter_chunked_vmap(f, chunk_size=3))


def test_collective_check_traces():
    # With `axis_name`, the collective check traces `fun` once more, with the
    # axis unbound, when `fun` does not read it.
    assert _count("overlap", _CALLS["jit"], axis_name="i") == 1 + 1
    assert _count("separate", _CALLS["jit"], axis_name="i") == 2 + 1


@pytest.mark.parametrize("call", ("eager", "jit", "grad"))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_collectives_trace_fun_twice(call, remainder):
    # Where `fun` reads the axis: the look with the axis unbound, which stops at
    # the first collective, then one trace, whatever the remainder, the number
    # of collectives and the derivative (docs/guide.md).
    def normalised(x):
        for _ in range(3):
            x = jnp.sin(x)
            x = x - lax.pmean(x, "i")
        return x

    calls = _count(remainder, _CALLS[call], body=normalised, axis_name="i")
    assert calls == 2


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_other_transforms_trace_fun_once_per_loop(remainder):
    traces = []

    def f(x):
        traces.append(None)
        return jnp.sin(x)

    expected = 1 if remainder == "overlap" else 2
    kwargs: dict[str, Any] = dict(chunk_size=3, remainder=remainder)
    fc.filter_chunked_apply(f, **kwargs)(_X)
    # Plus two abstract traces, at two chunk sizes, that check `fun`'s contract.
    assert len(traces) == expected + 2
    traces.clear()
    jacobian = fc.chunked_jacfwd(lambda x: jnp.sum(f(x)), **kwargs)(_X)
    assert len(traces) == expected
    assert jnp.allclose(jacobian, jnp.cos(_X))
