"""Budgets a step cannot meet: the error that names the smallest footprint
reached, and that footprint remembered per step, with the plan that
reached it: a second budget under it fails at once, and a budget at it
(the one the error named) takes that plan without searching again."""

from __future__ import annotations

import weakref
from typing import Callable

from jaxmem._budget import BudgetError, format_bytes
from jaxmem._decisions import Plan


def budget_error(budget: int, reserve: int, unconstrained: int, smallest: int,
                 planner: str, where: str, plan: str | None = None) -> BudgetError:
  """The error for ``budget`` (bytes, ``reserve`` included) under
  ``smallest``, the least footprint ``planner`` reaches on ``where`` (by
  ``plan``, a saved plan's text, where given)."""
  least = smallest + reserve
  kept = (f", and {format_bytes(reserve)} is kept free beyond it for the "
          "runtime's workspaces (transform(..., reserve=))" if reserve else "")
  return BudgetError(
      f"jaxmem: budget {format_bytes(budget)} ({budget / unconstrained:.0%} "
      f"of the unconstrained {format_bytes(unconstrained)}) cannot be met "
      f"by planner {planner!r}"
      f"{f' on target {where}' if where else ''}: the smallest "
      f"footprint it reaches for this step is {format_bytes(smallest)} ({smallest} bytes, "
      f"{smallest / unconstrained:.0%}){kept}. Pass budget >= {least} bytes, "
      "or shrink the batch.", smallest=least, plan=plan)


class NoPlanFits(BudgetError):
  """A :class:`BudgetError` from the fit loop's search for the smallest
  footprint, with the plans that reached the least, smallest first, and
  the graph they are plans of."""

  def __init__(self, error: BudgetError, plans: tuple[Plan, ...], graph):
    super().__init__(str(error), smallest=error.smallest)
    self.plans, self.graph = plans, graph


# The smallest footprint a fit reached where it failed, per step function
# (weakly: it goes with the function) and per what decides it (the traced
# step's fingerprint, planner, target, planning rounds), with the plan that
# reached it: a second budget under it fails at once, without planning or
# compiling again.
_SMALLEST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# How far above the smallest footprint a budget takes the plan that reached
# it, without searching again: there the only plan known to fit is that
# one, and a search toward the budget compiles plans that land above it.
SNUG = 0.01


def remember(fun, key: tuple, smallest: int, unconstrained: int | None,
             plan: str | None = None) -> None:
  """Records that fitting ``fun`` as ``key`` says reaches ``smallest`` bytes
  at least (XLA's footprint, reserve excluded), of ``unconstrained`` (None
  where the backend gives no footprint: nothing is recorded), by ``plan``
  (a saved plan's text, where known); a record of less is kept."""
  if unconstrained is None:
    return
  try:
    known = _SMALLEST.setdefault(fun, {})
  except TypeError:  # a callable that cannot be referenced weakly
    return
  if key not in known or smallest <= known[key][0]:  # the least reached is kept
    known[key] = (smallest, unconstrained, plan)


def remembered(fun, key: tuple) -> tuple[int, int, str | None] | None:
  """``(smallest, unconstrained, plan)`` recorded for ``fun`` and ``key``."""
  try:
    return _SMALLEST.get(fun, {}).get(key)
  except TypeError:
    return None


def snug_plan(fun, key: tuple, in_bytes: Callable[[int], tuple[int, int]],
              above: float = SNUG) -> str | None:
  """The plan (a saved plan's text) that reached the smallest footprint an
  earlier fit of ``fun`` as ``key`` says, where this budget
  (``in_bytes(unconstrained) -> (budget, reserve)``) lies from that
  footprint to ``above`` (a share) above it; else None."""
  known = remembered(fun, key)
  if known is None or known[2] is None:
    return None
  smallest, unconstrained, plan = known
  budget, reserve = in_bytes(unconstrained)
  return plan if smallest <= budget - reserve <= smallest * (1 + above) else None


def known_to_fail(fun, key: tuple, in_bytes: Callable[[int], tuple[int, int]],
                  find_smallest: bool, planner: str, where: str) -> bool:
  """Whether an earlier fit of ``fun`` as ``key`` says (its fingerprint,
  planner, target and rounds) reached no footprint within this budget
  (``in_bytes(unconstrained) -> (budget, reserve)``): then ``can_fit``
  answers at once (True returned) and ``fit`` raises its error, before
  planning or compiling again."""
  known = remembered(fun, key)
  if known is None:
    return False
  smallest, unconstrained, _ = known
  budget, reserve = in_bytes(unconstrained)
  if budget - reserve >= smallest:
    return False
  if not find_smallest:
    return True
  raise budget_error(budget, reserve, unconstrained, smallest, planner, where, known[2])
