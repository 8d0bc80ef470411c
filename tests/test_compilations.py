"""What a transform compiles: a budget the step as written meets costs the
one compilation jax.jit makes; an impossible budget fails at once the
second time."""

import jax
import jax.numpy as jnp
from jax import monitoring
import pytest

import jaxmem
from tests.helpers import tanh_step

_COMPILES: list = []
_COUNTING = [False]


def _listen(name, secs, **kwargs):
  if _COUNTING[0] and "backend_compile" in name:
    _COMPILES.append(name)


monitoring.register_event_duration_secs_listener(_listen)


def compiles(fn, *args):
  """``fn(*args)``'s result, with the backend compilations it made."""
  _COMPILES.clear()
  _COUNTING[0] = True
  try:
    out = jax.block_until_ready(fn(*args))
  finally:
    _COUNTING[0] = False
  return out, len(_COMPILES)


def _step(w, x):
  return tanh_step(w, x, layers=6, lr=1e-3)


@pytest.fixture(scope="module")
def args():
  return jax.block_until_ready((jnp.eye(64) * 0.1, jnp.ones((512, 64))))


def test_a_budget_the_step_meets_compiles_once(args):
  want, plain = compiles(jax.jit(_step), *args)
  fitted = jaxmem.transform(_step, budget="100%")
  got, made = compiles(fitted, *args)
  assert plain == 1 and made == 1
  assert not len(fitted.fit(*args).plan)
  assert jnp.array_equal(got, want)
  _, again = compiles(fitted, *args)
  assert again == 0


def test_a_donated_step_is_measured_undonated(args):
  # The budget is a fraction of the step's footprint without donation, a
  # second program: two compilations, the donated one serving the calls.
  fitted = jaxmem.transform(_step, budget="100%", donate_argnums=0)
  w, x = jnp.array(args[0]), args[1]
  _, made = compiles(fitted, w, x)
  assert made == 2
  assert w.is_deleted()


def test_a_second_impossible_budget_fails_at_once(args):
  step = lambda w, x: _step(w, x)  # a step of its own: nothing remembered yet
  with pytest.raises(jaxmem.BudgetError) as first:
    jaxmem.transform(step, budget="10%").fit(*args)
  # Another transform of the same step, under the smallest footprint named:
  # the same error, no compilation.
  fitted = jaxmem.transform(step, budget="20%")
  _COMPILES.clear()
  _COUNTING[0] = True
  try:
    with pytest.raises(jaxmem.BudgetError) as second:
      fitted.fit(*args)
  finally:
    _COUNTING[0] = False
  assert not _COMPILES
  assert second.value.smallest == first.value.smallest
  assert not fitted.can_fit(*args)
  # A budget at the smallest named is still planned, and fits.
  assert jaxmem.transform(step, budget=first.value.smallest).can_fit(*args)


def test_a_saved_plan_reloads_to_the_same_program(args, tmp_path):
  fitted = jaxmem.transform(_step, budget="60%")
  fit = fitted.fit(*args)
  assert len(fit.plan)
  path = tmp_path / "plan.json"
  fitted.save_plan(path)
  again = jaxmem.transform(_step, budget="60%", plan=path)
  refit = again.fit(*args)
  assert refit.plan == fit.plan
  assert refit.footprint == fit.footprint
  assert [op.kind for op in refit.memory.schedule.ops] == [
      op.kind for op in fit.memory.schedule.ops]
  assert refit.attempts == 1 and "saved plan" in refit.report()
  assert jnp.array_equal(again(*args), fitted(*args))
  # Planned for other shapes: refused, and the error says why.
  with pytest.raises(ValueError, match="made for another step"):
    again.fit(args[0], jnp.ones((256, 64)))
  # A budget the saved plan does not meet names the plan's footprint.
  with pytest.raises(jaxmem.BudgetError):
    jaxmem.transform(_step, budget=fit.footprint - 1, plan=path).fit(*args)


def test_a_planned_budget_compiles_the_step_and_at_most_two_plans(args):
  # The first plan aims a little under the budget's share, and a looser
  # plan is compiled only where the steps compiled so far say it may fit.
  fitted = jaxmem.transform(lambda w, x: _step(w, x), budget="70%")
  _, made = compiles(fitted.fit, *args)
  assert len(fitted.fit(*args).plan)
  assert made <= 3, made  # the step as written, then plans
