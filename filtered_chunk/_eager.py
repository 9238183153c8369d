"""Running chunked calls outside `jit` without recompiling on every call.

An eager `lax.scan` compiles its body on every call (its jaxpr is new each time, and
JAX caches compilations by jaxpr identity). Wrapping the call in `jax.jit` would cache
on the identity of the Python function instead, and so silently reuse whatever
values `fun` read from its closure or from globals on the first call. Here the call
is traced afresh every time (cheap), and the *compiled program* is cached on what
was traced: the jaxpr's text, the identity of every callable inside it (the text
masks callbacks' addresses), and its constants' types. Constants (arrays `fun`
closes over) are passed as arguments, so new values are used without recompiling.
"""

import collections
import functools as ft
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jex
import jax.tree_util as jtu
from jaxtyping import PyTree


_MAX_PROGRAMS = 64
_programs: collections.OrderedDict[Hashable, Callable[..., Any]] = (
    collections.OrderedDict()
)


def is_traced(tree: PyTree[Any]) -> bool:
    """Whether any leaf is a tracer: then an outer transformation is running."""
    return any(isinstance(x, jax.core.Tracer) for x in jtu.tree_leaves(tree))


class _InnerConstants(Exception):
    pass


def _callables(jaxpr: Any) -> Iterator[Any]:
    """The callables in `jaxpr`'s parameters, which its text does not identify."""
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            if isinstance(value, jex.ClosedJaxpr) and value.consts:
                # Constants that JAX did not hoist are not in the key: don't cache.
                raise _InnerConstants
            if callable(value) and not isinstance(value, jex.Jaxpr | jex.ClosedJaxpr):
                yield value
        for sub in jex.jaxprs_in_params(eqn.params):
            yield from _callables(sub)


def _evaluate(jaxpr: Any, consts: list[Any], args: list[Any]) -> list[Any]:
    return jax.core.eval_jaxpr(jaxpr, consts, *args)


def call_compiled(fn: Callable[[PyTree[Any]], Any], tree: PyTree[Any]) -> Any:
    """Evaluates `fn(tree)` as one compiled program, compiled once per program."""
    dynamic, static = eqx.partition(tree, eqx.is_array)
    closed, out_struct, out_static = eqx.filter_make_jaxpr(
        lambda _dynamic: fn(eqx.combine(_dynamic, static))
    )(dynamic)
    if is_traced(closed.consts):
        return fn(tree)  # `fn` closes over an outer transformation's tracers
    try:
        key = (str(closed.jaxpr), tuple(_callables(closed.jaxpr)))
        hash(key)
    except (TypeError, _InnerConstants):
        return fn(tree)  # no reliable key (an unhashable callable): run op by op
    compiled = _programs.pop(key, None)
    if compiled is None:
        compiled = jax.jit(ft.partial(_evaluate, closed.jaxpr))
    _programs[key] = compiled
    while len(_programs) > _MAX_PROGRAMS:
        _programs.popitem(last=False)
    flat = compiled(list(closed.consts), jtu.tree_leaves(dynamic))
    out = jtu.tree_unflatten(jtu.tree_structure(out_struct), flat)
    return eqx.combine(out, out_static)
