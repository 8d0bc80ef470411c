"""Where the fit loop aims next: the model's aim after a compiled plan came
out over the budget, from the model peaks and XLA footprints seen so far."""

from __future__ import annotations


def reaim(points: list[tuple[float, int]], room: int, aim: int) -> int:
  """The next model aim where the plan of the last point was over ``room``
  (the budget less what the model does not hold) in XLA's footprint:
  where that footprint falls with the model's peak between the last two
  points, the peak at which the line through them meets 1% under
  ``room`` (XLA keeps some bytes whatever a plan does, so a plan
  recomputing more saves less than its model peak says); else the last
  peak scaled by how far XLA overshot. Always under the last peak and
  ``aim`` (a plan well within its aim would otherwise come back unchanged),
  and not under half the scaled aim: a line that XLA's footprint barely
  follows reaches far, past where two points say anything.

  Example:
    >>> reaim([(100, 110), (80, 95)], 90, 90)  # XLA = 35 + 0.75 x model
    72
    >>> reaim([(100, 110), (80, 109)], 90, 90)  # XLA follows the model little
    32
  """
  (before, over_before), (peak, over) = points[-2:]
  under = min(aim, peak)
  scaled = under * room / over * 0.99
  if before > peak and over_before > over:
    slope = (over_before - over) / (before - peak)
    line = min(peak - (over - 0.99 * room) / slope, under * 0.999)
    return int(max(line, scaled / 2))
  return int(scaled)
