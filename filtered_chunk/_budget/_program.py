"""The program a memory budget measures: the chunked call as the transformations
around it (read off the tracers of its inputs and closed-over arrays, innermost
first) will run it. A `LinearizeTracer` (`grad`, `vjp`, `jacrev`, `linearize`) is a
pullback or a linearisation, which the primal trace cannot tell apart: both are
measured, the larger counts. A `JVPTracer` (`jvp`, `jacfwd`) pushes as many tangents
at once as it carries. A `BatchTracer` (an outer `vmap`) is looked through: the
budget is per element of the outer map.

What a transformation feeds in is an argument, never a constant such as ones, which
XLA would fold away. Tangents are counted, as the surrounding program allocates
them (the basis under `jacfwd`). A pullback's cotangent is computed from the
outputs, as by the user's loss: fed in independently, it let XLA run the backward
pass of a separate remainder right after its forward pass, which the user's program
cannot (its cotangent needs every output): the search measured 658,056 bytes at 3
elements per chunk where `jax.jit` of `jax.grad` needs 1,044,216 (issue 23, item 10).
"""

import dataclasses
import functools as ft
import hashlib
import math
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._eager import program_key
from .._jax_compat import (
    count_every_buffer,
    fusions_uncounted,
    own_count,
    transformations_tracing,
)
from .._mesh import leaf_sharding
from .._sharding import on_devices
from .._structs import struct
from . import _timing


Program = Callable[[list[Any]], list[Any]]


@dataclasses.dataclass(frozen=True)
class Layer:
    """One transformation around the call: `"reverse"` or `"forward"`, the leaves
    it differentiates, and (forward) how many tangents it pushes at once."""

    kind: str
    mask: tuple[bool, ...]
    batch: int | None = None


def _inexact(x: Any) -> bool:
    return bool(jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact))


def layers_of(leaves: list[Any]) -> tuple[Layer, ...]:
    """The transformations around a call with these input leaves, innermost first."""
    chains = [transformations_tracing(x) if _inexact(x) else [] for x in leaves]
    order: list[tuple[Any, str, int | None]] = []  # `(trace, kind, batch)`
    for chain in sorted(chains, key=len, reverse=True):
        for entry in chain:
            if all(entry[0] is not seen[0] for seen in order):
                order.append(entry)
    return tuple(
        Layer(kind, tuple(any(trace is c[0] for c in ch) for ch in chains), batch)
        for trace, kind, batch in order
    )


def _plain(x: Any, batch: int | None = None) -> jax.ShapeDtypeStruct:
    if batch is None:
        return struct(x, weak=False, sharding=getattr(x, "sharding", None))
    return jax.ShapeDtypeStruct((batch, *x.shape), x.dtype)


def _select(xs: list[Any], mask: list[bool], keep: bool = True) -> list[Any]:
    return [x for x, m in zip(xs, mask, strict=True) if m == keep]


def _apply(
    fn: Program, structs: list[Any], layer: Layer, linearize: bool
) -> tuple[Program, list[Any]]:
    """`fn` under `layer`: its arguments extended by what the layer feeds in."""
    n = len(structs)
    mask = [*layer.mask, *[False] * (n - len(layer.mask))]
    outs = jax.eval_shape(fn, structs)
    inexact = [_inexact(o) for o in outs]
    if layer.kind == "reverse" and not linearize:
        extra = [_plain(o) for o in _select(outs, inexact)]
    else:
        extra = [_plain(s, layer.batch) for s in _select(structs, mask)]

    def _program(args: list[Any]) -> list[Any]:
        base, fed = args[:n], args[n:]

        def _f(_diff: list[Any]) -> tuple[list[Any], list[Any]]:
            # The masked inputs to the inexact outputs, the others as auxiliary data.
            it = iter(_diff)
            _outs = fn([next(it) if m else x for x, m in zip(base, mask, strict=True)])
            return _select(_outs, inexact), _select(_outs, inexact, keep=False)

        diff = _select(base, mask)
        if layer.kind == "reverse" and not linearize:
            out, pullback, others = jax.vjp(_f, diff, has_aux=True)
            # The loss `sum(fed * out**2)`, its cotangent from the outputs (the backward
            # pass waits for them all), as `value_and_grad(..., has_aux=True)` runs it.
            cotangents = [c * o for c, o in zip(fed, out, strict=True)]
            values = [jnp.sum(c * o) for c, o in zip(cotangents, out, strict=True)]
            return [*out, *others, *values, *pullback(cotangents)[0]]
        if layer.kind == "reverse":
            out, push, others = jax.linearize(_f, diff, has_aux=True)
            return [*out, *others, *push(fed)]
        _jvp = lambda t: jax.jvp(_f, (diff,), (t,), has_aux=True)  # noqa: E731
        if layer.batch is not None:
            _jvp = jax.vmap(_jvp, out_axes=(None, 0, None))
        out, tangents, others = _jvp(fed)
        return [*out, *others, *tangents]

    return _program, [*structs, *extra]


def transformed(
    fn: Program, structs: list[Any], layers: tuple[Layer, ...], linearize: bool
) -> tuple[Program, list[Any], int]:
    """`fn` as `layers` run it (reverse layers as pullbacks, or as linearisations
    if `linearize`), its argument structs, and the bytes of the tangents fed in."""
    fed = 0
    for layer in layers:
        num_args = len(structs)
        fn, structs = _apply(fn, structs, layer, linearize)
        if layer.kind == "forward" or linearize:
            fed += sum(argument_bytes(s) for s in structs[num_args:])
    return fn, structs, fed


def argument_bytes(s: jax.ShapeDtypeStruct) -> int:
    """The bytes of an argument of type `s` (on each device, if split)."""
    shape = s.shape if s.sharding is None else s.sharding.shard_shape(s.shape)
    # `s.dtype`'s own size: a PRNG key's (`key<fry>`) is not a NumPy type.
    return math.prod(shape) * s.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Measured:
    """XLA's temporary and output bytes of a program, and the tangents' it is fed."""

    temp: int
    output: int
    fed: int = 0

    @property
    def total(self) -> int:
        return self.temp + self.output + self.fed


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.core.Tracer):
        # Explicit-sharding mode puts the sharding in the type, under `jax.jit`
        # too: the program is split as the call's (`shard_map` over the batch).
        sharding = leaf_sharding(x)
        if sharding is None or not sharding.mesh.explicit_axes:
            return struct(x)
        split = any(entry is not None for entry in sharding.spec)
        return struct(x, sharding=sharding if split else None)
    concrete = isinstance(x, jax.Array)
    # A concrete array split over devices: per-device bytes, as the call runs.
    split = concrete and len(x.sharding.device_set) > 1
    return struct(x, sharding=x.sharding if split else None)


_compilations = 0  # of `ChunkedProgram.compile`, in this process


def compilations() -> int:
    """How many programs the budgets of this process compiled (`ChunkSizeChoice`'s
    `compilations` is the difference across a choice)."""
    return _compilations


class ChunkedProgram:
    """The chunked call at any chunk size, as a function of abstract inputs."""

    def __init__(self, run: Callable[[int | None, Any], Any], tree: PyTree[Any]):
        dynamic, self.static = eqx.partition(tree, eqx.is_array)
        self.leaves, self.treedef = jtu.tree_flatten(dynamic)
        self.run = run
        self.structs = [_struct(x) for x in self.leaves]
        self.examples: dict[Hashable, Any] = {}  # shared by the programs timed
        self._traced: dict[int | None, Any] = {}

    def trace(self, k: int | None) -> Any:
        """The jaxpr at `k`, traced once (its key, its pullback and its
        linearisation share it); its consts may be outer tracers or closed-over
        arrays."""

        def _fn(_leaves: list[Any]) -> Any:
            tree = eqx.combine(jtu.tree_unflatten(self.treedef, _leaves), self.static)
            return jtu.tree_leaves(eqx.filter(self.run(k, tree), eqx.is_array))

        if k not in self._traced:
            self._traced[k] = jax.make_jaxpr(_fn)(self.structs)
        return self._traced[k]

    def key(
        self, k: int | None = None
    ) -> tuple[tuple[Hashable, ...] | None, tuple[Layer, ...]]:
        """What measurements depend on (the program at `k`, by default the unchunked
        one, and its callables' identities, the inputs' types, the
        transformations), and the transformations."""
        closed = self.trace(k)
        layers = layers_of([*closed.consts, *self.leaves])
        structs = [*map(_struct, closed.consts), *self.structs]
        try:
            key = (
                str(closed.jaxpr),
                tuple(program_key(closed.jaxpr, evaluated_only=False)),
                tuple(
                    (s.shape, str(s.dtype), s.weak_type, s.sharding) for s in structs
                ),
                layers,
            )
            hash(key)
        except TypeError:
            return None, layers
        return key, layers

    def lower(self, k: int | None, linearize: bool = False) -> "Lowered":
        """The call at `k` lowered as the transformations run it (reverse mode as
        a linearisation if `linearize`), to compile."""
        closed = self.trace(k)
        consts, n = list(closed.consts), len(closed.consts)
        layers = layers_of([*consts, *self.leaves])
        _forward = lambda _x: jax.core.eval_jaxpr(closed.jaxpr, _x[:n], *_x[n:])
        structs = [_struct(x) for x in consts] + self.structs
        fn, structs, fed = transformed(_forward, structs, layers, linearize)
        structs = on_devices(structs, [*consts, *self.leaves])

        @ft.cache  # made on the first run
        def _arguments() -> list[Any]:
            known = [*consts, *self.leaves]
            return _timing.example_arguments(structs, known, self.examples)

        return Lowered(jax.jit(fn).lower(structs), fed, _arguments)


class Lowered:
    """A program of the call at one size, lowered; the bytes of the tangents it is
    fed (`fed`); compiled as it runs (`compiled`) and, on CPU, as XLA counts every
    buffer (`every_buffer`), each once. The first of the two counts it in
    `compilations()`."""

    def __init__(
        self, lowered: Any, fed: int, arguments: Callable[[], list[Any]]
    ) -> None:
        self.lowered, self.fed, self._arguments = lowered, fed, arguments
        self._compiled: Any = None
        self._every: Measured | None = None
        self._fingerprint: str | None = None
        self._counted = False

    def _count(self) -> None:
        global _compilations
        _compilations += not self._counted
        self._counted = True

    def fingerprint(self) -> str:
        """A hash of its text as lowered: on one machine and the same versions and
        flags (`_store.machine`), XLA compiles the same text to the same bytes.
        Computed once."""
        if self._fingerprint is None:
            text = self.lowered.as_text().encode()
            self._fingerprint = hashlib.sha256(text).hexdigest()
        return self._fingerprint

    def compiled(self) -> tuple[Measured, Callable[[], Any]]:
        """Its bytes as XLA counts them for the program that runs, and a run of it
        on example arguments."""
        if self._compiled is None:
            self._compiled = self.lowered.compile()
            self._count()
        compiled = self._compiled
        measured = Measured(*own_count(compiled), self.fed)
        return measured, lambda: compiled(self._arguments())

    def every_buffer(self) -> Measured | None:
        """On CPU, its bytes compiled with XLA's YNNPACK fusions off, where XLA
        counts every buffer (`count_every_buffer`); `None` elsewhere."""
        if self._every is None:
            found = count_every_buffer(self.lowered)
            if found is None:
                return None
            self._count()
            self._every = Measured(*found, self.fed)
        return self._every

    def full(self) -> Measured:
        """Its bytes with every buffer counted: XLA's count of the program that
        runs, plus on CPU what its YNNPACK fusions keep (`fusions_uncounted`);
        where one uses a dot's or a convolution's result further, at least
        `every_buffer()`."""
        own = self.compiled()[0]
        found = fusions_uncounted(self._compiled)
        if found is None:
            return own
        kept = dataclasses.replace(own, temp=own.temp + found.bytes)
        every = self.every_buffer() if found.dots else None
        return kept if every is None or kept.total >= every.total else every


def linearisation(program: ChunkedProgram, k: int | None) -> Measured | None:
    """The call at `k` as a linearisation, counted in full (`Lowered.full`), or
    `None` under a `jax.custom_vjp` (a `TypeError`) or a primitive without a JVP
    rule (`NotImplementedError`): the transformation around it is then a
    pullback, measured alone (issue 23, item 8)."""
    try:
        return program.lower(k, linearize=True).full()
    except (TypeError, NotImplementedError):
        return None
