"""One fit of a zoo model at its CPU size for a T4 (XLA:GPU, compiled on
this machine) at a budget in bytes with no runtime reserve, as
``benchmarks/policies.py`` fits at a policy's own footprint; jaxmem's DEBUG
log (each plan, compilation and greedy step, with its milliseconds since
the start) and the result go to standard output.

  JAX_PLATFORMS=cpu PYTHONPATH=.:benchmarks python \\
      benchmarks/results/fit-policy-footprint-t4/fit_log.py BYTES MODEL > LOG
"""
import logging, sys, time
import jax
logging.basicConfig(level=logging.DEBUG, format="%(relativeCreated)8.0f %(name)s %(message)s",
                    stream=sys.stdout)
for name in ("jax", "absl"):
  logging.getLogger(name).setLevel(logging.WARNING)
import jaxmem
from jaxmem._zoo import models
from benchmarks._steps import task as zoo_task
from jaxmem.targets import placed
budget, name = int(sys.argv[1]), sys.argv[2]
t = zoo_task(name, dict(models().CPU_SIZES[name]))
shapes = placed(jax.eval_shape(t.init), "t4")
t0 = time.perf_counter()
try:
  fit = jaxmem.transform(t.step, budget=budget, target="t4", reserve=0).fit(*shapes)
  print("FIT", fit.footprint, fit.predicted, len(fit.plan), time.perf_counter() - t0)
except jaxmem.BudgetError as e:
  print("FAIL", e.smallest, time.perf_counter() - t0)
