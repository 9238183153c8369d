"""Memory budgets find the largest chunk size whose compiled program fits, and run
it or the speed model's smaller size that also fits (`test_budget_model.py`): on
the benchmarks' workloads and random PyTrees, when nothing fits or everything
does; the search's cache follows the traced program and makes repeated calls
compile nothing."""

import pathlib
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from hypothesis import given, Phase, settings

import filtered_chunk as fc
from filtered_chunk._budget import MemoryBudget
from filtered_chunk._budget._keep import keep_if_fits
from filtered_chunk._budget._program import Measured
from filtered_chunk._budget._refusal import too_small
from filtered_chunk._budget._search import _search, _secant, MAX_COMPILATIONS, Sizes

from .budgets import (
    check_largest,
    check_refusal,
    compiled_bytes,
    derivative_bytes,
    memory_analysis,
    nonlinear_element,
)
from .helpers import count_compiles, tree_allclose


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import _workloads  # noqa: E402  # pyright: ignore[reportMissingImports]


# The benchmarks' workloads (`benchmarks/_workloads.py`), at small sizes.
def _small_workloads() -> list[Any]:
    s = _workloads.Sizes(64, (8,), 32, 8)
    return [
        _workloads.pairwise_kernel(64, 8, s),
        _workloads.wide_mlp(8, 64, 4, s),
        _workloads.per_example_grads(8, 16, _workloads.Sizes(32, (8,), 16, 8)),
        _workloads.shared_grad(8, 64, 4, s),
        _workloads.ensemble(4, 16, 2, 16, _workloads.Sizes(16, (4,), 8, 4)),
    ]


def _workload_program(w: Any, chunk_size: Any) -> Callable[..., Any]:
    mapped = fc.filter_chunked_vmap(
        w.element, in_axes=w.in_axes, out_axes=w.out_axes, chunk_size=chunk_size
    )
    if w.objective == "grad":
        return lambda p, *rest: jax.grad(lambda _p: jnp.sum(mapped(_p, *rest)))(p)
    return mapped


@pytest.mark.parametrize("w", _small_workloads(), ids=lambda w: w.key)
# The benchmark (`benchmarks/budget.py`) also runs 1/4 and 1/2.
@pytest.mark.parametrize("fraction", (1 / 8, 1 / 2))
def test_workloads_fit_the_budget(w, fraction, choices):
    # The benchmarks' functions broadcast as NumPy does.
    with jax.numpy_rank_promotion("allow"):
        _check_workload(w, fraction, choices)


_WORKLOAD_BYTES: dict[tuple[str, int | None], int] = {}


def _check_workload(w: Any, fraction: float, choices: list[Any]) -> None:
    n = w.sizes.batch_size
    args = w.make_args(n)

    def bytes_at(k: int | None) -> int:
        # Shared by the four budgets of a workload: each size compiles once.
        if (w.key, k) not in _WORKLOAD_BYTES:
            mapped = fc.filter_chunked_vmap(
                w.element, in_axes=w.in_axes, out_axes=w.out_axes, chunk_size=k
            )
            measure = derivative_bytes if w.objective == "grad" else compiled_bytes
            _WORKLOAD_BYTES[w.key, k] = measure(mapped, *args)
        return _WORKLOAD_BYTES[w.key, k]

    budget = int(fraction * bytes_at(None))
    program = _workload_program(w, fc.MemoryBudget(budget))
    expected = _workload_program(w, None)(*args)
    try:
        actual = program(*args)
    except ValueError as error:
        # Refused only where neither the whole batch nor one element fits (and
        # no other size measured does).
        assert bytes_at(None) > budget and bytes_at(1) > budget
        check_refusal(str(error), bytes_at, budget, n)
        return
    assert tree_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    (choice,) = choices
    check_largest(bytes_at, choice, budget, n)
    # Eagerly and under `jit` the same choice, from the cache: nothing compiled.
    with count_compiles() as compiles:
        jax.jit(program).lower(*args)
    assert len(compiles) == 0
    assert choices[-1] == choice


@st.composite
def pytree_cases(draw):
    batch_size = draw(st.integers(1, 24))
    widths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    remainder = draw(st.sampled_from(("overlap", "separate")))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tree = {
        f"x{i}": rng.standard_normal((batch_size, d)).astype(np.float32)
        for i, d in enumerate(widths)
    }
    return tree, remainder, draw(st.floats(0.0, 1.2))


def _pytree_fun(tree: dict[str, Any], scale: Any) -> Any:
    # Each leaf makes a `d x d` temporary; the output holds one row of it.
    return {k: jnp.tanh(jnp.outer(x, x)) @ x * scale for k, x in tree.items()}


# Each example compiles the call at several chunk sizes: few examples suffice.
@settings(max_examples=5, phases=(Phase.explicit, Phase.generate))
@given(pytree_cases())
def test_random_pytrees_fit_the_budget(case):
    tree, remainder, where = case
    n = next(iter(tree.values())).shape[0]

    def chunked(chunk_size: Any) -> Callable[..., Any]:
        return fc.filter_chunked_vmap(
            _pytree_fun, in_axes=(0, None), chunk_size=chunk_size, remainder=remainder
        )

    bytes_at = lambda k: compiled_bytes(chunked(k), tree, 2.0)  # noqa: E731
    whole = bytes_at(None)
    smallest = min(whole, bytes_at(1)) if n > 1 else whole
    budget = max(int(smallest * 0.9 + where * (whole - smallest * 0.9)), 1)
    expected = eqx.filter_vmap(_pytree_fun, in_axes=(0, None))(tree, 2.0)
    try:
        choice = fc.suggest_chunk_size(chunked(fc.MemoryBudget(budget)), tree, 2.0)
    except ValueError as error:
        # Refused only below both ends (a size between may still fit).
        assert budget < smallest
        check_refusal(str(error), bytes_at, budget, n)
        return
    check_largest(bytes_at, choice, budget, n, remainder)
    assert tree_allclose(chunked(fc.MemoryBudget(budget))(tree, 2.0), expected)


def _mlp_case(getkey):
    mlp = eqx.nn.MLP(4, 2, 64, depth=1, key=getkey())
    return mlp, jr.normal(getkey(), (40, 4))


def test_nothing_fits_says_what_the_smallest_chunk_needs(getkey):
    mlp, x = _mlp_case(getkey)
    needs = compiled_bytes(fc.filter_chunked_vmap(mlp, chunk_size=1), x)
    analysis = memory_analysis(fc.filter_chunked_vmap(mlp, chunk_size=1), x)
    output_bytes = analysis.output_size_in_bytes
    chunked = fc.filter_chunked_vmap(mlp, chunk_size=fc.MemoryBudget(needs - 1))
    match = (
        rf"`filter_chunked_vmap\(\.\.\., chunk_size=MemoryBudget\({needs - 1}\)\)`: "
        rf"the memory budget of {needs - 1} bytes .* is too small for this call\. "
        rf"Even one element per chunk .* needs {needs} bytes .* of which "
        rf"{output_bytes} bytes \(.*\) are outputs.* Give a budget of at least "
        rf"{needs} bytes"
    )
    with pytest.raises(ValueError, match=match):
        chunked(x)
    with pytest.raises(ValueError, match=match):
        eqx.filter_jit(chunked)(x)
    # Below the outputs: refused at once, naming them.
    below = fc.filter_chunked_vmap(mlp, chunk_size=fc.MemoryBudget(output_bytes - 1))
    with count_compiles() as compiles:
        with pytest.raises(
            ValueError, match=rf"Its outputs alone need {output_bytes} "
        ):
            below(x)
    # The whole batch only (if not cached), with every buffer counted: on CPU
    # compiled once more where a YNNPACK fusion uses a product's result further.
    assert len(compiles) <= 2
    # At exactly that many bytes, one element per chunk is chosen.
    exact = fc.MemoryBudget(needs)
    assert fc.suggest_chunk_size(fc.filter_chunked_vmap(mlp, chunk_size=exact), x)
    choice = fc.suggest_chunk_size(fc.filter_chunked_vmap(mlp, chunk_size=exact), x)
    assert choice.chunk_size == 1 and choice.bytes == needs


def test_whole_batch_when_it_fits(getkey):
    mlp, x = _mlp_case(getkey)
    bytes_at = lambda k: compiled_bytes(fc.filter_chunked_vmap(mlp, chunk_size=k), x)  # noqa: E731
    whole = bytes_at(None)
    chunked = fc.filter_chunked_vmap(mlp, chunk_size=fc.MemoryBudget(whole))
    choice = fc.suggest_chunk_size(chunked, x)
    assert choice.largest == 40 and (40, whole) in choice.tried
    check_largest(bytes_at, choice, whole, 40)
    # One compilation; one more only where the cache model caps the size.
    if choice.chunk_size == 40:
        assert choice.tried == ((40, whole),)
    else:
        assert len(choice.tried) == 2
    assert tree_allclose(chunked(x), jax.vmap(mlp)(x))


def test_repeated_calls_compile_nothing_for_the_search(getkey):
    # Shapes of its own: the cache is shared by every test in the process.
    mlp = eqx.nn.MLP(5, 2, 96, depth=1, key=getkey())
    x = jr.normal(getkey(), (48, 5))
    whole = compiled_bytes(fc.filter_chunked_vmap(mlp), x)
    chunked = fc.filter_chunked_vmap(mlp, chunk_size=fc.MemoryBudget(whole // 3))
    with count_compiles() as first:
        choice = fc.suggest_chunk_size(chunked, x)
    # One more where the speed model caps the size below the largest that fits.
    capped = choice.chunk_size < choice.largest
    assert 3 <= len(choice.tried) <= 8 + capped
    # On CPU a program whose YNNPACK fusion uses a product's result further
    # compiles once more, to count every buffer (`Lowered.full`).
    assert len(choice.tried) <= len(first) <= 2 * len(choice.tried)
    with count_compiles() as again:
        assert fc.suggest_chunk_size(chunked, x) == choice
    assert len(again) == 0
    with count_compiles() as eager:
        out = chunked(x)
    assert len(eager) == 1  # the call itself, chunked at the chosen size
    with count_compiles() as eager_again:
        chunked(x)
    assert len(eager_again) == 0
    # Under `jit`: only the outer program is compiled.
    with count_compiles() as jitted:
        jax.jit(lambda _x: chunked(_x))(x)
    assert len(jitted) == 1
    # A new wrapper of the same function shares the cache (it is keyed on the
    # traced program, not on the wrapper).
    with count_compiles() as rebuilt:
        same = fc.filter_chunked_vmap(mlp, chunk_size=fc.MemoryBudget(whole // 3))
        assert fc.suggest_chunk_size(same, x) == choice
    assert len(rebuilt) == 0
    assert tree_allclose(out, jax.vmap(mlp)(x))


def test_cache_follows_the_program_not_the_function(getkey):
    x = jr.normal(getkey(), (64, 32))
    budget = fc.MemoryBudget("256KiB")
    # Same Python function, a different program: the closure's width changes.
    width = [8]
    f = lambda v: jnp.tanh(jnp.outer(v, jnp.ones(width[0]))) @ jnp.ones(width[0])
    chunked = fc.filter_chunked_vmap(f, chunk_size=budget)
    first = fc.suggest_chunk_size(chunked, x)
    width[0] = 128
    second = fc.suggest_chunk_size(chunked, x)
    assert second.largest < first.largest
    assert second.chunk_size <= first.chunk_size
    assert (
        compiled_bytes(fc.filter_chunked_vmap(f, chunk_size=second.chunk_size), x)
        <= 2**18
    )
    assert tree_allclose(chunked(x), jax.vmap(f)(x))


@pytest.mark.parametrize("batch_size", (17, 30, 97))
def test_separate_remainder_chooses_the_largest_that_fits(batch_size):
    # Above half the batch, one chunk and the remainder are live at once: the
    # bytes jump and then fall, not affine in the size (issue 14, item 4).
    xs = jr.normal(jr.key(1), (batch_size, 64))

    def chunked(k: Any) -> Callable[..., Any]:
        return fc.filter_chunked_vmap(
            nonlinear_element, chunk_size=k, remainder="separate"
        )

    # Every size, or (larger batches) a sample of those above half of it.
    exhaustive = batch_size < 20
    step = 3 if batch_size < 50 else 6
    sizes = (
        range(1, batch_size + 1)
        if exhaustive
        else range(batch_size // 2, batch_size, step)
    )
    measured = {
        k: compiled_bytes(chunked(k if k < batch_size else None), xs)
        for k in {*sizes, batch_size // 2, batch_size - 1, batch_size}
    }

    def bytes_at(k: int | None) -> int:
        k = batch_size if k is None else k
        if k not in measured:
            measured[k] = compiled_bytes(chunked(k if k < batch_size else None), xs)
        return measured[k]

    budgets = [measured[batch_size] - 1, measured[batch_size // 2] + 1]
    if exhaustive:
        budgets.append((measured[1] + measured[batch_size // 2]) // 2)
    for i, budget in enumerate(budgets):
        with count_compiles() as compiles:
            choice = fc.suggest_chunk_size(chunked(fc.MemoryBudget(budget)), xs)
        # Later budgets reuse the measurements of earlier ones.
        assert len(compiles) <= len(choice.tried) <= MAX_COMPILATIONS
        assert i or len(compiles) == len(choice.tried)
        largest = max(k for k, b in measured.items() if b <= budget)
        assert choice.largest == largest
        assert dict(choice.tried)[largest] == measured[largest]
        check_largest(bytes_at, choice, budget, batch_size, "separate")


def _search_table(
    bytes_at: Callable[[int], int], n: int, remainder: str, limit: int
) -> tuple[int | None, dict[int, int], str]:
    """`_search` over a table of bytes: the size it chooses (`None` where it
    refuses), the sizes it measured, and its refusal."""
    tried: dict[int, Measured] = {}

    def _measure(k: int) -> Measured:
        tried[k] = Measured(bytes_at(k), 0)
        return tried[k]

    def _refusal() -> ValueError:
        return too_small("f", MemoryBudget(limit), limit, tried, n)

    try:
        k = _search(
            _measure, Sizes(n, remainder), limit, _refusal, lambda: len(tried) + 1
        )
    except ValueError as error:
        return None, {s: m.total for s, m in tried.items()}, str(error)
    return k, {s: m.total for s, m in tried.items()}, ""


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_search_does_not_assume_one_element_is_the_smallest(remainder):
    # Affine in the size, except that one element per chunk costs most (as a
    # collective's staged program can) and the sizes that divide the batch cost
    # less than their neighbours (as a derivative's program can): a budget that
    # some size meets is not refused because one element does not (issue 23,
    # item 7).
    n = 40

    def bytes_at(k: int) -> int:
        return 50_000 if k == 1 else 10_000 + 1_000 * k - 3_000 * (n % k == 0)

    sizes = Sizes(n, remainder)
    for limit in (bytes_at(2), bytes_at(4), bytes_at(8), bytes_at(10)):
        k, tried, _ = _search_table(bytes_at, n, remainder, limit)
        assert k is not None and tried[k] == bytes_at(k) <= limit
        assert bytes_at(sizes.above(k)) > limit  # the largest that fits from there
        assert len(tried) < MAX_COMPILATIONS
    # Below every size: refused, naming every size measured and the smallest.
    k, tried, message = _search_table(bytes_at, n, remainder, bytes_at(2) - 1)
    assert k is None and min(tried.values()) == bytes_at(2)
    measured = ", ".join(f"{s}: {b}" for s, b in sorted(tried.items()))
    assert f"were {measured}: none fits" in message
    smallest = "at 2 elements per chunk (rows or columns, for a Jacobian), needs"
    assert f"{smallest} {bytes_at(2)} bytes" in message
    assert f"Give a budget of at least {bytes_at(2)} bytes" in message


def test_a_guess_far_over_the_budget_is_not_checked_with_its_neighbour():
    # Bytes that jump between 16 and 18 elements, as XLA's schedule of a staged
    # derivative did (`tests/test_collectives_boundaries.py`'s six blocks under
    # `jax.grad`): the line from 1 to 128 guesses 20, over the budget by more
    # than the line through 1 and 20 falls to 19, so the next guess is on that
    # line (16), not 19. The same size as measuring every size, one fewer.
    n, limit = 256, 163_840

    def bytes_at(k: int) -> int:
        if k == 128:
            return 603_032
        return 83_544 + 3_500 * (k - 1) if k <= 16 else 173_496 + 3_000 * (k - 18)

    sizes, measured = Sizes(n, "overlap"), []

    def _bytes(k: int) -> int:
        measured.append(k)
        return bytes_at(k)

    k = _secant(_bytes, sizes, limit, (1, 128), lambda: len(set(measured)))
    everything = {sizes.at_most(s) for s in range(1, 129)}
    assert k == max(s for s in everything if bytes_at(s) <= limit) == 16
    assert set(measured) == {1, 128, 20, 16, 18}


def _normalised_kernel(x: Any) -> Any:
    # Two collectives over the batch, then a `d x d` temporary per element.
    z = (x - jax.lax.pmean(x, "i")) / jnp.sqrt(jax.lax.pmean(x**2, "i"))
    return jnp.tanh(jnp.outer(z, z)) @ z


def test_collectives_budget_met_above_one_element_per_chunk(getkey):
    # With collectives, one element per chunk needs more than two or four do
    # (issue 23, item 7): their budgets are met, not refused as too small.
    x = jr.normal(getkey(), (200, 32), jnp.float64)  # the gradient sums 200 terms

    def chunked(k: Any) -> Callable[..., Any]:
        return fc.filter_chunked_vmap(_normalised_kernel, chunk_size=k, axis_name="i")

    bytes_at = lambda k: compiled_bytes(chunked(k), x)  # noqa: E731
    expected = eqx.filter_vmap(_normalised_kernel, axis_name="i")(x)
    for budget in (bytes_at(2), bytes_at(4)):
        choice = fc.suggest_chunk_size(chunked(fc.MemoryBudget(budget)), x)
        assert bytes_at(choice.chunk_size) == choice.bytes <= budget
        assert tree_allclose(chunked(fc.MemoryBudget(budget))(x), expected)
    # Under `grad` too: the user's own compiled program fits.
    loss = lambda g: lambda _x: jnp.sum(g(_x) ** 2)  # noqa: E731
    budget = derivative_bytes(chunked(2), x)
    program = jax.grad(loss(chunked(fc.MemoryBudget(budget))))
    assert compiled_bytes(program, x) <= budget
    expected = jax.grad(loss(eqx.filter_vmap(_normalised_kernel, axis_name="i")))(x)
    assert tree_allclose(jax.jit(program)(x), expected)
    # Just above the outputs, below every program: refused, with what each size
    # measured needs, chunks of two among them.
    budget = x.nbytes + 1  # the output is like `x`
    with pytest.raises(ValueError, match="too small") as info:
        fc.suggest_chunk_size(chunked(fc.MemoryBudget(budget)), x)
    measured = check_refusal(str(info.value), bytes_at, budget, 200)
    assert 2 in measured


def _mlp_losses(g: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    """The user's programs of reverse mode through a chunked map `g(q, *rest)`,
    differentiated with respect to `q`."""

    def _with_predictions(q: Any, *rest: Any) -> Any:
        y = g(q, *rest)
        return jnp.sum(y**2), y

    return {
        "grad": jax.grad(lambda q, *rest: jnp.sum(g(q, *rest) ** 2)),
        "linear grad": jax.grad(lambda q, *rest: jnp.sum(g(q, *rest))),
        "value_and_grad": jax.value_and_grad(_with_predictions, has_aux=True),
    }


@pytest.mark.parametrize("wrt", ("inputs", "closed-over weights"))
def test_under_grad_a_budget_met_above_one_element_per_chunk(wrt, getkey):
    # Under `grad` the program at one element per chunk can need more than at
    # a size that divides the batch (issue 23, item 7): here 3 of 33. Every
    # value the user varies is an argument of their program.
    w1, w2 = jr.normal(getkey(), (16, 64)), jr.normal(getkey(), (64, 16))
    xs = jr.normal(getkey(), (33, 16))

    def mapped(k: Any) -> Callable[..., Any]:
        def _call(x: Any, w: Any, v: Any) -> Any:
            f = lambda _x: jnp.tanh(jnp.tanh(_x @ w) @ v)  # noqa: E731
            return fc.filter_chunked_vmap(f, chunk_size=k)(x)

        if wrt == "inputs":
            return _call
        return lambda w, x, v: _call(x, w, v)

    args = (xs, w1, w2) if wrt == "inputs" else (w1, xs, w2)
    budget = derivative_bytes(mapped(3), *args)
    oracle = _mlp_losses(mapped(None))
    for name, program in _mlp_losses(mapped(fc.MemoryBudget(budget))).items():
        assert compiled_bytes(program, *args) <= budget, name
        assert tree_allclose(jax.jit(program)(*args), oracle[name](*args)), name


def _keep_choice(budget: int) -> Any:
    # A recomputing program of 8 passes chosen at 1,024 elements a chunk: 4 MiB
    # that is not per element, 4 KiB an element.
    k, fixed, element = 1024, 4 * 2**20, 4096
    return fc.ChunkSizeChoice(
        chunk_size=k,
        bytes=fixed + element * k,
        budget=budget,
        tried=(),
        largest=k,
        model="largest",
        element_bytes=element,
        cache_bytes=None,
        working_set=(),
    )


def _kept_bytes(size: int, every: int) -> int:
    # Every `every`-th of 8 passes keeps a boundary of 4 MiB; a kept program's
    # working set is 1 KiB an element, a quarter of the recomputing one's.
    return 4 * 2**20 + 1024 * size + (8 // every) * 4 * 2**20


@pytest.mark.parametrize(
    "budget_mib, expected",
    [(40, (1024, True)), (22, (1024, 2)), (17, (1024, 3)), (12.5, (512, 3))],
)
def test_keep_if_fits_keeps_most_at_least_work(budget_mib, expected):
    # Of the `n` that keep as many passes' boundaries, the smallest (every 3rd of
    # 8 keeps two, as every 4th does, recomputing more); a size too large for
    # them is cut where the line through the kept program's own bytes meets the
    # budget (`element_bytes`, the recomputing program's, would cut too little
    # here and miss), within eight compilations.
    calls = []

    def measure(size: int, every: int) -> int:
        calls.append((size, every))
        return _kept_bytes(size, every)

    budget = int(budget_mib * 2**20)
    kept = lambda every: (8 // every) * 4 * 2**20  # noqa: E731
    choice = keep_if_fits(_keep_choice(budget), measure, 8, 8192, "overlap", kept)
    assert (choice.chunk_size, choice.keep_boundaries) == expected
    every = 1 if choice.keep_boundaries is True else choice.keep_boundaries
    assert choice.bytes == _kept_bytes(choice.chunk_size, every) <= budget
    assert len(calls) <= 8 and all(n != 4 for _, n in calls)
    # Boundaries that alone do not fit beside the 4 MiB that is not per element
    # are never compiled: every pass's (32 MiB) below 36 MiB.
    assert all(n != 1 for _, n in calls) or budget >= 36 * 2**20
