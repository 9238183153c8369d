"""Progress meters: what each transform reports, eagerly, under `jit`, `grad`,
`vmap` and nesting, when `fun` raises, and what the built-in meters print."""

import collections
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtered_chunk as fc
from filtered_chunk import _eager

from .helpers import tree_allclose
from .meters import check_one_call, Recorder, recorder
from .transforms import TRANSFORMS


REMAINDERS = ("overlap", "separate")


def build(name: str, remainder: str, meter: Any = None, **kw: Any) -> tuple:
    """The transform `name`'s example, chunked, its oracle, arguments and size."""
    transform = TRANSFORMS[name]
    example = transform.example()
    if meter is not None:
        kw["progress_meter"] = meter
    chunked, oracle = transform.build(example, remainder=remainder, **kw)
    return chunked, oracle, example.args, example.total


@pytest.mark.parametrize("remainder", REMAINDERS)
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_each_transform_reports_each_call(name, remainder):
    meter = recorder()
    chunked, oracle, args, total = build(name, remainder, meter)
    expected = oracle(*args)
    assert tree_allclose(chunked(*args), expected)
    check_one_call(meter, name, total)
    # Under `jit`, each execution of the compiled program opens its own meter.
    jitted = eqx.filter_jit(chunked)
    assert tree_allclose(jitted(*args), expected)
    assert tree_allclose(jitted(*args), expected)
    check_one_call(meter, name, total, calls=3)


@pytest.mark.parametrize("remainder", REMAINDERS)
def test_counts_are_elements_not_chunks(remainder):
    # 10 elements in chunks of 4: overlapping even chunks of 4 end at 4, 8 and 10
    # (the last recomputes 2 elements, which are not counted twice); with a
    # separate remainder, the loop's chunks end at 4 and 8, then the remainder.
    meter = recorder(label="sines")
    f = fc.filter_chunked_vmap(
        jnp.sin, chunk_size=4, remainder=remainder, progress_meter=meter
    )
    x = jnp.linspace(0.0, 1.0, 10)
    assert tree_allclose(f(x), jax.vmap(jnp.sin)(x))
    check_one_call(meter, "sines", 10)
    assert meter.counts() == ([4, 8, 10] if remainder == "overlap" else [4, 10])


class EveryChunk(Recorder):
    max_updates = 10**9


@pytest.mark.parametrize("remainder", REMAINDERS)
def test_long_calls_report_at_most_max_updates_times(remainder):
    # 1000 elements in chunks of 3: 334 steps (333 and a remainder when separate),
    # reported every 4th step from the first (ending at 3, 15, ..., 999), and the
    # last (ending at 1000; with a separate remainder, that is the step ending at
    # 999).
    x = jnp.linspace(0.0, 1.0, 1000)
    meter = recorder()
    f = fc.filter_chunked_vmap(
        jnp.sin, chunk_size=3, remainder=remainder, progress_meter=meter
    )
    loss = lambda x: jnp.sum(f(x) ** 2)
    expected = jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x)
    assert tree_allclose(jax.jit(jax.grad(jax.checkpoint(loss)))(x), expected)
    check_one_call(meter, "filter_chunked_vmap", 1000)
    every_4th = list(range(3, 1000, 12))
    if remainder == "separate":
        every_4th.pop()
    assert meter.counts() == [*every_4th, 1000]
    assert tree_allclose(jax.vmap(f)(x[None]), jnp.sin(x)[None])
    check_one_call(meter, "filter_chunked_vmap", 1000, calls=2)
    every = EveryChunk(meter.name + "every")
    fc.filter_chunked_vmap(jnp.sin, chunk_size=3, progress_meter=every)(x)
    check_one_call(every, "filter_chunked_vmap", 1000)
    assert len(every.counts()) == 334


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_no_meter_compiles_the_same_program(name):
    chunked, _, args, _ = build(name, "overlap")
    plain = str(jax.make_jaxpr(chunked)(*args))
    for meter in (None, fc.NoProgressMeter()):
        same, _, _, _ = build(name, "overlap", progress_meter=meter)
        assert str(jax.make_jaxpr(same)(*args)) == plain
    assert "chunk_progress" not in plain and "callback" not in plain
    reporting, _, _, _ = build(name, "overlap", recorder())
    assert "chunk_progress" in str(jax.make_jaxpr(reporting)(*args))


def test_eager_calls_do_not_recompile(monkeypatch):
    monkeypatch.setattr(_eager, "_programs", collections.OrderedDict())
    x = jnp.linspace(0.0, 1.0, 10)
    f = lambda m: fc.filter_chunked_vmap(jnp.sin, chunk_size=4, progress_meter=m)
    meter = recorder()
    f(meter)(x)
    f(meter)(x)
    f(Recorder(meter.name))(x)  # an equal meter
    assert len(_eager._programs) == 1
    f(fc.TextProgressMeter())(x)
    f(fc.TextProgressMeter())(x)
    assert len(_eager._programs) == 2
    check_one_call(meter, "filter_chunked_vmap", 10, calls=3)


def test_updates_arrive_while_the_compiled_loop_runs():
    starts: list[float] = []

    def _slow(x: Any) -> Any:
        starts.append(time.perf_counter())
        time.sleep(0.03)
        return np.sin(x)

    def slow_sin(x: Any) -> Any:
        struct = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(_slow, struct, x, vmap_method="expand_dims")

    meter = recorder()
    f = jax.jit(fc.filter_chunked_vmap(slow_sin, chunk_size=3, progress_meter=meter))
    x = jnp.linspace(0.0, 1.0, 12)
    f(x).block_until_ready()
    starts.clear()
    meter.events.clear()
    assert tree_allclose(f(x), jnp.sin(x))
    times = [e[2] for e in meter.events if e[0] == "update"]
    assert meter.counts() == [3, 6, 9, 12] and len(starts) == 4
    # Each update comes after its chunk's work and before the next chunk's.
    for i, t in enumerate(times):
        assert t >= starts[i] + 0.03
        assert i + 1 == len(starts) or t <= starts[i + 1]


@pytest.mark.parametrize("remainder", REMAINDERS)
@pytest.mark.parametrize("name", ["filter_chunked_vmap", "filter_chunked_apply"])
def test_reverse_mode_reports_the_forward_pass_once(name, remainder):
    meter = recorder()
    chunked, oracle, args, total = build(name, remainder, meter)
    loss = lambda f: lambda x: jnp.sum(f(x, *args[1:]) ** 2)
    expected = jax.grad(loss(oracle))(args[0])
    assert tree_allclose(jax.grad(loss(chunked))(args[0]), expected)
    check_one_call(meter, name, total)
    assert tree_allclose(jax.jit(jax.grad(loss(chunked)))(args[0]), expected)
    check_one_call(meter, name, total, calls=2)
    # The backward pass (rematerialising each chunk) reports nothing.
    out, pullback = jax.vjp(lambda x: chunked(x, *args[1:]), args[0])
    check_one_call(meter, name, total, calls=3)
    ct = jnp.ones_like(out)
    _, oracle_pullback = jax.vjp(lambda x: oracle(x, *args[1:]), args[0])
    assert tree_allclose(pullback(ct), oracle_pullback(ct))
    check_one_call(meter, name, total, calls=3)


def test_checkpoint_around_a_call_reports_once():
    # `jax.checkpoint` reruns the forward pass in the backward pass: that rerun
    # reports nothing (a `jax.debug.callback` would report it again).
    meter = recorder()
    f = fc.filter_chunked_vmap(jnp.sin, chunk_size=3, progress_meter=meter)
    x = jnp.linspace(0.0, 1.0, 10)
    loss = lambda f: jax.checkpoint(lambda x: jnp.sum(f(x) ** 2))
    expected = jax.grad(loss(jax.vmap(jnp.sin)))(x)
    assert tree_allclose(jax.jit(jax.grad(loss(f)))(x), expected)
    check_one_call(meter, "filter_chunked_vmap", 10)
    assert meter.counts() == [3, 6, 9, 10]


def test_forward_mode_reports_once():
    meter = recorder()
    f = fc.filter_chunked_vmap(jnp.sin, chunk_size=3, progress_meter=meter)
    x = jnp.linspace(0.0, 1.0, 7)
    assert tree_allclose(jax.jacfwd(f)(x), jax.jacfwd(jax.vmap(jnp.sin))(x))
    check_one_call(meter, "filter_chunked_vmap", 7)


@pytest.mark.parametrize("remainder", REMAINDERS)
def test_outer_vmap_reports_once(remainder):
    meter = recorder()
    f = fc.filter_chunked_vmap(
        jnp.sin, chunk_size=3, remainder=remainder, progress_meter=meter
    )
    x = jnp.linspace(0.0, 1.0, 28).reshape(4, 7)
    expected = jax.vmap(jax.vmap(jnp.sin))(x)
    assert tree_allclose(jax.vmap(f)(x), expected)
    check_one_call(meter, "filter_chunked_vmap", 7)
    assert tree_allclose(jax.jit(jax.vmap(f))(x), expected)
    check_one_call(meter, "filter_chunked_vmap", 7, calls=2)


def test_nested_maps_report_the_outermost_only():
    inner_meter, outer_meter = recorder(), recorder()
    inner = fc.filter_chunked_vmap(jnp.sin, chunk_size=2, progress_meter=inner_meter)
    outer = fc.filter_chunked_vmap(inner, chunk_size=2, progress_meter=outer_meter)
    x = jnp.linspace(0.0, 1.0, 30).reshape(5, 6)
    assert tree_allclose(outer(x), jnp.sin(x))
    check_one_call(outer_meter, "filter_chunked_vmap", 5)
    assert inner_meter.events == []
    # Without an outer meter, the inner map reports each time it runs: once per
    # step of the outer loop (3 steps of 2 elements here).
    quiet = fc.filter_chunked_vmap(inner, chunk_size=2)
    assert tree_allclose(quiet(x), jnp.sin(x))
    check_one_call(inner_meter, "filter_chunked_vmap", 6, calls=3)


def test_fun_raising_while_tracing_opens_nothing():
    meter = recorder()

    def fun(x: Any) -> Any:
        raise ValueError("bad fun")

    f = fc.filter_chunked_vmap(fun, chunk_size=2, progress_meter=meter)
    with pytest.raises(ValueError, match="bad fun"):
        f(jnp.ones(5))
    assert meter.events == []


def test_fun_raising_while_running_closes_the_meter():
    meter = recorder()
    fun = lambda x: eqx.error_if(x, x > 0.5, "too large")
    f = fc.filter_chunked_vmap(fun, chunk_size=2, progress_meter=meter)
    x = jnp.linspace(0.0, 1.0, 6)
    with pytest.raises(Exception, match="too large"):
        f(x)
    kinds = [e[0] for e in meter.events]
    assert kinds[0] == "open" and kinds[-1] == "close"
    assert kinds.count("open") == kinds.count("close") == 1
    assert meter.counts() and meter.counts()[-1] < 6
    # Under `jit` the failure never reaches this library: the meter is closed
    # when the next execution of the program starts.
    meter.events.clear()
    jitted = jax.jit(f)
    with pytest.raises(Exception, match="too large"):
        jitted(x).block_until_ready()
    assert [e[0] for e in meter.events].count("close") == 0
    assert tree_allclose(jitted(x / 4), x / 4)
    kinds = [e[0] for e in meter.events]
    assert kinds.count("open") == kinds.count("close") == 2
    assert meter.counts()[-1] == 6


def test_text_meter_prints_a_few_lines(capsys):
    meter = fc.TextProgressMeter(label="sines")
    f = fc.filter_chunked_vmap(jnp.sin, chunk_size=100, progress_meter=meter)
    x = jnp.zeros(1000)
    assert tree_allclose(f(x), jnp.sin(x))
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "sines: 100/1000 (10%)",
        "sines: 400/1000 (40%)",
        "sines: 700/1000 (70%)",
    ]
    assert re.fullmatch(r"sines: 1000/1000 \(100%\) done in \d+\.\d\d s", lines[3])
    assert len(lines) == 4


def test_tqdm_meter_counts_elements(capsys):
    pytest.importorskip("tqdm")
    f = fc.chunked_jacfwd(
        lambda x: jnp.sin(x) * 2.0, chunk_size=3, progress_meter=fc.TqdmProgressMeter()
    )
    x = jnp.linspace(0.0, 1.0, 10)
    assert tree_allclose(f(x), jax.jacfwd(lambda x: jnp.sin(x) * 2.0)(x))
    final = capsys.readouterr().err.split("\r")[-1]
    assert "chunked_jacfwd: 100%" in final and "10/10" in final


def test_tqdm_missing_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match=r"needs the `tqdm` package.*pip install"):
        fc.TqdmProgressMeter()


def test_a_meter_must_be_a_progress_meter():
    with pytest.raises(TypeError, match="progress_meter"):
        fc.filter_chunked_apply(jnp.sin, progress_meter="bar")  # pyright: ignore[reportArgumentType]


_TMUX_SCRIPT = """
import jax.numpy as jnp
import filtered_chunk as fc

meter = fc.TqdmProgressMeter(label="sines")
f = fc.filter_chunked_vmap(jnp.sin, chunk_size=100, progress_meter=meter)
f(jnp.zeros(1000)).block_until_ready()
print("END")
"""


def test_tqdm_bar_in_a_terminal(tmp_path):
    pytest.importorskip("tqdm")
    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.skip("needs tmux")
    script = tmp_path / "bar.py"
    script.write_text(textwrap.dedent(_TMUX_SCRIPT))
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    socket, session = f"fc-{uuid.uuid4().hex[:8]}", "progress"
    command = f"cd {root} && PYTHONPATH={root} {sys.executable} {script}; sleep 60"
    base = [tmux, "-L", socket]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMUX")}
    new = [*base, "new-session", "-d", "-s", session, "-x", "100", "-y", "12"]
    subprocess.run([*new, command], check=True, env=env)
    try:
        screen = ""
        for _ in range(240):
            screen = subprocess.run(
                [*base, "capture-pane", "-p", "-t", session],
                capture_output=True,
                text=True,
                env=env,
            ).stdout
            if "END" in screen:
                break
            time.sleep(0.25)
    finally:
        subprocess.run([*base, "kill-server"], env=env, check=False)
    lines = [line for line in screen.splitlines() if line.strip()]
    assert lines[-1] == "END", screen
    bar = lines[-2]
    assert bar.startswith("sines: 100%|"), screen
    assert "1000/1000" in bar and "elements/s" in bar, screen
    assert len(lines) == 2, screen  # the bar redrawn on one line


class _EqualToAll(Recorder):
    """A meter whose own `__eq__` ignores its state."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Recorder)

    def __hash__(self) -> int:
        return 0


def test_a_meter_with_its_own_eq_is_never_matched_by_it(monkeypatch):
    monkeypatch.setattr(_eager, "_programs", collections.OrderedDict())
    x = jnp.linspace(0.0, 1.0, 10)
    first, second = _EqualToAll("equal-a"), _EqualToAll("equal-b")
    fc.filter_chunked_vmap(jnp.sin, chunk_size=4, progress_meter=first)(x)
    fc.filter_chunked_vmap(jnp.sin, chunk_size=4, progress_meter=second)(x)
    check_one_call(first, "filter_chunked_vmap", 10)
    check_one_call(second, "filter_chunked_vmap", 10)
