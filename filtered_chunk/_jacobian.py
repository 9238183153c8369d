"""Jacobians built `chunk_size` rows (reverse mode) or columns (forward mode) at a
time: `chunked_jacrev` and `chunked_jacfwd`, as JAX's, and `filter_chunked_jacrev`
and `filter_chunked_jacfwd`, as Equinox's. A mode is one plan, for both forms."""

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from beartype import beartype
from jaxtyping import Array, Int, jaxtyped

from ._basis import (
    Argnums,
    basis,
    check_dtypes,
    dynamic_args,
    inputs_rule,
    offsets,
    outputs_rule,
    unravel,
    without_float0,
)
from ._boundary import deferred, keyword_only
from ._custom_types import (
    CheckpointSpec,
    ChunkOutput,
    keep_untraced,
    Remainder,
    sentinel,
    unwrap_kept,
)
from ._progress import AbstractProgressMeter
from ._wrapper import (
    AbstractPlan,
    Batch,
    Bound,
    ChunkOptions,
    ChunkSizeSpec,
    Fun,
    run_batch,
    wrap,
)


class AbstractJacobian(AbstractPlan):
    """A Jacobian's plan: the arguments of its builder other than `fun` and the
    `ChunkOptions`. Its batch is the Jacobian's rows (reverse mode) or columns, so
    a chunked call always runs a loop. `filtered` is Equinox's form: the Jacobian
    with respect to the floating-point arrays of the first argument."""

    argnums: Argnums
    has_aux: bool
    holomorphic: bool
    allow_int: bool = False
    filtered: bool = False
    # Reverse mode (rows, pulled back) or forward mode (columns, pushed forward).
    rev: ClassVar[bool]

    def bind(self, fun: Fun, options: ChunkOptions, args: Any, kwargs: Any) -> Bound:
        del fun
        if self.filtered and not args:
            raise TypeError(
                f"`{options.api}` takes the function's first argument positionally "
                "(the Jacobian is with respect to it), but got no positional "
                "argument."
            )
        return Bound((args, kwargs))

    def chunked(self, bound: Bound, chunk_size: int | None) -> bool:
        del bound
        return chunk_size is not None

    def _dynamic(
        self, fun: Callable[..., Any], options: ChunkOptions, bound: Bound
    ) -> tuple[Callable[..., Any], tuple[Any, ...], tuple[int, ...]]:
        """`fun` as a function of the differentiated arguments, those arguments
        and their positions."""
        args, kwargs = bound.tree
        if not self.filtered:
            return dynamic_args(fun, self.argnums, args, kwargs, options.api)
        # Equinox's: the first argument's floating-point arrays (its other leaves
        # get `None` in the Jacobian); the other arguments are passed through.
        diff_x, static_x = eqx.partition(args[0], eqx.is_inexact_array)

        def _fun(_diff_x: Any) -> Any:
            return fun(eqx.combine(_diff_x, static_x), *args[1:], **kwargs)

        return _fun, (diff_x,), (0,)

    def _checked(
        self, fun: Callable[..., Any], options: ChunkOptions, bound: Bound
    ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """`_dynamic`'s function and arguments, their dtypes checked as JAX does."""
        f, dynamic, nums = self._dynamic(fun, options, bound)
        names = [f"args[{n}]" for n in nums]
        rule = inputs_rule(self.holomorphic, self.allow_int, rev=self.rev)
        check_dtypes(dynamic, names, rule, "the input", options.api)
        return f, dynamic

    def _check_output(self, y: Any, options: ChunkOptions) -> None:
        rule = outputs_rule(self.holomorphic, rev=self.rev)
        check_dtypes((y,), ["output"], rule, "the output", options.api)

    def _example(self, dynamic: tuple[Any, ...]) -> Any:
        """The differentiated arguments as the Jacobian's leaves are shaped."""
        return dynamic[0] if isinstance(self.argnums, int) else dynamic


def _over_indices(
    chunk_fn: Callable[[Int[Array, " size"], int], ChunkOutput],
    total: int,
    chunk_size: int | None,
    options: ChunkOptions,
) -> ChunkOutput:
    """`chunk_fn` over the indices `0, ..., total - 1`, in chunks."""
    chunk = lambda _, index, size: chunk_fn(index, size)  # noqa: E731
    return run_batch(
        Batch(chunk, None, jnp.arange(total), 0, total), chunk_size, options
    )


class JacrevPlan(AbstractJacobian):
    rev: ClassVar[bool] = True

    def budget_size(self, fun: Fun, options: ChunkOptions, bound: Bound) -> int:
        f, dynamic, _ = self._dynamic(fun, options, bound)
        out = jax.eval_shape(f, *dynamic)
        out = out[0] if self.has_aux else out
        return sum(math.prod(np.shape(y)) for y in jtu.tree_leaves(out))

    def evaluate(
        self, fun: Fun, options: ChunkOptions, bound: Bound, chunk_size: int | None
    ) -> Any:
        f, dynamic = self._checked(fun, options, bound)
        y, pullback, *aux = jax.vjp(f, *dynamic, has_aux=self.has_aux)
        self._check_output(y, options)

        def _rows(index: Int[Array, " size"], size: int) -> ChunkOutput:
            del size
            cotangents, axes = without_float0(
                jax.vmap(pullback)(basis(y, index)), False
            )
            return ChunkOutput(cotangents, axes, None, None)

        _, total = offsets(y)
        rows = _over_indices(_rows, total, chunk_size, options).batched
        rows = rows[0] if isinstance(self.argnums, int) else rows

        def _unravel_rows(x: Any, block: Any) -> Any:
            shape = lambda leaf: np.shape(leaf) + np.shape(x)
            return unravel(block, y, x, 0, shape)

        example = self._example(dynamic)
        jac = jtu.tree_map(_unravel_rows, example, rows)
        treedefs = jtu.tree_structure(example), jtu.tree_structure(y)
        jac = jtu.tree_transpose(*treedefs, jac)
        return (jac, *aux) if self.has_aux else jac


class JacfwdPlan(AbstractJacobian):
    rev: ClassVar[bool] = False

    def budget_size(self, fun: Fun, options: ChunkOptions, bound: Bound) -> int:
        _, dynamic, _ = self._dynamic(fun, options, bound)
        return offsets(dynamic)[1]

    def evaluate(
        self, fun: Fun, options: ChunkOptions, bound: Bound, chunk_size: int | None
    ) -> Any:
        f, dynamic = self._checked(fun, options, bound)
        has_aux = self.has_aux

        def _columns(index: Int[Array, " size"], size: int) -> ChunkOutput:
            def _push(tangents: Any) -> Any:
                out = jax.jvp(f, dynamic, tangents, has_aux=has_aux)
                return out if has_aux else (*out, None)

            y, t, aux = jax.vmap(_push, out_axes=(None, -1, None), axis_size=size)(
                basis(dynamic, index)
            )
            tangents, axes = without_float0(t, True)
            unbatched, static = eqx.partition((y, aux), eqx.is_array)
            # What no trace computed (a NumPy `aux`) is returned as it is.
            unbatched, kept = keep_untraced(unbatched)
            return ChunkOutput(tangents, axes, unbatched, eqx.combine(static, kept))

        _, total = offsets(dynamic)
        out = _over_indices(_columns, total, chunk_size, options)
        y, aux = eqx.combine(out.unbatched, unwrap_kept(out.static))
        self._check_output(y, options)
        example = self._example(dynamic)

        def _unravel_columns(y_leaf: Any, block: Any) -> Any:
            shape = lambda leaf: np.shape(y_leaf) + np.shape(leaf)
            return unravel(block, example, y_leaf, np.ndim(y_leaf), shape)

        jac = jtu.tree_map(_unravel_columns, y, out.batched)
        return (jac, aux) if has_aux else jac


@overload
def chunked_jacrev(
    *,
    argnums: int | Sequence[int] = 0,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def chunked_jacrev(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]: ...


@keyword_only(
    "chunked_jacrev", 2, ("has_aux", "holomorphic", "allow_int"), "jax.jacrev"
)
@jaxtyped(typechecker=beartype)
def chunked_jacrev(
    fun: Callable[..., Any] = sentinel,
    argnums: int | Sequence[int] = 0,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]:
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
    - `chunk_size`: keyword-only. The number of rows (elements of the flattened
        output) computed per step. `None` (the default), or any value at least the
        output size, computes them all in one `vmap`, as `jax.jacrev`. Or a
        memory budget, `"auto"` or a [`filtered_chunk.MemoryBudget`][]: the
        largest chunk size whose compiled program fits it is chosen, as for
        `filter_chunked_vmap`.
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
    *,
    argnums: int | Sequence[int] = 0,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def chunked_jacfwd(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]: ...


@keyword_only("chunked_jacfwd", 2, ("has_aux", "holomorphic"), "jax.jacfwd")
@jaxtyped(typechecker=beartype)
def chunked_jacfwd(
    fun: Callable[..., Any] = sentinel,
    argnums: int | Sequence[int] = 0,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    holomorphic: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]:
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
        differentiated arguments) computed per step. `None` (the default), or any
        value at least the input size, computes them all in one `vmap`, as
        `jax.jacfwd`. Or a memory budget, `"auto"` or a
        [`filtered_chunk.MemoryBudget`][]: the largest chunk size whose compiled
        program fits it is chosen, as for `filter_chunked_vmap`.
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
def filter_chunked_jacrev(
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def filter_chunked_jacrev(
    fun: Callable[..., Any],
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]: ...


@keyword_only("filter_chunked_jacrev", 1, ("has_aux",), "equinox.filter_jacrev")
@jaxtyped(typechecker=beartype)
def filter_chunked_jacrev(
    fun: Callable[..., Any] = sentinel,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]:
    """As `equinox.filter_jacrev`, with the Jacobian built `chunk_size` rows at a
    time: see [`filtered_chunk.chunked_jacrev`][].

    The Jacobian is taken with respect to the floating-point arrays of the first
    argument (for example the parameters of an `equinox.Module`); its other leaves
    get `None`. The remaining arguments are passed through.

    **Arguments:**

    - `fun`: the function to differentiate, returning real arrays.
    - `chunk_size`: keyword-only. The number of rows (elements of the flattened
        output) computed per step; `None` (the default) computes them all at once.
        Or a memory budget, `"auto"` or a [`filtered_chunk.MemoryBudget`][]: the
        largest chunk size whose compiled program fits it is chosen.
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
def filter_chunked_jacfwd(
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def filter_chunked_jacfwd(
    fun: Callable[..., Any],
    *,
    chunk_size: ChunkSizeSpec = None,
    has_aux: bool = False,
    remainder: Remainder = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]: ...


@keyword_only("filter_chunked_jacfwd", 1, ("has_aux",), "equinox.filter_jacfwd")
@jaxtyped(typechecker=beartype)
def filter_chunked_jacfwd(
    fun: Callable[..., Any] = sentinel,
    *,
    chunk_size: Any = None,  # checked: see `ChunkSizeSpec`
    has_aux: bool = False,
    remainder: str = "overlap",
    checkpoint: CheckpointSpec = True,
    progress_meter: AbstractProgressMeter | None = None,
) -> Callable[..., Any]:
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
        [`filtered_chunk.MemoryBudget`][]: the largest chunk size whose compiled
        program fits it is chosen.
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
