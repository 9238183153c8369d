from typing import Any

import equinox as eqx
import jax


def tree_allclose(x: Any, y: Any, *, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """Same structure, Python types, shapes, dtypes and (close) values."""
    if jax.default_backend() == "gpu":
        atol = max(atol, 1e-3)
    return bool(eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol))
