"""The guide under docs/ builds without a warning (its examples run as
doctests: ``--doctest-glob=*.md``)."""

import ast
import os
import pathlib
import re
import subprocess
import sys

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
  """Every file or folder the README, the guide and the results pages
  (``benchmarks/results/*/README.md``) name by its path
  (``benchmarks/results/...``, ``tests/...``, ``jaxmem/...``, or
  ``../folder`` from a results page) exists, but the guide's build folder."""
  root = DOCS.parent
  results = sorted(root.glob("benchmarks/results/*/README.md"))
  cited = set()
  for page in [root / "README.md", *DOCS.glob("*.md"), *results]:
    text = page.read_text()
    for path in re.findall(r"\b((?:benchmarks|tests|jaxmem|models|docs)/[\w./-]*\w)", text):
      cited.add((str(page.relative_to(root)), path))
    for path in re.findall(r"(?<![\w.])(\.\./[\w./-]*\w)", text):
      cited.add((str(page.relative_to(root)), str((page.parent / path).relative_to(root))))
  missing = sorted((page, path) for page, path in cited if "_build" not in path
                   and not (root / path).exists() and not (DOCS / path).exists())
  assert results and len(cited) > 30 and not missing


ROOT = DOCS.parent


def test_the_readme_quickstart_runs(tmp_path):
  """The README's first code block is a doctest of ``jaxmem.transform`` on
  a small Flax step; it runs, in a process of its own on the CPU, as a
  reader would paste it (a few seconds)."""
  readme = (ROOT / "README.md").read_text()
  first = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
  assert first.startswith(">>> ") and "jaxmem.transform(train_step, budget=" in first
  run = ("import doctest, sys\n"
         f"result = doctest.testfile({str(ROOT / 'README.md')!r}, module_relative=False)\n"
         "sys.exit(1 if result.failed or not result.attempted else 0)\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", run], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def _message_calls(source: str, every: bool = False):
  """``(line, pieces)`` for each call in ``source`` that makes an error or
  a warning from a literal message (``raise ...Error(...)``, ``return
  ...Error(...)``, ``warnings.warn(...)``, ``_log.warning(...)``; with
  ``every``, any call given a literal first): the message's literal pieces,
  between its placeholders (``{...}`` or ``%s``)."""
  def pieces(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      return [node.value]
    if isinstance(node, ast.JoinedStr):
      out = [""]
      for part in node.values:
        if isinstance(part, ast.Constant):
          out[-1] += part.value
        else:
          out.append("")
      return out
    return None

  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Call) and node.args:
      name = getattr(node.func, "attr", getattr(node.func, "id", ""))
      if every or name.endswith("Error") or name in ("warn", "warning"):
        found = pieces(node.args[0])
        if found is not None:
          yield node.lineno, [p for piece in found for p in re.split(r"%[-.\d]*[sdfr]", piece)]


def _phrases(pieces) -> list[str]:
  """The openings (up to five words) of the message's phrases of three
  words or more: its literal pieces cut at punctuation."""
  cut = [p.split() for piece in pieces for p in re.split(r"[;:(),.]", piece)]
  return [" ".join(words[:5]) for words in cut if len(words) >= 3]


# Messages users meet that do not begin with "jaxmem": a planner's, a
# profile's, a per-block policy's, jaxmem-bench's. Each is in the package
# and has its entry.
UNPREFIXED = [
    "offload needs a target to time copies",
    "the swap refinement times copies on a target",
    "expected recompute or offload moves, got neither",
    "swap must be 'greedy' or 'lgm'",
    "reserve is a share of the aim in [0, 1)",
    "min_chunk must be >= 0 bytes",
    "max_chunks must be >= 1",
    "efficiency must be in [0, 1)",
    "expected link_latency >= 0 and memory > 0",
    "residual(s) in host memory or in chunks",
    "residual decision(s) of the plan are not those of whole blocks",
    "the examples are reduced by",
    "no argument holds a batch",
    "no part of the backward pass runs per example",
    "reads a batch value, and",
    "Micro-batching cannot help either",
    "Splitting layers' features cannot help either",
    "layers make these features (a residual stream)",
    "before a layer contracts them",
    "reads another layer's activations whole",
    "expected 'unconstrained', 'remat:<policy>'",
]


def test_every_message_has_a_troubleshooting_entry():
  """Each error and warning of the package whose message begins with
  "jaxmem" (and each in ``UNPREFIXED``) has an entry in
  docs/troubleshooting.md that quotes a phrase of it."""
  page = " ".join((DOCS / "troubleshooting.md").read_text().replace("`", "").split())
  package = {path: path.read_text() for path in sorted((ROOT / "jaxmem").rglob("*.py"))}
  missing, messages = [], 0
  for path, source in package.items():
    for line, pieces in _message_calls(source):
      if not pieces[0].startswith("jaxmem"):
        continue
      messages += 1
      if not any(phrase in page for phrase in _phrases(pieces)):
        missing.append(f"{path.relative_to(ROOT)}:{line}: {'...'.join(pieces)[:80]}")
  said = [" ".join("{}".join(pieces).split()) for source in package.values()
          for _, pieces in _message_calls(source, every=True)]
  for fragment in UNPREFIXED:
    if not any(fragment in message for message in said):
      missing.append(f"{fragment!r} is in no message of the package: update UNPREFIXED")
    elif fragment not in page:
      missing.append(f"{fragment!r}: no entry")
  assert messages > 25 and not missing, "\n".join(missing)
