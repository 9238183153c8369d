"""Running the staged evaluation, and its oracle `jax.vmap`, in the tests."""

import jax

from filtered_chunk._staged import run_staged


def staged_call(fun, mapped, unmapped, chunk_size, remainder="overlap", **kwargs):
    """`run_staged` on a `fun(mapped, unmapped) -> (mapped_out, unmapped_out)`."""
    batch_size = mapped[0].shape[0]
    auxes = []

    # Under `jit`, as the chunked transforms run it: eagerly, every operation
    # would compile on its own.
    @jax.jit
    def _run(_mapped, _unmapped):
        out_mapped, out_unmapped, aux, _ = run_staged(
            lambda m, u: (*fun(m, u), "aux"),
            _mapped,
            _unmapped,
            batch_size=batch_size,
            chunk_size=chunk_size,
            remainder=remainder,
            checkpoint=kwargs.get("checkpoint", True),
            axis_name=kwargs.get("axis_name", "i"),
        )
        auxes.append(aux)
        return out_mapped, out_unmapped

    out = _run(list(mapped), list(unmapped))
    assert auxes == ["aux"]
    return out


def vmap_call(fun, mapped, unmapped, axis_name="i"):
    return jax.vmap(
        lambda m: fun(m, unmapped), out_axes=(0, None), axis_name=axis_name
    )(list(mapped))
