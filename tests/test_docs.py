"""The guide under docs/ builds without a warning (its examples run as
doctests: ``--doctest-glob=*.md``)."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def test_the_guide_builds_without_warnings(tmp_path):
  build = pytest.importorskip("sphinx.cmd.build", reason="the docs extra: pip install -e '.[docs]'")
  assert build.build_main(["-W", "-q", "-b", "html", str(DOCS), str(tmp_path)]) == 0
  assert (tmp_path / "index.html").exists() and (tmp_path / "troubleshooting.html").exists()


def test_every_page_is_in_the_table_of_contents():
  pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
  index = (DOCS / "index.md").read_text()
  assert pages and all(f"\n{page}\n" in index for page in pages)


def test_what_the_docs_cite_is_in_the_repository():
  """Every file or folder the README and the guide name by its path
  (``benchmarks/results/...``, ``tests/...``, ``jaxmem/...``) exists, but
  the guide's build folder."""
  root = DOCS.parent
  cited = set()
  for page in [root / "README.md", *DOCS.glob("*.md")]:
    for path in re.findall(r"\b((?:benchmarks|tests|jaxmem|models|docs)/[\w./-]*\w)",
                           page.read_text()):
      cited.add((page.name, path))
  missing = sorted((page, path) for page, path in cited if "_build" not in path
                   and not (root / path).exists() and not (DOCS / path).exists())
  assert len(cited) > 30 and not missing
