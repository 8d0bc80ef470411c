"""Libra's greedy refinement: a plan that fits gives back, wherever the
peak stays within the aim, what it does not need. A plan taken for a looser
aim (a ladder run's, every block checkpointed) otherwise recomputes or
moves to the host everything it did on its way down.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> from jaxmem.cost._evaluate import recomputable
  >>> def step(w, x):
  ...   def f(w):
  ...     h = x
  ...     for _ in range(4):
  ...       h = h + jnp.tanh(h @ w)
  ...     return jnp.sum(h)
  ...   return jax.grad(f)(w)
  >>> g = build_graph(jax.make_jaxpr(step)(jnp.eye(64), jnp.ones((256, 64))))
  >>> everything = Plan.of({v: RECOMPUTE for v in recomputable(g)})
  >>> given = refined(g, candidate(g, everything, aim=10**9), 10**9, evaluations=24)
  >>> len(given.plan.values_with("recompute")) < len(everything.values_with("recompute"))
  True
"""

from __future__ import annotations

import dataclasses

from jaxmem._decisions import KEEP, OFFLOAD, RECOMPUTE, Chunked, Plan
from jaxmem.cost._evaluate import Candidate, candidate, evaluate
from jaxmem.planners._blocks import segments
from jaxmem.schedule._loop_segments import segmentable
from jaxmem.schedule._scan_remat import rebuildable


def kept_copies(graph, result: Candidate, aim: int, evaluations: int) -> Candidate:
  """The refinement of an offload-only plan that fits: offloaded residuals
  are kept on the device again wherever the peak stays within
  ``aim``, the largest copies first, within ``evaluations`` evaluations. A
  ladder plan taken for a looser aim otherwise moves every byte it
  moved on its way to the lowest peak. A loop's hosted stacks first give
  back their last layers (:func:`_layers_back`)."""
  result = _layers_back(graph, result, aim)
  moved = sorted(result.plan.values_with("offload"),
                 key=lambda v: (-graph.values[v].nbytes, v))
  return _give_back(graph, result, aim, "offload", [[v] for v in moved], evaluations)


def refined(graph, result: Candidate, aim: int, evaluations: int) -> Candidate:
  """Libra's greedy refinement of a plan that fits: recomputed residuals
  are kept again wherever the peak stays within ``aim``, whole blocks
  first, then one by one, the costliest rebuilds per byte first (matmul
  and convolution outputs before elementwise ones), within
  ``evaluations`` evaluations. A plan that overshot
  (a ladder or block plan taken for a looser aim) gives back the
  recomputation it does not need. A loop whose stacks are rebuilt per
  iteration first keeps its last layers' stacks again, as many as the
  aim allows (:func:`_layers_back`)."""
  result = _layers_back(graph, result, aim)
  dropped = result.plan.values_with("recompute")
  blocks = [[v for v in seg.drops if v in dropped] for seg in segments(graph)]
  costly = sorted(dropped, key=lambda v: (-graph.producer(v).flops
                                           / max(graph.values[v].nbytes, 1), v))
  return _give_back(graph, result, aim, "recompute",
                    [b for b in blocks if b] + [[v] for v in costly], evaluations)


def _give_back(graph, result: Candidate, aim: int, kind: str, groups: list,
               evaluations: int) -> Candidate:
  """``result`` with each group's residuals still of ``kind`` kept on the
  device again, in order, wherever the peak stays within ``aim``,
  within ``evaluations`` evaluations."""
  plan, schedule, memory = result.plan, result.schedule, result.memory
  tries = 0
  for group in groups:
    if tries >= evaluations:
      break
    group = [v for v in group if plan[v].kind == kind]
    if not group:
      continue
    tries += 1
    trial = plan
    for vid in group:
      trial = trial.with_decision(vid, KEEP)
    t_schedule, t_memory = evaluate(graph, trial)
    if t_memory.peak <= aim:
      plan, schedule, memory = trial, t_schedule, t_memory
  return dataclasses.replace(result, plan=plan, schedule=schedule, memory=memory)


def _layers_back(graph, result: Candidate, aim: int) -> Candidate:
  """Per-layer plans: for each loop whose stacks ``result`` rebuilds
  (per iteration or nested), or keeps in host memory, only the first
  layers' stacks are rebuilt (hosted) and the rest kept (the loop then
  runs in two segments, ``_loop_segments``): the fewest such layers that
  keep the peak within ``aim``."""
  rebuilt_ok = rebuildable(graph)
  for forward, stacks in segmentable(graph).items():
    length = graph.nodes[forward].params["length"]
    for decision in (RECOMPUTE, OFFLOAD):
      plan = result.plan
      if decision is RECOMPUTE:
        moved = ([v for v in stacks if v in rebuilt_ok]
                 if any(plan[v].kind == "recompute" for v in stacks) else [])
        # A layer input the plan rebuilt (the loop nested) is kept again.
        back = {v: KEEP for v in stacks
                if v not in rebuilt_ok and plan[v].kind == "recompute"}
      else:
        moved, back = [v for v in stacks if plan[v].kind == "offload"], {}
      for cut in sorted({length // 4, length // 2, 3 * length // 4} - {0, length}):
        if not moved:
          break
        chunks = Chunked(0, ((0, cut), (cut, length)), (decision, KEEP))
        trial = Plan.of({**plan.as_dict(), **back, **{v: chunks for v in moved}})
        found = candidate(graph, trial, aim)
        if found.fits:
          result = dataclasses.replace(result, plan=trial, schedule=found.schedule,
                                       memory=found.memory)
          break
  return result
