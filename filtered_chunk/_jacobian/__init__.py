"""Chunked Jacobians: `jax.jacrev`/`jax.jacfwd` (`_jax.py`) and Equinox's filtered
forms (`_filter.py`), each a plan of the one call path (`_plans.py`) whose chunk
function pushes or pulls a chunk of basis vectors (`_basis.py`)."""

from ._filter import (
    filter_chunked_jacfwd as filter_chunked_jacfwd,
    filter_chunked_jacrev as filter_chunked_jacrev,
)
from ._jax import chunked_jacfwd as chunked_jacfwd, chunked_jacrev as chunked_jacrev
