"""How the loop reports to a progress meter: elements done out of the batch size.

Each step of the loop calls back to the host once, with the elements done
(`min(end of the step, batch_size)`: the overlapping last chunk never counts twice)
and one element of the step's outputs, a data dependency so that the call happens
after the step's work rather than wherever XLA schedules it. The first step's report
opens a meter's state and the last closes it: each *execution* of a compiled program
gets its own state, and a loop without a meter has no callback at all.

The callback is a primitive of this module rather than `jax.debug.callback`, which
wraps its callable in a new closure on every trace (defeating the compiled program
cache of eager calls, keyed on the callables in the jaxpr: see `_eager.py`) and
copies the operands with `jax.device_put` on the host, several times slower per call
(`benchmarks/progress.py`). Its rules, in JAX's public tables (`jax.interpreters`),
make it behave as a debug callback, as each says; only its lowering takes JAX
internals, as `jax.debug.callback`'s does (`_jax_compat.lower_host_callback`).
`tests/test_progress.py` exercises each rule.
"""

import atexit
import contextlib
import contextvars
import functools as ft
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.interpreters import ad, batching, mlir, partial_eval as pe
from jaxtyping import Array, PyTree

from ._jax_compat import lower_host_callback
from ._progress import AbstractProgressMeter, is_reporting


# Host side: the meter state of each loop that is running, keyed by its reporter.
_lock = threading.RLock()
_running: dict["Reporter", tuple[int, Any]] = {}
_serial = itertools.count()


def _close(reporter: "Reporter") -> None:
    _, state = _running.pop(reporter)
    reporter.methods[2](reporter.meter, state)


def _close_opened_after(first: int) -> None:
    with _lock:
        for reporter in [r for r, (n, _) in _running.items() if n > first]:
            _close(reporter)


atexit.register(_close_opened_after, -1)


@contextlib.contextmanager
def closing_on_error() -> Iterator[None]:
    """Closes the meters a failing call opened (outside `jit` the failure of a
    compiled program reaches Python here)."""
    first = next(_serial)
    try:
        yield
    except BaseException:
        _close_opened_after(first)
        raise


class Reporter:
    """What a loop reports to its meter: a callable, equal across traces of the
    same loop (so that eager calls hit the compiled program cache)."""

    # `_eager.py` may match a cached program's reporter by value: its equality
    # covers everything that decides where its reports go.
    cache_by_value = True

    _FIELDS = ("meter", "label", "total", "first", "last", "scale", "stride")
    # `__weakref__`: JAX keeps weak references to parameters.
    __slots__ = (*_FIELDS, "_key", "_hash", "methods", "__weakref__")

    def __init__(
        self,
        meter: AbstractProgressMeter,
        label: str,
        total: int,  # the batch size, over all devices
        first: int,  # the elements one device has done after its first step
        last: int,  # ... after its last step
        scale: int,  # the number of devices the batch is split over
        stride: int,  # report every `stride` steps (and the last one)
    ) -> None:
        self.meter, self.label, self.total = meter, label, total
        self.first, self.last, self.scale, self.stride = first, last, scale, stride
        # Called through the class: an `eqx.Module`'s bound method costs about
        # 50 us to make, on every step (`benchmarks/progress.py`).
        cls = type(meter)
        self.methods = (cls.open, cls.update, cls.close)
        # A meter is an `eqx.Module`: a value, rebuilt by every tree operation, so
        # it is compared by value, with the equality Equinox gives every Module
        # (all fields). A class that overrides `__eq__` (which may ignore state,
        # and so send reports to an old meter) or an unhashable meter is compared
        # by identity; the reporter holds a reference, so the `id` is not reused.
        try:
            if type(meter).__eq__ is not AbstractProgressMeter.__eq__:
                raise TypeError
            self._hash = hash(meter)
            key: Any = meter
        except TypeError:
            key = self._hash = id(meter)
        # Hashed once: the host looks the reporter up on every step.
        self._key = (key, label, total, first, last, scale, stride)
        self._hash = hash((self._hash, *self._key[1:]))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Reporter) or self._hash != other._hash:
            return False
        return self is other or bool(self._key == other._key)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._FIELDS)
        return f"Reporter({fields})"

    def __call__(self, done: Any, *rest: Any) -> None:
        # `rest`: the device's index over the batch's mesh axes (if sharded), then
        # the data dependency.
        if self.scale > 1 and int(rest[0]) != 0:
            return  # one report per step for a sharded batch: the first shard's
        done = int(done)
        with _lock:
            if done == self.first:
                if self in _running:  # a failed execution's
                    _close(self)
                state = self.methods[0](self.meter, self.label, self.total)
                _running[self] = (next(_serial), state)
            if self not in _running:
                return
            _, state = _running[self]
            ended = done >= self.last
            count = self.total if ended else min(done * self.scale, self.total)
            self.methods[1](self.meter, state, count)
            if ended:
                _close(self)


progress_p = jex.Primitive("chunk_progress")
progress_p.multiple_results = True
# JAX's unordered debug effect: allowed under control flow, `custom_jvp` and
# `checkpoint`, which JAX registers by the effect's type.
_debug_effect = jax.debug.DebugEffect()
progress_p.def_impl(lambda *args, callback: callback(*args) or [])
progress_p.def_effectful_abstract_eval(lambda *_, callback: ([], {_debug_effect}))


def _batch(args: Sequence[Any], dims: Sequence[Any], **params: Any) -> Any:
    # Report once per step, not once per element of an outer `vmap`.
    args = [
        x if d is None else lax.index_in_dim(x, 0, d, keepdims=False)
        for x, d in zip(args, dims, strict=True)
    ]
    return progress_p.bind(*args, **params), []


batching.primitive_batchers[progress_p] = _batch
# No tangent and no transpose (of `primals, tangents`): it returns nothing.
ad.primitive_jvps[progress_p] = lambda p, t, **kw: (progress_p.bind(*p, **kw), [])
ad.primitive_transposes[progress_p] = lambda _, *args, **params: [None] * len(args)


def _partial_eval_custom(
    saveable: Any, unks_in: Sequence[bool], inst_in: Sequence[bool], eqn: Any
) -> tuple[Any, Any, list[Any], list[Any], list[Any]]:
    """Known operands: report in the known (forward) jaxpr only. A debug callback
    would also be staged into the rematerialised one, so that the forward pass of
    a `jax.checkpoint` around a chunked call would be reported twice."""
    del saveable
    if any(unks_in):
        residuals = [v for v, inst in zip(eqn.invars, inst_in) if not inst]
        return None, eqn, [], [], residuals
    return eqn, None, [], [], []


pe.partial_eval_jaxpr_custom_rules[progress_p] = _partial_eval_custom


_lower = lambda ctx, *a, callback: lower_host_callback(ctx, a, callback, _debug_effect)
mlir.register_lowering(progress_p, _lower, platform="cpu")
mlir.register_lowering(progress_p, _lower, platform="gpu")
# Python callbacks use channel IDs on TPU, which must not be cached.
mlir.register_lowering(progress_p, _lower, platform="tpu", cacheable=False)


# Trace side.
class _Context(NamedTuple):
    outer: bool = False  # inside the loop of a chunked call that reports
    axis_names: tuple[str, ...] = ()
    num_devices: int = 1
    elements: int | None = None  # of a batch padded to a multiple of the devices


_context = contextvars.ContextVar("filtered_chunk_progress", default=_Context())


@contextlib.contextmanager
def _set(**changes: Any) -> Iterator[None]:
    token = _context.set(_context.get()._replace(**changes))
    try:
        yield
    finally:
        _context.reset(token)


def sharded(axis_names: tuple[str, ...], num_devices: int, elements: int) -> Any:
    """While tracing one device's loop inside `shard_map`: report once, scaled, out
    of the batch's `elements` (its padding not counted)."""
    return _set(axis_names=axis_names, num_devices=num_devices, elements=elements)


def reporter(
    meter: AbstractProgressMeter | None, api: str, steps: Any, loop: str | None = None
) -> Reporter | None:
    """What a loop of `steps` (`_loop.Steps`) reports to `meter`: `None` if
    nothing (no meter, or inside the loop of an outer chunked call that reports,
    since nested bars interleave). `loop` says which of a call's loops it is
    (`"loop 1 of 3"`), in the label."""
    context = _context.get()
    if not is_reporting(meter) or context.outer:
        return None
    assert meter is not None
    label = getattr(meter, "label", None) or api
    label = label if loop is None else f"{label} ({loop})"
    scale = context.num_devices
    # At most `max_updates` reports per call: each costs a host callback.
    stride = -(-steps.num_steps // max(1, meter.max_updates))
    total = steps.batch_size * scale
    total = total if context.elements is None else min(total, context.elements)
    return Reporter(meter, label, total, steps.chunk_size, steps.covered, scale, stride)


def quiet(fn: Callable[..., Any], found: Reporter | None) -> Callable[..., Any]:
    """`fn`, traced so that the chunked calls inside it report as calls of their
    own: not at all if the loop calling it does (nested bars interleave), and
    never scaled to the devices that split the batch around them."""
    context = _context.get()
    inner = _Context(outer=context.outer or found is not None)
    if inner == context:
        return fn

    @ft.wraps(fn)
    def _quiet(*args: Any, **kwargs: Any) -> Any:
        with _set(**inner._asdict()):
            return fn(*args, **kwargs)

    return _quiet


def _dependency(tree: PyTree[Array]) -> list[Array]:
    """One element of the first numeric array of `tree` that has one: the outputs
    once written into the full-size buffers, so that the report follows the whole
    step, its write included (the compiled loop is otherwise the same: no copy is
    added, checked on the HLO of `benchmarks/progress.py`'s workload)."""
    for x in jtu.tree_leaves(tree):
        if x.size and (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == bool):
            return [lax.reshape(lax.slice(x, (0,) * x.ndim, (1,) * x.ndim), ())]
    return []


def report_step(
    found: Reporter | None, start: Array, size: int, outputs: PyTree[Array]
) -> None:
    """Reports the elements done after the step of `size` elements at `start`
    that wrote `outputs` (nothing at all without a reporter)."""
    if found is None:
        return
    done = jnp.asarray(start + size, jnp.int32)
    index = [lax.axis_index(_context.get().axis_names)] if found.scale > 1 else []
    operands = [done, *index, *_dependency(outputs)]

    def _report() -> None:
        progress_p.bind(*operands, callback=found)

    if found.stride == 1:
        return _report()
    # Every `stride`-th step from the first (which opens), and the last (which
    # closes). Steps that do not report skip the callback altogether.
    step = done // size - 1
    lax.cond((step % found.stride == 0) | (done >= found.last), _report, lambda: None)
