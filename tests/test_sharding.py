"""Chunking a sharded batch: on one device here, on 8 and on two processes in
subprocesses (the device count must be set before JAX starts).

The 8-device cases live in `sharding_cases.py`; one pytest run in a subprocess
executes them all, and each becomes one test here.
"""

import ast
import os
import pathlib
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jaxtyping
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import filtered_chunk as fc

from .helpers import tree_allclose


HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = sorted(
    node.name
    for node in ast.parse((HERE / "sharding_cases.py").read_text()).body
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
)


def _environment(num_devices: int) -> dict[str, str]:
    env = dict(os.environ)
    flag = f"--xla_force_host_platform_device_count={num_devices}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    return _with_package(env)


def _with_package(env: dict[str, str]) -> dict[str, str]:
    """`env` importing the package under test, not whichever copy is installed (a
    script's own folder, not the working directory, leads `sys.path`)."""
    paths = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Runs `sharding_cases.py` on 8 CPU devices; each case's failure messages."""
    report = tmp_path_factory.mktemp("sharding") / "report.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-n", "0"]  # one process: the cases share its 8 devices
    command += [str(HERE / "sharding_cases.py"), f"--junitxml={report}"]
    try:
        run = subprocess.run(
            command,
            cwd=ROOT,
            env=_environment(8),
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"The 8-device cases took over {e.timeout} s.")
    if not report.exists():
        pytest.fail(f"The 8-device run wrote no report:\n{run.stdout}\n{run.stderr}")
    results: dict[str, list[str]] = {}
    for case in ET.parse(report).iter("testcase"):
        name = case.get("name", "").split("[")[0]
        problems = [f"{c.tag}: {c.get('message')}\n{c.text}" for c in case]
        results.setdefault(name, []).extend(problems)
    return results


@pytest.mark.parametrize("case", CASES)
def test_on_eight_devices(case: str, eight_devices: dict[str, list[str]]):
    assert case in eight_devices, f"`{case}` did not run on 8 devices."
    problems = eight_devices[case]
    assert not problems, "\n".join(problems)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes():
    """The same code under `jax.distributed`, two CPU processes over loopback; a
    memory budget chooses alike on both (`sharding_multihost.check_budget`)."""
    port = _free_port()
    worker = [sys.executable, str(HERE / "sharding_multihost.py")]
    processes = [
        subprocess.Popen(
            [*worker, str(i), str(port)],
            cwd=ROOT,
            env=_with_package(dict(os.environ)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in processes:
            outputs.append(p.communicate(timeout=180)[0])
    except subprocess.TimeoutExpired:
        pytest.fail("The two processes did not finish within 180 s.")
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, out) in enumerate(zip(processes, outputs)):
        assert p.returncode == 0 and out.strip().endswith("OK"), f"process {i}:\n{out}"
    # A memory budget chose the same on both, with different free memory.
    choices = [[s for s in o.splitlines() if s.startswith("CHOICE")] for o in outputs]
    assert len(choices[0]) == 1 and choices[0] == choices[1], choices


# On the single device of this process: a mesh of one device still goes through
# `shard_map`, and must change nothing.


@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit))
@pytest.mark.parametrize("chunk_size", (2, 3))
def test_one_device_mesh_matches_filter_vmap(axis_type, chunk_size, getkey):
    mesh = jax.make_mesh((1,), ("batch",), axis_types=(axis_type,))
    x = jax.device_put(jr.normal(getkey(), (7, 3)), NamedSharding(mesh, P("batch")))
    w = jr.normal(getkey(), (3,))
    f = lambda w, x: (jnp.outer(x, w), w * 2, "static")
    kwargs: dict[str, Any] = dict(in_axes=(None, 0), out_axes=(1, None, None))
    expected = eqx.filter_vmap(f, **kwargs)(w, x)
    detected = fc.filter_chunked_vmap(f, chunk_size=chunk_size, **kwargs)
    named = fc.filter_chunked_vmap(
        f, chunk_size=chunk_size, spmd_axis_name="batch", **kwargs
    )
    expected_grad = _grad(eqx.filter_vmap(f, **kwargs))(w, x)
    actual = detected(w, x)
    with jax.set_mesh(mesh):
        actual_named = eqx.filter_jit(named)(w, x)
        actual_grad = jax.jit(_grad(named))(w, x)
    assert _same(actual, expected)
    assert _same(actual_named, expected)
    assert _same(actual_grad, expected_grad)


def _same(actual: Any, expected: Any) -> bool:
    return tree_allclose(jax.device_get(actual), jax.device_get(expected))


def _grad(fn: Any) -> Any:
    return jax.grad(lambda w, x: jnp.sum(fn(w, x)[0] ** 2))


@pytest.mark.parametrize("name", ((), ("batch", "batch")))
def test_bad_spmd_axis_name_raises(name):
    with pytest.raises(ValueError, match="distinct mesh axis names"):
        fc.filter_chunked_vmap(jnp.sin, spmd_axis_name=name)


def test_spmd_axis_name_type_is_checked():
    with pytest.raises(jaxtyping.TypeCheckError, match="spmd_axis_name"):
        fc.filter_chunked_vmap(jnp.sin, spmd_axis_name=3)  # pyright: ignore[reportArgumentType]
