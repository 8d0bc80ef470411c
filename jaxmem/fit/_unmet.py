"""Budgets a step cannot meet: the error that names the smallest footprint
reached, and that footprint remembered per step, so a second budget under
it fails at once."""

from __future__ import annotations

import weakref
from typing import Callable

from jaxmem._budget import BudgetError, format_bytes
from jaxmem._decisions import Plan


def budget_error(budget: int, reserve: int, unconstrained: int, smallest: int,
                 planner: str, where: str) -> BudgetError:
  """The error for ``budget`` (bytes, ``reserve`` included) under
  ``smallest``, the least footprint ``planner`` reaches on ``where``."""
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
      "or shrink the batch.", smallest=least)


class NoPlanFits(BudgetError):
  """A :class:`BudgetError` from the fit loop's search for the smallest
  footprint, with the plans that reached the least, smallest first."""

  def __init__(self, error: BudgetError, plans: tuple[Plan, ...]):
    super().__init__(str(error), smallest=error.smallest)
    self.plans = plans


# The smallest footprint a fit reached where it failed, per step function
# (weakly: it goes with the function) and per what decides it (the traced
# step's fingerprint, planner, target, planning rounds): a second budget
# under it fails at once, without planning or compiling again.
_SMALLEST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def remember(fun, key: tuple, smallest: int, unconstrained: int | None) -> None:
  """Records that fitting ``fun`` as ``key`` says reaches ``smallest`` bytes
  at least (XLA's footprint, reserve excluded), of ``unconstrained`` (None
  where the backend gives no footprint: nothing is recorded)."""
  if unconstrained is None:
    return
  try:
    _SMALLEST.setdefault(fun, {})[key] = (smallest, unconstrained)
  except TypeError:  # a callable that cannot be referenced weakly
    pass


def remembered(fun, key: tuple) -> tuple[int, int] | None:
  """``(smallest, unconstrained)`` recorded for ``fun`` and ``key``."""
  try:
    return _SMALLEST.get(fun, {}).get(key)
  except TypeError:
    return None


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
  smallest, unconstrained = known
  budget, reserve = in_bytes(unconstrained)
  if budget - reserve >= smallest:
    return False
  if not find_smallest:
    return True
  raise budget_error(budget, reserve, unconstrained, smallest, planner, where)
