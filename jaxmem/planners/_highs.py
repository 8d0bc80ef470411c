"""HiGHS through ``scipy.optimize.milp``: one 0/1 program solved quietly
within a time limit, and the rows a program needs."""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
from scipy import optimize

# HiGHS's default mip_rel_gap: a program closed to it is reported optimal.
OPTIMAL_GAP = 1e-4

# What each variable a program may take costs beyond its own cost.
TIE = 1e-7


def tie_broken(cost: np.ndarray, n: int) -> np.ndarray:
  """``cost`` (scaled to about 1) with each of its first ``n`` variables
  charged ``TIE`` more: among equal plans the program takes the fewest
  choices (an unpriced choice of no estimated cost is not taken for
  nothing); the plans it prefers cost at most n * 1e-7 more, far under
  the gap the solver closes (``ILP.mip_gap``)."""
  cost = cost.copy()
  cost[:n] += TIE
  return cost


def solve(cost: np.ndarray, constraints: list, n_binary: int, time_limit: float,
          mip_gap: float):
  """Minimizes ``cost`` over variables in [0, inf), the first ``n_binary``
  0/1, within ``time_limit`` seconds or ``mip_gap`` of the bound:
  ``(x, bound, status)``; x None when it has no solution."""
  n = len(cost)
  integrality = np.zeros(n)
  integrality[:n_binary] = 1
  upper = np.full(n, np.inf)
  upper[:n_binary] = 1
  with _quiet_stdout():
    result = optimize.milp(cost, constraints=constraints, integrality=integrality,
                           bounds=optimize.Bounds(0, upper),
                           options={"time_limit": time_limit, "mip_rel_gap": mip_gap})
  if result.x is None:
    return None, None, "infeasible"
  bound = getattr(result, "mip_dual_bound", None)
  if result.status != 0:
    status = "time limit"
  else:  # HiGHS's own default gap counts as optimal
    status = "optimal" if getattr(result, "mip_gap", 0.0) <= OPTIMAL_GAP else "near-optimal"
  return result.x, (result.fun if bound is None else bound), status


def binding_rows(rows: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The rows of ``base + rows @ x <= limit`` (over x >= 0) that no other
  row implies: rows with equal coefficients merged into one with the
  largest ``base`` (equations between the same makings and reads of the
  chosen values), then each row dropped where another row is at least as
  large in ``base`` and in every coefficient. On the zoo's GPT-2 this
  leaves about half of its 100-200 rows, and HiGHS's time over a sweep
  of 20 budgets falls by about a third."""
  if not len(rows):
    return rows, base
  unique, inverse = np.unique(rows, axis=0, return_inverse=True)
  top = np.full(len(unique), -np.inf)
  np.maximum.at(top, inverse.ravel(), base)
  # A row's dominator has a larger coefficient sum (rows are distinct), so
  # it comes first in this order and is kept, or dominated by a kept row.
  kept: list[int] = []
  for i in np.lexsort((-top, -unique.sum(axis=1))):
    if kept and ((unique[kept] >= unique[i]).all(axis=1) & (top[kept] >= top[i])).any():
      continue
    kept.append(i)
  kept.sort()
  return unique[kept], top[kept]


@contextlib.contextmanager
def _quiet_stdout():
  """The process's standard output closed to what HiGHS prints itself
  (some builds print a debugging line while solving, whatever ``disp``
  says); Python's own output is flushed first and goes on after."""
  sys.stdout.flush()
  try:
    saved = os.dup(1)
  except OSError:  # no standard output to silence
    yield
    return
  try:
    with open(os.devnull, "w") as null:
      os.dup2(null.fileno(), 1)
      yield
  finally:
    os.dup2(saved, 1)
    os.close(saved)
