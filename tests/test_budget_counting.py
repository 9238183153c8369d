"""A budget counts every buffer of the program that runs: on CPU, XLA's YNNPACK
fusions keep buffers that `memory_analysis()` does not report, so the budget
adds what they keep and, where one uses a product's result further, also reads
the program compiled with them off (`Lowered.full`); and it counts each size only
as far as its comparison with the budget needs."""

from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc
import filtered_chunk._budget._counts as counts
from filtered_chunk._budget._program import ChunkedProgram, Lowered, Measured

from .budgets import compiled_bytes, derivative_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU fusions")
def test_budget_counts_the_buffers_that_cpu_fusions_hide(getkey):
    # XLA's CPU backend runs a per-element loss of an MLP in a YNNPACK fusion
    # whose buffers `memory_analysis()` does not count (no temporaries at all
    # for the whole batch). The budget counts every buffer (`budgets.py`
    # counts the same way): it splits the batch, and the program it runs fits.
    w1 = jr.normal(getkey(), (16, 256), jnp.float32)
    w2 = jr.normal(getkey(), (256, 16), jnp.float32)
    xs = jr.normal(getkey(), (2048, 16), jnp.float32)
    f = lambda x: jnp.sum(jnp.tanh(x @ w1 + 0.1) @ w2)  # noqa: E731
    counted = compiled_bytes(jax.vmap(f), xs)  # every buffer
    whole = jax.jit(jax.vmap(f)).lower(xs).compile()
    if '"__ynn_fusion"' in str(whole.as_text()):
        # What XLA reports leaves buffers out (jax 0.10.2: every temporary).
        reported = whole.memory_analysis()
        assert reported is not None
        assert reported.temp_size_in_bytes + reported.output_size_in_bytes < counted
    budget = counted // 4
    chunked = fc.filter_chunked_vmap(f, chunk_size=fc.MemoryBudget(budget, tune=False))
    choice = fc.suggest_chunk_size(chunked, xs)
    assert choice.chunk_size < 2048 and choice.bytes <= budget
    fixed = fc.filter_chunked_vmap(f, chunk_size=choice.chunk_size)
    assert compiled_bytes(fixed, xs) <= budget
    assert jnp.allclose(chunked(xs), jax.vmap(f)(xs), rtol=1e-4, atol=1e-3)


def test_sizes_are_counted_only_as_far_as_the_budget_needs(monkeypatch):
    # Under `jax.grad` a size is first counted as a lower bound (the pullback's
    # program). Its linearisation compiles only where that fits, for the sizes
    # the search settles on: the one chosen and the largest (no size is timed
    # here, `tests/conftest.py`), and those it measures in full where the
    # bounds were loose. A size over the budget by its bound never does.
    w = jr.normal(jr.key(0), (64, 32), jnp.float32) / 8
    xs = jr.normal(jr.key(1), (300, 64), jnp.float32)
    f = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w.T) ** 2)  # noqa: E731

    def fixed(k: Any) -> Any:
        return fc.filter_chunked_vmap(f, in_axes=(None, 0), chunk_size=k)

    budget = derivative_bytes(fixed(None), w, xs) // 3
    counts.measured.clear()
    linearised: list[int] = []
    real = counts.linearisation

    def _recording(program: Any, k: int | None) -> Any:
        linearised.append(300 if k is None else k)
        return real(program, k)

    monkeypatch.setattr(counts, "linearisation", _recording)
    budgeted = fixed(fc.MemoryBudget(budget))
    grad = jax.grad(lambda w: jnp.sum(budgeted(w, xs)))
    (choice,) = fc.suggest_chunk_sizes(grad, w)
    tried = dict(choice.tried)
    runs = {choice.chunk_size, choice.largest}
    assert runs <= set(linearised) and len(set(linearised)) == len(linearised)
    assert len(linearised) < len(tried)  # not the sizes over the budget
    for k, num_bytes in tried.items():
        oracle = derivative_bytes(fixed(k if k < 300 else None), w, xs)
        if k in linearised:  # counted in full
            assert num_bytes == oracle
        else:  # a lower bound: over the budget, so is the program
            assert num_bytes <= oracle
    assert choice.bytes == tried[choice.chunk_size] <= budget


class _FakeLowered(Lowered):
    """A size's program with its counts given, `own` (XLA's count of the program
    that runs) and `every` (with the fusions off): records each compilation."""

    def __init__(self, log: list[str], k: int, own: int, every: int) -> None:
        self.log, self.k, self.done = log, k, set()
        self.own, self.every = Measured(own, 0), Measured(every, 0)

    def _compile(self, what: str) -> None:
        if what not in self.done:
            self.done.add(what)
            self.log.append(f"{what} {self.k}")

    def compiled(self) -> tuple[Measured, Any]:
        self._compile("runs")
        return self.own, lambda: None

    def full(self) -> Measured:
        self._compile("runs")
        self._compile("every")
        return max(self.own, self.every, key=lambda m: m.total)


class _FakeProgram(ChunkedProgram):
    def __init__(self, log: list[str], table: dict[int, tuple[int, int, int]]):
        self.log, self.table = log, table

    def lower(self, k: int | None, linearize: bool = False) -> Lowered:
        assert k is not None and not linearize
        return _FakeLowered(self.log, k, *self.table[k][:2])


def test_counts_compile_only_what_the_comparison_needs(monkeypatch):
    # By size: XLA's count of the program that runs, every buffer's (the
    # fusions off), the linearisation's.
    table = {1: (10, 12, 30), 2: (50, 40, 45), 3: (90, 95, 80)}
    log: list[str] = []

    def _linearisation(program: Any, k: int) -> Measured:
        log.append(f"linearisation {k}")
        return Measured(table[k][2], 0)

    monkeypatch.setattr(counts, "linearisation", _linearisation)
    c = counts.Counts(_FakeProgram(log, table), None, reverse=True)
    # Over the limit by the program that runs: nothing more compiles.
    assert c.measure(3, 60) == (Measured(90, 0), False) and log == ["runs 3"]
    # Within it, every buffer, then the linearisation, each while the bytes so
    # far fit.
    log.clear()
    assert c.measure(1, 11) == (Measured(12, 0), False)
    assert log == ["runs 1", "every 1"]
    log.clear()
    assert c.measure(2, 60) == (Measured(50, 0), True)
    assert log == ["runs 2", "every 2", "linearisation 2"]
    log.clear()
    assert c.measure(1, 100) == (Measured(30, 0), True)  # the linearisation's
    assert log == ["linearisation 1"]
    # `full`: every count whatever the limit (a refusal's smallest size).
    log.clear()
    assert c.measure(3, 60, full=True) == (Measured(95, 0), True)
    assert log == ["every 3", "linearisation 3"]
