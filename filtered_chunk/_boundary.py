"""Where errors meet the user: positional arguments in the public builders, and
the traceback frames of the library.

JAX users write `jax.vmap(f, (0, None))`; the builders here take everything but
`fun` by keyword, as `equinox.filter_vmap` does. [`keyword_only`][] turns the bare
`TypeError: too many positional arguments` of such a call into one that names the
arguments and shows the call to write instead.

[`api_boundary`][] marks a wrapper's `__call__` as the place below which JAX drops
the frames of excluded files from a traceback, and the package's folder is
excluded here, as Equinox excludes its own files: an error inside `fun` then shows
no frame of this library, as under `equinox.filter_vmap`.

The builders' docstrings share text: `{meters}` stands for the progress meters a
`progress_meter` argument takes, filled in by `keyword_only` (so that `help()` and
the API docs show it).
"""

import functools as ft
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from ._jax_compat import api_boundary as api_boundary, exclude_from_tracebacks


_F = TypeVar("_F", bound=Callable[..., Any])

exclude_from_tracebacks(__file__)

_SHARED_DOCS = {
    "{meters}": "`None` or `filtered_chunk.NoProgressMeter()` (the default: nothing, "
    "at no cost), `filtered_chunk.TextProgressMeter()`, "
    "`filtered_chunk.TqdmProgressMeter()`, or a subclass of "
    "`filtered_chunk.AbstractProgressMeter`.",
}


def _call_text(
    api: str, fun: Any, names: tuple[str, ...], extra: tuple[Any, ...], kwargs: Any
) -> str:
    """The call the user meant: extra positional arguments named as keywords."""
    fun_name = getattr(fun, "__name__", "fun")
    if not fun_name.isidentifier():  # a lambda
        fun_name = "fun"
    parts = [fun_name] + [f"{n}={v!r}" for n, v in zip(names, extra)]
    parts += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{api}({', '.join(parts)})"


def _public_signature(builder: Callable[..., Any]) -> inspect.Signature:
    """The signature of the overload that takes `fun`, as `help()` and the API
    docs show it: `fun` required, `remainder` a `Literal`, no `sentinel`."""
    for overload in typing.get_overloads(builder):
        signature = inspect.signature(overload)
        first = next(iter(signature.parameters.values()), None)
        if first is not None and first.name == "fun":
            # As a string: shown as written, not as `collections.abc.Callable`.
            return signature.replace(return_annotation="Callable[..., Any]")
    return inspect.signature(builder)


def deferred(builder: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """`builder` waiting for `fun`, with the other `arguments` (a builder's
    `locals()`, its parameters): the decorator form `builder(...)(fun)`."""
    return ft.partial(builder, **{k: v for k, v in arguments.items() if k != "fun"})


def keyword_only(
    api: str, num_positional: int, names: tuple[str, ...], like: str
) -> Callable[[_F], _F]:
    """Rejects positional arguments beyond the first `num_positional` with a
    message naming them as `names` (their meaning in the JAX or Equinox call
    `like` that users have in mind)."""

    def _decorate(builder: _F) -> _F:
        @ft.wraps(builder)
        def _builder(*args: Any, **kwargs: Any) -> Any:
            if len(args) <= num_positional:
                return builder(*args, **kwargs)
            extra = args[num_positional:]
            keyword = ", ".join(f"`{n}`" for n in names)
            if len(extra) > len(names):
                call = f"{api}(fun, {', '.join(f'{n}=...' for n in names)}, ...)"
            else:
                call = _call_text(api, args[0], names, extra, kwargs)
            raise TypeError(
                f"`{api}` takes {num_positional} positional argument"
                f"{'s' if num_positional > 1 else ''} but got {len(args)}. "
                f"Its other arguments ({keyword}, `chunk_size`, ...) are "
                f"keyword-only, unlike in `{like}`: write `{call}`."
            )

        # Introspection (`help`, `inspect.signature`, the API docs) stops here and
        # shows the public signature rather than the implementation's.
        del _builder.__wrapped__  # pyright: ignore[reportAttributeAccessIssue]
        for name, text in _SHARED_DOCS.items():
            _builder.__doc__ = (_builder.__doc__ or "").replace(name, text)
        _builder.__signature__ = _public_signature(builder)  # pyright: ignore[reportAttributeAccessIssue]
        return _builder  # pyright: ignore[reportReturnType]

    return _decorate
