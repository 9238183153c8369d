"""Running chunked calls outside `jit` without recompiling on every call.

An eager `lax.scan` compiles its body on every call (its jaxpr is new each time, and
JAX caches compilations by jaxpr identity). Wrapping the call in `jax.jit` would cache
on the identity of the Python function instead, and so silently reuse whatever
values `fun` read from its closure or from globals on the first call. Here the call
is traced afresh every time (cheap), and the *compiled program* is cached on what
was traced: the jaxpr's text, the identity of every callable inside it (the text
masks callbacks' addresses), and its constants' types. Constants (arrays `fun`
closes over) are passed as arguments, so new values are used without recompiling.

Outputs that the trace did not compute (a NumPy value `fun` returns with
`out_axes=None`, a non-array) are returned as they are, as `eqx.filter_vmap` does:
only traced outputs go through the compiled program. The program runs under
`eqx.filter_jit`, so that `eqx.error_if` raises `eqx.EquinoxRuntimeError` as it
does under `eqx.filter_jit`.
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


def _trace(
    fn: Callable[[PyTree[Any]], Any], tree: PyTree[Any]
) -> tuple[Any, list[Any], Callable[[list[Any]], Any]]:
    """Traces `fn(tree)` with `tree`'s arrays abstract.

    Returns the jaxpr, the arrays it takes, and a function that builds `fn`'s
    output from the jaxpr's outputs and the leaves the trace did not compute.
    """
    dynamic, static = eqx.partition(tree, eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)
    found: list[Any] = []

    def _traced(*_leaves: Any) -> list[Any]:
        out = fn(eqx.combine(jtu.tree_unflatten(treedef, _leaves), static))
        out_leaves, out_treedef = jtu.tree_flatten(out)
        traced = [isinstance(x, jax.core.Tracer) for x in out_leaves]
        found[:] = [out_leaves, out_treedef, traced]
        return [x for x, t in zip(out_leaves, traced) if t]

    closed = jax.make_jaxpr(_traced)(*leaves)

    def _rebuild(outputs: list[Any]) -> Any:
        out_leaves, out_treedef, traced = found
        computed = iter(outputs)
        merged = [next(computed) if t else x for x, t in zip(out_leaves, traced)]
        return jtu.tree_unflatten(out_treedef, merged)

    return closed, leaves, _rebuild


def call_compiled(fn: Callable[[PyTree[Any]], Any], tree: PyTree[Any]) -> Any:
    """Evaluates `fn(tree)` as one compiled program, compiled once per program."""
    closed, leaves, rebuild = _trace(fn, tree)
    if is_traced(closed.consts):
        return fn(tree)  # `fn` closes over an outer transformation's tracers
    try:
        key = (str(closed.jaxpr), tuple(_callables(closed.jaxpr)))
        hash(key)
    except (TypeError, _InnerConstants):
        return fn(tree)  # no reliable key (an unhashable callable): run op by op
    compiled = _programs.pop(key, None)
    if compiled is None:
        compiled = eqx.filter_jit(ft.partial(_evaluate, closed.jaxpr))
    _programs[key] = compiled
    while len(_programs) > _MAX_PROGRAMS:
        _programs.popitem(last=False)
    return rebuild(compiled(list(closed.consts), leaves))
