"""Where the builders meet the user: their signatures, positional arguments, and
the traceback frames of the library.

JAX users write `jax.vmap(f, (0, None))`; the builders take everything but `fun` by
keyword, as `equinox.filter_vmap` does. [`keyword_only`][] turns the bare
`TypeError: too many positional arguments` of such a call into one that names the
arguments and shows the call to write instead. It also sets the signature `help()`
and the API docs show, and fills in `{meters}` in the docstring: the progress
meters a `progress_meter` argument takes.

[`api_boundary`][] marks a wrapper's `__call__` as the place below which JAX drops
the frames of excluded files from a traceback, and the package's folder is
excluded here, as Equinox excludes its own files: an error inside `fun` then shows
no frame of this library, as under `equinox.filter_vmap`.
"""

import functools as ft
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypedDict, TypeVar

from ._budget import ChunkSizeSpec
from ._custom_types import CheckpointSpec, Remainder
from ._jax_compat import api_boundary as api_boundary, exclude_from_tracebacks
from ._progress import AbstractProgressMeter


_F = TypeVar("_F", bound=Callable[..., Any])
# What a builder called without `fun` returns: the decorator form `builder(...)(fun)`.
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

exclude_from_tracebacks(__file__)

_METERS = (
    "`None` or `filtered_chunk.NoProgressMeter()` (the default: nothing, at no "
    "cost), `filtered_chunk.TextProgressMeter()`, `filtered_chunk.TqdmProgressMeter()`"
    ", or a subclass of `filtered_chunk.AbstractProgressMeter`."
)


class BuilderOptions(TypedDict, total=False):
    """The keywords every builder takes, typed for its overloads (`Unpack`)."""

    chunk_size: ChunkSizeSpec
    remainder: Remainder
    checkpoint: CheckpointSpec
    progress_meter: AbstractProgressMeter | None


def _call_text(
    api: str, fun: Any, names: tuple[str, ...], extra: tuple[Any, ...], kwargs: Any
) -> str:
    """The call the user meant: extra positional arguments named as keywords."""
    fun_name = getattr(fun, "__name__", "fun")
    parts = [fun_name if fun_name.isidentifier() else "fun"]  # "fun" for a lambda
    parts += [f"{n}={v!r}" for n, v in zip(names, extra)]
    parts += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{api}({', '.join(parts)})"


def _public_signature(builder: Callable[..., Any]) -> inspect.Signature:
    """The implementation's signature (whose annotations are loose: `wrap` checks
    the values) with its overloads' annotations, those of `**options: Unpack[...]`
    included: `fun` required, `remainder` a `Literal`, no `sentinel`."""
    hints: dict[str, Any] = {}
    for overload in typing.get_overloads(builder):
        for p in inspect.signature(overload).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                hints.update(typing.get_args(p.annotation)[0].__annotations__)
            else:
                hints[p.name] = p.annotation
    signature = inspect.signature(builder)
    parameters = [
        p.replace(
            annotation=hints.get(p.name, p.annotation),
            default=p.empty if p.name == "fun" else p.default,
        )
        for p in signature.parameters.values()
    ]
    # The return type as a string: shown as written, not as `collections.abc.Callable`.
    return signature.replace(
        parameters=parameters, return_annotation="Callable[..., Any]"
    )


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
        _builder.__doc__ = (_builder.__doc__ or "").replace("{meters}", _METERS)
        _builder.__signature__ = _public_signature(builder)  # pyright: ignore[reportAttributeAccessIssue]
        return _builder  # pyright: ignore[reportReturnType]

    return _decorate
