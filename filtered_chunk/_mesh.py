"""Where an array lies on the batch's mesh: the batch's sharding, specs with
and without its mesh axes, and the reshards that explicit-sharding mode needs
before `jax.shard_map` (`_sharding.py`) or a pad (`_gate.py`)."""

import math
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.core
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array


AnyMesh: TypeAlias = Mesh | AbstractMesh


class BatchSharding(NamedTuple):
    """The mesh, and the axes of it, that the batch is split over."""

    mesh: AnyMesh
    axis_names: tuple[str, ...]

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.shape[name] for name in self.axis_names)

    def spec(self, axis: int) -> P:
        """A `PartitionSpec` splitting dimension `axis` over the batch's axes."""
        names = self.axis_names
        return P(*([None] * axis), names[0] if len(names) == 1 else names)


def as_names(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def leaf_sharding(x: Any) -> NamedSharding | None:
    """The sharding JAX shows for `x` while tracing, if it is a named one."""
    if isinstance(x, jax.core.Tracer):
        # Only explicit-sharding mode puts the sharding in the type; in auto mode
        # the spec is all `None`, which reads as "not split".
        sharding = getattr(jax.typeof(x), "sharding", None)
    elif isinstance(x, jax.Array):
        sharding = x.sharding
    else:
        return None
    return sharding if isinstance(sharding, NamedSharding) else None


def entries(spec: P, ndim: int) -> list[tuple[str, ...]]:
    """The mesh axes each of `ndim` dimensions is split over."""
    return [as_names(entry) for entry in tuple(spec) + (None,) * (ndim - len(spec))]


def without(sharding: BatchSharding, spec: P, ndim: int) -> list[tuple[str, ...]]:
    """`spec`'s entries, with the batch's mesh axes removed."""
    names = sharding.axis_names
    return [tuple(n for n in e if n not in names) for e in entries(spec, ndim)]


def spec_of(entries: list[tuple[str, ...]]) -> P:
    return P(*(e[0] if len(e) == 1 else e or None for e in entries))


def batched_sharding(
    sharding: BatchSharding, struct: jax.ShapeDtypeStruct, axis: int, kind: Any
) -> NamedSharding:
    """A batched output's sharding: one device's chunk, split at `axis`; or, for
    an accumulated one, replicated over the batch's mesh axes (without `axis`)."""
    entries = without(sharding, struct.sharding.spec, len(struct.shape))
    if kind is not None:
        del entries[axis]
        return NamedSharding(sharding.mesh, spec_of(entries))
    entries[axis] = sharding.axis_names + entries[axis]
    return NamedSharding(sharding.mesh, spec_of(entries))


def gathered(sharding: BatchSharding, x: Array) -> Array:
    """In explicit mode, `x` replicated over the batch's mesh axes: a slice of a
    split dimension must be one the devices divide."""
    return conform(sharding, None, x)


def _off_mesh(sharding: BatchSharding, current: NamedSharding | None) -> bool:
    """Whether an array sharded as `current` is on no explicit mesh (a NumPy
    array, or one device's) while the batch is split in explicit mode."""
    if current is not None and current.mesh.explicit_axes:
        return False
    return bool(set(sharding.axis_names) & set(sharding.mesh.explicit_axes))


def on_mesh(sharding: BatchSharding, x: Array) -> Array:
    """In explicit mode, `x` replicated on the batch's mesh if it is on none."""
    if not _off_mesh(sharding, leaf_sharding(x)):
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, P()))


def conform(sharding: BatchSharding, axis: int | None, x: Any) -> Any:
    """In explicit mode, reshards `x` to be split over the batch's mesh axes along
    `axis` only (replicated over them if `axis` is `None`), as `shard_map` requires;
    a mapped input not on the mesh too.

    In auto mode `shard_map` reshards by itself (and types do not show shardings).
    """
    current = leaf_sharding(x)
    if _off_mesh(sharding, current):  # a mapped input is split as the batch
        if axis is None:
            return x
        return jax.sharding.reshard(
            x, NamedSharding(sharding.mesh, sharding.spec(axis))
        )
    if current is None or not current.mesh.explicit_axes:  # auto mode
        return x
    old = entries(current.spec, np.ndim(x))
    new = without(sharding, current.spec, np.ndim(x))
    if axis is not None:
        new[axis] = sharding.axis_names + new[axis]
    return x if new == old else jax.sharding.reshard(x, spec_of(new))
