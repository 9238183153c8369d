"""Every line of the package that depends on JAX's version or on JAX's internals.

The rest of the package uses JAX's public API only (`jax.interpreters.*` for the
rules of a primitive, `jax.extend.core` for jaxprs). What follows has no public
home, or changed between the JAX versions supported (`MIN_JAX` to the newest, as
in `pyproject.toml`), each in one place, checked against JAX itself by
`tests/test_jax_compat.py`: a JAX release that changes one fails there, loudly.
"""

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.core
import numpy as np
from jax._src import (
    debugging as _debugging,
    distributed as _distributed,
    named_sharding as _named_sharding,
    sharding_impls as _sharding_impls,
    traceback_util as _traceback_util,
)
from jax._src.interpreters.ad import LinearizeTracer as _LinearizeTracer
from jax._src.interpreters.batching import BatchTracer as _BatchTracer
from jax._src.lax.lax import _convert_element_type
from jax.interpreters import ad, mlir
from jaxtyping import Array

from ._fusions import Uncounted, uncounted


# The oldest JAX supported: `pyproject.toml` states the same bound, so that pip
# refuses an older one; this is for an install that bypassed it.
MIN_JAX = (0, 10, 0)
if jax.__version_info__ < MIN_JAX:
    raise ImportError(
        f"filtered_chunk needs jax>={'.'.join(map(str, MIN_JAX))}, but "
        f"jax {jax.__version__} is installed: upgrade jax and jaxlib."
    )


# Version-dependent: the mesh axes a value varies over inside `shard_map`, which
# JAX 0.10 moved from `ShapeDtypeStruct.vma` to `.manual_axis_type.varying`.
def varying_axes(struct: Any) -> tuple[str, ...]:
    """The manual mesh axes a `jax.ShapeDtypeStruct` or abstract value varies over."""
    manual = struct.manual_axis_type
    return () if manual is None else tuple(manual.varying)


# Version-dependent: from JAX 0.11 a `Jaxpr` holds the values of its constvars.
def without_const_values(jaxpr: Any) -> Any:
    """`jaxpr` with no values attached to its constvars (their number unchanged):
    `eqx.filter_closure_convert` passes a function's constants itself, beside its
    jaxpr; the copies that JAX 0.11 and later attach to the jaxpr are tracers of
    the trace that made it, which a derivative rule holding the function would
    keep alive after that trace ends (`jax.checking_leaks` reports them)."""
    consts = getattr(jaxpr, "consts", None)
    return jaxpr.with_consts([None] * len(consts)) if consts else jaxpr


# Internal: tracer classes and their fields. `jax.interpreters.ad` exports
# `JVPTracer` only, but `jax.grad`, `jax.vjp` and `jax.linearize` trace with a
# `LinearizeTracer`; an outer `vmap`'s `BatchTracer` is not exported either.
def _tangent_batch(x: Any) -> int | None:
    """How many tangents a `JVPTracer` carries at once: a `jacfwd` basis is a
    `vmap` of the tangent only (an outer `vmap` batches the primal too)."""
    t, primal = x.tangent, x.primal
    if not isinstance(t, _BatchTracer) or not isinstance(t.batch_dim, int):
        return None
    if isinstance(primal, _BatchTracer) and primal._trace is t._trace:
        return None
    return int(jax.typeof(t.val).shape[t.batch_dim])


def transformations_tracing(x: Any) -> list[tuple[Any, str, int | None]]:
    """The differentiating transformations tracing `x`, innermost first, each as
    `(trace, kind, batch)`: `kind` is `"reverse"` for a `LinearizeTracer`
    (`jax.grad`, `vjp`, `linearize`, `jacrev`) and `"forward"` for a `JVPTracer`
    with a nonzero tangent (`jax.jvp`, `jacfwd`), whose `batch` is how many
    tangents it pushes at once (else `None`). Other tracers (`vmap`, `jit`) are
    looked through."""
    found: list[tuple[Any, str, int | None]] = []
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, _LinearizeTracer):
            found.append((x._trace, "reverse", None))
            x = x.primal
        elif isinstance(x, ad.JVPTracer):
            if not isinstance(x.tangent, ad.Zero):
                found.append((x._trace, "forward", _tangent_batch(x)))
            x = x.primal
        else:
            x = getattr(x, "val", None)
    return found


# Internal: `lax.convert_element_type` always gives a strong type; a tangent must
# have its primal's, which only JAX's private conversion sets.
def with_weak_type(x: Array | np.ndarray, weak_type: bool) -> Array:
    """`x` with the same values and dtype, weakly typed if `weak_type`."""
    return _convert_element_type(x, jax.typeof(x).dtype, weak_type=weak_type)  # pyright: ignore[reportReturnType]


# Internal: tracebacks. JAX drops the frames of excluded files (Equinox excludes
# its own) from the traceback of an exception raised below an API boundary.
def exclude_from_tracebacks(path: str) -> None:
    _traceback_util.register_exclusion(os.path.dirname(path))


# JAX filters the tracebacks of exceptions raised below a call of the function.
api_boundary = _traceback_util.api_boundary


# Internal: the text of JAX's error for a batched output at out axis `None`.
_BATCHED_NONE = re.compile(
    r"at vmap out_axes((?:\[\d+\])*), got axis spec None but output was batched"
)


def batched_none_output(e: BaseException) -> tuple[int, ...] | None:
    """If `e` is `jax.vmap`'s error for an output with out axis `None` that varies
    over the batch, the key path JAX names below `out_axes` (`(0, 2)` for
    `out_axes[0][2]`); else `None`."""
    match = _BATCHED_NONE.search(str(e))
    if match is None:
        return None
    return tuple(int(i) for i in re.findall(r"\d+", match.group(1)))


# Internal: lowering a host callback. `jax.debug.callback` lowers through the
# same private functions; `mlir.emit_python_callback` is public, what places it
# on the devices (its sharding) is not.
def lower_host_callback(
    ctx: Any, args: Any, callback: Callable[..., None], effect: Any
) -> Any:
    """Lowers a call of `callback(*args)` on the host, returning nothing, with
    JAX's unordered debug `effect`."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, mlir.SPMDAxisContext):
        # Inside `shard_map`, JAX's own debug callback knows how to place it.
        return _debugging.debug_callback_lowering(
            ctx, *args, effect=effect, partitioned=False, callback=callback
        )
    sharding = None
    if isinstance(axis_context, mlir.ShardingContext):
        # Run it once, on the first device, as `jax.debug.callback` does.
        first = _named_sharding.SdyArray(
            mesh_shape=(), dim_shardings=(), logical_device_ids=(0,)
        )
        sharding = _sharding_impls.SdyArrayList((first,))
    mlir.emit_python_callback(
        ctx,
        lambda *flat: callback(*flat) or (),
        None,
        list(args),
        ctx.avals_in,
        ctx.avals_out,
        has_side_effect=True,
        returns_token=False,
        sharding=sharding,
    )
    return []


# Internal: the text of a failed `eqx.error_if` and JAX's log of the failed
# callback, which `eqx.filter_jit` turns into an `eqx.EquinoxRuntimeError`.
_CALLBACK_LOGGER = "jax._src.callback"
_EQX_MARK = "_EquinoxRuntimeError: "


@contextlib.contextmanager
def quiet_callback_errors() -> Iterator[None]:
    """Within, JAX's log of a failed callback is dropped, as `eqx.filter_jit` drops
    it: the error it logs is the one raised."""

    def _keep(record: logging.LogRecord) -> bool:
        failed = record.getMessage() == "jax.pure_callback failed"
        return not (record.name == _CALLBACK_LOGGER and failed)

    logger = logging.getLogger(_CALLBACK_LOGGER)
    logger.addFilter(_keep)
    try:
        yield
    finally:
        logger.removeFilter(_keep)


def equinox_runtime_message(e: BaseException) -> str | None:
    """The message of the `eqx.error_if` that raised `e` in a running program, or
    `None` if `e` is some other error."""
    _, mark, message = str(e).partition(_EQX_MARK)
    return message.split("\n\n\n-----", 1)[0] if mark else None


# XLA's CPU backend runs some fusions through YNNPACK (on by default since jax
# 0.10), which keep buffers `memory_analysis()` does not count: `jax.vmap` of an
# MLP whose softmax is over the batch showed 16 MiB and allocated 512 MiB while it
# ran. `_fusions.py` reads what they keep off the compiled program; where a fusion
# uses a dot's or a convolution's result further, it may keep more, and a budget
# also counts the program compiled with the fusions off (`count_every_buffer`),
# where XLA allocates, and counts, what its own emitters need.
_EVERY_BUFFER_COUNTED = "xla_cpu_experimental_ynn_fusion_type"
_counting = [True]  # until this XLA refuses the option


def own_count(compiled: Any) -> tuple[int, int]:
    """The `(temporary, output)` bytes of a compiled program as XLA counts them."""
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes)


def fusions_uncounted(compiled: Any) -> Uncounted | None:
    """What XLA's own count of a compiled program leaves out: on CPU, what its
    YNNPACK fusions keep (`_fusions.uncounted`); `None` where it has none."""
    if jax.default_backend() != "cpu":
        return None
    return uncounted(str(compiled.as_text()))


def count_every_buffer(lowered: Any) -> tuple[int, int] | None:
    """On CPU, the `(temporary, output)` bytes of `lowered` compiled with XLA's
    YNNPACK fusions off, where XLA allocates and counts what its own emitters
    need (above); `None` elsewhere, or where this XLA lacks the option."""
    if not _counting[0] or jax.default_backend() != "cpu":
        return None
    options: Any = {_EVERY_BUFFER_COUNTED: ""}
    try:
        return own_count(lowered.compile(compiler_options=options))
    except Exception as e:  # an XLA without the option: INVALID_ARGUMENT
        if _EVERY_BUFFER_COUNTED not in str(e):
            raise
        _counting[0] = False
        return None


def distributed_client() -> Any:
    """The client of `jax.distributed`'s key-value store (`None` before
    `jax.distributed.initialize`), through which processes agree on a budget's
    choice (`_budget/_hosts.py`): what `jax.experimental.multihost_utils` uses."""
    return _distributed.global_state.client
