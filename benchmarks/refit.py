"""A step fitted again by new transforms of the same function: the budget
an error named (a user's second try), then a sweep of budgets (what
``jaxmem-bench`` does at each budget).

For each zoo model at its CPU size (Adam): a fit at an impossible budget
(``--impossible``, which fails naming the smallest footprint), a fit at the
budget it named, then a fit at each of ``--budgets``, each by a new
``jaxmem.transform`` of the model's one step function; per fit its
seconds, XLA:CPU footprint, micro-batches and the backend compilations it
made. Run at two commits to compare what a fit reuses of the fits before it.

    python benchmarks/refit.py --models gpt2 --budgets 90% 70% 50% --out DIR
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

import jaxmem
from jaxmem._zoo import models as zoo

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import _results  # noqa: E402
from benchmarks._steps import compilations, task  # noqa: E402

def _fit(step, args, budget) -> dict:
  """One new transform of ``step`` fitted at ``budget``."""
  began, before = time.perf_counter(), compilations()
  try:
    fit = jaxmem.transform(step, budget=budget).fit(*args)
    found = dict(footprint=fit.footprint, micro=fit.micro and fit.micro.count)
  except jaxmem.BudgetError as err:
    found = dict(smallest=err.smallest)
  return dict(budget=budget, seconds=round(time.perf_counter() - began, 2),
              compilations=compilations() - before, **found)


def rows_for(model: str, impossible: str, budgets: list[str]) -> list[dict]:
  t = task(model, dict(zoo().CPU_SIZES[model]))
  args = t.init()
  failed = _fit(t.step, args, impossible)
  rows = [failed, _fit(t.step, args, failed.get("smallest", impossible))]
  rows += [_fit(t.step, args, budget) for budget in budgets]
  for row, what in zip(rows, ["impossible", "named", *["sweep"] * len(budgets)]):
    row.update(model=model, fit=what)
  return rows


def table(rows: list[dict]) -> str:
  lines = ["| model | fit | budget | seconds | compilations | footprint (MiB) | micro-batches |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    mib = r.get("footprint", r.get("smallest"))
    lines.append(f"| {r['model']} | {r['fit']} | {r['budget']} | {r['seconds']} | "
                 f"{r['compilations']} | {mib / 2**20:.2f}{' (smallest)' if 'smallest' in r else ''}"
                 f" | {r.get('micro') or '-'} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["gpt2"])
  parser.add_argument("--impossible", default="10%")
  parser.add_argument("--budgets", nargs="+", default=["90%", "70%", "50%"])
  parser.add_argument("--out", required=True)
  opts = parser.parse_args(argv)
  rows: list = []
  for model in opts.models:
    rows += rows_for(model, opts.impossible, opts.budgets)
    print(table(rows), flush=True)
    _results.write(opts.out, "benchmarks/refit.py", sys.argv[1:] if argv is None else argv,
                   "A step fitted again by new transforms of the same function",
                   f"XLA:CPU on {jax.devices()[0].device_kind}", table(rows), rows)


if __name__ == "__main__":
  main()
