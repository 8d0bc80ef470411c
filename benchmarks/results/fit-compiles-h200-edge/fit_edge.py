"""One fit of a zoo model at the GPU check's edge size for an H200, compiled
here (a compile-only device), timed beside jax.jit's compile of the step
for it, with the backend compilations the fit makes and its log.

  PYTHONPATH=.:benchmarks JAX_PLATFORMS=cpu python \
      benchmarks/results/fit-compiles-h200-edge/fit_edge.py MODEL BUDGET LOG

MODEL: a key of ``benchmarks/gpu.py``'s CONFIGS; BUDGET: as ``transform``
takes it (``70%``: of the step's footprint for an H200).
"""

import logging
import sys
import time

import jax
from jax import monitoring

import jaxmem
from jaxmem._zoo import models
from jaxmem.targets import placed, timing_profile
from gpu import CONFIGS

COMPILES = [0]
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: COMPILES.__setitem__(0, COMPILES[0] + ("backend_compile" in name)))


def main(name: str, budget: str, log: str) -> None:
  logging.basicConfig(filename=log, filemode="w", format="%(relativeCreated)8.0f %(message)s")
  logging.getLogger("jaxmem").setLevel("INFO")
  config = dict(CONFIGS[name])
  task = models().get(config.pop("zoo", name), **config)
  shapes = placed(jax.eval_shape(task.init), "h200")
  timing_profile("h200")  # the probe of how XLA:GPU schedules copies, once a process
  began = time.perf_counter()
  jax.jit(task.step).lower(*shapes).compile(
      compiler_options={"xla_gpu_enable_triton_gemm": False})  # as jaxmem compiles for it
  jit_s = time.perf_counter() - began
  COMPILES[0] = 0
  began = time.perf_counter()
  try:
    fit = jaxmem.transform(task.step, budget=budget, target="h200").fit(*shapes)
    outcome = (f"fits at {fit.footprint} bytes, predicted {fit.predicted * 1e3:.2f} ms "
               f"(as written {fit.unconstrained_predicted * 1e3:.2f} ms)")
  except jaxmem.BudgetError as err:
    outcome = f"fails, smallest named {err.smallest} bytes"
  fit_s = time.perf_counter() - began
  print(f"{name} at {budget}: jax.jit compile for h200 {jit_s:.1f} s; fit {fit_s:.1f} s "
        f"({fit_s / jit_s:.2f}x), {COMPILES[0]} compilations; {outcome}")


if __name__ == "__main__":
  main(*sys.argv[1:4])
