"""The one wrapper of every chunked transform, and its one call path.

Every builder (`filter_chunked_vmap`, `filter_chunked_apply`, the Jacobians) returns
a [`Chunked`][] module holding `fun`, the transform's *plan* and the
[`ChunkOptions`][] every transform shares. `Chunked.__call__` is the one call path
(`docs/internals.md` walks through it): a transform contributes only what differs,
how its arguments bind, its chunk function and how its outputs are finished.
"""

import abc
import contextlib
import dataclasses
import functools as ft
import operator
from collections.abc import Callable, Hashable
from typing import Any, cast, ClassVar, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from ._axes import batch_size_of, bind_arguments, check_spec, normalise_in_axes
from ._boundary import api_boundary
from ._budget import (
    Budgeted,
    choose_chunk_size,
    ChunkSizeChoice,
    ChunkSizeSpec as ChunkSizeSpec,
    Lowered,
    mark,
    measure_bytes,
    MemoryBudget,
    normalise_chunk_size,
    program_at,
    refined,
    Staged,
)
from ._custom_types import CheckpointSpec, REMAINDERS, SpmdAxisName
from ._eager import call_compiled, is_traced
from ._mesh import BatchSharding
from ._progress import AbstractProgressMeter, check_meter, is_reporting
from ._reporting import closing_on_error
from ._restrict import BoundMethod, Restrictable
from ._sharding import check_spmd_axis_name, find_batch_sharding


Fun = Callable[..., Any]  # the function a transform wraps


class ChunkOptions(eqx.Module):
    """The arguments every chunked transform takes besides `fun` (`axis_name` and
    `spmd_axis_name` only `filter_chunked_vmap`), checked once by [`wrap`][]."""

    api: str
    chunk_size: Any  # as given; `int | MemoryBudget | None` once checked by `wrap`
    remainder: str
    checkpoint: CheckpointSpec
    progress_meter: AbstractProgressMeter | None = None
    axis_name: Hashable | None = None
    spmd_axis_name: SpmdAxisName = None
    # Whether staged collectives keep their stage boundaries, or every how many
    # passes (`None`: not at a fixed chunk size; a budget decides); as given,
    # `bool | int | None` once checked by `wrap`.
    keep_boundaries: Any = None


def kept_every(keep: bool | int | None) -> int:
    """`keep_boundaries` as the staged plan takes it: every how many passes keep
    their boundaries (`0`: none)."""
    return int(keep or 0)


class Bound(NamedTuple):
    """A call's arguments as a plan binds them."""

    tree: PyTree[Any]  # the arguments: traced by the eager path and the budget
    in_axes: PyTree[int | None] = None  # each leaf's mapped axis
    batch_size: int | None = None  # `None`: nothing mapped (or not known yet)
    sharding: BatchSharding | None = None  # the mesh axes the batch is split over


class AbstractPlan(eqx.Module):
    """What a transform contributes to the call path of [`Chunked`][]."""

    # Whether [`Chunked.valid`][] can restrict the transform's batch (`_valid.py`).
    restrictable: ClassVar[bool] = False

    def check(self, api: str) -> None:
        """Checks the transform's own arguments when it is built."""
        del api

    @abc.abstractmethod
    def bind(self, fun: Fun, options: ChunkOptions, args: Any, kwargs: Any) -> Bound:
        """The call's arguments, bound once."""

    def budget_size(self, fun: Fun, options: ChunkOptions, bound: Bound) -> int:
        """The number of elements a budget splits (per device); 0 if none."""
        del fun, options
        devices = 1 if bound.sharding is None else bound.sharding.num_devices
        return -(-(bound.batch_size or 0) // devices)  # padded to a multiple

    def chunked(self, bound: Bound, chunk_size: int | None) -> bool:
        """Whether the call runs a loop (and so, eagerly, a compiled program)."""
        size = bound.batch_size
        return size is not None and chunk_size is not None and chunk_size < size

    @abc.abstractmethod
    def evaluate(
        self, fun: Fun, options: ChunkOptions, bound: Bound, chunk_size: int | None
    ) -> Any:
        """The call's output at a fixed `chunk_size`, traced or not."""

    def staged(
        self, fun: Fun, options: ChunkOptions, bound: Bound, chunk_size: int
    ) -> tuple[int, int, float]:
        """The passes over the batch that staged collectives take before the final
        loop at `chunk_size` with `options.keep_boundaries`, the bytes of the
        values they keep, and the estimated work of the loops against `fun`
        once for each element; `(0, 0, 1.0)` if the call is not staged."""
        del fun, options, bound, chunk_size
        return 0, 0, 1.0


class Chunked(eqx.Module, Restrictable):
    """A chunked transform of `fun`, as every builder returns it."""

    _fun: Callable[..., Any]
    _plan: AbstractPlan
    _options: ChunkOptions

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self._fun

    @property
    def budget(self) -> MemoryBudget | None:
        """The memory budget the chunk size is chosen for, if any."""
        chunk_size = self._options.chunk_size
        return chunk_size if isinstance(chunk_size, MemoryBudget) else None

    def choose(self, args: Any, kwargs: Any) -> ChunkSizeChoice | None:
        """The budget's chunk size for these arguments (`None`: nothing to split)."""
        return self._choose(self._plan.bind(self._fun, self._options, args, kwargs))

    def _choose(self, bound: Bound) -> ChunkSizeChoice | None:
        budget = self.budget
        assert budget is not None
        size = self._plan.budget_size(self._fun, self._options, bound)
        if not size:
            return None

        def _run(k: int | None, closed: Any) -> Any:
            chunked, _tree = closed
            return chunked._evaluate(bound._replace(tree=_tree), k)

        o = self._options
        keep = o.keep_boundaries
        # What else changes the chunked program but not the unchunked one, or
        # the refinement (`None`: the budget decides what to keep).
        options = (o.remainder, o.checkpoint, o.axis_name, type(self._plan), keep)

        def _measure(k: int, every: int, limit: int) -> int:
            # The bytes at `k` keeping every `every`-th pass's boundaries.
            kept = (self._keeping(True if every == 1 else every), bound.tree)
            return measure_bytes(_run, kept, k, limit)

        def _staged(keeping: bool | int | None, k: int) -> tuple[int, int, float]:
            kept = dataclasses.replace(o, keep_boundaries=keeping)
            return self._plan.staged(self._fun, kept, bound, k)

        staged = None if o.axis_name is None else Staged(_measure, _staged)
        refine = ft.partial(
            refined, batch_size=size, remainder=o.remainder, keep=keep, staged=staged
        )

        def _program(choice: ChunkSizeChoice) -> Lowered:
            # The program a choice runs, lowered.
            k = None if choice.chunk_size >= size else choice.chunk_size
            kept = (self._keeping(choice.keep_boundaries), bound.tree)
            return program_at(_run, kept, k)

        return choose_chunk_size(
            Budgeted(
                _run,
                (self._keeping(False if keep is None else keep), bound.tree),
                batch_size=size,
                budget=budget,
                remainder=o.remainder,
                options=options,
                api=o.api,
                refine=refine,
                program=_program,
            )
        )

    def _keeping(self, keep: bool | int) -> "Chunked":
        """This transform, with staged collectives keeping their boundaries or not."""
        options = dataclasses.replace(self._options, keep_boundaries=keep)
        return dataclasses.replace(self, _options=options)

    @api_boundary
    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        bound = self._plan.bind(self._fun, self._options, args, kwargs)
        chunk_size, chunked = self._options.chunk_size, self
        scope = contextlib.nullcontext()
        if self.budget is not None:
            choice = self._choose(bound)
            chunk_size = None if choice is None else choice.chunk_size
            if choice is not None:
                chunked = self._keeping(choice.keep_boundaries)
                # Marked in the program, for `suggest_chunk_sizes`.
                scope = jax.named_scope(mark(choice))
        reporting = is_reporting(self._options.progress_meter)
        with closing_on_error() if reporting else contextlib.nullcontext(), scope:
            return chunked._dispatch(bound, chunk_size)

    def _dispatch(self, bound: Bound, chunk_size: int | None) -> Any:
        if self._plan.chunked(bound, chunk_size) and not is_traced((self, bound.tree)):
            # An eager `lax.scan` recompiles on every call: see `_eager.py`. The
            # axes (and the batch's sharding) were found on the caller's leaves,
            # as `eqx.filter_vmap` does: inside, every array is a tracer.
            return call_compiled(
                lambda _tree: self._evaluate(bound._replace(tree=_tree), chunk_size),
                bound.tree,
            )
        return self._evaluate(bound, chunk_size)

    def _evaluate(self, bound: Bound, chunk_size: int | None) -> Any:
        return self._plan.evaluate(self._fun, self._options, bound, chunk_size)

    def __get__(self, instance: Any, owner: Any) -> Any:
        del owner
        return self if instance is None else BoundMethod(self, instance)


def wrap(fun: Fun, plan: AbstractPlan, options: ChunkOptions) -> "Chunked":
    """Checks the arguments, once, and wraps `fun` in a [`Chunked`][]."""
    chunk_size = normalise_chunk_size(options.chunk_size, options.api)
    if options.remainder not in REMAINDERS:
        raise ValueError(
            f"`{options.api}(..., remainder=...)` must be one of {REMAINDERS}, got "
            f"{options.remainder!r}."
        )
    plan.check(options.api)
    check_spmd_axis_name(options.spmd_axis_name, options.api)
    check_meter(options.progress_meter, options.api)
    keep = _normalise_keep(options.keep_boundaries, options.api)
    options = dataclasses.replace(options, chunk_size=chunk_size, keep_boundaries=keep)
    return cast(Chunked, eqx.module_update_wrapper(Chunked(fun, plan, options)))


def _normalise_keep(keep: Any, api: str) -> bool | int | None:
    """`keep_boundaries` as a Python `bool`, `int` or `None`: any integer type,
    as `chunk_size` (`np.int64(2)`, `np.bool_(True)`), or the error for a bad one."""
    expected = (
        f"`{api}(..., keep_boundaries=...)` must be `None`, a bool, or a positive "
        "integer (keep the boundaries of every that many passes), got"
    )
    if keep is None or isinstance(keep, bool | np.bool_):
        return None if keep is None else bool(keep)
    if getattr(type(keep), "__index__", None) is None:
        raise TypeError(f"{expected} {type(keep).__name__} object {keep!r}.")
    every = operator.index(keep)
    if every < 1:
        raise ValueError(f"{expected} {keep!r}.")
    return every


class AbstractMappedPlan(AbstractPlan):
    """The plan of a map over a batch whose axes `in_axes`/`out_axes` give
    (`filter_chunked_vmap`, `filter_chunked_apply`): its arguments bind to `fun`'s
    signature, and its batch is their common size along their mapped axes."""

    in_axes: Any  # `PyTree[AxisSpec]`, checked by value (`check`)
    out_axes: Any
    # The batch size when nothing is mapped (`filter_chunked_vmap`'s). It is
    # checked where it is used, as by `jax.vmap`: a negative one is inconsistent
    # with a mapped input (`ValueError`) or cannot be broadcast to (`TypeError`).
    axis_size: int | None = None
    # Whether the batch may be split over devices (found on the mapped inputs).
    sharded: ClassVar[bool] = False
    restrictable: ClassVar[bool] = True

    def check(self, api: str) -> None:
        del api
        check_spec(self.in_axes, "in_axes")
        check_spec(self.out_axes, "out_axes")

    def bind(self, fun: Fun, options: ChunkOptions, args: Any, kwargs: Any) -> Bound:
        """The call's arguments as one tree `(args, kwargs)`, bound to `fun`'s
        signature, with their axes, batch size and sharding."""
        api = options.api
        tree, spec = bind_arguments(fun, self.in_axes, args, kwargs, api)
        axes = normalise_in_axes(tree, spec)
        batch_size = batch_size_of(tree, axes, self.axis_size, api)
        sharding = None
        if self.sharded and batch_size is not None:
            sharding = find_batch_sharding(tree, axes, options.spmd_axis_name, api)
        return Bound(tree, axes, batch_size, sharding)
