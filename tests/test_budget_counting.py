"""A budget counts every buffer of the program that runs: on CPU, XLA's YNNPACK
fusions keep scratch memory that `memory_analysis()` does not report, so the
budget also reads the program compiled with them off (`memory_counted`)."""

import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc

from .budgets import compiled_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU fusions")
def test_budget_counts_the_buffers_that_cpu_fusions_hide(getkey):
    # XLA's CPU backend runs a per-element loss of an MLP in a YNNPACK fusion
    # whose scratch `memory_analysis()` does not count (no temporaries at all
    # for the whole batch). The budget counts every buffer, as compiled with
    # those fusions off: it splits the batch, and the program it runs fits.
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
