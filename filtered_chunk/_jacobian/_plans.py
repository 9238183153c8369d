"""The chunked Jacobians' plans, one per mode (reverse: rows; forward: columns) for
JAX's form and Equinox's, and their pieces: unit vectors (rows of the identity over
a flattened PyTree) made from indices, a loop over index chunks, unravelling the
flat blocks back into PyTrees, JAX's dtype rules and errors."""

import functools as ft
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Int

from .._axes import is_array
from .._batch import Batch, run_batch
from .._custom_types import ChunkOutput, keep_untraced, unwrap_kept
from .._wrapper import AbstractPlan, Bound, ChunkOptions, Fun


Argnums = int | Sequence[int]


def _dynamic_args(
    fun: Fun, argnums: Argnums, args: tuple[Any, ...], kwargs: dict[str, Any], api: str
) -> tuple[Callable[..., Any], tuple[Any, ...], tuple[int, ...]]:
    """`fun` as a function of the positional arguments in `argnums` only."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for n in nums:
        if not -len(args) <= n < len(args):
            raise ValueError(
                f"`{api}(..., argnums={argnums!r})` refers to positional argument "
                f"{n}, but the function was called with {len(args)} positional "
                f"argument(s). `argnums` must be in [-{len(args)}, {len(args)})."
            )
    nums = tuple(n % len(args) for n in nums)

    def _partial(*dynamic: Any) -> Any:
        _args = list(args)
        for n, arg in zip(nums, dynamic, strict=True):
            _args[n] = arg
        return fun(*_args, **kwargs)

    return _partial, tuple(args[n] for n in nums), nums


def _check_dtypes(
    tree: Any,
    names: list[str],
    allowed: Callable[[np.dtype], str | None],
    what: str,
    api: str,
) -> None:
    """Raises `TypeError` (as JAX does) for a leaf whose dtype is not `allowed`
    (which returns the reason, or `None` when allowed)."""
    for path, leaf in jtu.tree_leaves_with_path(tree):
        head = path[0]
        assert isinstance(head, jtu.SequenceKey)
        where = names[head.idx] + jtu.keystr(tuple(path[1:]))
        if not is_array(leaf) and not isinstance(leaf, bool | int | float | complex):
            raise TypeError(
                f"`{api}`: {what} `{where}` is {type(leaf).__name__} object "
                f"{leaf!r}, which is not a valid JAX type."
            )
        dtype = jnp.result_type(leaf)
        reason = allowed(dtype)
        if reason is not None:
            raise TypeError(
                f"`{api}` requires {reason}, but {what} `{where}` has dtype "
                f"{dtype.name}."
            )


def _input_error(
    holomorphic: bool, allow_int: bool, rev: bool, dtype: np.dtype
) -> str | None:
    """Why `jax.jacrev` (`rev`) or `jax.jacfwd` refuses an input of `dtype`."""
    if holomorphic and not jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex inputs with `holomorphic=True`"
    if jnp.issubdtype(dtype, jnp.inexact) and (rev or holomorphic):
        return None
    if jnp.issubdtype(dtype, jnp.floating):
        return None
    if rev and allow_int and (jnp.issubdtype(dtype, np.integer) or dtype == np.bool_):
        return None
    if rev:
        return (
            "real or complex inputs (use `allow_int=True` for integer and "
            "boolean inputs, which get zero derivatives)"
        )
    return "real inputs (use `holomorphic=True` for complex inputs)"


def _output_error(holomorphic: bool, rev: bool, dtype: np.dtype) -> str | None:
    """Why `jax.jacrev` (`rev`) or `jax.jacfwd` refuses an output of `dtype`."""
    if holomorphic:
        if jnp.issubdtype(dtype, jnp.complexfloating):
            return None
        return "complex outputs with `holomorphic=True`"
    if not rev or jnp.issubdtype(dtype, jnp.floating):
        return None
    return (
        "real floating-point outputs (use `holomorphic=True` for complex "
        "outputs of a holomorphic function, or `jax.vjp` directly)"
    )


def _offsets(tree: Any) -> tuple[list[int], int]:
    """Where each leaf of `tree` starts in its flattening, and the total size."""
    sizes = [int(np.size(x)) for x in jtu.tree_leaves(tree)]
    return [int(o) for o in np.cumsum([0, *sizes[:-1]])], int(sum(sizes))


def _basis(tree: Any, index: Int[Array, " size"]) -> Any:
    """Rows `index` of the identity over the flattened leaves of `tree`, as a tree
    like `tree` with a leading axis: the unit vectors, one chunk of them."""
    starts, _ = _offsets(tree)

    def _unit(offset: int, leaf: Any) -> Array:
        positions = offset + jnp.arange(np.size(leaf)).reshape((1, *np.shape(leaf)))
        hits = index.reshape(index.shape + (1,) * np.ndim(leaf)) == positions
        return hits.astype(jnp.result_type(leaf))

    leaves, treedef = jtu.tree_flatten(tree)
    return jtu.tree_unflatten(treedef, list(map(_unit, starts, leaves)))


def _derivatives(
    tree: Any, axis_last: bool, unbatched: Any = None, static: Any = None
) -> ChunkOutput:
    """A chunk of derivatives `tree`, batched along their first or last axis,
    without its float0 (integer) ones."""
    is_float0 = lambda x: is_array(x) and x.dtype == jax.dtypes.float0  # noqa: E731
    arrays = jtu.tree_map(lambda x: None if is_float0(x) else x, tree)
    axes = tuple(x.ndim - 1 if axis_last else 0 for x in jtu.tree_leaves(arrays))
    return ChunkOutput(arrays, axes, unbatched, static)


def _cast(x: Array, like: Any) -> Array:
    """`x` with the dtype and weak type of `like`, as JAX's Jacobians give."""
    x = x.astype(jnp.result_type(like))
    if not jax.typeof(like).weak_type or jax.typeof(x).weak_type:
        return x
    # `astype` drops a weak type; a scatter keeps its operand's. Weak types only
    # exist for the default dtypes, which a Python scalar fill value gives.
    return lax.full(x.shape, x.dtype.type(0).item()).at[...].set(x)


def _unravel(block: Any, tree: Any, like: Any, axis: int, shape: Callable) -> Any:
    """Splits `block`'s `axis` (the flattened leaves of `tree`) into a tree like
    `tree` of blocks of shape `shape(leaf)`, typed like `like`."""
    starts, _ = _offsets(tree)

    def _part(offset: int, leaf: Any) -> Array:
        if block is None:  # an integer derivative: zeros, as JAX gives
            return _cast(jnp.zeros(shape(leaf)), like)
        part = lax.slice_in_dim(block, offset, offset + np.size(leaf), axis=axis)
        return _cast(part.reshape(shape(leaf)), like)

    leaves, treedef = jtu.tree_flatten(tree)
    return jtu.tree_unflatten(treedef, list(map(_part, starts, leaves)))


def _over_indices(
    chunk_fn: Callable[[Int[Array, " size"], int], ChunkOutput],
    tree: Any,
    chunk_size: int | None,
    options: ChunkOptions,
) -> ChunkOutput:
    """`chunk_fn` over the indices of the flattened leaves of `tree`, in chunks."""
    _, total = _offsets(tree)
    chunk = lambda _, index, size: chunk_fn(index, size)  # noqa: E731
    return run_batch(
        Batch(chunk, None, jnp.arange(total), 0, total), chunk_size, options
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
    rev: ClassVar[bool]  # reverse mode (rows) or forward mode (columns)

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
            return _dynamic_args(fun, self.argnums, args, kwargs, options.api)
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
        rule = ft.partial(_input_error, self.holomorphic, self.allow_int, self.rev)
        _check_dtypes(dynamic, names, rule, "the input", options.api)
        return f, dynamic

    def _check_output(self, y: Any, options: ChunkOptions) -> None:
        rule = ft.partial(_output_error, self.holomorphic, self.rev)
        _check_dtypes((y,), ["output"], rule, "the output", options.api)

    def _pick(self, dynamic: tuple[Any, ...]) -> Any:
        """The differentiated arguments (or a tuple like them) as the Jacobian's
        leaves are shaped: the one argument for an int `argnums`."""
        return dynamic[0] if isinstance(self.argnums, int) else dynamic


class JacrevPlan(AbstractJacobian):
    rev: ClassVar[bool] = True

    def budget_size(self, fun: Fun, options: ChunkOptions, bound: Bound) -> int:
        f, dynamic, _ = self._dynamic(fun, options, bound)
        out = jax.eval_shape(f, *dynamic)
        return _offsets(out[0] if self.has_aux else out)[1]

    def evaluate(
        self, fun: Fun, options: ChunkOptions, bound: Bound, chunk_size: int | None
    ) -> Any:
        f, dynamic = self._checked(fun, options, bound)
        y, pullback, *aux = jax.vjp(f, *dynamic, has_aux=self.has_aux)
        self._check_output(y, options)

        def _rows(index: Int[Array, " size"], size: int) -> ChunkOutput:
            del size
            return _derivatives(jax.vmap(pullback)(_basis(y, index)), False)

        rows = self._pick(_over_indices(_rows, y, chunk_size, options).batched)

        def _unravel_rows(x: Any, block: Any) -> Any:
            shape = lambda leaf: np.shape(leaf) + np.shape(x)
            return _unravel(block, y, x, 0, shape)

        example = self._pick(dynamic)
        jac = jtu.tree_map(_unravel_rows, example, rows)
        treedefs = jtu.tree_structure(example), jtu.tree_structure(y)
        jac = jtu.tree_transpose(*treedefs, jac)
        return (jac, *aux) if self.has_aux else jac


class JacfwdPlan(AbstractJacobian):
    rev: ClassVar[bool] = False

    def budget_size(self, fun: Fun, options: ChunkOptions, bound: Bound) -> int:
        return _offsets(self._dynamic(fun, options, bound)[1])[1]

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
                _basis(dynamic, index)
            )
            unbatched, static = eqx.partition((y, aux), eqx.is_array)
            # What no trace computed (a NumPy `aux`) is returned as it is.
            unbatched, kept = keep_untraced(unbatched)
            return _derivatives(t, True, unbatched, eqx.combine(static, kept))

        out = _over_indices(_columns, dynamic, chunk_size, options)
        y, aux = eqx.combine(out.unbatched, unwrap_kept(out.static))
        self._check_output(y, options)
        example = self._pick(dynamic)

        def _unravel_columns(y_leaf: Any, block: Any) -> Any:
            shape = lambda leaf: np.shape(y_leaf) + np.shape(leaf)
            return _unravel(block, example, y_leaf, np.ndim(y_leaf), shape)

        jac = jtu.tree_map(_unravel_columns, y, out.batched)
        return (jac, aux) if has_aux else jac
