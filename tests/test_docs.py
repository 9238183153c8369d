"""Runs the fenced `python` blocks of README.md, docs/ and public docstrings.

The blocks of one page run in order in one namespace, as a reader would run them,
under JAX's default configuration (not the strict one of `conftest.py`), as a user
would, and with a memory budget's default timing on (each test storing its timed
choices in a folder of its own, and timing for about a second).
"""

import inspect
import pathlib
import re
import textwrap

import jax
import pytest

import filtered_chunk as fc


ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^( *)```python\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda p: str(p.relative_to(ROOT)),
)
PUBLIC = sorted(
    name for name, obj in vars(fc).items() if not name.startswith("_") and callable(obj)
)


@pytest.fixture(autouse=True)
def _default_timing(monkeypatch, tmp_path):
    import filtered_chunk._budget._timing as timing

    monkeypatch.setattr(timing, "BY_DEFAULT", True)
    monkeypatch.setattr(timing, "FLOOR_SECONDS", 1.0)
    monkeypatch.setenv("FILTERED_CHUNK_CACHE_DIR", str(tmp_path / "choices"))


def blocks(text: str) -> list[str]:
    return [textwrap.dedent(body) for _, body in FENCE.findall(text)]


def run_blocks(text: str, where: str) -> None:
    namespace: dict = {"__name__": f"docs:{where}"}
    with (
        jax.enable_x64(False),
        jax.numpy_dtype_promotion("standard"),
        jax.numpy_rank_promotion("allow"),
    ):
        for i, block in enumerate(blocks(text)):
            exec(compile(block, f"<{where} block {i}>", "exec"), namespace)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page: pathlib.Path):
    run_blocks(page.read_text(), str(page.relative_to(ROOT)))


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_examples_run(name: str):
    doc = inspect.getdoc(getattr(fc, name))
    assert doc, f"`filtered_chunk.{name}` has no docstring."
    assert blocks(doc), f"`filtered_chunk.{name}`'s docstring has no example."
    run_blocks(doc, f"filtered_chunk.{name}")


def test_fence_finder_finds_indented_blocks():
    text = "x\n\n    ```python\n    a = 1\n    ```\n\n```python\nb = 2\n```\n"
    assert blocks(text) == ["a = 1\n", "b = 2\n"]
