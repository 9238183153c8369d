"""The program a memory budget measures: the chunked call as the transformations
around it will run it.

A chunked call chooses its chunk size when it is traced, and under `jax.grad` or
`jax.jvp` what then runs is not the call but its derivative. The transformations
are read off the tracers of the call's inputs (and of the arrays it closes over),
innermost first, and replayed on the traced call before it is compiled:

- a `LinearizeTracer` (`jax.grad`, `value_and_grad`, `vjp`, `jacrev`,
  `linearize`) is reverse mode or a linearisation, and which one cannot be told
  from the primal trace: the call is measured both as its pullback (`jax.vjp`)
  and as its linearisation (`jax.linearize`) applied to tangents, and the larger
  counts;
- a `JVPTracer` (`jax.jvp`, `jacfwd`) is forward mode: the call is measured as
  `jax.jvp`, its primal and tangent outputs, pushing as many tangents at once as
  the tracer carries (`jacfwd` and `hessian` push a batch of basis vectors);
- a `BatchTracer` (an outer `jax.vmap`) is looked through: the budget holds per
  element of the outer map.

Every value the transformation feeds in (cotangents, tangents) comes from an
argument of the measured program, never a constant such as ones, which XLA would
fold away: a real loss's cotangent is not constant. The tangents (a
linearisation's, forward mode's) are those arguments, and their bytes are
counted, since the surrounding program allocates them for the call (the basis
under `jacfwd`). A pullback's cotangent is instead computed from the call's
outputs, as the user's loss computes it, and returned with the loss's value and
the outputs (`_as_a_loss_gives_it`: the program of `jax.value_and_grad(...,
has_aux=True)` returning predictions, the largest that reverse mode runs): it
is then a temporary of the measured program, as of the user's, and its argument
is not counted. Fed in as an independent argument, it let XLA run the backward
pass of a separate remainder right after its forward pass, which the user's
program cannot (its cotangent needs every output): with `remainder="separate"`
the search measured 658,056 bytes at 3 elements per chunk where `jax.jit` of
`jax.grad` needs 1,044,216, the remainder's working set being live beside the
loop's (issue 23, item 10).

A function holding a `jax.custom_vjp` has no linearisation (`linearisation`):
the transformation around its call is then a pullback, and only that is
measured (issue 23, item 8). `ChunkedProgram` traces and compiles the call at a
chunk size.
"""

import dataclasses
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
from .._jax_compat import transformations_tracing
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


def _chain(x: Any) -> list[tuple[Any, str, int | None]]:
    """The transformations tracing `x`, innermost first, as `(trace, kind, batch)`."""
    if not isinstance(x, jax.core.Tracer) or not _inexact(x):
        return []
    return transformations_tracing(x)


def layers_of(leaves: list[Any]) -> tuple[Layer, ...]:
    """The transformations around a call with these input leaves, innermost first."""
    chains = [_chain(x) for x in leaves]
    order: list[tuple[Any, str, int | None]] = []
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


def _differentiable(
    fn: Program, base: list[Any], mask: list[bool], inexact: list[bool]
):
    """`fn` as a function of its masked inputs, returning its inexact outputs and,
    as auxiliary data, the others."""

    def _fn(_diff: list[Any]) -> tuple[list[Any], list[Any]]:
        it = iter(_diff)
        outs = fn([next(it) if m else x for x, m in zip(base, mask, strict=True)])
        return (
            [o for o, i in zip(outs, inexact, strict=True) if i],
            [o for o, i in zip(outs, inexact, strict=True) if not i],
        )

    return _fn, [x for x, m in zip(base, mask, strict=True) if m]


def _as_a_loss_gives_it(fed: list[Any], out: list[Any]) -> tuple[list[Any], list[Any]]:
    """The value of a loss of the outputs `out` (`sum(fed * out**2)`, one per
    output) and its cotangents (`fed * out`, up to a factor): computed from
    the outputs, as the user's loss computes them, so that the backward pass
    waits for the whole forward pass; and returned with its value, as under
    `jax.value_and_grad`."""
    cotangents = [c * o for c, o in zip(fed, out, strict=True)]
    values = [jnp.sum(c * o) for c, o in zip(cotangents, out, strict=True)]
    return values, cotangents


def _apply(
    fn: Program, structs: list[Any], layer: Layer, linearize: bool
) -> tuple[Program, list[Any]]:
    """`fn` under `layer`: its arguments extended by what the layer feeds in."""
    n = len(structs)
    mask = [*layer.mask, *[False] * (n - len(layer.mask))]
    outs = jax.eval_shape(fn, structs)
    inexact = [_inexact(o) for o in outs]
    if layer.kind == "reverse" and not linearize:
        extra = [_plain(o) for o, i in zip(outs, inexact, strict=True) if i]
    else:
        extra = [_plain(s, layer.batch) for s, m in zip(structs, mask) if m]

    def _program(args: list[Any]) -> list[Any]:
        f, diff = _differentiable(fn, args[:n], mask, inexact)
        fed = args[n:]
        if layer.kind == "reverse" and not linearize:
            out, pullback, others = jax.vjp(f, diff, has_aux=True)
            values, cotangents = _as_a_loss_gives_it(fed, out)
            return [*out, *others, *values, *pullback(cotangents)[0]]
        if layer.kind == "reverse":
            out, push, others = jax.linearize(f, diff, has_aux=True)
            return [*out, *others, *push(fed)]
        _jvp = lambda t: jax.jvp(f, (diff,), (t,), has_aux=True)  # noqa: E731
        if layer.batch is not None:
            _jvp = jax.vmap(_jvp, out_axes=(None, 0, None))
        out, tangents, others = _jvp(fed)
        return [*out, *others, *tangents]

    return _program, [*structs, *extra]


def transformed(
    fn: Program, structs: list[Any], layers: tuple[Layer, ...], linearize: bool
) -> tuple[Program, list[Any], int]:
    """`fn` as `layers` run it (reverse layers as pullbacks, or as linearisations
    if `linearize`), its argument structs, and the bytes of the tangents the
    layers feed in (counted as the call's; a pullback's cotangent is a temporary
    of the program instead, `_as_a_loss_gives_it`)."""
    fed = 0
    for layer in layers:
        num_args = len(structs)
        fn, structs = _apply(fn, structs, layer, linearize)
        if layer.kind == "forward" or linearize:
            fed += sum(_bytes(s) for s in structs[num_args:])
    return fn, structs, fed


def _bytes(s: jax.ShapeDtypeStruct) -> int:
    sharding = s.sharding
    shape = s.shape if sharding is None else sharding.shard_shape(s.shape)
    return math.prod(shape) * jnp.dtype(s.dtype).itemsize


def has_reverse(layers: tuple[Layer, ...]) -> bool:
    return any(layer.kind == "reverse" for layer in layers)


@dataclasses.dataclass(frozen=True)
class Measured:
    """XLA's temporary and output bytes of a program, and the bytes of the
    tangents it is fed (counted as the call's)."""

    temp: int
    output: int
    fed: int = 0

    @property
    def total(self) -> int:
        return self.temp + self.output + self.fed


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    # A concrete array split over devices: per-device bytes, as the call runs.
    split = concrete and len(x.sharding.device_set) > 1
    return struct(x, sharding=x.sharding if split else None)


def _key_of(struct: jax.ShapeDtypeStruct) -> Hashable:
    return (struct.shape, str(struct.dtype), struct.weak_type, struct.sharding)


class ChunkedProgram:
    """The chunked call at any chunk size, as a function of abstract inputs."""

    def __init__(self, run: Callable[[int | None, Any], Any], tree: PyTree[Any]):
        dynamic, self.static = eqx.partition(tree, eqx.is_array)
        self.leaves, self.treedef = jtu.tree_flatten(dynamic)
        self.run = run
        self.structs = [_struct(x) for x in self.leaves]
        self.examples: dict[Hashable, Any] = {}  # shared by the programs timed

    def trace(self, k: int | None) -> Any:
        """The jaxpr at `k` (its constants may be an outer transformation's
        tracers, or arrays the call closes over)."""

        def _fn(_leaves: list[Any]) -> Any:
            tree = eqx.combine(jtu.tree_unflatten(self.treedef, _leaves), self.static)
            return jtu.tree_leaves(eqx.filter(self.run(k, tree), eqx.is_array))

        return jax.make_jaxpr(_fn)(self.structs)

    def key(self) -> tuple[Hashable | None, tuple[Layer, ...]]:
        """What the measurements depend on (the traced program, unchunked, and
        its callables' identities; the inputs' types; the transformations around
        it), and those transformations."""
        closed = self.trace(None)
        layers = layers_of([*closed.consts, *self.leaves])
        try:
            key = (
                str(closed.jaxpr),
                tuple(program_key(closed.jaxpr, evaluated_only=False)),
                tuple(_key_of(_struct(x)) for x in closed.consts),
                tuple(_key_of(s) for s in self.structs),  # with their shardings
                layers,
            )
            hash(key)
        except TypeError:
            return None, layers
        return key, layers

    def compile(
        self, k: int | None, linearize: bool = False
    ) -> tuple[Measured, Callable[[], Any]]:
        """XLA's temporary and output bytes of the call at chunk size `k` as the
        transformations around it run it (reverse mode as a linearisation if
        `linearize`), plus the bytes they feed in (`_program.py`); and a
        function that runs the compiled program on example arguments
        (`_timing.py`), made on its first call."""
        closed = self.trace(k)
        consts = list(closed.consts)
        layers = layers_of([*consts, *self.leaves])

        def _forward(leaves: list[Any]) -> list[Any]:
            return jax.core.eval_jaxpr(
                closed.jaxpr, leaves[: len(consts)], *leaves[len(consts) :]
            )

        structs = [_struct(x) for x in consts] + self.structs
        fn, structs, fed = transformed(_forward, structs, layers, linearize)
        compiled = jax.jit(fn).lower(structs).compile()
        analysis = compiled.memory_analysis()
        assert analysis is not None
        measured = Measured(
            int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes), fed
        )
        arguments: list[Any] = []

        def _run() -> Any:
            if not arguments:
                known = [*consts, *self.leaves]
                examples = _timing.example_arguments(structs, known, self.examples)
                arguments.append(examples)
            return compiled(arguments[0])

        return measured, _run


def linearisation(program: ChunkedProgram, k: int | None) -> Measured | None:
    """The call at `k` measured as a linearisation, or `None` where it has none.
    A `jax.custom_vjp` has no forward-mode derivative (JAX raises a `TypeError`;
    a primitive without a JVP rule, `NotImplementedError`): the transformation
    around such a call is then not a linearisation, which would raise for the
    user too, but a pullback, measured on its own (issue 23, item 8)."""
    try:
        return program.compile(k, linearize=True)[0]
    except (TypeError, NotImplementedError):
        return None
