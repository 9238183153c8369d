"""Memory budgets: `chunk_size="auto"`/`fc.MemoryBudget(...)` choose the largest
chunk size whose compiled program fits, on every transform and under `jit`, `grad`
and `vmap`; `fc.suggest_chunk_size` reports it; bad budgets and chunk sizes fail
with the library's messages.

The memory oracle is independent of the library's search: `jax.jit` of the public
transform at a fixed chunk size, compiled, read with `memory_analysis()`.
"""

import contextlib
import pathlib
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import given, Phase, settings

import filtered_chunk as fc
import filtered_chunk._apply
import filtered_chunk._chunked_vmap
import filtered_chunk._jacobian
from filtered_chunk._chunk_search import MAX_COMPILATIONS

from .helpers import tree_allclose


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import _workloads  # noqa: E402  # pyright: ignore[reportMissingImports]


def memory_analysis(fn: Callable[..., Any], *args: Any) -> Any:
    """XLA's memory analysis of `fn` compiled for `args`, with its non-array
    arguments (Python scalars) fixed, as a chunked call runs it."""
    dynamic, static = eqx.partition(args, eqx.is_array)
    program = lambda _dynamic: fn(*eqx.combine(_dynamic, static))  # noqa: E731
    analysis = jax.jit(program).lower(dynamic).compile().memory_analysis()
    assert analysis is not None
    return analysis


def compiled_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """XLA's temporary plus output bytes of `fn` compiled for `args`."""
    analysis = memory_analysis(fn, *args)
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def nbytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jtu.tree_leaves(tree))


def derivative_bytes(fn: Callable[..., Any], p: Any, *rest: Any) -> int:
    """What a budget counts for `fn` differentiated w.r.t. its first argument, as
    `jax.grad`/`jax.linearize` run it: the larger of its pullback of a cotangent
    and its linearisation applied to a tangent, plus the bytes of that cotangent
    or tangent. Both are arguments of the compiled program, as a real loss's
    cotangent is not a constant XLA could fold."""
    out = jax.eval_shape(fn, p, *rest)
    ct = jtu.tree_map(lambda o: np.zeros(o.shape, o.dtype), out)

    def _pullback(_ct: Any, _p: Any, *_rest: Any) -> Any:
        y, pullback = jax.vjp(lambda q: fn(q, *_rest), _p)
        return y, pullback(_ct)

    def _linearised(_t: Any, _p: Any, *_rest: Any) -> Any:
        y, push = jax.linearize(lambda q: fn(q, *_rest), _p)
        return y, push(_t)

    return max(
        compiled_bytes(_pullback, ct, p, *rest) + nbytes(ct),
        compiled_bytes(_linearised, p, p, *rest) + nbytes(p),
    )


def next_size_up(batch_size: int, k: int, remainder: str) -> int | None:
    """The next chunk size that runs differently; `None` once the batch is reached.
    With `remainder="overlap"` that is the balanced size with one step fewer."""
    if k >= batch_size:
        return None
    if remainder == "separate":
        return k + 1
    steps = -(-batch_size // k)
    return -(-batch_size // (steps - 1))


class _Compiles:
    """Counts XLA compilations (JAX's monitoring events) while active."""

    def __init__(self) -> None:
        self.count = 0

    def _listen(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        del duration_secs, kwargs
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


@contextlib.contextmanager
def count_compiles() -> Iterator[_Compiles]:
    counter = _Compiles()
    jax.monitoring.register_event_duration_secs_listener(counter._listen)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(counter._listen)


@pytest.fixture
def choices(monkeypatch) -> list[fc.ChunkSizeChoice]:
    """Every choice a transform makes while the test runs (under `grad` too)."""
    found: list[fc.ChunkSizeChoice] = []
    for module in (
        filtered_chunk._chunked_vmap,
        filtered_chunk._apply,
        filtered_chunk._jacobian,
    ):
        original = module.choose_chunk_size

        def _spy(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            choice = _original(*args, **kwargs)
            found.append(choice)
            return choice

        monkeypatch.setattr(module, "choose_chunk_size", _spy)
    return found


def check_largest(
    bytes_at: Callable[[int | None], int],
    choice: fc.ChunkSizeChoice,
    budget: int,
    batch_size: int,
    remainder: str = "overlap",
) -> None:
    """The chosen size fits (by the oracle) and the next size up does not."""
    k = choice.chunk_size
    assert choice.budget == budget
    assert bytes_at(k if k < batch_size else None) == choice.bytes <= budget
    up = next_size_up(batch_size, k, remainder)
    if up is not None:
        assert bytes_at(up if up < batch_size else None) > budget


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
    if bytes_at(None) > budget and bytes_at(1) > budget:
        with pytest.raises(ValueError, match=f"needs {bytes_at(1)} bytes"):
            program(*args)
        return
    assert tree_allclose(program(*args), expected, rtol=1e-4, atol=1e-5)
    (choice,) = choices
    check_largest(bytes_at, choice, budget, n)
    # Eagerly and under `jit` the same choice, from the cache: nothing compiled.
    with count_compiles() as compiles:
        jax.jit(program).lower(*args)
    assert compiles.count == 0
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
    if budget < smallest:
        with pytest.raises(ValueError, match="is too small for this call"):
            chunked(fc.MemoryBudget(budget))(tree, 2.0)
        return
    choice = fc.suggest_chunk_size(chunked(fc.MemoryBudget(budget)), tree, 2.0)
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
        rf"{output_bytes} bytes are outputs.* Give a budget of at least {needs} bytes"
    )
    with pytest.raises(ValueError, match=match):
        chunked(x)
    with pytest.raises(ValueError, match=match):
        eqx.filter_jit(chunked)(x)
    # At exactly that many bytes, one element per chunk is chosen.
    exact = fc.MemoryBudget(needs)
    assert fc.suggest_chunk_size(fc.filter_chunked_vmap(mlp, chunk_size=exact), x)
    choice = fc.suggest_chunk_size(fc.filter_chunked_vmap(mlp, chunk_size=exact), x)
    assert choice.chunk_size == 1 and choice.bytes == needs


def test_whole_batch_when_it_fits(getkey):
    mlp, x = _mlp_case(getkey)
    whole = compiled_bytes(fc.filter_chunked_vmap(mlp), x)
    chunked = fc.filter_chunked_vmap(mlp, chunk_size=fc.MemoryBudget(whole))
    choice = fc.suggest_chunk_size(chunked, x)
    assert choice.chunk_size == 40 and choice.tried == ((40, whole),)
    assert tree_allclose(chunked(x), jax.vmap(mlp)(x))


def test_repeated_calls_compile_nothing_for_the_search(getkey):
    # Shapes of its own: the cache is shared by every test in the process.
    mlp = eqx.nn.MLP(5, 2, 96, depth=1, key=getkey())
    x = jr.normal(getkey(), (48, 5))
    whole = compiled_bytes(fc.filter_chunked_vmap(mlp), x)
    chunked = fc.filter_chunked_vmap(mlp, chunk_size=fc.MemoryBudget(whole // 3))
    with count_compiles() as first:
        choice = fc.suggest_chunk_size(chunked, x)
    assert 3 <= first.count <= 8 and first.count == len(choice.tried)
    with count_compiles() as again:
        assert fc.suggest_chunk_size(chunked, x) == choice
    assert again.count == 0
    with count_compiles() as eager:
        out = chunked(x)
    assert eager.count == 1  # the call itself, chunked at the chosen size
    with count_compiles() as eager_again:
        chunked(x)
    assert eager_again.count == 0
    # Under `jit`: only the outer program is compiled.
    with count_compiles() as jitted:
        jax.jit(lambda _x: chunked(_x))(x)
    assert jitted.count == 1
    # A new wrapper of the same function shares the cache (it is keyed on the
    # traced program, not on the wrapper).
    with count_compiles() as rebuilt:
        same = fc.filter_chunked_vmap(mlp, chunk_size=fc.MemoryBudget(whole // 3))
        assert fc.suggest_chunk_size(same, x) == choice
    assert rebuilt.count == 0
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
    assert second.chunk_size < first.chunk_size
    assert (
        compiled_bytes(fc.filter_chunked_vmap(f, chunk_size=second.chunk_size), x)
        <= 2**18
    )
    assert tree_allclose(chunked(x), jax.vmap(f)(x))


def _apply_fun(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p) @ p.T


_JAC_CASES = (
    (fc.chunked_jacrev, jax.jacrev),
    (fc.chunked_jacfwd, jax.jacfwd),
)


@pytest.mark.parametrize("chunked, oracle", _JAC_CASES, ids=("jacrev", "jacfwd"))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_jacobians_fit_the_budget(chunked, oracle, remainder, choices, getkey):
    f = lambda p, x: jnp.tanh(jnp.outer(x @ p, x @ p)).ravel()
    p, x = jr.normal(getkey(), (4, 6)), jr.normal(getkey(), (4,))
    bytes_at = lambda k: compiled_bytes(  # noqa: E731
        chunked(f, chunk_size=k, remainder=remainder), p, x
    )
    total = 36 if chunked is fc.chunked_jacrev else 24
    budget = (bytes_at(1) + bytes_at(None)) // 2
    jacobian = chunked(f, chunk_size=fc.MemoryBudget(budget), remainder=remainder)
    assert tree_allclose(jacobian(p, x), oracle(f)(p, x))
    (choice,) = choices
    check_largest(bytes_at, choice, budget, total, remainder)


@pytest.mark.parametrize(
    "chunked, oracle",
    (
        (fc.filter_chunked_jacrev, eqx.filter_jacrev),
        (fc.filter_chunked_jacfwd, eqx.filter_jacfwd),
    ),
    ids=("jacrev", "jacfwd"),
)
def test_filtered_jacobians_fit_the_budget(chunked, oracle, choices, getkey):
    model = eqx.nn.Linear(8, 30, key=getkey())
    f = lambda m, x: jnp.tanh(m(x)) ** 2
    x = jr.normal(getkey(), (8,))
    bytes_at = lambda k: compiled_bytes(chunked(f, chunk_size=k), model, x)  # noqa: E731
    total = 30 if chunked is fc.filter_chunked_jacrev else 270
    budget = (bytes_at(1) + bytes_at(None)) // 2
    jacobian = chunked(f, chunk_size=fc.MemoryBudget(budget))
    assert tree_allclose(jacobian(model, x), oracle(f)(model, x))
    (choice,) = choices
    check_largest(bytes_at, choice, budget, total)
    assert fc.suggest_chunk_size(jacobian, model, x) == choice


def test_apply_fits_the_budget(choices, getkey):
    p, x = jr.normal(getkey(), (8, 128)), jr.normal(getkey(), (200, 8))
    bytes_at = lambda k: compiled_bytes(  # noqa: E731
        fc.filter_chunked_apply(_apply_fun, in_axes=(None, 0), chunk_size=k), p, x
    )
    budget = bytes_at(None) // 3
    chunked = fc.filter_chunked_apply(
        _apply_fun, in_axes=(None, 0), chunk_size=fc.MemoryBudget(budget)
    )
    assert tree_allclose(chunked(p, x), _apply_fun(p, x))
    (choice,) = choices
    check_largest(bytes_at, choice, budget, 200)
    structs = (
        jax.ShapeDtypeStruct(p.shape, p.dtype),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
    )
    assert fc.suggest_chunk_size(chunked, *structs) == choice


def test_under_grad_the_differentiated_program_fits(choices, getkey):
    p, x = jr.normal(getkey(), (8, 128)), jr.normal(getkey(), (200, 8))
    f = lambda p, x: jnp.tanh(x @ p) @ p.T
    mapped = lambda k: fc.filter_chunked_vmap(f, in_axes=(None, 0), chunk_size=k)  # noqa: E731
    bytes_at = lambda k: derivative_bytes(mapped(k), p, x)  # noqa: E731
    budget = bytes_at(None) // 4
    chunked = mapped(fc.MemoryBudget(budget))
    loss = lambda _p, g: jnp.sum(g(_p, x) ** 2)
    expected = jax.grad(loss)(p, jax.vmap(f, in_axes=(None, 0)))
    assert tree_allclose(jax.grad(loss)(p, chunked), expected, rtol=1e-4)
    (choice,) = choices
    check_largest(bytes_at, choice, budget, 200)
    # The forward program alone would allow a larger chunk.
    forward = fc.suggest_chunk_size(chunked, p, x)
    assert forward.chunk_size > choice.chunk_size
    assert tree_allclose(
        jax.jit(jax.grad(loss), static_argnums=1)(p, chunked), expected, rtol=1e-4
    )


def _issue_fun(x: Any) -> Any:
    # A `d x d` temporary per element, its output one row of it: non-linear.
    return jnp.tanh(jnp.outer(x, x)) @ x


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_grad_of_a_nonlinear_loss_fits(remainder, choices):
    # The cotangent of a real loss is not constant: the search must not let XLA
    # fold it away, as it would an all-ones cotangent (issue 14, item 1).
    xs = jr.normal(jr.key(0), (29, 48), jnp.float32)
    g = fc.filter_chunked_vmap(
        _issue_fun, chunk_size=fc.MemoryBudget(900_000), remainder=remainder
    )
    loss = lambda x: jnp.sum(g(x) ** 2)  # noqa: E731
    assert compiled_bytes(jax.grad(loss), xs) <= 900_000
    assert compiled_bytes(jax.value_and_grad(loss), xs) <= 900_000
    assert choices[0].chunk_size < 29
    expected = jax.grad(lambda x: jnp.sum(jax.vmap(_issue_fun)(x) ** 2))(xs)
    assert tree_allclose(jax.jit(jax.grad(loss))(xs), expected, rtol=1e-4)


def test_jvp_fits_or_the_budget_is_too_small():
    # Forward mode allocates the primal and the tangent outputs (issue 14, item 2).
    w = jnp.linspace(0, 1, 4096, dtype=jnp.float32)
    h = lambda x: jnp.tanh(x * w)  # noqa: E731
    xs = jnp.linspace(0, 1, 256, dtype=jnp.float32)
    ts = jnp.linspace(-1, 1, 256, dtype=jnp.float32)

    def jvp(budget: int) -> Callable[..., Any]:
        g = fc.filter_chunked_vmap(h, chunk_size=fc.MemoryBudget(budget))
        return lambda x, t: jax.jvp(g, (x,), (t,))

    # The two outputs alone are 8 MiB: a budget of 4.3 MB cannot be met.
    with pytest.raises(ValueError, match="is too small for this call"):
        jax.jit(jvp(4_300_000))(xs, ts)
    for budget in (8_500_000, 9_000_000):
        assert compiled_bytes(jvp(budget), xs, ts) <= budget
        expected = jax.jvp(jax.vmap(h), (xs,), (ts,))
        assert tree_allclose(jax.jit(jvp(budget))(xs, ts), expected)


@pytest.mark.parametrize("batch_size", (17, 30, 97))
def test_separate_remainder_chooses_the_largest_that_fits(batch_size):
    # Above half the batch, one chunk and the remainder are live at once: the
    # bytes jump and then fall, not affine in the size (issue 14, item 4).
    xs = jr.normal(jr.key(1), (batch_size, 64))

    def chunked(k: Any) -> Callable[..., Any]:
        return fc.filter_chunked_vmap(_issue_fun, chunk_size=k, remainder="separate")

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
    budgets = [measured[batch_size] - 1, measured[batch_size // 2] + 1]
    if exhaustive:
        budgets.append((measured[1] + measured[batch_size // 2]) // 2)
    for i, budget in enumerate(budgets):
        with count_compiles() as compiles:
            choice = fc.suggest_chunk_size(chunked(fc.MemoryBudget(budget)), xs)
        # Later budgets reuse the measurements of earlier ones.
        assert compiles.count <= len(choice.tried) <= MAX_COMPILATIONS
        assert i or compiles.count == len(choice.tried)
        largest = max(k for k, b in measured.items() if b <= budget)
        assert choice.chunk_size == largest and choice.bytes == measured[largest]


_ACTIVATIONS = (jnp.tanh, jnp.sin, jax.nn.softplus, jax.nn.silu)
_TRANSFORMS = (
    "grad",
    "value_and_grad",
    "vjp",
    "jvp",
    "linearize",
    "jacrev",
    "jacfwd",
    "hessian",
)


def _random_element(activations: tuple[int, ...]) -> Callable[..., Any]:
    a, b = (_ACTIVATIONS[i] for i in activations)

    def _element(p: Any, x: Any) -> Any:
        h = a(jnp.outer(x, x) @ p)  # a `width x width` temporary per element
        return b(h @ x + p[0]) * jnp.mean(p)

    return _element


def _user_program(transform: str, g: Callable[..., Any]) -> Callable[..., Any]:
    """The user's call of `transform` through the chunked map `g(p, xs)`; `v` is
    the cotangent (`vjp`) or the tangent (`jvp`, `linearize`) they give."""
    loss = lambda p, xs: jnp.sum(g(p, xs) ** 2)  # noqa: E731

    def _program(p: Any, xs: Any, v: Any) -> Any:
        of_p = lambda q: g(q, xs)  # noqa: E731
        if transform == "vjp":
            y, pullback = jax.vjp(of_p, p)
            return y, pullback(v)
        if transform == "jvp":
            return jax.jvp(of_p, (p,), (v,))
        if transform == "linearize":
            y, push = jax.linearize(of_p, p)
            return y, push(v)
        if transform == "jacfwd":
            return jax.jacfwd(of_p)(p)
        return getattr(jax, transform)(loss)(p, xs)

    return _program


# Each example compiles a dozen programs: two per transform and remainder. The
# case is drawn from the seed, so that even the first (seed 0) is a random one.
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("transform", _TRANSFORMS)
@settings(max_examples=2, phases=(Phase.explicit, Phase.generate))
@given(seed=st.integers(0, 2**32 - 1))
def test_every_transform_fits_the_budget(transform, remainder, seed):
    # The memory oracle is the user's own program, compiled with every value
    # they would vary (parameters, batch, cotangent, tangent) as an argument.
    combo = (_TRANSFORMS.index(transform), remainder == "separate")
    rng = np.random.default_rng([seed, *combo])
    batch_size, width = int(rng.integers(2, 25)), int(rng.integers(8, 17))
    where = float(rng.uniform())
    element = _random_element(tuple(rng.choice(len(_ACTIVATIONS), 2)))
    p = rng.standard_normal((width, width)).astype(np.float32)
    xs = rng.standard_normal((batch_size, width)).astype(np.float32)
    v = rng.standard_normal((batch_size, width) if transform == "vjp" else p.shape)
    v = v.astype(np.float32)

    def program(chunk_size: Any) -> Callable[..., Any]:
        g = fc.filter_chunked_vmap(
            element, in_axes=(None, 0), chunk_size=chunk_size, remainder=remainder
        )
        return _user_program(transform, g)

    with pytest.raises(ValueError, match="needs") as info:
        jax.jit(program(fc.MemoryBudget(1)))(p, xs, v)
    needs = int(re.search(r"needs (\d+) bytes", str(info.value)).group(1))  # pyright: ignore
    whole = compiled_bytes(program(None), p, xs, v)
    budget = int(needs + where * max(whole - needs, needs))
    compiled = jax.jit(program(fc.MemoryBudget(budget))).lower(p, xs, v).compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None
    # The budget bounds the chunked call; around it the user's program holds a
    # few scalars of its own (the loss, `jacrev`'s one-element basis).
    outside = 64
    assert (
        analysis.temp_size_in_bytes + analysis.output_size_in_bytes <= budget + outside
    )
    expected = jax.jit(_user_program(transform, jax.vmap(element, in_axes=(None, 0))))
    actual = compiled(p, xs, v)
    assert tree_allclose(actual, expected(p, xs, v), rtol=1e-4, atol=1e-5)


def test_under_jit_and_vmap(choices, getkey):
    x = jr.normal(getkey(), (3, 50, 16))
    f = lambda v: jnp.tanh(jnp.outer(v, v)) @ v
    budget = fc.MemoryBudget("64KiB")
    chunked = fc.filter_chunked_vmap(f, chunk_size=budget)
    expected = jax.vmap(jax.vmap(f))(x)
    assert tree_allclose(jax.jit(chunked)(x[0]), expected[0])
    # Under an outer `vmap` the budget holds per element of the outer map.
    assert tree_allclose(jax.vmap(chunked)(x), expected)
    assert choices[0] == choices[1]
    assert (
        compiled_bytes(
            fc.filter_chunked_vmap(f, chunk_size=choices[0].chunk_size), x[0]
        )
        <= 2**16
    )


def test_batch_that_cannot_be_chunked():
    chunked = fc.filter_chunked_vmap(jnp.sin, chunk_size="auto")
    assert tree_allclose(chunked(jnp.ones((0, 3))), jnp.sin(jnp.ones((0, 3))))
    with pytest.raises(ValueError, match="no batch to split"):
        fc.suggest_chunk_size(chunked, jnp.ones((0, 3)))
    nothing = fc.filter_chunked_vmap(lambda: 1.0, chunk_size="auto", axis_size=3)
    assert tree_allclose(nothing(), eqx.filter_vmap(lambda: 1.0, axis_size=3)())


def test_bound_method(getkey):
    class Model(eqx.Module):
        w: jax.Array

        @fc.filter_chunked_vmap(in_axes=(None, 0), chunk_size=fc.MemoryBudget("1MiB"))
        def __call__(self, x):
            return jnp.tanh(jnp.outer(x, self.w)) @ self.w

    model, x = Model(jr.normal(getkey(), (64,))), jr.normal(getkey(), (100, 8))
    assert tree_allclose(
        model(x), jax.vmap(lambda v: jnp.tanh(jnp.outer(v, model.w)) @ model.w)(x)
    )
    assert fc.suggest_chunk_size(model.__call__, x).bytes <= 2**20


@pytest.mark.parametrize(
    "size, expected",
    (
        ("4GiB", 4 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        (" 64 kib ", 64 * 1024),
        ("100", 100),
        ("12B", 12),
        (1024, 1024),
        (np.int64(2048), 2048),
    ),
)
def test_budget_formats(size, expected):
    budget = fc.MemoryBudget(size)
    assert budget.bytes == expected and budget.fraction is None
    assert budget.resolve() == expected
    assert repr(budget) == f"MemoryBudget({expected})"


def test_fractions_of_free_memory(monkeypatch):
    import filtered_chunk._budget as budget_module

    monkeypatch.setattr(budget_module, "available_bytes", lambda: 10 * 2**30)
    assert fc.MemoryBudget(0.5).resolve() == 5 * 2**30
    assert fc.MemoryBudget(1.0).resolve() == 10 * 2**30
    # "auto" is 80% of it, rounded down to 1/32 of a power of two.
    auto = fc.filter_chunked_vmap(jnp.sin, chunk_size="auto")._budget  # pyright: ignore
    assert auto == fc.MemoryBudget(0.8)
    assert 0.8 * 10 * 2**30 * (1 - 1 / 32) <= auto.resolve() <= 0.8 * 10 * 2**30
    # What a device or the system reports free is a positive number of bytes.
    monkeypatch.undo()
    assert fc.MemoryBudget(1.0).resolve() > 0


@pytest.mark.parametrize(
    "size, cls, match",
    (
        (0, ValueError, r"must be at least one byte, got 0"),
        (-5, ValueError, r"must be at least one byte, got -5"),
        ("0MiB", ValueError, r"must be at least one byte, got '0MiB'"),
        ("4 parsecs", ValueError, r"`MemoryBudget\('4 parsecs'\)`: a size string"),
        ("GiB", ValueError, r"a size string is a number and a unit"),
        ("", ValueError, r"a size string is a number and a unit"),
        (1.5, ValueError, r"must be in `\(0, 1\]`, got 1\.5\. Give a number of bytes"),
        (0.0, ValueError, r"must be in `\(0, 1\]`, got 0\.0"),
        (float("nan"), ValueError, r"must be in `\(0, 1\]`, got nan"),
        (True, TypeError, r"got bool object True"),
        (None, TypeError, r"got NoneType object None"),
        ([1], TypeError, r"got list object \[1\]"),
    ),
)
def test_bad_budgets(size, cls, match):
    with pytest.raises(cls, match=match):
        fc.MemoryBudget(size)


@pytest.mark.parametrize(
    "size, hint",
    (
        ("auto", r"write `chunk_size='auto'` \(or `MemoryBudget\(0\.8\)`\)\.$"),
        ("AUTO", r"write `chunk_size='auto'` \(or `MemoryBudget\(0\.8\)`\)\.$"),
        ("0.5", r"got '0\.5'\. For a fraction of .* `MemoryBudget\(0\.5\)`\.$"),
    ),
)
def test_bad_budget_hints(size, hint):
    with pytest.raises(ValueError, match=hint):
        fc.MemoryBudget(size)


@pytest.mark.parametrize("text", ("AUTO", " Auto ", "3", "4GiB", "512 MiB", "1.5GB"))
def test_chunk_size_hints_work(text):
    """Every `chunk_size=...` a message suggests builds a transform that runs."""
    with pytest.raises(ValueError) as info:
        fc.filter_chunked_vmap(jnp.sin, chunk_size=text)
    suggested = re.findall(r"`chunk_size=([^`]+)`", str(info.value))
    assert suggested, str(info.value)
    x = jnp.linspace(0.0, 1.0, 7)
    for code in suggested:
        chunk_size = eval(code, {"fc": fc})
        chunked = fc.filter_chunked_vmap(jnp.sin, chunk_size=chunk_size)
        assert tree_allclose(chunked(x), jax.vmap(jnp.sin)(x))


_BUILDERS = (
    fc.filter_chunked_vmap,
    fc.filter_chunked_apply,
    fc.chunked_jacrev,
    fc.chunked_jacfwd,
    fc.filter_chunked_jacrev,
    fc.filter_chunked_jacfwd,
)


@pytest.mark.parametrize("builder", _BUILDERS, ids=lambda b: b.__name__)
@pytest.mark.parametrize(
    "chunk_size, cls, match",
    (
        (
            2.5,
            TypeError,
            r"must be a positive integer, `None`, `'auto'` or a "
            r"`filtered_chunk.MemoryBudget`, got float object 2\.5\.",
        ),
        (np.float32(2.0), TypeError, r"got float32 object np\.float32\(2\.0\)\."),
        (True, ValueError, r"must be a positive integer or `None`, got True\."),
        (
            np.int64(0),
            ValueError,
            r"must be a positive integer or `None`, got np\.int64\(0\)\.",
        ),
        (
            "4GiB",
            ValueError,
            r"got '4GiB'\. For a memory budget write "
            r"`chunk_size=fc.MemoryBudget\('4GiB'\)`\.",
        ),
        (
            "AUTO",
            ValueError,
            r"got 'AUTO'\. Write `chunk_size='auto'` \(lower case\)\.$",
        ),
        (
            "3",
            ValueError,
            r"got '3'\. For chunks of 3 elements write `chunk_size=3`\.$",
        ),
        # No hint where nothing that works is likely meant.
        ("0", ValueError, r"got '0'\.$"),
        ("0MiB", ValueError, r"got '0MiB'\.$"),
        ("fast", ValueError, r"got 'fast'\.$"),
    ),
)
def test_bad_chunk_sizes(builder, chunk_size, cls, match):
    api = re.escape(f"`{builder.__name__}(..., chunk_size=...)`")
    with pytest.raises(cls, match=api + " .*" + match):
        builder(jnp.sin, chunk_size=chunk_size)
    with pytest.raises(cls, match=api):
        builder(chunk_size=chunk_size)(jnp.sin)


@pytest.mark.parametrize(
    "builder, oracle",
    (
        (fc.filter_chunked_vmap, jax.vmap(jnp.sin)),
        (fc.filter_chunked_apply, jnp.sin),
        (fc.chunked_jacrev, jax.jacrev(jnp.sin)),
        (fc.chunked_jacfwd, jax.jacfwd(jnp.sin)),
        (fc.filter_chunked_jacrev, eqx.filter_jacrev(jnp.sin)),
        (fc.filter_chunked_jacfwd, eqx.filter_jacfwd(jnp.sin)),
    ),
    ids=lambda b: getattr(b, "__name__", ""),
)
@pytest.mark.parametrize(
    "chunk_size", (np.int64(3), np.int32(3), jnp.int32(3), np.uint8(3)), ids=str
)
def test_integer_scalars_as_chunk_size(builder, oracle, chunk_size, getkey):
    x = jr.normal(getkey(), (7,))
    chunked = builder(jnp.sin, chunk_size=chunk_size)
    assert tree_allclose(chunked(x), oracle(x))
    assert (
        type(
            chunked._options.chunk_size
            if hasattr(chunked, "_options")
            else chunked._chunk_size
        )
        is int
    )  # pyright: ignore


def test_suggest_needs_a_budget():
    with pytest.raises(
        TypeError,
        match=r"`suggest_chunk_size\(fun, \.\.\.\)` takes a chunked transform "
        r"built with a memory budget",
    ):
        fc.suggest_chunk_size(
            fc.filter_chunked_vmap(jnp.sin, chunk_size=4), jnp.ones(8)
        )
    with pytest.raises(TypeError, match="takes a chunked transform"):
        fc.suggest_chunk_size(jnp.sin, jnp.ones(8))
