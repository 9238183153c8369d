"""Walking jaxprs: the one home of the helpers that look into traced programs."""

from collections.abc import Iterator
from typing import Any

import jax.extend.core as jex


def subjaxprs(value: Any) -> Iterator[Any]:
    """The jaxprs in an equation's parameter (a jaxpr, a closed one, or a tuple)."""
    if isinstance(value, jex.Jaxpr):
        yield value
    elif isinstance(value, jex.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for v in value:
            yield from subjaxprs(v)


def holds_custom_vjp(value: Any) -> bool:
    """Whether the jaxprs in `value` call a `jax.custom_vjp` function, whose
    backward pass (the user's code) need not be linear in the cotangent."""
    return any(
        eqn.primitive.name == "custom_vjp_call"
        or any(holds_custom_vjp(v) for v in eqn.params.values())
        for jaxpr in subjaxprs(value)
        for eqn in jaxpr.eqns
    )
