"""What XLA's CPU YNNPACK fusions keep beyond `memory_analysis()`
(`filtered_chunk/_fusions.py`): read off the compiled program, and checked against
what a run of it allocates."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import filtered_chunk as fc
from filtered_chunk._fusions import _bytes, Uncounted, uncounted

from .budgets import compiled_bytes
from .helpers import count_compiles


pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="XLA's CPU fusions"
)

MiB = 2**20


def _compiled(f, *shapes):
    structs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.jit(f).lower(*structs).compile()


def _pairwise(q, x):
    return jnp.exp(-jnp.sum((q[:, None, :] - x[None, :, :]) ** 2, -1))


def _mlp(x, w1, w2, w3):
    return jnp.tanh(jnp.tanh(x @ w1) @ w2) @ w3


def test_shapes_are_read_as_bytes():
    assert _bytes("f32[2,3]{1,0}") == 24
    assert _bytes("bf16[4]{0}") == 8
    assert _bytes("pred[5]") == 5
    assert _bytes("f64[]") == 8
    assert _bytes("(f32[2]{0}, s8[3]{0})") == 11
    assert _bytes("c64[2]") == 16


def test_a_streamed_kernel_keeps_only_its_reductions():
    # The `[256, 1024, 64]` differences are never whole: what the fusion keeps is
    # at most the `[256, 1024]` sums, where XLA's own emitters allocate 64 MiB.
    compiled = _compiled(_pairwise, (256, 64), (1024, 64))
    found = uncounted(str(compiled.as_text()))
    if found is None:
        pytest.skip("no YNNPACK fusion in this XLA")
    assert not found.dots
    assert found.bytes <= 256 * 1024 * 4


def test_a_reduction_over_the_batch_broadcast_back_keeps_its_operand():
    compiled = _compiled(lambda x: jax.nn.softmax(jnp.tanh(x), 0), (4096, 256))
    found = uncounted(str(compiled.as_text()))
    if found is None:
        pytest.skip("no YNNPACK fusion in this XLA")
    assert found.bytes >= 4096 * 256 * 4
    rows = _compiled(lambda x: jax.nn.softmax(jnp.tanh(x), 1), (4096, 256))
    by_row = uncounted(str(rows.as_text()))
    assert by_row is not None and by_row.bytes < 4096 * 256 * 4


def test_matrix_products_fused_together_keep_what_they_pass():
    # Summed, the whole MLP is one fusion: it keeps both `[4096, 256]`
    # activations, and uses a product's result further (so the budget also
    # compiles it with the fusions off). Unsummed, each product is a fusion of
    # its own, which keeps nothing.
    shapes = (4096, 16), (16, 256), (256, 256), (256, 16)
    compiled = _compiled(lambda *a: jnp.sum(_mlp(*a), 1), *shapes)
    found = uncounted(str(compiled.as_text()))
    if found is None:
        pytest.skip("no YNNPACK fusion in this XLA")
    assert found.dots and found.bytes >= 2 * 4096 * 256 * 4
    alone = uncounted(str(_compiled(_mlp, *shapes).as_text()))
    assert alone is None or (not alone.dots and alone.bytes == 0)
    # A fusion's buffers are freed once it has run: two such fusions one after
    # the other keep what one keeps.
    one = lambda x, *w: jax.nn.softmax(_mlp(x, *w), 0)  # noqa: E731
    two = lambda x, y, *w: (one(x, *w), one(y, *w))  # noqa: E731
    each = uncounted(str(_compiled(one, *shapes).as_text()))
    both = uncounted(str(_compiled(two, shapes[0], *shapes).as_text()))
    assert each is not None and both is not None and both.bytes == each.bytes


def test_a_budget_over_a_streamed_kernel_runs_the_chunks_that_fit():
    # A kernel density at each query, over 4,096 points: with the fusions off
    # XLA would hold the `[k, 4096, 64]` differences (1 MiB an element); the
    # fusion streams them, keeping at most the `[k, 4096]` sums (16 KiB). At a
    # budget of 2 MiB the chunks are tens of elements, not one or two, and each
    # size the search counts compiles once.
    q = jnp.linspace(-1, 1, 512 * 64).reshape(512, 64)
    x = jnp.linspace(1, -1, 4096 * 64).reshape(4096, 64)
    kernel = lambda qi: jnp.sum(_pairwise(qi[None], x))  # noqa: E731
    budget = 2 * MiB
    chunked = fc.filter_chunked_vmap(
        kernel, chunk_size=fc.MemoryBudget(budget, tune=False)
    )
    with count_compiles() as compiles:
        choice = fc.suggest_chunk_size(chunked, q)
    if uncounted(str(jax.jit(jax.vmap(kernel)).lower(q).compile().as_text())) is None:
        pytest.skip("no YNNPACK fusion in this XLA")
    assert choice.chunk_size >= 16 and choice.bytes <= budget
    assert len(compiles) <= len(choice.tried) + 1  # and the outer program
    fixed = fc.filter_chunked_vmap(kernel, chunk_size=choice.chunk_size)
    assert compiled_bytes(fixed, q) <= budget
    assert jnp.allclose(chunked(q), jax.vmap(kernel)(q), rtol=1e-6, atol=1e-6)


_GROWTH = """
import json, sys
import jax, jax.numpy as jnp
sys.path.insert(0, {root!r})
from tests.test_budget_fusions import _mlp, _pairwise
from tests.budgets import memory_analysis

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def allocated(f, *args):
    compiled = jax.jit(f).lower(*args).compile()
    jax.block_until_ready(compiled(*args))  # the first run builds the fusions
    open("/proc/self/clear_refs", "w").write("5")  # the peak, from now
    before = status("VmRSS")
    jax.block_until_ready(compiled(*args))
    return status("VmHWM") - before

x = jnp.linspace(-1, 1, 65536 * 256).reshape(65536, 256)
x16 = x[:, :16]
w1, w2, w3 = x[:16] / 16, x[:256] / 256, x[:256, :16] / 256
cases = {{
    "pairwise": (_pairwise, x16[:128], x16),
    "batch softmax": (lambda x: jax.nn.softmax(jnp.tanh(x), 0), x),
    "row softmax": (lambda x: jax.nn.softmax(jnp.tanh(x), 1), x),
    "mlp, batch softmax": (lambda *a: jax.nn.softmax(_mlp(*a), 0), x16, w1, w2, w3),
    "mlp, summed": (lambda *a: jnp.sum(_mlp(*a), 1), x16, w1, w2, w3),
    "two mlps, one after the other": (
        lambda x, y, *w: (
            jax.nn.softmax(_mlp(x, *w), 0), jax.nn.softmax(_mlp(y, *w), 0)
        ),
        x16, -x16, w1, w2, w3,
    ),
}}
out = {{}}
for name, (f, *args) in cases.items():
    analysis = memory_analysis(f, *args)
    counted = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    own = jax.jit(f).lower(*args).compile().memory_analysis()
    out[name] = (allocated(f, *args), counted, own.temp_size_in_bytes)
print(json.dumps(out))
"""


@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="reads the process's peak"
)
def test_what_a_run_allocates_is_counted():
    # A second run of each program, in a process whose allocator returns every
    # large block (so each run's buffers are new pages): its peak growth is what
    # the run allocates, XLA's buffers and the fusions' alike (its outputs not
    # always: they can reuse the first run's pages). The budget's count must
    # cover it (to a MiB for the allocator's own), and for the streamed kernel
    # stay far below what XLA's emitters would need.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_GROWTH.format(root=root))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    for name, (allocated, counted, _) in found.items():
        assert allocated <= counted + MiB, (name, allocated, counted)
    output = 128 * 65536 * 4
    allocated, counted, temp = found["pairwise"]
    assert counted <= temp + 2 * output  # its sums at most: 64 MiB, not 512
    # Where a fusion keeps what XLA leaves out (the 64 MiB `tanh`), a run shows it.
    allocated, counted, temp = found["batch softmax"]
    assert allocated > temp + 32 * MiB


def test_many_paths_through_a_fusion_are_read_quickly():
    # After a reduction over the leading axis, 40 levels of
    # `y = sin(y) * cos(y)`: 2**40 paths to the end, where the reading looks for
    # a broadcast back; each value is followed once.
    lines = [
        "%p = f32[4096,256]{1,0} parameter(0)",
        "%t = f32[4096,256]{1,0} tanh(%p)",
        "%r = f32[256]{0} reduce(%t, %c), dimensions={0}",
    ]
    previous = "r"
    for i in range(40):
        lines += [
            f"%s{i} = f32[256]{{0}} sine(%{previous})",
            f"%k{i} = f32[256]{{0}} cosine(%{previous})",
            f"%m{i} = f32[256]{{0}} multiply(%s{i}, %k{i})",
        ]
        previous = f"m{i}"
    lines[-1] = "ROOT " + lines[-1]
    text = "\n".join(
        [
            "%fused (p: f32[4096,256]) -> f32[256] {",
            *("  " + line for line in lines),
            "}",
            "",
            "ENTRY %main (x: f32[4096,256]) -> f32[256] {",
            "  ROOT %f = f32[256]{0} fusion(%x), kind=kCustom, calls=%fused, "
            'backend_config={"kind":"__ynn_fusion"}',
            "}",
        ]
    )
    # The reduction's result only: it is not broadcast back.
    assert uncounted(text) == Uncounted(256 * 4, False)
