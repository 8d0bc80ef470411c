"""The planner contract: what the fit loop may ask of any planner.

A planner is a small object with a name and, where it times plans, a
target (the GPU whose profile times them). It proposes
:class:`~jaxmem.cost._evaluate.Candidate` plans for a graph, each aimed at a
peak in model bytes; the fit loop compiles them and keeps the one XLA
agrees with. Subclass :class:`Planner` and implement :meth:`Planner.plan`;
the other methods have defaults.
"""

from __future__ import annotations

from jaxmem._decisions import Plan
from jaxmem.targets._profiles import DeviceProfile, get_profile
from jaxmem.cost._evaluate import Candidate
from jaxmem.graph._graph import Graph
from jaxmem.cost._perf import predict_schedule, rerun_seconds
from jaxmem.schedule._schedule import Schedule

# The target a planner that times copies plans for when none is given.
DEFAULT_TARGET = "t4"


# Plans a residual-by-residual search evaluates per residual of the step:
# 8-13 on the zoo's test models and a small GPT-2 (a budget planned toward,
# then the smallest).
EVALUATIONS_PER_RESIDUAL = 10


class Planner:
  """Base class of every planner.

  Attributes:
    name: how reports and the registry name it.
    target: the GPU plans are timed on (a name in ``jaxmem.PROFILES`` or
      a :class:`~jaxmem.DeviceProfile`); None: a plan's cost is the FLOPs
      it recomputes.
    assumed_target: the target was not given but assumed
      (``DEFAULT_TARGET``); reports say so.

  Example:
    >>> class KeepAll(Planner):
    ...   name = "keep-all"
    ...   def plan(self, graph, aim, start=None):
    ...     from jaxmem.cost._evaluate import candidate
    ...     return candidate(graph, Plan(), aim)
    >>> KeepAll().describe()
    'keep-all (cost: recomputed FLOPs)'
  """
  name: str = "planner"
  target: object = None
  assumed_target: bool = False

  def plan(self, graph: Graph, aim: int, start: Plan | None = None) -> Candidate:
    """A plan for ``graph`` whose predicted peak is at most ``aim``
    model bytes if it can find one (``fits`` says), else its lowest; from
    ``start`` if given (a plan for a looser aim)."""
    raise NotImplementedError(f"{type(self).__name__} must implement plan(graph, aim, "
                              "start=None) -> Candidate")

  def lowest(self, graph: Graph, start: Plan | None = None) -> list[Candidate]:
    """Candidates for the smallest footprint, lowest predicted peak first
    (the fit loop compiles each and names the smallest XLA gives); from
    ``start`` where given, unless the planner's search has starting points
    of its own."""
    return [self.plan(graph, 0, start=start)]

  def structured(self, graph: Graph) -> list[Candidate]:
    """Plans XLA follows closely (shaped like per-block remat), cheapest
    first; the fit loop compiles those cheaper than its plan."""
    return []

  def weighs(self, graph: Graph) -> int:
    """About how many plans a search for one budget evaluates at most
    (each a whole-schedule evaluation): what the fit loop's warning of a
    long planning time multiplies. By default ``EVALUATIONS_PER_RESIDUAL``
    per residual of ``graph``."""
    return EVALUATIONS_PER_RESIDUAL * len(graph.residuals)

  def may_offload(self) -> bool:
    """Whether its plans may put residuals in host memory (the fit loop
    then also tries loops with their stacks there)."""
    return False

  @property
  def target_profile(self) -> DeviceProfile | None:
    """The target's :class:`~jaxmem.DeviceProfile` (None without one)."""
    return None if self.target is None else get_profile(self.target)

  def cost(self, schedule: Schedule) -> float:
    """What a plan costs, in FLOPs: those it recomputes or, with a target,
    its predicted step time (copies and stalls included) in FLOPs of that
    target."""
    profile = self.target_profile
    if profile is None:
      return schedule.recompute_flops
    return predict_schedule(schedule, profile).seconds * profile.flops

  def rerun_costs(self, graph: Graph) -> tuple[float, ...]:
    """What running each equation of ``graph`` once more adds to
    :meth:`cost` (a recomputed op; no copy waits on it): its FLOPs, or
    with a target its predicted time in FLOPs of that target."""
    profile = self.target_profile
    if profile is None:
      return tuple(float(node.flops) for node in graph.nodes)
    return tuple(s * profile.flops for s in rerun_seconds(graph, profile))

  def describe(self) -> str:
    """The planner and what it plans for, for reports."""
    profile = self.target_profile
    if profile is None:
      return f"{self.name} (cost: recomputed FLOPs)"
    waits = (", its compiler waiting for each host copy (priced as a stall)"
             if profile.copies_wait and self.may_offload() else "")
    if self.assumed_target:
      return (f"{self.name} on {profile.name}{waits} (assumed: no target given; pass "
              f"target=<a name in jaxmem.PROFILES> or jaxmem.calibrate())")
    return f"{self.name} on {profile.name}{waits}"


def with_target(target) -> tuple[object, bool]:
  """``(target, assumed)``: the target given, or ``DEFAULT_TARGET`` where
  none is, which reports then name as assumed."""
  if target is None:
    return DEFAULT_TARGET, True
  get_profile(target)  # an unknown name fails here, with the choices
  return target, False
