"""Resolving `in_axes`/`out_axes` specs to one `int | None` per leaf, with checks."""

import contextlib
import inspect
import operator
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._custom_types import AxisSpec, is_none, ResolvedAxisSpec
from ._jax_compat import batched_none_output


# JAX and NumPy arrays and NumPy scalars: the leaves that can be mapped.
is_array = eqx.is_array


_FROM_FUN = "_filtered_chunk_raised_by_fun"


def run_tagged(fun: Callable[..., Any], *args: Any) -> Any:
    """`fun(*args)`, marking any exception it raises as the function's own: a
    transform rewrites the errors of its own `jax.vmap` (about its out axes), not
    one that `fun` raised, such as one from a `jax.vmap` inside `fun`."""
    try:
        return fun(*args)
    except Exception as e:
        # An exception type with `__slots__` is not marked: not rewritten either way.
        with contextlib.suppress(AttributeError):
            setattr(e, _FROM_FUN, True)
        raise


def batched_none_path(e: BaseException) -> tuple[int, ...] | None:
    """If `e` is a transform's own `jax.vmap` refusing an output with out axis
    `None` that varies over the batch (not an error `fun` raised, marked by
    `run_tagged`), the key path JAX names below `out_axes`; else `None`."""
    return None if getattr(e, _FROM_FUN, False) else batched_none_output(e)


def varying_unmapped(api: str, where: str, fix: str | None = None) -> ValueError:
    """The one error for an output marked `out_axes=None` that varies over the
    batch (`where`: the output, as `describe` names it, in backticks), with what
    to do instead (`fix`; by default, map it)."""
    if fix is None:
        fix = "give it an integer out axis to map it instead"
        if api == "filter_chunked_vmap":
            fix += ", or pass `sum_match=True` to sum it over the batch"
    return ValueError(
        f"`{api}(..., out_axes=...)` gives `None` for {where}, but it varies over the "
        f"batch. An output marked `None` must not depend on the mapped inputs; {fix}."
    )


def describe(argname: str, path: tuple[Any, ...]) -> str:
    """Renders a leaf's key path as the user wrote it: `args[0]['w']`, `output[1]`
    (inputs live in a tree `(args, kwargs)`, so their first key picks the name)."""
    if argname == "in_axes" and path:
        head = "args" if getattr(path[0], "idx", 0) == 0 else "kwargs"
        return head + jtu.keystr(tuple(path[1:]))
    return argname + jtu.keystr(tuple(path))


def _resolve_leaf(
    spec: AxisSpec, leaf: Any, where: str, argname: str
) -> ResolvedAxisSpec:
    # Not a callable: `None` or an int, as `check_spec` found at build time.
    axis = spec if spec is None or isinstance(spec, int) else spec(leaf)
    if isinstance(axis, bool):
        # `eqx.filter_vmap` takes a bool out axis as the int it is (`True` is 1);
        # `jax.vmap` rejects a bool in axis with `TypeError`.
        if argname == "out_axes":
            return int(axis)
        raise TypeError(
            f"An axis spec must be an `int`, `None` or a callable, got {spec!r} for "
            f"`{where}`. Booleans are not axes."
        )
    if axis is None or isinstance(axis, int):
        return axis
    if argname == "out_axes":
        # `eqx.filter_vmap` moves the axis with `jnp.moveaxis`, which takes any
        # integer (`np.int64` from shape arithmetic); `jax.vmap`'s `in_axes` do not.
        with contextlib.suppress(TypeError):
            return operator.index(axis)
    raise TypeError(
        f"The axis spec {spec!r} returned {axis!r} for `{where}`; a callable axis spec "
        "must return an `int` or `None`."
    )


def check_spec(spec: PyTree[Any], argname: str) -> None:
    """Checks, when the transform is built, that a spec holds only valid leaves."""
    # `spec` is the user's, still unchecked: annotated `Any` so that a runtime type
    # checker leaves the (value) error to this function.
    for path, leaf in jtu.tree_leaves_with_path(spec, is_leaf=is_none):
        if leaf is None or callable(leaf):
            continue
        if isinstance(leaf, bool) and argname == "in_axes":  # as from `jax.vmap`
            raise TypeError(
                f"`{argname}` must consist of `None`, ints and callables, got the bool "
                f"{leaf!r} at `{argname}{jtu.keystr(path)}`. Booleans are not axes."
            )
        if not isinstance(leaf, int):
            raise ValueError(
                f"`in_axes` and `out_axes` must consist of None, ints, and callables "
                f"only; got {leaf!r} at `{argname}{jtu.keystr(path)}`."
            )


def _prefix_error(spec: PyTree[Any], tree: PyTree[Any]) -> ValueError | None:
    try:
        jtu.tree_map(lambda *_: None, spec, tree, is_leaf=is_none)
    except ValueError as e:
        return e
    return None


def resolve_axes(
    tree: PyTree[Any], spec: PyTree[AxisSpec], argname: str
) -> PyTree[ResolvedAxisSpec]:
    """Evaluates the prefix `spec` on every leaf of `tree`, as `eqx.filter_vmap`."""
    error = _prefix_error(spec, tree)
    if error is not None:
        shown, target = spec, "the output" if argname == "out_axes" else "the inputs"
        if argname == "in_axes" and isinstance(spec, tuple) and len(spec) == 2:
            # Built by `bind_arguments` as `(args, kwargs)`: show what was written.
            bad_args = _prefix_error(spec[0], tree[0]) is not None
            shown = spec[0] if bad_args else spec[1]
            target = "the positional arguments" if bad_args else "the keyword arguments"
        raise ValueError(
            f"`{argname}` must be a PyTree prefix of {target}, got {shown!r}. JAX "
            f"reported: {error}"
        ) from None

    def _subtree(prefix: tuple[Any, ...], s: AxisSpec, subtree: Any) -> Any:
        def _leaf(path: tuple[Any, ...], leaf: Any) -> ResolvedAxisSpec:
            return _resolve_leaf(s, leaf, describe(argname, prefix + path), argname)

        return jtu.tree_map_with_path(_leaf, subtree)

    return jtu.tree_map_with_path(_subtree, spec, tree, is_leaf=is_none)


def normalise_in_axes(
    tree: PyTree[Any], spec: PyTree[AxisSpec]
) -> PyTree[ResolvedAxisSpec]:
    """The axes `spec` gives the leaves of `tree`, made >= 0, once checked: each
    mapped leaf must be an array with that axis."""

    def _check(path: tuple[Any, ...], axis: ResolvedAxisSpec, leaf: Any) -> Any:
        if axis is None:
            return None
        where = describe("in_axes", path)
        scalar = isinstance(leaf, bool | int | float | complex) and not is_array(leaf)
        if not scalar and not is_array(leaf):
            raise TypeError(
                f"`{where}` is {type(leaf).__name__} object {leaf!r}, which is "
                f"not an array, but its axis spec is {axis}. Only arrays can be "
                "mapped: mark it `None` (or use `eqx.if_array(...)`)."
            )
        ndim = np.ndim(leaf)
        if ndim == 0:
            # `jax.vmap` raises `ValueError` for a mapped Python scalar too.
            what = f"the Python scalar {leaf!r}" if scalar else "a rank-0 array"
            raise ValueError(
                f"`{where}` is {what}, which has no axis {axis} to map over. Mark it "
                "unmapped with `None` (or use `eqx.if_array`), or pass an array with "
                "a batch axis."
            )
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"`{where}` has shape {tuple(np.shape(leaf))}, so axis {axis} is out "
                f"of range: a mapped axis must be in [-{ndim}, {ndim})."
            )
        return axis % ndim

    axes = resolve_axes(tree, spec, "in_axes")
    return jtu.tree_map_with_path(_check, axes, tree, is_leaf=is_none)


def batch_size_of(
    tree: PyTree[Any], axes: PyTree[ResolvedAxisSpec], axis_size: int | None, api: str
) -> int | None:
    """The common size of all mapped axes; `None` if nothing is mapped."""
    leaves = dict(jtu.tree_leaves_with_path(tree))
    sizes = {
        describe("in_axes", path): int(np.shape(leaves[path])[axis])
        for path, axis in jtu.tree_leaves_with_path(axes)
    }
    distinct = set(sizes.values())
    if axis_size is not None:
        distinct.add(axis_size)
    if axis_size is not None and axis_size < 0 and not sizes:
        # `jax.vmap` fails to broadcast to a negative size with `TypeError`.
        raise TypeError(
            f"`{api}(..., axis_size=...)` must be a non-negative integer or `None`, "
            f"got {axis_size!r}."
        )
    if len(distinct) > 1:
        listed = ", ".join(f"`{p}`: {s}" for p, s in sizes.items())
        extra = f" and `axis_size={axis_size}`" if axis_size is not None else ""
        raise ValueError(
            f"`{api}` got inconsistent sizes along the mapped axes: {listed}{extra}. "
            "Every leaf with a non-`None` `in_axes` must have the same batch size; "
            "use `in_axes=None` for leaves that should be broadcast."
        )
    return distinct.pop() if distinct else None


def _positional_names(signature: inspect.Signature | None, num_args: int) -> list[str]:
    """The parameter name of each positional argument; `*args` names all extras."""
    if signature is None:
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = signature.parameters.values()
    names = [p.name for p in params if p.kind in kinds]
    var = [p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL]
    return (names + var * max(num_args - len(names), 0))[:num_args]


def bind_arguments(
    fun: Callable[..., Any],
    in_axes: PyTree[AxisSpec],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    api: str,
) -> tuple[tuple[tuple[Any, ...], dict[str, Any]], Any]:
    """The tree `(args, kwargs)`, keyword arguments bound to `fun`'s signature, and
    the matching spec, as the **Returns:** of `filter_chunked_vmap`'s docstring says."""
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        signature = None
    if signature is not None and kwargs:
        with contextlib.suppress(TypeError):  # else `fun` raises its own when called
            bound = signature.bind(*args, **kwargs)
            args, kwargs = bound.args, bound.kwargs
    if isinstance(in_axes, dict):
        names = [] if signature is None else list(signature.parameters)
        unknown = [k for k in in_axes if k not in names and k not in kwargs]
        if unknown:
            raise ValueError(
                f"The following `in_axes` did not correspond to any argument of "
                f"`{api}`'s function: {tuple(unknown)}. A dict `in_axes` maps "
                f"parameter names to axis specs; the parameters are {tuple(names)}."
            )
        positional = _positional_names(signature, len(args))
        unpassed = [k for k in in_axes if k not in positional and k not in kwargs]
        if unpassed:
            raise ValueError(
                f"The following `in_axes` did not correspond to any argument: "
                f"{tuple(unpassed)}. A parameter named in a dict `in_axes` must be "
                "passed explicitly (its default value is not mapped)."
            )
        arg_axes = tuple(in_axes.get(name, eqx.if_array(0)) for name in positional)
        kwarg_axes = {k: in_axes.get(k, eqx.if_array(0)) for k in kwargs}
        return (args, kwargs), (arg_axes, kwarg_axes)
    if isinstance(in_axes, tuple | list):
        return (args, kwargs), (in_axes, {k: eqx.if_array(0) for k in kwargs})
    return (args, kwargs), in_axes
