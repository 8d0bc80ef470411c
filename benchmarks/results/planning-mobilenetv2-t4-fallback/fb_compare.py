"""Where the exact planner falls back (MobileNetV2 at its zoo CPU size, a T4
target, BYTES with no reserve), four ways to the first plan compared on the
same graph and aim; exits after printing them.

  JAX_PLATFORMS=cpu PYTHONPATH=.:tests:benchmarks python \
      benchmarks/results/planning-mobilenetv2-t4-fallback/fb_compare.py 13015084 mobilenetv2
"""
import sys, time
from jaxmem.planners import _ilp
from fb_fit import fit_with_fallback
orig = _ilp.ILP._fallback_plan
def patched(self, graph, lowest, aim):
  g = self._recompute_greedy()
  t = time.perf_counter(); descent = g.descended(graph, lowest.plan).aimed(aim); td = time.perf_counter() - t
  print(f"lowest peak {lowest.peak} cost {self.cost(lowest.schedule):.4g}; descent peak {descent.peak} fits {descent.fits} in {td:.1f}s", flush=True)
  out = {}
  t = time.perf_counter(); r = g.refined(graph, descent, aim); out['refined descent'] = (r, time.perf_counter() - t)
  t = time.perf_counter(); r = self.fallback.plan(graph, aim, start=descent.plan); out['hybrid from descent'] = (r, time.perf_counter() - t)
  t = time.perf_counter(); r = self.fallback.plan(graph, aim, start=lowest.plan); out['hybrid from lowest'] = (r, time.perf_counter() - t)
  t = time.perf_counter(); r = orig(self, graph, lowest, aim); out['orig'] = (r, time.perf_counter() - t)
  for k, (r, s) in out.items():
    print(f"{k:22s} fits {r.fits} peak {r.peak} decisions {len(r.plan)} offloads {len(r.plan.values_with('offload'))} cost {self.cost(r.schedule)*1e3:.4f} ms  {s:.1f}s", flush=True)
  sys.exit(0)
fit_with_fallback(patched)
