"""A candidate plan compiled: its footprint on the target, and its time
where the target has a clock."""

from __future__ import annotations

import dataclasses

from jaxmem._budget import format_bytes
from jaxmem.cost._evaluate import Candidate


@dataclasses.dataclass(frozen=True)
class Trial:
  """A candidate compiled.

  Attributes:
    candidate: the plan with its schedule and memory model.
    footprint: XLA's footprint, or for a plan with offloads on a backend
      that ignores host memory the model's device peak in XLA's scale;
      None where the backend gives no analysis.
    seconds: the compiled program's predicted time on the target (the
      clock, ``_xla_clock``); None where the fit has no clock (XLA:CPU).
    took: the seconds its compilation took (where an earlier fit compiled
      it, then).
  """
  candidate: Candidate
  footprint: int | None
  seconds: float | None = None
  took: float = 0.0

  @property
  def measured(self) -> int:
    """The footprint the budget is judged by (the model's where XLA gives none)."""
    return self.candidate.peak if self.footprint is None else self.footprint


def described(candidate: Candidate) -> str:
  """A compiled candidate as the log names it."""
  if len(candidate.plan):
    return f"a plan of {len(candidate.plan)} decisions"
  if candidate.changes_step:
    return "the step with its backward reads separated"
  return "the step as written"


def compiled_line(trial: Trial, best: Trial, budget: int, compiled: bool = True) -> str:
  """The log's line for ``trial``, compiled (or, without ``compiled``, taken
  as an earlier fit compiled it), with the ``best`` trial so far against
  the ``budget``."""
  fits = lambda t: " (fits)" if t.measured <= budget else " (over)"  # noqa: E731
  return (f"jaxmem: {'compiled' if compiled else 'took, as an earlier fit compiled it,'} "
          f"{described(trial.candidate)}: footprint {format_bytes(trial.measured)} against "
          f"the budget {format_bytes(budget)}"
          + ("" if trial.seconds is None else f", predicted {trial.seconds * 1e3:.3g} ms")
          + f" in {trial.took:.1f} s; best so far: {described(best.candidate)} at "
          f"{format_bytes(best.measured)}{fits(best)}")
