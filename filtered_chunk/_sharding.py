"""Chunking a sharded batch inside each device's shard.

Chunking an axis that is sharded over devices breaks sharding propagation: the
scan's dynamic slices index the whole batch, so XLA gathers it onto every device
(`jax.lax.map(batch_size=)` on a sharded batch adds all-gathers and returns a
replicated output: `python benchmarks/sharding.py` counts them, and
`tests/sharding_cases.py` checks that the programs here have none). Instead, when
the batch is split over a mesh axis, [`run_sharded`][] runs the chunked map under
`jax.shard_map`, manual over that mesh axis only: each device chunks its own
`batch_size / num_devices` elements, and the compiled program has no collective on
the batch. Unmapped inputs enter `shard_map` replicated over the manual axis (so
`shard_map`'s transpose sums their cotangents over it, once) and stay as they are
over every other mesh axis.

The mesh axis is found from the mapped inputs wherever JAX shows it when tracing:
the `NamedSharding` of a concrete `jax.Array`, or the type of a traced array in
explicit-sharding mode. Under `jit` in auto mode the sharding is invisible, so the
user names the mesh axis with `spmd_axis_name` (and the mesh comes from
`jax.set_mesh`).
"""

import functools as ft
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, PyTree

from ._axes import describe, is_array
from ._custom_types import ChunkFn, ChunkOutput, InputArray, SpmdAxisName
from ._mesh import (
    AnyMesh,
    as_names,
    batched_sharding,
    BatchSharding,
    conform,
    leaf_sharding,
    spec_of,
    without,
)
from ._reporting import sharded
from ._structs import struct


def check_spmd_axis_name(spmd_axis_name: SpmdAxisName, api: str) -> None:
    """Checks, when the transform is built, that `spmd_axis_name` names axes."""
    names = as_names(spmd_axis_name)
    if spmd_axis_name is not None and (not names or len(set(names)) != len(names)):
        raise ValueError(
            f"`{api}(..., spmd_axis_name=...)` must be a mesh axis name or a tuple of "
            f"distinct mesh axis names, got {spmd_axis_name!r}."
        )


def on_devices(structs: list[Any], xs: Iterable[Any]) -> list[Any]:
    """`structs` as a budget compiles them alone, outside the trace they come from:
    where no mesh is set (`jax.set_mesh`) but the types of `xs` name one (tracers of
    sharded arrays under `jax.jit` carry its abstract mesh, and so does every
    operation traced on them), on a concrete mesh of that shape (a struct's own,
    else this backend's first devices), replicated where they name no sharding:
    XLA compiles a program that names a mesh only for devices. The bytes a device
    needs do not depend on which devices they are."""
    if not jax.sharding.get_abstract_mesh().empty:  # set: its devices are known
        return structs
    meshes = [
        getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None) for x in xs
    ]
    named = [m for m in meshes if isinstance(m, AbstractMesh) and not m.empty]
    if not named or named[0].manual_axes:
        return structs
    abstract = named[0]
    concrete = [
        s.sharding.mesh
        for s in structs
        if isinstance(s.sharding, NamedSharding) and isinstance(s.sharding.mesh, Mesh)
    ]
    if concrete:
        mesh = concrete[0]
    else:
        devices = np.array(jax.devices()[: abstract.size]).reshape(abstract.axis_sizes)
        mesh = Mesh(devices, abstract.axis_names, axis_types=abstract.axis_types)

    def _on(s: Any) -> Any:
        sharding = s.sharding
        if sharding is None:
            sharding = NamedSharding(mesh, P())
        elif isinstance(sharding, NamedSharding) and sharding.mesh == abstract:
            sharding = NamedSharding(mesh, sharding.spec)
        else:
            return s
        return jax.ShapeDtypeStruct(
            s.shape, s.dtype, weak_type=s.weak_type, sharding=sharding
        )

    return [_on(s) for s in structs]


def _split_names(sharding: NamedSharding, axis: int) -> tuple[str, ...]:
    spec = sharding.spec
    names = as_names(spec[axis]) if axis < len(spec) else ()
    mesh = sharding.mesh
    # An axis that is already manual (inside an outer `shard_map`) is not ours.
    return tuple(n for n in names if n not in set(mesh.manual_axes))


def _same_mesh(a: AnyMesh, b: AnyMesh) -> bool:
    if isinstance(a, Mesh) and isinstance(b, Mesh):
        return a == b
    return a.abstract_mesh == b.abstract_mesh


def _pick_mesh(meshes: list[AnyMesh], api: str) -> AnyMesh | None:
    """One mesh for every input, preferring a concrete one; `None` if none seen."""
    for mesh in meshes[1:]:
        if not _same_mesh(mesh, meshes[0]):
            raise ValueError(
                f"`{api}` got mapped inputs on different meshes: {meshes[0]} and "
                f"{mesh}. Put every input on one mesh, for example with "
                "`jax.device_put(x, NamedSharding(mesh, spec))`."
            )
    concrete = [m for m in meshes if isinstance(m, Mesh)]
    return (concrete or meshes or [None])[0]


def find_batch_sharding(
    tree: PyTree[Any],
    in_axes: PyTree[int | None],
    spmd_axis_name: SpmdAxisName,
    api: str,
) -> BatchSharding | None:
    """The mesh axes the mapped inputs' batch is split over; `None` if it is not."""
    leaves = dict(jtu.tree_leaves_with_path(tree))
    meshes, split = [], {}
    for path, axis in jtu.tree_leaves_with_path(in_axes):
        sharding = leaf_sharding(leaves[path])
        if sharding is None or sharding.mesh.empty:
            continue
        meshes.append(sharding.mesh)
        names = _split_names(sharding, axis)
        if names:
            split[describe("in_axes", path)] = names
    wanted = as_names(spmd_axis_name)
    if not wanted and not split:
        return None
    mesh = _pick_mesh(meshes, api)
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    names = wanted or next(iter(split.values()))
    _check_names(mesh, names, split, spmd_axis_name, api)
    return BatchSharding(mesh, names)


def _check_names(
    mesh: AnyMesh,
    names: tuple[str, ...],
    split: dict[str, tuple[str, ...]],
    spmd_axis_name: SpmdAxisName,
    api: str,
) -> None:
    if mesh.empty:
        raise ValueError(
            f"`{api}(..., spmd_axis_name={spmd_axis_name!r})` needs a mesh, but "
            "none of the mapped inputs shows one and no mesh is set. Call it under "
            "`with jax.set_mesh(mesh):`."
        )
    missing = [n for n in names if n not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"`{api}(..., spmd_axis_name={spmd_axis_name!r})` names {missing!r}, "
            f"which are not axes of the mesh {mesh}."
        )
    disagree = {where: n for where, n in split.items() if n != names}
    if disagree:
        listed = ", ".join(f"`{where}`: {n!r}" for where, n in split.items())
        source = (
            "`spmd_axis_name`"
            if spmd_axis_name is not None
            else "`" + next(iter(split)) + "`"
        )
        raise ValueError(
            f"`{api}` got mapped inputs whose batch is split over different mesh "
            f"axes: {listed}; {source} splits it over {names!r}. Split every "
            "mapped input's batch over the same mesh axes (for example with "
            "`jax.sharding.reshard`), or replicate the odd ones."
        )


def _local_struct(sharding: BatchSharding, axis: int, x: Any) -> jax.ShapeDtypeStruct:
    """One device's shard of `x`, keeping its explicit sharding over other axes."""
    size = np.shape(x)[axis] // sharding.num_devices
    current = leaf_sharding(x)
    local = None
    if current is not None and current.mesh.explicit_axes:
        entries = without(sharding, current.spec, np.ndim(x))
        local = NamedSharding(current.mesh, spec_of(entries))
    return struct(x, axis, size, weak=False, sharding=local)


_ACROSS = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}


def across(which: str | None, x: Array, axis_names: tuple[str, ...]) -> Array:
    """Inside `shard_map`: every device's accumulator `x` (a `which` over its
    shard's rows) combined, or with `which=None` every device's rows gathered."""
    if which is None:
        return jax.lax.all_gather(x, axis_names, tiled=True)
    return _ACROSS[which](x, axis_names)


def run_sharded(
    local: Callable[[PyTree[Any], PyTree[InputArray], int], ChunkOutput],
    closed: PyTree[Any],
    chunk_fn: ChunkFn,
    mapped: PyTree[InputArray],
    in_axes: PyTree[int | None],
    *,
    batch_size: int,
    sharding: BatchSharding,
    api: str,
    check_vma: bool,
    elements: int,
) -> ChunkOutput:
    """Evaluates `local(closed, local_inputs, local_batch_size)` on each shard.

    `local` is the unsharded path (one `vmap`, or the scan over chunks), so the
    chunking core is the same on one device or many. `closed` holds what it
    closes over, unmapped arrays included: they enter `shard_map` as replicated
    inputs, since closing over tracers breaks `shard_map`'s transpose under a scan.
    `chunk_fn` only gives the outputs' axes, which put the shards back together.
    `check_vma` is `jax.shard_map`'s: the staged loops bind the primitives of a
    traced program one by one, which type no value as varying over devices.
    `elements`: the batch's without its padding (`Batch.padding`), as a progress
    meter counts them.
    """
    num_devices = sharding.num_devices
    if batch_size % num_devices != 0:
        raise ValueError(
            f"`{api}` got a batch of {batch_size} elements split over the mesh "
            f"axes {sharding.axis_names!r} of {num_devices} devices, with "
            "collectives over `axis_name` computed across chunks. For those, "
            f"the batch size must be a multiple of {num_devices}: pad the batch, "
            "or do not split it (drop `spmd_axis_name`, or replicate the inputs)."
        )
    local_size = batch_size // num_devices
    arrays, rest = eqx.partition(closed, is_array)
    arrays = jtu.tree_map(ft.partial(conform, sharding, None), arrays)
    mapped = jtu.tree_map(ft.partial(conform, sharding), in_axes, mapped)
    structs = jtu.tree_map(ft.partial(_local_struct, sharding), in_axes, mapped)
    shapes = eqx.filter_eval_shape(chunk_fn, structs, local_size)

    kinds = shapes.kinds()

    def _local(_arrays: PyTree[Array], _mapped: PyTree[InputArray]) -> tuple[Any, Any]:
        # One meter, not one a device.
        with sharded(sharding.axis_names, num_devices, elements):
            _out = local(eqx.combine(_arrays, rest), _mapped, local_size)
        # An accumulated output: every device's accumulator, combined.
        leaves, treedef = jtu.tree_flatten(_out.batched)
        leaves = [
            x if k is None else across(k, x, sharding.axis_names)
            for x, k in zip(leaves, kinds, strict=True)
        ]
        return jtu.tree_unflatten(treedef, leaves), _out.unbatched

    in_specs = (P(), jtu.tree_map(sharding.spec, in_axes))
    call = _shard_map(_local, sharding, in_specs, shapes, check_vma)
    batched, unbatched = call(arrays, mapped)
    return shapes._replace(batched=batched, unbatched=unbatched)


def _shard_map(
    fn: Callable[..., Any],
    sharding: BatchSharding,
    in_specs: Any,
    shapes: ChunkOutput,
    check_vma: bool,
) -> Callable[..., Any]:
    """`jax.shard_map` of `fn`, manual over the batch's mesh axes only."""
    out_specs = (
        jtu.tree_unflatten(
            jtu.tree_structure(shapes.batched),
            [
                sharding.spec(axis) if k is None else P()
                for axis, k in zip(shapes.batched_axes, shapes.kinds(), strict=True)
            ],
        ),
        P(),  # `out_axes=None` outputs do not vary over devices
    )
    kwargs = dict(
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(sharding.axis_names),
        check_vma=check_vma,
    )
    others = [a for a in sharding.mesh.explicit_axes if a not in sharding.axis_names]
    if not others:
        return jax.shard_map(fn, mesh=sharding.mesh, **kwargs)

    # With other explicit mesh axes, a partial-manual `shard_map` lowers to
    # all-gathers over them (jax 0.10). Making them auto for the call avoids it;
    # the outputs' explicit shardings come from the evaluated shapes.
    def _call(*args: Any) -> Any:
        mesh = jax.sharding.get_abstract_mesh()
        return jax.shard_map(fn, mesh=mesh, **kwargs)(*args)

    structs = jtu.tree_leaves(shapes.batched)
    batched = [
        batched_sharding(sharding, struct, axis, k)
        for struct, axis, k in zip(
            structs, shapes.batched_axes, shapes.kinds(), strict=True
        )
    ]
    out_sharding = (
        jtu.tree_unflatten(jtu.tree_structure(shapes.batched), batched),
        jtu.tree_map(lambda struct: struct.sharding, shapes.unbatched),
    )
    return jax.sharding.auto_axes(_call, axes=tuple(others), out_sharding=out_sharding)
