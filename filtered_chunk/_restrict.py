"""What a chunked transform offers besides its call: [`Restrictable.valid`][],
a call on the valid elements of a padded batch (`_valid.py`)."""

import dataclasses
from typing import Any, TYPE_CHECKING

import equinox as eqx
import numpy as np


if TYPE_CHECKING:
    from ._wrapper import Chunked


class Restrictable:
    """A base of [`Chunked`][]: a plain class, so that its methods stay
    functions that the API reference can read."""

    def valid(
        self,
        count: Any = None,
        *,
        mask: Any = None,
        fill: bool | int | float | complex | np.generic = 0,
    ) -> "Chunked":
        """This transform on the valid elements of the batch only: the first
        `count` along the mapped axes, or those where `mask` is `True`. Both may
        be traced: every count and every mask of the same shapes runs one
        compiled program (see [variable-size batches][variable-size-batches]).

        **Arguments:**

        - `count`: an integer scalar (a Python `int` or a JAX or NumPy one,
            traced or not): the elements before it are valid. It is clipped to
            `[0, batch size]`.
        - `mask`: keyword-only. A boolean vector of the batch's size: the
            elements where it is `True` are valid, anywhere in the batch.
        - `fill`: keyword-only. What the mapped outputs hold at the invalid
            elements, in each output's dtype. Defaults to `0`.

        Give exactly one of `count` and `mask`.

        **Returns:**

        A function with the signature of `fun`. `fun` is never evaluated on an
        invalid element, so whatever the padding holds (NaN, infinities) reaches
        no value and no derivative: derivatives with respect to invalid elements
        are zero. An output marked `out_axes=None` is checked, or with
        `sum_match=True` summed, over the valid elements only. A chunk holding
        no valid element is skipped, on each device of a sharded batch too.

        `filter_chunked_vmap`'s and `filter_chunked_apply`'s transforms have
        it, not with `axis_name`, and so does a method they decorate, bound to
        its instance (`model.method.valid(n)(x)`). For `filter_chunked_apply`,
        `fun` is called on chunks in which each invalid element is a copy of a
        valid one.
        What it costs: see [variable-size batches][variable-size-batches].

        !!! example

            ```python
            import jax
            import jax.numpy as jnp
            import filtered_chunk as fc

            square = fc.filter_chunked_vmap(lambda x: x**2, chunk_size=4)
            padded = jnp.array([1.0, 2.0, 3.0, jnp.nan, jnp.nan, jnp.nan])
            # One compilation for every count.
            out = jax.jit(lambda x, n: square.valid(n)(x))(padded, 3)
            assert jnp.array_equal(out, jnp.array([1.0, 4.0, 9.0, 0.0, 0.0, 0.0]))
            ```
        """
        from ._valid import check_valid, ValidPlan
        from ._wrapper import Chunked

        assert isinstance(self, Chunked)

        api = f"{self._options.api}(...).valid"
        if not self._plan.restrictable:
            what = "a call already restricted by `valid`"
            if not isinstance(self._plan, ValidPlan):
                what = f"`{self._options.api}`"
            raise TypeError(
                "`valid` is only available on `filter_chunked_vmap` and "
                f"`filter_chunked_apply`, not on {what}."
            )
        count, mask, fill = check_valid(count, mask, fill, api)
        return dataclasses.replace(self, _plan=ValidPlan(self._plan, count, mask, fill))


class BoundMethod(eqx.Partial):
    """A chunked transform bound to an instance, as `model.method` gives it where
    the transform decorates `method`: `eqx.Partial(chunked, model)`, with `valid`."""

    def __init__(self, func: "Chunked", instance: Any, /):
        self.func = func
        self.args = (instance,)
        self.keywords = {}

    def valid(
        self,
        count: Any = None,
        *,
        mask: Any = None,
        fill: bool | int | float | complex | np.generic = 0,
    ) -> "BoundMethod":
        """[`Chunked.valid`][], the instance still bound."""
        chunked: Any = self.func
        return BoundMethod(chunked.valid(count, mask=mask, fill=fill), *self.args)
