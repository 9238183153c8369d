"""Tangents where `None` is a zero that stays symbolic: a leaf without one is
held constant, never given a tangent of zeros (`0 * inf` is `nan`). The
derivatives of the staged passes (`_derivative.py`) add and pass them so."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._structs import inexact


def jvp_held(fn: Any, primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> Any:
    """The tangents of `fn` at `primals`, where a `None` (or missing) tangent is
    zero: that leaf is held constant, never a tangent of zeros (`0 * inf`)."""
    leaves, treedef = jax.tree.flatten(primals)
    t_leaves = aligned(primals, tangents)
    moved = [
        j
        for j, (x, t) in enumerate(zip(leaves, t_leaves, strict=True))
        if t is not None and inexact(x)
    ]

    def _fn(*diff: Any) -> Any:
        full = list(leaves)
        for j, d in zip(moved, diff, strict=True):
            full[j] = d
        return fn(*jax.tree.unflatten(treedef, full))

    if not moved:
        return jax.tree.map(lambda _: None, _fn())
    _, t_out = jax.jvp(
        jax.jit(_fn), tuple(leaves[j] for j in moved), tuple(t_leaves[j] for j in moved)
    )
    return t_out


def aligned(primals: Any, tangents: Any) -> list[Any]:
    """`tangents` as a list of `primals`' leaves, `None` where there is none (a
    `None` subtree, or a key of a dict that `tangents` lacks)."""
    if isinstance(primals, dict):
        tangents = tangents or {}
        # In `jax.tree`'s order of a dict's keys: sorted.
        keys = sorted(primals)
        return [t for key in keys for t in aligned(primals[key], tangents.get(key))]
    if isinstance(primals, list | tuple):
        tangents = tangents if tangents is not None else [None] * len(primals)
        return [
            t for p, u in zip(primals, tangents, strict=True) for t in aligned(p, u)
        ]
    if primals is None:
        return []
    return [tangents]


def add_tangents(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None or not inexact(a):
        return a
    return a + b


def tangent_or_zero(x: Any, t: Any) -> Any:
    """`t`, or the zero tangent of `x` where it has none (`float0` if not inexact)."""
    if not inexact(x):
        return np.zeros(np.shape(x), jax.dtypes.float0)
    return jnp.zeros_like(x) if t is None else t
