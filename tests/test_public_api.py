"""Every public name imports and is documented under `docs/api/`."""

import importlib
import pathlib
import re
import types

import pytest

import filtered_chunk as fc


_DOCS_API = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api"


def _public_names() -> list[str]:
    return sorted(
        name
        for name, value in vars(fc).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    )


def _documented() -> set[str]:
    pattern = re.compile(r"^\s*:::\s*filtered_chunk\.(\w+)\s*$", re.MULTILINE)
    return {
        name
        for page in _DOCS_API.glob("*.md")
        for name in pattern.findall(page.read_text(encoding="utf-8"))
    }


def test_there_are_public_names():
    assert "filter_chunked_vmap" in _public_names()


@pytest.mark.parametrize("name", _public_names())
def test_public_name_imports(name):
    module = importlib.import_module("filtered_chunk")
    assert getattr(module, name) is getattr(fc, name)


@pytest.mark.parametrize("name", _public_names())
def test_public_name_is_documented(name):
    assert name in _documented(), (
        f"`filtered_chunk.{name}` is public but no page in docs/api/ contains "
        f"`::: filtered_chunk.{name}`."
    )
