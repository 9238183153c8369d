"""`MemoryBudget(..., tune=True)`: the fastest of a few sizes that fit, timed
(`filtered_chunk/_budget/_timing.py`). The timer is faked where a test needs a
given winner; every size timed is checked against the memory oracle of
`tests/budgets.py` and the results against `jax.vmap`'s."""

import math
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc
import filtered_chunk._budget._choose as choose
import filtered_chunk._budget._counts as counts
import filtered_chunk._budget._model as model
import filtered_chunk._budget._search as search
import filtered_chunk._budget._timing as timing

from .budgets import compiled_bytes, derivative_bytes
from .helpers import tree_allclose


def _fun(x: jax.Array) -> jax.Array:
    return jnp.tanh(jnp.outer(x, x)) @ x  # 16 KiB of working set per element


_N = 200
_XS = jr.normal(jr.key(3), (_N, 64), jnp.float32)


@pytest.fixture
def clean(monkeypatch):
    """CPU whose model sizes a working set to 128 KiB (about 8 elements),
    empty caches, and a record of what is timed."""
    monkeypatch.setattr(model, "backend", lambda: "cpu")
    monkeypatch.setattr(model, "cache_bytes", lambda: 2**17)
    monkeypatch.setattr(timing, "SECONDS", 0.2)  # fewer rounds of the real timer
    counts.measured.clear()
    choose._chosen.clear()
    timed: list[list[int]] = []
    real = timing.time_each

    def _recording(runs: dict[int, Any]) -> dict[int, float]:
        timed.append(sorted(runs))
        return real(runs)

    monkeypatch.setattr(timing, "time_each", _recording)
    yield timed
    counts.measured.clear()
    choose._chosen.clear()


def _fake_timer(monkeypatch, fastest: int, timed: list[list[int]]) -> None:
    """Times every run once (so that it runs) and reports `fastest` as fastest,
    the rest by their distance from it."""

    def _time_each(runs: dict[int, Any]) -> dict[int, float]:
        timed.append(sorted(runs))
        for run in runs.values():
            jax.block_until_ready(run())
        return {k: 1.0 + abs(math.log(k / fastest)) for k in runs}

    monkeypatch.setattr(timing, "time_each", _time_each)


def _bytes_at(k: int | None) -> int:
    return compiled_bytes(fc.filter_chunked_vmap(_fun, chunk_size=k), _XS)


def _check_timed(choice: fc.ChunkSizeChoice, timed: list[int]) -> None:
    """The sizes timed are the ladder and the model's size, each measured to fit
    (by the oracle), and the fastest is chosen."""
    times = dict(choice.times)
    assert sorted(times) == timed
    assert choice.model == "timed"
    assert choice.chunk_size == min(times, key=lambda k: (times[k], k))
    tried = dict(choice.tried)
    for k in timed:
        assert tried[k] == _bytes_at(k if k < _N else None) <= choice.budget
    assert choice.bytes == tried[choice.chunk_size]
    # From half the cache model's size up to the largest that fits.
    assert max(timed) == choice.largest
    assert min(timed) >= 1 and len(timed) <= timing.LADDER + 1


@pytest.mark.parametrize("fraction", (1.0, 0.5, 0.2))
def test_tune_times_sizes_that_fit_and_runs_the_fastest(clean, monkeypatch, fraction):
    budget = int(fraction * _bytes_at(None))
    untuned = fc.suggest_chunk_size(
        fc.filter_chunked_vmap(_fun, chunk_size=fc.MemoryBudget(budget)), _XS
    )
    assert untuned.times == () and untuned.model == "cache"
    # The winner is the largest, which the cache model would not run.
    _fake_timer(monkeypatch, untuned.largest, clean)
    chunked = fc.filter_chunked_vmap(
        _fun, chunk_size=fc.MemoryBudget(budget, tune=True)
    )
    choice = fc.suggest_chunk_size(chunked, _XS)
    _check_timed(choice, clean[-1])
    assert untuned.chunk_size in clean[-1]  # the model's own size is timed
    assert choice.chunk_size == untuned.largest != untuned.chunk_size
    assert tree_allclose(chunked(_XS), jax.vmap(_fun)(_XS))
    assert tree_allclose(jax.jit(chunked)(_XS), jax.vmap(_fun)(_XS))
    # Cached: neither the call nor a second suggestion times anything again.
    assert len(clean) == 1
    assert fc.suggest_chunk_size(chunked, _XS) == choice


def test_tune_with_the_real_timer(clean):
    budget = _bytes_at(None) // 2
    chunked = fc.filter_chunked_vmap(
        _fun, chunk_size=fc.MemoryBudget(budget, tune=True)
    )
    choice = fc.suggest_chunk_size(chunked, _XS)
    _check_timed(choice, clean[-1])
    assert all(seconds > 0 for _, seconds in choice.times)
    assert tree_allclose(jax.jit(chunked)(_XS), jax.vmap(_fun)(_XS))


def test_tune_under_grad_fits_the_differentiated_program(clean, monkeypatch):
    remainder = "overlap"  # the default (the other's sizes: `test_ladder`)
    w = jr.normal(jr.key(0), (64, 32), jnp.float32) / 8
    f = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w.T) ** 2)

    def fixed(k: Any) -> Any:
        g = fc.filter_chunked_vmap(
            f, in_axes=(None, 0), chunk_size=k, remainder=remainder
        )
        return lambda w, x: g(w, x)

    budget = derivative_bytes(fixed(None), w, _XS) // 2
    _fake_timer(monkeypatch, 7, clean)  # the smallest timed size wins
    tuned = fixed(fc.MemoryBudget(budget, tune=True))
    loss = lambda w: jnp.sum(jnp.sin(tuned(w, _XS)))
    expected = jax.grad(lambda w: jnp.sum(jnp.sin(jax.vmap(f, (None, 0))(w, _XS))))(w)
    # float32 sums in another order: within 1e-4 of values up to about 24.
    assert tree_allclose(jax.jit(jax.grad(loss))(w), expected, rtol=1e-4, atol=1e-4)
    (choice,) = choose._chosen.values()
    assert choice.model == "timed" and sorted(dict(choice.times)) == clean[-1]
    # Every size timed, and the one chosen, fits as the user's program runs it.
    for k in clean[-1]:
        assert derivative_bytes(fixed(k if k < _N else None), w, _XS) <= budget
    assert choice.chunk_size == min(clean[-1])


def test_tune_with_keys_and_integers(clean):
    # Per-sample PRNG keys and integer labels: timed on example keys and zeros.
    keys = jr.split(jr.key(1), _N)
    labels = jnp.arange(_N) % 4

    def f(key: jax.Array, label: jax.Array) -> jax.Array:
        draws = jr.normal(key, (64, 64))
        return jnp.sum(jnp.tanh(draws @ draws)) * label.astype(draws.dtype)

    oracle = jax.vmap(f)(keys, labels)
    budget = compiled_bytes(fc.filter_chunked_vmap(f, chunk_size=None), keys, labels)
    chunked = fc.filter_chunked_vmap(
        f, chunk_size=fc.MemoryBudget(budget // 2, tune=True)
    )
    assert tree_allclose(jax.jit(chunked)(keys, labels), oracle)
    (choice,) = choose._chosen.values()
    assert choice.model == "timed" and len(choice.times) >= 2


def test_example_values_keep_types_and_use_concrete_arrays():
    s = jax.ShapeDtypeStruct((3, 2), jnp.float32)
    x = timing.example_value(s, 0)
    assert x.shape == (3, 2) and x.dtype == jnp.float32 and np.std(x) > 0
    known = jnp.ones((3, 2))
    assert timing.example_arguments([s], [known], {})[0] is known
    ints = timing.example_value(jax.ShapeDtypeStruct((4,), jnp.int32), 0)
    assert ints.dtype == jnp.int32 and not np.any(ints)
    keys = jr.split(jr.key(0), 5)
    example = timing.example_value(jax.ShapeDtypeStruct(keys.shape, keys.dtype), 0)
    assert example.shape == keys.shape and example.dtype == keys.dtype

    # A tracer is not concrete: an example takes its place.
    def _traced(t: jax.Array) -> jax.Array:
        (made,) = timing.example_arguments([s], [t], {})
        assert made is not t and not isinstance(made, jax.core.Tracer)
        return t

    jax.jit(_traced)(known)
    # The programs of one search share one example per shape and dtype.
    made: dict[Any, Any] = {}
    first = timing.example_arguments([s, s, s], [known], made)
    second = timing.example_arguments([s, s], [None], made)
    assert first[0] is known and first[1] is first[2] is second[0] is second[1]
    assert len(made) == 1


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize(("lo", "hi"), ((1, 1), (3, 3), (1, 200), (21, 1024), (8, 9)))
def test_ladder(remainder, lo, hi):
    sizes = search.Sizes(max(hi, 200), remainder)
    ladder = timing.ladder(lo, sizes.at_most(hi), sizes.at_most)
    assert ladder == sorted(set(ladder)) and ladder[-1] == sizes.at_most(hi)
    assert all(sizes.at_most(k) == k for k in ladder)
    assert len(ladder) <= timing.LADDER and ladder[0] <= max(lo, ladder[0])
    if hi >= 8 * lo:  # spread over the range, not bunched at one end
        assert ladder[0] <= 2 * lo and len(ladder) >= 3


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize(
    ("k", "largest", "n"), ((41, 512, 1024), (1, 1, 1), (1, 8, 8), (7, 1000, 1000))
)
def test_descent_times_powers_of_two(remainder, k, largest, n):
    """The default's descent: the model's size and the powers of two within three
    doublings of it, as sizes that run (a matrix product over the chunk runs
    fastest at a power of two: workload (k) of `benchmarks/budget.py`)."""
    sizes = search.Sizes(n, remainder)
    near = timing.neighbours(k, largest, sizes.at_most)
    assert near == sorted(set(near)) and sizes.at_most(k) in near
    assert all(sizes.at_most(s) == s and 1 <= s <= largest for s in near)
    powers = [2**j for j in range(12) if k <= 8 * 2**j and 2**j <= 8 * k]
    assert {sizes.at_most(min(p, largest)) for p in powers} <= set(near)
    assert len(near) <= len(powers) + 1
    if (k, largest, n) == (41, 512, 1024):  # (k)'s: 64 is one step from 41
        assert near == [8, 16, 32, 41, 64, 128, 256]


def test_tune_argument_is_checked():
    with pytest.raises(TypeError, match="tune"):
        fc.MemoryBudget("1MiB", tune="yes")  # pyright: ignore[reportArgumentType]
    assert repr(fc.MemoryBudget(4096, tune=True)) == "MemoryBudget(4096, tune=True)"
    assert repr(fc.MemoryBudget(0.5)) == "MemoryBudget(0.5)"
    assert fc.MemoryBudget(4096, tune=True) != fc.MemoryBudget(4096)
