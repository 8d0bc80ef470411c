"""The planner contract: what the fit loop may ask of any planner.

A planner is a small object with a name and, where it times plans, a
device profile. It proposes :class:`~jaxmem._evaluate.Candidate` plans for
a graph; the fit loop compiles them and keeps the one XLA agrees with.
Subclass :class:`Planner` and implement :meth:`Planner.plan`; the other
methods have defaults.
"""

from __future__ import annotations

from jaxmem._decisions import Plan
from jaxmem.targets._profiles import DeviceProfile, get_profile
from jaxmem._evaluate import Candidate
from jaxmem._graph import Graph
from jaxmem._perf import predict_schedule
from jaxmem._schedule import Schedule

# The profile a planner that times copies plans for when none is given.
DEFAULT_DEVICE = "t4"


class Planner:
  """Base class of every planner.

  Attributes:
    name: how reports and the registry name it.
    device: the device profile plans are timed on (a name in
      ``jaxmem.PROFILES`` or a :class:`~jaxmem.DeviceProfile`); None: a
      plan's cost is the FLOPs it recomputes.
    assumed_device: the device was not given but assumed
      (``DEFAULT_DEVICE``); reports say so.

  Example:
    >>> class KeepAll(Planner):
    ...   name = "keep-all"
    ...   def plan(self, graph, target, start=None):
    ...     from jaxmem._evaluate import candidate
    ...     return candidate(graph, Plan(), target)
    >>> KeepAll().describe()
    'keep-all (cost: recomputed FLOPs)'
  """
  name: str = "planner"
  device: object = None
  assumed_device: bool = False

  def plan(self, graph: Graph, target: int, start: Plan | None = None) -> Candidate:
    """A plan for ``graph`` whose predicted peak is at most ``target``
    model bytes if it can find one (``fits`` says), else its lowest; from
    ``start`` if given (a plan for a looser target)."""
    raise NotImplementedError(f"{type(self).__name__} must implement plan(graph, target, "
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

  def may_offload(self) -> bool:
    """Whether its plans may put residuals in host memory (the fit loop
    then also tries loops with their stacks there)."""
    return False

  @property
  def device_profile(self) -> DeviceProfile | None:
    return None if self.device is None else get_profile(self.device)

  def cost(self, schedule: Schedule) -> float:
    """What a plan costs, in FLOPs: those it recomputes or, with a device,
    its predicted step time (copies and stalls included) in FLOPs of that
    device."""
    device = self.device_profile
    if device is None:
      return schedule.recompute_flops
    return predict_schedule(schedule, device).seconds * device.flops

  def describe(self) -> str:
    """The planner and what it plans for, for reports."""
    device = self.device_profile
    if device is None:
      return f"{self.name} (cost: recomputed FLOPs)"
    if self.assumed_device:
      return (f"{self.name} on {device.name} (assumed: no device given; pass "
              f"device=<a name in jaxmem.PROFILES> or jaxmem.calibrate())")
    return f"{self.name} on {device.name}"


def with_device(device) -> tuple[object, bool]:
  """``(device, assumed)``: the device given, or ``DEFAULT_DEVICE`` where
  none is, which reports then name as assumed."""
  if device is None:
    return DEFAULT_DEVICE, True
  get_profile(device)  # an unknown name fails here, with the choices
  return device, False
