"""The recompute greedy's steps: where a layer stack repeats, the moves of
one step that lower the peak as much per added cost are taken together."""

import jax
import jax.numpy as jnp
import pytest

from jaxmem import Greedy
from jaxmem._decisions import Plan
from jaxmem.cost._evaluate import unplanned_liveness
from jaxmem.graph._graph import build_graph


@pytest.fixture(scope="module")
def stack():
  """A 16-layer residual tanh MLP: every layer's residuals free as many
  bytes for as many FLOPs."""
  def step(ws, x):
    def loss(ws):
      h = x
      for w in ws:
        h = h + jnp.tanh(h @ w)
      return jnp.sum(h ** 2)
    return jax.grad(loss)(ws)
  ws = [jnp.eye(64) * 0.01 for _ in range(16)]
  return build_graph(jax.make_jaxpr(step)(ws, jnp.ones((512, 64))))


def test_tied_moves_are_taken_together_far_from_the_aim(stack):
  """At 70% of the peak, with tied moves taken together, the run takes
  fewer steps to a plan that fits at the same cost as one move a step."""
  aim = int(0.7 * unplanned_liveness(stack).peak)
  one, together = Greedy(tied=None), Greedy()
  alone, taken = one.plan(stack, aim), together.plan(stack, aim)
  assert taken.fits and alone.fits
  assert taken.steps < alone.steps, (taken.steps, alone.steps)
  assert together.cost(taken.schedule) == one.cost(alone.schedule)


def test_a_descent_takes_tied_moves_together(stack):
  """A descent toward the lowest peak (goal 0) from nothing reaches the
  same peak in fewer steps."""
  one, together = Greedy(tied=None), Greedy()
  alone, taken = one.descended(stack, Plan()), together.descended(stack, Plan())
  assert taken.steps < alone.steps and taken.peak == alone.peak
