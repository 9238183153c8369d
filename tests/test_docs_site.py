"""The docs site: every page is in the nav, every image has alt text and exists.

MkDocs builds every Markdown file under `docs/`, so a page missing from the nav is
built, searchable and reachable by no menu. Checked here from the sources, without
building the site (CI also runs `mkdocs build --strict`).
"""

import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NAV_ENTRY = re.compile(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", re.MULTILINE)
MARKDOWN_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)[^)]*\)")
HTML_IMAGE = re.compile(r"<img\b[^>]*>", re.IGNORECASE)
HTML_ALT = re.compile(r"""\balt\s*=\s*(["'])(.*?)\1""", re.IGNORECASE | re.DOTALL)
PAGES = sorted(DOCS.rglob("*.md"))


def nav_pages(mkdocs_yml: str) -> set[str]:
    nav = mkdocs_yml.split("\nnav:", 1)[1]
    return set(NAV_ENTRY.findall(nav))


def images(text: str) -> list[tuple[str, str]]:
    """`(alt, src)` of every Markdown and HTML image, `src` empty if unknown."""
    found = MARKDOWN_IMAGE.findall(text)
    for tag in HTML_IMAGE.findall(text):
        alt = HTML_ALT.search(tag)
        src = re.search(r"""\bsrc\s*=\s*(["'])(.*?)\1""", tag)
        found.append((alt.group(2) if alt else "", src.group(2) if src else ""))
    return found


def test_nav_parser_finds_entries():
    text = "site_name: x\nnav:\n  - Home: index.md\n  - API:\n      - api/a.md\n"
    assert nav_pages(text) == {"index.md", "api/a.md"}


def test_image_finder_finds_missing_alt_text():
    text = '![](a.svg) ![A plot of x.](b.svg) <img src="c.png"> <img alt="d" src="d">'
    assert images(text) == [
        ("", "a.svg"),
        ("A plot of x.", "b.svg"),
        ("", "c.png"),
        ("d", "d"),
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_is_in_the_nav(page: pathlib.Path):
    nav = nav_pages((ROOT / "mkdocs.yml").read_text())
    assert page.relative_to(DOCS).as_posix() in nav, (
        f"docs/{page.relative_to(DOCS)} is built but not in the nav of mkdocs.yml: "
        "add it there, or fold it into a page that is."
    )


@pytest.mark.parametrize(
    "page",
    [ROOT / "README.md", *PAGES],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_images_have_alt_text_and_exist(page: pathlib.Path):
    for alt, src in images(page.read_text()):
        assert len(alt.split()) >= 3, (
            f"{page.relative_to(ROOT)}: the image {src!r} needs alt text that "
            f"describes it, got {alt!r}."
        )
        if src and not re.match(r"https?://", src):
            assert (page.parent / src).is_file(), f"{src!r} does not exist."


def test_search_splits_identifiers():
    # Material's search splits words at its `separator`: "chunked" then finds
    # `filter_chunked_vmap`.
    config = (ROOT / "mkdocs.yml").read_text()
    found = re.search(r"^\s*separator:\s*'(.+)'\s*$", config, re.MULTILINE)
    assert found, "mkdocs.yml sets no search separator."
    separator = found.group(1).replace("\\\\", "\\")
    words = re.split(separator, "fc.filter_chunked_vmap(fun, in_axes=(0, None))")
    assert "chunked" in words and "axes" in words
