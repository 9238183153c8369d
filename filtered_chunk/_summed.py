"""`sum_match=True`: an `out_axes=None` output that varies over the batch is summed.

`jax.vmap(..., sum_match=True)` sums such an output over the batch (in `jnp.sum`'s
dtype: small integers and booleans promote) and returns one that does not vary as
it is. Chunked, a summed output is an accumulator of the loop (`_loop/_accumulate.py`):
its memory is its own size, never the batch's.

Whether an output varies is what `jax.vmap`'s own batching rules say, found while
the chunk is traced: each unmapped output passes an identity whose batching rule
(`jax.custom_batching.custom_vmap`) sees whether its operand is batched. A mapped
*marker* (each element's position) goes in beside it, so that the rule runs for
every output, batched or not, and leaves nothing of itself in the program. (A
mapped input serves: it is sharded like the batch, as `jax.vmap` requires of
what it maps; it is never read.)
"""

from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
from equinox.internal import Static
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from ._custom_types import ChunkOutput, keep_untraced, unwrap_kept
from ._structs import typed


def _varies(x: Any, marker: Array) -> bool:
    """Inside `jax.vmap`, with `marker` mapped: whether `x` is batched."""
    if not isinstance(x, jax.core.Tracer):
        return False  # a constant, returned as it is
    seen: list[bool] = []

    @custom_vmap
    def _probe(_x: Any, _marker: Any) -> Any:
        return _x

    @_probe.def_vmap
    def _rule(axis_size: int, in_batched: list[bool], _x: Any, _marker: Any) -> Any:
        del axis_size, _marker
        seen.append(bool(in_batched[0]))
        return _x, in_batched[0]

    _probe(x, marker)
    return bool(seen and seen[0])


def split_varying(
    leaves: list[Any], marker: Array
) -> tuple[list[Any], list[Any], list[bool]]:
    """Inside `jax.vmap` (`marker` mapped): `leaves` split into those that vary
    over the batch (to be summed), the others, and which varied."""
    varies = [_varies(x, marker) for x in leaves]
    summed = [x for x, v in zip(leaves, varies, strict=True) if v]
    rest = [x for x, v in zip(leaves, varies, strict=True) if not v]
    return summed, rest, varies


def as_sums(rows: list[Array]) -> list[Array]:
    """Each output's rows (the batch on axis 0) in the dtype and weak type that
    `jnp.sum` gives their sum, as `jax.vmap(..., sum_match=True)` sums them."""
    return [typed(x, jax.eval_shape(lambda _x: _x.sum(0), x)) for x in rows]


def merge_varying(varies: list[bool], summed: list[Any], rest: list[Any]) -> list:
    """The outputs in their order again: `split_varying`'s inverse."""
    summed_iter, rest_iter = iter(summed), iter(rest)
    return [next(summed_iter) if v else next(rest_iter) for v in varies]


def summed_output(
    out_mapped: Any, static: Any, summed: list[Any], unmapped: list[Any], where: Any
) -> ChunkOutput:
    """`_chunk_fn`'s output with `sum_match`: the unmapped leaves flat, the summed
    ones accumulated after the mapped ones (`where`: which varied, and the
    unmapped outputs' tree)."""
    out_static, out_axes = static.value
    axes = tuple(jtu.tree_leaves(out_axes))
    moved = [jnp.moveaxis(x, 0, a) for x, a in zip(jtu.tree_leaves(out_mapped), axes)]
    summed = as_sums(summed)
    # What no trace computed is returned as it is (`jax.vmap` does the same).
    rest, kept = keep_untraced(list(unmapped))
    batched = (jtu.tree_unflatten(jtu.tree_structure(out_mapped), moved), summed)
    kinds = (None,) * len(axes) + ("sum",) * len(summed)
    static = Static((out_static, kept, *where))
    return ChunkOutput(batched, axes + (0,) * len(summed), rest, static, kinds)


def with_sums(out: ChunkOutput) -> Any:
    """`filter_chunked_vmap`'s output from `summed_output`'s, once summed."""
    (out_mapped, summed), (out_static, kept, varies, treedef) = (
        out.batched,
        out.static.value,
    )
    rest = [x if k is None else k for x, k in zip(out.unbatched, kept, strict=True)]
    out_unmapped = jtu.tree_unflatten(treedef, merge_varying(varies, summed, rest))
    return unwrap_kept(eqx.combine(out_mapped, out_unmapped, out_static))
