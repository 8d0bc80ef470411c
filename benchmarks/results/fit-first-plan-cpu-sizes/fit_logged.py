"""One fit of a zoo model at its CPU size beside jax.jit's compile of the
step, in one process, with the fit's log (every plan and compilation) kept.

  JAX_PLATFORMS=cpu PYTHONPATH=.:benchmarks python fit_logged.py MODEL BUDGET LOG
"""
import logging
import sys
import time

import jax

logging.basicConfig(filename=sys.argv[3], filemode="w", format="%(relativeCreated)8.0f %(message)s")
logging.getLogger("jaxmem").setLevel("DEBUG")

import jaxmem  # noqa: E402
from jaxmem._zoo import models  # noqa: E402
from benchmarks._steps import task  # noqa: E402

t0 = task(sys.argv[1], dict(models().CPU_SIZES[sys.argv[1]]))
args = jax.block_until_ready(t0.init())
t = time.perf_counter()
jax.jit(t0.step).lower(*args).compile()
tj = time.perf_counter() - t
t = time.perf_counter()
fit = jaxmem.transform(t0.step, budget=sys.argv[2]).fit(*args)
tf = time.perf_counter() - t
print(sys.argv[1], sys.argv[2], "jit %.2f fit %.2f ratio %.2f" % (tj, tf, tf / tj))
