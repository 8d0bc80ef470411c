"""The recompute greedy's descent from the exact planner's lowest plan,
refined with 24-400 evaluations, against the greedy's own search from
nothing, at the fallback's aim (same model and budget as fb_compare.py).

  JAX_PLATFORMS=cpu PYTHONPATH=.:tests:benchmarks python \
      benchmarks/results/planning-mobilenetv2-t4-fallback/fb_refine.py 13015084 mobilenetv2
"""
import sys, time
from fb_fit import fit_with_fallback
def patched(self, graph, lowest, aim):
  g = self._recompute_greedy()
  descent = g.descended(graph, lowest.plan).aimed(aim)
  for ev in (24, 64, 160, 400):
    t = time.perf_counter(); r = g.refined(graph, descent, aim, ev); s = time.perf_counter() - t
    print(f"refined {ev:4d} fits {r.fits} peak {r.peak} decisions {len(r.plan)} cost {self.cost(r.schedule)/1e10:.4f}  {s:.1f}s", flush=True)
  t = time.perf_counter(); r = g.plan(graph, aim); s = time.perf_counter() - t
  print(f"greedy own fits {r.fits} peak {r.peak} decisions {len(r.plan)} cost {self.cost(r.schedule)/1e10:.4f}  {s:.1f}s", flush=True)
  sys.exit(0)
fit_with_fallback(patched)
