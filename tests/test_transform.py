"""transform(): same numbers as the untransformed step, footprint within budget."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmem
from jaxmem._decisions import RECOMPUTE
from jaxmem.targets import xla_footprint
import jaxmem_models as models
from tests.helpers import assert_trees_close, xla_budget

# Activation-dominated sizes (as a memory budget bites in practice): with
# Adam's parameters and states small beside the residuals, 50% is reachable.
SMALL = {
    "mlp": dict(depth=16, width=64, batch=512, features=32),
    "cnn": dict(widths=(8, 16), batch=8, size=16, blocks=6),
    "transformer": dict(depth=2, dim=32, heads=2, seq=32, batch=16, vocab=64),
}


def run_steps(step, state, batch, n=3):
  outs = []
  for _ in range(n):
    state, loss = step(state, batch)
    outs.append((state, loss))
  return outs


def check_fits_and_matches(step, args, budget, steps=3):
  """Transforms ``step`` and checks footprint and numbers; returns the plan."""
  fitted = jaxmem.transform(step, budget=budget)
  plan = fitted.fit(*args)
  compiled = fitted.lower(*args).compile()
  footprint = xla_footprint(compiled)
  assert footprint == plan.footprint
  # The budget as the user means it, from XLA's footprint of the step.
  assert plan.budget == xla_budget(step, args, budget)
  assert footprint <= plan.budget, (footprint, plan.budget)
  # The memory model predicts the planned step too, not only the original:
  # within 12% (its error varies from plan to plan: 7% and 10% on two plans
  # for the small transformer at 70%, 0-3% on the MLP). In micro-batches,
  # it models one micro-batch, which holds less than the whole step.
  assert plan.micro is not None or abs(plan.memory.peak - footprint) <= 0.12 * footprint, (
      plan.memory.peak, footprint)
  state, batch = args
  want = run_steps(jax.jit(step), state, batch, steps)
  got = run_steps(fitted, state, batch, steps)
  assert_trees_close(got, want)
  return plan


@pytest.fixture(scope="module", params=sorted(SMALL))
def task(request):
  # Adam with eps 1e-3 (optax's default is 1e-8): Adam divides each update
  # by sqrt(v) + eps, so with a tiny eps a parameter whose gradient is zero in
  # exact arithmetic (attention's key bias: softmax ignores a shift shared by
  # a query's logits) moves by +-lr on rounding noise alone, and any change
  # in XLA's evaluation order (which recomputation is) changes that noise.
  # The footprint is Adam's either way.
  task = models.get(request.param, optimizer=optax.adam(1e-3, eps=1e-3),
                    **SMALL[request.param])
  return task, task.init()


# 50% is model-scale work on 2 cores (15-45 s a model); CI's low budgets are
# the smallest-budget search below and tests/test_written_steps.py's.
@pytest.mark.parametrize("budget", ["100%", "70%", pytest.param("50%", marks=pytest.mark.slow)])
def test_budget_is_met_and_numbers_match(task, budget):
  task, args = task
  plan = check_fits_and_matches(task.step, args, budget)
  if budget != "100%":
    assert len(plan.plan) > 0
    assert plan.added_flops > 0
  assert len(plan.report()) <= 2000 and len(repr(plan)) <= 2000  # a screen


def test_on_xla_cpu_a_kept_fused_residual_reads_its_rebuilt_source_as_made():
  """On XLA:CPU a kept residual XLA computes inside its backward readers
  (BatchNorm's normalized input, a ReLU's mask) is computed there from the
  forward buffers it reads, which so live on even where a plan rebuilds
  them: the schedule reads those as made instead of rebuilding them for
  their own backward reads too. Rebuilding them puts the CNN's smallest
  plan at 52% of its footprint instead of 50% (its 50% case above, slow)."""
  from jaxmem.cost._evaluate import fused_values
  from jaxmem.graph._graph import build_graph
  from jaxmem.graph._xla_cpu_fusion import readable
  task = models.get("cnn", **SMALL["cnn"])
  graph = build_graph(jax.make_jaxpr(task.step)(*jax.eval_shape(task.init)))
  fused = fused_values(graph)
  sources = {b for v, bufs in fused.items() if graph.is_residual(v)
             for b in bufs if graph.is_residual(b)}
  assert sources
  assert all(readable(graph, fused, {b}, set())(b) for b in sources)


def test_report_is_a_screen_and_lists_all_when_asked():
  """The default report (an LGM plan's: residuals and vTensor swaps) fits
  in 2,000 characters; ``top=None`` gives every residual and swap."""
  task = models.get("transformer", **SMALL["transformer"])
  args = task.init()
  fit = jaxmem.transform(task.step, budget="60%", planner="lgm").fit(*args)
  short, whole = fit.report(), fit.report(top=None)
  assert len(short) <= 2000 and "report(top=None) lists" in short
  records = fit.result.details.records
  assert records and f"LGM planner's vTensor swaps: {len(records)} tensors" in short
  assert "lists" not in whole
  assert all(r.name[:40] in whole for r in records)
  assert all(r.name in whole for r in fit.graph.residuals)


# The CNN's and the transformer's searches for their smallest footprint
# compile some twenty plans (about two minutes each on CI's two cores):
# model-scale checks CI leaves out (tests/test_written_steps.py searches a
# scanned transformer's smallest in CI).
@pytest.mark.parametrize("task", ["mlp", pytest.param("transformer", marks=pytest.mark.slow),
                                  pytest.param("cnn", marks=pytest.mark.slow)],
                         indirect=True)
def test_smallest_feasible_budget_fits_and_matches(task):
  task, args = task
  fitted = jaxmem.transform(task.step, budget=1)
  with pytest.raises(jaxmem.BudgetError, match="smallest footprint it reaches") as info:
    fitted.fit(*args)
  smallest = info.value.smallest
  assert f"Pass budget >= {smallest} bytes" in str(info.value)
  plan = check_fits_and_matches(task.step, args, smallest)
  # The least reached: nothing comes under it, and the plan that reached it fits.
  assert plan.footprint == smallest < plan.unconstrained


def test_memory_model_tracks_xla_on_the_flax_models(task):
  """Unconstrained: the model's peak within 10% of XLA's footprint."""
  task, args = task
  analysis = jaxmem.analyze(task.step, *args)
  xla = xla_footprint(jax.jit(task.step).lower(*args).compile())
  assert abs(analysis.peak - xla) <= 0.1 * xla, (analysis.peak, xla)


def test_memory_model_tracks_xla_on_a_residual_mlp():
  """Model within 10% of XLA's footprint, unconstrained and planned."""
  # Activations (0.5 MiB each) outweigh weights (0.25 MiB each) here, as in
  # the configuration measured in the issue note.
  w = [jnp.eye(256) * 0.01 + 0.001 * i for i in range(16)]
  x = jnp.ones((512, 256))

  def step(params, x):
    def loss(params):
      h = x
      for p in params:
        h = h + jnp.tanh(h @ p)
      return jnp.sum(h ** 2)
    l, g = jax.value_and_grad(loss)(params)
    return [p - 0.1 * gi for p, gi in zip(params, g)], l

  for budget in ["100%", "70%", "60%"]:
    plan = check_fits_and_matches(step, (w, x), budget, steps=1)
    assert abs(plan.unconstrained_model - plan.unconstrained) <= 0.1 * plan.unconstrained
    assert abs(plan.memory.peak - plan.footprint) <= 0.1 * plan.footprint


def test_random_ops_recompute_from_the_same_key():
  """Dropout masks rebuilt in the backward pass replay the same key: with
  every residual recomputed, the rewritten step re-runs random-bit equations
  and still gives the untransformed step's numbers."""
  from jaxmem.schedule._emit import emit
  from jaxmem.cost._evaluate import recomputable
  from jaxmem.schedule._schedule import build_schedule

  task = models.get("transformer", **SMALL["transformer"])
  state, batch = task.init()
  graph = jaxmem.analyze(task.step, state, batch).graph
  plan = jaxmem.Plan.of({v: RECOMPUTE for v in recomputable(graph)})
  schedule = build_schedule(graph, plan)
  rerun = {graph.nodes[op.node].prim.name
           for op in schedule.ops if op.kind == "recompute"}
  assert rerun & {"random_bits", "threefry2x32"}, sorted(rerun)
  got = jax.jit(emit(schedule))(*jax.tree_util.tree_leaves(((state, batch), {})))
  want = jax.tree_util.tree_leaves(jax.jit(task.step)(state, batch))
  assert_trees_close(got, want)


@pytest.mark.parametrize("optimizer", ["clip+adamw", "adam"])
def test_a_planned_step_draws_each_mask_where_the_step_uses_it(optimizer):
  """XLA:CPU schedules a random draw, which reads only a key, where it
  likes: without a barrier it draws every dropout mask of a planned step at
  its start and holds them all through the forward pass (on this Flax MLP
  of six residual layers with dropout 0.1, the smallest plan's footprint
  is then 78% of the step's, XLA's 1.79x the memory model's). Each draw waits
  for the last array computed before it that is read after it: the
  smallest is under 60% (49% measured), and XLA's footprint within 15% of
  the model's. With plain Adam each parameter's update runs as soon as its
  gradient exists, and a recomputation's barrier copy of an update is made
  that early: a draw waiting for such a copy drew its mask there (78%, XLA
  1.39x the model), so draws wait only for equations run."""
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
      for _ in range(6):
        x = x + nn.Dense(128)(nn.LayerNorm()(jax.nn.silu(x)))
        x = nn.Dropout(0.1, deterministic=not train)(x)
      return nn.Dense(10)(x)

  x = jax.random.normal(jax.random.key(0), (512, 128))
  y = jax.random.randint(jax.random.key(1), (512,), 0, 10)
  tx = (optax.adam(1e-3) if optimizer == "adam"
        else optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
  params = Net().init(jax.random.key(2), x, train=False)["params"]

  def step(state, x, y):
    params, opt, key = state
    key, sub = jax.random.split(key)
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
        Net().apply({"params": p}, x, rngs={"dropout": sub}), y).mean()
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt, key), value

  args = ((params, tx.init(params), jax.random.key(3)), x, y)
  with pytest.raises(jaxmem.BudgetError) as err:
    jaxmem.transform(step, budget=1, micro_batches=1).fit(*args)
  fit = jaxmem.transform(step, budget=err.value.smallest, micro_batches=1).fit(*args)
  assert fit.footprint <= 0.6 * fit.unconstrained, (fit.footprint, fit.unconstrained)
  assert fit.footprint <= 1.15 * fit.memory.peak * fit.unconstrained / fit.unconstrained_model


def test_nnx_step():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(8)])

    def __call__(self, x):
      for layer in self.layers:
        x = x + jnp.tanh(layer(x))
      return x

  model = Net(nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tx = optax.sgd(0.1)
  opt = tx.init(params)

  def step(state, x):
    params, opt = state
    def loss(p):
      return jnp.mean(nnx.merge(graphdef, p)(x) ** 2)
    l, g = jax.value_and_grad(loss)(params)
    upd, opt = tx.update(g, opt, params)
    return (optax.apply_updates(params, upd), opt), l

  check_fits_and_matches(step, ((params, opt), jnp.ones((256, 32))), "75%")


def test_plain_jax_step_with_static_and_donated_args():
  def step(w, x, scale):
    def loss(w):
      h = x
      for _ in range(8):
        h = h + jnp.sin(h @ w)
      return jnp.sum(h * scale)
    return w - 0.1 * jax.grad(loss)(w)

  w, x = jnp.eye(64) * 0.5, jnp.ones((512, 64))
  want = jax.jit(step, static_argnums=2)(w, x, 2.0)
  fitted = jaxmem.transform(step, budget="80%", static_argnums=2, donate_argnums=0)
  plan = fitted.fit(w, x, 2.0)
  assert plan.footprint <= xla_budget(lambda w, x: step(w, x, 2.0), (w, x), "80%")
  got = fitted(jnp.array(w), x, 2.0)
  assert_trees_close(got, want)
  assert fitted.lower(w, x, 2.0).compile().memory_analysis() is not None


def test_step_without_backward_pass_is_returned_unchanged():
  step = lambda x: jnp.sin(x) * 2
  fitted = jaxmem.transform(step, budget="50%")
  with pytest.warns(UserWarning, match="no backward pass"):
    with pytest.raises(jaxmem.BudgetError, match="smallest footprint"):
      fitted(jnp.ones(1024))
  fitted = jaxmem.transform(step, budget="100%")
  with pytest.warns(UserWarning, match="no backward pass"):
    assert_trees_close(fitted(jnp.ones(8)), step(jnp.ones(8)))


def test_user_state_is_not_mutated():
  task = models.get("mlp", **SMALL["mlp"])
  state, batch = task.init()
  before = jax.tree.map(lambda x: x.copy(), state)
  jaxmem.transform(task.step, budget="70%")(state, batch)
  assert_trees_close(state, before)
