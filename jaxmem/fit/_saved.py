"""Plans saved as JSON and loaded back, checked against the step they were
made for.

A plan names residuals by their value ids in the step's joint jaxpr, which
tracing the same step with the same argument shapes gives again. The file
carries the step's :func:`fingerprint` (its equations and argument and
result types), so a plan is never applied to a step that changed.

Example:
  >>> from jaxmem._decisions import Chunked, Offload, RECOMPUTE, SAVE, KEEP
  >>> plan = Plan.of({3: RECOMPUTE, 5: SAVE, 8: Offload(at=12),
  ...                 9: Chunked(0, ((0, 2), (2, 4)), (KEEP, Offload()))})
  >>> loads(dumps(plan, "abc"), "abc") == plan
  True
"""

from __future__ import annotations

import enum
import os
import hashlib
import json
from typing import NamedTuple

import numpy as np

from jaxmem._decisions import Chunked, Decision, Host, Keep, Offload, Plan, Recompute, Save

FORMAT = "jaxmem-plan/1"

_SIMPLE = {"keep": Keep, "recompute": Recompute, "save": Save}


def fingerprint(closed) -> str:
  """A digest of a traced step (a ``ClosedJaxpr``): its equations
  (primitives, result types and parameters, nested jaxprs included) and the
  types of its arguments and results, stable across processes. Parameters
  that are functions or other objects whose text holds an address count by
  their type only."""
  text = "\n".join([*_equations(closed.jaxpr), *map(str, closed.in_avals), "->",
                     *map(str, closed.out_avals)])
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def _equations(jaxpr) -> list[str]:
  return [f"{e.primitive} {[str(v.aval) for v in e.outvars]} "
          f"{ {k: _param(v) for k, v in sorted(e.params.items())} }" for e in jaxpr.eqns]


def _param(value):
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (tuple, list)):
    return [_param(v) for v in value]
  inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr's jaxpr, or a Jaxpr
  if hasattr(inner, "eqns"):
    return _equations(inner)
  if isinstance(value, (np.dtype, enum.Enum)) or type(value).__module__ == "numpy":
    return str(value)
  return type(value).__name__


def _encode(decision: Decision) -> dict:
  if isinstance(decision, (Offload, Host)):
    return {"kind": decision.kind, "at": decision.at}
  if isinstance(decision, Recompute) and decision.with_block:
    return {"kind": "recompute", "with_block": True}
  if isinstance(decision, Chunked):
    return {"kind": "chunked", "axis": decision.axis,
            "bounds": [list(b) for b in decision.bounds],
            "chunks": [_encode(d) for d in decision.chunks]}
  return {"kind": decision.kind}


def _decode(record: dict) -> Decision:
  kind = record.get("kind")
  if kind == "recompute" and record.get("with_block"):
    return Recompute(with_block=True)
  if kind in _SIMPLE:
    return _SIMPLE[kind]()
  if kind == "offload":
    return Offload(at=record.get("at"))
  if kind == "host":
    return Host(at=record.get("at"))
  if kind == "chunked":
    return Chunked(record["axis"], tuple(tuple(b) for b in record["bounds"]),
                   tuple(_decode(d) for d in record["chunks"]))
  raise ValueError(f"jaxmem: unknown decision {record!r} in a saved plan; expected one of "
                   f"{sorted([*_SIMPLE, 'offload', 'host', 'chunked'])}")


def dumps(plan: Plan, step: str, around: Plan | None = None, **about) -> str:
  """``plan`` as JSON, for the step of fingerprint ``step``; ``around`` (the
  :class:`Host` decisions of the step around the loop whose body ``plan``
  is, in the step's own value ids) where there are any; ``about`` (budget,
  target, planner) is recorded for people reading the file."""
  record = {"format": FORMAT, "step": step, **about,
            "decisions": [[vid, _encode(d)] for vid, d in plan]}
  if around:
    record["around_loop"] = [[vid, _encode(d)] for vid, d in around]
  return json.dumps(record, indent=1)


def _decisions(record: list) -> Plan:
  return Plan.of({int(vid): _decode(d) for vid, d in record})


def loads(text: str, step: str, source: str = "the saved plan") -> Plan:
  """The plan in ``text``, checked to be for the step of fingerprint
  ``step``."""
  return _checked(json.loads(text), step, source)


def _checked(record: dict, step: str, source: str) -> Plan:
  """The plan of a parsed saved plan, checked to be one, for ``step``."""
  if record.get("format") != FORMAT:
    raise ValueError(f"jaxmem: {source} is not a jaxmem plan (format "
                     f"{record.get('format')!r}, expected {FORMAT!r})")
  if record.get("step") != step:
    raise ValueError(
        f"jaxmem: {source} was made for another step (fingerprint {record.get('step')}, "
        f"this step's is {step}): the step's equations or its argument shapes changed. "
        "Plan it again (leave out plan=) and save the new plan.")
  return _decisions(record["decisions"])


class Saved(NamedTuple):
  """A plan given as ``transform(..., plan=...)``: the plan, where it came
  from, the chunks it runs the step in (``fit._micro``) and whether they
  are a region's, and the host decisions of the step around the loop whose
  body the plan is (empty where it is the whole step's); ``region`` names
  what runs in chunks where it is not the batch (``fit._micro``)."""
  plan: Plan
  source: str
  micro_batches: int | str
  region: bool | str
  around: Plan


def load_plan(saved, step: str, micro_batches) -> Saved:
  """The plan given as ``transform(..., plan=saved)`` (a :class:`Plan`, or
  a path to one saved by ``Fit.save_plan``, checked to be for ``step``);
  for a :class:`Plan`, ``micro_batches`` as given."""
  if isinstance(saved, Plan):
    return Saved(saved, "given", micro_batches, False, Plan())
  path = os.fspath(saved)
  with open(path) as f:
    return loads_saved(f.read(), step, path)


def loads_saved(text: str, step: str, source: str) -> Saved:
  """The saved plan in ``text`` (from ``source``), checked to be for ``step``,
  with the chunks it runs the step in."""
  record = json.loads(text)
  # The chunks the step runs in (1: whole), and whether only the region
  # around its peak runs in them (or, named, what else: layers' features).
  region = record.get("region", False)
  return Saved(_checked(record, step, source), source, int(record.get("micro_batches", 1)),
               region if isinstance(region, str) else bool(region),
               _decisions(record.get("around_loop", [])))
