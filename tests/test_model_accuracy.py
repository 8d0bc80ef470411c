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
from jaxmem.targets import xla_footprint

# model / XLA, measured on XLA:CPU (jax 0.10.2): gpt2 0.80, vit 0.89,
# mobilenetv2 0.90, unet 0.94, resnet18 0.97, resnet_deep 0.99; vgg 0.73
# (XLA:CPU holds more of the plain conv stack's backward pass than the model
# counts: an open gap the fit loop closes from the compiled footprint).
BANDS = {
    "gpt2": (0.78, 1.0),
    "vit": (0.87, 1.0),
    "mobilenetv2": (0.88, 1.0),
    "unet": (0.92, 1.0),
    "resnet18": (0.95, 1.0),
    "resnet_deep": (0.97, 1.01),
    "vgg": (0.70, 0.76),
}


def test_every_zoo_model_at_cpu_size_has_a_band():
  assert set(BANDS) == set(models.CPU_SIZES)


@pytest.mark.parametrize("name", sorted(BANDS))
def test_model_peak_over_xla_footprint_stays_in_its_band(name):
  task = models.get(name, **models.CPU_SIZES[name])
  args = jax.jit(task.init)()
  model = jaxmem.analyze(task.step, *args).peak
  xla = xla_footprint(jax.jit(task.step).lower(*args).compile())
  low, high = BANDS[name]
  assert low <= model / xla <= high, (name, model, xla, model / xla)
