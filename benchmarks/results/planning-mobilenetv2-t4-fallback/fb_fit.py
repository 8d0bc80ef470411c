"""What fb_compare.py and fb_refine.py share: the fit of MobileNetV2 (or the
zoo model named) at BYTES for a T4 with no reserve, with the exact
planner's fallback replaced by ``patched`` (which prints and exits).

  <script> BYTES MODEL
"""
import sys

import jax
import jaxmem
from jaxmem._zoo import models
from benchmarks._steps import task as zoo_task
from jaxmem.targets import placed
from jaxmem.planners import _ilp


def fit_with_fallback(patched):
  budget, name = int(sys.argv[1]), sys.argv[2]
  _ilp.ILP._fallback_plan = patched
  t = zoo_task(name, dict(models().CPU_SIZES[name]))
  shapes = placed(jax.eval_shape(t.init), "t4")
  jaxmem.transform(t.step, budget=budget, target="t4", reserve=0).fit(*shapes)
