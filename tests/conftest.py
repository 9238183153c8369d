import os

import hypothesis
import jax
import jax.random as jr
import pytest


# Strict JAX, so that shape and dtype bugs cannot hide behind promotion.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

hypothesis.settings.register_profile("dev", max_examples=25, deadline=None)
hypothesis.settings.register_profile(
    "ci", max_examples=200, deadline=None, print_blob=True
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def getkey():
    """Returns a function that gives a fresh PRNG key on every call."""
    key = jr.key(0)

    def _getkey():
        nonlocal key
        key, subkey = jr.split(key)
        return subkey

    return _getkey
