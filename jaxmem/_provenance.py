"""Where a result comes from: the exact command, the commit and whether the
working tree was dirty, written by the tool that made the result.

The commit is the source checkout's that jaxmem runs from (None for an
installed copy). ``JAXMEM_COMMIT`` / ``JAXMEM_DIRTY`` stand in for git where
the tree travels without its history (a GPU machine gets a copy of the
working tree).
"""

from __future__ import annotations

import datetime
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def provenance(script: str, argv) -> dict:
  """``{"command", "commit", "dirty", "date"}`` for ``python <script> <argv>``."""
  def git(*args):
    if not os.path.exists(os.path.join(ROOT, ".git")):
      return None  # not a source checkout: a repository around it is not ours
    try:
      return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
      return None
  commit = os.environ.get("JAXMEM_COMMIT") or git("rev-parse", "HEAD")
  dirty = os.environ.get("JAXMEM_DIRTY")
  if dirty is None:
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = None if commit is None else bool(status)
  else:
    dirty = dirty.lower() in ("1", "true", "yes")
  return {"command": " ".join(["python", script, *argv]), "commit": commit,
          "dirty": dirty, "date": datetime.date.today().isoformat()}
