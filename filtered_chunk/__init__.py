import importlib.metadata

from ._apply import filter_chunked_apply as filter_chunked_apply
from ._budget import (
    ChunkSizeChoice as ChunkSizeChoice,
    MemoryBudget as MemoryBudget,
)
from ._chunked_vmap import filter_chunked_vmap as filter_chunked_vmap
from ._jacobian import (
    chunked_jacfwd as chunked_jacfwd,
    chunked_jacrev as chunked_jacrev,
    filter_chunked_jacfwd as filter_chunked_jacfwd,
    filter_chunked_jacrev as filter_chunked_jacrev,
)
from ._progress import (
    AbstractProgressMeter as AbstractProgressMeter,
    NoProgressMeter as NoProgressMeter,
    TextProgressMeter as TextProgressMeter,
    TqdmProgressMeter as TqdmProgressMeter,
)
from ._suggest import (
    suggest_chunk_size as suggest_chunk_size,
    suggest_chunk_sizes as suggest_chunk_sizes,
)


__version__ = importlib.metadata.version("filtered_chunk")
