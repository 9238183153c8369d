"""The plans of the chunked Jacobians: a mode (reverse, rows; forward, columns) is
one plan, for JAX's form and Equinox's."""

import math
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Int

from .._batch import Batch, run_batch
from .._custom_types import (
    ChunkOutput,
    keep_untraced,
    unwrap_kept,
)
from .._wrapper import (
    AbstractPlan,
    Bound,
    ChunkOptions,
    Fun,
)
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
