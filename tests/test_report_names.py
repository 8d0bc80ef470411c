"""Reports name residuals by module path and the user's own source line,
whole (issue 20, part 5): a residual made inside Flax is named by the line
of the user's code that called the layer, not by a site-packages line, and
names are not cut."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxmem

THIS = pathlib.Path(__file__).name


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)  # LAYERNORM
    h = nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
    return x + nn.relu(nn.Dense(16)(h))  # RELU


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Block()(Block()(x))


def _report():
  model, x = Net(), jnp.ones((2, 8, 16))
  params = model.init(jax.random.key(0), x)
  step = lambda p, x: jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(p)
  return jaxmem.analyze(step, params, x)


def _line(marker: str) -> int:
  text = pathlib.Path(__file__).read_text().splitlines()
  return next(i + 1 for i, line in enumerate(text) if line.endswith(f"# {marker}"))


def test_residuals_made_in_a_library_name_the_users_line():
  residuals = _report().residuals
  assert residuals and all("site-packages" not in r.name for r in residuals)
  norms = [r.name for r in residuals if "/LayerNorm_0 " in r.name]
  assert norms and all(f"{THIS}:{_line('LAYERNORM')}" in n for n in norms), norms
  relus = [r.name for r in residuals if r.primitive == "gt"]  # relu's mask
  assert relus and all(n.startswith("Net/Block_") and f"{THIS}:{_line('RELU')}" in n
                       for n in relus), relus


def test_the_report_shows_names_whole():
  analysis = _report()
  report = analysis.report(top=None)
  longest = max((r.name for r in analysis.residuals), key=len)
  assert len(longest) > 70 and longest in report


def test_the_peak_of_a_step_no_module_names_is_named_by_its_line():
  """Where no module names the equation at the peak (plain JAX, an NNX
  model), the report's ``peak at`` gives its source line; a Flax module's
  path names it alone."""
  def loss(w, x):
    h = x
    for _ in range(4):
      h = h + jnp.tanh(h @ w)
    return jnp.sum(h ** 2)
  step = lambda w, x: w - 0.1 * jax.grad(loss)(w, x)  # noqa: E731
  peak = jaxmem.analyze(step, jnp.eye(64), jnp.ones((256, 64))).memory.peak_name
  assert peak.startswith("<top> ") and f"{THIS}:" in peak, peak
  flax_peak = _report().memory.peak_name
  assert flax_peak.startswith("Net/") and THIS not in flax_peak, flax_peak
