"""Finding collectives over the mapped axis, which chunking would make per-chunk.

[`check_collectives`][] is the one place where a call decides what a collective
over `axis_name` means for its schedule: nothing (no collective, or one `vmap` of
the whole batch), one `vmap` of the whole batch on a batch split over devices
(XLA computes the collective across them), or the one error, when the batch would
be split into chunks.
"""

from collections.abc import Callable, Hashable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._sharding import BatchSharding


def _subjaxprs(value: Any) -> Iterator[Any]:
    if hasattr(value, "eqns"):  # a Jaxpr
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):  # a ClosedJaxpr
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _subjaxprs(v)


def _axis_names(params: dict[str, Any]) -> tuple[Any, ...]:
    names = params.get("axes", params.get("axis_name", ()))
    return tuple(names) if isinstance(names, tuple | list) else (names,)


def _find(jaxpr: Any, axis_name: Hashable) -> Iterator[str]:
    for eqn in jaxpr.eqns:
        if axis_name in _axis_names(eqn.params):
            yield eqn.primitive.name
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                yield from _find(sub, axis_name)


def collectives_over(
    fun: Callable[[PyTree[Any]], Any],
    element: PyTree[jax.ShapeDtypeStruct],
    axis_name: Hashable,
    axis_size: int,
    other_size: int,
) -> list[str]:
    """The names of the collectives over `axis_name` that `fun(element)` performs,
    evaluated or differentiated, when the axis has `axis_size` elements.

    `fun` is traced at `axis_size` first, the size it is written for: a function
    whose shapes depend on the axis (an `all_gather` reshaped to the batch) may not
    trace at any other. A collective that only a custom derivative rule performs
    (a `jax.custom_vjp` backward pass) shows in the derivatives of that trace.

    `lax.axis_size` (and `lax.psum` of a constant) reads the size of the axis when
    tracing and leaves no collective in the jaxpr; it shows as `"axis_size"` when the
    jaxpr changes with that size (`other_size`), and not when it already changes
    between two traces at the same size (a function that draws NumPy random numbers
    when traced).
    """

    def trace(size: int) -> Any:
        # A new function every time: `make_jaxpr` caches traces by function.
        _fun = lambda _element: fun(_element)
        return jax.make_jaxpr(_fun, axis_env=[(axis_name, size)])(element)

    closed = trace(axis_size)
    found = set(_find(closed.jaxpr, axis_name))
    if not found:  # the derivatives of a collective hold its transposes
        found.update(_in_derivatives(closed, element, axis_name, axis_size))
    if not found and _depends_on_size(trace, str(closed), axis_size, other_size):
        found.add("axis_size")
    return sorted(found)


def _in_derivatives(
    closed: Any, element: PyTree[Any], axis_name: Hashable, axis_size: int
) -> set[str]:
    """The collectives in the derivatives of `closed` (a traced function of
    `element`) w.r.t. its inexact inputs and the arrays it closed over.

    Reverse mode shows both custom rules: a `custom_jvp` rule is linearised and a
    `custom_vjp` backward pass is traced when transposing. Where reverse mode is not
    defined (a `while_loop`), forward mode shows `custom_jvp` rules.
    """
    inputs = ([_struct(c) for c in closed.consts], jtu.tree_leaves(element))
    diff, nondiff = eqx.partition(inputs, _inexact)

    def _outputs(_diff: Any) -> list[Any]:
        consts, args = eqx.combine(_diff, nondiff)
        out = jax.core.eval_jaxpr(closed.jaxpr, consts, *args)
        return [x for x in out if jnp.issubdtype(x.dtype, jnp.inexact)]

    def _reverse(_diff: Any) -> Any:
        out, pullback = jax.vjp(_outputs, _diff)
        return pullback(out)

    def _forward(_diff: Any) -> Any:
        return jax.jvp(_outputs, (_diff,), (_diff,))

    for derivative in (_reverse, _forward):
        try:
            jaxpr = jax.make_jaxpr(derivative, axis_env=[(axis_name, axis_size)])
            return set(_find(jaxpr(diff).jaxpr, axis_name))
        except Exception:  # not differentiable in this mode: nothing to find
            continue
    return set()


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def _inexact(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) and bool(
        jnp.issubdtype(x.dtype, jnp.inexact)
    )


def _depends_on_size(
    trace: Callable[[int], Any], jaxpr: str, size: int, other: int
) -> bool:
    # Printed jaxprs are deterministic (function addresses are masked), unless the
    # function itself changes between traces.
    if str(trace(size)) != jaxpr:
        return False  # comparing with another size would tell nothing
    try:
        return str(trace(other)) != jaxpr
    except Exception:  # any failure at another size depends on the size
        return True


def element_struct(axis: int, x: Any) -> jax.ShapeDtypeStruct:
    """One element of the mapped leaf `x`: its shape without `axis`."""
    shape = list(np.shape(x))
    del shape[axis]
    return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x))


def check_collectives(
    element: Callable[[PyTree[Any]], Any],
    mapped: PyTree[Any],
    in_axes: PyTree[int | None],
    axis_name: Hashable | None,
    *,
    batch_size: int,
    chunk_size: int | None,
    sharding: BatchSharding | None,
    api: str,
) -> bool:
    """Whether the batch must be evaluated in one `vmap` because `element` (`fun`
    on one element, returning its arrays) uses collectives over `axis_name`.

    A batch of one chunk (`chunk_size` `None` or at least `batch_size`) is never
    checked on one device, and is evaluated whole when split over devices and a
    collective is found (`True`). A batch split into chunks, or into per-device
    shards that would be chunked, with a collective raises: chunking would make
    the collective per-chunk (or per-shard) and silently change the result.
    """
    one_chunk = chunk_size is None or chunk_size >= batch_size
    if axis_name is None or (sharding is None and one_chunk):
        return False
    structs = jtu.tree_map(element_struct, in_axes, mapped)
    if sharding is None:
        other_size = chunk_size
        num_steps = -(-batch_size // chunk_size)  # pyright: ignore[reportOperatorIssue]
        split = (
            f"the batch of {batch_size} is split into {num_steps} chunks of "
            f"`chunk_size={chunk_size}`, so it would only see one chunk at a time"
        )
    else:
        other_size = max(1, batch_size // sharding.num_devices)
        split = (
            f"the batch is split over the mesh axes {sharding.axis_names!r}, so "
            "each device would only see its own shard when chunking it"
        )
    assert other_size is not None
    arrays = lambda m: eqx.filter(element(m), eqx.is_array)  # noqa: E731
    found = collectives_over(arrays, structs, axis_name, batch_size, other_size)
    if found and not one_chunk:
        raise ValueError(
            f"`{api}(..., axis_name={axis_name!r})`: the function uses the "
            f"collective(s) {', '.join(f'`{c}`' for c in found)} over "
            f"{axis_name!r}, but {split}. Use `chunk_size=None` (or at least the "
            f"batch size, {batch_size}) to evaluate the whole batch in one `vmap`, "
            "or move the collective out of the mapped function (for example, "
            "reduce the mapped output afterwards)."
        )
    return bool(found)
