"""Budget and chunk size values: `fc.MemoryBudget`'s formats and fractions of the
free memory, and the errors for bad budgets and bad chunk sizes on every builder."""

import re

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import filtered_chunk as fc

from .helpers import tree_allclose
from .transforms import TRANSFORMS


@pytest.mark.parametrize(
    "size, expected",
    (
        ("4GiB", 4 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        (" 64 kib ", 64 * 1024),
        ("100", 100),
        ("12B", 12),
        (1024, 1024),
        (np.int64(2048), 2048),
    ),
)
def test_budget_formats(size, expected):
    budget = fc.MemoryBudget(size)
    assert budget.bytes == expected and budget.fraction is None
    assert budget.resolve() == expected
    assert repr(budget) == f"MemoryBudget({expected})"


def test_fractions_of_free_memory(monkeypatch):
    import filtered_chunk._budget._values as budget_module

    monkeypatch.setattr(budget_module, "available_bytes", lambda: 10 * 2**30)
    assert fc.MemoryBudget(0.5).resolve() == 5 * 2**30
    assert fc.MemoryBudget(1.0).resolve() == 10 * 2**30
    # "auto" is 80% of it, rounded down to 1/32 of a power of two.
    auto = fc.filter_chunked_vmap(jnp.sin, chunk_size="auto").budget
    assert auto is not None and auto == fc.MemoryBudget(0.8)
    assert 0.8 * 10 * 2**30 * (1 - 1 / 32) <= auto.resolve() <= 0.8 * 10 * 2**30
    # What a device or the system reports free is a positive number of bytes.
    monkeypatch.undo()
    assert fc.MemoryBudget(1.0).resolve() > 0


@pytest.mark.parametrize(
    "size, cls, match",
    (
        (0, ValueError, r"must be at least one byte, got 0"),
        (-5, ValueError, r"must be at least one byte, got -5"),
        ("0MiB", ValueError, r"must be at least one byte, got '0MiB'"),
        ("4 parsecs", ValueError, r"`MemoryBudget\('4 parsecs'\)`: a size string"),
        ("GiB", ValueError, r"a size string is a number and a unit"),
        ("", ValueError, r"a size string is a number and a unit"),
        ("9" * 400 + "TB", ValueError, r"the size is too large to be a number of"),
        (1.5, ValueError, r"must be in `\(0, 1\]`, got 1\.5\. Give a number of bytes"),
        (0.0, ValueError, r"must be in `\(0, 1\]`, got 0\.0"),
        (float("nan"), ValueError, r"must be in `\(0, 1\]`, got nan"),
        (True, TypeError, r"got bool object True"),
        (None, TypeError, r"got NoneType object None"),
        ([1], TypeError, r"got list object \[1\]"),
    ),
)
def test_bad_budgets(size, cls, match):
    with pytest.raises(cls, match=match):
        fc.MemoryBudget(size)


@pytest.mark.parametrize(
    "size, hint",
    (
        ("auto", r"write `chunk_size='auto'` \(or `MemoryBudget\(0\.8\)`\)\.$"),
        ("AUTO", r"write `chunk_size='auto'` \(or `MemoryBudget\(0\.8\)`\)\.$"),
        ("0.5", r"got '0\.5'\. For a fraction of .* `MemoryBudget\(0\.5\)`\.$"),
    ),
)
def test_bad_budget_hints(size, hint):
    with pytest.raises(ValueError, match=hint):
        fc.MemoryBudget(size)


@pytest.mark.parametrize("text", ("AUTO", " Auto ", "3", "4GiB", "512 MiB", "1.5GB"))
def test_chunk_size_hints_work(text):
    """Every `chunk_size=...` a message suggests builds a transform that runs."""
    with pytest.raises(ValueError) as info:
        fc.filter_chunked_vmap(jnp.sin, chunk_size=text)
    suggested = re.findall(r"`chunk_size=([^`]+)`", str(info.value))
    assert suggested, str(info.value)
    x = jnp.linspace(0.0, 1.0, 7)
    for code in suggested:
        chunk_size = eval(code, {"fc": fc})
        chunked = fc.filter_chunked_vmap(jnp.sin, chunk_size=chunk_size)
        assert tree_allclose(chunked(x), jax.vmap(jnp.sin)(x))


@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize(
    "chunk_size, cls, match",
    (
        (
            2.5,
            TypeError,
            r"must be a positive integer, `None`, `'auto'` or a "
            r"`filtered_chunk.MemoryBudget`, got float object 2\.5\.",
        ),
        (np.float32(2.0), TypeError, r"got float32 object np\.float32\(2\.0\)\."),
        (True, ValueError, r"must be a positive integer or `None`, got True\."),
        (
            np.int64(0),
            ValueError,
            r"must be a positive integer or `None`, got np\.int64\(0\)\.",
        ),
        (
            "4GiB",
            ValueError,
            r"got '4GiB'\. For a memory budget write "
            r"`chunk_size=fc.MemoryBudget\('4GiB'\)`\.",
        ),
        (
            "AUTO",
            ValueError,
            r"got 'AUTO'\. Write `chunk_size='auto'` \(lower case\)\.$",
        ),
        (
            "3",
            ValueError,
            r"got '3'\. For chunks of 3 elements write `chunk_size=3`\.$",
        ),
        # No hint where nothing that works is likely meant.
        ("0", ValueError, r"got '0'\.$"),
        ("0MiB", ValueError, r"got '0MiB'\.$"),
        ("fast", ValueError, r"got 'fast'\.$"),
    ),
)
def test_bad_chunk_sizes(name, chunk_size, cls, match):
    builder = TRANSFORMS[name].builder
    api = re.escape(f"`{builder.__name__}(..., chunk_size=...)`")
    with pytest.raises(cls, match=api + " .*" + match):
        builder(jnp.sin, chunk_size=chunk_size)
    with pytest.raises(cls, match=api):
        builder(chunk_size=chunk_size)(jnp.sin)


@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize(
    "chunk_size", (np.int64(3), np.int32(3), jnp.int32(3), np.uint8(3)), ids=str
)
def test_integer_scalars_as_chunk_size(name, chunk_size, getkey):
    x = jr.normal(getkey(), (7,))
    transform = TRANSFORMS[name]
    chunked = transform.builder(jnp.sin, chunk_size=chunk_size)
    assert tree_allclose(chunked(x), transform.oracle(jnp.sin)(x))
    assert type(chunked._options.chunk_size) is int  # pyright: ignore


def test_suggest_needs_a_budget():
    with pytest.raises(
        TypeError,
        match=r"`suggest_chunk_size\(fun, \.\.\.\)` takes a chunked transform "
        r"built with a memory budget",
    ):
        fc.suggest_chunk_size(
            fc.filter_chunked_vmap(jnp.sin, chunk_size=4), jnp.ones(8)
        )
    with pytest.raises(TypeError, match="takes a chunked transform"):
        fc.suggest_chunk_size(jnp.sin, jnp.ones(8))
