"""`sum_match=True`: an `out_axes=None` output that varies over the batch is summed.

`jax.vmap(..., sum_match=True)` sums such an output over the batch (in `jnp.sum`'s
dtype: small integers and booleans promote) and returns one that does not vary as
it is. Chunked, a summed output is an accumulator of the loop (`_accumulate.py`):
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

import jax
import jax.core
import jax.lax as lax
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from ._jax_compat import with_weak_type


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
    out = []
    for x in rows:
        total = jax.eval_shape(lambda _x: _x.sum(0), x)
        if total.dtype != x.dtype or total.weak_type != jax.typeof(x).weak_type:
            x = lax.convert_element_type(x, total.dtype)
            x = with_weak_type(x, total.weak_type)
        out.append(x)
    return out


def merge_varying(varies: list[bool], summed: list[Any], rest: list[Any]) -> list:
    """The outputs in their order again: `split_varying`'s inverse."""
    summed_iter, rest_iter = iter(summed), iter(rest)
    return [next(summed_iter) if v else next(rest_iter) for v in varies]
