"""Memory budgets (`_values.py`) turned into a chunk size (`_search.py`) by compiling
the call as the transformations around it run it (`_program.py`), then choosing by
the speed model (`_model.py`) or by timing (`_timing.py`); `_free_memory.py` reads
the free memory; `_marks.py` marks each call's choice in its program.
`suggest_chunk_size` and `suggest_chunk_sizes` live beside the transforms
(`_suggest.py`).
"""

from ._marks import mark as mark, marked_in as marked_in
from ._search import (
    choose_chunk_size as choose_chunk_size,
    keep_if_fits as keep_if_fits,
    measure_bytes as measure_bytes,
)
from ._values import (
    ChunkSizeChoice as ChunkSizeChoice,
    ChunkSizeSpec as ChunkSizeSpec,
    MemoryBudget as MemoryBudget,
    normalise_chunk_size as normalise_chunk_size,
)
