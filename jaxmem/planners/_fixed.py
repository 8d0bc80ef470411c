"""A planner that proposes one given plan: a saved plan applied again."""

from __future__ import annotations

import dataclasses

from jaxmem._decisions import Plan
from jaxmem.cost._evaluate import Candidate, candidate
from jaxmem.graph._graph import Graph
from jaxmem.planners._base import Planner


@dataclasses.dataclass
class Fixed(Planner):
  """Proposes ``plan`` whatever the aim (``transform(..., plan=path)``):
  the fit loop compiles it once and keeps it if XLA's footprint fits the
  budget; if not, the error names its footprint.

  Example:
    >>> Fixed(Plan(), source="plan.json").describe()
    'saved plan plan.json (cost: recomputed FLOPs)'
  """
  plan_given: Plan = dataclasses.field(default_factory=Plan)
  source: str = "a saved plan"
  # Where ``plan_given`` is a loop body's (micro-batches, gradient
  # accumulation): the host decisions of the step around the loop.
  around: Plan = dataclasses.field(default_factory=Plan)

  @property
  def name(self) -> str:
    return f"saved plan {self.source}"

  def plan(self, graph: Graph, aim: int, start: Plan | None = None) -> Candidate:
    return candidate(graph, self.plan_given, aim)

  def weighs(self, graph: Graph) -> int:
    """One plan, the one given: applying it searches nothing."""
    return 1

  def may_offload(self) -> bool:
    return self.plan_given.uses_host
