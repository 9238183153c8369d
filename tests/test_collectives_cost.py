"""The estimated work and kept bytes of a staged plan (`_staged/_cost.py`), as a
memory budget's choice reports them (`ChunkSizeChoice.work`, `.boundary_bytes`)."""

import jax
import jax.lax as lax
import jax.numpy as jnp
import pytest

from filtered_chunk._staged._cost import plan_cost
from filtered_chunk._staged._run import plan_staged


B = 32


def _blocks(layer):
    # Two blocks of a layer, each centred over the batch: two passes.
    def fun(m, u):
        (x,), (w1, w2) = m, u
        for w in (w1, w2):
            x = layer(x, w)
            x = x - lax.pmean(x, "i")
        return [x], [], None

    return fun


def _dense(x, w):
    return x @ w


def _conv(x, w):
    return lax.conv_general_dilated(x[None], w, (1, 1), "SAME")[0]


_CASES = {
    # (layer, element, weight): a 16 x 16 matrix; a 3 x 3 convolution of 4
    # channels over 8 x 8 pixels.
    "dense": (_dense, (16,), (16, 16)),
    "conv": (_conv, (4, 8, 8), (4, 4, 3, 3)),
}


@pytest.mark.parametrize("name", _CASES)
def test_work_and_kept_bytes(name):
    layer, element, weight = _CASES[name]
    fun = _blocks(layer)
    s = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731

    def plan(keep):
        return plan_staged(
            fun,
            [s(element)],
            [s(weight), s(weight)],
            batch_size=B,
            axis_name="i",
            api="test",
            keep=keep,
        )

    kept, work = plan_cost(plan(1), 8)
    # Kept: each block's layer output, once an element; nothing runs twice.
    assert plan(1).num_passes == 2
    assert kept == 2 * 4 * jnp.prod(jnp.array(element))
    assert work == 1.0
    # Recomputing: the layers run 1 + 2 + 2 times where the program runs them
    # twice, and they dominate the work (their multiply-adds against the
    # elementwise centring).
    kept, work = plan_cost(plan(0), 8)
    assert kept == 0
    assert 2.4 < work < 2.5
