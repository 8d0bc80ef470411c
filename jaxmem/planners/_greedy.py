"""The greedy planner: Libra's memory-reduction estimation and refinement."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

from jaxmem.planners._blocks import KEEPS, block_candidates, block_plans, checkpoint_moves, segments
from jaxmem._decisions import KEEP, OFFLOAD, RECOMPUTE, Offload, Plan
from jaxmem.targets._profiles import PROFILES, get_profile
from jaxmem.cost._evaluate import (Candidate, candidate, evaluate, fused_values, paused_gc,
                              prefetch_point, recomputable)
from jaxmem.graph._graph import Graph, Residual
from jaxmem.schedule._scan_remat import hostable
from jaxmem.planners._base import Planner
from jaxmem.planners._refine import kept_copies, refined as refined_plan
from jaxmem.planners._scores import Baseline, PerGraph, Scores, ranked_groups, scored

# Each greedy step at DEBUG level: logging.getLogger("jaxmem").setLevel("DEBUG").
_log = logging.getLogger("jaxmem")


class _Move(NamedTuple):
  """A move taken on a plan: its score (``Baseline.judged``), the plan, its
  candidate where evaluated now (else None: its score was kept), and its
  model peak."""
  score: tuple
  plan: Plan
  found: Candidate | None
  peak: int


@dataclasses.dataclass
class Greedy(Planner):
  """The greedy planner (Libra's memory-reduction estimation).

  Recompute-only by default (``offload=True`` adds offload moves,
  ``recompute=False`` leaves only those). Each step looks at the current
  peak, takes the kept residuals that are live there and not read again
  until the backward pass, ranks them by bytes per FLOP of their rebuild
  chain (those freeing a sliver of the bytes above the goal last),
  simulates the best ``evaluations`` of them exactly (a chain can add a new
  peak in the backward pass; the peak can move), and drops the one that
  lowers the peak most per added FLOP. When a recompute segment
  has itself become the peak, keeping one of its residuals again is tried
  as well (Libra's greedy refinement). It stops when the peak fits ``aim``
  or nothing lowers it further; the result is then the lowest peak reached.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph._graph import build_graph
    >>> def step(w, x):
    ...   def f(w):
    ...     h = x
    ...     for _ in range(8):
    ...       h = h + jnp.tanh(h @ w)
    ...     return jnp.sum(h)
    ...   return jax.grad(f)(w)
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.eye(64), jnp.ones((256, 64))))
    >>> result = Greedy().plan(g, aim=0)
    >>> result.peak < evaluate(g, Plan())[1].peak
    True
  """
  name: str = "recompute"
  evaluations: int = 4
  batches: int = 3

  # Greedy choices depend on the goal a run descends toward (the plateau
  # objective is the time spent above it), and a run toward the aim can stall
  # just above it while one toward a lower goal passes it: after the aim, run
  # toward these fractions of the unconstrained peak, then toward 0, until a
  # plan fits. Asked for the lowest peak (aim 0), every one is tried.
  aims: tuple = (0.85, 0.7, 0.5, 0.3)
  # Bulk moves (``_bulk``): shares of the bytes above the goal to drop at once.
  bulk: tuple = (0.25, 0.5)
  bulk_above: float = 0.5
  # Moves of one step that lower the peak per added cost within ``tied`` of
  # the best move's are taken together (``_together``), up to ``tied_share``
  # of the bytes above the goal; None takes one a step.
  tied: float | None = 0.01
  tied_share: float = 0.25
  # Evaluations the refinement of a fitting plan may spend (:meth:`refined`).
  refine: int = 24
  # Which moves a step may take, and what a plan costs (``Planner.cost``):
  # without a target, recomputed FLOPs; with one (a name in jaxmem.PROFILES or
  # a DeviceProfile), the predicted step time. Offload needs a target (never
  # chosen on a unified-memory one); host_budget caps pinned host bytes.
  recompute: bool = True
  offload: bool = False
  # What a run from a given start that stalls above the aim goes on to:
  # "ladder", the ladder (runs from nothing) as a run from nothing does;
  # "blocks", the block descents, the lowest of those and the run taken;
  # "none", nothing. From a start, the lowest plans are the ladder's, or the
  # run's and the block descents' ("blocks"), or the run's ("none"). The
  # ladder costs most of a search (330 s of MobileNetV2's first plan for a
  # T4 at 50%): the hybrid's recompute greedy takes "blocks" and its
  # offload greedy, which goes on from that one's plan, "none"; the hybrid
  # climbs the ladder only where offloading from those does not reach.
  climbs: str = "ladder"
  target: object = None
  host_budget: int | None = None
  assumed_target: bool = False
  # Per graph planned: greedy runs (the ladder's, ``descended``), and per
  # start plan the lowest plan a search that found no fit returned (an aim
  # under it fails at once).
  _runs: PerGraph = dataclasses.field(default_factory=PerGraph, init=False, repr=False,
                                      compare=False)
  _floors: PerGraph = dataclasses.field(default_factory=PerGraph, init=False, repr=False,
                                        compare=False)
  # The scores of the moves evaluated for each graph (_scores.py).
  _scores: Scores = dataclasses.field(default_factory=Scores, init=False, repr=False,
                                      compare=False)

  def __post_init__(self):
    if self.offload and self.target is None:
      raise ValueError(f"planner {self.name!r}: offload needs a target to time "
                       f"copies; got target=None, expected a name in {sorted(PROFILES)} "
                       "or a DeviceProfile (jaxmem.calibrate())")
    if self.target is not None:
      get_profile(self.target)  # an unknown name fails here, with the choices
    if self.climbs not in _CLIMBS:
      raise ValueError(f"planner {self.name!r}: climbs must be one of {_CLIMBS}, "
                       f"got {self.climbs!r}")
    if not (self.offload or self.recompute):
      raise ValueError(f"planner {self.name!r}: expected recompute or offload moves, "
                       "got neither")

  def may_offload(self) -> bool:
    return self.offload and not self.target_profile.unified

  def plan(self, graph: Graph, aim: int, start: Plan | None = None) -> Candidate:
    """Plans ``graph`` toward ``aim`` bytes, from ``start`` if given (a
    plan for a looser aim: tightening it is cheaper than starting over)."""
    began = time.perf_counter()
    floors = self._floors.get(graph, dict)
    floor = floors.get(start)
    if floor is not None and aim < floor.peak:
      # The same search ended at ``floor`` for a higher aim: its direct run,
      # the block plans and the whole ladder reach no lower for this one.
      return dataclasses.replace(floor.aimed(aim), seconds=time.perf_counter() - began)
    candidates = recomputable(graph)
    best = None
    if aim > 0:
      best = self._greedy(graph, aim, aim, candidates, start or Plan())
    if best is None or not best.fits:
      # Every block checkpointed costs one evaluation: where that fits, the
      # refinement below gives back the recomputation the aim does not
      # need, and the ladder is not climbed.
      fitting = [r for r in self._block_results(graph) if r.peak <= aim]
      if fitting:
        best = min(fitting, key=lambda r: self.cost(r.schedule)).aimed(aim)
    if best is None or (not best.fits and (self.climbs == "ladder" or start is None)):
      # The ladder, always the same goals: when nothing fits, its best is
      # the lowest plan of this graph whatever the aim, so the smallest
      # footprint named in an error is met when asked for.
      best = None
      for result in self._ladder(graph, aim, candidates):
        if best is None or result.peak < best.peak:
          best = result
        if best.fits:
          break
    elif not best.fits and self.climbs == "blocks":
      best = min([best, *(r.aimed(aim) for r in self.block_descents(graph))],
                 key=lambda r: r.peak)
    if best.fits:
      with paused_gc():
        best = (self.refined(graph, best, aim) if self.recompute
                else kept_copies(graph, best, aim, self.refine))
    else:
      floors[start] = best
    best.seconds = time.perf_counter() - began
    return best

  def refined(self, graph, result: Candidate, aim: int,
              evaluations: int | None = None) -> Candidate:
    """Libra's greedy refinement of a plan that fits (:func:`_refine.refined`),
    within ``evaluations`` evaluations (None: ``refine``)."""
    return refined_plan(graph, result, aim,
                        self.refine if evaluations is None else evaluations)

  def lowest(self, graph: Graph, start: Plan | None = None) -> list[Candidate]:
    """The ladder's plans, lowest predicted peak first: the candidates for
    the smallest footprint (the model ranks them only within a few percent,
    so the caller may measure each). The ladder has its own starting points:
    ``start`` is not used, but by a greedy that does not climb it
    (``climbs``), whose lowest are its descent from ``start`` and, with
    ``climbs="blocks"``, the block descents."""
    began = time.perf_counter()
    if start is None or self.climbs == "ladder":
      results = list(self._ladder(graph, 0, recomputable(graph)))
    else:
      results = [self.descended(graph, start),
                 *(self.block_descents(graph) if self.climbs == "blocks" else ())]
    results = sorted(results, key=lambda r: r.peak)
    for result in results:
      result.seconds = time.perf_counter() - began
    return results

  def descended(self, graph: Graph, start: Plan) -> Candidate:
    """One run from ``start`` toward the lowest peak (kept with the ladder's)."""
    runs = self._runs_for(graph)
    if ("from", start) not in runs:
      runs["from", start] = self._greedy(graph, 0, 0, recomputable(graph), start)
    return runs["from", start]

  def _runs_for(self, graph: Graph) -> dict:
    return self._runs.get(graph, dict)

  def _ladder(self, graph, aim, candidates):
    """Greedy runs toward each fraction of ``aims`` of the unconstrained
    peak, then 0, each from the plan the one before reached (the first from
    an empty plan), so the ladder costs about one descent to the lowest
    peak; each run is kept with the planner for its graph (it
    does not depend on ``aim``, which each is judged against as it is
    yielded), so :meth:`lowest` after a failed :meth:`plan` costs nothing
    more."""
    base = evaluate(graph, Plan())[1].peak
    runs, plan = self._runs_for(graph), Plan()
    for fraction in (*self.aims, 0):
      if fraction not in runs:
        runs[fraction] = self._greedy(graph, 0, int(base * fraction), candidates, plan)
      result = runs[fraction]
      plan = result.plan
      yield result.aimed(aim)
    yield from (r.aimed(aim) for r in self.block_descents(graph))

  def block_descents(self, graph: Graph):
    """Every block (or layer) checkpointed with nothing saved, the plans XLA
    follows best, and the descent from those of every block (run lazily)."""
    descend = block_plans(graph)
    for result in self._block_results(graph, ("nothing_saveable",)):
      yield result
      if result.plan in descend:
        yield self.descended(graph, result.plan)

  def _block_results(self, graph, keeps: tuple = tuple(KEEPS)) -> list[Candidate]:
    """The block-checkpointed plans under the policies ``keeps``
    (:func:`block_candidates`); none for a planner that may not
    recompute."""
    return block_candidates(graph, keeps) if self.recompute else []

  def structured(self, graph: Graph) -> list[Candidate]:
    """Plans shaped like the per-block remat policies (every block or
    every layer checkpointed, under each policy of :data:`KEEPS`), cheapest
    first: XLA follows them closely, so the fit loop measures them against
    the plan it has."""
    return sorted(self._block_results(graph), key=lambda r: self.cost(r.schedule))

  def _greedy(self, graph, aim, goal, candidates, plan) -> Candidate:
    """One greedy run from ``plan`` toward ``goal`` bytes; fits is judged
    against ``aim``."""
    with paused_gc():
      current = candidate(graph, plan)
      best, steps = current, 0
      while current.peak > goal:
        found = self._step(graph, current, goal, candidates)
        if found is None:
          break
        current = found
        _log.debug("greedy step %d: peak %d (goal %d), %d decisions, %d saves, peak at %s",
                   steps, current.peak, goal, len(current.plan),
                   len(current.plan.values_with("save")), current.memory.peak_name)
        steps += 1
        if current.peak < best.peak:
          best = current
    return dataclasses.replace(best.aimed(aim), steps=steps)

  def _step(self, graph, current: Candidate, goal: int, candidates) -> Candidate | None:
    """One greedy step from ``current``: of the first batch of moves with
    one that helps, the move that lowers the peak most per added cost (at a
    plateau, the time spent above ``goal``), or all of the moves that lower
    it as much per cost taken at once (:meth:`_together`); None if no move
    helps."""
    ranked = ranked_groups(graph, current, candidates, current.peak - goal)
    base = Baseline(current.peak, current.memory.excess(goal), self.cost(current.schedule),
                    goal)
    choice, helpful = None, []
    for moves in self._batches(graph, current, ranked, goal, candidates):
      for move in moves:
        found = self._scored(graph, current.plan, move, base)
        if found is None or found.score <= (0.0, 0.0):
          continue
        helpful.append((found.score[0], base.peak - found.peak, move))
        if choice is None or found.score > choice.score:
          choice = found
      if choice is not None:
        break
    if choice is None:
      return None
    taken = self._together(graph, current.plan, choice, helpful, base) or choice
    return taken.found if taken.found is not None else candidate(graph, taken.plan)

  def _scored(self, graph, plan: Plan, move, base: Baseline) -> _Move | None:
    """``move`` taken on ``plan``, scored against ``base``; None where it
    exceeds the host budget."""
    for vid, decision in move:
      plan = plan.with_decision(vid, decision)
    found, seen = scored(self._scores, graph, plan, self.cost)
    if self.host_budget is not None and seen.host_peak > self.host_budget:
      return None
    return _Move(base.judged(seen), plan, found, seen.peak)

  def _together(self, graph, plan: Plan, choice: _Move, helpful: list,
                base: Baseline) -> _Move | None:
    """The ``helpful`` moves (``(score, peak lowered, move)``) that lower
    the peak within ``tied`` as much per cost as the best one (``choice``),
    on disjoint values and lowering it by at most ``tied_share`` of its
    height above the goal, taken in one step where together they still do;
    None where they are not. Where a layer stack repeats, one move a step
    takes one layer's residuals (12 steps from nothing to 70% of a 16-layer
    residual MLP's peak, 10 with ties taken together, to a plan of the same
    cost); near the goal one at a time is cheaper, as each step sees where
    the peak has gone."""
    best = choice.score[0]
    if self.tied is None or best <= 0:
      return None
    near, room = (1 - self.tied) * best, self.tied_share * (base.peak - base.goal)
    moves, seen, lowered = [], set(), 0
    for score, gain, move in sorted(helpful, key=lambda h: -h[0]):
      vids = {vid for vid, _ in move}
      if score >= near and not vids & seen and lowered + gain <= room:
        moves.append(move)
        seen |= vids
        lowered += gain
    if len(moves) < 2:
      return None
    found = self._scored(graph, plan, [d for move in moves for d in move], base)
    return found if found is not None and found.score[0] >= near else None

  def _batches(self, graph, current: Candidate, ranked, goal: int, candidates):
    """The moves of one greedy step, in batches tried until one helps:
    the best-ranked candidates with the undo and bulk moves, then the next
    ranked ones (the cheapest rebuilds can be the ones that make a new
    peak), and last the block moves (``_segment_moves``), for where single
    drops no longer lower the peak: a block checkpointed at its boundary
    stops recomputation from running back through earlier blocks."""
    schedule = current.schedule
    undo = [[(r.value, KEEP)] for r in self._undo(graph, current)]
    bulk = [move for group in self._bulk(ranked, current.peak - goal, current.peak)
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
      yield self._segment_moves(graph, current)

  def _bulk_move(self, graph, schedule, residuals) -> list[tuple]:
    """One move taking many residuals off: rebuilt where the planner may
    recompute, else each one that may be offloaded."""
    if self.recompute:
      return [(r.value, RECOMPUTE) for r in residuals]
    return [move[0] for r in residuals for move in self._moves(graph, schedule, [r])]

  def _moves(self, graph, schedule, group) -> list[list[tuple]]:
    """The ways to take ``group`` off the device at the peak: rebuild it
    (``recompute``), or copy it to the host (``offload``, a lone residual
    with a buffer of its own, on a target whose memory is not the host's),
    copied back early enough to hide the copy under compute. A stack of a
    loop that can live in host memory one slice per iteration also moves
    with all such stacks of its loop at once: one at a time, each frees
    less than nesting the loop does, and nested there is nothing left to
    host."""
    moves = []
    if self.recompute:
      moves.append([(r.value, RECOMPUTE) for r in group])
    if self.offload and len(group) == 1 and group[0].value not in fused_values(graph):
      profile = self.target_profile
      if not profile.unified:
        r = group[0]
        at = prefetch_point(schedule, r.value, r.nbytes, profile)
        moves.append([(r.value, Offload(at=at))])
        loop = _loop_stacks(graph, r.value) - schedule.plan.values_with("offload")
        if len(loop) > 1:
          moves.append([(v, OFFLOAD) for v in sorted(loop)])
    return moves

  def _bulk(self, ranked, deficit: int, peak: int) -> list[list[Residual]]:
    """Moves that drop several ranked groups at once, far from the goal (more
    than ``bulk_above`` of the peak above it): the best-ranked groups
    covering a share (``bulk``) of the bytes still above it. They are scored
    like single drops, so one is taken only where it lowers the peak as much
    per added FLOP; it saves the steps a long descent would take one group at
    a time. (Nearer the goal they cost quality: on a residual MLP at 60%, bulk
    moves all the way end at 62% where single drops reach 58%.)"""
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

  def _segment_moves(self, graph, current: Candidate) -> list[list[tuple]]:
    """Block moves: checkpoint a whole module block at once (see
    :func:`segments`), for the ``evaluations`` blocks whose residuals free
    the most bytes at the peak per FLOP of the block.

    The move saves the values the block reads from outside it (its
    boundary; a dropped residual there is kept again) and drops the
    residuals made and used inside it, as per-block ``jax.checkpoint``
    does: recomputation then starts at the boundary instead of running
    back through earlier blocks.
    """
    decisions = current.plan.as_dict()
    live_at_peak = current.memory.live_at_peak
    live = {k[0] for k in live_at_peak if k[1] == 0}
    # Rebuilt copies at the peak: a recomputation running back through
    # earlier blocks (their boundaries not saved) may be what peaks.
    rebuilt = sum(graph.values[k[0]].nbytes for k in live_at_peak if k[1] > 0)
    ranked = []
    for seg in segments(graph):
      todo = [v for v in seg.drops if v not in decisions]
      move = checkpoint_moves(graph, seg, decisions)
      freed = sum(graph.values[v].nbytes for v in todo if v in live)
      if len(move) > len(todo) and len(todo) < len(seg.drops):
        freed += rebuilt  # some dropped already: saving the boundary may cut a chain
      if freed:
        ranked.append((freed / (seg.flops + 1.0), move))
    ranked.sort(key=lambda item: -item[0])
    return [move for _, move in ranked[:self.evaluations]]

  def _undo(self, graph, current: Candidate) -> list[Residual]:
    """Dropped residuals whose rebuilt copy is live at the peak.

    Keeping one again splits a recompute segment that became the peak.
    """
    plan = current.plan
    dropped = plan.values_with("recompute") | plan.values_with("offload")
    live = [k for k in current.memory.live_at_peak if k[1] > 0 and k[0] in dropped]
    live.sort(key=lambda k: -graph.values[k[0]].nbytes)
    return [graph.residual(k[0]) for k in live[:max(1, self.evaluations // 2)]]


_CLIMBS = ("ladder", "blocks", "none")


def _loop_stacks(graph: Graph, vid: int) -> frozenset[int]:
  """The stacks of the loop that stacks ``vid`` that can live in host
  memory one slice per iteration (none if ``vid`` cannot)."""
  where = hostable(graph)
  if vid not in where:
    return frozenset()
  return frozenset(v for v, (loop, _) in where.items() if loop == where[vid][0])
