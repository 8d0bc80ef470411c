"""Mistakes in the user's step or arguments get jax.jit's errors, which name
the user's function and the argument or output path, never jaxmem's
wrappers (issue 20, part 4)."""

import re

import jax
import jax.numpy as jnp
import pytest

import jaxmem


def step(w, x):
  g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
  return {"w": w - g, "tag": "not an array"}


def _message(fun, *args) -> str:
  with pytest.raises(TypeError) as error:
    fun(*args)
  return str(error.value)


def test_an_output_that_is_not_an_array_is_named_by_its_path():
  w, x = jnp.eye(8), jnp.ones((4, 8))
  got = _message(jaxmem.transform(step, budget="100%"), w, x)
  assert "function step at" in got and "['tag']" in got
  assert "flat_fun" not in got and "jaxmem" not in got
  assert got == _message(jax.jit(step), w, x)


class NotAPytree:
  """An object jax does not know how to flatten (as an Equinox module is
  without Equinox's registration)."""


def test_an_argument_that_is_not_an_array_is_named_by_its_path():
  fine = lambda w, x: w - jax.grad(lambda w: jnp.sum(x @ w))(w)
  got = _message(jaxmem.transform(fine, budget="100%"), NotAPytree(), jnp.ones(3))
  assert re.search(r"passed to the function at path w\b", got)
  assert "static_argnums" in got  # says how to fix it


def test_an_unknown_planner_is_refused_with_the_choices():
  with pytest.raises(ValueError, match=r"unknown planner 'greedy'; expected one of "
                                       r"\['auto', 'hybrid', 'ilp', 'lgm'.*'recompute'\]"):
    jaxmem.transform(step, budget="50%", planner="greedy")
  with pytest.raises(TypeError, match="planner must be a name in .* got int"):
    jaxmem.transform(step, budget="50%", planner=3)


def test_the_error_and_the_transform_name_their_public_home():
  """A traceback names ``jaxmem.BudgetError`` (what to catch), not the
  private module that defines it; a transformed step's repr likewise."""
  import traceback
  with pytest.raises(jaxmem.BudgetError) as err:
    jaxmem.Budget.parse("sixty")
  assert traceback.format_exception_only(err.type, err.value)[0].startswith(
      "jaxmem.BudgetError: jaxmem: cannot read budget")
  assert repr(jaxmem.transform(lambda w: w, budget="60%")).startswith("<jaxmem.Transformed ")
