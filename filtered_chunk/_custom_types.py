from collections.abc import Callable
from typing import Any, Literal, TypeAlias


ResolvedAxisSpec: TypeAlias = int | None
AxisSpec: TypeAlias = ResolvedAxisSpec | Callable[[Any], ResolvedAxisSpec]
Remainder: TypeAlias = Literal["overlap", "separate"]
# `True`/`False`, or a `jax.checkpoint_policies` policy.
CheckpointSpec: TypeAlias = bool | Callable[..., Any]
REMAINDERS: tuple[str, ...] = ("overlap", "separate")


class _Sentinel:
    def __repr__(self) -> str:
        return "sentinel"


sentinel: Any = _Sentinel()
