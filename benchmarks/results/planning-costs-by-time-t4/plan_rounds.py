"""The default planner's first two plans of a zoo model at its CPU size, at
70% then 50% of the memory model's peak of the step as written, planning
only (one planner, as a fit keeps one): seconds, fit, peak and cost.

  JAX_PLATFORMS=cpu PYTHONPATH=.:tests:benchmarks python \\
      benchmarks/results/planning-costs-by-time-t4/plan_rounds.py MODEL GRAPH

GRAPH: ``t4`` (the memory model learned from XLA:GPU's program for a T4,
compiled here, plans costed by predicted time on it), ``cpu-t4`` (XLA:CPU's
emulated fusion, plans costed by predicted time on a T4) or ``cpu`` (emulated,
costed by recomputed FLOPs).
"""
import sys
import time

import jax

from benchmarks._steps import task
from jaxmem._zoo import models
from jaxmem.cost._evaluate import unplanned_liveness
from jaxmem.fit._traced import modelled
from jaxmem.graph._graph import build_graph
from jaxmem.planners import get_planner
from jaxmem.targets import resolve

name, kind = sys.argv[1], sys.argv[2]
t = task(name, dict(models().CPU_SIZES[name]))
graph = build_graph(jax.make_jaxpr(t.step)(*jax.eval_shape(t.init)))
profile = None
if kind.startswith("cpu-"):
  profile = resolve(kind[4:], ()).profile
elif kind != "cpu":
  target = resolve(kind, ())
  graph, profile = modelled(graph, target), target.profile
base = unplanned_liveness(graph).peak
planner = get_planner("auto", profile)
out = [name, kind]
for fraction in (0.7, 0.5):
  began = time.perf_counter()
  found = planner.plan(graph, int(base * fraction))
  out.append("%.0f%%: %.2fs fits=%s peak=%.3f cost=%.6g" % (
      fraction * 100, time.perf_counter() - began, found.fits, found.peak / base,
      planner.cost(found.schedule)))
print(" | ".join(out), flush=True)
