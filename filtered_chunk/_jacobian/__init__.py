"""Chunked Jacobians: JAX's and Equinox's builders (`_builders.py`), each a plan of
the one call path whose chunk pushes or pulls basis vectors (`_plans.py`)."""

from ._builders import (
    chunked_jacfwd as chunked_jacfwd,
    chunked_jacrev as chunked_jacrev,
    filter_chunked_jacfwd as filter_chunked_jacfwd,
    filter_chunked_jacrev as filter_chunked_jacrev,
)
