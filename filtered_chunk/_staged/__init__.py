"""Collectives over `axis_name`, exact across chunks: staged evaluation.

How it works is in this folder's `README.md`. The rest of the package uses
[`collective_mode`][] (`_analysis.py`: what the collectives of a call make of
it: none, one `vmap` or staged passes), and [`plan_staged_vmap`][],
[`run_staged_vmap`][] and [`output_shapes`][] (`_vmap.py`: `filter_chunked_vmap`'s
call, planned once and run in passes of the one loop, on one device or on each
device's shard).
"""

from ._analysis import (
    collective_mode as collective_mode,
    NONE as NONE,
    STAGED as STAGED,
    WHOLE as WHOLE,
)
from ._vmap import (
    output_shapes as output_shapes,
    plan_staged_vmap as plan_staged_vmap,
    run_staged_vmap as run_staged_vmap,
    StagedVmap as StagedVmap,
)
