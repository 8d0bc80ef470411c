"""The runtime reserve: bytes of the budget kept free beyond XLA's footprint.

On a GPU the allocator's peak exceeds XLA's compiled footprint by the
runtime's workspaces (measured on an H200: up to 92 MB), so a plan judged by
the footprint alone exceeded four budgets. The fit loop holds the footprint
to ``budget - reserve``; CPU has no reserve by default, and these tests set
one explicitly.
"""

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.targets import runtime_reserve, xla_footprint


def _step(w, x):
  def loss(w):
    h = x
    for _ in range(12):
      h = h + jnp.tanh(h @ w)
    return jnp.sum(h * h)
  return w - 0.01 * jax.grad(loss)(w)


W, X = jnp.eye(64) * 0.5, jnp.ones((512, 64))


def _plain() -> int:
  return xla_footprint(jax.jit(_step).lower(W, X).compile())


def test_defaults():
  assert runtime_reserve("cpu") == 0
  assert runtime_reserve("gpu") == runtime_reserve("tpu") == 128 * 2**20


def test_footprint_is_held_under_budget_less_reserve():
  plain = _plain()
  budget, reserve = int(0.8 * plain), int(0.15 * plain)
  fitted = jaxmem.transform(_step, budget=budget, reserve=reserve)
  fit = fitted.fit(W, X)
  assert xla_footprint(fitted.lower(W, X).compile()) <= budget - reserve
  assert fit.budget == budget and fit.reserve == reserve
  assert "kept for the runtime" in fit.report()
  assert jnp.allclose(fitted(W, X), jax.jit(_step)(W, X), rtol=1e-5, atol=1e-6)


def test_error_names_the_smallest_budget_with_the_reserve():
  plain = _plain()
  reserve = plain // 4
  with pytest.raises(jaxmem.BudgetError, match="kept free") as info:
    jaxmem.transform(_step, budget=int(0.3 * plain), reserve=reserve).fit(W, X)
  smallest = info.value.smallest
  fitted = jaxmem.transform(_step, budget=smallest, reserve=reserve)
  assert xla_footprint(fitted.lower(W, X).compile()) <= smallest - reserve


def test_budget_within_the_reserve_and_bad_reserves_are_errors():
  with pytest.raises(jaxmem.BudgetError, match="leaves nothing"):
    jaxmem.transform(_step, budget=1000, reserve=1000).fit(W, X)
  with pytest.raises(jaxmem.BudgetError, match="reserve must be"):
    jaxmem.transform(_step, budget="50%", reserve=-1)
