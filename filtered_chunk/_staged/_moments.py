"""Staged collectives: a variance about a mean over the batch in the mean's pass.

BatchNorm (`eqx.nn.BatchNorm`, and the same written by hand) computes a mean over
the batch, then the mean of the squared deviations from it:

    m = lax.pmean(jnp.mean(y, J), axis_name)
    v = lax.pmean(jnp.mean((y - m) * jnp.conj(y - m), J), axis_name)

As written, the variance's collective depends on the mean's, so it takes a pass of
its own (`_plan.py`), and each pass recomputes what it needs of `fun`. But for any
`K` of the mean's shape and any `m`, summing over the batch's `N` elements and the
`|J|` reduced positions of each, with `u` the mean of `y - K`,

    sum(pair(y - m)) = [sum(pair(y - K)) - N |J| pair(u)] + N |J| pair(m - K - u)

(`pair(a) = a a'`, `'` the same conjugation or none): the cross terms of the
bracket vanish because `u` is the mean of `y - K`. So the pass that sums the
mean's operand can sum it about a shift `K` known before it (the mean is then
`N K` plus that sum), and the variance's operand about `K` too: one pass where
there were two, exact in real arithmetic and in every derivative (the identity
holds for every `y` and `m`, and `K` is a constant). In floating point the
bracket is the "shifted data" algorithm, with `u` summed from terms as small as
the spread: its rounding grows with `1 + |u|^2 / variance`; the last term is
the rounding of `m` squared, as the written form has it (`Moment.correct`). `K`
is the mean of a sample of the batch (`_shifts.py`: 256 elements, or a chunk, at
an even stride), so `|u|^2` is about the variance over the sample's size for a
batch of any order, and at worst `N / size` times the variance (the sample's
own deviations bound it). Where each pair is a square, a bracket that rounding
made negative is zero, as the written form is never negative
(`tests/test_collectives_moments.py` checks data far from zero, where the
textbook one-pass formula loses every digit, constant and sorted batches).

[`find_moments`][] recognises the pattern in the staged program's jaxpr,
equation by equation, seeing through a conversion that only drops a weak type
(JAX's, where a weakly typed `y` meets the strong result of a `psum`); anything
else (another reduction, a cast to another dtype between, a sum over other
axes) is left to its own pass, as before.
"""

import dataclasses
import math
from collections.abc import Hashable
from typing import Any

import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._structs import inexact
from ._analysis import axis_names
from ._program import bind


@dataclasses.dataclass(frozen=True)
class Moment:
    """A variance's `psum` (equation `variance`) whose operand is a mean over the
    axes `J` of `pair(y - m)`, where `m` is the result of the equation `mean_of`
    (`psum(mean(y, J)) / N`, the `psum` being equation `mean`)."""

    mean: int  # the mean's `psum`
    variance: int  # the variance's `psum`
    m: Any  # the mean over the batch (a variable of the jaxpr)
    # The equations that compute it from the mean's `psum`, in order: one `div`,
    # or, for a complex mean from JAX 0.12.1, `real`, `imag`, a `div` of each and
    # `complex`.
    m_eqns: tuple[int, ...]
    conj: tuple[bool, bool]  # which factor of the pair is conjugated
    # The variance's operand is `coef` times the mean over `J` of the pairs, so
    # its sum over the batch's `N` elements is corrected by `coef * N` pairs.
    coef: float

    def mean_from(self, eqns: list[Any], total: Array) -> Array:
        """`m` from the mean's `psum` result `total`, as the jaxpr computes it."""
        env = {eqns[self.mean].outvars[0]: total}
        for j in self.m_eqns:
            eqn = eqns[j]
            invals = [
                v.val if isinstance(v, jex.Literal) else env[v] for v in eqn.invars
            ]
            env.update(zip(eqn.outvars, bind(eqn, invals)))
        return env[self.m]

    def _pair(self, x: Array) -> Array:
        first, second = (jnp.conj(x) if c else x for c in self.conj)
        return first * second

    def correct(
        self, summed: Array, offset: Array, m: Array, shift: Array, batch_size: int
    ) -> Array:
        """The variance's `psum` from its operand's sum about `shift` (`summed`)
        and the sum over the batch of the mean's operand less `shift` (`offset`).

        With `u = offset / N` (the batch's mean about the shift, from terms as
        small as the spread) and `d = m - shift`, exactly for every `m`,

            sum(pair(y - m)) = [sum(pair(y - K)) - N |J| pair(u)]
                               + N |J| pair(d - u):

        the bracket is the spread about the batch's mean, the last term the
        rounding of `m` squared, as the written form has it. Correcting by
        `N |J| pair(d)` alone (the identity where `m` is exact) made the error
        first order in `m`'s rounding, and could make a variance negative.
        """
        scale = self.coef * batch_size
        u = offset / batch_size
        spread = summed - scale * self._pair(u)
        if self.squares:  # a sum of squares (its sign `coef`'s) is never negative
            wrong = spread.real < 0 if self.coef > 0 else spread.real > 0
            spread = jnp.where(wrong, jnp.zeros_like(spread), spread)
        return spread + scale * self._pair(m - shift - u)

    @property
    def squares(self) -> bool:
        """Whether each pair is a square: real, or a value times its conjugate."""
        complex_ = jnp.issubdtype(self.m.aval.dtype, jnp.complexfloating)
        return self.conj[0] != self.conj[1] or not complex_


def _is_literal(v: Any, value: int) -> bool:
    if not isinstance(v, jex.Literal) or np.shape(v.val) != ():
        return False
    return bool(np.asarray(v.val) == value)


def _single_psum(eqn: Any, axis_name: Hashable) -> bool:
    return (
        eqn is not None
        and eqn.primitive.name == "psum"
        and len(eqn.invars) == 1
        and axis_names(eqn.params) == (axis_name,)
        and eqn.params.get("axis_index_groups") is None
    )


class _Matcher:
    def __init__(self, jaxpr: Any, axis_name: Hashable, batch_size: int):
        self.eqns = jaxpr.eqns
        self.axis_name = axis_name
        self.batch_size = batch_size
        self.made_by: dict[Any, int] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.outvars:
                if not isinstance(v, jex.DropVar):
                    self.made_by[v] = i

    def producer(self, v: Any, name: str) -> Any:
        """The equation of primitive `name` that makes `v`, or `None`."""
        if isinstance(v, jex.Literal) or v not in self.made_by:
            return None
        eqn = self.eqns[self.made_by[v]]
        return eqn if eqn.primitive.name == name else None

    def source(self, v: Any) -> Any:
        """`v`, or what it converts to its own dtype (a weak type dropped, as JAX
        does where a weakly typed value meets the strong result of a `psum`):
        the same values."""
        while (eqn := self.producer(v, "convert_element_type")) is not None:
            (x,) = eqn.invars
            if isinstance(x, jex.Literal) or x.aval.dtype != v.aval.dtype:
                break
            v = x
        return v

    def mean_over(self, v: Any) -> tuple[Any, tuple[int, ...], float] | None:
        """`v` as `reduce_sum(x, J) / s`, the sum or the division left out where
        the jaxpr has none (`J = ()`, `s = 1`): `(x, J, s)`."""
        divided = self.producer(v, "div")
        scale = 1.0
        if divided is not None:
            lit = divided.invars[1]
            if not isinstance(lit, jex.Literal) or np.shape(lit.val) != ():
                return None
            value = complex(np.asarray(lit.val))
            if value.imag != 0 or value.real == 0:
                return None
            scale, v = value.real, divided.invars[0]
        summed = self.producer(v, "reduce_sum")
        if summed is None:
            return v, (), scale
        return summed.invars[0], tuple(sorted(summed.params["axes"])), scale

    def deviation(self, v: Any, axes: tuple[int, ...]) -> tuple[Any, Any] | None:
        """`v` as `y - m`, `m` broadcast along `axes` of `y`: `(y, m)`."""
        sub = self.producer(v, "sub")
        if sub is None or any(isinstance(x, jex.Literal) for x in sub.invars):
            return None
        y, m = sub.invars
        shape = y.aval.shape
        kept = [d for d in range(len(shape)) if d not in axes]
        broadcast = self.producer(m, "broadcast_in_dim")
        if broadcast is not None:
            m = broadcast.invars[0]
            out = broadcast.outvars[0].aval.shape
            if tuple(broadcast.params["broadcast_dimensions"]) != tuple(kept):
                return None
            if any(out[d] not in (1, shape[d]) for d in axes) or len(out) != len(shape):
                return None
        if isinstance(m, jex.Literal) or m.aval.shape != tuple(shape[d] for d in kept):
            return None
        return y, m

    def factor(self, v: Any, axes: tuple[int, ...]) -> tuple[Any, Any, bool] | None:
        conj = self.producer(v, "conj")
        found = self.deviation(conj.invars[0] if conj else v, axes)
        return None if found is None else (*found, conj is not None)

    def pair(self, v: Any, axes: tuple[int, ...]) -> tuple[Any, Any, tuple] | None:
        """`v` as `pair(y - m)`: `(y, m, conj)`."""
        eqn = self.eqns[self.made_by[v]] if v in self.made_by else None
        if eqn is None:
            return None
        name = eqn.primitive.name
        if name == "square" or (name == "integer_pow" and eqn.params["y"] == 2):
            found = self.deviation(eqn.invars[0], axes)
            return None if found is None else (*found, (False, False))
        if name != "mul":
            return None
        factors = [self.factor(x, axes) for x in eqn.invars]
        if None in factors:
            return None
        (y1, m1, c1), (y2, m2, c2) = factors  # pyright: ignore[reportGeneralTypeIssues]
        if self.source(y1) is not self.source(y2) or m1 is not m2:
            return None
        return y1, m1, (c1, c2)

    def divided(self, v: Any) -> Any:
        """The equation that makes `v` as `x / N` (`N` the batch's size), or `None`."""
        eqn = self.producer(v, "div")
        if eqn is None or not _is_literal(eqn.invars[1], self.batch_size):
            return None
        return eqn

    def batch_mean(self, m: Any) -> tuple[Any, tuple[int, ...]] | None:
        """`m` as `psum(x) / N`: the `psum`'s equation and the indices of those
        that divide its result, in order. A complex mean is divided as it is or,
        as JAX traces it from 0.12.1, part by part:
        `complex(real(p) / N, imag(p) / N)`."""
        if (eqn := self.divided(m)) is not None:
            psum, chain = self.producer(eqn.invars[0], "psum"), [eqn]
        elif (parts := self.producer(m, "complex")) is not None:
            chain = [self.divided(v) for v in parts.invars]
            if None in chain:
                return None
            names = ("real", "imag")
            taken = [self.producer(e.invars[0], n) for e, n in zip(chain, names)]
            if None in taken or taken[0].invars[0] is not taken[1].invars[0]:
                return None
            psum = self.producer(taken[0].invars[0], "psum")
            chain = [*taken, *chain, parts]
        else:
            return None
        if not _single_psum(psum, self.axis_name):
            return None
        order = tuple(sorted(self.made_by[e.outvars[0]] for e in chain))
        return psum, order

    def match(self, i: int) -> Moment | None:
        """Equation `i` as a variance's `psum` about a mean over the batch."""
        eqn = self.eqns[i]
        if not _single_psum(eqn, self.axis_name):
            return None
        (operand,) = eqn.invars
        if isinstance(operand, jex.Literal) or not inexact(operand.aval):
            return None
        outer = self.mean_over(operand)
        if outer is None:
            return None
        pairs, axes, scale = outer
        found = self.pair(pairs, axes)
        if found is None:
            return None
        y, m, conj = found
        # `m`: the batch's mean of `mean(y, J)`, as `lax.pmean` computes it.
        scaled = self.batch_mean(m)
        if scaled is None:
            return None
        mean, m_eqns = scaled
        inner = self.mean_over(mean.invars[0])
        size = math.prod(y.aval.shape[d] for d in axes)
        if inner is None or inner[1:] != (axes, size):
            return None
        if self.source(inner[0]) is not self.source(y):
            return None
        if len({y.aval.dtype, m.aval.dtype, operand.aval.dtype}) != 1:
            return None
        return Moment(self.made_by[mean.outvars[0]], i, m, m_eqns, conj, size / scale)


def find_moments(jaxpr: Any, axis_name: Hashable, batch_size: int) -> dict[int, Moment]:
    """Each variance's `psum` equation in `jaxpr` that can be computed in its mean's
    pass (see the module docstring), by its index."""
    if batch_size == 0:
        return {}
    matcher = _Matcher(jaxpr, axis_name, batch_size)
    found = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name == "psum":
            moment = matcher.match(i)
            if moment is not None:
                found[i] = moment
    return found
