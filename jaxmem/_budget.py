"""Memory budgets: parse what a user writes into bytes.

Accepted forms:

* an ``int`` number of bytes (``3 * 2**30``);
* a string with a unit: ``"3GiB"``, ``"512MB"``, ``"1.5 GB"``, ``"800 KiB"``,
  ``"4096B"`` (binary units KiB/MiB/GiB/TiB are powers of 1024, decimal
  KB/MB/GB/TB powers of 1000);
* a fraction of the step's own footprint (XLA's compiled footprint of
  the step as written, without donation, on the target): ``"60%"`` or a
  float such as ``0.6``; above 1 (``"150%"``, ``1.5``) a budget the step as
  written meets, which needs no plan. A float above 10 (1000%) is refused:
  it is most likely bytes written as a float (``6e9``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

ACCEPTED = (
    "an int number of bytes (e.g. 3221225472), a string with a unit "
    "(e.g. '3GiB', '512MB', '1.5 GB'; units B, KB, MB, GB, TB, KiB, MiB, GiB, "
    "TiB), or a fraction of the step's own footprint ('60%' or a float, e.g. "
    "0.6; '150%' or 1.5 leave room above it)")

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
# The largest float read as a fraction of the footprint (1000%): a larger
# one is most likely bytes written as a float (``budget=6e9``), refused.
MAX_FRACTION = 10.0
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%]*)\s*$")


class BudgetError(ValueError):
  """A budget that cannot be parsed, or that no plan can meet.

  Attributes:
    smallest: for an unmeetable budget, the smallest footprint in bytes that
      the planner reaches (pass it as the budget); None for unreadable input.
    plan: where known, the plan that reaches ``smallest``, as the JSON text
      ``Fit.save_plan`` writes (written to a file, ``transform(...,
      plan=path)`` applies it without planning); None otherwise.
  """

  def __init__(self, message: str, smallest: int | None = None, plan: str | None = None):
    super().__init__(message)
    self.smallest, self.plan = smallest, plan


@dataclasses.dataclass(frozen=True)
class Budget:
  """A parsed budget: absolute bytes, or a fraction of the unconstrained step.

  Example:
    >>> Budget.parse("60%").resolve(1000)
    600
    >>> Budget.parse("1KiB").resolve(10**6)
    1024
  """
  nbytes: int | None = None
  fraction: float | None = None
  text: str = ""

  @classmethod
  def parse(cls, budget) -> "Budget":
    """Parses ``budget`` (see the module docstring for the accepted forms)."""
    if isinstance(budget, Budget):
      return budget
    if isinstance(budget, bool) or budget is None:
      raise _bad(budget)
    if isinstance(budget, numbers.Integral):
      if budget <= 0:
        raise _bad(budget, "it must be positive")
      return cls(nbytes=int(budget), text=format_bytes(int(budget)))
    if isinstance(budget, numbers.Real):
      value = float(budget)
      if not 0.0 < value < math.inf:
        raise _bad(budget, "a float is a fraction of the step's footprint and must be "
                   "positive and finite; pass an int for bytes")
      if value > MAX_FRACTION:  # budget=6e9: bytes written as a float
        raise _bad(budget, f"a float is a fraction of the step's footprint, and "
                   f"{value:g} would be {value:.0%} of it; for bytes pass the int "
                   f"{int(value)} (or '{format_bytes(value)}'); for that fraction write "
                   f"'{value:.0%}'")
      return cls(fraction=value, text=f"{value:.0%}")
    if isinstance(budget, str):
      match = _PATTERN.match(budget)
      if not match:
        raise _bad(budget)
      number, unit = float(match.group(1)), match.group(2).lower()
      if unit == "%":
        if not 0.0 < number < math.inf:
          raise _bad(budget, "a percentage must be positive")
        return cls(fraction=number / 100.0, text=budget.strip())
      if not unit:
        raise _bad(budget, _unitless(number))
      if unit not in _UNITS:
        raise _bad(budget, f"unknown unit {match.group(2)!r}")
      if not math.isfinite(number * _UNITS[unit]):
        raise _bad(budget, "the number is too large to be a count of bytes")
      nbytes = int(number * _UNITS[unit])
      if nbytes <= 0:
        raise _bad(budget, "it must be positive")
      return cls(nbytes=nbytes, text=budget.strip())
    raise _bad(budget)

  def resolve(self, unconstrained_bytes: int) -> int:
    """Bytes this budget allows, given the unconstrained footprint."""
    if self.nbytes is not None:
      return self.nbytes
    return int(self.fraction * unconstrained_bytes)

  def reserve(self, given: int | None, runtime: int) -> int:
    """Bytes kept free for the runtime beyond the footprint: ``given``
    (``transform(..., reserve=)``) where passed; else the runtime's
    workspaces (``runtime``) for a budget in bytes. A fraction is of XLA's
    footprint, which those workspaces add to as much for the step as
    written, so it keeps none."""
    if given is not None:
      return given
    return 0 if self.fraction is not None else runtime

  def in_bytes(self, unconstrained: int, reserve: int) -> tuple[int, int]:
    """``(budget, reserve)`` in bytes for a step of ``unconstrained``
    bytes; an error where the reserve leaves nothing."""
    budget = self.resolve(unconstrained)
    if budget <= reserve:
      raise BudgetError(
          f"jaxmem: budget {format_bytes(budget)} leaves nothing for the step once "
          f"{format_bytes(reserve)} is kept free for the runtime's workspaces; pass a "
          f"budget above {reserve} bytes, or a smaller transform(..., reserve=).",
          smallest=reserve + 1)
    return budget, reserve


def _unitless(number: float) -> str:
  """Why a string without a unit is refused, and what was likely meant."""
  if not math.isfinite(number):
    return "the number is too large to be a count of bytes"
  if number <= 0.0:
    return "it must be positive"
  if number <= 1.0:
    return (f"a string needs a unit; for a fraction of the footprint write "
            f"'{number * 100:g}%' or pass the float {number:g}")
  if number != int(number):
    return f"a string needs a unit, e.g. '{number:g}GiB' or '{number:g}GB'"
  return (f"a string needs a unit; for bytes write '{number:g}B' or pass the "
          f"int {int(number)}")


def _bad(budget, why: str = "") -> BudgetError:
  why = f" ({why})" if why else ""
  return BudgetError(
      f"jaxmem: cannot read budget {budget!r} of type "
      f"{type(budget).__name__}{why}. Expected {ACCEPTED}.")


def format_bytes(nbytes: float) -> str:
  """Formats bytes for people: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
  try:
    value = float(nbytes)
  except OverflowError:
    return f"{nbytes} B"
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(value) < 1024 or unit == "GiB":
      return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
    value /= 1024
  return f"{value:.2f} GiB"  # pragma: no cover
