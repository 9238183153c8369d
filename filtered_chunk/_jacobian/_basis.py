"""The pieces of a chunked Jacobian: unit vectors (rows of the identity over a
flattened PyTree) made from indices, a loop over index chunks, and unravelling the
flat blocks back into PyTrees, with JAX's dtype rules and errors."""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Int

from .._axes import is_array


Argnums = int | Sequence[int]


def _is_float0(x: Any) -> bool:
    return is_array(x) and x.dtype == jax.dtypes.float0


def dtype_of(x: Any) -> np.dtype:
    """The dtype of an array or Python scalar (as JAX would make it)."""
    return jnp.result_type(x)


def dynamic_args(
    fun: Callable[..., Any],
    argnums: Argnums,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    api: str,
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


def check_dtypes(
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
        dtype = dtype_of(leaf)
        reason = allowed(dtype)
        if reason is not None:
            raise TypeError(
                f"`{api}` requires {reason}, but {what} `{where}` has dtype "
                f"{dtype.name}."
            )


def inputs_rule(holomorphic: bool, allow_int: bool, rev: bool) -> Callable:
    """The input dtypes `jax.jacrev` (`rev`) or `jax.jacfwd` accept."""

    def _allowed(dtype: np.dtype) -> str | None:
        if holomorphic and not jnp.issubdtype(dtype, jnp.complexfloating):
            return "complex inputs with `holomorphic=True`"
        if jnp.issubdtype(dtype, jnp.inexact) and (rev or holomorphic):
            return None
        if jnp.issubdtype(dtype, jnp.floating):
            return None
        if (
            rev
            and allow_int
            and (jnp.issubdtype(dtype, np.integer) or dtype == np.bool_)
        ):
            return None
        if rev:
            return (
                "real or complex inputs (use `allow_int=True` for integer and "
                "boolean inputs, which get zero derivatives)"
            )
        return "real inputs (use `holomorphic=True` for complex inputs)"

    return _allowed


def outputs_rule(holomorphic: bool, rev: bool) -> Callable:
    """The output dtypes `jax.jacrev` (`rev`) or `jax.jacfwd` accept."""

    def _allowed(dtype: np.dtype) -> str | None:
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

    return _allowed


def offsets(tree: Any) -> tuple[list[int], int]:
    """Where each leaf of `tree` starts in its flattening, and the total size."""
    sizes = [int(np.size(x)) for x in jtu.tree_leaves(tree)]
    return [int(o) for o in np.cumsum([0, *sizes[:-1]])], int(sum(sizes))


def basis(tree: Any, index: Int[Array, " size"]) -> Any:
    """Rows `index` of the identity over the flattened leaves of `tree`, as a tree
    like `tree` with a leading axis: the unit vectors, one chunk of them."""
    starts, _ = offsets(tree)

    def _unit(offset: int, leaf: Any) -> Array:
        positions = offset + jnp.arange(np.size(leaf)).reshape((1, *np.shape(leaf)))
        hits = index.reshape(index.shape + (1,) * np.ndim(leaf)) == positions
        return hits.astype(dtype_of(leaf))

    leaves, treedef = jtu.tree_flatten(tree)
    return jtu.tree_unflatten(treedef, list(map(_unit, starts, leaves)))


def without_float0(tree: Any, axis_last: bool) -> tuple[Any, tuple[int, ...]]:
    """`tree` without its float0 (integer) derivatives, and its batch axes."""
    arrays = jtu.tree_map(lambda x: None if _is_float0(x) else x, tree)
    leaves = jtu.tree_leaves(arrays)
    return arrays, tuple(x.ndim - 1 if axis_last else 0 for x in leaves)


def _cast(x: Array, like: Any) -> Array:
    """`x` with the dtype and weak type of `like`, as JAX's Jacobians give."""
    x = x.astype(dtype_of(like))
    if not jax.typeof(like).weak_type or jax.typeof(x).weak_type:
        return x
    # `astype` drops a weak type; a scatter keeps its operand's. Weak types only
    # exist for the default dtypes, which a Python scalar fill value gives.
    return lax.full(x.shape, x.dtype.type(0).item()).at[...].set(x)


def unravel(block: Any, tree: Any, like: Any, axis: int, shape: Callable) -> Any:
    """Splits `block`'s `axis` (the flattened leaves of `tree`) into a tree like
    `tree` of blocks of shape `shape(leaf)`, typed like `like`."""
    starts, _ = offsets(tree)

    def _part(offset: int, leaf: Any) -> Array:
        if block is None:  # an integer derivative: zeros, as JAX gives
            return _cast(jnp.zeros(shape(leaf)), like)
        part = lax.slice_in_dim(block, offset, offset + np.size(leaf), axis=axis)
        return _cast(part.reshape(shape(leaf)), like)

    leaves, treedef = jtu.tree_flatten(tree)
    return jtu.tree_unflatten(treedef, list(map(_part, starts, leaves)))
