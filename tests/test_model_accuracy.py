"""The memory model's peak against XLA's footprint on every zoo model.

At the zoo's small, activation-dominated sizes (``CPU_SIZES``) the
untransformed step's model peak over XLA:CPU's compiled footprint lies in a
band per model, asserted at what is true today. The model sits under XLA
where XLA:CPU packs temporaries less tightly than their live ranges
(GPT-2's attention); the fit loop closes that gap from
the compiled footprint, so the band is a claim about the model alone.
"""

import jax
import pytest

import jaxmem
import jaxmem_models as models
from jaxmem.cost._evaluate import unplanned_liveness
from jaxmem.graph._graph import build_graph
from jaxmem.planners import ILP
from jaxmem.schedule._emit import emit
from jaxmem.targets import xla_footprint
from tests.helpers import some_slow

# model / XLA, measured on XLA:CPU (jax 0.10.2): gpt2 0.80, vit 0.89,
# mobilenetv2 0.90, unet 1.01, resnet18 0.97, resnet_deep 0.99; vgg 0.85
# (XLA:CPU holds more of the plain conv stack's backward pass than the model
# counts: an open gap the fit loop closes from the compiled footprint).
BANDS = {
    "gpt2": (0.78, 1.0),
    "vit": (0.87, 1.0),
    "mobilenetv2": (0.88, 1.0),
    "unet": (0.99, 1.03),
    "resnet18": (0.95, 1.0),
    "resnet_deep": (0.97, 1.01),
    "vgg": (0.83, 0.88),
}


def test_every_zoo_model_at_cpu_size_has_a_band():
  assert set(BANDS) == set(models.CPU_SIZES)


# CI checks four models; the other three (16-36 s each there) are model-scale.
@pytest.mark.parametrize("name", some_slow(sorted(BANDS), ("mobilenetv2", "vgg", "resnet_deep")))
def test_model_peak_over_xla_footprint_stays_in_its_band(name):
  task = models.get(name, **models.CPU_SIZES[name])
  args = jax.jit(task.init)()
  model = jaxmem.analyze(task.step, *args).peak
  xla = xla_footprint(jax.jit(task.step).lower(*args).compile())
  low, high = BANDS[name]
  assert low <= model / xla <= high, (name, model, xla, model / xla)


def test_a_unets_plans_stay_near_xla_with_its_max_pools_iotas():
  """XLA:CPU expands a max-pool's gradient with iotas of the operand's
  positions, made at the program's start and held until the operand exists
  to reduce them with. A small U-Net's exact plans at 70% and 60% of its
  model peak come within 12% of XLA's footprint (0.82 and 0.71 where the
  model held the iotas only while the gradient runs)."""
  task = models.get("unet", width=8, depth=2, size=32, batch=4)
  args = jax.eval_shape(task.init)
  graph = build_graph(jax.make_jaxpr(task.step)(*args))
  leaves, planner = jax.tree_util.tree_leaves(args), ILP()
  for fraction in (0.7, 0.6):
    found = planner.plan(graph, int(unplanned_liveness(graph).peak * fraction))
    assert found.fits
    xla = xla_footprint(jax.jit(emit(found.schedule)).lower(*leaves).compile())
    assert abs(found.peak / xla - 1) <= 0.12, (fraction, found.peak, xla)
