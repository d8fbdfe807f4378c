"""Every file of the repository a page names (`twinrun/storage/rundir.py`, `benchmarks/...`) exists:
pages follow the code when rooms move."""

import re

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("*/README.md")),
         *sorted(REPO.glob("examples/*/README.md"))]
PATH = re.compile(r"`((?:twinrun|tests|benchmarks|launch|conf|examples|docs)/"
                  r"[A-Za-z0-9_./-]+\.(?:py|md|yaml|sh))`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_named_file_exists(page):
    missing = sorted({m for m in PATH.findall(page.read_text()) if not (REPO / m).exists()})
    assert not missing, f"{page.relative_to(REPO)} names files that do not exist: {missing}"
