"""Evaluation: what a plan does to a step, in memory and in time.

Everything a planner, the fit loop and the report need to judge a plan
stands here, below the planners: :func:`evaluate` (plan -> schedule and
memory model), :class:`Candidate` (a plan with what it does), the
untransformed step, the analyses every planner reads (rebuildable
residuals, values XLA fuses) and the timing of copies back
(:func:`prefetch_point`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Iterator

from jaxmem._decisions import Keep, Plan
from jaxmem.targets._profiles import DeviceProfile
from jaxmem.graph._graph import Graph, Residual, analysis
from jaxmem.graph._primitives import rebuildable
from jaxmem.graph._state import hosted_state, optimizer_state, with_hosted
from jaxmem.cost._memory import Liveness, floor, simulate
from jaxmem.cost._perf import schedule_costs
from jaxmem.schedule._loop_schedule import apply_in_loops, split_plan
from jaxmem.schedule._schedule import Schedule, build_schedule


class Details:
  """What a planner reports beyond its plan (the LGM planner: its layers,
  peaks and the vTensors that cover them)."""

  def table(self, top: int | None = None) -> str:
    """A readable table for :meth:`jaxmem.Fit.report`, its first ``top``
    rows (all for None)."""
    raise NotImplementedError

  def rows(self) -> list[dict]:
    """The same as plain records, for JSON."""
    raise NotImplementedError


def clipped(rows: list[str], top: int | None, what: str = "more") -> list[str]:
  """The first ``top`` of a table's ``rows`` (all for None), and a line
  that counts the rest."""
  if top is None or len(rows) <= top:
    return rows
  return rows[:top] + [f"... and {len(rows) - top} {what} (report(top=None) lists all)"]


@dataclasses.dataclass
class Candidate:
  """A plan with the schedule and memory model it produces.

  Attributes:
    plan: the decisions.
    schedule: the rewritten step.
    memory: the memory model's prediction for ``schedule``.
    aim: the peak the planner aimed at, in model bytes.
    fits: whether ``memory.peak <= aim``.
    seconds: planning time.
    steps: number of greedy choices made.
    details: what the planner reports beyond the plan, or None.
    written: whether it is the step as written (:func:`unplanned`, its
      graph keeping no state in host memory), which
      runs unchanged whatever its schedule holds for the model (kernel
      gradients' inputs pinned where the model emulates XLA:CPU).
  """
  plan: Plan
  schedule: Schedule
  memory: Liveness
  aim: int
  fits: bool
  seconds: float = 0.0
  steps: int = 0
  details: Details | None = None
  written: bool = False

  @property
  def peak(self) -> int:
    return self.memory.peak

  @property
  def uses_host(self) -> bool:
    """Whether the step puts anything in host memory: the plan's offloads,
    or optimizer state its graph keeps there (``graph._state``)."""
    return self.plan.uses_host or bool(self.schedule.graph.hosted)

  @property
  def changes_step(self) -> bool:
    """Whether the step differs from the step as written: a plan with
    decisions, state kept in host memory, or backward reads separated
    from the forward pass (the schedule of an empty plan a planner starts
    from, :func:`unplanned_liveness`: on XLA:GPU, a padded copy that the
    forward and backward convolutions share as written is then made again
    for the backward pass, and the forward pass's copy dies with it)."""
    if self.written:
      return False
    return (bool(len(self.plan)) or bool(self.schedule.graph.hosted)
            or any(op.kind != "node" for op in self.schedule.ops))

  def __repr__(self) -> str:
    mib = lambda n: f"{n / 2**20:.2f} MiB"
    return (f"Candidate({self.plan!r}, model peak {mib(self.peak)}, aim {mib(self.aim)}, "
            f"fits={self.fits})")

  def aimed(self, aim: int) -> "Candidate":
    """This candidate judged against ``aim``."""
    return dataclasses.replace(self, aim=aim, fits=self.peak <= aim)


def evaluate(graph: Graph, plan: Plan) -> tuple[Schedule, Liveness]:
  """Builds and simulates the schedule of ``plan``."""
  if all(isinstance(d, Keep) for _, d in plan):
    memory = unplanned_liveness(graph)  # the untransformed step, cached
    return memory.schedule, memory
  inner, in_loops = split_plan(graph, plan)
  schedule = build_schedule(graph, inner, fused_values(graph))
  if in_loops:
    schedule = apply_in_loops(schedule, in_loops, plan)
  return schedule, simulate(schedule)


def candidate(graph: Graph, plan: Plan, aim: int = 0) -> Candidate:
  """``plan`` evaluated and judged against ``aim``."""
  schedule, memory = evaluate(graph, plan)
  return Candidate(plan, schedule, memory, aim, memory.peak <= aim)


def unplanned(graph: Graph, aim: int) -> Candidate:
  """The untransformed step as a :class:`Candidate` (every residual kept,
  no backward read separated: the step as written), judged against
  ``aim``."""
  schedule, memory = _as_written(graph)
  # With optimizer state kept in host memory (``graph.hosted``) it is not
  # the step as written.
  return Candidate(Plan(), schedule, memory, aim, memory.peak <= aim,
                   written=not graph.hosted)


@analysis
def _as_written(graph: Graph) -> tuple[Schedule, Liveness]:
  """The schedule of the step as written and its memory model, once per graph."""
  schedule = build_schedule(graph, Plan(), fused_values(graph), separate=False)
  return schedule, simulate(schedule)


@analysis
def unplanned_liveness(graph: Graph) -> Liveness:
  """The memory model of the plan that keeps every residual: the planners'
  starting point (backward reads separated as in every planned step;
  :func:`unplanned` gives the step as written)."""
  return simulate(build_schedule(graph, Plan()))


@analysis
def model_floor(graph: Graph) -> int:
  """The least model peak a plan of ``graph`` may have (:func:`floor`): a
  search for less is over before it starts."""
  return floor(unplanned_liveness(graph).schedule)


@analysis
def fused_values(graph: Graph) -> dict:
  """Values XLA computes inside their readers in the untransformed step:
  value id -> ids of the buffers it is computed from.

  Recomputation must not read the forward ones (that would give one a
  buffer of its own); it reads the buffers they are computed from instead.
  The schedule builder does not anchor barriers on the backward ones, for
  the same reason.
  """
  memory = unplanned_liveness(graph)
  return {k[0]: tuple(b[0] for b in memory.fused_reads.get(k, ()))
          for k in memory.fused if k[1] == 0}


@analysis
def recomputable(graph: Graph) -> dict[int, Residual]:
  """Residuals whose whole rebuild chain is pure and that are not outputs.

  The chain of a residual runs back through forward intermediates to other
  residuals and step inputs; any equation with effects on it, or a
  collective other than a gather, rules it out.
  """
  ok = {}
  for r in graph.residuals:
    if r.value in graph.output_ids or not r.recomputable:
      continue
    stack, seen, pure = list(r.needs), set(), True
    while stack and pure:
      vid = stack.pop()
      if vid in seen or not graph.is_forward_value(vid):
        continue
      seen.add(vid)
      if graph.is_residual(vid):
        continue  # another residual: its own entry decides
      node = graph.producer(vid)
      pure = not node.effects and rebuildable(node.prim.name)
      stack.extend(a for a in node.ins if isinstance(a, int))
    if pure:
      ok[r.value] = r
  return ok


def chain_flops(graph: Graph, vid: int, dropped) -> float:
  """FLOPs to rebuild ``vid`` from kept values (rough; for ranking only)."""
  total, stack, seen = 0.0, [vid], set()
  while stack:
    v = stack.pop()
    if v in seen or not graph.is_forward_value(v):
      continue
    seen.add(v)
    if v != vid and graph.is_residual(v) and v not in dropped:
      continue  # a kept residual
    node = graph.producer(v)
    total += node.flops
    stack.extend(a for a in node.ins if isinstance(a, int))
  return total


def prefetch_point(schedule: Schedule, value: int, nbytes: int, profile: DeviceProfile,
                   costs: list | None = None, after: int = -1, late: bool = False,
                   queue: bool = False) -> int | None:
  """The latest backward node before ``value`` (an offloaded residual, or
  optimizer state kept on the host) is first needed in the backward pass
  (:func:`first_backward_need`: its reader, or a recomputation that reads
  it) such that the compute in between, as ``profile`` times it, covers
  the copy back of ``nbytes`` (a vTensor's chunks queue on one link, so a
  later chunk passes the bytes of those before it too): the copy is then
  ready when needed.

  With ``queue``, copies back already issued in between are ahead of it on
  the link, so the compute must cover theirs too (an earlier point: the
  copy is ready, but it holds device memory longer). If no node covers it,
  the earliest backward node, or with ``late`` the node where it is needed
  (the copy stalls the step but holds the device buffer for the least
  time). With ``after``, no node at or before that schedule position: a
  copy that frees memory at a peak must not come back before it. Where the
  target's compiler waits for each copy (``profile.copies_wait``), the copy
  stalls the step wherever it is issued: the node where it is needed.
  """
  graph = schedule.graph
  ops = schedule.ops
  first = first_backward_need(schedule, value)
  if first is None:
    return None
  # The backward node whose turn emits the op at ``first``.
  reader = next(op.node for op in ops[first:] if op.kind == "node")
  if profile.copies_wait:
    return reader
  need = profile.transfer_seconds(nbytes, "h2d")
  costs = schedule_costs(schedule) if costs is None else costs
  covered, at = 0.0, reader
  for pos in range(first - 1, after, -1):
    op = ops[pos]
    if op.kind == "node" and not graph.nodes[op.node].backward:
      break
    covered += costs[pos].seconds(profile)
    if queue and op.kind == "prefetch":  # issued in between: ahead on the link
      need += profile.transfer_seconds(schedule.nbytes(op.outs[0]), "h2d")
    if op.kind == "node":
      at = op.node
      if covered >= need:
        return at
  return reader if late else at


def state_fetch_points(graph: Graph, profile: DeviceProfile) -> dict[int, int]:
  """Optimizer state ``graph`` keeps on the host -> the backward node before
  which its copy to the device is issued, so that the compute before its
  update covers the copy (:func:`prefetch_point`, copies queued on the
  link, over the step with every residual kept)."""
  schedule = evaluate(graph, Plan())[0]
  costs = schedule_costs(schedule)
  points = {}
  for leaf in hosted_state(graph):
    at = prefetch_point(schedule, leaf.value, leaf.nbytes, profile, costs, queue=True)
    if at is not None:
      points[leaf.value] = at
  return points


def first_backward_need(schedule: Schedule, vid: int) -> int | None:
  """The schedule position of the first backward op that needs ``vid``: a
  backward equation reading it, a recomputation reading it (a dropped value
  rebuilt from it, which comes before the residual's own first backward
  reader) or making it, or the merge of its chunks."""
  graph = schedule.graph
  for pos, op in enumerate(schedule.ops):
    if op.kind == "node" and not graph.nodes[op.node].backward:
      continue
    if op.kind in ("node", "recompute", "merge") and any(
        isinstance(k, tuple) and k[0] == vid for k in op.ins + op.outs):
      return pos
  return None


@contextlib.contextmanager
def paused_gc():
  """Pauses Python's cyclic garbage collector: a planner's search allocates
  many short-lived schedules, none in cycles, and collections scanning the
  step's traced jaxpr took up to half of a run's time."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


@analysis
def with_state_hosted(graph: Graph, profile: DeviceProfile | None,
                      masters: bool = True) -> Graph | None:
  """``graph`` with its optimizer state kept on the host between steps (its
  master weights too, with ``masters``), each leaf fetched in time on
  ``profile`` (:func:`state_fetch_points`; before its first reader without
  one); None where it has none. One graph per ``graph``, ``profile`` and
  ``masters`` (arguments after the graph are positional)."""
  state = [leaf.value for leaf in optimizer_state(graph) if masters or not leaf.master]
  if not state:
    return None
  hosted = with_hosted(graph, state)
  return hosted if profile is None else with_hosted(graph, state,
                                                    state_fetch_points(hosted, profile))


def state_hosted_tiers(graph: Graph, profile: DeviceProfile | None) -> Iterator[Graph]:
  """The graphs a fit tries in turn where no plan fits with its state on
  the device, each built only when asked for: the optimizer state alone in
  host memory, then with the master weights (``graph._state``) too, whose
  copies in for the forward pass cost link time the state's alone does
  not. A step with only one kind gives one graph."""
  state = optimizer_state(graph)
  if any(not leaf.master for leaf in state):
    yield with_state_hosted(graph, profile, False)
  if any(leaf.master for leaf in state):
    yield with_state_hosted(graph, profile, True)
