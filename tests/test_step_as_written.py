"""The step as written is always a candidate (issue 20, part 3): a budget
the untransformed step meets gives that step back, unchanged, and no error
names a smallest footprint above it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.targets import xla_footprint
from jaxmem._flags import compiler_options


def _critic(ws, x):
  for w in ws:
    x = x + jnp.tanh(x @ w)
  return x


def gan(wd, wg, z, x):
  """Two gradients in sequence, the second through the first's update (the
  probe whose error once named 106% of the untransformed footprint)."""
  d = lambda wd, h: jnp.mean(_critic(wd, h) ** 2)
  grads_d = jax.grad(lambda wd: d(wd, _critic(wg, z)) - d(wd, x))(wd)
  wd = [w - 0.1 * g for w, g in zip(wd, grads_d)]
  grads_g = jax.grad(lambda wg: -d(wd, _critic(wg, z)))(wg)
  return wd, [w - 0.1 * g for w, g in zip(wg, grads_g)]


def mlp(ws, x):
  grads = jax.grad(lambda ws: jnp.sum(_critic(ws, x) ** 2))(ws)
  return [w - 0.01 * g for w, g in zip(ws, grads)]


def _weights(n):
  keys = jax.random.split(jax.random.key(0), n)
  return [jax.random.normal(k, (32, 32)) * 0.1 for k in keys]


STEPS = {
    "gan": (gan, lambda: (_weights(4), _weights(4), jnp.ones((256, 32)), jnp.ones((256, 32)))),
    "mlp": (mlp, lambda: (_weights(6), jnp.ones((256, 32)))),
}


def _unconstrained(step, args) -> int:
  options = compiler_options(jax.default_backend()) or None
  return xla_footprint(jax.jit(step, compiler_options=options).lower(*args).compile())


@pytest.mark.parametrize("name", STEPS)
def test_a_budget_the_step_meets_returns_the_step_unchanged(name):
  step, make = STEPS[name]
  args = make()
  budget = _unconstrained(step, args)
  fitted = jaxmem.transform(step, budget=budget)
  fit = fitted.fit(*args)
  assert not len(fit.plan)
  assert xla_footprint(fitted.lower(*args).compile()) == budget
  # The same program: the same bits.
  for got, want in zip(jax.tree_util.tree_leaves(fitted(*args)),
                       jax.tree_util.tree_leaves(jax.jit(step)(*args))):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", STEPS)
def test_no_error_names_a_smallest_above_the_step_as_written(name):
  step, make = STEPS[name]
  args = make()
  with pytest.raises(jaxmem.BudgetError) as error:
    jaxmem.transform(step, budget=1).fit(*args)
  assert error.value.smallest <= _unconstrained(step, args)
