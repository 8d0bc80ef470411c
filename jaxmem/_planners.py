"""Planners: choose a decision per residual so the predicted peak fits.

Every planner has the same small interface, ``plan(graph, target) ->
PlanResult``, and is registered by name in :data:`PLANNERS` so the public
transform and the benchmark CLI can select it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from typing import Callable, Protocol

from jaxmem._graph import Graph, Residual
from jaxmem._memory import MemoryProfile, fused_values, simulate, unplanned_profile
from jaxmem._devices import PROFILES, get_profile
from jaxmem._perf import predict_schedule, schedule_costs
from jaxmem._plan import KEEP, RECOMPUTE, SAVE, Keep, Offload, Plan
from jaxmem._rewrite import Schedule, build_schedule


# Each greedy step at DEBUG level: logging.getLogger("jaxmem").setLevel("DEBUG").
_log = logging.getLogger("jaxmem")


@dataclasses.dataclass
class PlanResult:
  """A plan with the schedule and memory profile it produces.

  Attributes:
    plan: the decisions.
    schedule: the rewritten step.
    profile: the memory model's prediction for ``schedule``.
    target: the peak the planner aimed at, in model bytes.
    fits: whether ``profile.peak <= target``.
    seconds: planning time.
    steps: number of greedy choices made.
    details: what a planner reports beyond the plan (the LGM planner: its
      layers, peaks and the vTensors that cover them), or None.
  """
  plan: Plan
  schedule: Schedule
  profile: MemoryProfile
  target: int
  fits: bool
  seconds: float
  steps: int
  details: object = None

  @property
  def peak(self) -> int:
    return self.profile.peak


class Planner(Protocol):
  """What every planner provides."""
  name: str

  def plan(self, graph: Graph, target: int, start: Plan | None = None) -> PlanResult:
    ...


def evaluate(graph: Graph, plan: Plan) -> tuple[Schedule, MemoryProfile]:
  """Builds and simulates the schedule of ``plan``."""
  if all(isinstance(d, Keep) for _, d in plan):
    profile = unplanned_profile(graph)  # the untransformed step, cached
    return profile.schedule, profile
  schedule = build_schedule(graph, plan, fused_values(graph))
  return schedule, simulate(schedule)


def unplanned(graph: Graph, target: int) -> PlanResult:
  """The untransformed step as a :class:`PlanResult` (every residual kept,
  no backward read separated: the step as written)."""
  schedule = build_schedule(graph, Plan(), fused_values(graph), separate=False)
  profile = simulate(schedule)
  return PlanResult(Plan(), schedule, profile, target, profile.peak <= target, 0.0, 0)


def recomputable(graph: Graph) -> dict[int, Residual]:
  """Residuals whose whole rebuild chain is pure and that are not outputs.

  The chain of a residual runs back through forward intermediates to other
  residuals and step inputs; any equation with effects on it rules it out.
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
      if vid in graph._by_value:
        continue  # another residual: its own entry decides
      node = graph.nodes[graph.values[vid].producer]
      pure = not node.effects
      stack.extend(a for a in node.ins if isinstance(a, int))
    if pure:
      ok[r.value] = r
  return ok


@dataclasses.dataclass
class RecomputeGreedy:
  """Recompute-only planner (Libra's memory-reduction estimation, greedy).

  Each step looks at the current peak, takes the kept residuals that are live
  there and not read again until the backward pass, ranks them by bytes per
  FLOP of their rebuild chain, simulates the best ``evaluations`` of them
  exactly (a chain can add a new peak in the backward pass; the peak can
  move), and drops the one that lowers the peak most per added FLOP. When a
  recompute segment has itself become the peak, keeping one of its residuals
  again is tried as well (Libra's greedy refinement). It stops
  when the peak fits ``target`` or nothing lowers it further; the result is
  then the lowest peak reached.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem._graph import build_graph
    >>> def step(w, x):
    ...   def f(w):
    ...     h = x
    ...     for _ in range(8):
    ...       h = h + jnp.tanh(h @ w)
    ...     return jnp.sum(h)
    ...   return jax.grad(f)(w)
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.eye(64), jnp.ones((256, 64))))
    >>> result = RecomputeGreedy().plan(g, target=0)
    >>> result.peak < evaluate(g, Plan())[1].peak
    True
  """
  name: str = "recompute"
  evaluations: int = 4
  batches: int = 3

  # Greedy choices depend on the aim (the plateau objective is the time spent
  # above it), and a run aimed at the target can stall just above it while
  # one aimed lower passes it: after the target, aim at these fractions of
  # the unconstrained peak, then at 0, until a plan fits. Asked for the
  # lowest peak (target 0), every aim is tried.
  aims: tuple = (0.85, 0.7, 0.5, 0.3)
  # Bulk moves (``_bulk``): shares of the bytes above the aim to drop at once.
  bulk: tuple = (0.25, 0.5)
  bulk_above: float = 0.5
  # Evaluations the refinement of a fitting plan may spend (``_refine``).
  refine: int = 24
  # Which moves a step may take, and what a plan costs: without a device
  # profile, recomputed FLOPs; with one (a name in jaxmem.PROFILES or a
  # DeviceProfile), the predicted step time. Offload needs a profile (it is
  # never chosen on a unified-memory one); host_budget caps pinned host bytes.
  recompute: bool = True
  offload: bool = False
  profile: object = None
  host_budget: int | None = None

  def __post_init__(self):
    if self.offload and self.profile is None:
      raise ValueError(f"planner {self.name!r}: offload needs a device profile to time "
                       f"copies; got profile=None, expected a name in {sorted(PROFILES)} "
                       "or a DeviceProfile (jaxmem.calibrate())")
    if not (self.offload or self.recompute):
      raise ValueError(f"planner {self.name!r}: expected recompute or offload moves, "
                       "got neither")

  def plan(self, graph: Graph, target: int, start: Plan | None = None) -> PlanResult:
    """Plans ``graph`` toward ``target`` bytes, from ``start`` if given (a
    plan for a looser target: tightening it is cheaper than starting over)."""
    began = time.perf_counter()
    candidates = recomputable(graph)
    best = None
    if target > 0:
      best = self._greedy(graph, target, target, candidates, start or Plan())
    if best is None or not best.fits:
      # Every block checkpointed costs one evaluation: where that fits, the
      # refinement below gives back the recomputation the target does not
      # need, and the ladder is not climbed.
      fitting = [r for r in self._block_results(graph, candidates) if r.peak <= target]
      if fitting:
        best = dataclasses.replace(min(fitting, key=lambda r: self._cost(r.schedule)),
                                   target=target, fits=True)
    if best is None or not best.fits:
      # The ladder, always the same aims: when nothing fits, its best is
      # the lowest plan of this graph whatever the target, so the smallest
      # footprint named in an error is met when asked for.
      best = None
      for result in self._ladder(graph, target, candidates):
        if best is None or result.peak < best.peak:
          best = result
        if best.fits:
          break
    if best.fits and self.recompute:
      with _paused_gc():
        best = self._refine(graph, best, target)
    best.seconds = time.perf_counter() - began
    return best

  def _refine(self, graph, result: PlanResult, target: int) -> PlanResult:
    """Libra's greedy refinement of a plan that fits: recomputed residuals
    are kept again wherever the peak stays within ``target``, whole blocks
    first, then one by one, the costliest rebuilds per byte first (matmul
    and convolution outputs before elementwise ones), within ``refine``
    evaluations. A plan that overshot (a ladder or block plan taken for a
    looser target) gives back the recomputation it does not need."""
    plan, schedule, profile = result.plan, result.schedule, result.profile
    dropped = plan.values_with("recompute")
    blocks = [[v for v in seg.drops if v in dropped] for seg in segments(graph)]
    costly = sorted(dropped, key=lambda v: (-graph.nodes[graph.values[v].producer].flops
                                             / max(graph.values[v].nbytes, 1), v))
    tries = 0
    for group in [b for b in blocks if b] + [[v] for v in costly]:
      if tries >= self.refine:
        break
      group = [v for v in group if plan[v].kind == "recompute"]
      if not group:
        continue
      tries += 1
      trial = plan
      for vid in group:
        trial = trial.with_decision(vid, KEEP)
      t_schedule, t_profile = evaluate(graph, trial)
      if t_profile.peak <= target:
        plan, schedule, profile = trial, t_schedule, t_profile
    return dataclasses.replace(result, plan=plan, schedule=schedule, profile=profile)

  def lowest(self, graph: Graph) -> list[PlanResult]:
    """The ladder's plans, lowest predicted peak first: the candidates for
    the smallest footprint (the model ranks them only within a few percent,
    so the caller may measure each)."""
    began = time.perf_counter()
    results = sorted(self._ladder(graph, 0, recomputable(graph)),
                     key=lambda r: r.peak)
    for result in results:
      result.seconds = time.perf_counter() - began
    return results

  def _ladder(self, graph, target, candidates):
    """Greedy runs toward each aim of ``aims``, then 0, each from the plan
    the one before reached (the first from an empty plan), so the ladder
    costs about one descent to the lowest peak; each run is kept with the
    graph (it does not depend on ``target``), so :meth:`lowest` after a
    failed :meth:`plan` costs nothing more."""
    base = evaluate(graph, Plan())[1].peak
    runs = graph.derived.setdefault(
        ("ladder", self.aims, self.evaluations, self.batches, self.bulk, self.bulk_above,
         self.recompute, self.offload, self.profile, self.host_budget), {})
    plan = Plan()
    for fraction in (*self.aims, 0):
      if fraction not in runs:
        runs[fraction] = self._greedy(graph, 0, int(base * fraction), candidates, plan)
      result = runs[fraction]
      plan = result.plan
      yield dataclasses.replace(result, target=target, fits=result.peak <= target)
    # Then every block checkpointed (the plan XLA follows best), and the
    # greedy's descent from there (run only when asked for; not from the
    # plans that keep matmul outputs, which start higher).
    descend = len(block_plans(graph, candidates))
    for i, result in enumerate(self._block_results(graph, candidates)):
      yield dataclasses.replace(result, target=target, fits=result.peak <= target)
      if i >= descend:
        continue
      if ("blocks", i, 0) not in runs:
        runs["blocks", i, 0] = self._greedy(graph, 0, 0, candidates, result.plan)
      result = runs["blocks", i, 0]
      yield dataclasses.replace(result, target=target, fits=result.peak <= target)

  def _block_results(self, graph, candidates=None) -> list[PlanResult]:
    """The every-block-checkpointed plans (:func:`block_plans`: everything
    recomputed, then matmul outputs kept), evaluated once per graph; none
    for a planner that may not recompute."""
    if not self.recompute:
      return []
    key = ("block plans",)
    if key not in graph.derived:
      plans = block_plans(graph, candidates) + block_plans(graph, candidates, MATMULS)
      graph.derived[key] = [PlanResult(plan, *evaluate(graph, plan), 0, False, 0.0, 0)
                            for plan in plans]
    return graph.derived[key]

  def structured(self, graph: Graph) -> list[PlanResult]:
    """Plans shaped like the per-block remat baselines (every block
    checkpointed; matmul outputs kept or not), cheapest first: XLA follows
    them closely, so the transform measures them against the plan it has."""
    return sorted(self._block_results(graph), key=lambda r: self._cost(r.schedule))

  def _greedy(self, graph, target, aim, candidates, plan) -> PlanResult:
    """One greedy run from ``plan`` toward ``aim``; fits is judged against
    ``target``."""
    with _paused_gc():
      return self._descend(graph, target, aim, candidates, plan)

  def _descend(self, graph, target, aim, candidates, plan) -> PlanResult:
    schedule, profile = evaluate(graph, plan)
    best = (profile.peak, plan, schedule, profile)
    steps = 0
    while profile.peak > aim:
      ranked = self._rank(graph, plan, profile, candidates)
      base = (profile.peak, profile.excess(aim), self._cost(schedule))
      choice = None
      for moves in self._batches(graph, plan, schedule, profile, ranked, aim, candidates):
        for move in moves:
          trial = plan
          for vid, decision in move:
            trial = trial.with_decision(vid, decision)
          t_schedule, t_profile = evaluate(graph, trial)
          if self.host_budget is not None and t_profile.host_peak > self.host_budget:
            continue
          gain_peak = base[0] - t_profile.peak
          gain_excess = base[1] - t_profile.excess(aim)
          cost = max(self._cost(t_schedule) - base[2], 0.0) + 1.0
          # Lower peak first; at a plateau, less time above the target.
          score = (gain_peak / cost if gain_peak > 0 else 0.0,
                   gain_excess / cost if gain_peak >= 0 and gain_excess > 0 else 0.0)
          if score > (0.0, 0.0) and (choice is None or score > choice[0]):
            choice = (score, trial, t_schedule, t_profile)
        if choice is not None:
          break
      if choice is None:
        break
      _, plan, schedule, profile = choice
      _log.debug("greedy step %d: peak %d (aim %d), %d decisions, %d saves, peak at %s",
                 steps, profile.peak, aim, len(plan), len(plan.values_with("save")),
                 profile.peak_name)
      steps += 1
      if profile.peak < best[0]:
        best = (profile.peak, plan, schedule, profile)
    peak, plan, schedule, profile = best
    return PlanResult(plan, schedule, profile, target, peak <= target, 0.0, steps)

  def _batches(self, graph, plan, schedule, profile, ranked, aim, candidates):
    """The moves of one greedy step, in batches tried until one helps:
    the best-ranked candidates with the undo and bulk moves, then the next
    ranked ones (the cheapest rebuilds can be the ones that make a new
    peak), and last the block moves (``_segment_moves``), for where single
    drops no longer lower the peak: a block checkpointed at its boundary
    stops recomputation from running back through earlier blocks."""
    undo = [[(r.value, KEEP)] for r in self._undo(graph, plan, profile)]
    bulk = [move for group in self._bulk(ranked, profile.peak - aim, profile.peak)
            if (move := self._bulk_move(graph, schedule, group))]
    groups = [group for group, _ in ranked]
    for batch in range(self.batches):
      moves = [move for group in groups[batch * self.evaluations:
                                         (batch + 1) * self.evaluations]
               for move in self._moves(graph, schedule, group)]
      if batch == 0:
        moves += undo + bulk
      if not moves:
        break
      yield moves
    if self.recompute:
      yield self._segment_moves(graph, plan, profile, candidates)

  def _cost(self, schedule) -> float:
    """What a plan costs: FLOPs recomputed, or with a device profile the
    predicted step time (copies and stalls included) in FLOPs of that
    device."""
    if self.profile is None:
      return schedule.recompute_flops
    profile = get_profile(self.profile)
    return predict_schedule(schedule, profile).seconds * profile.flops

  def _bulk_move(self, graph, schedule, residuals) -> list[tuple]:
    """One move taking many residuals off: rebuilt where the planner may
    recompute, else each one that may be offloaded."""
    if self.recompute:
      return [(r.value, RECOMPUTE) for r in residuals]
    return [move[0] for r in residuals for move in self._moves(graph, schedule, [r])]

  def _moves(self, graph, schedule, group) -> list[list[tuple]]:
    """The ways to take ``group`` off the device at the peak: rebuild it
    (``recompute``), or copy it to the host (``offload``, a lone residual
    with a buffer of its own, on a device whose memory is not the host's),
    copied back early enough to hide the copy under compute."""
    moves = []
    if self.recompute:
      moves.append([(r.value, RECOMPUTE) for r in group])
    if self.offload and len(group) == 1 and group[0].value not in fused_values(graph):
      profile = get_profile(self.profile)
      if not profile.unified:
        r = group[0]
        moves.append([(r.value, Offload(at=_prefetch_point(schedule, r, profile)))])
    return moves

  def _bulk(self, ranked, deficit: int, peak: int) -> list[list[Residual]]:
    """Moves that drop several ranked groups at once, far from the aim (more
    than ``bulk_above`` of the peak above it): the best-ranked groups
    covering a share (``bulk``) of the bytes still above it. They are scored
    like single drops, so one is taken only where it lowers the peak as much
    per added FLOP; it saves the steps a long descent would take one group at
    a time. (Nearer the aim they cost quality: on a residual MLP at 60%, bulk
    moves all the way ended at 62% where single drops reach 58%.)"""
    moves = []
    if deficit <= self.bulk_above * peak:
      return moves
    for share in self.bulk:
      move, covered = [], 0
      for group, nbytes in ranked:
        if covered + nbytes > deficit * share:
          break
        move += group
        covered += nbytes
      if len(move) > 1 and (not moves or len(move) > len(moves[-1])):
        moves.append(move)
    return moves

  def _segment_moves(self, graph, plan, profile, candidates) -> list[list[tuple]]:
    """Block moves: checkpoint a whole module block at once (see
    :func:`segments`), for the ``evaluations`` blocks whose residuals free
    the most bytes at the peak per FLOP of the block.

    The move saves the values the block reads from outside it (its
    boundary; a dropped residual there is kept again) and drops the
    residuals made and used inside it, as per-block ``jax.checkpoint``
    does: recomputation then starts at the boundary instead of running
    back through earlier blocks.
    """
    decisions = plan.as_dict()
    live = {k[0] for k in profile.live_at_peak if k[1] == 0}
    # Rebuilt copies at the peak: a recomputation running back through
    # earlier blocks (their boundaries not saved) may be what peaks.
    rebuilt = sum(graph.values[k[0]].nbytes for k in profile.live_at_peak if k[1] > 0)
    ranked = []
    for seg in segments(graph, candidates):
      todo = [v for v in seg.drops if v not in decisions]
      move = _checkpoint(graph, seg, decisions)
      freed = sum(graph.values[v].nbytes for v in todo if v in live)
      if len(move) > len(todo) and len(todo) < len(seg.drops):
        freed += rebuilt  # some dropped already: saving the boundary may cut a chain
      if freed:
        ranked.append((freed / (seg.flops + 1.0), move))
    ranked.sort(key=lambda item: -item[0])
    return [move for _, move in ranked[:self.evaluations]]

  def _undo(self, graph, plan, profile) -> list[Residual]:
    """Dropped residuals whose rebuilt copy is live at the peak.

    Keeping one again splits a recompute segment that became the peak.
    """
    dropped = plan.values_with("recompute") | plan.values_with("offload")
    live = [k for k in profile.live_at_peak if k[1] > 0 and k[0] in dropped]
    live.sort(key=lambda k: -graph.values[k[0]].nbytes)
    return [graph.residual(k[0]) for k in live[:max(1, self.evaluations // 2)]]

  @staticmethod
  def _rank(graph, plan, profile, candidates) -> list[tuple[list[Residual], int]]:
    """Candidate groups with the bytes they free, best bytes-per-FLOP first.

    A group is a residual plus the kept residuals fused onto its buffer
    (``1 - tanh(x)**2`` read in the backward pass keeps ``tanh(x)`` alive
    there): dropping one without the others frees nothing.
    """
    dropped = plan.values_with("recompute")
    moved = dropped | plan.values_with("offload")
    live = set(profile.live_at_peak)
    riders: dict = {}
    # The rewrite reads a kept fused residual's buffers for it (directly, or
    # through a copy it rebuilds in the backward pass), so those stay.
    for vid, bufs in fused_values(graph).items():
      if vid in candidates and vid not in moved:
        for buf in bufs:
          riders.setdefault((buf, 0), []).append(candidates[vid])
    ops = profile.schedule.ops
    ranked = []
    for buf in live:
      own = [candidates[buf[0]]] if (
          buf[1] == 0 and buf[0] in candidates and buf[0] not in moved) else []
      group = own + riders.get(buf, [])
      if not group:
        continue
      later = [p for p in profile.reads.get(buf, []) if p > profile.peak_op]
      if any(ops[p].kind == "node" and not graph.nodes[ops[p].node].backward
             for p in later):
        continue  # still read by the forward pass after the peak
      flops = sum(_chain_flops(graph, g.value, dropped) for g in group)
      nbytes = graph.values[buf[0]].nbytes
      ranked.append((nbytes / (flops + 1.0), group, nbytes))
    ranked.sort(key=lambda item: -item[0])
    return [(group, nbytes) for _, group, nbytes in ranked]


@dataclasses.dataclass(frozen=True)
class Segment:
  """A module block that a planner can checkpoint in one move.

  Attributes:
    name: the block's module path (``GPT2/block0``).
    drops: recomputable residuals made in the block and read by no forward
      equation outside it.
    saves: forward values made outside the block that it reads: where its
      recomputation starts.
    flops: FLOPs of the block's forward equations.
  """
  name: str
  drops: tuple
  saves: tuple
  flops: float


def segments(graph: Graph, candidates: dict | None = None,
             depths: tuple = (2, 3)) -> list[Segment]:
  """The blocks of ``graph`` at module depths ``depths`` that hold residuals
  to drop (duplicates of a shallower block left out); computed once per
  graph.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return x + nn.Dense(8)(jnp.tanh(nn.Dense(8)(x)))
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     h = Block()(x)
    ...     return jnp.sum(Block()(h) ** 2)
    >>> from jaxmem._graph import build_graph
    >>> net, x = Net(), jnp.ones((4, 8))
    >>> p = net.init(jax.random.key(0), x)
    >>> g = build_graph(jax.make_jaxpr(jax.grad(lambda p: net.apply(p, x)))(p))
    >>> [(s.name, len(s.drops), len(s.saves)) for s in segments(g)]
    [('Net/Block_0', 2, 0), ('Net/Block_1', 2, 1)]
  """
  key = ("segments", depths)
  if key in graph.derived:
    return graph.derived[key]
  if candidates is None:
    candidates = recomputable(graph)
  found, seen = [], set()
  for depth in depths:
    for name, nodes in graph.blocks(depth).items():
      inside = set(nodes)
      drops = tuple(r.value for r in graph.residuals
                    if r.produced_at in inside and r.value in candidates
                    and all(u in inside for u in graph.values[r.value].uses
                            if not graph.nodes[u].backward))
      saves = tuple(sorted({a for i in nodes for a in graph.nodes[i].ins
                            if isinstance(a, int) and graph.is_forward_value(a)
                            and graph.values[a].producer not in inside}))
      if drops and (drops, saves) not in seen:
        seen.add((drops, saves))
        found.append(Segment(name, drops, saves,
                             sum(graph.nodes[i].flops for i in nodes)))
  graph.derived[key] = found
  return found


def _checkpoint(graph: Graph, seg: Segment, decisions: dict) -> list[tuple]:
  """The decisions that checkpoint ``seg`` on top of ``decisions``: its
  residuals recomputed, its boundary saved (a dropped residual there kept
  again)."""
  move = [(v, RECOMPUTE) for v in seg.drops if v not in decisions]
  for v in seg.saves:
    if v not in graph._by_value:
      if v not in decisions:
        move.append((v, SAVE))
    elif decisions.get(v, KEEP).kind == "recompute":
      move.append((v, KEEP))
  return move


# Primitives whose outputs a dots_saveable-like block plan keeps.
MATMULS = frozenset({"dot_general", "conv_general_dilated"})


def block_plans(graph: Graph, candidates: dict | None = None,
                keep: frozenset = frozenset()) -> list[Plan]:
  """Every block checkpointed, at module depth 2 and at depth 3: the plans
  per-block ``jax.checkpoint`` with ``nothing_saveable`` would give (with
  ``keep=MATMULS``, ``dots_saveable``'s: matmul and convolution outputs
  kept), as starting points and as candidates for the lowest footprint
  (XLA follows them closely: recomputation starts at saved block
  boundaries)."""
  plans = []
  for depth in (2, 3):
    decisions: dict = {}
    for seg in segments(graph, candidates, depths=(depth,)):
      decisions.update(_checkpoint(graph, seg, decisions))
      for index in graph.blocks(depth)[seg.name]:
        node = graph.nodes[index]
        if node.prim.name in keep:  # kept: a residual, or saved for rebuilding
          for vid in node.outs:
            if vid in graph._by_value:
              decisions.pop(vid, None)
            else:
              decisions[vid] = SAVE
    if any(d.kind == "recompute" for d in decisions.values()) and \
        Plan.of(decisions) not in plans:
      plans.append(Plan.of(decisions))
  return plans


def _prefetch_point(schedule, residual: Residual, profile, nbytes: int | None = None,
                    costs: list | None = None, after: int = -1,
                    late: bool = False, queue: bool = False) -> int | None:
  """The latest backward node before ``residual`` is first needed in the
  backward pass (:func:`_first_backward_need`: its reader, or a
  recomputation that reads it) such that the predicted compute in between covers the copy back of
  ``nbytes`` (the residual's by default; a vTensor's chunks queue on one
  link, so a later chunk passes the bytes of those before it too): the copy
  is then ready when needed. With ``queue``, copies back already issued in
  between are ahead of it on the link, so the compute must cover theirs
  too (an earlier point: the copy is ready, but it holds device memory
  longer). If none does, the earliest backward node, or
  with ``late`` the node where it is needed (the copy stalls the step but holds the
  device buffer for the least time). With ``after``, no node at or before
  that schedule position: a copy that frees memory at a peak must not come
  back before it."""
  graph = schedule.graph
  need = profile.transfer_seconds(residual.nbytes if nbytes is None else nbytes, "h2d")
  costs = schedule_costs(schedule) if costs is None else costs
  ops = schedule.ops
  first = _first_backward_need(schedule, residual.value)
  if first is None:
    return None
  # The backward node whose turn emits the op at ``first``.
  reader = next(op.node for op in ops[first:] if op.kind == "node")
  covered, at = 0.0, reader
  for pos in range(first - 1, after, -1):
    op = ops[pos]
    if op.kind == "node" and not graph.nodes[op.node].backward:
      break
    covered += profile.op_seconds(costs[pos].flops, costs[pos].nbytes)
    if queue and op.kind == "prefetch":  # issued in between: ahead on the link
      need += profile.transfer_seconds(schedule.nbytes(op.outs[0]), "h2d")
    if op.kind == "node":
      at = op.node
      if covered >= need:
        return at
  return reader if late else at


def _first_backward_need(schedule, vid: int) -> int | None:
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
def _paused_gc():
  """Pauses Python's cyclic garbage collector: a greedy run allocates many
  short-lived schedules, none in cycles, and collections scanning the
  step's traced jaxpr took up to half of a run's time."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def _chain_flops(graph: Graph, vid: int, dropped) -> float:
  """FLOPs to rebuild ``vid`` from kept values (rough; for ranking only)."""
  total, stack, seen = 0.0, [vid], set()
  while stack:
    v = stack.pop()
    if v in seen or not graph.is_forward_value(v):
      continue
    seen.add(v)
    if v != vid and v in graph._by_value and v not in dropped:
      continue  # a kept residual
    node = graph.nodes[graph.values[v].producer]
    total += node.flops
    stack.extend(a for a in node.ins if isinstance(a, int))
  return total


@dataclasses.dataclass
class Hybrid:
  """Libra's hybrid planner: recompute first, swap where it pays.

  1. The recompute-only greedy plans toward the target, its moves scored
     by predicted step time on ``profile``.
  2. Where that plan does not fit, the greedy goes on from it with offload
     moves as well: each step takes a residual at the peak off the device by
     recomputing or offloading it, whichever lowers the peak most per
     predicted second (an offload whose copy hides under compute costs
     nothing; a slow link makes recomputation win). With ``swap="lgm"``
     the vTensor planner (:class:`~jaxmem._lgm.LGM`) covers what is left
     instead, swapping only the chunks each peak lacks.
  3. Refinement: each recomputed residual, largest first (up to ``swaps``),
     is switched to an offload copied back early enough to hide the copy
     (behind the copies already queued on the link, and ahead of any
     recomputation that reads it), where that lowers the predicted time and
     the plan still fits.

  A unified-memory device never offloads (it frees nothing there);
  ``host_budget`` caps pinned host bytes.

  Example:
    >>> Hybrid("rtx3060").name
    'hybrid'
  """
  profile: object = "t4"
  host_budget: int | None = None
  swaps: int = 32
  swap: str = "greedy"
  name: str = "hybrid"

  def __post_init__(self):
    if self.swap not in ("greedy", "lgm"):
      raise ValueError(f"Hybrid: swap must be 'greedy' or 'lgm', got {self.swap!r}")
    self.alone = RecomputeGreedy(profile=self.profile)
    self.mixed = RecomputeGreedy(name=self.name, offload=True, profile=self.profile,
                                 host_budget=self.host_budget)
    if self.swap == "lgm":
      from jaxmem._lgm import LGM
      self.mixed = LGM(self.profile, host_budget=self.host_budget, name=self.name)

  def plan(self, graph: Graph, target: int, start: Plan | None = None) -> PlanResult:
    """Plans toward ``target`` bytes, from ``start`` if given."""
    began = time.perf_counter()
    kept = None if start is None else Plan.of(
        {**start.with_kind("recompute"), **start.with_kind("save")})
    first = self.alone.plan(graph, target, start=kept)
    results = [first]
    if not first.fits:
      results.append(self.mixed.plan(graph, target, start=first.plan))
    with _paused_gc():
      results = [self._swap(graph, r, target) for r in results]
    best = min(results, key=lambda r: (not r.fits, self.alone._cost(r.schedule)
                                       if r.fits else r.peak))
    best.seconds = time.perf_counter() - began
    return best

  def lowest(self, graph: Graph) -> list[PlanResult]:
    """The candidates for the smallest footprint: both greedy ladders', or
    with ``swap="lgm"`` the recompute ladder's and LGM's swaps on top of its
    lowest plan."""
    alone = self.alone.lowest(graph)
    mixed = (self.mixed.lowest(graph) if self.swap == "greedy"
             else [self.mixed.plan(graph, 0, start=alone[0].plan)])
    return sorted(alone + mixed, key=lambda r: r.peak)

  def _swap(self, graph, result: PlanResult, target: int) -> PlanResult:
    """Refinement 3: recomputed residuals switched to offloads that pay."""
    if get_profile(self.profile).unified:
      return result
    limit = max(target, result.peak)
    plan, schedule, profile = result.plan, result.schedule, result.profile
    cost = self.alone._cost(schedule)
    fused = fused_values(graph)
    chosen = sorted((graph.residual(v) for v in plan.values_with("recompute")
                     if v not in fused), key=lambda r: -r.nbytes)[:self.swaps]
    for r in chosen:
      at = _prefetch_point(schedule, r, get_profile(self.profile), queue=True)
      trial = plan.with_decision(r.value, Offload(at=at))
      t_schedule, t_profile = evaluate(graph, trial)
      if t_profile.peak > limit or (self.host_budget is not None
                                    and t_profile.host_peak > self.host_budget):
        continue
      t_cost = self.alone._cost(t_schedule)
      if t_cost < cost:
        plan, schedule, profile, cost = trial, t_schedule, t_profile, t_cost
    return dataclasses.replace(result, plan=plan, schedule=schedule, profile=profile,
                               fits=profile.peak <= target)


def hybrid(profile="t4", **options) -> Hybrid:
  """The hybrid planner for ``profile`` (see :class:`Hybrid`)."""
  return Hybrid(profile=profile, **options)


def offload_only(profile="t4", **options) -> RecomputeGreedy:
  """Offload-only planner: like :func:`hybrid` with no recomputation."""
  return RecomputeGreedy(name="offload", offload=True, recompute=False,
                         profile=profile, **options)


def lgm(profile="t4", **options):
  """The vTensor planner (:class:`~jaxmem._lgm.LGM`) for ``profile``."""
  from jaxmem._lgm import LGM
  return LGM(profile=profile, **options)


def lgm_whole(profile="t4", **options):
  """Ablation: the LGM planner swapping whole tensors only (no vTensors)."""
  return lgm(profile, whole=True, name="lgm-whole", **options)


def lgm_unreserved(profile="t4", **options):
  """Ablation: the LGM planner with memory reservation off (no chunk floor,
  no headroom)."""
  return lgm(profile, min_chunk=0, reserve=0.0, name="lgm-unreserved", **options)


PLANNERS: dict[str, Callable[[], Planner]] = {
    "recompute": RecomputeGreedy, "hybrid": hybrid, "offload": offload_only,
    "lgm": lgm, "lgm-whole": lgm_whole, "lgm-unreserved": lgm_unreserved}
# Planners that exist to be compared against (left out of default runs).
ABLATIONS = frozenset({"lgm-whole", "lgm-unreserved"})


def get_planner(planner) -> Planner:
  """Returns a planner from a name in :data:`PLANNERS` or a planner object."""
  if isinstance(planner, str):
    if planner not in PLANNERS:
      raise ValueError(
          f"jaxmem: unknown planner {planner!r}; expected one of "
          f"{sorted(PLANNERS)} or an object with .plan(graph, target).")
    return PLANNERS[planner]()
  if not hasattr(planner, "plan"):
    raise TypeError(
        f"jaxmem: planner must be a name in {sorted(PLANNERS)} or an object "
        f"with .plan(graph, target); got {type(planner).__name__}.")
  return planner
