"""A fit that will plan for long says so before it starts, with why.

Planning time grows with the step: each plan a planner weighs is a full
evaluation (the rewritten schedule and its liveness walk), and a search
weighs many (the planner says about how many). Before the first search, an
evaluation is timed (the faster of two); where the search it implies would
take longer than ``LONG`` seconds, a warning (shown without any logging set
up) says how long, why, and what saves the wait next time.
"""

from __future__ import annotations

import logging
import time

from jaxmem._decisions import RECOMPUTE, Plan
from jaxmem.cost._evaluate import candidate, recomputable
from jaxmem.graph._graph import Graph
from jaxmem.planners._base import Planner

_log = logging.getLogger("jaxmem")

LONG = 60.0  # seconds of planning worth a warning


def forewarn(graph: Graph, where: str, planner: Planner) -> float:
  """Times one evaluation of a plan of ``graph`` and warns where
  ``planner``'s search (:meth:`~jaxmem.Planner.weighs` plans) would take
  more than ``LONG`` seconds; returns that estimate (0 where nothing can
  be recomputed, or where the planner weighs one plan: a saved plan's)."""
  rebuildable = recomputable(graph)
  plans = planner.weighs(graph)
  if not rebuildable or plans <= 1:
    return 0.0
  plan = Plan.of({max(rebuildable.values(), key=lambda r: r.nbytes).value: RECOMPUTE})
  # The faster of two: the first also builds the graph's cached analyses,
  # and one pause (a collection, a busy core) is not the search's pace.
  each = min(_seconds(graph, plan) for _ in range(2))
  estimate = each * plans
  if estimate > LONG:
    _log.warning(
        "jaxmem: planning this step for %s may take about %.0f minute(s): each plan "
        "weighed is evaluated in %.0f ms (%d equations) and planner %r weighs up to about "
        "%d plans (%d residuals), besides compiling some. "
        "Running the fit inside 'with jaxmem.progress():' shows each plan and compilation; "
        "fit.save_plan(path) then transform(..., plan=path), or transform(..., "
        "plan_cache=dir), applies the plan later without planning.",
        where, max(estimate / 60, 1), each * 1e3, len(graph.nodes), planner.name, plans,
        len(graph.residuals))
  return estimate


def _seconds(graph: Graph, plan: Plan) -> float:
  """Seconds one evaluation of ``plan`` takes."""
  began = time.perf_counter()
  candidate(graph, plan)
  return time.perf_counter() - began
