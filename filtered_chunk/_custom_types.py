from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypeAlias

import jax
import jax.core
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree


ResolvedAxisSpec: TypeAlias = int | None
AxisSpec: TypeAlias = ResolvedAxisSpec | Callable[[Any], ResolvedAxisSpec]
Remainder: TypeAlias = Literal["overlap", "separate"]
# `True`/`False`, or a `jax.checkpoint_policies` policy.
CheckpointSpec: TypeAlias = bool | Callable[..., Any]
REMAINDERS: tuple[str, ...] = ("overlap", "separate")
# A mapped input as the caller passed it: a NumPy array stays one until a chunk is
# sliced out of it (under an outer `jit` it is a constant, not a tracer). So is
# what JAX hands a derivative rule: the primals and tangents of an eager call as
# the caller gave them, and a zero tangent JAX made (a NumPy subclass).
InputArray: TypeAlias = Array | np.ndarray
# The mesh axis name (or names) a batch is split over, as `jax.vmap` takes it.
SpmdAxisName: TypeAlias = str | tuple[str, ...] | None


class ChunkOutput(NamedTuple):
    """What a chunk function returns (see `_loop/_run.py`)."""

    batched: PyTree[Array]
    batched_axes: tuple[int, ...]
    unbatched: PyTree[Array]
    static: Any
    # Per leaf of `batched`: `None` (written at full batch size), or the kind of
    # accumulator (`"sum"`, `"max"`, `"min"`) that the loop folds its rows into
    # (`_loop/_accumulate.py`). `None` for the whole tuple: every leaf is written.
    reduce: tuple[str | None, ...] | None = None

    def kinds(self) -> tuple[str | None, ...]:
        """`reduce`, one entry per batched leaf."""
        if self.reduce is None:
            return (None,) * len(self.batched_axes)
        return self.reduce


class Batch(NamedTuple):
    """What a plan hands to [`run_batch`][]: `size` elements of `mapped` (at
    `in_axes`), and how to evaluate them, as functions of what they close over
    (`closed`, arrays included), so that they can be rebuilt inside `shard_map`."""

    chunk: Callable[[Any, PyTree[InputArray], int], ChunkOutput]
    closed: PyTree[Any]
    mapped: PyTree[InputArray]
    in_axes: PyTree[int | None]
    size: int
    # `fun` on one element, returning `(mapped outputs, unmapped arrays,
    # Static((the rest, out_axes)))`: for collectives over `axis_name`, which the
    # staged evaluation computes across chunks (`_staged.run_staged_vmap`).
    element: Callable[[Any, PyTree[Any]], Any] | None = None
    # The transform's own check of `fun`, before a loop of chunks of that size.
    check: Callable[[Any, PyTree[InputArray], int], None] | None = None
    # `sum_match=True`: the unmapped outputs that vary over the batch are summed.
    sum_match: bool = False
    # Whether `jax.shard_map` checks the varying manual axes of a sharded batch.
    # Not where a chunk branches on which of its elements are valid (`_valid.py`):
    # the check casts what the chunk closes over to varying inside the branch,
    # and in reverse mode that cast's transpose is a `psum` that only the
    # devices taking the branch would run.
    check_vma: bool = True
    # The rows at the end of the batch that are padding, not elements (a batch
    # padded to a multiple of the devices that split it: `_gate.py`).
    padding: int = 0
    # Where only the batch's leading rows need computing (a batch gated by a
    # count: `_gate.py`): what those rows are, from its `closed` and `mapped`
    # (a device's, inside `shard_map`). The loop evaluates only the steps that
    # hold them.
    leading: "Callable[[Any, PyTree[InputArray]], Leading] | None" = None


class Leading(NamedTuple):
    """The rows of a batch that a loop computes (`Batch.leading`): the first
    `rows` (a traced integer scalar, the same for every element of any `vmap`
    around the loop: the largest); every other row of a written output holds
    `fill`, and adds nothing to an accumulated one. Only evaluating skips the
    steps after them: a derivative runs every step (which must then leave those
    rows as the loop would)."""

    rows: Any
    fill: Any


class LoopOptions(NamedTuple):
    """How the loop over chunks runs (`_loop.run_in_chunks`): what every
    chunked transform takes besides `fun`, once the chunk size is an integer."""

    chunk_size: int
    remainder: str
    checkpoint: CheckpointSpec
    progress_meter: Any = None  # an `AbstractProgressMeter`, or `None`
    api: str = ""


# A chunk function: the mapped inputs sliced to `size` elements, and `size`.
ChunkFn: TypeAlias = Callable[[PyTree[InputArray], int], ChunkOutput]


def is_none(x: Any) -> bool:
    """Whether `x` is `None`: the `is_leaf` of trees of axes, where `None` is a
    leaf (unmapped) rather than an empty subtree."""
    return x is None


class _Sentinel:
    def __repr__(self) -> str:
        return "sentinel"


sentinel: Any = _Sentinel()


class Kept:
    """An output leaf that a transform returns as it is: a value `fun` returned with
    `out_axes=None` that no trace computed (a NumPy value, a closed-over array).

    It is one opaque leaf to JAX, so that neither the loop nor a compiled program
    turns it into a `jax.Array` (a NumPy float64 would become a float32). Equality
    is identity, so a cache never matches it by value.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _is_kept(x: Any) -> bool:
    return isinstance(x, Kept)


def keep_untraced(tree: Any) -> tuple[Any, Any]:
    """Splits `tree` into its tracers and its other leaves, wrapped in `Kept`."""
    is_tracer = lambda x: isinstance(x, jax.core.Tracer)  # noqa: E731
    traced = jtu.tree_map(lambda x: x if is_tracer(x) else None, tree)
    kept = jtu.tree_map(lambda x: None if is_tracer(x) else Kept(x), tree)
    return traced, kept


def unwrap_kept(tree: Any) -> Any:
    """Replaces each `Kept` leaf of `tree` by its value."""
    return jtu.tree_map(lambda x: x.value if _is_kept(x) else x, tree, is_leaf=_is_kept)
