"""A 20-budget sweep of the exact planner on one zoo model at its CPU size
(95% to 30% of the step's model peak): seconds and cost per budget, JSON.

  JAX_PLATFORMS=cpu PYTHONPATH=.:benchmarks python sweep.py MODEL 0.01
"""
import sys, time, json
import jax, numpy as np
from benchmarks._steps import task
from jaxmem._zoo import models
from jaxmem.graph._graph import build_graph
from jaxmem.planners import ILP
from jaxmem.cost._evaluate import unplanned_liveness
name, gap = sys.argv[1], float(sys.argv[2])
t = task(name, dict(models().CPU_SIZES[name]))
graph = build_graph(jax.make_jaxpr(t.step)(*jax.eval_shape(t.init)))
base = unplanned_liveness(graph).peak
p = ILP(mip_gap=gap)
out = []
tot = 0
for f in np.linspace(0.95, 0.3, 20):
  b = time.perf_counter(); c = p.plan(graph, int(base * f)); d = time.perf_counter() - b; tot += d
  out.append((round(float(f), 3), round(d, 2), bool(c.fits), float(p.cost(c.schedule))))
print(json.dumps(dict(name=name, gap=gap, total=tot, rows=out)))
