"""planner='names': per-layer checkpoint policies over checkpoint_names, and
a plan written out as such a policy for the model's code."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxmem
from helpers import assert_trees_close
from jaxmem._decisions import KEEP, RECOMPUTE, Plan
from jaxmem.fit._policies import NotPolicies, name_policy
from jaxmem.graph._graph import build_graph
from jaxmem.cost._evaluate import candidate
from jaxmem.planners import Names, NoNames
from jaxmem.planners._names import (OFFLOADED, REBUILT, SAVE, choice_of, named_blocks,
                                    names_plan, offloadable)
from jaxmem.targets import xla_footprint

NAMES = ("up", "act", "down")


class Layer(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = checkpoint_name(nn.Dense(128)(x), "up")
    h = checkpoint_name(jax.nn.gelu(h), "act")
    return nn.LayerNorm()(x + checkpoint_name(nn.Dense(32)(h), "down"))


class Net(nn.Module):
  policy: object = None
  named: bool = True

  @nn.compact
  def __call__(self, x):
    layer = Layer if self.policy is None else nn.remat(Layer, policy=self.policy)
    for i in range(4):
      x = layer(name=f"Layer_{i}")(x) if self.named else x + nn.Dense(32)(jnp.tanh(x))
    return jnp.mean(x ** 2)


def train_step(net):
  opt = optax.adam(1e-3)

  def step(params, state, x):
    loss, grads = jax.value_and_grad(lambda p: net.apply(p, x))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  return step, opt


@pytest.fixture(scope="module")
def named():
  step, opt = train_step(Net())
  x = jax.random.normal(jax.random.key(1), (256, 32))
  params = Net().init(jax.random.key(0), x)
  args = (params, opt.init(params), x)
  return step, args, build_graph(jax.make_jaxpr(step)(*args))


def test_every_names_policy_is_read_back_from_its_plan(named):
  _, _, graph = named
  assert [seg.name for seg in named_blocks(graph)] == [f"Net/Layer_{i}" for i in range(4)]
  # "down" feeds a sum: no backward equation reads it, so it cannot be
  # offloaded (saved, it is where each layer's rebuild starts).
  assert offloadable(graph) == {"up", "act"}
  plans, choices = set(), []
  for places in itertools.product((SAVE, OFFLOADED, REBUILT), repeat=len(NAMES)):
    choice = dict(zip(NAMES, places))
    if any(p == OFFLOADED and n not in offloadable(graph) for n, p in choice.items()):
      continue
    choices.append(choice)
    plan = names_plan(graph, choice)
    plans.add(plan)
    assert choice_of(graph, plan) == choice
    policy = name_policy(graph, plan)
    assert policy.saved == tuple(n for n in NAMES if choice[n] == SAVE)
    assert policy.offloaded == tuple(n for n in NAMES if choice[n] == OFFLOADED)
    assert policy.layers == tuple(f"Net/Layer_{i}" for i in range(4))
  assert len(plans) == len(choices) == 3 * 3 * 2  # each choice its own plan


def test_a_names_fit_trains_as_written_and_its_policy_fits_in_the_model(named):
  step, args, _ = named
  fitted = jaxmem.transform(step, budget="75%", planner="names")
  fit = fitted.fit(*args)
  assert len(fit.plan) and fit.footprint <= fit.budget
  assert_trees_close(fitted(*args), jax.jit(step)(*args), rtol=1e-4, atol=1e-5)
  policy = fit.name_policy()
  assert policy.layers == tuple(f"Net/Layer_{i}" for i in range(4))
  # Some names saved, some rebuilt: the policy is neither extreme.
  assert policy.saved and set(policy.saved) | set(policy.offloaded) < set(NAMES)
  # Written into the model (nn.remat around each layer under the policy),
  # the step trains the same numbers and compiles to what jaxmem's version
  # of the plan compiles to, within a few percent (XLA schedules the two
  # programs a little differently).
  theirs, _ = train_step(Net(policy=policy))
  footprint = xla_footprint(jax.jit(theirs).lower(*args).compile())
  assert abs(footprint / fit.footprint - 1) <= 0.05, (footprint, fit.footprint)
  assert_trees_close(jax.jit(theirs)(*args), jax.jit(step)(*args), rtol=1e-4, atol=1e-5)


def test_plans_no_names_policy_gives_are_refused_with_the_way_out(named):
  _, _, graph = named
  lone = named_blocks(graph)[1].drops[0]
  with pytest.raises(NotPolicies, match="planner='names'"):
    name_policy(graph, Plan.of({lone: RECOMPUTE}))  # one residual rebuilt
  plan = names_plan(graph, {"up": REBUILT})
  rebuilt = next(v for v in named_blocks(graph)[0].drops if plan[v].kind == "recompute")
  with pytest.raises(NotPolicies, match="not those of the layers"):
    name_policy(graph, plan.with_decision(rebuilt, KEEP))
  with pytest.raises(NotPolicies, match="no checkpoint policy applies"):
    name_policy(graph, Plan())


def test_a_step_whose_layers_name_nothing_is_told_how_to_name_them():
  step, opt = train_step(Net(named=False))
  x = jnp.ones((64, 32))
  params = Net(named=False).init(jax.random.key(0), x)
  with pytest.raises(NoNames, match=r"checkpoint_name\(h, 'mlp_hidden'\).*planner='auto'"):
    jaxmem.transform(step, budget="50%", planner="names").fit(params, opt.init(params), x)


def test_names_the_aim_leaves_room_for_are_saved_again(named):
  _, _, graph = named
  planner = Names()
  rebuilt = {name: REBUILT for name in NAMES}
  start = candidate(graph, names_plan(graph, rebuilt), 10 ** 12)
  choice, found = planner._saved_again(graph, rebuilt, start, 10 ** 12)
  assert choice == {name: SAVE for name in NAMES} and found.fits
  # Where only the plan itself fits, nothing is saved again.
  choice, _ = planner._saved_again(graph, rebuilt, start.aimed(start.peak), start.peak)
  assert choice == rebuilt
