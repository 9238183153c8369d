"""Choosing the chunk size for a memory budget, by compiling the call.

What a chunked call allocates beyond its arguments (XLA's temporary plus output
bytes of the compiled program) is close to affine in the chunk size: the outputs
are allocated at full batch size, and one chunk's working set grows linearly with
it. So the chunk size is searched by compiling the call on abstract shapes
(`jax.jit(...).lower(...).compile().memory_analysis()`), never by running it: the
whole batch first (if it fits, nothing is chunked), then one element per chunk
(if that does not fit, nothing does), then sizes in between guessed by secant
interpolation of the measured bytes, each guess checked together with its
neighbour (bisecting when the guesses keep missing on one side), so that the
answer is a measured size that fits whose next size up measurably does not.
Measurements and choices are cached on the traced program (as `_eager.py` keys
compiled programs), so a repeated call compiles nothing for the search.
"""

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._budget import ChunkSizeChoice, format_bytes, MemoryBudget
from ._eager import program_key
from ._jax_compat import DIFFERENTIATING_TRACERS


# A search compiles the whole batch, one element, then pairs of guesses.
MAX_COMPILATIONS = 10


@dataclasses.dataclass(frozen=True)
class _Measured:
    temp: int
    output: int

    @property
    def total(self) -> int:
        return self.temp + self.output


_MAX_ENTRIES = 256
_measured: dict[Hashable, _Measured] = {}
_chosen: dict[Hashable, ChunkSizeChoice] = {}


def _remember(cache: dict[Hashable, Any], key: Hashable | None, value: Any) -> None:
    if key is None:
        return
    cache[key] = value
    while len(cache) > _MAX_ENTRIES:
        del cache[next(iter(cache))]


def _differentiated(x: Any) -> bool:
    """Whether `x` is traced by `jax.grad`/`jax.vjp`/`jax.jvp` (maybe under other
    transformations): then the program that runs is the differentiated one."""
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, DIFFERENTIATING_TRACERS):
            return bool(jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact))
        x = getattr(x, "val", None)
    return False


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    aval = jax.typeof(x)
    sharding = None
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        if len(x.sharding.device_set) > 1:
            sharding = x.sharding  # per-device bytes, as the call runs
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding
    )


def _key_of(struct: jax.ShapeDtypeStruct) -> Hashable:
    return (struct.shape, str(struct.dtype), struct.weak_type, struct.sharding)


class _Program:
    """The chunked call at any chunk size, as a function of abstract inputs."""

    def __init__(self, run: Callable[[int | None, Any], Any], tree: PyTree[Any]):
        dynamic, self.static = eqx.partition(tree, eqx.is_array)
        leaves, self.treedef = jtu.tree_flatten(dynamic)
        self.run = run
        self.structs = [_struct(x) for x in leaves]
        self.mask = [_differentiated(x) for x in leaves]

    def trace(self, k: int | None) -> Any:
        """The jaxpr at `k` (its constants may be an outer transformation's
        tracers, or arrays the call closes over)."""

        def _fn(_leaves: list[Any]) -> Any:
            tree = eqx.combine(jtu.tree_unflatten(self.treedef, _leaves), self.static)
            return jtu.tree_leaves(eqx.filter(self.run(k, tree), eqx.is_array))

        return jax.make_jaxpr(_fn)(self.structs)

    def key(self) -> Hashable | None:
        """What the measurements depend on: the traced program (unchunked, and its
        callables' identities), the inputs' types, what is differentiated."""
        closed = self.trace(None)
        try:
            key = (
                str(closed.jaxpr),
                tuple(program_key(closed.jaxpr, evaluated_only=False)),
                tuple(_key_of(_struct(x)) for x in closed.consts),
                tuple(_differentiated(x) for x in closed.consts),
                tuple(_key_of(s) for s in self.structs),  # with their shardings
                tuple(self.mask),
            )
            hash(key)
        except TypeError:
            return None
        return key

    def measure(self, k: int | None) -> _Measured:
        """XLA's temporary and output bytes of the call at chunk size `k`."""
        closed = self.trace(k)
        consts = list(closed.consts)
        mask = [_differentiated(x) for x in consts] + self.mask
        fn = _as_program(closed.jaxpr, len(consts), mask)
        structs = [_struct(x) for x in consts] + self.structs
        analysis = jax.jit(fn).lower(structs).compile().memory_analysis()
        assert analysis is not None
        return _Measured(
            int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes)
        )


def _as_program(jaxpr: Any, num_consts: int, mask: list[bool]) -> Callable:
    """The function measured: `jaxpr`'s evaluation, or with a differentiated input
    its evaluation and pullback (of ones), as `jax.grad` runs it."""

    def _forward(leaves: list[Any]) -> list[Any]:
        return jax.core.eval_jaxpr(jaxpr, leaves[:num_consts], *leaves[num_consts:])

    if not any(mask):
        return _forward

    def _vjp(leaves: list[Any]) -> Any:
        def _diff(_diff_leaves: list[Any]) -> tuple[list[Any], list[Any]]:
            it = iter(_diff_leaves)
            full = [next(it) if m else x for x, m in zip(leaves, mask, strict=True)]
            outs = _forward(full)
            inexact = [bool(jnp.issubdtype(o.dtype, jnp.inexact)) for o in outs]
            return (
                [o for o, i in zip(outs, inexact) if i],
                [o for o, i in zip(outs, inexact) if not i],
            )

        diff = [x for x, m in zip(leaves, mask, strict=True) if m]
        outs, pullback, others = jax.vjp(_diff, diff, has_aux=True)
        return outs, others, pullback([jnp.ones_like(o) for o in outs])

    return _vjp


class _Sizes:
    """The chunk sizes worth trying for a batch: with `remainder="overlap"` only
    balanced ones, `ceil(batch_size / num_steps)` (any other size runs as the
    balanced size with its number of steps); with `"separate"` every size."""

    def __init__(self, batch_size: int, remainder: str):
        self.n, self.balanced = batch_size, remainder == "overlap"

    def at_most(self, x: int) -> int:
        """The largest size not above `x` (`1 <= x <= batch_size`)."""
        if not self.balanced:
            return x
        return -(-self.n // -(-self.n // x))

    def above(self, k: int) -> int:
        """The smallest size above `k` (`k < batch_size`)."""
        if not self.balanced:
            return k + 1
        steps = -(-self.n // (k + 1))
        size = -(-self.n // steps)
        return size if size > k else -(-self.n // (steps - 1))

    def below(self, k: int) -> int:
        """The largest size below `k` (`k > 1`)."""
        return self.at_most(k - 1)


def _too_small(api: str, budget: MemoryBudget, limit: int, smallest: _Measured):
    return ValueError(
        f"`{api}(..., chunk_size={budget!r})`: the memory budget of {limit} bytes "
        f"({format_bytes(limit)}) is too small for this call. Even one element per "
        "chunk (one row or column, for a Jacobian) needs "
        f"{smallest.total} bytes ({format_bytes(smallest.total)}) of temporaries "
        f"and outputs, of which {smallest.output} bytes are outputs, "
        "allocated at full batch size whatever the chunk size. Give a budget of at "
        f"least {smallest.total} bytes, or make the outputs smaller (map fewer "
        "elements per call, or return less)."
    )


def _search(
    measure: Callable[[int], _Measured],
    sizes: _Sizes,
    limit: int,
    on_too_small: Callable[[_Measured], Exception],
) -> int:
    """The largest size measured to fit `limit` whose next size up does not (or the
    batch size, or after `MAX_COMPILATIONS` the largest found to fit)."""
    n = sizes.n
    bytes_at = lambda k: measure(k).total  # noqa: E731
    if bytes_at(n) <= limit:
        return n
    if n == 1 or bytes_at(1) > limit:
        raise on_too_small(measure(1))
    lo, hi, count, moved = 1, n, 2, ""
    while sizes.above(lo) < hi and count < MAX_COMPILATIONS:
        # A secant guess, checked with its neighbour; but bisect when the last
        # two guesses moved the same end (the bytes are far from affine there).
        bisect = moved[-2:] in ("ll", "hh")
        if bisect:
            guess = (lo + hi) / 2
        else:
            slope = (bytes_at(hi) - bytes_at(lo)) / (hi - lo)
            guess = lo + (limit - bytes_at(lo)) / slope if slope > 0 else hi - 1
        k = sizes.at_most(min(max(int(guess), sizes.above(lo)), hi - 1))
        k = max(k, sizes.above(lo))
        count += 1
        fits = bytes_at(k) <= limit
        lo, hi, moved = (k, hi, moved + "l") if fits else (lo, k, moved + "h")
        neighbour = sizes.above(k) if fits else sizes.below(k)
        if not bisect and lo < neighbour < hi:
            count += 1
            if bytes_at(neighbour) <= limit:
                lo = neighbour
            else:
                hi = neighbour
    return lo


def choose_chunk_size(
    run: Callable[[int | None, Any], Any],
    tree: PyTree[Any],
    *,
    batch_size: int,
    budget: MemoryBudget,
    remainder: str,
    options: Hashable,
    api: str,
) -> ChunkSizeChoice:
    """The largest chunk size for which `run(chunk_size, tree)` (the chunked call;
    `None` for the whole batch) fits `budget`, measured by compiling it."""
    program = _Program(run, tree)
    limit = budget.resolve()
    base = program.key()
    base = None if base is None else (base, batch_size, remainder, options)
    chosen = _chosen.get((base, limit)) if base is not None else None
    if chosen is not None:
        return chosen
    tried: dict[int, _Measured] = {}

    def _measure(k: int) -> _Measured:
        if k in tried:
            return tried[k]
        key = None if base is None else (base, k)
        found = _measured.get(key) if key is not None else None
        if found is None:
            found = program.measure(None if k >= batch_size else k)
            _remember(_measured, key, found)
        tried[k] = found
        return found

    sizes = _Sizes(batch_size, remainder)
    too_small = lambda m: _too_small(api, budget, limit, m)  # noqa: E731
    k = _search(_measure, sizes, limit, too_small)
    chosen = ChunkSizeChoice(
        k, tried[k].total, limit, tuple((s, tried[s].total) for s in sorted(tried))
    )
    _remember(_chosen, None if base is None else (base, limit), chosen)
    return chosen
