"""Finding collectives over the mapped axis, derivatives included, and what they
mean for the call ([`collective_mode`][]): the one collective analysis of
every transform.
"""

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._jaxprs import subjaxprs
from .._mesh import BatchSharding
from .._structs import element_struct, inexact, struct


def axis_names(params: dict[str, Any]) -> tuple[Any, ...]:
    """The axis names an equation's collective names (`()` for none)."""
    names = params.get("axes", params.get("axis_name", ()))
    return tuple(names) if isinstance(names, tuple | list) else (names,)


def public_name(eqn: Any) -> str:
    """The name a user writes for the collective that `eqn` binds."""
    name = eqn.primitive.name
    return f"lax.{'psum_scatter' if name == 'reduce_scatter' else name}"


def found_in(jaxpr: Any, axis_name: Hashable) -> list[str]:
    """The collectives over `axis_name` anywhere in `jaxpr`, as users write them."""
    found = []
    for eqn in jaxpr.eqns:
        if axis_name in axis_names(eqn.params):
            found.append(public_name(eqn))
        for value in eqn.params.values():
            for sub in subjaxprs(value):
                found += found_in(sub, axis_name)
    return sorted(set(found))


def in_derivatives(
    fun: Callable[[list[Any]], list[Any]],
    args: list[jax.ShapeDtypeStruct],
    axis_name: Hashable,
    axis_size: int,
) -> list[str]:
    """The collectives over `axis_name` in the derivatives of `fun(args)` (its
    inexact outputs) w.r.t. its inexact arguments.

    Reverse mode shows both custom rules: a `custom_jvp` rule is linearised and a
    `custom_vjp` backward pass is traced when transposing. Where reverse mode is not
    defined (a `while_loop`), forward mode shows `custom_jvp` rules.
    """
    is_diff = [inexact(x) for x in args]
    diff = [x for x, b in zip(args, is_diff) if b]
    if not diff:
        return []
    rest = [x for x, b in zip(args, is_diff) if not b]

    def _outputs(_diff: list[Any]) -> list[Any]:
        first, others = iter(_diff), iter(rest)
        merged = [next(first) if b else next(others) for b in is_diff]
        return [x for x in fun(merged) if inexact(x)]

    def _reverse(_diff: list[Any]) -> Any:
        out, pullback = jax.vjp(_outputs, _diff)
        return pullback(out)

    def _forward(_diff: list[Any]) -> Any:
        return jax.jvp(_outputs, (_diff,), (_diff,))

    for derivative in (_reverse, _forward):
        try:
            traced = jax.make_jaxpr(derivative, axis_env=[(axis_name, axis_size)])
            return found_in(traced(diff).jaxpr, axis_name)
        except Exception:  # not differentiable in this mode: nothing to find
            continue
    return []


def reads_axis(
    fun: Callable[[PyTree[Any]], Any],
    element: PyTree[jax.ShapeDtypeStruct],
    axis_name: Hashable,
    axis_size: int,
) -> bool:
    """Whether `fun(element)` reads the mapped axis at all, evaluated or
    differentiated: a collective over `axis_name`, or its size.

    `lax.axis_size` (and `lax.psum` of a constant) reads the size when `fun` is
    traced and leaves nothing in the jaxpr, and a jaxpr may read it in Python
    (`min(lax.axis_size("i"), 6)`, a branch on it) or differently on every trace (a
    function that draws NumPy random numbers when traced): no comparison of traces
    can tell. Tracing `fun` with the axis unbound can: any read of it raises. A
    collective that only a custom derivative rule performs (a `jax.custom_vjp`
    backward pass) shows in the derivatives of that trace, traced with the axis.
    """
    try:
        # A new function every time: `make_jaxpr` caches traces by function.
        closed = jax.make_jaxpr(lambda _element: fun(_element))(element)
    except Exception:  # an unbound axis; any other error, the staged trace raises
        return True
    num_consts = len(closed.consts)
    return bool(
        in_derivatives(
            lambda xs: jax.core.eval_jaxpr(
                closed.jaxpr, xs[:num_consts], *xs[num_consts:]
            ),
            [struct(c, weak=False) for c in closed.consts] + jtu.tree_leaves(element),
            axis_name,
            axis_size,
        )
    )


# What a collective over `axis_name` makes of a call (`collective_mode`).
NONE, WHOLE, STAGED = "none", "whole", "staged"

# The axes whose per-element programs are being traced for staging, innermost last.
_staging: list[Hashable] = []


@contextlib.contextmanager
def staging(axis_name: Hashable) -> Iterator[None]:
    """While `fun` is traced to be staged over `axis_name` (`_program.py`).

    A chunked map nested in `fun` whose own function uses a collective over that
    axis evaluates its batch in one `vmap` (`collective_mode`): inside a loop
    of chunks, the collective could not be staged; in one `vmap` it stays at the top
    level of `fun`, and the outer map's chunks bound the memory.
    """
    _staging.append(axis_name)
    try:
        yield
    finally:
        _staging.pop()


def collective_mode(
    element: Callable[[PyTree[Any]], Any],
    mapped: PyTree[Any],
    in_axes: PyTree[int | None],
    axis_name: Hashable | None,
    *,
    batch_size: int,
    chunk_size: int | None,
    sharding: BatchSharding | None,
) -> str:
    """How the batch is evaluated, given the collectives over `axis_name` that
    `element` (`fun` on one element) performs.

    - `NONE`: as if there were none: `element` never reads the axis (no
      collective over it, not its size; or no axis name), or a batch of one chunk
      on one device (`chunk_size` `None` or at least `batch_size`), which is not
      traced here.
    - `WHOLE`: one `vmap` of the whole batch split over devices, with
      `chunk_size=None`: XLA computes the collective across them.
    - `WHOLE` also when a chunked map is nested in a staged one and uses a
      collective over its axis (see `staging`).
    - `STAGED`: the staged evaluation (this sub-package), on each device's shard if the
      batch is split over devices, whenever `element` reads the axis: it traces
      `fun` with the axis at the batch size, so every size `fun` reads is the
      batch's, whatever the size of the chunks. It refuses, naming the
      collective, what it cannot compute exactly.
    """
    local = batch_size if sharding is None else batch_size // sharding.num_devices
    # A sharded batch is staged on each device, unless `chunk_size=None` asks for
    # one `vmap` of the whole batch.
    one_chunk = chunk_size is None or (sharding is None and chunk_size >= local)
    structs = jtu.tree_map(element_struct, in_axes, mapped)
    arrays = lambda m: eqx.filter(element(m), eqx.is_array)  # noqa: E731
    outer = [n for n in _staging if n != axis_name]
    if outer and not one_chunk and _uses(arrays, structs, outer, axis_name, batch_size):
        return WHOLE
    if axis_name is None or (sharding is None and one_chunk):
        return NONE
    # The whole output: a size read in Python may reach a non-array output.
    if not reads_axis(element, structs, axis_name, batch_size):
        return NONE
    return WHOLE if one_chunk else STAGED


def _uses(
    fun: Callable[[PyTree[Any]], Any],
    element: PyTree[jax.ShapeDtypeStruct],
    outer: list[Hashable],
    axis_name: Hashable | None,
    axis_size: int,
) -> bool:
    """Whether `fun(element)` uses a collective over an axis being staged around
    it (`outer`: bound already), with its own axis (if named) of `axis_size`."""
    env = [] if axis_name is None else [(axis_name, axis_size)]
    closed = jax.make_jaxpr(lambda _element: fun(_element), axis_env=env)(element)
    return any(found_in(closed.jaxpr, name) for name in outer)
