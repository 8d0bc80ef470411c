import logging, sys, time, cProfile
import jax
logging.basicConfig(filename=sys.argv[2], format="%(relativeCreated)8.0f %(message)s")
logging.getLogger("jaxmem").setLevel("DEBUG")
import jaxmem
from jaxmem._zoo import models
from jaxmem.targets import placed
from benchmarks._steps import task
budget = sys.argv[1]
t0 = task("mobilenetv2", dict(models().CPU_SIZES["mobilenetv2"]))
shapes = placed(jax.eval_shape(t0.init), "t4")
t = time.perf_counter()
pr = cProfile.Profile(); pr.enable()
try:
  fit = jaxmem.transform(t0.step, budget=budget, target="t4").fit(*shapes)
  res = f"footprint {fit.footprint} predicted {fit.predicted}"
except jaxmem.BudgetError as e:
  res = "error smallest %d" % e.smallest
pr.disable(); pr.dump_stats(sys.argv[2] + ".prof")
print(budget, res, "%.1f s" % (time.perf_counter() - t), flush=True)
