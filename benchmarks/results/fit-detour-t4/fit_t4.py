"""One fit of a zoo model at its CPU size for a compile-only GPU target,
timed beside jax.jit's compile of the step for it, with the fit's log
(every plan and compilation) kept.

  JAX_PLATFORMS=cpu PYTHONPATH=.:benchmarks python \
      benchmarks/results/fit-detour-t4/fit_t4.py MODEL BUDGET TARGET LOG
"""
import logging
import sys
import time

import jax

logging.basicConfig(filename=sys.argv[4], filemode="w", format="%(relativeCreated)8.0f %(message)s")
logging.getLogger("jaxmem").setLevel("INFO")

import jaxmem  # noqa: E402
from jaxmem._zoo import models  # noqa: E402
from jaxmem.targets import placed  # noqa: E402
from benchmarks._steps import task  # noqa: E402

model, budget, target = sys.argv[1:4]
t0 = task(model, dict(models().CPU_SIZES[model]))
shapes = placed(jax.eval_shape(t0.init), target)
began = time.perf_counter()
jax.jit(t0.step).lower(*shapes).compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
jit_s = time.perf_counter() - began
began = time.perf_counter()
try:
  fit = jaxmem.transform(t0.step, budget=budget, target=target).fit(*shapes)
  outcome = (f"fits at {fit.footprint} bytes, predicted {fit.predicted * 1e3:.2f} ms "
             f"(as written {fit.unconstrained_predicted * 1e3:.2f} ms)")
except jaxmem.BudgetError as err:
  outcome = f"fails, smallest named {err.smallest} bytes"
fit_s = time.perf_counter() - began
print(f"{model} at {budget} for {target}: jax.jit compile {jit_s:.1f} s; fit {fit_s:.1f} s "
      f"({fit_s / jit_s:.2f}x); {outcome}")
