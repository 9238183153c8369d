"""Cotangents that keep the weak type the chunk function's transpose gives them.

JAX has no rule that types a cotangent like its primal: a cotangent has whatever
weak type the transposes on its way produce (`dot_general` gives a strong one, `mul`
keeps its operand's), and `jax.vmap` passes the chunk function's through. The
loop's own linear steps would override it: transposing the slices that split a
tangent into chunks gives a strong cotangent, the sum of an unmapped input's
cotangents over the steps (the reverse scan's carry) is typed like the input, a
conversion converts back, and `jax.checkpoint` (around each step) transposes with
cotangents typed like its forward outputs. So each tangent passes a pair of
identities: `fork` where it enters the loop's plumbing (with a zero-size *probe*
per place it reaches) and `join` where it arrives (with its probe). In reverse
mode, `join` writes the weak type of the cotangent it sees into the probe's
cotangent, which travels back beside it (a scanned output, for a step of the loop),
and `fork` gives the cotangent that leaves it that weak type.

The probes hold no elements and the conversions change no dtype: the compiled
program's memory is unchanged (`benchmarks/derivatives.py`). A probe that sees no
cotangent (a symbolic zero, or zeros JAX makes up) carries the weak type of the
tangent it was forked from, as JAX types such zeros.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.core import ShapedArray
from jax.interpreters import ad, batching, mlir
from jaxtyping import PyTree

from .._custom_types import InputArray, is_none
from .._jax_compat import with_weak_type


Shape = tuple[int, ...]


def is_weak(x: Any) -> bool:
    """Whether `x` is weakly typed."""
    return bool(jax.typeof(x).weak_type)


def _retyped(x: InputArray, weak_type: bool | None) -> InputArray:
    if weak_type is None or is_weak(x) == weak_type:
        return x
    return with_weak_type(x, weak_type)


def _probe(shape: Shape, dtype: Any, weak_type: bool) -> InputArray:
    return with_weak_type(jnp.zeros(shape, dtype), weak_type)


fork_p = jex.Primitive("chunk_weak_type_fork")
fork_p.multiple_results = True
join_p = jex.Primitive("chunk_weak_type_join")


def fork(
    t: InputArray | np.generic | tuple[InputArray, InputArray],
    shapes: Sequence[Shape],
) -> tuple[InputArray, list[InputArray]]:
    """`t` and, per shape, a probe of that shape with no elements, whose cotangent
    gives `t`'s its weak type.

    `t` may be a strongly and a weakly typed copy of one tangent (see
    `strong_and_weak`): the cotangent then goes to the copy with its weak type, and
    a symbolic zero to the other (so that `jax.checkpoint` transposes the copy
    with the right type).
    """
    assert all(0 in shape for shape in shapes)
    # A NumPy tangent (a scalar, for a closed-over NumPy constant).
    ts = t if isinstance(t, tuple) else (jnp.asarray(t),)
    out = fork_p.bind(*ts, shapes=tuple(shapes))
    return out[0], list(out[1:])


def join(t: InputArray, probe: InputArray, weak_type: bool | None = None) -> InputArray:
    """`t` (weakly typed if `weak_type`, unchanged if `None`), whose cotangent's
    weak type goes into `probe`'s cotangent."""
    return join_p.bind(t, probe, weak_type=weak_type)


def strong_and_weak(t: InputArray) -> tuple[InputArray, InputArray]:
    """Copies of `t`, strongly and weakly typed, for `fork`; their
    cotangents keep their own weak types.

    Inside `jax.checkpoint`, which each step of the loop is, JAX transposes with
    cotangents typed like the forward outputs, whatever the cotangents it is given:
    the step returns both copies, so that the one that gets the cotangent is typed
    like it.
    """
    copies = []
    for weak_type in (False, True):
        _t, (probe,) = fork(t, [(0,)])
        copies.append(join(_t, probe, weak_type))
    return copies[0], copies[1]


@fork_p.def_impl
def _fork_impl(*ts: InputArray, shapes: tuple[Shape, ...]) -> list[InputArray]:
    return [ts[0], *(_probe(shape, ts[0].dtype, is_weak(ts[0])) for shape in shapes)]


@fork_p.def_abstract_eval
def _fork_abstract_eval(*ts: Any, shapes: tuple[Shape, ...]) -> list[Any]:
    t = ts[0]
    probes = [ShapedArray(s, t.dtype, weak_type=t.weak_type) for s in shapes]
    return [t, *probes]


@join_p.def_impl
def _join_impl(
    t: InputArray, probe: InputArray, *, weak_type: bool | None
) -> InputArray:
    del probe
    return _retyped(t, weak_type)


@join_p.def_abstract_eval
def _join_abstract_eval(t: Any, probe: Any, *, weak_type: bool | None) -> Any:
    del probe
    return t if weak_type is None else t.update(weak_type=weak_type)


def _fork_transpose(cts: Sequence[Any], *ts: Any, shapes: tuple[Shape, ...]) -> list:
    del shapes
    ct, *probes = cts
    if type(ct) is ad.Zero:
        return [ad.Zero(t.aval) for t in ts]
    seen = [is_weak(p) for p in probes if type(p) is not ad.Zero]
    weak_type = all(seen) if seen else is_weak(ct)
    if len(ts) == 1:
        return [_retyped(ct, weak_type)]
    strong, weak = ts
    if weak_type:
        return [ad.Zero(strong.aval), _retyped(ct, True)]
    return [_retyped(ct, False), ad.Zero(weak.aval)]


def _join_transpose(ct: Any, t: Any, probe: Any, *, weak_type: bool | None) -> list:
    del t, weak_type
    if not isinstance(probe, ad.UndefinedPrimal):  # a known (zero) tangent's
        return [ct, None]
    if type(ct) is ad.Zero:
        return [ct, ad.Zero(probe.aval)]
    return [ct, _probe(probe.aval.shape, probe.aval.dtype, is_weak(ct))]


def _fork_jvp(primals: Any, tangents: Any, **params: Any) -> tuple[Any, Any]:
    tangents = map(ad.instantiate_zeros, tangents)
    return fork_p.bind(*primals, **params), fork_p.bind(*tangents, **params)


def _join_jvp(primals: Any, tangents: Any, **params: Any) -> tuple[Any, Any]:
    dt, dprobe = map(ad.instantiate_zeros, tangents)
    return join_p.bind(*primals, **params), join_p.bind(dt, dprobe, **params)


def _fork_batch(args: Any, dims: Any, **params: Any) -> tuple[Any, Any]:
    if len(set(dims)) > 1:  # copies of one tangent: never so, but cheap to allow
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        args, dims = (
            [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)],
            [0],
        )
    out = fork_p.bind(*args, **params)
    return out, [dims[0]] + [None] * (len(out) - 1)


def _join_batch(args: Any, dims: Any, **params: Any) -> tuple[Any, Any]:
    # The probe's shape only shapes its cotangent: it may stay batched.
    return join_p.bind(*args, **params), dims[0]


ad.primitive_transposes[fork_p] = _fork_transpose
ad.primitive_transposes[join_p] = _join_transpose
ad.primitive_jvps[fork_p] = _fork_jvp
ad.primitive_jvps[join_p] = _join_jvp
batching.primitive_batchers[fork_p] = _fork_batch
batching.primitive_batchers[join_p] = _join_batch
mlir.register_lowering(fork_p, mlir.lower_fun(_fork_impl, multiple_results=True))
mlir.register_lowering(join_p, mlir.lower_fun(_join_impl, multiple_results=False))


def fork_tree(
    tangents: PyTree[Any], shapes: list[tuple[int, ...]]
) -> tuple[PyTree[Any], ...]:
    """`fork` of every tangent: the tangents, then a tree of probes per shape.

    A tangent may be any array JAX hands a rule: a NumPy scalar among them (the
    zero tangent of a closed-over NumPy constant)."""
    leaves, treedef = jtu.tree_flatten(tangents, is_leaf=is_none)
    columns: list[list[InputArray | None]] = [[] for _ in range(1 + len(shapes))]
    for t in leaves:
        t, probes = (None, [None] * len(shapes)) if t is None else fork(t, shapes)
        for column, x in zip(columns, [t, *probes], strict=True):
            column.append(x)
    return tuple(jtu.tree_unflatten(treedef, column) for column in columns)


def join_tree(tangents: PyTree[Any], probes: PyTree[Any]) -> PyTree[Any]:
    return jtu.tree_map(
        lambda t, p: None if t is None else join(t, p),
        tangents,
        probes,
        is_leaf=is_none,
    )


def fork_output(t: tuple[InputArray, InputArray]) -> tuple[InputArray, InputArray]:
    """One tangent (from its two copies) and a probe."""
    out, (probe,) = fork(t, [(0,)])
    return out, probe


def fork_outputs(
    t_out: list[tuple[InputArray, InputArray] | None],
) -> tuple[list[InputArray | None], list[InputArray | None]]:
    forked = [(None, None) if t is None else fork_output(t) for t in t_out]
    return [t for t, _ in forked], [probe for _, probe in forked]
