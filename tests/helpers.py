import contextlib
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def tree_allclose(x: Any, y: Any, *, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """Same structure, Python types, shapes, dtypes and (close) values."""
    if jax.default_backend() == "gpu":
        atol = max(atol, 1e-3)
    return bool(eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol))


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
    """Collects one entry per XLA compilation (JAX's monitoring events) while
    active: `compiles == []` when nothing compiled."""
    compiles: list[str] = []

    def _listen(event: str, duration_secs: float, **kwargs: Any) -> None:
        del duration_secs, kwargs
        if event == _BACKEND_COMPILE:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(_listen)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(_listen)


def scan_counts(eqn: Any) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a `scan` equation of a jaxpr: parameters of
    their own up to JAX 0.10; from JAX 0.11, the sizes of the groups of its
    `ft_in` (constants, carry, scanned inputs)."""
    params = eqn.params
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
