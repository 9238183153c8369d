"""Errors on a JAX user's habits: positional arguments to the builders, and
tracebacks of errors raised inside `fun`, which show none of the library's frames.
"""

import inspect
import pathlib
import traceback
import typing
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import filtered_chunk as fc


_PACKAGE = pathlib.Path(fc.__file__).resolve().parent


def _f(x, w):
    return x * w


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda: fc.filter_chunked_vmap(_f, (0, None), chunk_size=16),  # pyright: ignore[reportCallIssue]
            r"`filter_chunked_vmap` takes 1 positional argument but got 2\. Its other "
            r"arguments \(`in_axes`, `out_axes`, `chunk_size`, \.\.\.\) are "
            r"keyword-only, unlike in `jax\.vmap`: write "
            r"`filter_chunked_vmap\(_f, in_axes=\(0, None\), chunk_size=16\)`\.",
        ),
        (
            lambda: fc.filter_chunked_vmap(_f, (0, None), 0),  # pyright: ignore[reportCallIssue]
            r"write `filter_chunked_vmap\(_f, in_axes=\(0, None\), out_axes=0\)`",
        ),
        (
            lambda: fc.filter_chunked_vmap(lambda x: x, 0, 0, 4),  # pyright: ignore[reportCallIssue]
            r"got 4\..*write `filter_chunked_vmap\(fun, in_axes=\.\.\., "
            r"out_axes=\.\.\., \.\.\.\)`",
        ),
        (
            lambda: fc.filter_chunked_apply(_f, (None, 0), chunk_size=8),  # pyright: ignore[reportCallIssue]
            r"`filter_chunked_apply` takes 1 positional argument but got 2\..*"
            r"write `filter_chunked_apply\(_f, in_axes=\(None, 0\), chunk_size=8\)`",
        ),
        (
            lambda: fc.chunked_jacrev(_f, 0, True, chunk_size=8),  # pyright: ignore[reportCallIssue]
            r"`chunked_jacrev` takes 2 positional arguments but got 3\..*unlike in "
            r"`jax\.jacrev`: write `chunked_jacrev\(_f, has_aux=True, chunk_size=8\)`",
        ),
        (
            lambda: fc.chunked_jacfwd(_f, 0, True),  # pyright: ignore[reportCallIssue]
            r"`chunked_jacfwd` takes 2 positional arguments but got 3\.",
        ),
        (
            lambda: fc.filter_chunked_jacrev(_f, True, chunk_size=8),  # pyright: ignore[reportCallIssue]
            r"unlike in `equinox\.filter_jacrev`: write "
            r"`filter_chunked_jacrev\(_f, has_aux=True, chunk_size=8\)`",
        ),
        (
            lambda: fc.filter_chunked_jacfwd(_f, True),  # pyright: ignore[reportCallIssue]
            r"`filter_chunked_jacfwd` takes 1 positional argument but got 2\.",
        ),
    ],
)
def test_positional_arguments_name_the_keywords(build, match):
    with pytest.raises(TypeError, match=match):
        build()


def test_keyword_form_still_works():
    x, w = jnp.arange(6.0).reshape(3, 2), jnp.float64(2.0)
    chunked = fc.filter_chunked_vmap(_f, in_axes=(0, None), chunk_size=2)
    assert jnp.allclose(chunked(x, w), jax.vmap(_f, in_axes=(0, None))(x, w))
    assert fc.filter_chunked_vmap.__name__ == "filter_chunked_vmap"
    assert "chunk_size" in (fc.filter_chunked_vmap.__doc__ or "")


def _shape_bug(x, w):
    return x @ w  # (3,) @ (4, 2): a shape error inside the user's function


def _calls():
    x, w = jnp.ones((8, 3)), jnp.ones((4, 2))
    vmap = fc.filter_chunked_vmap(_shape_bug, in_axes=(0, None), chunk_size=2)
    apply = fc.filter_chunked_apply(
        lambda x, w: jnp.stack([_shape_bug(r, w) for r in x]),
        in_axes=(0, None),
        chunk_size=2,
    )
    jac = fc.chunked_jacrev(lambda w: _shape_bug(x[0], w), chunk_size=2)
    filter_jac = fc.filter_chunked_jacrev(lambda w: _shape_bug(x[0], w), chunk_size=2)
    return {
        "eager": lambda: vmap(x, w),
        "jit": lambda: jax.jit(vmap)(x, w),
        "grad": lambda: jax.grad(lambda w: jnp.sum(vmap(x, w)))(w),
        "unchunked": lambda: fc.filter_chunked_vmap(_shape_bug, in_axes=(0, None))(
            x, w
        ),
        "apply": lambda: apply(x, w),
        "jacrev": lambda: jac(w),
        "filter_jacrev": lambda: filter_jac(w),
    }


@pytest.fixture
def default_filtering() -> Iterator[None]:
    """JAX's default traceback filtering, as users have it, whatever the run sets
    (`.ci/run` turns it off, so that an error inside JAX shows its frames)."""
    before = getattr(jax.config, "jax_traceback_filtering")
    jax.config.update("jax_traceback_filtering", "auto")
    try:
        yield
    finally:
        jax.config.update("jax_traceback_filtering", before)


@pytest.mark.usefixtures("default_filtering")
@pytest.mark.parametrize("call", sorted(_calls()))
def test_traceback_hides_library_frames(call):
    # Under JAX's default traceback filtering, as a user sees the error.
    with pytest.raises(TypeError, match="dot_general requires contracting") as info:
        _calls()[call]()
    frames = traceback.extract_tb(info.value.__traceback__)
    files = [pathlib.Path(frame.filename).resolve() for frame in frames]
    ours = [str(f) for f in files if f.is_relative_to(_PACKAGE)]
    assert ours == []
    assert any(frame.name == "_shape_bug" for frame in frames)


@pytest.mark.usefixtures("default_filtering")
def test_traceback_no_longer_than_filter_vmap():
    x, w = jnp.ones((8, 3)), jnp.ones((4, 2))
    lengths = {}
    for name, vmap in (
        ("eqx", eqx.filter_vmap(_shape_bug, in_axes=(0, None))),
        ("fc", fc.filter_chunked_vmap(_shape_bug, in_axes=(0, None), chunk_size=2)),
    ):
        with pytest.raises(TypeError) as info:
            vmap(x, w)
        lengths[name] = len(traceback.extract_tb(info.value.__traceback__))
    # Equinox's own bound-method frames (two) are all that remains beside `fun`'s.
    assert lengths["fc"] <= lengths["eqx"] + 2


@pytest.mark.parametrize(
    "name",
    [
        "filter_chunked_vmap",
        "filter_chunked_apply",
        "chunked_jacrev",
        "chunked_jacfwd",
        "filter_chunked_jacrev",
        "filter_chunked_jacfwd",
    ],
)
def test_signature_is_the_public_one(name):
    # What `help()` and the API docs show: `fun` required, no `sentinel`, the
    # allowed values of `remainder`.
    signature = inspect.signature(getattr(fc, name))
    fun = signature.parameters["fun"]
    assert fun.default is inspect.Parameter.empty
    remainder = signature.parameters["remainder"]
    assert remainder.annotation == typing.Literal["overlap", "separate"]
    assert remainder.kind is inspect.Parameter.KEYWORD_ONLY
    assert "sentinel" not in str(signature)
