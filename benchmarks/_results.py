"""Where a benchmark script's results go: ``results.json`` (its rows and a
header saying how they were made) and ``results.md`` (a title, the command,
the commit and the table) under one folder."""

from __future__ import annotations

import json
import os

import jax

from jaxmem._provenance import provenance


def write(out: str, script: str, argv: list[str], title: str, where: str, table: str,
          rows: list, **header) -> dict:
  """Writes the two files under ``out``; ``where`` says what compiled or
  ran the rows, ``header`` adds to the JSON header. Returns the header."""
  os.makedirs(out, exist_ok=True)
  header = {**provenance(script, argv), "jax": jax.__version__, **header}
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({"header": header, "rows": rows}, f, indent=1)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(f"# {title}\n\nCommand: `{header['command']}`  \nCommit: {header.get('commit')} "
            f"(dirty: {header.get('dirty')}), jax {jax.__version__}, {header['date']}, "
            f"{where}.\n\n{table}\n")
  return header
