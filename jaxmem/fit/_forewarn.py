"""A fit that will plan for long says so before it starts, with why.

Planning time grows with the step: each plan a planner weighs is a full
evaluation (the rewritten schedule and its liveness walk), and a search
weighs several plans per residual. Before the first search, one evaluation
is timed; where the search it implies would take longer than ``LONG``
seconds, a warning (shown without any logging set up) says how long, why,
and what saves the wait next time.
"""

from __future__ import annotations

import logging
import time

from jaxmem._decisions import RECOMPUTE, Plan
from jaxmem.cost._evaluate import candidate, recomputable
from jaxmem.graph._graph import Graph

_log = logging.getLogger("jaxmem")

# Plans a search evaluates per residual of the step: 8-13 on the zoo's test
# models and a small GPT-2 (a budget planned toward, then the smallest).
EVALUATIONS_PER_RESIDUAL = 10
LONG = 60.0  # seconds of planning worth a warning


def forewarn(graph: Graph, where: str) -> float:
  """Times one evaluation of a plan of ``graph`` and warns where a search
  of this size would plan for more than ``LONG`` seconds; returns that
  estimate (0 where nothing can be recomputed)."""
  rebuildable = recomputable(graph)
  if not rebuildable:
    return 0.0
  largest = max(rebuildable.values(), key=lambda r: r.nbytes)
  began = time.perf_counter()
  candidate(graph, Plan.of({largest.value: RECOMPUTE}))
  each = time.perf_counter() - began
  estimate = each * EVALUATIONS_PER_RESIDUAL * len(graph.residuals)
  if estimate > LONG:
    _log.warning(
        "jaxmem: planning this step for %s may take about %.0f minute(s): each plan "
        "weighed is evaluated in %.0f ms (%d equations) and a search weighs about %d "
        "plans per residual (%d residuals), besides compiling some. "
        "logging.getLogger('jaxmem').setLevel('INFO') shows each plan and compilation; "
        "fit.save_plan(path) then transform(..., plan=path), or transform(..., "
        "plan_cache=dir), applies the plan later without planning.",
        where, max(estimate / 60, 1), each * 1e3, len(graph.nodes),
        EVALUATIONS_PER_RESIDUAL, len(graph.residuals))
  return estimate
