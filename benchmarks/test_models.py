"""Issue-2 figures for the three test models at the tests' sizes.

For each model: XLA's footprint at 100%, 70%, 50% and the smallest budget the
transform reaches, as fractions of the unconstrained footprint, the memory
model's peak over XLA's, added FLOPs and planning time, as a markdown table.

Example:
  python benchmarks/test_models.py mlp cnn transformer
"""

from __future__ import annotations

import sys

import jaxmem  # noqa: F401  (sets the XLA:CPU remat flag first)
import optax

from jaxmem._zoo import models as _models
models = _models()
from tests.test_transform import SMALL


def rows(name: str):
  task = models.get(name, optimizer=optax.adam(1e-3, eps=1e-3), **SMALL[name])
  args = task.init()
  try:
    jaxmem.transform(task.step, budget=1).fit(*args)
  except jaxmem.BudgetError as err:
    smallest = err.smallest
  for budget in ["100%", "70%", "50%", smallest]:
    p = jaxmem.transform(task.step, budget=budget).fit(*args)
    label = budget if isinstance(budget, str) else "smallest"
    yield (f"| {name} | {label} | {p.footprint / p.unconstrained:.3f} | "
           f"{p.memory.peak / p.footprint:.3f} | "
           f"{p.unconstrained_model / p.unconstrained:.3f} | "
           f"+{p.added_flops / p.base_flops:.1%} | {p.seconds:.1f} | {len(p.plan)} | "
           f"{p.unconstrained} |")


def main(names) -> None:
  print("| model | budget | XLA / unconstrained | model / XLA (planned) | "
        "model / XLA (unconstrained) | added FLOPs | plan s | residuals recomputed | "
        "unconstrained bytes |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name in names or sorted(SMALL):
    for row in rows(name):
      print(row, flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
