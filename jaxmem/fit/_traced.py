"""A traced step made ready for the fit loop on a target: its graphs, the
step as written, and the target's clock.

The graph planned is the step's, or where its passes run inside a loop
(gradient accumulation, or the micro-batches of ``fit._micro``) the loop's
body (``fit._inner``); on a GPU target the memory model learns the buffers
the target's compiler gives it (one compilation, ``_xla_buffers.learn``),
on XLA:CPU it emulates that compiler's fusion. Where the target is a
compile-only GPU and the step runs on one device, that compilation is the
step as written's own (:func:`as_written` compiles it tagged).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from jaxmem.cost._perf import timed
from jaxmem.cost._xla_buffers import (compile_tagged, read, rewritten, tagged_program,
                                      with_buffers)
from jaxmem.cost._xla_clock import program_time
from jaxmem.cost._xla_loops import loop_bodies
from jaxmem.fit._checks import fittable
from jaxmem.cost._evaluate import Candidate
from jaxmem.fit._inner import body_graph, embedded, inner_body
from jaxmem.targets._host_args import devices_of
from jaxmem.cost._xla_shards import elements, partitioned, per_device, shard_elements
from jaxmem.schedule._emit import emit
from jaxmem.graph._graph import Graph, analysis, build_graph
from jaxmem.graph._state import apply_host_decisions
from jaxmem.planners import Fixed
from jaxmem.targets import Target, xla_footprint


@dataclasses.dataclass(frozen=True)
class Written:
  """A traced step as written.

  Attributes:
    run: the step over flat leaves (as ``baseline`` compiles it).
    jitted: its ``jax.jit`` as it runs.
    baseline: it compiled for the target: the footprint a fraction budget
      is of.
    footprint: XLA's footprint of ``baseline`` (None where the backend
      gives no analysis).
    in_place: the target is where the step runs.
    one_program: ``baseline`` is ``jitted``'s own compilation, which serves
      the calls where the budget needs no plan.
    tagged: the graph whose step, its equations tagged, ``baseline`` is
      (``_xla_buffers.compile_tagged``), from which the buffers the target
      gives that graph are read; None where ``baseline`` is the step's own.
  """
  run: Callable
  jitted: object
  baseline: object
  footprint: int | None
  in_place: bool
  one_program: bool
  tagged: Graph | None = None


def as_written(run: Callable, jitted, target: Target, here: Target, leaves, placed: tuple,
               donates: bool, graph: Graph | None = None) -> Written:
  """The step ``run`` as written (``jitted`` its jit as it runs ``here``),
  compiled for ``target`` with the arguments ``placed`` there
  (``(args, kwargs)``). Where the step runs where it is planned for and
  donates nothing, ``jitted`` itself is compiled: one compilation then
  measures it, stands for the plan that keeps everything, and serves the
  calls when the budget needs no plan (``jax.jit``'s call reuses an
  ahead-of-time compilation of the same jit). For a compile-only GPU the
  step does not run on, on one device, its ``graph`` (where given) is
  compiled with its equations tagged: one compilation then measures it and
  teaches the memory model the target's buffers (:func:`modelled`); the
  step is then the one emitted from the graph, whose footprint is the one
  measured (a step emitted again may differ from the traced jaxpr by a few
  bytes: 256 of 31 MiB on a GPT-2 whose blocks run under ``nn.scan``)."""
  in_place = target.name == here.name
  one_program = in_place and not donates
  tagging = (not in_place and graph is not None and target.compile_only
             and target.platform == "gpu" and devices_of(leaves) <= 1)
  if one_program:
    baseline = jitted.lower(*placed[0], **placed[1]).compile()
  elif tagging:
    run, baseline = rewritten(graph), compile_tagged(graph, target, leaves)
  else:
    baseline = jax.jit(target.compiles(run, leaves), compiler_options=target.options() or None
                       ).lower(*target.place(leaves)).compile()
  return Written(run, jitted, baseline, xla_footprint(baseline), in_place, one_program,
                 graph if tagging else None)


def graphs(closed, target: Target, planner, name: str, graph: Graph | None = None,
           leaves=(), written: Written | None = None
           ) -> tuple[Graph, tuple[int, ...] | None, Graph, object]:
  """``(graph, loop, planned, planner)`` for the traced step ``closed`` (of
  the user's function ``name``, called on flat ``leaves``; ``graph`` its
  graph where built already): the step's graph, the loop or ``shard_map``
  its passes run in (or None), the graph planned (that body there; modelled
  for the target, and for one of its devices where ``leaves`` lie on
  several: the target compiler's partition of them) and
  the planner (a given plan's host placements moved onto the graph)."""
  graph = build_graph(closed) if graph is None else graph
  fittable(graph, name)
  loop = inner_body(graph)
  mapped = loop is not None and graph.nodes[loop[0]].prim.name == "shard_map"
  if loop is None and devices_of(leaves) > 1:
    planned = _per_device(graph, target, tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding,
                             weak_type=jax.typeof(a).weak_type)
        for a in target.place(leaves)))
  elif loop is None and written is not None and written.tagged is graph:
    planned = _read(graph, written.baseline, target.profile)
  else:
    planned = modelled(graph if loop is None else body_graph(graph, loop), target,
                       graph.nodes[loop[0]].params["mesh"] if mapped else None)
  if loop is None:
    graph = planned
    if isinstance(planner, Fixed):
      planned, given = apply_host_decisions(planned, planner.plan_given)
      planner = dataclasses.replace(planner, plan_given=given)
  return graph, loop, planned, planner


def emitted(written: Written, graph: Graph, loop: tuple[int, ...] | None,
            candidate: Candidate) -> Callable:
  """The step over flat leaves that runs ``candidate`` (a plan of ``graph``,
  or of the body that the path ``loop`` reaches): the step as ``written``
  where the plan changes nothing, which is never above the budget the step
  as written meets."""
  if not changes(candidate, graph):
    return written.run
  schedule = candidate.schedule
  return emit(schedule if loop is None else embedded(graph, loop, schedule))


def changes(candidate: Candidate, graph: Graph) -> bool:
  """Whether running ``candidate`` changes the step: its plan does, or
  ``graph`` (the step's, around a loop's planned body) keeps optimizer
  state in host memory."""
  return candidate.changes_step or bool(graph.hosted)


def looped(graph: Graph) -> bool:
  """Whether the step's passes run in a loop of its own (micro-batches,
  gradient accumulation over a ``lax.scan``), not under a ``shard_map``."""
  loop = inner_body(graph)
  return loop is not None and graph.nodes[loop[0]].prim.name == "scan"


def modelled(graph: Graph, target: Target, mesh=None) -> Graph:
  """``graph`` (the body of a ``shard_map`` over ``mesh``, where given) with
  the buffers its target's compiler gives it where the target is a GPU; on
  XLA:CPU the memory model emulates its fusion. One graph per ``graph``,
  target and mesh: the fits of a step (the quick one, then the one that
  seeks the smallest footprint) plan the same graph, and what its
  analyses and the planners' memos hold serves them all."""
  if target.platform == "cpu":
    return graph
  return _learned(graph, target, mesh)


@analysis
def _per_device(graph: Graph, target: Target, args: tuple) -> Graph:
  """``graph`` (of a step whose flat arguments, abstract as ``args``, lie
  on several devices) as one device of the target compiler's partition
  runs it, once per graph, target and arguments' shardings: each
  value's bytes that device's shard and, on a GPU, the buffers that
  device's program gives them, the collectives' among them (an FSDP or
  tensor-parallel step's gathered activations, held where the program
  holds them), read off one compilation."""
  compiled = partitioned(graph, args, target)
  known = shard_elements(graph, args, compiled)
  planned = per_device(graph, known)
  if target.platform == "cpu":
    return planned
  return _learned_from(planned, compiled, target.profile, elements(graph, known))


@analysis
def _learned(graph: Graph, target: Target, mesh) -> Graph:
  learned = _read(graph, tagged_program(graph, target, mesh), target.profile)
  if mesh is not None:  # a shard_map's body: its loops' bodies stay emulated
    return learned
  bodies = loop_bodies(graph, target)
  return dataclasses.replace(learned, buffers=dataclasses.replace(learned.buffers,
                                                                  bodies=bodies))


@analysis
def _read(graph: Graph, tagged, profile) -> Graph:
  """:func:`_learned_from`, once per graph, program and profile."""
  return _learned_from(graph, tagged, profile)


def _learned_from(graph: Graph, tagged, profile, elements=None) -> Graph:
  """``graph`` with the buffers its tagged compilation ``tagged`` gives it
  (and the time model's scale to its clock on ``profile``, where given);
  ``elements``: where ``tagged`` is one device's program of a partitioned
  step, each value's elements on that device."""
  return timed(with_buffers(graph, read(graph, tagged, elements)), tagged, profile)


def target_clock(target: Target) -> Callable | None:
  """The predicted seconds of a compiled program on a GPU target's profile
  (``_xla_clock``); None on XLA:CPU, where plans keep the planner's cost."""
  if target.platform == "cpu" or target.profile is None:
    return None
  return lambda compiled: program_time(compiled.as_text(), target.profile).seconds
