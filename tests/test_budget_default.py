"""The default choice of a memory budget (`MemoryBudget(..., tune=None)`): on CPU the
fastest of a few sizes that fit, timed within a bound on its cost, and stored on
disk so that a later process reuses it (`filtered_chunk/_budget/_store.py`). Every
size timed is checked against the memory oracle of `tests/budgets.py`."""

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
import filtered_chunk._budget._store as store
import filtered_chunk._budget._timing as timing

from .budgets import compiled_bytes, derivative_bytes
from .helpers import tree_allclose


def _fun(x: jax.Array) -> jax.Array:
    return jnp.tanh(jnp.outer(x, x)) @ x  # 16 KiB of working set per element


_N = 200
_XS = jr.normal(jr.key(3), (_N, 64), jnp.float32)


def _bytes_at(k: int | None) -> int:
    return compiled_bytes(fc.filter_chunked_vmap(_fun, chunk_size=k), _XS)


@pytest.fixture
def default(monkeypatch, tmp_path):
    """The default's timing on, on a CPU whose model sizes a working set to 128 KiB
    (about 8 elements), a store of its own, empty in-memory caches, and a
    record of what is timed."""
    monkeypatch.setattr(timing, "BY_DEFAULT", True)
    monkeypatch.setattr(timing, "FLOOR_SECONDS", 1.0)  # quicker, fewer sizes
    monkeypatch.setattr(model, "backend", lambda: "cpu")
    monkeypatch.setattr(model, "cache_bytes", lambda: 2**17)
    monkeypatch.setenv(store.ENVIRONMENT, str(tmp_path / "choices"))
    timed: list[list[int]] = []  # the sizes each search timed, by search
    each, bounded = timing.time_each, timing.bounded
    descending = [False]  # the default's rounds are recorded by its descent

    def _each(runs: dict[int, Any], *args: Any, **kwargs: Any) -> Any:
        if not descending[0]:
            timed.append(sorted(runs))
        return each(runs, *args, **kwargs)

    def _bounded(*args: Any, **kwargs: Any) -> Any:
        descending[0] = True
        try:
            times = bounded(*args, **kwargs)
        finally:
            descending[0] = False
        if times:
            timed.append(sorted(times))
        return times

    monkeypatch.setattr(timing, "time_each", _each)
    monkeypatch.setattr(timing, "bounded", _bounded)
    _forget()
    yield timed
    _forget()


def _forget() -> None:
    """What a new process would not know: the in-memory caches."""
    counts.measured.clear()
    choose._chosen.clear()


def _choose(budget: int, tune: bool | None = None) -> fc.ChunkSizeChoice:
    chunked = fc.filter_chunked_vmap(
        _fun, chunk_size=fc.MemoryBudget(budget, tune=tune)
    )
    return fc.suggest_chunk_size(chunked, _XS)


def _check_timed(choice: fc.ChunkSizeChoice) -> list[int]:
    """At least two sizes timed, each measured to fit (by the oracle), from the
    model's own size along its neighbours (doubled and halved): the fastest is
    chosen. Returns the neighbours."""
    times = dict(choice.times)
    assert choice.model == "timed" and len(times) >= 2
    assert choice.chunk_size == min(times, key=lambda k: (times[k], k))
    for k in times:
        assert _bytes_at(k if k < _N else None) <= choice.budget
    assert choice.bytes == dict(choice.tried)[choice.chunk_size] <= choice.budget
    # The model's own size, as `tune=False` chooses it, is timed first; the
    # descent times a run of its neighbours, without gaps but for sizes that
    # do not fit.
    _forget()
    start = _choose(choice.budget, tune=False).chunk_size
    _forget()
    at_most = search.Sizes(_N, "overlap").at_most
    ladder = timing.neighbours(start, choice.largest, at_most)
    fit = [k for k in ladder if _bytes_at(k if k < _N else None) <= choice.budget]
    assert start in times and set(times) <= set(fit)
    timed = [fit.index(k) for k in sorted(times)]
    assert timed == list(range(timed[0], timed[-1] + 1))
    return fit


@pytest.mark.parametrize("fraction", (1.0, 0.3))
def test_default_times_on_cpu_and_fits(default, fraction):
    budget = int(fraction * _bytes_at(None))
    choice = _choose(budget)
    _check_timed(choice)
    assert not choice.stored and len(default) == 1
    assert sorted(dict(choice.times)) == default[0]
    chunked = fc.filter_chunked_vmap(_fun, chunk_size=fc.MemoryBudget(budget))
    assert tree_allclose(jax.jit(chunked)(_XS), jax.vmap(_fun)(_XS))
    assert len(default) == 1  # cached in memory: not timed again


def test_a_later_process_reuses_the_stored_choice(default, tmp_path):
    budget = _bytes_at(None) // 2
    first = _choose(budget)
    assert first.compilations >= 4 and first.seconds > 0
    (entry,) = (tmp_path / "choices").glob("*.json")
    name = entry.name.removesuffix(".json")
    assert _entry(name) == (first, _bytes_at(first.chunk_size))
    _forget()
    second = _choose(budget)
    assert second.stored and len(default) == 1  # read, not timed
    # The whole choice, but for its cost: its program lowered, not compiled.
    assert second.compilations == 0 and second.seconds < first.seconds
    assert dataclasses.replace(second, stored=False, compilations=0, seconds=0.0) == (
        dataclasses.replace(first, compilations=0, seconds=0.0)
    )
    assert second.bytes == _bytes_at(second.chunk_size) <= budget
    # `tune=True` reads it too; `tune=False` never times, and stores its own.
    _forget()
    assert _choose(budget, tune=True).stored and len(default) == 1
    _forget()
    model_choice = _choose(budget, tune=False)
    assert model_choice.model == "cache" and not model_choice.stored
    assert model_choice.times == () and len(default) == 1
    _forget()
    again = _choose(budget, tune=False)
    assert again.stored and again.compilations == 0
    assert dataclasses.replace(again, seconds=0.0) == dataclasses.replace(
        model_choice, stored=True, compilations=0, seconds=0.0
    )
    # Another budget is another entry.
    _forget()
    assert not _choose(budget // 2).stored and len(default) == 2
    assert len(list((tmp_path / "choices").glob("*.json"))) == 3


def _entry(name: str) -> tuple[fc.ChunkSizeChoice, int] | None:
    """The choice stored under `name` and its program's bytes."""
    found = store.read(name)
    return None if found is None else (found[0], found[1].bytes)


def test_a_stored_choice_is_checked(default, tmp_path):
    """A stored choice whose program is lowered otherwise now (another build of
    this library with the same version, or a rule of `fun`'s that its traced
    program does not show) is taken where that program compiles to the bytes
    stored (the entry then holds the new hash), and searched again where it
    does not; so is a choice edited by hand, one for another budget, and a file
    that is not an entry."""
    budget = _bytes_at(None) // 2
    first = _choose(budget)
    (entry,) = (tmp_path / "choices").glob("*.json")
    name = entry.name.removesuffix(".json")
    found = store.read(name)
    assert found is not None and len(found[1].fingerprint) == 64
    right, other = found[1], store.Program(found[1].bytes, "0" * 64)
    # Lowered otherwise, the same bytes: taken, compiled once, the hash renewed.
    store.write(name, first, other)
    _forget()
    taken = _choose(budget)
    assert taken.stored and taken.compilations == 1 and store.read(name)[1] == right  # pyright: ignore[reportOptionalSubscript]
    # Lowered otherwise, other bytes: searched, and overwritten.
    store.write(name, first, other._replace(bytes=right.bytes - 1))
    _forget()
    choice = _choose(budget)
    assert not choice.stored and choice.compilations >= 4
    _check_timed(choice)
    assert _entry(name) == (choice, _bytes_at(choice.chunk_size))
    # Edited: the size (its program is another), the budget, the boundaries.
    model_choice = _choose(budget, tune=False)
    (entry,) = set((tmp_path / "choices").glob("*.json")) - {entry}
    name = entry.name.removesuffix(".json")
    stored = store.read(name)
    assert stored is not None
    for wrong in (
        dataclasses.replace(model_choice, chunk_size=_N),
        dataclasses.replace(model_choice, budget=budget + 1),
        dataclasses.replace(model_choice, keep_boundaries=-3),
    ):
        store.write(name, wrong, stored[1])
        _forget()
        again = _choose(budget, tune=False)
        assert not again.stored and again.compilations >= 4
        assert _entry(name) == (again, _bytes_at(again.chunk_size))
    not_entries = ("not json", "[]", '{"choice": {"chunk_size": 3}, "checked": 1}')
    for text in (*not_entries, entry.read_text().replace('"fingerprint"', '"f"')):
        entry.write_text(text)
        _forget()
        assert not _choose(budget, tune=False).stored


def test_store_turned_off(default, monkeypatch, tmp_path):
    monkeypatch.setenv(store.ENVIRONMENT, "")
    budget = _bytes_at(None) // 2
    _check_timed(_choose(budget))
    _forget()
    assert not _choose(budget).stored and len(default) == 2
    assert not (tmp_path / "choices").exists()


def test_an_unwritable_store_is_ignored(default, monkeypatch, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(store.ENVIRONMENT, str(blocker / "choices"))
    _check_timed(_choose(_bytes_at(None) // 2))


def test_store_folder_default(monkeypatch, tmp_path):
    monkeypatch.delenv(store.ENVIRONMENT)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert store.directory() == tmp_path / "filtered_chunk"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert store.directory() == Path.home() / ".cache" / "filtered_chunk"
    monkeypatch.setenv(store.ENVIRONMENT, "~/elsewhere")
    assert store.directory() == Path.home() / "elsewhere"


def test_keys_never_hold_addresses():
    assert store.key(("program", 3)) == store.key(("program", 3))
    assert store.key(("program", 3)) != store.key(("program", 4))
    assert store.key(("program", object())) is None
    # A jaxpr's text masks its callbacks' addresses: the same in a later process.
    masked = "callback=<function <lambda> at 0xXXXXXXXXXXXX>"
    assert store.key((masked,)) is not None


def test_bounded_cost_falls_back_to_the_model(default, monkeypatch):
    # No time allowed: not even two sizes can be timed.
    monkeypatch.setattr(timing, "FLOOR_SECONDS", 0.0)
    monkeypatch.setattr(timing, "SEARCH_FACTOR", 0.0)
    choice = _choose(_bytes_at(None) // 2)
    assert choice.model == "cache" and choice.times == () and not default
    # Stored: a later process does not try again, but `tune=True` times.
    monkeypatch.setattr(timing, "FLOOR_SECONDS", 1.0)
    _forget()
    again = _choose(_bytes_at(None) // 2)
    assert again.stored and again.model == "cache" and not default
    assert again.chunk_size == choice.chunk_size
    _forget()
    timed = _choose(_bytes_at(None) // 2, tune=True)
    assert not timed.stored and timed.model == "timed" and len(default) == 1


def test_timing_needs_room_for_a_copy_of_the_arguments(default, monkeypatch):
    # Half the free memory is below a copy of the arguments plus the budget.
    monkeypatch.setattr(timing, "available_bytes", lambda: _bytes_at(None))
    choice = _choose(_bytes_at(None) // 2)
    assert choice.model == "cache" and not default
    _forget()  # not stored: a later process may have the room
    assert not _choose(_bytes_at(None) // 2).stored


def test_timing_prng_keys(default):
    # A typed key's type is not a NumPy one: its bytes come from its own type.
    keys = jr.split(jr.key(0), _N)
    noise = lambda key, x: _fun(x + jr.normal(key, x.shape, x.dtype))
    chunked = fc.filter_chunked_vmap(noise, chunk_size=fc.MemoryBudget(2**20))
    choice = fc.suggest_chunk_size(chunked, keys, _XS)
    assert choice.model == "timed" and default
    expected = jax.vmap(noise)(keys, _XS)
    assert jnp.allclose(chunked(keys, _XS), expected, rtol=1e-5, atol=1e-5)


def test_default_on_an_accelerator_is_the_largest(default, monkeypatch):
    monkeypatch.setattr(model, "backend", lambda: "gpu")
    choice = _choose(_bytes_at(None) // 2)
    assert choice.model == "largest" and choice.chunk_size == choice.largest
    assert not default


def test_time_each_stops_at_its_budget(monkeypatch):
    # Each run repeated 3 times a sample: fixed, since the count is read from a
    # warm-up's time, which a loaded machine can stretch (CI saw 4 against 101).
    monkeypatch.setattr(timing, "_repeats", lambda first: 3)
    calls: list[int] = []
    runs = {k: (lambda k=k: calls.append(k)) for k in (1, 2, 3)}
    times = timing.time_each(runs, 0.0, min_rounds=1)
    assert sorted(times) == [1, 2, 3]
    # A warm-up and one round of a sample each.
    assert calls.count(1) == calls.count(2) == calls.count(3) == 1 + 3
    calls.clear()
    timing.time_each(runs, 0.0)
    assert calls.count(1) == 1 + 3 * timing.MIN_ROUNDS  # `MIN_ROUNDS` rounds


def test_a_sample_outlasts_the_timers_noise():
    # Runs shorter than `SAMPLE` seconds repeat to outlast it, at most 100 times.
    assert timing._repeats(timing.SAMPLE * 2) == 1
    assert timing._repeats(timing.SAMPLE / 4) == 4
    assert timing._repeats(1e-9) == 100


def test_default_under_grad_and_jit(default):
    w = jr.normal(jr.key(0), (64, 32), jnp.float32) / 8
    f = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w.T) ** 2)
    fixed = lambda k: fc.filter_chunked_vmap(f, in_axes=(None, 0), chunk_size=k)  # noqa: E731
    budget = derivative_bytes(fixed(None), w, _XS)
    g = fixed(fc.MemoryBudget(budget // 2))
    loss = lambda w: jnp.sum(jnp.sin(g(w, _XS)))
    expected = jax.grad(lambda w: jnp.sum(jnp.sin(jax.vmap(f, (None, 0))(w, _XS))))(w)
    assert tree_allclose(jax.jit(jax.grad(loss))(w), expected, rtol=1e-4, atol=1e-4)
    (choice,) = choose._chosen.values()
    assert choice.model == "timed" and choice.bytes <= budget // 2
    for k, _ in choice.times:
        assert derivative_bytes(fixed(k if k < _N else None), w, _XS) <= budget // 2


def test_tune_accepts_none():
    assert fc.MemoryBudget(4096).tune is None
    assert repr(fc.MemoryBudget(4096, tune=False)) == "MemoryBudget(4096, tune=False)"
    assert fc.MemoryBudget(4096, tune=None) == fc.MemoryBudget(4096)
    with pytest.raises(TypeError, match="tune"):
        fc.MemoryBudget(4096, tune=1)  # pyright: ignore[reportArgumentType]


def test_the_descent_ends_at_the_fastest_of_its_neighbours(default, monkeypatch):
    # A cache of 1 KiB: the model runs one element a chunk; with time for every
    # size the descent ends where both neighbours of the fastest were timed.
    monkeypatch.setattr(model, "cache_bytes", lambda: 2**10)
    monkeypatch.setattr(timing, "FLOOR_SECONDS", 60.0)
    choice = _choose(_bytes_at(None) // 2)
    fit = _check_timed(choice)
    times = dict(choice.times)
    assert 1 in times
    i = fit.index(choice.chunk_size)
    assert set(fit[max(i - 1, 0) : i + 2]) <= set(times)


def test_rounds_that_move_the_fastest_resume_the_descent(monkeypatch):
    # Single runs (the descent's samples) and rounds can disagree under load: here
    # one run of 4 elements reads slower than the tie, so the descent stops at 2,
    # but the rounds find 4 the fastest; the descent then goes on from 4 (and from
    # 8, which the next rounds find fastest) until the fastest's neighbours are
    # timed.
    sampled = {1: 3.0, 2: 1.0, 4: 1.5, 8: 2.0, 16: 3.0}
    rounds = {1: 3.0, 2: 1.0, 4: 0.5, 8: 0.4, 16: 0.6}
    monkeypatch.setattr(timing, "sample", lambda run: sampled[run()] * 1e-3)
    monkeypatch.setattr(
        timing, "time_each", lambda runs, *_, **__: {s: rounds[s] * 1e-3 for s in runs}
    )
    monkeypatch.setattr(timing, "available_bytes", lambda: 2**40)
    times = timing.bounded(
        1, [1, 2, 4, 8, 16], lambda s: 0, lambda s: lambda: s, 1, 60.0, 0.0, 0
    )
    assert times is not None and sorted(times) == [1, 2, 4, 8, 16]
    assert min(times, key=times.__getitem__) == 8
