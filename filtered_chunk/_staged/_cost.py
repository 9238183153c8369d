"""Staged collectives: what a plan costs, as a memory budget reports it.

[`plan_cost`][] estimates, from the plan's equations (`_plan.py`), the work of
its loops as a multiple of evaluating the program once for each element, and
the bytes an element of the values its passes keep. The work of an equation is
its floating-point operations where they dominate (`dot_general`, a
convolution: two per multiply-add) and its output's elements otherwise; an
equation holding a jaxpr (a `lax.scan`, `lax.cond`, a custom-derivative
function) costs its body's, a `lax.scan` that many times over, a `lax.while_loop`
once. An estimate: it counts no memory traffic.
"""

import math
from typing import Any

from .._jaxprs import subjaxprs
from ._plan import FINAL, Plan, SHIFT
from ._shifts import SAMPLE


def _elements(v: Any) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


def _equation(eqn: Any) -> float:
    """The work of one equation (see the module's docstring)."""
    name = eqn.primitive.name
    out = sum(_elements(v) for v in eqn.outvars)
    if name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]  # of the lhs, rhs
        lhs = eqn.invars[0].aval.shape
        return 2.0 * out * math.prod(lhs[d] for d in contracting)
    if name in ("conv_general_dilated", "chunked_conv_general_dilated"):
        spec = getattr(eqn.params["dimension_numbers"], "rhs_spec", None)
        rhs = eqn.invars[1].aval.shape
        # A kernel's input features and window: its shape but the output features.
        inner = rhs[1:] if spec is None else [rhs[d] for d in spec[1:]]
        return 2.0 * out * math.prod(inner)
    inside = sum(_jaxpr(j) for value in eqn.params.values() for j in subjaxprs(value))
    if inside:
        return inside * eqn.params.get("length", 1) if name == "scan" else inside
    return float(max(out, 1))


def _jaxpr(jaxpr: Any) -> float:
    return sum(_equation(eqn) for eqn in jaxpr.eqns)


def plan_cost(plan: Plan, chunk_size: int) -> tuple[int, float]:
    """The bytes an element of the values that `plan`'s passes keep, and the
    estimated work of its loops at `chunk_size` against evaluating the program
    once for each element of the batch.

    The collectives that take a pass count in neither (their results are
    given to the stages that read them). With every pass's boundaries kept the
    work is about `1.0`: only what depends on the collectives' results alone
    (not kept: it does not vary over the batch) is computed again where read.
    A variance's shift is evaluated on a sample (`_shifts.py`: at most `SAMPLE`
    elements, nor more than a chunk), which counts as that fraction of the batch.
    """
    eqns = plan.program.jaxpr.eqns
    cost = lambda order: sum(  # noqa: E731
        _equation(eqns[i]) for i in order if i not in plan.levels
    )
    once = cost(range(len(eqns)))
    batch_size = plan.program.batch_size
    sample = min(SAMPLE, chunk_size, batch_size) / max(batch_size, 1)
    work = 0.0
    for stage, order in plan.equations.items():
        weight = sample if isinstance(stage, tuple) and stage[0] == SHIFT else 1.0
        work += weight * cost(order)
    kept = sum(
        _elements(v) * v.aval.dtype.itemsize
        for stage in (*range(1, plan.num_passes + 1), FINAL)
        for v in plan.writes.get(stage, [])
    )
    return kept, (work / once if once else 1.0)
