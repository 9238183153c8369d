import importlib.metadata

from ._chunked_vmap import filter_chunked_vmap as filter_chunked_vmap


__version__ = importlib.metadata.version("filtered_chunk")
