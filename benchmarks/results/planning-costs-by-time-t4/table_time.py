"""The exact planner's table for a zoo model at its CPU size on a GPU target's learned
memory model (every column priced), then its plan at 70%: seconds per column.

  JAX_PLATFORMS=cpu PYTHONPATH=.:tests:benchmarks python \\
      benchmarks/results/planning-costs-by-time-t4/table_time.py MODEL TARGET
"""
import sys, time
import jax
from jaxmem._zoo import models
from benchmarks._steps import task
from jaxmem.graph._graph import build_graph
from jaxmem.fit._traced import modelled
from jaxmem.targets import resolve
from jaxmem.planners import get_planner
from jaxmem.cost._evaluate import unplanned_liveness
name, tgt = sys.argv[1], sys.argv[2]
t = task(name, dict(models().CPU_SIZES[name]))
target = resolve(tgt, ())
g = modelled(build_graph(jax.make_jaxpr(t.step)(*jax.eval_shape(t.init))), target)
p = get_planner("auto", target.profile)
b = time.perf_counter(); tab = p.table(g); tt = time.perf_counter() - b
b = time.perf_counter(); c = p.plan(g, int(unplanned_liveness(g).peak * 0.7)); tp = time.perf_counter() - b
print(name, tgt, "table %.2f s (%d columns, %.1f ms each)" % (tt, tab.priced, tab.seconds / max(tab.priced, 1) * 1e3), "plan 70%% %.2f s" % tp, "cost %.6g" % p.cost(c.schedule), flush=True)
