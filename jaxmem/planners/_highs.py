"""HiGHS through ``scipy.optimize.milp``: one 0/1 program solved quietly
within a time limit, and the rows a program needs."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import numpy as np
from scipy import optimize

# HiGHS's default mip_rel_gap: a program closed to it is reported optimal.
OPTIMAL_GAP = 1e-4

# What each variable a program may take costs beyond its own cost.
TIE = 1e-7

# Rows a program over lazily added rows starts from (:func:`solve_rows`): on the zoo's
# GPT-2 and ViT, 3 and 8 took longer over a sweep, and most programs need no more.
FIRST_ROWS = 5

# Rows from which a program's rows are brought in lazily: the test models' programs, of
# 20-40 rows, solve in milliseconds whole (GPT-2's and ViT's have 60-110).
LAZY_FROM = 50

# ``scipy.optimize.milp``'s status of a program with no solution.
_INFEASIBLE = 2

# Seconds a program solved after others is given at least.
_LEAST = 0.05

# How far over a row's limit, relative to it, a solution may lie and still meet it
# (HiGHS's own feasibility tolerance is 1e-6 on the scaled rows).
_SLACK = 1e-6


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
  with _quiet_stdout():
    result = optimize.milp(cost, constraints=constraints, integrality=integrality,
                           bounds=optimize.Bounds(0, _upper(n, n_binary)),
                           options={"time_limit": time_limit, "mip_rel_gap": mip_gap})
  if result.x is None:
    return None, None, "infeasible"
  bound = getattr(result, "mip_dual_bound", None)
  if result.status != 0:
    status = "time limit"
  else:  # HiGHS's own default gap counts as optimal
    status = "optimal" if getattr(result, "mip_gap", 0.0) <= OPTIMAL_GAP else "near-optimal"
  return result.x, (result.fun if bound is None else bound), status


def solve_rows(cost: np.ndarray, constraints: list, rows: np.ndarray, upper: np.ndarray,
               n_binary: int, time_limit: float, mip_gap: float):
  """:func:`solve` under ``constraints`` and ``rows @ x <= upper``, the
  rows brought in lazily where there are :data:`LAZY_FROM` or more: the
  program starts from the :data:`FIRST_ROWS` rows of least slack at its LP
  relaxation's optimum, and each program
  solved whose solution breaks some row left out is solved again with
  those rows added. A program over fewer rows relaxes the whole one, so
  its bound bounds the whole program too, and a solution that meets every
  row is the whole program's. Where a program runs out of time with a
  solution that breaks a row left out, the whole program is solved in the
  time left. On the zoo's GPT-2 and ViT, HiGHS then takes half and two
  thirds of its time over a 20-budget sweep, mostly in one round, for
  plans within the gap of the whole program's; programs at the time limit
  take as long either way."""
  whole = [*constraints, *([optimize.LinearConstraint(rows, -np.inf, upper)] if len(rows) else [])]
  if len(rows) < LAZY_FROM:
    return solve(cost, whole, n_binary, time_limit, mip_gap)
  began = time.perf_counter()
  left = lambda: max(time_limit - (time.perf_counter() - began), _LEAST)
  n = len(cost)
  integrality = np.zeros(n)
  with _quiet_stdout():
    relaxed = optimize.milp(cost, constraints=whole, integrality=integrality,
                            bounds=optimize.Bounds(0, _upper(n, n_binary)),
                            options={"time_limit": time_limit})
  if relaxed.status == _INFEASIBLE:  # the relaxation has no solution: nor has the program
    return None, None, "infeasible"
  if relaxed.x is None:  # out of time: the whole program in the time left
    return solve(cost, whole, n_binary, left(), mip_gap)
  taken = np.zeros(len(rows), bool)
  taken[np.argsort(upper - rows @ relaxed.x, kind="stable")[:FIRST_ROWS]] = True
  while True:
    x, bound, status = solve(
        cost, [*constraints, optimize.LinearConstraint(rows[taken], -np.inf, upper[taken])],
        n_binary, left(), mip_gap)
    if x is None:
      return x, bound, status
    # Rows taken hold to HiGHS's tolerance; only those left out are checked.
    broken = ~taken & (rows @ x > upper + _SLACK * np.maximum(np.abs(upper), 1.0))
    if not broken.any():
      return x, bound, status
    if status == "time limit":
      return solve(cost, whole, n_binary, left(), mip_gap)
    taken |= broken


def _upper(n: int, n_binary: int) -> np.ndarray:
  """Variables' upper bounds: 1 for the first ``n_binary``, else none."""
  upper = np.full(n, np.inf)
  upper[:n_binary] = 1
  return upper


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
