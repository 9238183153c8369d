"""Progress meters: what a chunked call reports to, on the host, while it runs. How
the loop calls them, under `jit`, `grad`, `vmap`, sharding and nesting, is in
`_reporting.py`."""

import abc
import time
from typing import Any, ClassVar

import equinox as eqx


class AbstractProgressMeter(eqx.Module):
    """The base class of progress meters: subclass it to report the progress of
    chunked calls anywhere (a log, an experiment tracker, a GUI).

    A meter is an `equinox.Module` whose three methods run on the host, called
    from the compiled program while it runs: `open` when a call's first chunk is
    done, `update` after every chunk (or every few, so that a call makes at most
    `max_updates` updates), `close` after the last one. They run per execution of
    the loop, not per trace: under `jax.jit`, each call of the compiled function
    gets its own `open`/`close` pair. The counts are elements of the batch (rows or
    columns for the Jacobians), never more than `total`, and never decreasing.

    Keep the fields hashable (numbers, strings, `eqx.field(static=True)` objects):
    a meter is part of the compiled program's identity, so that calling a chunked
    transform outside `jax.jit` reuses the compiled program.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtered_chunk as fc

        class PrintPercent(fc.AbstractProgressMeter):
            def open(self, label, total):
                return {"label": label, "total": total}

            def update(self, state, done):
                print(f"{state['label']}: {100 * done // state['total']}%")

            def close(self, state):
                print(f"{state['label']}: done")

        f = fc.filter_chunked_vmap(jnp.sin, chunk_size=4, progress_meter=PrintPercent())
        f(jnp.arange(10.0))  # prints 40%, 80%, 100%, done
        ```
    """

    max_updates: ClassVar[int] = 100
    """The most `update`s per call (class attribute, default 100): a call of more
    chunks reports every few chunks, as each report stops the compiled program
    for a call to Python. Override it in a subclass to report more often."""

    @abc.abstractmethod
    def open(self, label: str, total: int) -> Any:
        """Called when a call's first chunk is done, with the meter's label (or
        the transform's name) and the batch size; returns this call's state,
        which is passed to `update` and `close`."""

    @abc.abstractmethod
    def update(self, state: Any, done: int) -> None:
        """Called after each chunk with the number of elements done so far."""

    @abc.abstractmethod
    def close(self, state: Any) -> None:
        """Called once per call: after the last chunk (just after its `update`
        reported `done == total`), or, if the call failed, when its failure
        reaches Python (outside `jax.jit`) or when the next execution starts."""


class NoProgressMeter(AbstractProgressMeter):
    """Reports nothing (the default). The compiled program is exactly the one
    built without a meter: no callback, no cost.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtered_chunk as fc

        meter = fc.NoProgressMeter()
        f = fc.filter_chunked_vmap(jnp.sin, chunk_size=4, progress_meter=meter)
        assert jnp.allclose(f(jnp.arange(10.0)), jnp.sin(jnp.arange(10.0)))
        ```
    """

    def open(self, label: str, total: int) -> None:
        del label, total

    def update(self, state: Any, done: int) -> None:
        del state, done

    def close(self, state: Any) -> None:
        del state


class _TextState:
    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.printed = label, total, 0, 0
        self.start = time.perf_counter()


class TextProgressMeter(AbstractProgressMeter):
    """Prints a few plain lines per call to standard output: for logs and CI,
    where a redrawn bar would leave control characters.

    One line when the first chunk is done, then one each time the elements done
    grow by at least `minimum_increase` of the batch, and one when the call is
    done, with its duration.

    **Arguments:**

    - `label`: the name printed on each line; `None` (the default) prints the
        transform's name, such as `filter_chunked_vmap`.
    - `minimum_increase`: the fraction of the batch between two lines. Defaults
        to `0.25`.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtered_chunk as fc

        meter = fc.TextProgressMeter(label="sines")
        f = fc.filter_chunked_vmap(jnp.sin, chunk_size=100, progress_meter=meter)
        f(jnp.zeros(1000))
        # sines: 100/1000 (10%)
        # sines: 400/1000 (40%)
        # sines: 700/1000 (70%)
        # sines: 1000/1000 (100%) done in 0.00 s
        ```
    """

    label: str | None = None
    minimum_increase: float = 0.25

    def open(self, label: str, total: int) -> _TextState:
        return _TextState(label, total)

    def update(self, state: _TextState, done: int) -> None:
        state.done = done
        step = max(1, int(self.minimum_increase * state.total))
        if done == state.total or (state.printed and done - state.printed < step):
            return  # the last line is printed by `close`
        state.printed = done
        print(f"{state.label}: {_fraction(done, state.total)}", flush=True)

    def close(self, state: _TextState) -> None:
        seconds = time.perf_counter() - state.start
        end = "done" if state.done == state.total else "stopped"
        line = f"{_fraction(state.done, state.total)} {end} in {seconds:.2f} s"
        print(f"{state.label}: {line}", flush=True)


def _fraction(done: int, total: int) -> str:
    return f"{done}/{total} ({100 * done // max(total, 1)}%)"


def _import_tqdm() -> Any:
    try:
        import tqdm.auto
    except ImportError as e:
        raise ImportError(
            "`filtered_chunk.TqdmProgressMeter` needs the `tqdm` package, which is "
            "not installed. Install it with `pip install tqdm` (or, from a clone of "
            'filtered_chunk, `pip install ".[progress]"`), or use '
            "`filtered_chunk.TextProgressMeter`."
        ) from e
    return tqdm.auto


class TqdmProgressMeter(AbstractProgressMeter):
    """Shows a [tqdm](https://tqdm.github.io) bar per call, counting elements of
    the batch. Needs `tqdm`: `pip install tqdm`, or `pip install ".[progress]"`
    from a clone of filtered_chunk.

    **Arguments:**

    - `label`: the bar's description; `None` (the default) shows the transform's
        name, such as `filter_chunked_vmap`.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtered_chunk as fc

        meter = fc.TqdmProgressMeter(label="sines")
        f = fc.filter_chunked_vmap(jnp.sin, chunk_size=100, progress_meter=meter)
        f(jnp.zeros(1000))
        # sines: 100%|██████████| 1000/1000 [00:00<00:00, 5077849.88 elements/s]
        ```
    """

    label: str | None = None

    def __check_init__(self) -> None:
        _import_tqdm()  # fail when the transform is built, not in a callback

    def open(self, label: str, total: int) -> Any:
        return _import_tqdm().tqdm(total=total, desc=label, unit=" elements")

    def update(self, state: Any, done: int) -> None:
        state.update(done - state.n)

    def close(self, state: Any) -> None:
        state.close()


def is_reporting(meter: AbstractProgressMeter | None) -> bool:
    return meter is not None and not isinstance(meter, NoProgressMeter)


def check_meter(meter: Any, api: str) -> None:
    if meter is not None and not isinstance(meter, AbstractProgressMeter):
        raise TypeError(
            f"`{api}(..., progress_meter=...)` must be a "
            "`filtered_chunk.AbstractProgressMeter` (such as "
            "`filtered_chunk.TqdmProgressMeter()`) or `None`, got "
            f"{type(meter).__name__} object {meter!r}."
        )
