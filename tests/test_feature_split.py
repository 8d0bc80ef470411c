"""Layers' features in chunks: the backward pass between a convolution that
makes features and the one that contracts them runs over chunks of those
features, its forward work rebuilt per chunk (``graph._feature_axes``,
``schedule._microbatch``, ``fit._features``, ``fit._micro``).

Checked here, on a small CNN with BatchNorm in training mode (whose batch
cannot be split): the layers found are each block's first convolution (its
last's features join the residual stream; the head's reach the loss), the
expansion of a MobileNetV2 block through its depthwise convolution;
split, each gives the untransformed step's gradients and batch statistics;
the chunked backward pass reads the block's input whole and holds no
buffer of zeros for the input gradient it adds up; a transform whose
budget no plan of the step meets splits the features, within the budget by
XLA's footprint, with the step's numbers over three steps (Adam, donated
state); a saved plan reloads its chunks.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmem
from jaxmem.graph._axis_rules import RULES
from jaxmem.graph._feature_axes import feature_layers, split_features
from jaxmem.graph._graph import build_graph
from jaxmem.graph._split import NotSplittable
from jaxmem.schedule._microbatch import micro_batched
from jaxmem.targets import xla_footprint
from tests.helpers import assert_donated_steps_match, assert_trees_close

WIDTH, SIZE, BATCH = 8, 16, 8


def _conv(x):
  # No bias before BatchNorm, which takes any away (its gradient, zero but for
  # rounding, would be all Adam's update reads).
  return nn.Conv(WIDTH, (3, 3), use_bias=False)(x)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.relu(nn.BatchNorm(use_running_average=False)(_conv(x)))
    y = nn.BatchNorm(use_running_average=False)(_conv(y))
    return nn.relu(x + y)


class _Inverted(nn.Module):
  """MobileNetV2's block: its expansion's features run through a depthwise
  convolution (a group per feature) to the projection that sums them."""
  @nn.compact
  def __call__(self, x):
    norm = lambda y: nn.BatchNorm(use_running_average=False)(y)
    y = nn.relu(norm(nn.Conv(4 * WIDTH, (1, 1), use_bias=False)(x)))
    y = nn.relu(norm(nn.Conv(4 * WIDTH, (3, 3), feature_group_count=4 * WIDTH,
                             use_bias=False)(y)))
    return x + norm(nn.Conv(WIDTH, (1, 1), use_bias=False)(y))


class _CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.BatchNorm(use_running_average=False)(_conv(x)))
    x = _Inverted()(_Block()(_Block()(x)))
    return nn.Dense(10)(x.mean(axis=(1, 2)))


def _loss(params, stats, images, labels):
  logits, new = _CNN().apply({"params": params, "batch_stats": stats}, images,
                             mutable=["batch_stats"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), new


def _batch():
  images = jax.random.normal(jax.random.key(0), (BATCH, SIZE, SIZE, 3))
  return images, jax.random.randint(jax.random.key(1), (BATCH,), 0, 10)


def _variables():
  return _CNN().init(jax.random.key(2), _batch()[0])


def _gradients(params, stats, images, labels):
  (loss, new), grads = jax.value_and_grad(_loss, has_aux=True)(params, stats, images, labels)
  return grads, new, loss


def _graph():
  variables, batch = _variables(), _batch()
  args = (variables["params"], variables["batch_stats"], *batch)
  leaves, tree = jax.tree_util.tree_flatten(args)
  flat = lambda *xs: jax.tree_util.tree_leaves(_gradients(*jax.tree_util.tree_unflatten(tree, xs)))
  return flat, leaves, build_graph(jax.make_jaxpr(flat)(*leaves))


def _splits(graph):
  found = {}
  for layer in feature_layers(graph):
    try:
      found[graph.nodes[layer].readable] = split_features(graph, layer)
    except NotSplittable as why:
      found[graph.nodes[layer].readable] = why
  return found


def test_each_blocks_first_convolution_splits():
  _, _, graph = _graph()
  splits = _splits(graph)
  split = {name for name, s in splits.items() if not isinstance(s, Exception)}
  assert split == {"_CNN/_Block_0/Conv_0", "_CNN/_Block_1/Conv_0", "_CNN/_Inverted_0/Conv_0"}, (
      splits)
  assert "contracts" in str(splits["_CNN/_Block_0/Conv_1"])  # the residual stream
  assert "contracts" in str(splits["_CNN/Dense_0"])  # the loss reads the logits
  for name in split:
    s = splits[name]
    assert s.batch in (WIDTH, 4 * WIDTH) and s.rebuilt
    assert any(graph.nodes[i].backward for i in s.region)
    # The forward work is rebuilt from the block's input, which is read whole.
    assert not any(graph.values[v].nbytes >= BATCH * SIZE * SIZE * 4 for v in s.inputs)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_split_features_give_the_step_gradients(k):
  flat, leaves, graph = _graph()
  want = jax.jit(flat)(*leaves)
  for name, split in _splits(graph).items():
    if not isinstance(split, Exception):
      assert_trees_close(jax.jit(micro_batched(split, k))(*leaves), want, rtol=1e-5, atol=1e-6)


def test_the_input_gradient_adds_up_from_the_residual_branch():
  """The first convolution's input gradient, summed over the chunks, starts
  from the residual branch's gradient it is added to: the loop's carry is
  that value, not a buffer of zeros made before the loop."""
  _, leaves, graph = _graph()
  split = next(s for s in _splits(graph).values() if not isinstance(s, Exception))
  jaxpr = jax.make_jaxpr(micro_batched(split, 4))(*leaves).jaxpr
  loop = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
  made = {v: e for e in jaxpr.eqns for v in e.outvars}
  carries = loop.invars[loop.params["num_consts"]:][:loop.params["num_carry"]]
  large = [v for v in carries if v.aval.size >= BATCH * SIZE * SIZE]
  assert large and all(made[v].primitive.name != "broadcast_in_dim" for v in large)


def test_convolution_rules_follow_features():
  _, _, graph = _graph()
  conv = next(n for n in graph.nodes if n.prim.name == "conv_general_dilated" and not n.backward)
  lhs, rhs, out = conv.params["dimension_numbers"]
  shapes = [graph.values[a].aval.shape for a in conv.ins]
  outs = [graph.values[o].aval.shape for o in conv.outs]
  made = RULES["conv_general_dilated"](conv, [None, rhs[0]], shapes, outs)
  assert made.outs == (out[1],) and made.combine is None
  contracted = RULES["conv_general_dilated"](conv, [lhs[1], None], shapes, outs)
  assert contracted.combine == "add" and contracted.demand == ((1, rhs[1]),)


def _adam_task():
  variables, batch = _variables(), _batch()
  # eps 1e-3 (optax's default is 1e-8): Adam's update is about
  # lr * sign(grad) where eps is small beside |grad|, so a BatchNorm scale
  # whose gradient is rounding noise moves by +-lr on that noise alone, and
  # a split step sums its chunks in another order (it flipped 2 of 32).
  optimizer = optax.adam(1e-3, eps=1e-3)
  state = (variables["params"], variables["batch_stats"], optimizer.init(variables["params"]))

  def step(state, images, labels):
    params, stats, opt = state
    grads, new, loss = _gradients(params, stats, images, labels)
    updates, opt = optimizer.update(grads, opt, params)
    return (optax.apply_updates(params, updates), new["batch_stats"], opt), loss
  return step, (state, *batch)


def _below_the_plans_floor(step, args, **options):
  """A budget between the smallest footprint plans reach and the smallest
  with features split (by transforms with ``options``)."""
  copy = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)
  with pytest.raises(jaxmem.BudgetError) as plans:
    jaxmem.transform(step, budget=1, micro_batches=1, reserve=0, **options).fit(
        copy(args[0]), *args[1:])
  with pytest.raises(jaxmem.BudgetError) as features:
    jaxmem.transform(step, budget=1, reserve=0, **options).fit(copy(args[0]), *args[1:])
  assert features.value.smallest < plans.value.smallest
  return (plans.value.smallest + features.value.smallest) // 2


def test_transform_splits_features_where_no_plan_fits(tmp_path):
  step, args = _adam_task()
  # Donating as the fit below does: its step, forms and plans are compiled once.
  budget = _below_the_plans_floor(step, args, donate_argnums=0)
  copy = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)
  fitted = jaxmem.transform(step, budget=budget, reserve=0, donate_argnums=0)
  assert fitted.can_fit(copy(args[0]), *args[1:])  # the quick check splits them too
  fit = fitted.fit(copy(args[0]), *args[1:])
  assert fit.micro is not None and fit.micro.features and fit.micro.count > 1
  assert "chunked features" in fit.report() and "feature_chunks=" in repr(fit)
  assert xla_footprint(fitted.lower(copy(args[0]), *args[1:]).compile()) <= budget
  assert_donated_steps_match(fitted, step, args)
  path = tmp_path / "plan.json"
  fitted.save_plan(path, copy(args[0]), *args[1:])
  assert json.loads(path.read_text())["region"] == "features"
  again = jaxmem.transform(step, budget=budget, reserve=0, plan=path, donate_argnums=0).fit(
      copy(args[0]), *args[1:])
  assert again.micro == fit.micro and again.footprint == fit.footprint


def test_a_split_step_keeps_its_module_paths():
  """A step emitted again names each equation as the step did, those
  inlined from calls (``jax.nn.relu``'s ``custom_jvp``) included, so the
  next layer's split, found again in the new step, stays in its module."""
  from jaxmem.fit._features import features_step
  flat, leaves, graph = _graph()
  traced, layers = features_step(jax.make_jaxpr(flat)(*leaves), 2)
  assert sorted(layers) == sorted(graph.nodes[i].label for i in feature_layers(graph)
                                  if "_CNN/_" in graph.nodes[i].readable
                                  and graph.nodes[i].readable.endswith("Conv_0"))
  top = lambda g: sum(n.readable == "<top>" for n in g.nodes if not n.backward)
  assert top(build_graph(traced)) <= top(graph)
