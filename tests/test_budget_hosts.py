"""One choice on every host (`filtered_chunk/_budget/_hosts.py`), as one process
of two sees it, with `jax.distributed`'s key-value store faked: the other
process's posts are there already. `tests/test_sharding.py::test_two_processes`
runs two real processes whose free memory differs."""

import json
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import filtered_chunk as fc
import filtered_chunk._budget._hosts as hosts
import filtered_chunk._budget._store as store


class _Store:
    """`jax.distributed`'s key-value client: a dict, whose missing keys time out."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def key_value_set(self, key: str, value: str) -> None:
        assert key not in self.values, key  # every call's keys are its own
        self.values[key] = value

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        if key not in self.values:
            raise Exception(f"DEADLINE_EXCEEDED: {key}")  # as the runtime's
        return self.values[key]


_CHOICE = fc.ChunkSizeChoice(
    chunk_size=64,
    bytes=900,
    budget=1000,
    tried=((1, 100), (64, 900), (200, 3000)),
    largest=64,
    model="cache",
    element_bytes=14,
    cache_bytes=2**20,
    working_set=((1, 14), (64, 896), (200, 2800)),
)


@pytest.fixture
def process(monkeypatch):
    """Makes this process `index` of two, with a fresh faked store."""
    kv = _Store()
    monkeypatch.setattr(hosts, "distributed_client", lambda: kv)
    monkeypatch.setattr(hosts, "_calls", iter(range(100)))

    def _as(index: int) -> _Store:
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        monkeypatch.setattr(jax, "process_index", lambda: index)
        return kv

    return _as


def _post_limit(kv: _Store, call: int, process: int, limit: int, what: str) -> None:
    kv.values[f"filtered_chunk/budget/{call}/limit/{process}"] = json.dumps(
        [limit, what]
    )


def test_process_0_chooses_for_the_smallest_budget(process):
    kv = process(0)
    _post_limit(kv, 0, 1, 1000, "call")
    asked: list[int] = []

    def _choose(limit: int) -> fc.ChunkSizeChoice:
        asked.append(limit)
        return _CHOICE

    assert hosts.choose_everywhere(5000, "call", _choose) == _CHOICE
    assert asked == [1000]
    posted = json.loads(kv.values["filtered_chunk/budget/0/choice"])
    assert store.decode(posted) == _CHOICE


def test_other_processes_take_process_0s_choice(process):
    kv = process(1)
    _post_limit(kv, 0, 0, 5000, "call")
    kv.values["filtered_chunk/budget/0/choice"] = json.dumps(store.encode(_CHOICE))
    never = lambda limit: pytest.fail("process 1 chose")  # noqa: E731
    assert hosts.choose_everywhere(1000, "call", never) == _CHOICE


def test_a_refusal_is_everyones(process, monkeypatch):
    kv = process(0)
    _post_limit(kv, 0, 1, 10, "call")

    def _refuse(limit: int) -> Any:
        raise ValueError(f"the memory budget of {limit} bytes is too small")

    with pytest.raises(ValueError, match="of 10 bytes"):
        hosts.choose_everywhere(5000, "call", _refuse)
    refusal = kv.values["filtered_chunk/budget/0/choice"]
    # Process 1 raises the same.
    kv = process(1)
    kv.values.clear()
    monkeypatch.setattr(hosts, "_calls", iter(range(100)))
    _post_limit(kv, 0, 0, 5000, "call")
    kv.values["filtered_chunk/budget/0/choice"] = refusal
    with pytest.raises(ValueError, match="of 10 bytes is too small"):
        hosts.choose_everywhere(10, "call", lambda limit: _CHOICE)


def test_process_0_failing_otherwise(process):
    kv = process(1)
    _post_limit(kv, 0, 0, 5000, "call")
    failed = {"failed": "boom", "refused": False}
    kv.values["filtered_chunk/budget/0/choice"] = json.dumps(failed)
    with pytest.raises(RuntimeError, match="Process 0 failed .* boom"):
        hosts.choose_everywhere(1000, "call", lambda limit: _CHOICE)


def test_processes_that_diverge(process):
    kv = process(1)
    _post_limit(kv, 0, 0, 5000, "another call")
    with pytest.raises(RuntimeError, match="different budgeted calls"):
        hosts.choose_everywhere(1000, "call", lambda limit: _CHOICE)


def test_a_process_that_never_comes(process):
    process(1)  # process 0 posts nothing
    with pytest.raises(RuntimeError, match="waited for process 0"):
        hosts.choose_everywhere(1000, "call", lambda limit: _CHOICE)


def test_tune_true_is_refused_with_several_processes(process):
    process(0)
    chunked = fc.filter_chunked_vmap(
        jnp.sin, chunk_size=fc.MemoryBudget("1MiB", tune=True)
    )
    with pytest.raises(ValueError, match="tune=True"):
        chunked(jnp.ones((8, 3)))


def test_one_process_asks_nobody(monkeypatch):
    monkeypatch.setattr(hosts, "distributed_client", lambda: pytest.fail("asked"))
    assert hosts.choose_everywhere(7, "call", lambda limit: _CHOICE) == _CHOICE
