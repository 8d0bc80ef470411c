"""Footprints of a step's chunked forms as written, remembered per step.

Where no plan of a step fits, ``fit._micro`` compiles each count of
micro-batches (and of the chunks of the region around its peak) that it
weighs, to read its footprint as written. A later fit of the same step
(the budget an error named, or another budget) reads those footprints here
and compiles only the forms it goes on to plan.
"""

from __future__ import annotations

import weakref
from typing import Callable

from jaxmem.fit._saved import fingerprint

# Per step function (weakly: they go with it), per chunked form's
# fingerprint and what else decides its footprint: the footprint as written.
_FOOTPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_UNKNOWN = object()


class AsWritten:
  """A chunked form ``traced`` of the step, as written: its ``footprint``
  (XLA's, or None where the backend gives none), and its compilation
  (``fit._traced.Written``, by ``compile``), made on first use."""

  def __init__(self, compile: Callable, traced, footprint=_UNKNOWN):
    self._compile, self._traced = compile, traced
    self._footprint, self._written = footprint, None

  @property
  def written(self):
    if self._written is None:
      self._written = self._compile(self._traced)
    return self._written

  @property
  def footprint(self) -> int | None:
    if self._footprint is _UNKNOWN:
      self._footprint = self.written.footprint
    return self._footprint


def measuring(fun: Callable, where: tuple, compile: Callable) -> Callable:
  """``measure(traced) -> AsWritten`` for the chunked forms of step ``fun``
  (``compile(traced) -> Written``), with ``where`` (hashable) all that
  decides a form's footprint beside its traced program: target, argument
  shardings, donations, ``jax.jit`` options. A form measured before for
  ``fun`` and ``where`` is not compiled to be measured again."""
  try:
    known = _FOOTPRINTS.setdefault(fun, {})
  except TypeError:  # a callable that cannot be referenced weakly
    known = {}

  def measure(traced) -> AsWritten:
    key = (fingerprint(traced), where)
    if key in known:
      return AsWritten(compile, traced, known[key])
    found = AsWritten(compile, traced)
    known[key] = found.footprint
    return found
  return measure
