"""`suggest_chunk_size`: the chunk size a budgeted transform would choose;
`suggest_chunk_sizes`: those that the budgeted calls of a whole program choose."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from ._budget import ChunkSizeChoice, marked_in
from ._wrapper import Chunked


def suggest_chunk_size(
    fun: Callable[..., Any], /, *args: Any, **kwargs: Any
) -> ChunkSizeChoice:
    """Reports the chunk size a chunked transform built with a memory budget would
    choose for these arguments, without making the call. Choosing compiles the
    sizes it measures and, by default on CPU, runs a few of them on random inputs
    of the call's shapes to time them (the `tune` option of
    [`filtered_chunk.MemoryBudget`][]).

    **Arguments:**

    - `fun`: a chunked transform whose `chunk_size` is a
        [`filtered_chunk.MemoryBudget`][] or `"auto"`, as built by
        [`filtered_chunk.filter_chunked_vmap`][], `filter_chunked_apply`,
        `chunked_jacrev`, `chunked_jacfwd`, `filter_chunked_jacrev` or
        `filter_chunked_jacfwd`.
    - `*args`, `**kwargs`: what `fun` would be called with. Arrays may be given as
        `jax.ShapeDtypeStruct`s: only their shapes and dtypes are used. (Give the
        arrays themselves for a batch split over devices: their sharding makes the
        budget and `chunk_size` per device.)

    **Returns:**

    A [`filtered_chunk.ChunkSizeChoice`][]: the chosen `chunk_size`, its measured
    `bytes`, the `budget` in bytes, the `(chunk_size, bytes)` pairs `tried`, and why
    that size: the `largest` that fits, and how it was chosen among the sizes
    that fit (`model`): timed (`times`, and whether they were `stored` by an
    earlier process), or the speed model, with its figures (`element_bytes`,
    `cache_bytes`, `working_set`). The search is the one a call makes (for the
    program without differentiation) and shares its cache: the call compiles
    nothing more to choose. Under `jax.grad` the call chooses for the
    differentiated program, usually a smaller size: ask
    [`filtered_chunk.suggest_chunk_sizes`][] about the function you run.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtered_chunk as fc

        def f(x):
            return jnp.tanh(jnp.outer(x, x)) @ x  # 256 KiB of working set each

        chunked = fc.filter_chunked_vmap(f, chunk_size=fc.MemoryBudget("16MiB"))
        xs = jax.ShapeDtypeStruct((4_096, 256), jnp.float32)
        choice = fc.suggest_chunk_size(chunked, xs)
        print(choice.chunk_size, choice.bytes, choice.tried)
        assert choice.bytes <= choice.budget == 16 * 2**20
        # Fix the number once: a plain `chunk_size` searches nothing.
        fixed = fc.filter_chunked_vmap(f, chunk_size=choice.chunk_size)
        ```
    """
    if isinstance(fun, eqx.Partial):  # a bound method: `self` comes first
        args, fun = (*fun.args, *args), fun.func
    if not isinstance(fun, Chunked) or fun.budget is None:
        raise TypeError(
            "`suggest_chunk_size(fun, ...)` takes a chunked transform built with a "
            "memory budget, such as `fc.filter_chunked_vmap(f, "
            "chunk_size=fc.MemoryBudget('4GiB'))` or `chunk_size='auto'`, got "
            f"{fun!r}."
        )
    found: list[ChunkSizeChoice | None] = []
    _choose = lambda *_args: found.append(fun.choose(*_args))  # noqa: E731
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    if any(map(is_struct, jtu.tree_leaves((args, kwargs)))):
        eqx.filter_eval_shape(_choose, args, kwargs)
    else:
        _choose(args, kwargs)  # concrete arrays keep their sharding
    if found[0] is None:
        raise ValueError(
            "`suggest_chunk_size`: the call has no batch to split (nothing is "
            "mapped, or the batch is empty), so there is no chunk size to choose."
        )
    return found[0]


def suggest_chunk_sizes(
    fun: Callable[..., Any], /, *args: Any, **kwargs: Any
) -> tuple[ChunkSizeChoice, ...]:
    """Reports the chunk sizes that the budgeted chunked calls inside `fun` choose
    when `fun` runs with these arguments, without running it: one
    [`filtered_chunk.ChunkSizeChoice`][] for each, as the program that runs
    makes it, under the transformations that `fun` applies around the call
    (`jax.grad`, `jax.value_and_grad`, `jax.jvp`, `jax.vmap`, `jax.jit`, a
    whole training step).

    A budget measures the program that runs, so the size differs with the
    transformation: under `jax.grad` the call holds its residuals and
    cotangents too, and usually chooses a smaller size than
    [`filtered_chunk.suggest_chunk_size`][] reports for evaluating the same
    call. To fix the number once, ask the program you run.

    **Arguments:**

    - `fun`: any function, as you would call it (jitted or not). It is traced
        once (as `equinox.filter_make_jaxpr` does), never run: each budgeted call inside
        it chooses its chunk size as on a first call (compiling, and by default on
        CPU timing, what it measures) or reuses the choice already made in this
        process.
    - `*args`, `**kwargs`: what `fun` would be called with. Arrays may be given as
        `jax.ShapeDtypeStruct`s. Leaves that are not arrays are passed as they
        are.

    **Returns:**

    A tuple of [`filtered_chunk.ChunkSizeChoice`][], one for each distinct
    choice of the budgeted calls that `fun` makes, in the order of their first
    operations in its program; empty if it makes none (a call with nothing to
    split makes no choice).

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtered_chunk as fc

        def f(w, x):
            return jnp.tanh(jnp.outer(x, x) @ w) @ x

        # `tune=False`: the speed model's size, without timing (see `MemoryBudget`).
        budget = fc.MemoryBudget("8MiB", tune=False)
        chunked = fc.filter_chunked_vmap(f, in_axes=(None, 0), chunk_size=budget)
        loss = lambda w, xs: jnp.sum(chunked(w, xs) ** 2)
        w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
        xs = jax.ShapeDtypeStruct((4_096, 64), jnp.float32)
        (evaluated,) = fc.suggest_chunk_sizes(loss, w, xs)
        (differentiated,) = fc.suggest_chunk_sizes(jax.jit(jax.grad(loss)), w, xs)
        print(evaluated.chunk_size, differentiated.chunk_size)
        # The size to fix for the training step is the second.
        assert differentiated.bytes <= differentiated.budget
        ```
    """
    # As `equinox.filter_make_jaxpr`, which warns of a `jax.jit` of a Module (the
    # transform itself) held as a callable: nothing here is updated.
    traced = lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    dynamic, static = eqx.partition((args, kwargs), traced)

    def _traced(_dynamic: Any) -> Any:
        _args, _kwargs = eqx.combine(_dynamic, static)
        return eqx.filter(fun(*_args, **_kwargs), eqx.is_array)

    return tuple(marked_in(jax.make_jaxpr(_traced)(dynamic).jaxpr))
