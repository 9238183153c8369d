"""Running chunked calls outside `jit` without recompiling on every call.

An eager `lax.scan` compiles its body on every call (its jaxpr is new each time, and
JAX caches compilations by jaxpr identity). `jax.jit` would cache on the identity of
the Python function instead, and so silently reuse whatever values `fun` read from
its closure or from globals on the first call. Here the call is traced afresh every
time (cheap), and the *compiled program* is cached on what was traced: the jaxpr's
text, its constants' types, and what the text does not show (`program_key`):

- callables in equation parameters (callbacks): a function by its code, globals
  and what it closes over (recursively: immutable builtin values by value, anything
  else, mutable lists and arrays included, by identity), so that the new lambda or
  JAX wrapper each trace makes still hits, while one closing over a new value or
  object misses;
- constants of inner programs (an inner `jit` closing over an array): a
  `jax.Array` by identity, a (mutable) NumPy array by value;
- not the derivative rules of `custom_vjp`/`custom_jvp` calls: a cached program is
  only evaluated, never differentiated, so only their primal runs.

The key holds what it compares by identity, so no `id` is reused while cached; no
user-defined `__eq__` is ever called. Constants (arrays `fun` closes over) are
passed as arguments, so new values need no recompilation.

`jax.grad` of an eager chunked call cannot use this cache: its inputs are tracers,
so the loop runs op by op and JAX compiles the scan (a new jaxpr on every call)
each time, as for any eager `lax.scan` under `jax.grad`. Wrap the gradient in
`jax.jit` (or `eqx.filter_jit`) to compile it once. Where only what `fun` closes
over is traced (a loss that closes over the model it differentiates), the
program as traced is evaluated under the outer transformation, op by op: `fun`
is not traced a second time (`tests/test_collectives_staged.py`,
`test_closing_over_state_under_grad`).

Outputs that the trace did not compute (a NumPy value `fun` returns with
`out_axes=None`, a non-array) are returned as they are, as `eqx.filter_vmap` does.
Each cached program is a `jax.jit` of its own, freed when the cache drops it, so a
loop making a new program per call (a Python scalar that changes) holds at most the
cache's programs; `eqx.error_if` raises `eqx.EquinoxRuntimeError` as under
`eqx.filter_jit`.
"""

import collections
import dataclasses
import functools as ft
import types
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jex
import jax.tree_util as jtu
import numpy as np
from jax.errors import JaxRuntimeError
from jaxtyping import PyTree

from ._jax_compat import equinox_runtime_message, quiet_callback_errors


_MAX_PROGRAMS = 64
_programs = collections.OrderedDict[Hashable, Callable[..., Any]]()


def is_traced(tree: PyTree[Any]) -> bool:
    """Whether any leaf is a tracer: then an outer transformation is running."""
    return any(isinstance(x, jax.core.Tracer) for x in jtu.tree_leaves(tree))


class _Same:
    """An object in a cache key, compared by identity (and held: see above)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


# Parameters that only differentiation reads: the rules, new closures on every
# trace (such as those `eqx.internal.while_loop` makes), which a cached program
# (only evaluated: an eager call has no tracers) never runs.
_DIFFERENTIATION_ONLY = {
    "custom_vjp_call": ("fwd_jaxpr_thunk", "bwd", "out_trees"),
    "custom_jvp_call": ("jvp_jaxpr_fun", "jvp_jaxpr_thunk"),
}
_MAX_DEPTH = 8
_EXACT = (type(None), bool, int, str, bytes)


def _value_key(x: Any, depth: int = 0, trusted: bool = False) -> Hashable:
    """A key equal for two values only if they behave the same in a program.

    A callback runs the *cached* program's function, so a mutable object it
    closes over (a list it appends to, a NumPy buffer) must be the very same
    object: keyed by identity, except in the `trusted` closures JAX itself makes,
    whose containers it never changes.
    """
    if depth > _MAX_DEPTH:
        return _Same(x)
    key = ft.partial(_value_key, depth=depth + 1)
    if type(x) in _EXACT:
        return (type(x), x)
    if type(x) in (float, complex):
        return (type(x), repr(x))  # `-0.0 == 0.0`, but they differ
    if type(x) is tuple:
        return (tuple, tuple(map(key, x)))
    if trusted and type(x) in (list, dict):
        items = x.items() if isinstance(x, dict) else enumerate(x)
        return (type(x), tuple((key(k), key(v)) for k, v in items))
    if getattr(type(x), "cache_by_value", False) and type(x).__module__.startswith(
        "filtered_chunk."
    ):
        return (type(x), x)  # the library's own, whose equality is complete
    if isinstance(x, jtu.PyTreeDef):
        return (jtu.PyTreeDef, x)  # what `jax.jit` itself compares by value
    if isinstance(x, types.FunctionType):
        jax_own = x.__module__.startswith("jax.")
        cells = tuple(_cell_key(c, depth, jax_own) for c in x.__closure__ or ())
        # Each function has its own `__dict__` and `__kwdefaults__`: their items.
        extra = x.__dict__, x.__kwdefaults__ or {}
        defaults = (key(x.__defaults__), *(key(tuple(d.items())) for d in extra))
        return (_Same(x.__code__), _Same(x.__globals__), cells, defaults)
    if isinstance(x, types.MethodType):
        return (types.MethodType, key(x.__func__), _Same(x.__self__))
    if isinstance(x, ft.partial):
        keywords = key(tuple(x.keywords.items()))
        return (ft.partial, key(x.func), key(x.args), keywords)
    if dataclasses.is_dataclass(x) and type(x).__module__.startswith("jax."):
        # JAX's own wrappers, such as the one around a `pure_callback`'s function.
        fields = dataclasses.fields(x)
        return (type(x), tuple(key(getattr(x, f.name)) for f in fields))
    return _Same(x)


def _cell_key(cell: Any, depth: int, trusted: bool) -> Hashable:
    try:
        contents = cell.cell_contents
    except ValueError:  # an empty cell
        return ()
    return (_value_key(contents, depth + 1, trusted),)


def _const_key(x: Any) -> Hashable:
    """An inner program's constant, part of the compiled program: a `jax.Array`
    is immutable, so its identity tells; a NumPy one is copied in, by value."""
    if isinstance(x, np.ndarray | np.generic):
        return (np.ndarray, x.dtype, x.shape, x.tobytes())
    return _Same(x)


def program_key(jaxpr: Any, *, evaluated_only: bool) -> Iterator[Hashable]:
    """What identifies `jaxpr` as a program beyond its text, which masks callables
    (callbacks' addresses) and the values of inner programs' constants; with
    `evaluated_only`, less what only differentiation reads."""
    for eqn in jaxpr.eqns:
        skip = _DIFFERENTIATION_ONLY.get(eqn.primitive.name, ())
        skip = skip if evaluated_only else ()
        for name, value in eqn.params.items():
            if name in skip:
                continue
            if isinstance(value, jex.ClosedJaxpr):
                yield tuple(map(_const_key, value.consts))
            elif callable(value) and not isinstance(value, jex.Jaxpr):
                yield _value_key(value)
        for sub in jex.jaxprs_in_params(eqn.params):
            yield from program_key(sub, evaluated_only=evaluated_only)


def _trace(
    fn: Callable[[PyTree[Any]], Any], tree: PyTree[Any]
) -> tuple[Any, list[Any], Callable[[list[Any]], Any]]:
    """Traces `fn(tree)` with `tree`'s arrays abstract: the jaxpr, the arrays it
    takes, and how to build `fn`'s output from the jaxpr's outputs."""
    dynamic, static = eqx.partition(tree, eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)
    found: list[Any] = []

    def _traced(*_leaves: Any) -> list[Any]:
        out = fn(eqx.combine(jtu.tree_unflatten(treedef, _leaves), static))
        out_leaves, out_treedef = jtu.tree_flatten(out)
        traced = [isinstance(x, jax.core.Tracer) for x in out_leaves]
        # Only what the trace did not compute outlives it: a tracer kept here
        # would keep the trace alive (`jax.checking_leaks` reports it).
        kept = [None if t else x for x, t in zip(out_leaves, traced)]
        found[:] = [kept, out_treedef, traced]
        return [x for x, t in zip(out_leaves, traced) if t]

    closed = jax.make_jaxpr(_traced)(*leaves)

    def _rebuild(outputs: list[Any]) -> Any:
        kept, out_treedef, traced = found
        computed = iter(outputs)
        merged = [next(computed) if t else x for x, t in zip(kept, traced)]
        return jtu.tree_unflatten(out_treedef, merged)

    return closed, leaves, _rebuild


def call_compiled(fn: Callable[[PyTree[Any]], Any], tree: PyTree[Any]) -> Any:
    """Evaluates `fn(tree)` as one compiled program, compiled once per program."""
    closed, leaves, rebuild = _trace(fn, tree)
    if is_traced(closed.consts):
        # `fn` closes over an outer transformation's tracers (`jax.grad` of a
        # function closing over the model): the program as traced, evaluated
        # under that transformation, rather than `fn` again, which would trace
        # `fun` a second time.
        return rebuild(jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves))
    try:
        key = (str(closed.jaxpr), tuple(program_key(closed.jaxpr, evaluated_only=True)))
        hash(key)
    except TypeError:
        return fn(tree)  # no reliable key (an unhashable value): run op by op
    compiled = _programs.pop(key, None)
    if compiled is None:
        # Its own `jax.jit`, whose executable lives as long as it does. (Every
        # `eqx.filter_jit` of a non-function shares one `jax.jit`, whose cache holds
        # each program it ran, about 1.8 MB each, unbounded: benchmarks/eager.py.)
        compiled = jax.jit(ft.partial(jax.core.eval_jaxpr, closed.jaxpr))
    _programs[key] = compiled
    while len(_programs) > _MAX_PROGRAMS:
        _programs.popitem(last=False)
    return rebuild(_run(compiled, list(closed.consts), leaves))


def _run(compiled: Callable[..., Any], consts: list[Any], leaves: list[Any]) -> Any:
    """Runs a program and waits for it, raising `eqx.error_if`'s errors as
    `eqx.filter_jit` does: an `eqx.EquinoxRuntimeError` with the message."""
    with quiet_callback_errors():
        try:
            return jax.block_until_ready(compiled(consts, *leaves))
        except (JaxRuntimeError, ValueError) as e:
            message = equinox_runtime_message(e)
            if message is None:
                raise
            raise eqx.EquinoxRuntimeError(message) from None
