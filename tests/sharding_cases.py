"""Chunking a batch sharded over 8 simulated CPU devices.

Not collected by itself: `test_sharding.py` runs this file in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`, since the flag must be set
before JAX starts. Every value is checked against `eqx.filter_vmap`, every output's
sharding against the input's, and the compiled programs for collectives.
"""

import re
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import filtered_chunk as fc

from .helpers import tree_allclose
from .meters import check_one_call, recorder


if jax.device_count() < 8:
    pytest.skip(
        "needs 8 devices: run through `tests/test_sharding.py`",
        allow_module_level=True,
    )

COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-gather|all-reduce|all-to-all|reduce-scatter|"
    r"collective-permute)(?:-start)?\("
)
AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit


def collectives(fn: Any, *args: Any) -> list[tuple[str, str]]:
    """`(shape, op)` of each collective in the compiled program of `jit(fn)`."""
    return COLLECTIVE.findall(jax.jit(fn).lower(*args).compile().as_text() or "")


def size(shape: str) -> int:
    """The number of elements of an HLO shape: `f64[1,4]{1,0}`, or a tuple."""
    arrays = re.findall(r"\[([\d,]*)\]", shape)
    return sum(int(np.prod([int(d) for d in a.split(",") if d])) for a in arrays)


def mesh_1d(axis_type: AxisType = AUTO) -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("batch",), axis_types=(axis_type,))


def mesh_2d(axis_type: AxisType = AUTO) -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def put(x: Any, mesh: jax.sharding.Mesh, *spec: Any) -> Any:
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def same(actual: Any, expected: Any) -> bool:
    return tree_allclose(jax.device_get(actual), jax.device_get(expected))


def split_like(x: jax.Array, mesh: jax.sharding.Mesh, *spec: Any) -> bool:
    return x.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), x.ndim)


def outer(w, x):
    return jnp.outer(x, w), w * 2, "static"


OUTER_AXES: dict[str, Any] = dict(in_axes=(None, 0), out_axes=(1, None, None))


@pytest.mark.parametrize("chunk_size", (2, 5, 16))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_concrete_sharding_is_detected(chunk_size, remainder, getkey):
    # 40 elements on 8 devices: 5 per device, so chunks of 2 leave a remainder of 1
    # on every device, 5 is exact, and 16 does not chunk the shard.
    mesh = mesh_1d()
    x = put(jr.normal(getkey(), (40, 3)), mesh, "batch")
    w = jr.normal(getkey(), (4,))
    expected = eqx.filter_vmap(outer, **OUTER_AXES)(w, x)
    actual = fc.filter_chunked_vmap(
        outer, chunk_size=chunk_size, remainder=remainder, **OUTER_AXES
    )(w, x)
    assert same(actual, expected)
    assert split_like(actual[0], mesh, None, "batch")
    assert actual[1].sharding.is_fully_replicated


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_chunk_size_counts_elements_per_device(remainder):
    mesh = mesh_1d(EXPLICIT)
    x = put(jnp.ones((40, 3)), mesh, "batch")
    chunked = fc.filter_chunked_vmap(jnp.sin, chunk_size=2, remainder=remainder)
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(chunked)(x))
    # 5 elements per device: 3 steps with an overlapping last chunk, or 2 steps
    # and a remainder of 1 (a loop of one step).
    assert "shard_map" in jaxpr
    lengths = re.findall(r"length=(\d+)", jaxpr)
    assert lengths == (["3"] if remainder == "overlap" else ["2", "1"])


def test_explicit_mode_is_detected_under_jit(getkey):
    mesh = mesh_1d(EXPLICIT)
    x = put(jr.normal(getkey(), (64, 3)), mesh, "batch")
    w = put(jr.normal(getkey(), (4,)), mesh)
    chunked = fc.filter_chunked_vmap(outer, chunk_size=3, **OUTER_AXES)
    expected = eqx.filter_vmap(outer, **OUTER_AXES)(np.asarray(w), np.asarray(x))
    with jax.set_mesh(mesh):
        actual = eqx.filter_jit(chunked)(w, x)
        assert collectives(lambda w, x: chunked(w, x)[:2], w, x) == []
    assert same(actual, expected)
    assert split_like(actual[0], mesh, None, "batch")


def test_spmd_axis_name_under_jit_in_auto_mode(getkey):
    mesh = mesh_1d(AUTO)
    x = put(jr.normal(getkey(), (64, 3)), mesh, "batch")
    w = jr.normal(getkey(), (4,))
    named = fc.filter_chunked_vmap(
        outer, chunk_size=3, spmd_axis_name="batch", **OUTER_AXES
    )
    unnamed = fc.filter_chunked_vmap(outer, chunk_size=3, **OUTER_AXES)
    expected = eqx.filter_vmap(outer, **OUTER_AXES)(w, x)
    with jax.set_mesh(mesh):
        actual = eqx.filter_jit(named)(w, x)
        assert collectives(lambda w, x: named(w, x)[:2], w, x) == []
        # Without the name the sharding is invisible under `jit`: still right.
        assert same(eqx.filter_jit(unnamed)(w, x), expected)
    assert same(actual, expected)
    assert split_like(actual[0], mesh, None, "batch")


def test_spmd_axis_name_splits_a_replicated_batch(getkey):
    mesh = mesh_1d(AUTO)
    x = jr.normal(getkey(), (64, 3))
    chunked = fc.filter_chunked_vmap(jnp.sin, chunk_size=3, spmd_axis_name="batch")
    with jax.set_mesh(mesh):
        actual = jax.jit(chunked)(x)
    assert same(actual, jnp.sin(x))
    assert split_like(actual, mesh, "batch")


def loss(chunked: Any) -> Any:
    return lambda w, x: jnp.sum(chunked(w, x)[0] ** 2)


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
def test_gradient_reduces_unmapped_inputs_once(axis_type, getkey):
    mesh = mesh_1d(axis_type)
    x = put(jr.normal(getkey(), (64, 3)), mesh, "batch")
    w = put(jr.normal(getkey(), (4,)), mesh)
    chunked = fc.filter_chunked_vmap(
        outer, chunk_size=3, spmd_axis_name="batch", **OUTER_AXES
    )
    oracle = eqx.filter_vmap(outer, **OUTER_AXES)
    expected = jax.grad(loss(oracle), argnums=(0, 1))(np.asarray(w), np.asarray(x))
    grad = jax.grad(loss(chunked), argnums=(0, 1))
    with jax.set_mesh(mesh):
        actual = jax.jit(grad)(w, x)
        found = collectives(grad, w, x)
    assert same(actual, expected)  # not multiplied by the number of devices
    assert split_like(actual[1], mesh, "batch")
    # The only collective sums `w`'s cotangent over the devices.
    assert [(op, size(shape)) for shape, op in found] == [("all-reduce", 4)]


def test_gradient_memory_is_bounded(getkey):
    mesh = mesh_1d(AUTO)
    x = put(jr.normal(getkey(), (8 * 256, 16)), mesh, "batch")
    w = jr.normal(getkey(), (16, 128))
    f = lambda w, x: jnp.tanh(x @ w).sum()
    chunked = fc.filter_chunked_vmap(
        f, in_axes=(None, 0), chunk_size=8, spmd_axis_name="batch"
    )
    vmapped = jax.vmap(f, in_axes=(None, 0))

    def temp_bytes(fn: Any) -> int:
        grad = jax.grad(lambda w, x: fn(w, x).sum())
        with jax.set_mesh(mesh):
            compiled = jax.jit(grad).lower(w, x).compile()
        analysis = compiled.memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes

    # Per device, `vmap` keeps 256 x 128 activations; chunks keep 8 x 128.
    assert temp_bytes(chunked) < temp_bytes(vmapped) / 4


def test_memory_budget_is_per_device(getkey):
    mesh = mesh_1d()
    x = put(jr.normal(getkey(), (8 * 64, 32)), mesh, "batch")
    f = lambda v: jnp.tanh(jnp.outer(v, v)) @ v

    def bytes_at(k: Any) -> int:
        chunked = fc.filter_chunked_vmap(f, chunk_size=k, spmd_axis_name="batch")
        with jax.set_mesh(mesh):
            analysis = jax.jit(chunked).lower(x).compile().memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes + analysis.output_size_in_bytes

    # Between one element per chunk and the whole shard of 64, per device.
    budget = (bytes_at(1) + bytes_at(None)) // 2
    chunked = fc.filter_chunked_vmap(f, chunk_size=fc.MemoryBudget(budget))
    choice = fc.suggest_chunk_size(chunked, x)
    assert 1 < choice.chunk_size < 64 and choice.budget == budget
    assert bytes_at(choice.chunk_size) <= budget
    actual = chunked(x)
    assert same(actual, jax.vmap(f)(x))
    assert split_like(actual, mesh, "batch")
    # Timed: every size timed fits per device, on the sharded batch itself.
    tuned = fc.filter_chunked_vmap(f, chunk_size=fc.MemoryBudget(budget, tune=True))
    choice = fc.suggest_chunk_size(tuned, x)
    assert choice.model == "timed" and choice.times
    assert all(bytes_at(k if k < 64 else None) <= budget for k, _ in choice.times)
    actual = tuned(x)
    assert same(actual, jax.vmap(f)(x))
    assert split_like(actual, mesh, "batch")


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
def test_reported_size_of_a_sharded_training_step(axis_type, getkey):
    # `fc.suggest_chunk_sizes` of the jitted gradient on a sharded batch: the
    # size per device that the step runs, whose program fits the budget.
    mesh = mesh_1d(axis_type)
    x = put(jr.normal(getkey(), (8 * 64, 32)), mesh, "batch")
    w = put(jr.normal(getkey(), (32, 32)) / 6, mesh)
    f = lambda _w, v: jnp.tanh(jnp.outer(v, v) @ _w) @ v

    def step(k: Any) -> Any:
        chunked = fc.filter_chunked_vmap(
            f, in_axes=(None, 0), chunk_size=k, spmd_axis_name="batch"
        )
        return jax.jit(jax.grad(lambda _w, _x: jnp.sum(chunked(_w, _x) ** 2)))

    def bytes_at(k: Any) -> int:
        with jax.set_mesh(mesh):
            analysis = step(k).lower(w, x).compile().memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes + analysis.output_size_in_bytes

    budget = (bytes_at(1) + bytes_at(None)) // 2
    budgeted = step(fc.MemoryBudget(budget, tune=False))
    with jax.set_mesh(mesh):
        (choice,) = fc.suggest_chunk_sizes(budgeted, w, x)
        actual = budgeted(w, x)
    assert 1 < choice.chunk_size < 64 and choice.budget == budget
    assert bytes_at(choice.chunk_size) <= budget
    expected = jax.grad(lambda _w, _x: jnp.sum(jax.vmap(f, (None, 0))(_w, _x) ** 2))(
        np.asarray(w), np.asarray(x)
    )
    assert same(actual, expected)


def test_budget_under_jit_without_a_mesh_set(getkey):
    # In explicit mode, tracers of arrays on a mesh carry its abstract mesh, and
    # so does every operation traced on them: the budget's programs, compiled
    # alone, are put on devices of that shape (under `jax.jit` without
    # `jax.set_mesh` this once raised "only AbstractMesh exists in a jitted
    # computation"). In auto mode the split is not seen under `jit` without a
    # mesh set: `spmd_axis_name` needs `jax.set_mesh` (see the docs).
    mesh = mesh_1d(EXPLICIT)
    x = put(jr.normal(getkey(), (8 * 64, 32)), mesh, "batch")
    w = put(jr.normal(getkey(), (32, 32)) / 6, mesh)
    f = lambda _w, v: jnp.tanh(jnp.outer(v, v) @ _w) @ v
    loss = lambda run: lambda _w, _x: jnp.sum(run(_w, _x) ** 2)
    whole = jax.jit(jax.grad(loss(jax.vmap(f, (None, 0))))).lower(w, x).compile()
    analysis = whole.memory_analysis()
    assert analysis is not None
    budget = (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) // 4
    chunked = fc.filter_chunked_vmap(
        f, in_axes=(None, 0), chunk_size=fc.MemoryBudget(budget, tune=False)
    )
    for step in (jax.jit(chunked), jax.jit(jax.grad(loss(chunked)))):
        (choice,) = fc.suggest_chunk_sizes(step, w, x)
        assert choice.bytes <= budget
    expected = jax.vmap(f, (None, 0))(np.asarray(w), np.asarray(x))
    assert same(jax.jit(chunked)(w, x), expected)
    expected = jax.grad(loss(jax.vmap(f, (None, 0))))(np.asarray(w), np.asarray(x))
    assert same(jax.jit(jax.grad(loss(chunked)))(w, x), expected)


def _conv(w, x):
    # Equinox's layout, channels first; its loop binds it in XLA's CPU layout.
    return jnp.tanh(jax.lax.conv_general_dilated(x[None], w, (1, 1), "SAME")[0])


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
def test_convolution_gradient_on_a_sharded_batch(axis_type, getkey):
    mesh = mesh_1d(axis_type)
    x = put(jr.normal(getkey(), (16, 2, 5, 5)), mesh, "batch")
    w = put(jr.normal(getkey(), (3, 2, 3, 3)), mesh)
    chunked = fc.filter_chunked_vmap(
        _conv, in_axes=(None, 0), chunk_size=1, spmd_axis_name="batch"
    )
    oracle = eqx.filter_vmap(_conv, in_axes=(None, 0))
    grad = lambda f: jax.grad(lambda _w, _x: jnp.sum(f(_w, _x) ** 2), (0, 1))  # noqa: E731
    expected = grad(oracle)(np.asarray(w), np.asarray(x))
    with jax.set_mesh(mesh):
        actual = jax.jit(grad(chunked))(w, x)
    assert same(actual, expected)
    assert split_like(actual[1], mesh, "batch")


def mlp(w, x):
    return jnp.tanh(x @ w)


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
def test_two_dimensional_mesh(axis_type, getkey):
    mesh = mesh_2d(axis_type)
    x = put(jr.normal(getkey(), (32, 6)), mesh, "data")
    w = put(jr.normal(getkey(), (6, 4)), mesh, None, "model")
    chunked = fc.filter_chunked_vmap(
        mlp, in_axes=(None, 0), chunk_size=3, spmd_axis_name="data"
    )
    expected = jax.vmap(mlp, in_axes=(None, 0))(np.asarray(w), np.asarray(x))
    grad = jax.grad(lambda w, x: chunked(w, x).sum())
    expected_grad = jax.grad(lambda w, x: mlp(w, x).sum())(np.asarray(w), np.asarray(x))
    with jax.set_mesh(mesh):
        actual = jax.jit(chunked)(w, x)
        assert collectives(chunked, w, x) == []
        actual_grad = jax.jit(grad)(w, x)
        # The gradient sums `w`'s cotangent, each device its `model` half of it.
        found = collectives(grad, w, x)
    assert [(op, size(shape)) for shape, op in found] == [("all-reduce", 12)]
    assert same(actual, expected)
    assert split_like(actual, mesh, "data", "model")
    assert same(actual_grad, expected_grad)
    assert split_like(actual_grad, mesh, None, "model")


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
def test_batch_split_over_two_mesh_axes(axis_type, getkey):
    mesh = mesh_2d(axis_type)
    x = put(jr.normal(getkey(), (32, 6)), mesh, ("data", "model"))
    w = jr.normal(getkey(), (6, 4))
    chunked = fc.filter_chunked_vmap(mlp, in_axes=(None, 0), chunk_size=3)
    expected = jax.vmap(mlp, in_axes=(None, 0))(w, np.asarray(x))
    assert same(chunked(w, x), expected)  # detected outside `jit`
    named = fc.filter_chunked_vmap(
        mlp, in_axes=(None, 0), chunk_size=3, spmd_axis_name=("data", "model")
    )
    with jax.set_mesh(mesh):
        actual = jax.jit(named)(w, x)
        assert collectives(named, w, x) == []
    assert same(actual, expected)
    assert split_like(actual, mesh, ("data", "model"))


def test_nested_vmap(getkey):
    mesh = mesh_1d(EXPLICIT)
    x = put(jr.normal(getkey(), (3, 64, 2)), mesh, None, "batch")
    f = lambda x: jnp.sin(x).sum()
    chunked = jax.vmap(fc.filter_chunked_vmap(f, chunk_size=3))
    with jax.set_mesh(mesh):
        actual = jax.jit(chunked)(x)
        assert collectives(chunked, x) == []
    assert same(actual, jax.vmap(jax.vmap(f))(np.asarray(x)))
    assert split_like(actual, mesh, None, "batch")


def test_module_ensemble(getkey):
    mesh = mesh_1d(AUTO)
    make = lambda key: eqx.nn.MLP(3, 2, 8, 1, key=key)
    models = eqx.filter_vmap(make)(jr.split(getkey(), 16))
    models = eqx.filter_shard(models, NamedSharding(mesh, P("batch")))
    x = jr.normal(getkey(), (5, 3))
    call = lambda model, x: jax.vmap(model)(x)
    in_axes = (eqx.if_array(0), None)
    oracle = eqx.filter_jit(eqx.filter_vmap(call, in_axes=in_axes))
    chunked = fc.filter_chunked_vmap(call, in_axes=in_axes, chunk_size=1)
    actual = chunked(models, x)
    assert same(actual, oracle(models, x))
    assert split_like(actual, mesh, "batch")
    grad = lambda fn: eqx.filter_grad(lambda m, x: jnp.sum(fn(m, x) ** 2))
    named = fc.filter_chunked_vmap(
        call, in_axes=in_axes, chunk_size=1, spmd_axis_name="batch"
    )
    actual_grad = eqx.filter_jit(grad(named))(models, x)
    assert same(actual_grad, eqx.filter_jit(grad(oracle))(models, x))
    assert split_like(actual_grad.layers[0].weight, mesh, "batch")


def test_unmapped_input_split_over_the_batch_axis(getkey):
    # Each device needs all of `w`: it is gathered (not the batch), and the
    # gradient comes back split as `w` was.
    mesh = mesh_1d(EXPLICIT)
    x = put(jr.normal(getkey(), (64, 3)), mesh, "batch")
    w = put(jr.normal(getkey(), (8, 3)), mesh, "batch")
    f = lambda w, x: (w @ x).sum()
    chunked = fc.filter_chunked_vmap(f, in_axes=(None, 0), chunk_size=3)
    oracle = jax.vmap(f, in_axes=(None, 0))
    args = (np.asarray(w), np.asarray(x))
    with jax.set_mesh(mesh):
        actual = jax.jit(chunked)(w, x)
        actual_grad = jax.jit(jax.grad(lambda w, x: chunked(w, x).sum()))(w, x)
    assert same(actual, oracle(*args))
    assert same(actual_grad, jax.grad(lambda w, x: oracle(w, x).sum())(*args))


def _rows(w, x):
    return jnp.tanh(x @ w), jnp.outer(x, w), w.sum() * 2


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
@pytest.mark.parametrize(
    "batch, chunk_size, remainder",
    (
        (1001, 16, "overlap"),
        (1001, 125, "separate"),
        (3, 2, "overlap"),
        (9, None, "overlap"),
    ),
)
def test_batch_the_mesh_does_not_divide(axis_type, batch, chunk_size, remainder):
    # Padded to a multiple of 8 devices, the padding skipped: `jax.vmap`'s values,
    # shardings and gradients.
    mesh = mesh_1d(axis_type)
    x = np.random.RandomState(0).randn(batch, 3).astype(np.float32)
    w = np.linspace(-1.0, 1.0, 3, dtype=np.float32)
    axes: dict[str, Any] = dict(in_axes=(None, 0), out_axes=(0, 2, None))
    meter = recorder()
    chunked, metered = (
        fc.filter_chunked_vmap(
            _rows,
            chunk_size=chunk_size,
            remainder=remainder,
            spmd_axis_name="batch",
            progress_meter=m,
            **axes,
        )
        for m in (None, meter)
    )
    oracle = jax.vmap(_rows, spmd_axis_name="batch", **axes)
    grad = lambda f: jax.grad(lambda w, x: f(w, x)[0].sum(), argnums=(0, 1))  # noqa: E731
    with jax.set_mesh(mesh):
        actual, expected = jax.jit(chunked)(w, x), jax.jit(oracle)(w, x)
        # The meter counts the elements, not the padding.
        jax.block_until_ready(jax.jit(metered)(w, x))
        if chunk_size is not None and chunk_size < -(-batch // 8):  # a loop
            check_one_call(meter, "filter_chunked_vmap", batch)
        actual_grad = jax.jit(grad(chunked))(w, x)
        expected_grad = jax.jit(grad(oracle))(w, x)
        valid = jax.jit(lambda w, x: chunked.valid(batch // 2)(w, x))(w, x)
        # Eager, on an array on one device: its cotangent comes back replicated.
        eager_grad = grad(chunked)(w, jnp.asarray(x))
    assert same(actual, expected)
    for a, e in zip(actual, expected):
        assert a.sharding.is_equivalent_to(e.sharding, a.ndim), (a.sharding, e.sharding)
    assert same(actual_grad, expected_grad)
    assert same(eager_grad, expected_grad)
    assert same(valid[0][: batch // 2], expected[0][: batch // 2])
    assert not np.asarray(valid[0][batch // 2 :]).any()


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
@pytest.mark.parametrize("chunk_size", (3, None))
def test_spmd_axis_name_with_inputs_off_the_mesh(axis_type, chunk_size):
    # A NumPy array and an array on one device, split by `spmd_axis_name` alone;
    # eager and jitted, with and without `valid`.
    x = np.random.RandomState(0).randn(64, 3).astype(np.float32)
    w = np.linspace(-1.0, 1.0, 3, dtype=np.float32)
    chunked = fc.filter_chunked_vmap(
        _rows,
        in_axes=(None, 0),
        out_axes=(0, 2, None),
        chunk_size=chunk_size,
        spmd_axis_name="batch",
    )
    expected = jax.vmap(_rows, in_axes=(None, 0), out_axes=(0, 2, None))(w, x)
    with jax.set_mesh(mesh_1d(axis_type)):
        for xs in (x, jnp.asarray(x)):
            assert same(chunked(w, xs), expected)
            assert same(jax.jit(chunked)(w, xs), expected)
            out = np.asarray(chunked.valid(20)(w, xs)[0])
            assert same(out[:20], expected[0][:20]) and not out[20:].any()


def _weighted(w, x):
    return x * w, jnp.sum(x * w)


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
@pytest.mark.parametrize("batch, valid", ((13, None), (64, "mask"), (13, "mask")))
def test_sum_match_with_padding_or_a_mask(axis_type, batch, valid):
    # The sums accumulated on each device, over the elements only.
    x = np.random.RandomState(0).randn(batch, 2).astype(np.float32)
    w = np.array([1.5, -2.0], np.float32)
    mask = np.arange(batch) % 3 == 0 if valid else np.ones(batch, bool)
    chunked = fc.filter_chunked_vmap(
        _weighted,
        in_axes=(None, 0),
        out_axes=(0, None),
        chunk_size=1,
        spmd_axis_name="batch",
        sum_match=True,
    )
    call = chunked.valid(mask=mask) if valid else chunked
    with jax.set_mesh(mesh_1d(axis_type)):
        rows, total = eqx.filter_jit(call)(w, x)
        grad = jax.jit(jax.grad(lambda w: call(w, x)[1]))(w)
    assert same(np.asarray(rows)[mask], x[mask] * w)
    assert not np.asarray(rows)[~mask].any()
    assert same(total, np.sum(x[mask] * w))
    assert same(grad, x[mask].sum(0))


def test_progress_of_a_call_inside_a_sharded_batch():
    # The inner call maps 6 elements per element of the outer batch: its meter
    # counts 6, not 6 times the outer batch's devices.
    meter = recorder("inner")
    inner = fc.filter_chunked_vmap(lambda y: y * 2, chunk_size=2, progress_meter=meter)
    outer = fc.filter_chunked_vmap(inner, chunk_size=4, spmd_axis_name="batch")
    with jax.set_mesh(mesh_1d(AUTO)):
        jax.block_until_ready(jax.jit(outer)(jnp.ones((16, 6))))
    opens = [e for e in meter.events if e[0] == "open"]
    assert opens and all(e == ("open", "inner", 6) for e in opens), meter.events


def test_batch_the_mesh_does_not_divide_with_staged_collectives_raises():
    def normalised(x):
        return x - lax.pmean(x, "i")

    chunked = fc.filter_chunked_vmap(
        normalised, chunk_size=3, axis_name="i", spmd_axis_name="batch"
    )
    with jax.set_mesh(mesh_1d(AUTO)), pytest.raises(ValueError, match="multiple of 8"):
        jax.jit(chunked)(jnp.ones((10, 2)))


def test_batches_split_over_different_axes_raise():
    mesh = mesh_2d(EXPLICIT)
    x, y = put(jnp.ones((8, 2)), mesh, "data"), put(jnp.ones((8, 2)), mesh, "model")
    chunked = fc.filter_chunked_vmap(jnp.add, chunk_size=2)
    with pytest.raises(ValueError, match="split over different mesh axes"):
        chunked(x, y)
    named = fc.filter_chunked_vmap(jnp.add, chunk_size=2, spmd_axis_name="model")
    with pytest.raises(ValueError, match="split over different mesh axes"):
        named(x, x)


def test_unknown_mesh_axis_raises():
    x = put(jnp.ones((8, 2)), mesh_1d(), "batch")
    chunked = fc.filter_chunked_vmap(jnp.sin, chunk_size=2, spmd_axis_name="rows")
    with pytest.raises(ValueError, match="not axes of the mesh"):
        chunked(x)


def test_spmd_axis_name_without_a_mesh_raises():
    chunked = fc.filter_chunked_vmap(jnp.sin, chunk_size=2, spmd_axis_name="batch")
    with pytest.raises(ValueError, match="needs a mesh"):
        jax.jit(chunked)(np.ones((8, 2)))


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
@pytest.mark.parametrize("chunk_size", (None, 16, 32))
def test_collective_over_axis_name_with_one_chunk(axis_type, chunk_size, getkey):
    # `chunk_size=None`: one `vmap` of the whole batch, as `eqx.filter_vmap`, with
    # the collective across devices. A chunk size of at least the shard stages
    # each device's shard in one chunk.
    mesh = mesh_1d(axis_type)
    x = put(jr.normal(getkey(), (16, 2)), mesh, "batch")
    index = lambda: jax.lax.axis_index("i").astype(jnp.float64)
    normalise = lambda x: x / jax.lax.psum(x, "i") + index()
    oracle = eqx.filter_vmap(normalise, axis_name="i")
    chunked = fc.filter_chunked_vmap(normalise, axis_name="i", chunk_size=chunk_size)
    grad = lambda m: jax.grad(lambda x: jnp.sum(jnp.sin(m(x))))(x)
    with jax.set_mesh(mesh):
        expected = oracle(x)
        assert tree_allclose(chunked(x), expected)
        assert tree_allclose(grad(chunked), grad(oracle))
        try:  # jax 0.10 cannot lower this `vmap` under `jit` in explicit mode
            jitted = eqx.filter_jit(oracle)(x)
        except ValueError as e:
            if chunk_size is None:
                with pytest.raises(type(e)):
                    jax.jit(chunked)(x)
            else:  # the staged program is no `vmap` of the batch
                assert tree_allclose(jax.jit(chunked)(x), expected)
        else:
            assert tree_allclose(jax.jit(chunked)(x), jitted)


@pytest.mark.parametrize("chunk_size", (1, 2, 8))
def test_collective_over_axis_name_is_exact_when_chunked(chunk_size):
    # 2 elements per device: in chunks of 1 each device stages its shard; in
    # chunks of 2 or more the whole batch is one `vmap`, as `eqx.filter_vmap`.
    mesh = mesh_1d(EXPLICIT)
    x = put(jnp.arange(1.0, 17.0), mesh, "batch")
    normalise = lambda x: x / jax.lax.psum(x, "i")
    chunked = fc.filter_chunked_vmap(normalise, axis_name="i", chunk_size=chunk_size)
    with jax.set_mesh(mesh):
        out = chunked(x)
    assert same(out, np.arange(1.0, 17.0) / np.sum(np.arange(1.0, 17.0)))
    assert split_like(out, mesh, "batch")


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_progress_one_meter_for_the_global_batch(remainder, axis_type, getkey):
    # 5 elements per device in chunks of 2: every device reports the same counts,
    # so the first device's, scaled by 8, count the global batch of 40.
    meter = recorder()
    mesh = mesh_1d(axis_type)
    x = put(jr.normal(getkey(), (40, 3)), mesh, "batch")
    chunked = fc.filter_chunked_vmap(
        jnp.sin, chunk_size=2, remainder=remainder, progress_meter=meter
    )
    with jax.set_mesh(mesh):
        assert same(chunked(x), jnp.sin(np.asarray(x)))
        check_one_call(meter, "filter_chunked_vmap", 40)
        assert meter.counts() == ([16, 32, 40] if remainder == "overlap" else [16, 40])
        loss = lambda x: jnp.sum(chunked(x) ** 2)
        grad = eqx.filter_jit(jax.grad(loss))(x)
    assert same(grad, jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(np.asarray(x)))
    check_one_call(meter, "filter_chunked_vmap", 40, calls=2)


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
def test_progress_on_a_two_dimensional_mesh(axis_type, getkey):
    # Manual over "data" only: the callback runs once per "data" device. 500
    # elements per device in chunks of 2 are 250 steps, reported every 3rd.
    meter = recorder()
    mesh = mesh_2d(axis_type)
    x = put(jr.normal(getkey(), (2000, 4)), mesh, "data", "model")
    named = fc.filter_chunked_vmap(
        jnp.sin, chunk_size=2, spmd_axis_name="data", progress_meter=meter
    )
    loss = lambda x: jnp.sum(named(x) ** 2)
    with jax.set_mesh(mesh):
        assert same(eqx.filter_jit(named)(x), jnp.sin(np.asarray(x)))
        grad = eqx.filter_jit(jax.grad(loss))(x)
    assert same(grad, jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(np.asarray(x)))
    check_one_call(meter, "filter_chunked_vmap", 2000, calls=2)
    expected = [*range(8, 2000, 24), 2000]
    assert meter.counts() == expected * 2


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("chunk_size", (2, None))
def test_traces_of_fun(remainder, chunk_size):
    # One trace for the outputs' shapes, then the per-device loop's (two chunk
    # sizes with a separate remainder: 5 elements per device in chunks of 2).
    mesh = mesh_1d(EXPLICIT)
    x = put(jnp.ones((40, 2)), mesh, "batch")
    traces = []

    def f(e):
        traces.append(None)
        return jnp.sin(e)

    kwargs: dict[str, Any] = dict(chunk_size=chunk_size, remainder=remainder)
    with jax.set_mesh(mesh):
        out = jax.jit(fc.filter_chunked_vmap(f, **kwargs))(x)
    assert tree_allclose(out, eqx.filter_vmap(jnp.sin)(x))
    separate = remainder == "separate" and chunk_size is not None
    assert len(traces) == (3 if separate else 2)


def _every_collective(w, x):
    n = jax.lax.axis_size("i")
    mean = jax.lax.pmean(x * w, "i")
    var = jax.lax.pmean((x - mean) ** 2, "i")
    top = jax.lax.pmax(jax.lax.stop_gradient(x), "i")
    index = jax.lax.axis_index("i").astype(x.dtype)
    gathered = jax.lax.all_gather(x, "i").sum(0)
    shifted = jax.lax.ppermute(x, "i", [(j, (j + 3) % n) for j in range(n)])
    normed = (x - mean) * jax.lax.rsqrt(var + 1.0)
    return normed + jnp.exp(x - top) * index / n + gathered + shifted * w, mean


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
@pytest.mark.parametrize("mesh_of", (mesh_1d, mesh_2d))
@pytest.mark.parametrize("chunk_size, remainder", ((2, "overlap"), (2, "separate")))
def test_collectives_staged_per_device(axis_type, mesh_of, chunk_size, remainder):
    # Each device stages its own 5 elements in chunks of 2; every pass's
    # accumulators are combined across the devices. Values and gradients (w.r.t.
    # the unmapped `w` and the mapped `x`) are `eqx.filter_vmap`'s on the whole,
    # unsharded batch; the mapped output stays split like the batch.
    _check_staged_per_device(axis_type, mesh_of, chunk_size, remainder)


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
@pytest.mark.parametrize("remainder, keep", (("overlap", True), ("separate", 2)))
def test_kept_boundaries_per_device(axis_type, remainder, keep):
    # With the stage boundaries kept (every pass's, or every second pass's), each
    # device writes and reads its own shard's buffers: the same values and
    # gradients.
    _check_staged_per_device(axis_type, mesh_1d, 2, remainder, keep_boundaries=keep)


def _normalised(w, x):
    h = jnp.tanh(x * w) + x
    mean = jax.lax.pmean(h, "i")
    var = jax.lax.pmean((h - mean) ** 2, "i")
    return (h - mean) * jax.lax.rsqrt(var + 1.0), var


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
@pytest.mark.parametrize("keep", (False, True))
def test_variance_in_its_means_pass_per_device(axis_type, keep):
    # A variance about the batch's mean, summed in the mean's pass about a shift
    # (`_staged/_moments.py`): each device sums its shard about the shift its
    # devices agree on, on values far from zero.
    _check_staged_per_device(
        axis_type, mesh_1d, 2, "overlap", _normalised, 50.0, keep_boundaries=keep
    )


def _check_staged_per_device(
    axis_type, mesh_of, chunk_size, remainder, fun=_every_collective, offset=0.0, **kw
):
    mesh = mesh_of(axis_type)
    names = mesh.axis_names if len(mesh.axis_names) > 1 else mesh.axis_names[0]
    x = jr.normal(jr.key(0), (40, 3)) + offset
    w = jnp.array([1.0, 2.0, 0.5])
    axes: dict[str, Any] = dict(in_axes=(None, 0), out_axes=(0, None))
    oracle = eqx.filter_vmap(fun, axis_name="i", **axes)
    chunked = fc.filter_chunked_vmap(
        fun,
        axis_name="i",
        chunk_size=chunk_size,
        remainder=remainder,
        spmd_axis_name=mesh.axis_names,
        **axes,
        **kw,
    )
    loss = lambda f: lambda w, x: jnp.sum(jnp.sin(f(w, x)[0])) + jnp.sum(f(w, x)[1])
    expected = (oracle(w, x), jax.grad(loss(oracle), (0, 1))(w, x))
    xs = put(x, mesh, names)
    with jax.set_mesh(mesh):
        out = jax.jit(chunked)(w, xs)
        grads = jax.jit(jax.grad(loss(chunked), (0, 1)))(w, xs)
    actual, expected = jax.device_get(((out, grads), expected))
    assert tree_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    assert split_like(out[0], mesh, names)


@pytest.mark.parametrize("chunk_size", (3, 8))
def test_progress_reports_every_loop_of_a_sharded_batch(chunk_size, getkey):
    # A softmax over 64 elements on 8 devices takes three loops: each reports
    # the whole batch, also when every shard is one chunk (`chunk_size=8`).
    meter = recorder()
    mesh = mesh_1d(EXPLICIT)
    x = jr.normal(getkey(), (64, 3))
    softmax = lambda e: (
        jnp.exp(e - jax.lax.pmax(e, "i"))
        / jax.lax.psum(jnp.exp(e - jax.lax.pmax(e, "i")), "i")
    )
    chunked = fc.filter_chunked_vmap(
        softmax, axis_name="i", chunk_size=chunk_size, progress_meter=meter
    )
    with jax.set_mesh(mesh):
        out = chunked(put(x, mesh, "batch"))
    assert same(out, eqx.filter_vmap(softmax, axis_name="i")(x))
    opens = [e for e in meter.events if e[0] == "open"]
    labels = [f"filter_chunked_vmap (loop {k} of 3)" for k in (1, 2, 3)]
    assert opens == [("open", label, 64) for label in labels]
    assert meter.counts()[-1] == 64 and meter.events[-1] == ("close",)


_SIZE_READERS = {
    "min": lambda e: (e * min(jax.lax.axis_size("i"), 30), 40),
    "non-array": lambda e: (e * 30, jax.lax.axis_size("i")),
}


@pytest.mark.parametrize("name", _SIZE_READERS)
@pytest.mark.parametrize("chunk_size", (1, 3, 5, None))
def test_sizes_read_on_a_shard_are_the_batch(name, chunk_size):
    # 40 elements, 5 per device: `lax.axis_size` is 40 in every chunk of every
    # shard, read in Python or returned as a non-array output.
    mesh = mesh_1d(EXPLICIT)
    x = jnp.arange(1.0, 41.0)
    chunked = fc.filter_chunked_vmap(
        _SIZE_READERS[name], axis_name="i", chunk_size=chunk_size
    )
    with jax.set_mesh(mesh):
        out = chunked(put(x, mesh, "batch"))
    assert same(out[0], x * 30) and out[1] == 40
    assert split_like(out[0], mesh, "batch")


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
@pytest.mark.parametrize("chunk_size", (2, 5, None))
def test_sum_match_sums_every_device(axis_type, chunk_size, getkey):
    # Each device accumulates its shard's sum, then the devices' sums are added;
    # with a collective over the axis, through the staged passes.
    mesh = mesh_1d(axis_type)
    x = jr.normal(getkey(), (40, 3))
    w = jr.normal(getkey(), (3,))
    plain = lambda w, x: (x * w, jnp.sin(x) * w, w * 2)
    staged = lambda w, x: (x - lax.pmean(x, "i"), (x - lax.pmean(x, "i")) ** 2, w)
    for f, name in ((plain, None), (staged, "i")):
        kwargs: dict[str, Any] = dict(
            in_axes=(None, 0), out_axes=(0, None, None), axis_name=name, sum_match=True
        )
        expected = eqx.filter_vmap(f, **kwargs)(w, x)
        chunked = fc.filter_chunked_vmap(f, chunk_size=chunk_size, **kwargs)
        # Outside `jit`, where the split is found in either mode.
        with jax.set_mesh(mesh):
            actual = chunked(w, put(x, mesh, "batch"))
        assert same(actual, expected)
        assert split_like(actual[0], mesh, "batch")
        assert actual[1].sharding.is_fully_replicated


@pytest.mark.parametrize("axis_type", (AUTO, EXPLICIT))
@pytest.mark.parametrize("valid", ("count", "mask"))
def test_valid_elements_of_a_sharded_batch(axis_type, valid, getkey):
    # 64 elements, 8 per device, chunks of 3: a count of 19 leaves devices 3 to
    # 7 with no valid element, device 2 with 3 of 8.
    mesh = mesh_1d(axis_type)
    x = jr.normal(getkey(), (64, 3))
    w = jr.normal(getkey(), (4,))
    if valid == "count":
        mask = np.arange(64) < 19
        restrict = lambda c: c.valid(19)  # noqa: E731
    else:
        mask = np.asarray(jr.bernoulli(getkey(), 0.3, (64,)))
        restrict = lambda c: c.valid(mask=mask)  # noqa: E731
    poisoned = np.where(mask[:, None], x, np.nan)
    chunked = restrict(
        fc.filter_chunked_vmap(
            outer, chunk_size=3, spmd_axis_name="batch", **OUTER_AXES
        )
    )
    oracle = eqx.filter_vmap(outer, **OUTER_AXES)
    xs, ws = put(poisoned, mesh, "batch"), put(w, mesh)
    out = chunked(ws, xs)
    expected = oracle(w, x[mask])
    assert same(np.asarray(out[0])[:, mask], expected[0])
    assert not np.asarray(out[0])[:, ~mask].any()
    assert split_like(out[0], mesh, None, "batch"), out[0].sharding
    grad = jax.grad(loss(chunked), argnums=(0, 1))
    expected = jax.grad(loss(oracle), argnums=(0, 1))(w, x[mask])
    with jax.set_mesh(mesh):
        actual = jax.jit(grad)(ws, xs)
        found = collectives(grad, ws, xs)
    assert same(actual[0], expected[0])
    assert same(np.asarray(actual[1])[mask], expected[1])
    assert not np.asarray(actual[1])[~mask].any()
    if valid == "count":
        # As without `valid`: `w`'s cotangent summed once, outside the loop.
        assert [(op, size(shape)) for shape, op in found] == [("all-reduce", 4)]
