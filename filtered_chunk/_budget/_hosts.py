"""One choice on every host. Under `jax.distributed` each process would read its own
free memory and its own store, and could choose another chunk size than the
others, so compile another program for one SPMD step. So the processes agree
first, through `jax.distributed`'s key-value store: each posts the budget it
resolves, all take the smallest, process 0 chooses and posts its choice (or its
refusal), and the others take it. Budgeted calls are numbered in the order each
process makes them: every process must make the same calls in the same order, as
an SPMD program does, and each posts what the call is, so that processes that
diverge get an error rather than each other's choice.
"""

import itertools
import json
from collections.abc import Callable

import jax

from .._jax_compat import distributed_client
from . import _store
from ._values import ChunkSizeChoice


# How long a process waits for the others to reach the same budgeted call.
TIMEOUT_SECONDS = 600
_calls = itertools.count()


def several() -> bool:
    """Whether more than one process shares the program (`jax.distributed`)."""
    return jax.process_count() > 1


def _get(key: str, what: str) -> str:
    client = distributed_client()
    try:
        return client.blocking_key_value_get(key, TIMEOUT_SECONDS * 1000)
    except Exception as e:  # the runtime's own error type (a deadline, a shutdown)
        raise RuntimeError(
            f"Process {jax.process_index()} of {jax.process_count()} waited for "
            f"{what} at a memory budget's choice and gave up ({e}). Under "
            "`jax.distributed` every process must make the same budgeted calls in "
            "the same order; or give a fixed `chunk_size`."
        ) from None


def choose_everywhere(
    limit: int, call: str, choose: Callable[[int], ChunkSizeChoice]
) -> ChunkSizeChoice:
    """`choose(limit)` where one process runs; under `jax.distributed`, process 0's
    `choose` at the smallest `limit` of all processes, taken by all. `call` says
    what the call is (its shapes and budget), the same in every process."""
    if not several():
        return choose(limit)
    client = distributed_client()
    me, count = jax.process_index(), jax.process_count()
    prefix = f"filtered_chunk/budget/{next(_calls)}"
    client.key_value_set(f"{prefix}/limit/{me}", json.dumps([limit, call]))
    posted = [
        json.loads(_get(f"{prefix}/limit/{p}", f"process {p}")) for p in range(count)
    ]
    for p, (_, other) in enumerate(posted):
        if other != call:
            raise RuntimeError(
                f"Processes {me} and {p} made different budgeted calls at the same "
                f"point: {call} and {other}. Under `jax.distributed` every process "
                "must make the same budgeted calls in the same order."
            )
    smallest = min(int(other) for other, _ in posted)
    if me == 0:
        try:
            choice = choose(smallest)
        except Exception as e:  # every process raises: none waits for nothing
            failed = {"failed": str(e), "refused": isinstance(e, ValueError)}
            client.key_value_set(f"{prefix}/choice", json.dumps(failed))
            raise
        client.key_value_set(f"{prefix}/choice", json.dumps(_store.encode(choice)))
        return choice
    posted = json.loads(_get(f"{prefix}/choice", "process 0's choice"))
    if "failed" in posted:
        if posted["refused"]:  # the budget's refusal, as process 0 raised it
            raise ValueError(posted["failed"])
        raise RuntimeError(
            f"Process 0 failed to choose the chunk size: {posted['failed']}"
        )
    return _store.decode(posted)
