"""`jax.experimental.checkify` of chunked maps: the evaluated loop holds no
`jax.checkpoint`, which `checkify` cannot transform."""

from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from jax.experimental import checkify

import filtered_chunk as fc

from .helpers import tree_allclose


_ERRORS = {"index": checkify.index_checks, "all": checkify.all_checks}
_CHECKPOINTS: tuple[Any, ...] = (True, jax.checkpoint_policies.nothing_saveable)


def _gather(x, w):
    # An index computed from the data: `checkify` adds a bounds check.
    return jnp.sin(x[(x[0] > 0).astype(jnp.int32)]) * w


def _out_of_bounds(x, w):
    return x[(x[0] > 0).astype(jnp.int32) + 5] * w


@pytest.mark.parametrize("errors", _ERRORS)
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("checkpoint", _CHECKPOINTS)
@pytest.mark.parametrize("jit", (False, True))
def test_checkify_matches_vmap(errors, remainder, checkpoint, jit, getkey):
    x, w = jr.normal(getkey(), (7, 2)), jnp.array(1.5)
    kwargs: dict[str, Any] = dict(remainder=remainder, checkpoint=checkpoint)
    chunked = fc.filter_chunked_vmap(_gather, in_axes=(0, None), chunk_size=3, **kwargs)
    checked = checkify.checkify(chunked, errors=_ERRORS[errors])
    error, out = (jax.jit(checked) if jit else checked)(x, w)
    error.throw()
    assert tree_allclose(out, jax.vmap(_gather, in_axes=(0, None))(x, w))


@pytest.mark.parametrize("errors", _ERRORS)
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
@pytest.mark.parametrize("jit", (False, True))
def test_checkify_reports_an_index_error(errors, remainder, jit, getkey):
    x, w = jr.normal(getkey(), (7, 2)), jnp.array(1.5)
    chunked = fc.filter_chunked_vmap(
        _out_of_bounds, in_axes=(0, None), chunk_size=3, remainder=remainder
    )
    checked = checkify.checkify(chunked, errors=_ERRORS[errors])
    error, _ = (jax.jit(checked) if jit else checked)(x, w)
    with pytest.raises(checkify.JaxRuntimeError, match="index 5 is out of bounds"):
        error.throw()


@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_checkify_with_collectives_across_chunks(remainder, getkey):
    # The staged passes are runs of the same loop: no `jax.checkpoint` in them.
    def normalised(x, w):
        y = _gather(x, w)
        return y - jax.lax.pmean(y, "i")

    x, w = jr.normal(getkey(), (7, 2)), jnp.array(1.5)
    chunked = fc.filter_chunked_vmap(
        normalised, in_axes=(0, None), chunk_size=3, axis_name="i", remainder=remainder
    )
    error, out = jax.jit(checkify.checkify(chunked, errors=checkify.all_checks))(x, w)
    error.throw()
    expected = jax.vmap(normalised, in_axes=(0, None), axis_name="i")(x, w)
    assert tree_allclose(out, expected)
