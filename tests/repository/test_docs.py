"""The documentation stays inside the repository: every link resolves here, and the index lists every page."""

import re

import pytest
from conftest import REPO

DOCS = sorted((REPO / "docs").glob("*.md"))
# Every page a reader opens: the docs and every README (launch/, benchmarks/, tests/, each example, ...).
READMES = sorted(p for p in [*REPO.glob("*/README.md"), *REPO.glob("*/*/README.md")]
                 if not p.relative_to(REPO).parts[0].startswith("."))  # not a tool's cache
PAGES = [REPO / "README.md", *READMES, *DOCS]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _local_links(page):
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_resolves_inside_the_repository(page):
    for target in _local_links(page):
        path = (page.parent / target).resolve()
        assert path.is_relative_to(REPO), f"{page.name} links outside the repository: {target}"
        assert path.exists(), f"{page.name}: broken link {target}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_page_cites_notes_outside_the_repository(page):
    assert not re.search(r"(\.\./)?shared/(notes|DESIGN|STYLE)", page.read_text()), page


def test_index_links_every_docs_page():
    linked = {(REPO / "docs" / t).resolve() for t in _local_links(REPO / "docs" / "index.md")}
    missing = [p.name for p in DOCS if p.name != "index.md" and p.resolve() not in linked]
    assert not missing, missing
