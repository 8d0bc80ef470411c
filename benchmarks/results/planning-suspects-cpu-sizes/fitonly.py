"""One transform's fit of a zoo model at its CPU size, timed in its process.

  JAX_PLATFORMS=cpu PYTHONPATH=.:benchmarks python fitonly.py MODEL BUDGET
"""
import sys, time
import jax
import jaxmem
from jaxmem._zoo import models
from benchmarks._steps import task
t0 = task(sys.argv[1], dict(models().CPU_SIZES[sys.argv[1]]))
args = jax.block_until_ready(t0.init())
t = time.perf_counter()
fit = jaxmem.transform(t0.step, budget=sys.argv[2]).fit(*args)
print(sys.argv[1], sys.argv[2], "fit %.2f" % (time.perf_counter() - t))
