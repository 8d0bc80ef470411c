"""The recompute greedy's descent from the exact planner's lowest plan,
refined with 24-400 evaluations, against the greedy's own search from
nothing, at the fallback's aim (same model and budget as fb_compare.py).

  JAX_PLATFORMS=cpu PYTHONPATH=.:tests:benchmarks python \
      benchmarks/results/planning-mobilenetv2-t4-fallback/fb_refine.py 13015084 mobilenetv2
"""
import sys, time
import jax
import jaxmem
from jaxmem._zoo import models
from benchmarks._steps import task as zoo_task
from jaxmem.targets import placed
from jaxmem.planners import _ilp
budget, name = int(sys.argv[1]), sys.argv[2]
def patched(self, graph, lowest, aim):
  g = self._recompute_greedy()
  descent = g.descended(graph, lowest.plan).aimed(aim)
  for ev in (24, 64, 160, 400):
    t = time.perf_counter(); r = g.refined(graph, descent, aim, ev); s = time.perf_counter() - t
    print(f"refined {ev:4d} fits {r.fits} peak {r.peak} decisions {len(r.plan)} cost {self.cost(r.schedule)/1e10:.4f}  {s:.1f}s", flush=True)
  t = time.perf_counter(); r = g.plan(graph, aim); s = time.perf_counter() - t
  print(f"greedy own fits {r.fits} peak {r.peak} decisions {len(r.plan)} cost {self.cost(r.schedule)/1e10:.4f}  {s:.1f}s", flush=True)
  sys.exit(0)
_ilp.ILP._fallback_plan = patched
t = zoo_task(name, dict(models().CPU_SIZES[name]))
shapes = placed(jax.eval_shape(t.init), "t4")
jaxmem.transform(t.step, budget=budget, target="t4", reserve=0).fit(*shapes)
