"""What the exact planner proves: :class:`Solution` (its own plan's
status, cost and bound) and :class:`Gap` (any plan against its bound)."""

from __future__ import annotations

import dataclasses

from jaxmem.cost._evaluate import Details, clipped


@dataclasses.dataclass
class Solution(Details):
  """What the solver proved about a plan.

  Attributes:
    chosen: ``(block, policy)`` of each block the plan checkpoints.
    cost: the program's cost of the chosen blocks over the step as written
      (recomputed FLOPs, or with a target predicted seconds in FLOPs of the
      target); the plan's own cost where it was taken before its columns
      were priced.
    bound: the solver's lower bound on that cost (equal to ``cost`` when
      the program was solved to optimality).
    refined: the plan's cost after the refinement (at most ``cost`` where
      the two models agree; None before it).
    fallback: the planner whose plan was taken (status ``"fallback"``).
    status: ``"optimal"``, ``"near-optimal"`` (the solver stopped within
      :attr:`ILP.mip_gap` of its bound), ``"time limit"`` (the incumbent,
      with its gap), ``"aim tightened"`` (the memory model refused the
      program's combinations until its limit was lowered below the aim:
      the plan fits, its gap is to the bound at the aim),
      ``"fallback"`` (no combination fits, but the planner ``fallback``'s
      plan does: it is taken, its gap unknown) or ``"infeasible"`` (nothing
      fits; the plan is the lowest).
    rounds: programs solved (one more per combination the memory model
      refused).
    seconds: time in the solver.
    moved: columns of the program moved from alike layers' and never
      priced (:mod:`~jaxmem.planners._alike`): the bound is over them, near
      the exact program's but not proved.
  """
  chosen: list
  cost: float
  bound: float
  status: str
  rounds: int
  seconds: float
  refined: float | None = None
  fallback: str = ""
  moved: int = 0

  @property
  def gap(self) -> float:
    """``(cost - bound) / cost``: how far from the optimum the plan may be
    (0 when it is the optimum)."""
    return 0.0 if self.cost <= 0 else max(self.cost - self.bound, 0.0) / self.cost

  def rows(self) -> list[dict]:
    return [{"block": name, "policy": keep} for name, keep in self.chosen]

  def table(self, top: int | None = None) -> str:
    if self.status == "infeasible":
      head = "exact planner: no choice of block policies fits; the lowest is taken"
    elif self.status == "fallback":
      return (f"exact planner: no combination of its choices fits; planner "
              f"{self.fallback!r}'s plan is taken (gap unknown)")
    elif self.status == "optimal":
      head = "exact planner: optimal over its choices (blocks under a policy, residuals rebuilt alone)"
    else:
      head = (f"exact planner ({self.status}): an optimum over its choices saves at most "
              f"{self.gap:.1%} of its cost")
    if self.moved:
      head += f" ({_moved(self.moved)})"
    if self.refined is not None and self.refined < self.cost:
      head += f"; the refinement cuts its cost to {self.refined / self.cost:.1%} of that"
    lines = [f"{head} ({self.rounds} programs, {self.seconds:.2f} s):"]
    lines += clipped([f"  {name:<40} {keep}" for name, keep in self.chosen],
                     top, "more blocks") or ["  (nothing)"]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Gap:
  """A plan's cost against the exact planner's at the plan's own model
  peak (:meth:`ILP.gap`).

  Attributes:
    cost: the plan's cost over the step as written (the exact planner's
      cost model: recomputed FLOPs, or with a target predicted seconds in
      FLOPs of the target).
    bound: the solver's lower bound on the cost of any combination of the
      exact planner's choices that reaches the same model peak; None where
      no combination does.
    status: the program's (``"optimal"``, ``"near-optimal"``, ``"time limit"``,
      ``"aim tightened"``, ``"unreachable"``).
    seconds: time spent pricing and solving.
    moved: the program's columns moved from alike layers' and never
      priced (see :class:`Solution`).
  """
  cost: float
  bound: float | None
  status: str
  seconds: float = 0.0
  moved: int = 0

  @property
  def gap(self) -> float | None:
    """``(cost - bound) / cost``: at most how much of the plan's cost an
    optimal combination saves (negative where the plan is cheaper than
    any combination: it reaches outside the program's choices)."""
    if self.bound is None:
      return None
    return 0.0 if self.cost <= 0 else (self.cost - self.bound) / self.cost

  def text(self) -> str:
    if self.bound is None:
      return ("gap unknown: no combination of the exact planner's choices reaches "
              "this plan's peak")
    said = ([] if self.status == "optimal" else [f"its program: {self.status}"]) + (
        [_moved(self.moved)] if self.moved else [])
    solved = f" ({'; '.join(said)})" if said else ""
    if self.gap < 0:
      return (f"{-self.gap:.1%} cheaper than the exact planner's bound over its "
              f"choices{solved}: the plan reaches outside them")
    return (f"the exact planner's choices save at most {self.gap:.1%} of its cost at its "
            f"peak{solved}")


def _moved(count: int) -> str:
  """What a bound over moved columns says of itself."""
  return (f"bound over {count} column{'s' if count > 1 else ''} moved from alike "
          "layers, not priced")
