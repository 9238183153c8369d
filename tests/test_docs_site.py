"""The docs site: every page is in the nav, every image has alt text and exists,
no code line is wider than its box, and the API signatures are readable.

MkDocs builds every Markdown file under `docs/`, so a page missing from the nav is
built, searchable and reachable by no menu. Most checks read the sources; the
signature check builds the site (CI also runs `mkdocs build --strict`).
"""

import html
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import filtered_chunk as fc


ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NAV_ENTRY = re.compile(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", re.MULTILINE)
MARKDOWN_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)[^)]*\)")
HTML_IMAGE = re.compile(r"<img\b[^>]*>", re.IGNORECASE)
HTML_ALT = re.compile(r"""\balt\s*=\s*(["'])(.*?)\1""", re.IGNORECASE | re.DOTALL)
PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(r"^( *)```[^\n]*\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
# The characters a code box shows at 1280 px without scrolling: Material's text
# column holds about 80 characters of code, and about 74 inside a list item or an
# admonition (an indented fence).
TOP_LEVEL_WIDTH = 80
INDENTED_WIDTH = 74
SIGNATURE = re.compile(
    r'id="(filtered_chunk\.\w+)".*?<div class="doc-signature[^"]*"><pre>(.*?)</pre>',
    re.DOTALL,
)


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


def wide_code_lines(text: str) -> list[tuple[int, str]]:
    """`(limit, line)` for each line of a fenced block wider than its box."""
    wide = []
    for indent, body in FENCE.findall(text):
        limit = INDENTED_WIDTH if indent else TOP_LEVEL_WIDTH
        for line in body.splitlines():
            if len(line.removeprefix(indent)) > limit:
                wide.append((limit, line.strip()))
    return wide


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


def test_width_finder_finds_wide_lines():
    text = (
        "```python\n" + "a" * 80 + "\n" + "b" * 81 + "\n```\n\n"
        "- item\n\n    ```text\n    " + "c" * 74 + "\n    " + "d" * 75 + "\n    ```\n"
    )
    assert wide_code_lines(text) == [(80, "b" * 81), (74, "d" * 75)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_code_lines_fit_their_box(page: pathlib.Path):
    wide = wide_code_lines(page.read_text())
    assert not wide, (
        f"docs/{page.relative_to(DOCS)}: code lines wider than the box, which "
        f"scroll at 1280 px (limit, line): {wide}"
    )


def test_plots_link_to_their_svg():
    # At phone width a plot is small: a tap on it opens the SVG at full size.
    for page in PAGES:
        text = page.read_text()
        for _, src in MARKDOWN_IMAGE.findall(text):
            if src.endswith(".svg"):
                linked = re.search(
                    r"\[!\[[^\]]*\]\("
                    + re.escape(src)
                    + r"\)\]\("
                    + re.escape(src)
                    + r"\)",
                    text,
                )
                assert linked, f"docs/{page.relative_to(DOCS)}: link {src} to itself."


def test_docs_dependencies_are_pinned():
    # As Equinox's: a new release of the docs stack changes the rendered site. Ruff
    # formats the signatures; without it they render as one long line.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    docs = config["project"]["optional-dependencies"]["docs"]
    assert all(re.fullmatch(r"[\w.\[\]-]+==[\w.]+", d) for d in docs), docs
    assert any(d.startswith("ruff==") for d in docs), docs


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip('the docs extra is not installed: pip install ".[docs]"')
    out = tmp_path_factory.mktemp("site")
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    # The formatter is found next to the interpreter, as in a virtual environment.
    env["PATH"] = os.pathsep.join(
        [str(pathlib.Path(sys.executable).parent), env["PATH"]]
    )
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    return out


def signatures(page: str) -> dict[str, str]:
    """`{name: signature text}` of every API object of a built page."""
    return {
        name: html.unescape(re.sub(r"<[^>]+>", "", code))
        for name, code in SIGNATURE.findall(page)
    }


def test_signature_finder_reads_the_text():
    page = (
        '<h4 id="filtered_chunk.f" class="doc"><span>f</span></h4>'
        '<div class="doc-signature highlight"><pre><span></span><code>'
        '<span class="nf">f</span>(\n    <span class="n">x</span>: int,\n)</code>'
        "</pre></div>"
    )
    assert signatures(page) == {"filtered_chunk.f": "f(\n    x: int,\n)"}


@pytest.mark.parametrize("name", ["filter_chunked_vmap", "filter_chunked_apply"])
def test_api_signature_has_one_parameter_per_line(site: pathlib.Path, name: str):
    page = (site / "api" / name / "index.html").read_text()
    text = signatures(page)[f"filtered_chunk.{name}"]
    lines = text.splitlines()
    starts = {line.split(":")[0].strip() for line in lines if line.startswith("    ")}
    parameters = inspect.signature(getattr(fc, name)).parameters
    missing = [p for p in parameters if p not in starts]
    assert not missing, f"{name}: parameters not on a line of their own: {missing}"
    assert max(map(len, lines)) <= TOP_LEVEL_WIDTH, text


def test_docs_state_the_current_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(rf"^copyright: filtered_chunk {re.escape(version)} ", config, re.M)
    assert f"This documents version {version}" in (DOCS / "index.md").read_text()
    assert f"\n## {version} " in (ROOT / "CHANGELOG.md").read_text()
    for page in (ROOT / "README.md", DOCS / "index.md"):
        citation = re.search(r"```bibtex\n(.*?)```", page.read_text(), re.DOTALL)
        assert citation, f"{page.name} has no citation block."
        assert f"version = {{{version}}}" in citation.group(1), page.name
    assert '--8<-- "CHANGELOG.md"' in (DOCS / "changelog.md").read_text()


def test_site_shows_no_private_path_and_no_config(site: pathlib.Path):
    # Users read `equinox.Module`'s private home nowhere, and the docs' linter
    # settings are not a page.
    pages = [p.read_text() for p in site.rglob("*.html")]
    assert not [p for p in pages if "equinox._module" in p]
    assert not (site / "ruff.toml").exists()


@pytest.mark.parametrize(
    "diagram", sorted((DOCS / "diagrams").glob("*.svg")), ids=lambda p: p.name
)
def test_diagram_text_is_legible(diagram: pathlib.Path):
    # Drawn at phone width and shown at most 24rem wide (`extra.css`): 360 units
    # and text of 12 units or more read at 11-16 px on a 390 px phone and a desktop.
    svg = diagram.read_text()
    width = float(re.search(r'viewBox="0 0 ([0-9.]+) ', svg).group(1))  # pyright: ignore[reportOptionalMemberAccess]
    sizes = [float(s) for s in re.findall(r'font-size="([0-9.]+)"', svg)]
    assert width <= 360, f"{diagram.name} is {width} units wide"
    assert sizes and min(sizes) >= 12, f"{diagram.name}: text of {min(sizes)} units"
