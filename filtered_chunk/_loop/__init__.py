"""The one loop over chunks, which every chunked transform runs.

[`run_in_chunks`][] evaluates a *chunk function* over a batch, `chunk_size`
elements at a time, in one `lax.scan`: each output is written into its
full-batch buffer, or folded into an accumulator of its own size (a sum, a
running maximum or minimum: `_accumulate.py`). Its parts:

- `_run.py`: the loop itself, the remainder (an overlapping last chunk, or a
  separate one) and the chunk function's closure conversion;
- `_schedule.py`: which rows each step computes: in Python numbers
  ([`Steps`][], which the progress reports and the budget search read too) and
  as the loop's arrays ([`Schedule`][]);
- `_scan.py`: the loop as evaluated, one `lax.scan`;
- `_rule.py`: the loop's JVP rule, which keeps reverse mode linear in the batch
  and checkpoints each step only when differentiated, with `_tangents.py`: the
  output tangents that its scan does not give;
- `_weak_types.py`: cotangents that keep the weak types the chunk function's
  transpose gives them;
- `_accumulate.py`: accumulated outputs, their overlap and derivatives.
"""

from ._run import (
    Chain as Chain,
    reduced as reduced,
    run_in_chunks as run_in_chunks,
)
from ._schedule import Steps as Steps
