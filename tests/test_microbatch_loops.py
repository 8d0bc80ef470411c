"""Micro-batching steps whose layers run in a loop (``lax.scan``, Flax's
``nn.scan``): ``graph._scan_axes`` and the loop run per chunk in
``schedule._microbatch``.

Checked here, each against the untransformed step's gradients and loss: a
loop's stacked weight gradients summed over the chunks; running totals in
a loop's carry (a shared weight's gradient, a sum that starts at 1) run on
from chunk to chunk; a dropout mask drawn inside the loop; a budget only
micro-batches meet, within it by XLA's footprint. (The zoo's GPT-2 with
``nn.scan`` blocks: ``tests/test_microbatch.py``.) And the refusals: a loop
over the examples themselves, and a loop that normalizes by the batch's
statistics.
"""

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.graph._batch_axes import NotSplittable, split_batch
from jaxmem.graph._graph import build_graph
from jaxmem.schedule._microbatch import micro_batched
from jaxmem.targets import xla_footprint
from tests.helpers import assert_trees_close

WIDTH, DEPTH, BATCH = 8, 3, 8


def _args():
  k = jax.random.split(jax.random.key(0), 3)
  ws = jax.random.normal(k[0], (DEPTH, WIDTH, WIDTH)) / WIDTH ** 0.5
  shared = jax.random.normal(k[1], (WIDTH, WIDTH)) / WIDTH ** 0.5
  return {"ws": ws, "shared": shared}, jax.random.normal(k[2], (BATCH, WIDTH))


def _stacked(params, x):
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["ws"])
  return jnp.sum(h ** 2)


def _shared(params, x):
  """Every iteration reads ``shared``: its gradient accumulates in the
  backward loop's carry. The forward loop adds each iteration's sum into a
  carry that starts at 1 (a running total, not a zero), and stacks each
  iteration's sum of squares."""
  def body(carry, w):
    h, total = carry
    return (jnp.tanh(h @ w + h @ params["shared"]), total + jnp.sum(h)), jnp.sum(h * h)
  (h, total), sums = jax.lax.scan(body, (x, jnp.float32(1.0)), params["ws"])
  return jnp.sum(h ** 2) + total + jnp.sum(sums)


def _dropout(params, x):
  keys = jax.random.split(jax.random.key(7), DEPTH)

  def body(h, wk):
    w, key = wk
    h = jnp.tanh(h @ w)
    return h * jax.random.bernoulli(key, 0.8, h.shape) / 0.8, None
  h, _ = jax.lax.scan(body, x, (params["ws"], keys))
  return jnp.mean(h ** 2)


def _grad_step(loss):
  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), value
  return step


def _flat_split(step, params, x):
  leaves, tree = jax.tree.flatten((params, x))
  flat = lambda *a: jax.tree.leaves(step(*jax.tree.unflatten(tree, a)))  # noqa: E731
  graph = build_graph(jax.make_jaxpr(flat)(*leaves))
  return flat, leaves, split_batch(graph, [(len(leaves) - 1,)])


@pytest.mark.parametrize("loss", [_stacked, _shared, _dropout], ids=lambda f: f.__name__[1:])
def test_a_loop_runs_per_micro_batch_with_the_steps_gradients(loss):
  params, x = _args()
  flat, leaves, split = _flat_split(_grad_step(loss), params, x)
  loops = [split.rules[i] for i in split.region if split.graph.nodes[i].prim.name == "scan"]
  assert len(loops) == 2  # the forward loop and its transpose, both per chunk
  if loss is _shared:  # the running totals run on from chunk to chunk
    assert all(loop.threads for loop in loops)
  want = jax.jit(flat)(*leaves)
  for k in (2, BATCH):
    assert_trees_close(jax.jit(micro_batched(split, k))(*leaves), want, rtol=1e-5)


def test_a_loop_over_the_examples_is_refused():
  def loss(w, x):
    total, _ = jax.lax.scan(lambda t, xi: (t + jnp.sum(jnp.tanh(xi @ w)), None), 0.0, x)
    return total
  with pytest.raises(NotSplittable, match="loops over the example axis"):
    _flat_split(_grad_step(loss), jnp.eye(WIDTH), _args()[1])


def test_a_loop_normalizing_by_the_batch_is_refused():
  """Each layer subtracts the batch's mean, as a scanned BatchNorm does."""
  def loss(params, x):
    def body(h, w):
      h = jnp.tanh(h @ w)
      return h - jnp.mean(h, axis=0), None
    h, _ = jax.lax.scan(body, x, params["ws"])
    return jnp.sum(h ** 2)
  params, x = _args()
  with pytest.raises(NotSplittable, match="reads a reduction over the examples at") as err:
    _flat_split(_grad_step(loss), {"ws": params["ws"]}, x)
  assert "test_microbatch_loops.py:" in str(err.value)  # where, in the user's code


def test_a_scanned_mlp_meets_a_budget_only_micro_batches_meet():
  def step(params, batch):
    def loss(ws):
      h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), batch["x"], ws)
      return jnp.mean((h - batch["y"]) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return params - 0.1 * grads, value
  keys = jax.random.split(jax.random.key(1), 3)
  params = jax.random.normal(keys[0], (8, 64, 64)) / 64
  batch = {"x": jax.random.normal(keys[1], (512, 64)), "y": jax.random.normal(keys[2], (512, 64))}
  fitted = jaxmem.transform(step, budget="25%")
  fit = fitted.fit(params, batch)
  assert fit.micro is not None and fit.micro.count >= 2
  assert xla_footprint(fitted.lower(params, batch).compile()) <= fit.budget
  want, got = (params, batch), (params, batch)
  for _ in range(3):
    want = (jax.jit(step)(*want)[0], batch)
    got = (fitted(*got)[0], batch)
  assert_trees_close(got[0], want[0], rtol=1e-4)
