"""The speed model of a memory budget (`filtered_chunk/_budget/_model.py`): among
the sizes that fit, on CPU a size whose working set stays in a (here faked)
cache, at least one element; on other backends the largest. Every choice is
checked against the memory oracle of `tests/budgets.py` (the public transform at
that fixed size, compiled) and its result against `jax.vmap`'s."""

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc
import filtered_chunk._budget._choose as choose
import filtered_chunk._budget._counts as counts
import filtered_chunk._budget._model as model
import filtered_chunk._budget._search as search

from .budgets import check_largest, compiled_bytes, derivative_bytes
from .helpers import count_compiles, tree_allclose


def _fun(x: jax.Array) -> jax.Array:
    # A 64 x 64 temporary per element (a matrix product's operand, which XLA
    # cannot fuse away): 16 KiB of working set in float32.
    return jnp.tanh(jnp.outer(x, x)) @ x


_N = 200
_XS = jr.normal(jr.key(3), (_N, 64), jnp.float32)


@pytest.fixture
def fake_machine(monkeypatch):
    """Sets the backend and the cache size the model reads, with empty caches."""

    def _set(backend: str, cache: int) -> None:
        monkeypatch.setattr(model, "backend", lambda: backend)
        monkeypatch.setattr(model, "cache_bytes", lambda: cache)
        counts.measured.clear()
        choose._chosen.clear()

    yield _set
    counts.measured.clear()
    choose._chosen.clear()


def _bytes_at(k: int | None, xs: jax.Array = _XS) -> int:
    return compiled_bytes(fc.filter_chunked_vmap(_fun, chunk_size=k), xs)


def _choose(budget: int, xs: jax.Array = _XS) -> tuple[fc.ChunkSizeChoice, Any]:
    chunked = fc.filter_chunked_vmap(_fun, chunk_size=fc.MemoryBudget(budget))
    return fc.suggest_chunk_size(chunked, xs), chunked


def _check_fits_and_matches(
    choice: fc.ChunkSizeChoice, chunked: Any, xs: jax.Array = _XS
) -> None:
    k, n = choice.chunk_size, xs.shape[0]
    assert _bytes_at(k if k < n else None, xs) == choice.bytes <= choice.budget
    assert (k, choice.bytes) in choice.tried
    assert tree_allclose(chunked(xs), jax.vmap(_fun)(xs))
    assert tree_allclose(jax.jit(chunked)(xs), jax.vmap(_fun)(xs))


@pytest.mark.parametrize("fraction", (1.0, 0.5, 0.2))
def test_cpu_caps_the_working_set_at_the_cache(fake_machine, fraction):
    budget = int(fraction * _bytes_at(None))
    cache = 2**18  # a working set of 256 KiB: about 16 elements of 16 KiB
    fake_machine("cpu", cache)
    choice, chunked = _choose(budget)
    _check_fits_and_matches(choice, chunked)
    assert choice.model == "cache" and choice.cache_bytes == cache
    assert choice.element_bytes >= 64 * 64 * 4
    cap = cache // choice.element_bytes
    assert 8 <= cap < choice.largest
    # Balanced (`remainder="overlap"`): the largest balanced size under the cap.
    assert choice.chunk_size == -(-_N // -(-_N // cap))
    # The largest that fits is still found and reported, by the oracle.
    check_largest(_bytes_at, choice, budget, _N)


def test_the_cap_rounds_down_to_a_balanced_size(fake_machine):
    # 20 elements: the balanced sizes near 8 are 7 and 10, so a cap of 8 or 9
    # runs 7 per chunk (three steps), not 10.
    xs = _XS[:20]
    fake_machine("cpu", 2**10)
    element = _choose(_bytes_at(None, xs), xs)[0].element_bytes
    fake_machine("cpu", 8 * element + element // 2)
    choice, chunked = _choose(_bytes_at(None, xs), xs)
    _check_fits_and_matches(choice, chunked, xs)
    assert choice.model == "cache" and choice.largest == 20
    assert choice.chunk_size == 7
    check_largest(lambda k: _bytes_at(k, xs), choice, choice.budget, 20)


def test_cpu_runs_one_element_a_chunk_when_one_overflows_the_cache(fake_machine):
    fake_machine("cpu", 2**10)  # 1 KiB: one element's 16 KiB never stays in it
    budget = _bytes_at(None) // 3
    choice, chunked = _choose(budget)
    _check_fits_and_matches(choice, chunked)
    assert choice.model == "cache" and choice.element_bytes > 2**10
    assert choice.chunk_size == 1 < choice.largest
    check_largest(_bytes_at, choice, budget, _N)


@pytest.mark.parametrize("backend", ("gpu", "tpu"))
@pytest.mark.parametrize("fraction", (1.0, 0.3))
def test_accelerators_keep_the_largest_that_fits(fake_machine, backend, fraction):
    fake_machine(backend, 2**17)  # a cache that would cap on CPU
    budget = int(fraction * _bytes_at(None))
    choice, chunked = _choose(budget)
    _check_fits_and_matches(choice, chunked)
    assert choice.model == "largest" and choice.cache_bytes is None
    assert choice.chunk_size == choice.largest
    check_largest(_bytes_at, choice, budget, _N)


def test_under_grad_the_capped_size_fits_the_derivative(fake_machine, choices):
    # Under `jax.grad` the model's size must fit the differentiated program (in
    # float64, so that the gradients compare tightly).
    p = jr.normal(jr.key(4), (64, 64), jnp.float64)
    xs = _XS.astype(jnp.float64)
    f = lambda q, x: jnp.tanh(jnp.outer(x, x) @ q) @ x  # noqa: E731
    mapped = lambda k: fc.filter_chunked_vmap(f, in_axes=(None, 0), chunk_size=k)  # noqa: E731
    bytes_at = lambda k: derivative_bytes(mapped(k), p, xs)  # noqa: E731
    budget = bytes_at(None) // 2
    fake_machine("cpu", 2**17)
    loss = lambda q, g: jnp.sum(g(q, xs) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    actual = grad(p, mapped(fc.MemoryBudget(budget)))
    expected = jax.grad(loss)(p, jax.vmap(f, in_axes=(None, 0)))
    assert tree_allclose(actual, expected)
    (choice,) = choices
    assert choice.model == "cache" and choice.chunk_size < choice.largest
    check_largest(bytes_at, choice, budget, _N)


def test_the_choice_is_deterministic(fake_machine):
    budget = _bytes_at(None) // 2
    fake_machine("cpu", 2**17)
    first, _ = _choose(budget)
    assert first.chunk_size < first.largest
    counts.measured.clear()
    choose._chosen.clear()
    again, _ = _choose(budget)
    # The same choice; its cost (`seconds`) is the search's own.
    assert dataclasses.replace(first, seconds=0.0) == dataclasses.replace(
        again, seconds=0.0
    )
    # Another cache is another choice, not a stale cached one.
    fake_machine("cpu", 2**18)
    larger, _ = _choose(budget)
    assert larger.cache_bytes == 2**18 and larger.chunk_size > first.chunk_size
    # And the same machine again is the cached choice: nothing compiles.
    with count_compiles() as compiles:
        assert _choose(budget)[0] == larger
    assert len(compiles) == 0


def test_the_model_costs_at_most_one_size(fake_machine):
    fake_machine("gpu", 2**17)
    budget = _bytes_at(None) // 2
    largest, _ = _choose(budget)
    fake_machine("cpu", 2**17)
    with count_compiles() as compiles:
        capped, _ = _choose(budget)
    assert capped.chunk_size < capped.largest == largest.chunk_size
    assert len(compiles) == len(capped.tried) == len(largest.tried) + 1
    assert len(capped.tried) <= search.MAX_COMPILATIONS


def test_the_model_stays_within_the_search_bound(fake_machine, monkeypatch):
    # A budget between two steps of 100 and the whole batch: the search measures
    # 200, 1 and 100 (which fits). With a bound of 3 sizes the model's size (16)
    # is not measured: the largest found to fit runs.
    monkeypatch.setattr(search, "MAX_COMPILATIONS", 3)
    fake_machine("cpu", 2**17)
    budget = (_bytes_at(100) + _bytes_at(None)) // 2
    with count_compiles() as compiles:
        choice, chunked = _choose(budget)
    assert len(compiles) == len(choice.tried) == 3
    assert choice.chunk_size == choice.largest == 100
    _check_fits_and_matches(choice, chunked)


def test_the_cache_size_is_read_from_the_system():
    size = model.cache_bytes()
    assert isinstance(size, int) and size >= 2 * 2**10
    assert model._parse_size("2048K\n") == 2**21
    assert model._parse_size("1M") == 2**20
    assert model._parse_size("512") == 512
    assert model._parse_size("") is None


def _fake_caches(path: Path, sizes: dict[int, str]) -> None:
    # sysfs's layout: one folder per cache, level 1 split into data and code.
    caches = [(1, "Data", "32K"), (1, "Instruction", "32K")]
    caches += [(level, "Unified", size) for level, size in sorted(sizes.items())]
    for i, (level, kind, size) in enumerate(caches):
        index = path / f"index{i}"
        index.mkdir()
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (index / name).write_text(f"{text}\n")


@pytest.mark.parametrize(
    "sizes, expected",
    (
        # A quarter of the level-3 cache, within 2 and 8 level-2 caches.
        ({2: "1024K", 3: "32768K"}, 8 * 2**20),
        ({2: "2048K", 3: "16M"}, 4 * 2**20),
        ({2: "512K", 3: "2M"}, 2**20),
        ({2: "2048K", 3: "307200K"}, 16 * 2**20),
        ({2: "1024K"}, 2 * 2**20),
    ),
)
def test_the_cache_size_reads_both_levels(monkeypatch, tmp_path, sizes, expected):
    _fake_caches(tmp_path, sizes)
    monkeypatch.setattr(model, "_CACHE_DIR", tmp_path)
    assert model.cache_bytes.__wrapped__() == expected
