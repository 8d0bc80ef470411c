"""Where the fit loop runs: a saved plan first, then the step with its
optimizer state on the device, then in host memory.

:func:`search` runs :class:`~jaxmem.fit._fit.Fitter` on the step's graph
and, where no plan fits and the target may keep optimizer state in host
memory, on the graph that keeps it there (``graph._state``); a plan from
the plan cache or a file is compiled once first (:func:`fit_plan`).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Iterable, TypeVar

from jaxmem._budget import BudgetError
from jaxmem._decisions import Plan
from jaxmem.cost._evaluate import state_hosted_tiers
from jaxmem.fit._fit import Fitter
from jaxmem.fit._trial import Trial
from jaxmem.fit._unmet import NoPlanFits
from jaxmem.graph._graph import Graph
from jaxmem.graph._state import apply_host_decisions, hosted_state
from jaxmem.planners import Fixed, Planner
from jaxmem.targets import DeviceProfile

_log = logging.getLogger("jaxmem")
T = TypeVar("T")


def first_fit(tries: Iterable[Callable[[], T | None]]) -> T | None:
  """The answer of the first of ``tries`` (run in turn, each once the ones
  before it answered no: None, or a :class:`BudgetError`) that answers;
  where none does, the ``BudgetError`` naming the smallest footprint of
  those raised (the first of equals), or None where none raised."""
  error = None
  for attempt in tries:
    try:
      found = attempt()
    except BudgetError as err:
      error = err if error is None or err.smallest < error.smallest else error
      continue
    if found is not None:
      return found
  if error is not None:
    raise error
  return None


def state_places(graph: Graph, profile: DeviceProfile | None, may_host: bool = True):
  """``graph``, then, where ``may_host``, the graphs that keep its optimizer
  state (then its master weights) in host memory between steps
  (``state_hosted_tiers``): where the state may live, in the order a fit
  tries them, each once no plan fits with the one before."""
  yield graph
  if may_host:
    yield from state_hosted_tiers(graph, profile)


def fit_plan(fitter: Callable[..., Fitter], plan: Plan,
             source: str) -> tuple[Fixed, tuple[Trial, int]] | None:
  """A given plan (from ``source``) as a fit: compiled once, without
  planning, and taken where it fits. ``fitter`` makes the fit loop for a
  planner; the answer is the planner proposing the plan with the loop's
  ``(trial, rounds)``, or None where the plan does not fit."""
  fixed = Fixed(plan, source=source)
  found = fitter(planner=fixed).fit(find_smallest=False)
  return None if found is None else (fixed, found)


def search(fitter: Callable[..., Fitter], graph: Graph, planner: Planner,
           find_smallest: bool, may_host: bool, saved: tuple[Plan, str] | None = None,
           profile: DeviceProfile | None = None, only_fitting: bool = False):
  """``(graph, planner, (trial, rounds))``: a saved plan (``(plan,
  source)``, from the plan cache) where one is given and fits (``Fixed``
  its planner), else the fit loop's (``fitter(graph, planner=...)``) with
  ``planner``; where no plan fits and ``may_host``, the same with the
  step's optimizer state kept in host memory (``graph._state``), then
  with its master weights there too (``state_hosted_tiers``), the graph
  then the one that keeps them there (with a ``profile``, each leaf's copy
  to the device issued early enough for the compute before its update to
  cover it). ``(graph, planner, None)`` where :meth:`Fitter.fit`'s quick
  answer (``find_smallest=False``, or ``only_fitting``) is no; else the
  :class:`BudgetError` naming the smallest footprint of all."""
  if saved is not None:
    hosted, plan = apply_host_decisions(graph, saved[0])
    hit = fit_plan(functools.partial(fitter, hosted), plan, saved[1])
    if hit is not None:
      return (hosted, *hit)
  smallest_from = None

  def attempt(tried: Graph):
    nonlocal smallest_from
    try:
      found = fitter(tried, planner=planner, smallest_from=smallest_from).fit(
          find_smallest, only_fitting)
    except NoPlanFits as err:
      # With the state on the host, the smallest is sought among the plans
      # that were smallest with it on the device (and the plans the second
      # fit tries toward the budget), not over all the planner's candidates
      # again: the state's place changes their order little, and each
      # costs a compilation.
      smallest_from = err.plans
      raise
    if found is not None and tried.hosted:
      masters = " and master weights" if any(leaf.master for leaf in hosted_state(tried)) else ""
      _log.info("jaxmem: no plan fits with the optimizer state%s on the device; "
                "it is kept in host memory between steps", masters)
    return None if found is None else (tried, planner, found)

  try:
    hit = first_fit(functools.partial(attempt, tried)
                    for tried in state_places(graph, profile, may_host))
  except NoPlanFits as error:  # the smallest plan kept; the search's frames not
    raise NoPlanFits(error, error.plans[:1], error.graph) from None
  except BudgetError as error:
    raise BudgetError(str(error), smallest=error.smallest, plan=error.plan) from None
  return hit or (graph, planner, None)
