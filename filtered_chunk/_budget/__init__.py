"""Memory budgets (`_values.py`) turned into a chunk size (`_choose.py`): the same in
every process (`_hosts.py`), stored on disk (`_store.py`), else searched
(`_search.py`) by compiling the call as the transformations around it run it
(`_program.py`), its bytes counted as far as a comparison needs (`_counts.py`),
then chosen by the speed model (`_model.py`) or by timing (`_timing.py`), and for
a staged call the boundaries it keeps (`_keep.py`); `_free_memory.py` reads the
free memory; `_marks.py` marks each call's choice in its program.
`suggest_chunk_size` and `suggest_chunk_sizes` live beside the transforms
(`_suggest.py`).
"""

from ._choose import Budgeted as Budgeted, choose_chunk_size as choose_chunk_size
from ._counts import (
    measure_bytes as measure_bytes,
    program_at as program_at,
)
from ._keep import refined as refined, Staged as Staged
from ._marks import mark as mark, marked_in as marked_in
from ._program import Lowered as Lowered
from ._values import (
    ChunkSizeChoice as ChunkSizeChoice,
    ChunkSizeSpec as ChunkSizeSpec,
    MemoryBudget as MemoryBudget,
    normalise_chunk_size as normalise_chunk_size,
)
