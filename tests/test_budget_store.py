"""Stored choices (`filtered_chunk/_budget/_store.py`): a budget searches once per
program, budget and machine; a later process (here: the in-memory caches
emptied) lowers the program the stored choice runs, finds it the same (it
compiles nothing), and takes the whole choice, evaluated, under `jax.grad`, and
for a staged call that keeps boundaries. The tests' default (`tests/conftest.py`)
stores nothing; these turn the store on, each in a folder of its own."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc
import filtered_chunk._budget._choose as choose
import filtered_chunk._budget._counts as counts
import filtered_chunk._budget._store as store
import filtered_chunk._budget._values as values

from .budgets import compiled_bytes
from .helpers import tree_allclose


@pytest.fixture
def stored(monkeypatch, tmp_path):
    """A store of the test's own, and empty in-memory caches."""
    monkeypatch.setenv(store.ENVIRONMENT, str(tmp_path / "choices"))
    _forget()
    yield tmp_path / "choices"
    _forget()


def _forget() -> None:
    """What a new process would not know: the in-memory caches."""
    counts.measured.clear()
    choose._chosen.clear()


def _fun(x: jax.Array) -> jax.Array:
    return jnp.tanh(jnp.outer(x, x)) @ x  # 16 KiB of working set per element


_XS = jr.normal(jr.key(3), (200, 64), jnp.float32)


def _blocks(x, weights):
    """Blocks normalised over the batch: a staged call, whose boundaries (6 values
    an element) are much smaller than its working set (64)."""
    for w1, w2 in weights:
        x = jnp.tanh(x @ w1) @ w2
        x = x - lax.pmean(x, "i")
        x = x * lax.rsqrt(lax.pmean(x**2, "i") + 1.0)
    return x


def _twice(call: Any) -> tuple[fc.ChunkSizeChoice, fc.ChunkSizeChoice]:
    """The choice of a first process and of a later one, each `call()`."""
    first = call()
    _forget()
    later = call()
    return first, later


def _same(first: fc.ChunkSizeChoice, later: fc.ChunkSizeChoice) -> bool:
    """The same choice, but for how it was made."""
    cost = dict(compilations=0, seconds=0.0)
    return dataclasses.replace(first, **cost) == dataclasses.replace(
        later, stored=False, **cost
    )


def test_evaluated(stored):
    budget = compiled_bytes(fc.filter_chunked_vmap(_fun), _XS) // 4
    chunked = fc.filter_chunked_vmap(_fun, chunk_size=fc.MemoryBudget(budget))
    first, later = _twice(lambda: fc.suggest_chunk_size(chunked, _XS))
    assert not first.stored and first.compilations >= 4
    assert later.stored and later.compilations == 0 and _same(first, later)
    assert len(list(stored.glob("*.json"))) == 1
    assert tree_allclose(chunked(_XS), jax.vmap(_fun)(_XS))


def test_under_grad(stored):
    # The program of the user's step, traced; two programs a size under grad.
    loss = lambda run: lambda x: jnp.sum(run(x) ** 2)
    step = lambda run: jax.jit(jax.grad(loss(run)))
    whole = fc.filter_chunked_vmap(_fun, chunk_size=fc.MemoryBudget(2**40))
    (everything,) = fc.suggest_chunk_sizes(step(whole), _XS)
    chunked = fc.filter_chunked_vmap(
        _fun, chunk_size=fc.MemoryBudget(everything.bytes // 4)
    )
    first, later = _twice(lambda: fc.suggest_chunk_sizes(step(chunked), _XS)[0])
    # At least both programs of two sizes (how many sizes the search tries
    # depends on the machine's cache size; the whole budget's search measured
    # the largest sizes already).
    assert not first.stored and first.compilations >= 4
    assert later.stored and later.compilations == 0 and _same(first, later)
    assert first.chunk_size < 200 and later.bytes <= later.budget
    assert tree_allclose(step(chunked)(_XS), step(jax.vmap(_fun))(_XS))


def test_staged_call_keeping_boundaries(stored):
    # The boundaries kept are part of the choice: a later process lowers the
    # program that keeps them, and runs it.
    key1, key2 = jr.split(jr.key(1))
    x = jr.normal(key1, (256, 6))
    keys = jr.split(key2, 6)
    weights = [
        (jr.normal(keys[2 * i], (6, 64)), jr.normal(keys[2 * i + 1], (64, 6)) / 8)
        for i in range(3)
    ]
    chunked = fc.filter_chunked_vmap(
        _blocks,
        in_axes=(0, None),
        axis_name="i",
        chunk_size=fc.MemoryBudget(100 * 1024, tune=False),
    )
    first, later = _twice(lambda: fc.suggest_chunk_size(chunked, x, weights))
    assert first.keep_boundaries and first.passes == 3 and first.chunk_size < 256
    assert later.stored and later.compilations == 0 and _same(first, later)
    assert compiled_bytes(chunked, x, weights) == later.bytes <= later.budget
    oracle = eqx.filter_vmap(_blocks, in_axes=(0, None), axis_name="i")
    assert tree_allclose(chunked(x, weights), oracle(x, weights))


def test_a_fraction_of_free_memory(stored, monkeypatch):
    # The free memory moves a little between processes: the budget, rounded
    # down to 1/32 of a power of two, keeps its entry.
    free = 4 * compiled_bytes(fc.filter_chunked_vmap(_fun), _XS) + 12345
    monkeypatch.setattr(values, "available_bytes", lambda: free)
    chunked = fc.filter_chunked_vmap(_fun, chunk_size=fc.MemoryBudget(0.1))
    first = fc.suggest_chunk_size(chunked, _XS)
    _forget()
    monkeypatch.setattr(values, "available_bytes", lambda: free + 1000)
    later = fc.suggest_chunk_size(chunked, _XS)
    assert later.stored and _same(first, later)


def test_another_program_is_another_entry(stored):
    budget = compiled_bytes(fc.filter_chunked_vmap(_fun), _XS) // 4
    for f in (_fun, lambda x: jnp.cos(jnp.outer(x, x)) @ x):
        chunked = fc.filter_chunked_vmap(f, chunk_size=fc.MemoryBudget(budget))
        assert not fc.suggest_chunk_size(chunked, _XS).stored
    assert len(list(stored.glob("*.json"))) == 2


def _custom(scale: float) -> Any:
    """`_fun` with a backward pass of its own, scaled by `scale`."""

    @jax.custom_vjp
    def f(x):
        return _fun(x)

    def fwd(x):
        return _fun(x), x

    def bwd(x, g):
        return (jax.vjp(_fun, x)[1](g)[0] * scale,)

    f.defvjp(fwd, bwd)
    return f


def test_a_changed_backward_pass_compiles_once(stored):
    # A custom derivative's backward pass is not in the traced program that names
    # the entry, but is in the program a choice runs under `jax.grad`. Changed,
    # a later process compiles that program, takes the choice as its bytes are
    # those stored, and stores its new hash; the next compiles nothing.
    def grad(scale: float) -> Any:
        budget = fc.MemoryBudget(2**20, tune=False)
        chunked = fc.filter_chunked_vmap(_custom(scale), chunk_size=budget)
        return jax.grad(lambda x: chunked(x).sum())

    def choose(scale: float) -> fc.ChunkSizeChoice:
        (choice,) = fc.suggest_chunk_sizes(grad(scale), _XS)
        _forget()
        return choice

    first, same, changed, again = map(choose, (2.0, 2.0, 3.0, 3.0))
    assert not first.stored and first.chunk_size < 200
    assert (same.stored, same.compilations) == (True, 0) and _same(first, same)
    assert (changed.stored, changed.compilations) == (True, 1)
    # The choice taken runs the changed backward pass.
    true = jax.grad(lambda x: jax.vmap(_fun)(x).sum())(_XS)
    assert jnp.allclose(grad(3.0)(_XS), 3 * true, rtol=1e-5, atol=1e-5)
    assert (again.stored, again.compilations) == (True, 0) and _same(first, again)
    assert len(list(stored.glob("*.json"))) == 1


def test_a_program_that_calls_back_is_stored(stored):
    # A jaxpr's text masks the addresses of its callbacks' functions, and the
    # lowered program numbers the callbacks: a later process, whose functions are
    # new objects, takes the choice without compiling (`jax.debug.print` in
    # `fun` is common).
    def choose() -> tuple[fc.ChunkSizeChoice, Any]:
        def fun(x):
            out = jax.ShapeDtypeStruct(x.shape, x.dtype)
            y = jax.pure_callback(np.tanh, out, x, vmap_method="sequential")
            jax.debug.callback(lambda _: None, y[0])
            return _fun(y)

        budget = fc.MemoryBudget(2**20, tune=False)
        chunked = fc.filter_chunked_vmap(fun, chunk_size=budget)
        choice = fc.suggest_chunk_size(chunked, _XS)
        _forget()
        return choice, chunked

    (first, chunked), (later, _) = choose(), choose()
    assert not first.stored and first.chunk_size < 200
    assert (later.stored, later.compilations) == (True, 0) and _same(first, later)
    assert tree_allclose(chunked(_XS), jax.vmap(_fun)(jnp.tanh(_XS)))
