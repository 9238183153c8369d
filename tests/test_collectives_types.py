"""Dtypes and weak types of staged collectives, against `eqx.filter_vmap` compiled:
a chunked call outside `jax.jit` runs as one compiled program, so its types are
those of the compiled oracle."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import pytest

import filtered_chunk as fc


N = 10
_PERM = [(j, (j + 1) % N) for j in range(N)]
_FUNS = {
    "psum": lambda x: x / lax.psum(x, "i"),
    "pmean": lambda x: x - lax.pmean(x, "i"),
    "pmax": lambda x: x - lax.pmax(x, "i"),
    "pmin": lambda x: lax.pmin(x, "i"),
    "all_gather": lambda x: lax.all_gather(x, "i"),
    "ppermute": lambda x: lax.ppermute(x, "i", _PERM),
    "axis_index": lambda x: x * lax.axis_index("i").astype(x.dtype),
    "axis_size": lambda x: x * lax.axis_size("i"),
    "constant": lambda x: (x, lax.psum(2.0, "i")),
    # A variance about the mean, summed in the mean's pass about a shift.
    "variance": lambda x: lax.pmean((x - lax.pmean(x, "i")) ** 2, "i") * x,
}
_INPUTS = {
    "weak": lambda: lax.full((N,), 0.5).at[::3].set(2.0),
    "strong": lambda: jnp.linspace(0.5, 2.0, N, dtype=jnp.float32),
    "float16": lambda: jnp.linspace(0.5, 2.0, N, dtype=jnp.float16),
}


def test_the_weak_input_is_weak():
    assert jax.typeof(_INPUTS["weak"]()).weak_type


def _types(tree):
    return jax.tree.map(lambda x: (jax.typeof(x).dtype, jax.typeof(x).weak_type), tree)


@pytest.mark.parametrize("name", _FUNS)
@pytest.mark.parametrize("given", _INPUTS)
@pytest.mark.parametrize("remainder", ("overlap", "separate"))
def test_types_are_the_compiled_oracles(name, given, remainder):
    f, x = _FUNS[name], _INPUTS[given]()
    expected = _types(eqx.filter_jit(eqx.filter_vmap(f, axis_name="i"))(x))
    chunked = fc.filter_chunked_vmap(
        f, axis_name="i", chunk_size=3, remainder=remainder
    )
    assert _types(chunked(x)) == expected
    assert _types(eqx.filter_jit(chunked)(x)) == expected


def test_eager_oracle_keeps_a_weak_type_that_its_compiled_program_drops():
    # Why the compiled oracle: before jax 0.12.1, JAX evaluated `psum` op by op
    # with a weak result, but its abstract evaluation (any trace, `jax.jit`)
    # gave a strong one. From 0.12.1 the two agree (weak), and the compiled
    # oracle is the eager one; on the versions before, this test says why not.
    f, x = _FUNS["psum"], _INPUTS["weak"]()
    eager = eqx.filter_vmap(f, axis_name="i")(x)
    compiled = eqx.filter_jit(eqx.filter_vmap(f, axis_name="i"))(x)
    agrees = jax.__version_info__ >= (0, 12, 1)
    assert jax.typeof(eager).weak_type and jax.typeof(compiled).weak_type == agrees
