"""The chunked Jacobians' builders: `chunked_jacrev`/`chunked_jacfwd` as JAX's,
`filter_chunked_jacrev`/`filter_chunked_jacfwd` as Equinox's."""

from typing import Any, overload, Unpack

from beartype import beartype
from jaxtyping import jaxtyped

from .._boundary import BuilderOptions, Decorator, deferred, keyword_only
from .._custom_types import CheckpointSpec, sentinel
from .._progress import AbstractProgressMeter
from .._wrapper import ChunkOptions, Fun, wrap
from ._plans import Argnums, JacfwdPlan, JacrevPlan


class _FilterOptions(BuilderOptions, total=False):
    has_aux: bool


class _JacfwdOptions(_FilterOptions, total=False):
    holomorphic: bool


class _JacrevOptions(_JacfwdOptions, total=False):
    allow_int: bool


@overload
def chunked_jacrev(
    *, argnums: Argnums = 0, **options: Unpack[_JacrevOptions]
) -> Decorator: ...
@overload
def chunked_jacrev(
    fun: Fun, argnums: Argnums = 0, **options: Unpack[_JacrevOptions]
) -> Fun: ...
@keyword_only(
    "chunked_jacrev", 2, ("has_aux", "holomorphic", "allow_int"), "jax.jacrev"
)
@jaxtyped(typechecker=beartype)
def chunked_jacrev(
    fun: Fun = sentinel,
    argnums: Argnums = 0,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Fun:
    """The Jacobian of `fun` by reverse-mode autodiff, like `jax.jacrev`, built
    `chunk_size` rows at a time to bound peak memory.

    `jax.jacrev` evaluates `fun` once, then pulls every unit vector of the output
    space back through it in a single `jax.vmap`: its working set is the whole
    Jacobian times the backward pass's intermediates, plus an identity matrix as
    large as the output squared. `chunked_jacrev` evaluates `fun` once too, then
    pulls back `chunk_size` unit vectors per step of one `jax.lax.scan`, writing
    each block of rows into the Jacobian in place (like
    `torch.func.jacrev(..., chunk_size=...)`, for arbitrary PyTrees). The result is
    that of `jax.jacrev`: same values, PyTree structure, shapes and dtypes.

    **Arguments:**

    - `fun`: the function to differentiate, returning an array or a PyTree of
        real (or, with `holomorphic=True`, complex) arrays.
    - `argnums`: which positional argument(s) to differentiate with respect to:
        an int or a sequence of ints, as for `jax.jacrev`. Defaults to `0`.
    - `chunk_size`: keyword-only. The number of rows (elements of the flattened output)
        computed per step. `None` (the default), or any value at least the output size,
        computes them all in one `vmap`, as `jax.jacrev`. Or a memory budget, `"auto"`
        or a [`filtered_chunk.MemoryBudget`][]: a chunk size whose compiled program fits
        it is chosen: on CPU the fastest of a few that fit, timed once on your machine;
        elsewhere the largest, as for `filter_chunked_vmap`.
    - `has_aux`: keyword-only. Whether `fun` returns a pair `(output, aux)`; `aux`
        is returned beside the Jacobian. Defaults to `False`.
    - `holomorphic`: keyword-only. As for `jax.jacrev`. Defaults to `False`.
    - `allow_int`: keyword-only. As for `jax.jacrev`: accept integer and boolean
        inputs, whose derivatives are zero. Defaults to `False`.
    - `remainder`: keyword-only. As for `filter_chunked_vmap`: `"overlap"` (the
        default) or `"separate"`.
    - `checkpoint`: keyword-only. As for `filter_chunked_vmap`: rematerialise
        each chunk when the Jacobian is itself differentiated in reverse mode.
        `True` (the default), `False`, or a `jax.checkpoint_policies` policy.
    - `progress_meter`: keyword-only. Reports the rows done while the call
        runs, also under `jax.jit`: {meters} See the [guide on progress][progress].

    **Returns:**

    A function with the signature of `fun`, returning the Jacobian as a PyTree
    like the output of `fun` whose leaves are PyTrees like the differentiated
    arguments (or `(jacobian, aux)` with `has_aux=True`).

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtered_chunk as fc

        def f(x):
            return jnp.tanh(jnp.outer(x, x)).ravel()  # 400 outputs

        x = jnp.linspace(-1.0, 1.0, 20)
        jacobian = fc.chunked_jacrev(f, chunk_size=64)(x)  # 64 rows at a time
        assert jacobian.shape == (400, 20)
        assert jnp.allclose(jacobian, jax.jacrev(f)(x))
        ```
    """
    if fun is sentinel:
        return deferred(chunked_jacrev, locals())
    options = ChunkOptions(
        "chunked_jacrev", chunk_size, remainder, checkpoint, progress_meter
    )
    return wrap(fun, JacrevPlan(argnums, has_aux, holomorphic, allow_int), options)


@overload
def chunked_jacfwd(
    *, argnums: Argnums = 0, **options: Unpack[_JacfwdOptions]
) -> Decorator: ...
@overload
def chunked_jacfwd(
    fun: Fun, argnums: Argnums = 0, **options: Unpack[_JacfwdOptions]
) -> Fun: ...
@keyword_only("chunked_jacfwd", 2, ("has_aux", "holomorphic"), "jax.jacfwd")
@jaxtyped(typechecker=beartype)
def chunked_jacfwd(
    fun: Fun = sentinel,
    argnums: Argnums = 0,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    holomorphic: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Fun:
    """The Jacobian of `fun` by forward-mode autodiff, like `jax.jacfwd`, built
    `chunk_size` columns at a time to bound peak memory.

    `jax.jacfwd` pushes every unit vector of the input space forward through `fun`
    in a single `jax.vmap`. `chunked_jacfwd` pushes `chunk_size` of them per step
    of one `jax.lax.scan`, writing each block of columns into the Jacobian in
    place (like `torch.func.jacfwd(..., chunk_size=...)`, for arbitrary PyTrees).
    Each step re-evaluates `fun` alongside its `chunk_size` tangents. The result is
    that of `jax.jacfwd`: same values, PyTree structure, shapes and dtypes.

    **Arguments:**

    - `fun`: the function to differentiate.
    - `argnums`: which positional argument(s) to differentiate with respect to:
        an int or a sequence of ints, as for `jax.jacfwd`. Defaults to `0`.
    - `chunk_size`: keyword-only. The number of columns (elements of the flattened
        differentiated arguments) computed per step. `None` (the default), or any value
        at least the input size, computes them all in one `vmap`, as `jax.jacfwd`. Or a
        memory budget, `"auto"` or a [`filtered_chunk.MemoryBudget`][]: a chunk size
        whose compiled program fits it is chosen: on CPU the fastest of a few that fit,
        timed once on your machine; elsewhere the largest, as for `filter_chunked_vmap`.
    - `has_aux`: keyword-only. Whether `fun` returns a pair `(output, aux)`; `aux`
        is returned beside the Jacobian. Defaults to `False`.
    - `holomorphic`: keyword-only. As for `jax.jacfwd`. Defaults to `False`.
    - `remainder`: keyword-only. As for `filter_chunked_vmap`: `"overlap"` (the
        default) or `"separate"`.
    - `checkpoint`: keyword-only. As for `filter_chunked_vmap`: rematerialise
        each chunk when the Jacobian is itself differentiated in reverse mode.
        `True` (the default), `False`, or a `jax.checkpoint_policies` policy.
    - `progress_meter`: keyword-only. Reports the columns done while the call
        runs, also under `jax.jit`: {meters} See the [guide on progress][progress].

    **Returns:**

    A function with the signature of `fun`, returning the Jacobian as a PyTree
    like the output of `fun` whose leaves are PyTrees like the differentiated
    arguments (or `(jacobian, aux)` with `has_aux=True`).

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtered_chunk as fc

        def f(params, x):
            w, b = params
            return jnp.tanh(x @ w + b)

        params = (jnp.full((50, 8), 0.1), jnp.zeros(8))
        x = jnp.linspace(-1.0, 1.0, 50)
        # 408 columns (one per parameter), 100 at a time.
        jacobian = fc.chunked_jacfwd(f, chunk_size=100)(params, x)
        expected = jax.jacfwd(f)(params, x)
        assert jacobian[0].shape == (8, 50, 8)
        assert all(jnp.allclose(a, b) for a, b in zip(jacobian, expected))
        ```

    !!! tip

        Forward mode suits functions with fewer inputs than outputs; otherwise
        [`filtered_chunk.chunked_jacrev`][] needs fewer steps. A Hessian is
        `chunked_jacfwd(chunked_jacrev(f, chunk_size=...), chunk_size=...)`.
    """
    if fun is sentinel:
        return deferred(chunked_jacfwd, locals())
    options = ChunkOptions(
        "chunked_jacfwd", chunk_size, remainder, checkpoint, progress_meter
    )
    return wrap(fun, JacfwdPlan(argnums, has_aux, holomorphic), options)


@overload
def filter_chunked_jacrev(**options: Unpack[_FilterOptions]) -> Decorator: ...
@overload
def filter_chunked_jacrev(fun: Fun, **options: Unpack[_FilterOptions]) -> Fun: ...
@keyword_only("filter_chunked_jacrev", 1, ("has_aux",), "equinox.filter_jacrev")
@jaxtyped(typechecker=beartype)
def filter_chunked_jacrev(
    fun: Fun = sentinel,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Fun:
    """As `equinox.filter_jacrev`, with the Jacobian built `chunk_size` rows at a
    time: see [`filtered_chunk.chunked_jacrev`][].

    The Jacobian is taken with respect to the floating-point arrays of the first
    argument (for example the parameters of an `equinox.Module`); its other leaves
    get `None`. The remaining arguments are passed through.

    **Arguments:**

    - `fun`: the function to differentiate, returning real arrays.
    - `chunk_size`: keyword-only. The number of rows (elements of the flattened output)
        computed per step; `None` (the default) computes them all at once. Or a memory
        budget, `"auto"` or a [`filtered_chunk.MemoryBudget`][]: a chunk size whose
        compiled program fits it is chosen: on CPU the fastest of a few that fit, timed
        once on your machine; elsewhere the largest.
    - `has_aux`: keyword-only. Whether `fun` returns a pair `(output, aux)`.
    - `remainder`: keyword-only. As for `filter_chunked_vmap`: `"overlap"` (the
        default) or `"separate"`.
    - `checkpoint`: keyword-only. As for `filter_chunked_vmap`: rematerialise
        each chunk when the Jacobian is itself differentiated in reverse mode.
        `True` (the default), `False`, or a `jax.checkpoint_policies` policy.
    - `progress_meter`: keyword-only. Reports the rows done while the call
        runs, also under `jax.jit`: {meters} See the [guide on progress][progress].

    **Returns:**

    A function with the signature of `fun`, returning what `equinox.filter_jacrev`
    would.

    !!! example

        ```python
        import equinox as eqx
        import jax.numpy as jnp
        import jax.random as jr
        import filtered_chunk as fc

        model = eqx.nn.Linear(3, 100, key=jr.key(0))
        x = jnp.ones(3)
        jacobian = fc.filter_chunked_jacrev(lambda m, x: m(x), chunk_size=32)(model, x)
        assert jacobian.weight.shape == (100, 100, 3)
        expected = eqx.filter_jacrev(lambda m, x: m(x))(model, x)
        assert jnp.allclose(jacobian.weight, expected.weight)
        ```
    """
    if fun is sentinel:
        return deferred(filter_chunked_jacrev, locals())
    options = ChunkOptions(
        "filter_chunked_jacrev", chunk_size, remainder, checkpoint, progress_meter
    )
    return wrap(fun, JacrevPlan(0, has_aux, False, filtered=True), options)


@overload
def filter_chunked_jacfwd(**options: Unpack[_FilterOptions]) -> Decorator: ...
@overload
def filter_chunked_jacfwd(fun: Fun, **options: Unpack[_FilterOptions]) -> Fun: ...
@keyword_only("filter_chunked_jacfwd", 1, ("has_aux",), "equinox.filter_jacfwd")
@jaxtyped(typechecker=beartype)
def filter_chunked_jacfwd(
    fun: Fun = sentinel,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Fun:
    """As `equinox.filter_jacfwd`, with the Jacobian built `chunk_size` columns at
    a time: see [`filtered_chunk.chunked_jacfwd`][].

    The Jacobian is taken with respect to the floating-point arrays of the first
    argument (for example the parameters of an `equinox.Module`); its other leaves
    get `None`. The remaining arguments are passed through.

    **Arguments:**

    - `fun`: the function to differentiate.
    - `chunk_size`: keyword-only. The number of columns (elements of the flattened
        floating-point arrays of the first argument) computed per step; `None` (the
        default) computes them all at once. Or a memory budget, `"auto"` or a
        [`filtered_chunk.MemoryBudget`][]: a chunk size whose compiled program fits it
        is chosen: on CPU the fastest of a few that fit, timed once on your machine;
        elsewhere the largest.
    - `has_aux`: keyword-only. Whether `fun` returns a pair `(output, aux)`.
    - `remainder`: keyword-only. As for `filter_chunked_vmap`: `"overlap"` (the
        default) or `"separate"`.
    - `checkpoint`: keyword-only. As for `filter_chunked_vmap`: rematerialise
        each chunk when the Jacobian is itself differentiated in reverse mode.
        `True` (the default), `False`, or a `jax.checkpoint_policies` policy.
    - `progress_meter`: keyword-only. Reports the columns done while the call
        runs, also under `jax.jit`: {meters} See the [guide on progress][progress].

    **Returns:**

    A function with the signature of `fun`, returning what `equinox.filter_jacfwd`
    would.

    !!! example

        ```python
        import equinox as eqx
        import jax.numpy as jnp
        import jax.random as jr
        import filtered_chunk as fc

        model = eqx.nn.Linear(30, 2, key=jr.key(0))
        x = jnp.ones(30)
        jacobian = fc.filter_chunked_jacfwd(lambda m, x: m(x), chunk_size=16)(model, x)
        expected = eqx.filter_jacfwd(lambda m, x: m(x))(model, x)
        assert jnp.allclose(jacobian.weight, expected.weight)
        ```
    """
    if fun is sentinel:
        return deferred(filter_chunked_jacfwd, locals())
    options = ChunkOptions(
        "filter_chunked_jacfwd", chunk_size, remainder, checkpoint, progress_meter
    )
    return wrap(fun, JacfwdPlan(0, has_aux, False, filtered=True), options)
