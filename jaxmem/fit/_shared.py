"""What the fits of one step function share: its graphs, its planners, and
its forms as written (the step, and its chunked forms), compiled.

Each ``jaxmem.transform`` of a function traces its step again. Where the
traced program is the one traced before (the same equations, wiring,
literals and types, and equal constants), the graph built then is used
again, with every analysis kept on it; and a planner named by a string is
the one set up before for that function and target. A second fit of the
step (the budget an error named, the next budget of a sweep) then finds
the planners' searches on that graph done: a plan for a lower aim starts
where they ended.

Every fit compiles the step as written, for its footprint (the budget's
reference) and as the plan that keeps everything: a later fit of the same
step on the same graph, for the same target, arguments and options, takes
that compilation (:func:`once`), and what each plan it compiled came to.
Where no plan of a step fits,
``fit._micro`` compiles each count of micro-batches (and of the chunks of
the region around its peak) that it weighs, to read its footprint as
written. A later fit of the same step reads those footprints here, takes
the compilations of the forms planned before, and compiles only the other
forms it goes on to plan.
"""

from __future__ import annotations

import collections
import weakref
from typing import Callable

import numpy as np
from jax.extend import core as jex

from jaxmem.graph._graph import Graph, analysis, build_graph

# Graphs kept per function: the step and a few of its micro-batched forms.
KEPT = 4

# Function -> {program text: (traced program, graph)}, least recently used
# first; function -> {(planner name, profile): planner}; function ->
# {(chunked form's program text, what else decides its footprint): its
# footprint as written}. Weakly keyed: they go with the function.
_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PLANNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_FOOTPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_UNKNOWN = object()


def _kept(table: weakref.WeakKeyDictionary, fun: Callable, make: Callable) -> dict | None:
  try:
    return table.setdefault(fun, make())
  except TypeError:  # a callable that cannot be referenced weakly
    return None


def graph_of(fun: Callable, closed) -> Graph:
  """The graph of ``closed``, a traced step of ``fun``: the one built for an
  identical program of ``fun`` before (:func:`same_constants`), else
  built."""
  known = _kept(_GRAPHS, fun, collections.OrderedDict)
  if known is None:
    return build_graph(closed)
  text = program(closed)
  entry = known.get(text)
  if entry is not None and same_constants(entry[0], closed):
    known.move_to_end(text)
    return entry[1]
  graph = build_graph(closed)
  known[text] = (closed, graph)
  while len(known) > KEPT:
    known.popitem(last=False)
  return graph


def program(closed) -> tuple:
  """A traced program's text: its equations, their wiring and literals,
  the programs inside them, and its argument types."""
  return str(closed.jaxpr), tuple(map(str, closed.in_avals))


def planner_of(fun: Callable, name: str, profile, make: Callable):
  """The planner ``make()`` (named ``name``, for the target ``profile``),
  set up once per function."""
  known = _kept(_PLANNERS, fun, dict)
  if known is None:
    return make()
  if (name, profile) not in known:
    known[name, profile] = make()
  return known[name, profile]


def same_constants(a, b) -> bool:
  """Whether two traced programs whose text is the same hold equal
  constants, those of the programs inside their equations included."""
  if len(a.consts) != len(b.consts):
    return False
  if not all(_equal(x, y) for x, y in zip(a.consts, b.consts)):
    return False
  inner_a, inner_b = _inner(a.jaxpr), _inner(b.jaxpr)
  return len(inner_a) == len(inner_b) and all(map(same_constants, inner_a, inner_b))


def _inner(jaxpr) -> list:
  """The closed programs in ``jaxpr``'s equations' parameters, in order."""
  found = []
  for eqn in jaxpr.eqns:
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(item, jex.ClosedJaxpr):
          found.append(item)
        elif isinstance(item, jex.Jaxpr):
          found.append(jex.ClosedJaxpr(item, ()))
  return found


def _equal(x, y) -> bool:
  if x is y:
    return True
  try:
    x, y = np.asarray(x), np.asarray(y)
  except Exception:  # not an array: no constant jaxmem can compare
    return False
  return x.shape == y.shape and x.dtype == y.dtype and bool(np.array_equal(x, y))


@analysis
def _made(graph: Graph) -> dict:
  """What fits of the step made once for ``graph`` (filled by :func:`once`)."""
  return {}


def once(graph: Graph, key: tuple, make: Callable):
  """``make()``, made once per ``graph`` and ``key`` (hashable).

  The fits of a step key by all that decides a program beside its
  equations (``where``: target, argument shardings, static and donated
  arguments, ``jax.jit`` options, output tree):
  - the step as written, compiled (a ``fit._traced.Written``): ``("written", where)``;
  - what a plan of ``graph`` compiles to (footprint, predicted time, model
    bytes per XLA byte; ``Fitter.compile``): ``("plan", plan,
    changes_step, where)``, so that a later fit meeting the same plan (the
    candidates for the smallest footprint again, a budget's plan met
    before) does not compile it again."""
  made = _made(graph)
  if key not in made:
    made[key] = make()
  return made[key]


class AsWritten:
  """A chunked form ``traced`` of the step, as written: its ``footprint``
  (XLA's, or None where the backend gives none), and its compilation
  (``fit._traced.Written``, by ``compile``), made on first use; ``keep``
  is told of the form once its compilation is taken (:attr:`written`)."""

  def __init__(self, compile: Callable, traced, footprint=_UNKNOWN,
               keep: Callable | None = None):
    self._compile, self._traced, self._keep = compile, traced, keep
    self._footprint, self._written = footprint, None

  def compiled(self):
    """Its compilation, made once, without keeping the form for later fits
    (a form priced, not planned)."""
    if self._written is None:
      self._written = self._compile(self._traced)
      self._compile = None  # it holds the call's arguments: not kept with the form
    return self._written

  @property
  def written(self):
    found = self.compiled()
    if self._keep is not None:
      self._keep(self)
      self._keep = None
    return found

  @property
  def footprint(self) -> int | None:
    if self._footprint is _UNKNOWN:
      self._footprint = self.compiled().footprint
    return self._footprint


def measuring(fun: Callable, where: tuple, compile: Callable) -> Callable:
  """``measure(traced) -> AsWritten`` for the chunked forms of step ``fun``
  (``compile(traced) -> Written``), with ``where`` (hashable) all that
  decides a form's footprint beside its traced program: target, argument
  shardings, static and donated arguments, ``jax.jit`` options. A form
  measured before for ``fun`` and ``where`` is not compiled to be measured
  again, and one whose compilation a fit took before is taken again; the
  others' compilations are not kept (only the forms a fit plans are)."""
  known = _kept(_FOOTPRINTS, fun, dict)
  known = {} if known is None else known

  def measure(traced) -> AsWritten:
    key = (program(traced), where)
    hit = known.get(key, _UNKNOWN)
    if isinstance(hit, AsWritten):
      return hit
    found = AsWritten(compile, traced, hit, keep=lambda form: known.__setitem__(key, form))
    if hit is _UNKNOWN:
      known[key] = found.footprint
    return found
  return measure
