"""Staged collectives, part 1: the per-element program, with every collective over
the mapped axis at its top level and a level for each.

[`staged_program`][] traces `fun` for one element with the axis bound at the full
batch size (so `lax.axis_size`, `psum(1)` and `pmean`'s divisor read the whole
batch), then re-traces the jaxpr through an interpreter that inlines every call
(`pjit`, `checkpoint`) whose body holds such a collective, and turns a `lax.cond`
with a predicate that varies over the batch into a `select` of its branches, which
is what `jax.vmap` itself does with a batched predicate. What cannot be staged
exactly raises here, before anything runs: see `_refuse`.

A collective's *level* is one more than the highest level of the collectives its
operand depends on; the staged evaluation (`_run.py`) computes level `s` in its
`s`-th pass over the batch. A collective whose operand does not vary over the batch
costs no pass (`psum` of it is `batch_size` times it, as in `jax.vmap`), nor does
`axis_index` (the chunk's offset plus the position in the chunk).
"""

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.core
import jax.extend.core as jex
import jax.numpy as jnp
from jaxtyping import Array

from .._convolutions import in_loop
from .._jaxprs import subjaxprs
from .._structs import struct
from ._analysis import axis_names, found_in, public_name, staging


# The primitives that JAX's collectives bind, under `jax.vmap` with `axis_name`.
REDUCTIONS = ("psum", "pmax", "pmin")
GATHERS = ("all_gather", "ppermute", "all_to_all")
COLLECTIVES = REDUCTIONS + GATHERS + ("reduce_scatter", "axis_index")
_INLINED = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
_LOOPS = ("scan", "while")
CUSTOM = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
# The collectives whose result is the same for every element.
INVARIANT = REDUCTIONS + ("all_gather",)


def _body_holds(eqn: Any, axis_name: Hashable) -> list[str]:
    return [
        name
        for value in eqn.params.values()
        for sub in subjaxprs(value)
        for name in found_in(sub, axis_name)
    ]


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, jex.Literal) else env[v]


def bind(eqn: Any, invals: list[Any]) -> list[Any]:
    """`eqn` applied to `invals`, as `jax.core.eval_jaxpr` does; a convolution
    in the layout of XLA's fast CPU kernels, since the staged program runs in
    loops (`_convolutions.py`: also the sample that a variance's shift is
    taken from, in a `lax.while_loop` of its own)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    # The mesh is where it runs (inside `shard_map`, for a sharded batch), not
    # where it was traced.
    mesh = jax.sharding.get_abstract_mesh()
    with eqn.ctx.manager, jax.sharding.use_abstract_mesh(mesh):
        out = in_loop(eqn.primitive).bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


Handler = Callable[[Any, list[Any], list[bool]], list[Any] | None]


def walk(
    jaxpr: Any,
    args: list[Any],
    varying: list[bool],
    handle: Handler,
    axis_name: Hashable,
) -> tuple[list[Any], list[bool]]:
    """Evaluates `jaxpr` (its constvars first in `args`), tracking which values
    vary over the batch; `handle(eqn, invals, varying)` may replace an equation's
    evaluation (returning its outputs) or leave it to `bind` (returning `None`)."""
    env: dict[Any, Any] = {}
    var: dict[Any, bool] = {}
    invars = list(jaxpr.constvars) + list(jaxpr.invars)
    for v, x, b in zip(invars, args, varying, strict=True):
        env[v], var[v] = x, b
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        in_var = [not isinstance(v, jex.Literal) and var[v] for v in eqn.invars]
        out = handle(eqn, invals, in_var)
        out = bind(eqn, invals) if out is None else out
        out_var = varying_outputs(eqn, in_var, axis_name)
        for v, x, b in zip(eqn.outvars, out, out_var, strict=True):
            if not isinstance(v, jex.DropVar):
                env[v], var[v] = x, b
    outs = [_read(env, v) for v in jaxpr.outvars]
    return outs, [not isinstance(v, jex.Literal) and var[v] for v in jaxpr.outvars]


def _call_body(eqn: Any) -> tuple[Any, list[Any]] | None:
    """A call-like equation's body and its consts, or `None`."""
    for key in ("jaxpr", "call_jaxpr"):
        body = eqn.params.get(key)
        if isinstance(body, jex.ClosedJaxpr):
            return body.jaxpr, list(body.consts)
        if isinstance(body, jex.Jaxpr) and not body.constvars:
            return body, []
    return None


def varying_outputs(eqn: Any, in_var: list[bool], axis_name: Hashable) -> list[bool]:
    """Which outputs of `eqn` vary over the batch named `axis_name`."""
    name = eqn.primitive.name
    if axis_name in axis_names(eqn.params):
        return [name not in INVARIANT] * len(eqn.outvars)
    body = _call_body(eqn) if name in _INLINED + CUSTOM else None
    if body is not None and len(body[0].invars) == len(in_var):
        jaxpr, consts = body
        return _dependence(jaxpr, [False] * len(consts) + in_var, axis_name)
    # Anything else: varies if any input does (`jax.vmap` may batch less).
    return [any(in_var)] * len(eqn.outvars)


def _dependence(jaxpr: Any, varying: list[bool], axis_name: Hashable) -> list[bool]:
    var = dict(zip(list(jaxpr.constvars) + list(jaxpr.invars), varying, strict=True))
    for eqn in jaxpr.eqns:
        in_var = [not isinstance(v, jex.Literal) and var[v] for v in eqn.invars]
        out_var = varying_outputs(eqn, in_var, axis_name)
        for v, b in zip(eqn.outvars, out_var, strict=True):
            var[v] = b
    return [not isinstance(v, jex.Literal) and var[v] for v in jaxpr.outvars]


@dataclasses.dataclass(frozen=True)
class Program:
    """The per-element program: `jaxpr` (a flat `Jaxpr`) over `consts` then the
    mapped then the unmapped leaves, and its outputs' `num_mapped` split."""

    jaxpr: Any
    consts: list[Any]
    num_mapped_in: int
    num_mapped_out: int
    aux: Any
    axis_name: Hashable
    batch_size: int
    # Per unmapped output: `(True, value)` if it is a value no trace computed.
    kept: list[tuple[bool, Any]]


def staged_program(
    fun: Callable[[list[Array], list[Array]], tuple[list[Any], list[Any], Any]],
    mapped: list[jax.ShapeDtypeStruct],
    unmapped: list[jax.ShapeDtypeStruct],
    axis_name: Hashable,
    batch_size: int,
    api: str,
) -> Program:
    """Traces `fun(mapped, unmapped) -> (mapped_out, unmapped_out, aux)` for one
    element and flattens it (see the module docstring)."""
    aux: list[Any] = []

    def _fun(_mapped: list[Array], _unmapped: list[Array]) -> list[Any]:
        out_mapped, out_unmapped, _aux = fun(_mapped, _unmapped)
        # An unmapped output that no trace computed is returned as it is, as
        # `jax.vmap` does (a Python float stays one).
        kept = [(not isinstance(x, jax.core.Tracer), x) for x in out_unmapped]
        aux.append((len(out_mapped), _aux, kept))
        return list(out_mapped) + list(out_unmapped)

    env = [(axis_name, batch_size)]
    with staging(axis_name):  # a chunked map inside evaluates at once if need be
        closed = jax.make_jaxpr(_fun, axis_env=env)(mapped, unmapped)
    num_mapped_out, aux_value, kept = aux[0]
    varying = [False] * len(closed.consts) + [True] * len(mapped)
    varying += [False] * len(unmapped)
    handle = _Inliner(axis_name, api)

    def _flat(*args: Array) -> list[Any]:
        return walk(closed.jaxpr, list(args), varying, handle, axis_name)[0]

    structs = [struct(c) for c in closed.consts] + list(mapped) + list(unmapped)
    flat = jax.make_jaxpr(_flat, axis_env=env)(*structs)
    return Program(
        flat.jaxpr,
        list(flat.consts) + list(closed.consts),
        len(mapped),
        num_mapped_out,
        aux_value,
        axis_name,
        batch_size,
        kept,
    )


@dataclasses.dataclass(frozen=True)
class _Inliner:
    """The `walk` handler that brings collectives over `axis_name` to top level."""

    axis_name: Hashable
    api: str

    def __call__(self, eqn: Any, invals: list[Any], in_var: list[bool]) -> Any:
        found = _body_holds(eqn, self.axis_name)
        name = eqn.primitive.name
        if self.axis_name in axis_names(eqn.params):
            _check_collective(eqn, self.axis_name, self.api)
            return None
        if not found:
            return None
        body = _call_body(eqn)
        if name in _INLINED and body is not None:
            jaxpr, consts = body
            in_var = [False] * len(consts) + in_var
            return walk(jaxpr, consts + invals, in_var, self, self.axis_name)[0]
        if name == "cond" and in_var[0]:
            return self._select(eqn, invals, in_var)
        raise _refuse(eqn, found, self.axis_name, self.api)

    def _select(self, eqn: Any, invals: list[Any], in_var: list[bool]) -> list[Any]:
        # Every branch runs and the predicate picks, per element: `jax.vmap`'s
        # rule for a `cond` whose predicate is batched, derivatives included.
        index, operands = invals[0], invals[1:]
        outs = []
        for branch in eqn.params["branches"]:
            args = list(branch.consts) + operands
            varying = [False] * len(branch.consts) + in_var[1:]
            outs.append(walk(branch.jaxpr, args, varying, self, self.axis_name)[0])
        index = jnp.clip(index, 0, len(outs) - 1)
        return [jax.lax.select_n(index, *xs) for xs in zip(*outs, strict=True)]


def _check_collective(eqn: Any, axis_name: Hashable, api: str) -> None:
    name, names = eqn.primitive.name, axis_names(eqn.params)
    where = f"`{public_name(eqn)}` over {names!r}"
    if name not in COLLECTIVES:
        raise ValueError(
            f"`{api}(..., axis_name={axis_name!r})`: {where} cannot be computed across "
            "chunks. Use `chunk_size=None` (or at least the batch size)."
        )
    if eqn.params.get("axis_index_groups") is not None:
        # The class `jax.vmap` raises for them.
        raise NotImplementedError(
            f"`{api}(..., axis_name={axis_name!r})`: {where} has `axis_index_groups`, "
            "which chunks of the batch cannot compute exactly. Use `chunk_size=None` "
            "(or at least the batch size), or write the groups as masks."
        )
    if name not in REDUCTIONS and names != (axis_name,):
        raise ValueError(
            f"`{api}(..., axis_name={axis_name!r})`: {where} names other axes too; "
            "across chunks, only `psum`, `pmean`, `pmax` and `pmin` may name several "
            "axes. Apply it to one name at a time, or use `chunk_size=None`."
        )


def _function_name(closed: Any) -> str:
    info = getattr(getattr(closed, "jaxpr", None), "debug_info", None)
    return str(getattr(info, "func_src_info", "") or "").split(" ")[0]


def _refuse(eqn: Any, found: list[str], axis_name: Hashable, api: str) -> Exception:
    name = eqn.primitive.name
    what = ", ".join(f"`{f}`" for f in found)
    head = f"`{api}(..., axis_name={axis_name!r})`: the collective(s) {what} over "
    head += f"{axis_name!r} "
    if name in _LOOPS:
        why = (
            f"run inside a `lax.{'while_loop' if name == 'while' else name}` body, "
            "where each step may depend on the loop's carry, so the batch cannot be "
            "split around them. Move the collective out of the loop, or use "
            "`chunk_size=None` (or at least the batch size)."
        )
    elif name == "cond":
        why = (
            "run inside a `lax.cond`/`lax.switch` whose predicate is the same for "
            "every element, which only one branch's collectives may see. Compute "
            "the collective before the `cond`, select with `jnp.where`, or use "
            "`chunk_size=None` (or at least the batch size)."
        )
    elif name in CUSTOM:
        fn = eqn.params.get("name") or _function_name(eqn.params.get("call_jaxpr"))
        why = (
            f"run inside the custom-derivative function {fn!r} "
            f"(`jax.{name.removesuffix('_call').removesuffix('_call_jaxpr')}`), whose "
            "rule would be lost by splitting the batch around them. Move the "
            "collective out of the custom-derivative function, or use "
            "`chunk_size=None` (or at least the batch size)."
        )
    else:
        why = (
            f"run inside `{name}`, which chunks of the batch cannot split. Use "
            "`chunk_size=None` (or at least the batch size)."
        )
    return ValueError(head + why)
