"""Finding collectives over the mapped axis, which chunking would make per-chunk."""

from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax
from jaxtyping import PyTree


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
) -> list[str]:
    """The names of the collectives over `axis_name` that `fun(element)` performs.

    `lax.axis_size` (and `lax.psum` of a constant) reads the size of the axis when
    tracing and leaves no collective in the jaxpr; it shows as `"axis_size"` when the
    jaxpr changes with that size.
    """
    trace = lambda size: jax.make_jaxpr(fun, axis_env=[(axis_name, size)])(element)
    jaxpr = trace(axis_size)
    found = set(_find(jaxpr.jaxpr, axis_name))
    if not found and _depends_on_size(trace, str(jaxpr), axis_size + 1):
        found.add("axis_size")
    return sorted(found)


def _depends_on_size(trace: Callable[[int], Any], jaxpr: str, other: int) -> bool:
    try:
        # Printed jaxprs are deterministic: function addresses are masked.
        return str(trace(other)) != jaxpr
    except Exception:  # any failure at another size depends on the size
        return True
