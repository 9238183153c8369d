"""`fc.suggest_chunk_sizes`: the choices of the budgeted calls in the program that
runs, under every transformation around them. The size reported is the size the
program runs (the length of its loops), the program at that fixed size fits the
budget under the same transformation, and the report is the choice the call made."""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import filtered_chunk as fc

from .budgets import compiled_bytes


N, D = 96, 12


def _element(w: Any, x: Any) -> Any:
    return jnp.tanh(jnp.outer(x, x) @ w) @ x


def _map(chunk_size: Any) -> Callable[..., Any]:
    return fc.filter_chunked_vmap(_element, in_axes=(None, 0), chunk_size=chunk_size)


def _loss(run: Callable[..., Any]) -> Callable[..., Any]:
    return lambda w, xs: jnp.sum(run(w, xs) ** 2)


# What the user runs, given the chunked map: `(function of (w, xs), w's shape)`.
PROGRAMS: dict[str, Callable[[Any], Callable[..., Any]]] = {
    "evaluated": lambda run: _loss(run),
    "jit(grad)": lambda run: jax.jit(jax.grad(_loss(run))),
    "value_and_grad": lambda run: jax.value_and_grad(_loss(run)),
    "jvp": lambda run: lambda w, xs: jax.jvp(lambda _w: run(_w, xs), (w,), (w,)),
    "vmap": lambda run: jax.vmap(_loss(run), in_axes=(0, None)),
}


def _args(name: str, key: Any) -> tuple[Any, Any]:
    shape = (3, D, D) if name == "vmap" else (D, D)
    k1, k2 = jr.split(key)
    return jr.normal(k1, shape) / D, jr.normal(k2, (N, D))


def _loop_lengths(fn: Callable[..., Any], *args: Any) -> set[int]:
    """The lengths of the `lax.scan`s in `fn`'s program, nested ones included."""
    lengths: set[int] = set()

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                lengths.add(eqn.params["length"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return lengths


@pytest.fixture(scope="module")
def budget() -> int:
    # Evaluation fits chunks of about half the batch; a derivative, fewer.
    w, xs = _args("evaluated", jr.key(0))
    return compiled_bytes(_map(N // 2), w, xs)


@pytest.mark.parametrize("name", PROGRAMS)
def test_the_size_reported_is_the_size_run_and_fits(name, budget, choices, getkey):
    w, xs = _args(name, getkey())
    program = PROGRAMS[name]
    budgeted = program(_map(fc.MemoryBudget(budget, tune=False)))
    (choice,) = fc.suggest_chunk_sizes(budgeted, w, xs)
    assert choice == choices[-1]  # the choice the call made while traced
    k = choice.chunk_size
    assert 1 <= k < N and choice.bytes <= choice.budget == budget
    assert _loop_lengths(budgeted, w, xs) == {math.ceil(N / k)}
    fixed = program(_map(k))
    # Under an outer `vmap` the budget is for each of its elements.
    outer = w.shape[0] if name == "vmap" else 1
    assert compiled_bytes(fixed, w, xs) <= budget * outer
    expected = program(eqx.filter_vmap(_element, in_axes=(None, 0)))(w, xs)
    assert eqx.tree_equal(budgeted(w, xs), fixed(w, xs), expected, rtol=1e-5)


def test_a_derivative_reports_its_own_smaller_size(budget, getkey):
    # The report for evaluating the map is not the training step's: fixing the
    # first under `jax.grad` would exceed the budget.
    w, xs = _args("evaluated", getkey())
    chunked = _map(fc.MemoryBudget(budget, tune=False))
    evaluated = fc.suggest_chunk_size(chunked, w, xs)
    (differentiated,) = fc.suggest_chunk_sizes(jax.grad(_loss(chunked)), w, xs)
    assert differentiated.chunk_size < evaluated.chunk_size
    grad_at = lambda k: jax.grad(_loss(_map(k)))  # noqa: E731
    assert compiled_bytes(grad_at(evaluated.chunk_size), w, xs) > budget
    assert compiled_bytes(grad_at(differentiated.chunk_size), w, xs) <= budget


def test_every_budgeted_call_in_order_each_once(budget, getkey):
    w, xs = _args("evaluated", getkey())
    small = _map(fc.MemoryBudget(budget // 3, tune=False))
    large = _map(fc.MemoryBudget(budget, tune=False))
    fixed = _map(8)  # not budgeted: not reported

    def step(_w, _xs):
        y = large(_w, _xs) + fixed(_w, _xs)
        return small(_w, jnp.tanh(y)) + large(_w, _xs)  # `large` again: same choice

    first, second = fc.suggest_chunk_sizes(step, w, xs)
    assert (first.budget, second.budget) == (budget, budget // 3)
    assert second.chunk_size < first.chunk_size


def test_a_cached_trace_reports_the_same(budget, getkey):
    # A second trace of a jitted function reuses JAX's cached jaxpr without
    # calling the chunked map again: its marks still name the choice.
    w, xs = _args("evaluated", getkey())
    step = jax.jit(jax.grad(_loss(_map(fc.MemoryBudget(budget, tune=False)))))
    before = fc.suggest_chunk_sizes(step, w, xs)
    step(w, xs)
    assert fc.suggest_chunk_sizes(step, w, xs) == before
    assert len(before) == 1


def test_shapes_modules_and_no_budgeted_call(getkey):
    model = eqx.nn.MLP(D, D, 32, 1, key=getkey())
    chunked = fc.filter_chunked_vmap(
        lambda m, x: m(x), in_axes=(None, 0), chunk_size="auto"
    )
    xs = jax.ShapeDtypeStruct((N, D), model.layers[0].weight.dtype)
    loss = lambda m, _xs: jnp.sum(chunked(m, _xs))  # noqa: E731
    (choice,) = fc.suggest_chunk_sizes(eqx.filter_grad(loss), model, xs)
    assert 1 <= choice.chunk_size <= N
    assert fc.suggest_chunk_sizes(lambda m, _xs: jnp.sum(_xs), model, xs) == ()
    # Nothing to split: no choice to report.
    empty = jax.ShapeDtypeStruct((0, D), xs.dtype)
    assert fc.suggest_chunk_sizes(loss, model, empty) == ()
