"""Each budgeted call's choice, marked in the program that runs it.

A budgeted call chooses its chunk size while it is traced, under the
transformations around it (`_program.py`), and runs its loops inside a
`jax.named_scope` that names the choice (`mark`). `suggest_chunk_sizes` traces
the user's own function and reads the marks back from the equations of its
jaxpr (`marked_in`), nested jaxprs included. A `jax.jit` that reuses a cached
trace does not call the chunked transform again, but its cached jaxpr holds the
same marks, so the report is the one of the program that runs either way.
"""

import re
from typing import Any

from .._jaxprs import subjaxprs
from ._values import ChunkSizeChoice


_PREFIX = "filtered_chunk_choice_"
_PATTERN = re.compile(_PREFIX + r"(\d+)")
# Every distinct choice made in this process, numbered once: as many as the
# distinct programs and budgets chosen for, which `_search.py` caches anyway.
_numbers: dict[ChunkSizeChoice, int] = {}
_choices: list[ChunkSizeChoice] = []


def mark(choice: ChunkSizeChoice) -> str:
    """The name of the scope that a call made with `choice` runs in."""
    number = _numbers.get(choice)
    if number is None:
        number = _numbers[choice] = len(_choices)
        _choices.append(choice)
    return f"{_PREFIX}{number}"


def marked_in(jaxpr: Any) -> list[ChunkSizeChoice]:
    """The choices whose marks the equations of `jaxpr` (a `jax.extend.core.Jaxpr`)
    carry, in the order they first appear, each once."""
    found: dict[int, None] = {}
    _collect(jaxpr, found, set())
    return [_choices[n] for n in found]


def _collect(jaxpr: Any, found: dict[int, None], seen: set[int]) -> None:
    if id(jaxpr) in seen:  # a jaxpr shared by several equations
        return
    seen.add(id(jaxpr))
    for eqn in jaxpr.eqns:
        for number in _PATTERN.findall(str(eqn.source_info.name_stack)):
            found.setdefault(int(number))
        for value in eqn.params.values():
            for sub in subjaxprs(value):
                _collect(sub, found, seen)
