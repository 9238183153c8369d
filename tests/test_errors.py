"""Bad input: the message, and the exception class `eqx.filter_vmap` raises."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtered_chunk as fc


_chunked = ft.partial(fc.filter_chunked_vmap, chunk_size=2)
_x = jnp.ones((5, 3))


def _first(x, *rest):
    del rest
    return x


# (id, call with a `vmap`, exception class, message of `filter_chunked_vmap`)
_PARITY = [
    (
        "in_axes-not-an-axis",
        lambda vmap: vmap(_first, in_axes="a")(_x),
        ValueError,
        r"must consist of None, ints, and callables only; got 'a' at `in_axes`",
    ),
    (
        "in_axes-float-leaf",
        lambda vmap: vmap(_first, in_axes=(0, 1.0))(_x, _x),
        ValueError,
        r"got 1\.0 at `in_axes\[1\]`",
    ),
    (
        "in_axes-bool-leaf",
        lambda vmap: vmap(_first, in_axes=(0, True))(_x, _x),
        TypeError,
        r"got the bool True at `in_axes\[1\]`\. Booleans are not axes",
    ),
    (
        "out_axes-not-an-axis",
        lambda vmap: vmap(_first, out_axes="a")(_x),
        ValueError,
        r"got 'a' at `out_axes`",
    ),
    (
        "callable-spec-returns-str",
        lambda vmap: vmap(_first, in_axes=lambda leaf: "a")(_x),
        TypeError,
        r"returned 'a' for `args\[0\]`; a callable axis spec must return",
    ),
    (
        "in_axes-not-a-prefix",
        lambda vmap: vmap(_first, in_axes=(0, 0, 0))(_x, _x),
        ValueError,
        r"`in_axes` must be a PyTree prefix of the positional arguments, got "
        r"\(0, 0, 0\)",
    ),
    (
        "mapped-rank-0-array",
        lambda vmap: vmap(_first, in_axes=(0, 0))(_x, {"w": jnp.array(1.0)}),
        ValueError,
        r"`args\[1\]\['w'\]` is a rank-0 array, which has no axis 0",
    ),
    (
        "mapped-numpy-scalar",
        lambda vmap: vmap(_first)(_x, np.float64(1.0)),
        ValueError,
        r"`args\[1\]` is a rank-0 array",
    ),
    (
        "mapped-python-scalar",
        lambda vmap: vmap(_first, in_axes=(0, 0))(_x, 2.0),
        ValueError,
        r"`args\[1\]` is the Python scalar 2\.0, which has no axis 0",
    ),
    (
        "mapped-non-array",
        lambda vmap: vmap(_first, in_axes=(0, {"s": 0}))(_x, {"s": "name"}),
        TypeError,
        r"`args\[1\]\['s'\]` is str object 'name', which is not an array",
    ),
    (
        "in_axis-out-of-range",
        lambda vmap: vmap(_first, in_axes=(0, [-3]))(_x, [_x]),
        ValueError,
        r"`args\[1\]\[0\]` has shape \(5, 3\), so axis -3 is out of range",
    ),
    (
        "out_axis-out-of-range",
        lambda vmap: vmap(_first, out_axes={"a": 2})({"a": _x}),
        ValueError,
        r"axis 2 for `output\['a'\]`.*out of bounds",
    ),
    (
        "inconsistent-sizes",
        lambda vmap: vmap(_first)(_x, {"w": jnp.ones(4)}),
        ValueError,
        r"inconsistent sizes along the mapped axes: `args\[0\]`: 5, "
        r"`args\[1\]\['w'\]`: 4",
    ),
    (
        "axis_size-inconsistent",
        lambda vmap: vmap(_first, axis_size=4)(_x),
        ValueError,
        r"`args\[0\]`: 5 and `axis_size=4`",
    ),
    (
        "out_axes-none-on-batched-output",
        lambda vmap: vmap(
            lambda x: {"a": x, "b": (x.sum(), 2)}, out_axes={"a": 0, "b": None}
        )(_x),
        ValueError,
        r"gives `None` for `output\['b'\]\[0\]`, but it varies over the batch",
    ),
    (
        # Errors from a `vmap` inside `fun` are the user's: never rewritten.
        "inner-filter_vmap-out_axes",
        lambda vmap: vmap(
            lambda x: eqx.filter_vmap(lambda y: (y * x, y), out_axes=(None, 0))(
                jnp.ones(2)
            )
        )(jnp.arange(10.0)),
        ValueError,
        r"^at vmap out_axes\[0\]\[1\], got axis spec None but output was batched",
    ),
    (
        "inner-jax-vmap-out_axes",
        lambda vmap: vmap(
            lambda x: jax.vmap(lambda y: y * x, out_axes=None)(jnp.ones(2))
        )(jnp.arange(10.0)),
        ValueError,
        r"^at vmap out_axes, got axis spec None but output was batched on axis 0",
    ),
    (
        # `eqx.filter_vmap` checks the batch before the outputs' types.
        "nothing-mapped-non-array-output",
        lambda vmap: vmap(lambda x: (x, "s"), in_axes=None, out_axes=0)(_x),
        ValueError,
        r"Cannot resolve batch dimension",
    ),
    (
        "axis_size-negative-nothing-mapped",
        lambda vmap: vmap(lambda x: x * 2, in_axes=None, axis_size=-1)(_x),
        TypeError,
        r"`filter_chunked_vmap\(\.\.\., axis_size=\.\.\.\)` must be a non-negative",
    ),
    (
        "axis_size-negative-mapped",
        lambda vmap: vmap(_first, axis_size=-1)(_x),
        ValueError,
        r"`args\[0\]`: 5 and `axis_size=-1`",
    ),
    (
        "callable-in_axes-returns-bool",
        lambda vmap: vmap(_first, in_axes=lambda leaf: True)(_x),
        TypeError,
        r"got <function .*> for `args\[0\]`\. Booleans are not axes",
    ),
    (
        "nothing-mapped",
        lambda vmap: vmap(_first, in_axes=None)(_x),
        ValueError,
        r"Cannot resolve batch dimension",
    ),
    (
        "dict-in_axes-unknown-name",
        lambda vmap: vmap(_first, in_axes=dict(y=None))(_x),
        ValueError,
        r"did not correspond to any argument.*\('y',\)",
    ),
    (
        "dict-in_axes-default-not-passed",
        lambda vmap: vmap(lambda x, y=1.0: x, in_axes=dict(y=None))(_x),
        ValueError,
        r"did not correspond to any argument: \('y',\)",
    ),
]


@pytest.mark.parametrize(
    "call,cls,match", [case[1:] for case in _PARITY], ids=[case[0] for case in _PARITY]
)
def test_same_exception_as_filter_vmap(call, cls, match):
    with pytest.raises(cls, match=match):
        call(_chunked)
    with pytest.raises(cls):
        call(eqx.filter_vmap)


@pytest.mark.parametrize(
    "kwargs,match",
    (
        (dict(chunk_size=0), r"`filter_chunked_vmap\(\.\.\., chunk_size=\.\.\.\)`"),
        (dict(chunk_size=-2), r"must be a positive integer or `None`, got -2"),
        (dict(chunk_size=True), r"must be a positive integer or `None`, got True"),
        (
            dict(remainder="pad"),
            r"\(\.\.\., remainder=\.\.\.\)` must be one of \('overlap'",
        ),
        (dict(in_axes=(0, 1.5)), r"got 1\.5 at `in_axes\[1\]`"),
        (dict(in_axes=dict(y=1.5)), r"got 1\.5 at `in_axes\['y'\]`"),
        (dict(out_axes={"a": "b"}), r"got 'b' at `out_axes\['a'\]`"),
    ),
)
def test_bad_value_at_wrap_time(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fc.filter_chunked_vmap(_first, **kwargs)
    with pytest.raises(ValueError, match=match):
        fc.filter_chunked_vmap(**kwargs)(_first)


def test_errors_before_fun_is_called():
    calls = []

    def f(x, y):
        calls.append(None)
        return x

    with pytest.raises(ValueError, match="inconsistent sizes"):
        _chunked(f)(_x, jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="rank-0"):
        _chunked(f)(_x, jnp.array(1.0))
    assert calls == []
