"""One fit for a T4 compiled here, timed beside jax.jit's compile of the
step for a T4, with the backend compilations the fit makes.

  PYTHONPATH=.:tests:benchmarks JAX_PLATFORMS=cpu python \
      benchmarks/results/fit-compilations-t4/fit_times.py MODEL BUDGET

MODEL: a zoo model at its CPU size, or ``test-mlp`` (the residual MLP of
``tests/test_target_fits.py``, Adam, at ``tests.test_target.SMALL``'s size).
"""

import sys
import time

import jax
import optax
from jax import monitoring

import jaxmem
from jaxmem.targets import placed, timing_profile

COMPILES = [0]
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: COMPILES.__setitem__(0, COMPILES[0] + ("backend_compile" in name)))


def task_of(name: str):
  if name == "test-mlp":
    import jaxmem_models as models
    from tests.test_target import SMALL
    return models.get("mlp", optimizer=optax.adam(1e-3, eps=1e-3), **SMALL["mlp"])
  from jaxmem._zoo import models
  from benchmarks._steps import task
  return task(name, dict(models().CPU_SIZES[name]))


def main(name: str, budget: str) -> None:
  t = task_of(name)
  args = t.init()
  timing_profile("t4")  # the probe of how XLA:GPU schedules copies, once a process
  began = time.perf_counter()
  jax.jit(t.step).lower(*placed(jax.eval_shape(t.init), "t4")).compile()
  jit_s = time.perf_counter() - began
  COMPILES[0] = 0
  began = time.perf_counter()
  try:
    fit = jaxmem.transform(t.step, budget=budget, target="t4").fit(*args)
    outcome = f"fits at {fit.footprint} bytes"
  except jaxmem.BudgetError as err:
    outcome = f"fails, smallest named {err.smallest} bytes"
  fit_s = time.perf_counter() - began
  print(f"{name} at {budget}: jax.jit compile for t4 {jit_s:.1f} s; fit {fit_s:.1f} s "
        f"({fit_s / jit_s:.2f}x), {COMPILES[0]} compilations; {outcome}")


if __name__ == "__main__":
  main(*sys.argv[1:3])
