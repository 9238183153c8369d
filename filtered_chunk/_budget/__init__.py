"""Memory budgets: a `chunk_size` given as bytes (`"auto"`, `MemoryBudget`) turned
into a chunk size, by compiling the call at a few sizes.

The rest of the package uses what is re-exported here: the budget values and what a
search reports (`MemoryBudget`, `ChunkSizeChoice`, `ChunkSizeSpec`,
`normalise_chunk_size`, from `_values.py`) and the search (`choose_chunk_size`,
`_search.py`). Behind them:

- `_program.py`: the program a budget measures, the chunked call as the
  transformations around it (`grad`, `jvp`, `vmap`) will run it;
- `_model.py`: the speed model, which may cap the chunk size on CPU to stay in cache;
- `_timing.py`: timing the sizes that fit, for `MemoryBudget(..., tune=True)`;
- `_free_memory.py`: how much memory the device has free, for `"auto"` and
  fractional budgets.

`suggest_chunk_size` is a front end over a built transform, so it lives beside the
transforms, in `filtered_chunk/_suggest.py`.
"""

from ._search import choose_chunk_size as choose_chunk_size
from ._values import (
    ChunkSizeChoice as ChunkSizeChoice,
    ChunkSizeSpec as ChunkSizeSpec,
    MemoryBudget as MemoryBudget,
    normalise_chunk_size as normalise_chunk_size,
)
