"""The implementations compared: `filter_chunked_vmap` and its peers.

Each peer turns `(fun, in_axes, out_axes, chunk_size)` into a mapped function, with
`in_axes` of `0`/`None` per argument and `out_axes` of `0`/`None` per output (an
`int` for a single output). Peers without `out_axes=None` (`jax.lax.map`, NetKet)
map such an output like any other and keep its first element: what a user of those
APIs would write, and what it costs.
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

import filtered_chunk as fc


Mapper = Callable[[Callable[..., Any], Any, Any, int], Callable[..., Any]]


@dataclass(frozen=True)
class Peer:
    key: str
    label: str
    make: Mapper
    # Chunked peers are measured at every chunk size; the others once per batch.
    chunked: bool = True
    # Filtered peers are handed the workload's filter form (an `eqx.Module`).
    filtered: bool = False
    # Peers that unroll a Python loop are skipped above this many chunks (their
    # compile time grows with the number of chunks).
    max_chunks: int | None = None


def _is_none(x: Any) -> bool:
    return x is None


def _per_output(out_axes: Any, out: Any, fn: Callable[[Any, Any], Any]) -> Any:
    """Applies `fn(axis, subtree)` to each output subtree under `out_axes`."""
    return jtu.tree_map(fn, out_axes, out, is_leaf=_is_none)


def _first_of_unmapped(out: Any, out_axes: Any) -> Any:
    def _take(axis: Any, sub: Any) -> Any:
        return sub if axis is not None else jtu.tree_map(lambda x: x[0], sub)

    return _per_output(out_axes, out, _take)


def _lax_map(fun: Callable[..., Any], in_axes: Any, out_axes: Any, k: int) -> Any:
    def mapped(*args: Any) -> Any:
        xs = [a if ax is not None else None for a, ax in zip(args, in_axes)]

        def body(_xs: list[Any]) -> Any:
            full = [x if ax is not None else a for x, a, ax in zip(_xs, args, in_axes)]
            return fun(*full)

        out = jax.lax.map(body, xs, batch_size=k)
        return _first_of_unmapped(out, out_axes)

    return mapped


def _python_loop(fun: Callable[..., Any], in_axes: Any, out_axes: Any, k: int) -> Any:
    chunk = jax.jit(jax.vmap(fun, in_axes=in_axes, out_axes=out_axes))

    def mapped(*args: Any) -> Any:
        mapped_leaves = [
            leaf
            for a, ax in zip(args, in_axes)
            if ax is not None
            for leaf in jtu.tree_leaves(a)
        ]
        n = mapped_leaves[0].shape[0]
        outs = []
        for start in range(0, n, k):
            stop = min(start + k, n)
            sliced = [
                a if ax is None else jtu.tree_map(lambda x: x[start:stop], a)
                for a, ax in zip(args, in_axes)
            ]
            outs.append(chunk(*sliced))

        def _merge(axis: Any, *subs: Any) -> Any:
            if axis is None:
                return subs[0]
            return jtu.tree_map(lambda *xs: jnp.concatenate(xs), *subs)

        return jtu.tree_map(_merge, out_axes, *outs, is_leaf=_is_none)

    return mapped


def _netket() -> Mapper:
    # Imported here, outside any trace: importing NetKet sets a JAX mesh. It also
    # turns on 64-bit mode, which would change every peer's programs: undo that.
    x64 = jax.config.read("jax_enable_x64")
    import netket.jax as nkjax

    jax.config.update("jax_enable_x64", x64)

    def make(fun: Callable[..., Any], in_axes: Any, out_axes: Any, k: int) -> Any:
        chunked = nkjax.vmap_chunked(fun, in_axes=in_axes, chunk_size=k)
        # NetKet maps every output along axis 0; keep one copy of unmapped ones.
        return lambda *args: _first_of_unmapped(chunked(*args), out_axes)

    return make


def _fc(remainder: str) -> Mapper:
    def make(fun: Callable[..., Any], in_axes: Any, out_axes: Any, k: int) -> Any:
        return fc.filter_chunked_vmap(
            fun, in_axes=in_axes, out_axes=out_axes, chunk_size=k, remainder=remainder
        )

    return make


def netket_available() -> bool:
    return importlib.util.find_spec("netket") is not None


def peers(quick: bool = False) -> list[Peer]:
    """Every implementation measured; NetKet only where it is installed."""
    out = [
        Peer("fc", "filter_chunked_vmap", _fc("overlap"), filtered=True),
        Peer(
            "fc_separate",
            'filter_chunked_vmap (remainder="separate")',
            _fc("separate"),
            filtered=True,
        ),
        Peer(
            "vmap",
            "jax.vmap",
            lambda f, i, o, k: jax.vmap(f, in_axes=i, out_axes=o),
            chunked=False,
        ),
        Peer(
            "filter_vmap",
            "eqx.filter_vmap",
            lambda f, i, o, k: eqx.filter_vmap(f, in_axes=i, out_axes=o),
            chunked=False,
            filtered=True,
        ),
        Peer("lax_map", "jax.lax.map(batch_size=)", _lax_map),
        Peer(
            "loop", "Python loop (in jit)", _python_loop, max_chunks=16 if quick else 64
        ),
    ]
    if netket_available():
        out.append(Peer("netket", "netket.jax.vmap_chunked", _netket()))
    return out
