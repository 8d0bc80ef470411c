"""What a greedy step reads of a plan's evaluation, kept per plan, and the
order it tries its moves in (:func:`ranked_groups`).

A greedy step evaluates every move of a batch (a full schedule build and
liveness walk each) to score it: the peak, the bytes above the goal over
the step's own equations, the host peak and the cost. The same plans come
back, from the next run of a ladder or from a later step of the same run,
so a planner keeps each plan's :class:`Score`, a few arrays, not its
schedule, and evaluates again only the move it takes.

Example:
  >>> import numpy as np
  >>> s = Score(peak=9, host_peak=0, cost=1.0, levels=np.array([2, 5, 9]))
  >>> s.excess(4), s.excess(0), s.excess(9)  # (5-4) + (9-4); 2+5+9; nothing above
  (6, 16, 0)
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxmem._decisions import Plan
from jaxmem.cost._evaluate import Candidate, candidate, chain_flops, fused_values
from jaxmem.graph._graph import Residual


# A group that frees under this share of the bytes still above the goal ranks
# after every larger one (:func:`ranked_groups`). Rebuilding a channel-sized vector
# (a BatchNorm statistic) costs next to no FLOPs, so by bytes per FLOP such
# vectors come first, and each lowers the peak by its few hundred bytes: on
# MobileNetV2 for a T4, a descent from 23.7 MB toward 12 MB took one such
# step after another, each about a second.
SMALL_SHARE = 1 / 256


@dataclasses.dataclass(frozen=True, eq=False)
class Score:
  """A plan's figures a greedy step compares.

  Attributes:
    peak: the model's device peak, bytes.
    host_peak: the most bytes in host memory.
    cost: the planner's cost of the plan (:meth:`Planner.cost`).
    levels: live device bytes at each of the step's own equations, in any
      order (sorted here).
  """
  peak: int
  host_peak: int
  cost: float
  levels: np.ndarray

  def __post_init__(self):
    levels = np.sort(np.asarray(self.levels, dtype=np.int64))
    object.__setattr__(self, "levels", levels)
    object.__setattr__(self, "_tails", np.concatenate([np.cumsum(levels[::-1])[::-1], [0]]))

  @classmethod
  def of(cls, found: Candidate, cost: float) -> Score:
    memory = found.memory
    return cls(memory.peak, memory.host_peak, cost, np.asarray(memory.node_levels()))

  def excess(self, level: int) -> int:
    """:meth:`Liveness.excess`: byte-ops above ``level`` at the step's own
    equations."""
    first = int(np.searchsorted(self.levels, level, side="right"))
    return int(self._tails[first]) - int(level) * (len(self.levels) - first)


@dataclasses.dataclass(frozen=True)
class Baseline:
  """The plan a greedy step moves from, as its moves are judged against
  it: its peak, its :meth:`Score.excess` over ``goal``, and its cost."""
  peak: int
  excess: int
  cost: float
  goal: int

  def judged(self, seen: Score) -> tuple[float, float]:
    """A move's score from its plan's ``seen``: the peak it lowers per added
    cost first; at a plateau, the time above the goal it cuts per added
    cost. ``(0, 0)`` or less where it helps neither."""
    gain_peak = self.peak - seen.peak
    gain_excess = self.excess - seen.excess(self.goal)
    cost = max(seen.cost - self.cost, 0.0) + 1.0
    return (gain_peak / cost if gain_peak > 0 else 0.0,
            gain_excess / cost if gain_peak >= 0 and gain_excess > 0 else 0.0)


class PerGraph:
  """What a planner keeps for each of the last ``size`` graphs it planned,
  made by ``make()`` on first use: a fit plans several graphs of one step
  (whole, in micro-batches, with its optimizer state on the host) and comes
  back to them, when what it found for a graph serves again.

  Example:
    >>> kept, made = PerGraph(size=1), []
    >>> g, h = object(), object()
    >>> kept.get(g, lambda: made.append("g") or {}) is kept.get(g, dict)
    True
    >>> _ = kept.get(h, dict); _ = kept.get(g, lambda: made.append("g") or {})
    >>> made  # made again: only the last graph is kept
    ['g', 'g']
  """

  def __init__(self, size: int = 4):
    self.size = size
    self._kept: collections.OrderedDict[int, tuple] = collections.OrderedDict()

  def get(self, graph, make):
    found = self._kept.get(id(graph))
    if found is None or found[0] is not graph:
      found = self._kept[id(graph)] = (graph, make())
      while len(self._kept) > self.size:
        self._kept.popitem(last=False)
    self._kept.move_to_end(id(graph))
    return found[1]


class Scores:
  """The scores of the plans one planner evaluated for each graph it
  planned (:class:`PerGraph`), the least recently used dropped beyond
  ``size`` per graph."""

  def __init__(self, size: int = 512):
    self.size = size
    self._graphs = PerGraph()

  def _kept(self, graph) -> collections.OrderedDict:
    return self._graphs.get(graph, collections.OrderedDict)

  def get(self, graph, plan: Plan) -> Score | None:
    kept = self._kept(graph)
    score = kept.get(plan)
    if score is not None:
      kept.move_to_end(plan)
    return score

  def put(self, graph, plan: Plan, score: Score) -> None:
    kept = self._kept(graph)
    kept[plan] = score
    while len(kept) > self.size:
      kept.popitem(last=False)


def scored(scores: Scores, graph, plan: Plan, cost) -> tuple[Candidate | None, Score]:
  """``plan``'s score (``cost``: the planner's cost of a schedule), and its
  candidate where it had to be evaluated (None where ``scores`` kept it
  from an earlier step)."""
  seen = scores.get(graph, plan)
  if seen is not None:
    return None, seen
  found = candidate(graph, plan)
  seen = Score.of(found, cost(found.schedule))
  scores.put(graph, plan, seen)
  return found, seen


def ranked_groups(graph, current: Candidate, candidates,
                  deficit: int) -> list[tuple[list[Residual], int]]:
  """Candidate groups with the bytes they free, best bytes-per-FLOP first,
  those freeing under ``SMALL_SHARE`` of the ``deficit`` (the bytes above
  the goal) after all the others.

  A group is a residual plus the kept residuals fused onto its buffer
  (``1 - tanh(x)**2`` read in the backward pass keeps ``tanh(x)`` alive
  there): dropping one without the others frees nothing.
  """
  plan, memory = current.plan, current.memory
  dropped = plan.values_with("recompute")
  moved = dropped | plan.values_with("offload")
  live = set(memory.live_at_peak)
  riders: dict = {}
  # The schedule reads a kept fused residual's buffers for it (directly, or
  # through a copy it rebuilds in the backward pass), so those stay.
  for vid, bufs in fused_values(graph).items():
    if vid in candidates and vid not in moved:
      for buf in bufs:
        riders.setdefault((buf, 0), []).append(candidates[vid])
  ops = memory.schedule.ops
  ranked = []
  for buf in live:
    own = [candidates[buf[0]]] if (
        buf[1] == 0 and buf[0] in candidates and buf[0] not in moved) else []
    group = own + riders.get(buf, [])
    if not group:
      continue
    later = [p for p in memory.reads.get(buf, []) if p > memory.peak_op]
    if any(ops[p].kind == "node" and not graph.nodes[ops[p].node].backward
           for p in later):
      continue  # still read by the forward pass after the peak
    flops = sum(chain_flops(graph, g.value, dropped) for g in group)
    nbytes = graph.values[buf[0]].nbytes
    ranked.append(((nbytes >= SMALL_SHARE * deficit, nbytes / (flops + 1.0)), group, nbytes))
  ranked.sort(key=lambda item: item[0], reverse=True)
  return [(group, nbytes) for _, group, nbytes in ranked]
