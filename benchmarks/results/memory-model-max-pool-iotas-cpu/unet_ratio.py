"""The memory model's peak against XLA:CPU's footprint for the zoo's U-Net:
the step as written, then the exact planner's plans at 70%, 60% (and 50%)
of its model peak, each emitted and compiled.

  JAX_PLATFORMS=cpu PYTHONPATH=.:benchmarks python unet_ratio.py
  CFG='{"width": 8, "depth": 2, "size": 32, "batch": 4}' ... (a smaller U-Net)
"""
import json
import os

import jax

from benchmarks._steps import task
from jaxmem._decisions import Plan
from jaxmem._zoo import models
from jaxmem.cost._evaluate import candidate, unplanned_liveness
from jaxmem.graph._graph import build_graph
from jaxmem.planners import ILP
from jaxmem.schedule._emit import emit
from jaxmem.targets import xla_footprint

t = task("unet", json.loads(os.environ.get("CFG", json.dumps(dict(models().CPU_SIZES["unet"])))))
args = jax.eval_shape(t.init)
g = build_graph(jax.make_jaxpr(t.step)(*args))
leaves = jax.tree_util.tree_leaves(args)
base = unplanned_liveness(g).peak
p = ILP()
for f in [1.0, 0.7, 0.6, 0.5]:
  c = candidate(g, Plan()) if f == 1.0 else p.plan(g, int(base * f))
  xla = xla_footprint(jax.jit(emit(c.schedule)).lower(*leaves).compile())
  print("%.1f model %.2f xla %.2f ratio %.3f" % (f, c.peak / 2**20, xla / 2**20, c.peak / xla), flush=True)
