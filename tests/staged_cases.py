"""Running collectives across chunks through the public call, and its oracle
`jax.vmap`, in the tests."""

import re
from typing import Any

import equinox as eqx
import jax

import filtered_chunk as fc

from .meters import recorder


def _chunked(fun, chunk_size, remainder: Any = "overlap", **kwargs) -> Any:
    """`filter_chunked_vmap` of a `fun(mapped, unmapped) -> (mapped_out,
    unmapped_out)` on lists of leaves: the mapped ones on axis 0 (or `in_axes`)."""
    return fc.filter_chunked_vmap(
        fun,
        in_axes=(kwargs.pop("in_axes", 0), None),
        out_axes=(0, None),
        axis_name=kwargs.pop("axis_name", "i"),
        chunk_size=chunk_size,
        remainder=remainder,
        **kwargs,
    )


def staged_call(fun, mapped, unmapped, chunk_size, remainder="overlap", **kwargs):
    """`fun(mapped, unmapped) -> (mapped_out, unmapped_out)` chunked, under `jit`
    (as a chunked call outside it runs: one compiled program)."""
    chunked = _chunked(fun, chunk_size, remainder, **kwargs)
    return eqx.filter_jit(chunked)(list(mapped), list(unmapped))


def num_passes(fun, mapped, unmapped, chunk_size, **kwargs) -> int:
    """The passes over the batch before the final one, as a progress meter sees
    them: each loop reports as `loop k of n`."""
    meter = recorder()
    staged_call(fun, mapped, unmapped, chunk_size, progress_meter=meter, **kwargs)
    labels = [e[1] for e in meter.events if e[0] == "open"]
    found = re.search(r"loop \d+ of (\d+)", labels[0])
    return 0 if found is None else int(found.group(1)) - 1


def vmap_call(fun, mapped, unmapped, axis_name="i"):
    return jax.vmap(
        lambda m: fun(m, unmapped), out_axes=(0, None), axis_name=axis_name
    )(list(mapped))
