"""Every public chunked transform with its oracle and an example call: the one list
that tests over all transforms (progress, budgets, eager calls, schedules) share."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import filtered_chunk as fc


class Example(NamedTuple):
    """A call of a transform split into chunks: `fun`, the builder's own keyword
    arguments, the call's arguments, and the batch size (rows or columns)."""

    fun: Callable[..., Any]
    kwargs: dict[str, Any]
    args: tuple[Any, ...]
    total: int
    chunk_size: int = 4


class Transform(NamedTuple):
    """A builder, its oracle (called as the builder, without the chunking
    options: `oracle(fun, **kwargs)`), and an example."""

    builder: Callable[..., Any]
    oracle: Callable[..., Any]
    example: Callable[[], Example]

    @property
    def name(self) -> str:
        return self.builder.__name__

    def build(self, example: Example | None = None, **options: Any) -> Any:
        """The chunked transform of `example` (default: the transform's own), at
        its chunk size unless `options` gives one, and its oracle."""
        e = self.example() if example is None else example
        options.setdefault("chunk_size", e.chunk_size)
        chunked = self.builder(e.fun, **e.kwargs, **options)
        return chunked, self.oracle(e.fun, **e.kwargs)


_W = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)


def _model() -> eqx.nn.Linear:
    return eqx.nn.Linear(3, 10, key=jr.key(0))


def _vmap() -> Example:
    f = lambda x, y: jnp.sin(x) * y
    x = jnp.linspace(0.0, 1.0, 30).reshape(10, 3)
    return Example(f, dict(in_axes=(0, None)), (x, 2.0), 10)


def _apply() -> Example:
    f = lambda x: jnp.tanh(x @ _W)
    return Example(f, {}, (jnp.linspace(0.0, 1.0, 30).reshape(10, 3),), 10)


def _jacrev() -> Example:
    f = lambda x: jnp.tanh(jnp.outer(x, x[:3])).ravel()  # 15 rows
    return Example(f, {}, (jnp.linspace(0.0, 1.0, 5),), 15)


def _jacfwd() -> Example:
    f = lambda x: jnp.sin(x) * jnp.sum(x)  # 10 columns
    return Example(f, {}, (jnp.linspace(0.0, 1.0, 10),), 10)


def _filter_jacrev() -> Example:
    f = lambda m, x: m(x)  # 10 rows
    return Example(f, {}, (_model(), jnp.ones(3)), 10)


def _filter_jacfwd() -> Example:
    f = lambda m, x: m(x)[:2]  # 3 * 10 + 10 = 40 columns
    return Example(f, {}, (_model(), jnp.ones(3)), 40, chunk_size=12)


def _apply_oracle(fun: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    del kwargs  # `in_axes`/`out_axes` only say where the batch is
    return fun


TRANSFORMS: dict[str, Transform] = {
    t.name: t
    for t in (
        Transform(fc.filter_chunked_vmap, eqx.filter_vmap, _vmap),
        Transform(fc.filter_chunked_apply, _apply_oracle, _apply),
        Transform(fc.chunked_jacrev, jax.jacrev, _jacrev),
        Transform(fc.chunked_jacfwd, jax.jacfwd, _jacfwd),
        Transform(fc.filter_chunked_jacrev, eqx.filter_jacrev, _filter_jacrev),
        Transform(fc.filter_chunked_jacfwd, eqx.filter_jacfwd, _filter_jacfwd),
    )
}
JACOBIANS = {name: t for name, t in TRANSFORMS.items() if "jac" in name}


# The JAX transformations a chunked call is differentiated under, in the tests
# that run every one of them (their order seeds the random cases).
DERIVATIVES = (
    "grad",
    "value_and_grad",
    "vjp",
    "jvp",
    "linearize",
    "jacrev",
    "jacfwd",
    "hessian",
)
