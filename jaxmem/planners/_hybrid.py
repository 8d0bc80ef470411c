"""Libra's hybrid planner, as a combinator over two planners."""

from __future__ import annotations

import dataclasses
import time

from jaxmem._decisions import Offload, Plan
from jaxmem.cost._evaluate import (Candidate, evaluate, fused_values, model_floor, paused_gc,
                                   prefetch_point)
from jaxmem.graph._graph import Graph
from jaxmem.graph._loops import stacked_residuals
from jaxmem.planners._base import Planner


@dataclasses.dataclass
class Hybrid(Planner):
  """Recompute first, swap where it pays: ``first`` then ``then``, the way
  optax's ``chain`` composes transforms.

  1. ``first`` (a recompute-only planner) plans toward the aim.
  2. Where its plan does not fit, ``then`` (a planner that swaps: a greedy
     with offload moves, or the vTensor planner) goes on from it, deciding
     afresh the stacked residuals of loops: a loop ``first`` nested drops
     every stack, which leaves nothing there to swap, while stacks kept in
     host memory one slice per iteration can beat any recomputation.
     From a ``start`` where that does not fit either, ``then`` goes on
     from ``first``'s lowest plan too: :func:`jaxmem.planners.hybrid`'s
     ``first`` searches around a start only, and climbs its ladder from
     nothing (most of a search) only here.
  3. Refinement: each recomputed residual, largest first (up to
     ``swaps``), is switched to an offload copied back early enough to hide
     the copy (behind the copies already queued on the link, and ahead of
     any recomputation that reads it), where that lowers the predicted time
     on ``target`` and the plan still fits.

  A unified-memory target never offloads (it frees nothing there);
  ``host_budget`` caps pinned host bytes. :func:`jaxmem.planners.hybrid`
  builds the usual pair for a target.

  Example:
    >>> from jaxmem.planners import Greedy
    >>> h = Hybrid(Greedy(target="rtx3060"),
    ...            Greedy(offload=True, target="rtx3060"), target="rtx3060")
    >>> h.describe()
    'hybrid on rtx3060'
  """
  first: Planner
  then: Planner
  target: object = None
  swaps: int = 32
  host_budget: int | None = None
  name: str = "hybrid"
  assumed_target: bool = False

  def __post_init__(self):
    if self.target is None:
      raise ValueError("Hybrid: the swap refinement times copies on a target; got "
                       "target=None, expected a name in jaxmem.PROFILES or a "
                       "DeviceProfile (jaxmem.calibrate())")

  def may_offload(self) -> bool:
    return self.then.may_offload() and not self.target_profile.unified

  def plan(self, graph: Graph, aim: int, start: Plan | None = None) -> Candidate:
    """Plans toward ``aim`` bytes, from ``start`` if given (its
    recomputation and saved boundaries); under the graph's
    :func:`~jaxmem.cost._evaluate.model_floor`, where no plan fits, the
    lowest of :meth:`lowest` (which the fit loop asks for next)."""
    began = time.perf_counter()
    if aim < model_floor(graph):
      return dataclasses.replace(self.lowest(graph)[0].aimed(aim),
                                 seconds=time.perf_counter() - began)
    kept = None if start is None else Plan.of(
        {**start.with_kind("recompute"), **start.with_kind("save")})
    found = self.first.plan(graph, aim, start=kept)
    results = [found]
    if not found.fits:
      results.append(self.then.plan(graph, aim, start=_outside_loops(graph, found.plan)))
      if not results[-1].fits and start is not None:
        # ``first`` may not have climbed its ladder from ``start`` (``climbs``):
        # its lowest plan from nothing may leave ``then`` less to move.
        lowest = self.first.lowest(graph)[0]
        if lowest.plan != found.plan:
          results.append(self.then.plan(graph, aim, start=_outside_loops(graph, lowest.plan)))
    with paused_gc():
      results = [self._swap(graph, r, aim) for r in results]
    best = min(results, key=lambda r: (not r.fits, self.cost(r.schedule)
                                       if r.fits else r.peak))
    best.seconds = time.perf_counter() - began
    return best

  def lowest(self, graph: Graph) -> list[Candidate]:
    """The candidates for the smallest footprint: both planners' lowest,
    ``then``'s from ``first``'s lowest plan."""
    first = self.first.lowest(graph)
    then = self.then.lowest(graph, start=_outside_loops(graph, first[0].plan))
    return sorted(first + then, key=lambda r: r.peak)

  def _swap(self, graph, result: Candidate, aim: int) -> Candidate:
    """Refinement 3: recomputed residuals switched to offloads that pay."""
    profile = self.target_profile
    if profile.unified:
      return result
    limit = max(aim, result.peak)
    plan, schedule, memory = result.plan, result.schedule, result.memory
    cost = self.cost(schedule)
    fused = fused_values(graph)
    chosen = sorted((graph.residual(v) for v in plan.values_with("recompute")
                     if v not in fused), key=lambda r: -r.nbytes)[:self.swaps]
    for r in chosen:
      at = prefetch_point(schedule, r.value, r.nbytes, profile, queue=True)
      trial = plan.with_decision(r.value, Offload(at=at))
      t_schedule, t_memory = evaluate(graph, trial)
      if t_memory.peak > limit or (self.host_budget is not None
                                   and t_memory.host_peak > self.host_budget):
        continue
      t_cost = self.cost(t_schedule)
      if t_cost < cost:
        plan, schedule, memory, cost = trial, t_schedule, t_memory, t_cost
    return dataclasses.replace(result, plan=plan, schedule=schedule, memory=memory,
                               fits=memory.peak <= aim)


def _outside_loops(graph: Graph, plan: Plan) -> Plan:
  """``plan`` without its decisions on stacked residuals."""
  stacked = stacked_residuals(graph)
  return Plan.of({v: d for v, d in plan.items if v not in stacked})
