"""Staged collectives, part 3: each collective's result over the whole batch, from
what one pass accumulated (`finish`), and what each element then reads of it: all
of it, or its own slice (`psum_scatter`) or row (`ppermute`, `all_to_all`).
"""

import functools as ft
from collections.abc import Hashable
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, Int

from .._structs import inexact, typed
from ._analysis import axis_names
from ._plan import Plan
from ._program import bind, GATHERS


def kind(eqn: Any) -> str:
    name = eqn.primitive.name
    if name in ("psum", "reduce_scatter"):
        return "sum"
    if name in ("pmax", "pmin"):
        return name[1:]
    assert name in GATHERS
    return "gather"


def strong(x: Array) -> Array:
    """`x`, strongly typed."""
    return lax.convert_element_type(x, x.dtype)


@ft.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _no_derivative(name: str, value: Array, carrier: Array) -> Array:
    """`value`, whose derivative (through `carrier`'s) JAX does not define."""
    del name, carrier
    return value


def _no_derivative_jvp(name: str, primals: Any, tangents: Any) -> Any:
    value, _ = primals
    if isinstance(tangents[1], SymbolicZero):  # the operand has no tangent
        return value, jnp.zeros_like(value)
    # What `jax.vmap` raises for a `pmax` or `pmin` with a tangent.
    raise NotImplementedError(f"Differentiation rule for '{name}' not implemented")


_no_derivative.defjvp(_no_derivative_jvp, symbolic_zeros=True)


def finish(eqn: Any, accs: list[Any], axis_name: Hashable, batch_size: int) -> list:
    """The collective's result over the whole batch, from its accumulators (one
    per operand), with the outer axes it names reduced."""
    name = eqn.primitive.name
    others = tuple(n for n in axis_names(eqn.params) if n != axis_name)
    if name == "psum":
        out = [lax.psum(a, others) if others else a for a in accs]
    elif name in ("pmax", "pmin"):
        # `accs`: pairs of the best value and the carrier of its tangent.
        out = [_no_derivative(name, *a) if inexact(a[0]) else a[0] for a in accs]
        out = [getattr(lax, name)(x, others) if others else x for x in out]
    elif name == "all_gather":
        out = [_gathered(eqn, accs[0])]
    elif name == "reduce_scatter":
        out = [accs[0]]
    else:  # every element's result, as `jax.vmap` computes it from the buffer
        fn = lambda x: bind(eqn, [x])[0]  # noqa: E731
        out = [jax.vmap(fn, axis_name=axis_name, axis_size=batch_size)(accs[0])]
    if name in ("ppermute", "all_to_all", "reduce_scatter"):
        return out  # typed when read, per element
    return [typed(x, v.aval) for x, v in zip(out, eqn.outvars, strict=True)]


def _gathered(eqn: Any, rows: Array) -> Array:
    dim = eqn.params["all_gather_dimension"]
    stacked = jnp.moveaxis(rows, 0, dim)
    if not eqn.params["tiled"]:
        return stacked
    return stacked.reshape(eqn.outvars[0].aval.shape)


def read(eqn: Any, result: list[Array], position: Int[Array, ""] | None) -> list[Array]:
    """What the element at `position` gets from the collective's `result`."""
    name = eqn.primitive.name
    if name not in ("ppermute", "all_to_all", "reduce_scatter"):
        return result
    (x,), aval = result, eqn.outvars[0].aval
    if name != "reduce_scatter":
        return [typed(lax.dynamic_index_in_dim(x, position, 0, keepdims=False), aval)]
    dim = eqn.params["scatter_dimension"]
    if not eqn.params["tiled"]:
        out = lax.dynamic_index_in_dim(x, position, dim, keepdims=False)
    else:
        size = aval.shape[dim]
        out = lax.dynamic_slice_in_dim(x, position * size, size, axis=dim)
    return [typed(out, aval)]


def unstaged(
    eqn: Any, invals: list[Any], position: Any, axis_name: Hashable, batch_size: int
) -> list[Any]:
    """A collective that takes no pass: `axis_index`, or one whose operands are the
    same for every element (as `jax.vmap` computes it: `psum` multiplies by the
    batch size, `pmax` and `pmin` are the identity, `all_gather` broadcasts)."""
    name = eqn.primitive.name
    if name == "axis_index":
        return [typed(jnp.asarray(position), eqn.outvars[0].aval)]
    others = tuple(n for n in axis_names(eqn.params) if n != axis_name)
    if name == "all_gather":
        x, dim = invals[0], eqn.params["all_gather_dimension"]
        shape = list(np.shape(x))
        shape.insert(dim, batch_size)
        out = jnp.broadcast_to(jnp.expand_dims(x, dim), shape)
        return [out.reshape(eqn.outvars[0].aval.shape)]
    if name == "psum":
        out = [batch_size * x for x in invals]
    else:
        out = list(invals)
    if others:
        out = getattr(lax, name)(out, others)
    return [typed(jnp.asarray(x), v.aval) for x, v in zip(out, eqn.outvars)]


def level_results(
    plan: Plan,
    level: int,
    acc: list[Any],
    gathered: list[Array],
    shifts: dict[Any, Array],
) -> dict[int, list[Array]]:
    """The results of the level's collectives, from what its pass accumulated
    (`acc`) and gathered: each variance summed about a shift corrected by its
    mean's result (`Moment.correct`)."""
    program = plan.program
    eqns = program.jaxpr.eqns
    accs, rows = iter(acc), iter(gathered)
    moments = {moment.variance: moment for moment in plan.moments.get(level, [])}
    means = {moment.mean: moment.m for moment in plan.moments.get(level, [])}
    # The sums of the means' operands about the shifts, by the mean's `psum`.
    about: dict[int, Array] = {}
    out = {}
    for i in plan.at_level(level):
        eqn = eqns[i]
        parts = [
            next(rows) if kind(eqn) == "gather" else next(accs) for _ in eqn.invars
        ]
        n = program.batch_size
        if i in means:  # summed about a shift, which adds back in the end
            about[i] = parts[0]
            shift = strong(shifts[means[i]])
            parts = [typed(parts[0] + n * shift, eqn.invars[0].aval)]
        if i in moments:  # summed about a shift: its mean's result corrects it
            moment = moments[i]
            m = moment.mean_from(eqns, out[moment.mean][0])
            shift = strong(shifts[moment.m])
            offset = about[moment.mean]
            summed = moment.correct(parts[0], offset, strong(m), shift, n)
            parts = [typed(summed, eqn.invars[0].aval)]
        out[i] = finish(eqn, parts, program.axis_name, program.batch_size)
    return out
