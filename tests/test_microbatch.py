"""Micro-batching: a step run over chunks of its batch with accumulated
gradients (``graph._batch_axes``, ``schedule._microbatch``, ``fit._micro``).

Checked here: the split follows the examples through the zoo's models and
gives the untransformed step's updates (gradients, through SGD) in two
micro-batches and one example at a time; BatchNorm in training mode refuses, with the
documented message; a transform whose budget only micro-batches meet runs
in as few as fit, within the budget by XLA's footprint, with the step's
numbers over three steps; dropout masks are drawn per chunk, with the
step's numbers; and the switches (``micro_batches=1`` and a
given count), saved plans and errors.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem
from jaxmem._zoo import models
from jaxmem.graph._batch_axes import NotSplittable, split_batch
from jaxmem.graph._graph import build_graph
from jaxmem.schedule._microbatch import micro_batched
from jaxmem.targets import xla_footprint
from tests.helpers import assert_trees_close, assert_updates_close, some_slow

M = models()

# The zoo's models at test sizes, each with an SGD step: its update is the
# gradient itself, so comparing updates compares gradients.
ZOO = {
    "gpt2": dict(dim=32, depth=2, heads=2, seq=16, vocab=64, batch=4),
    "vit": dict(dim=32, depth=2, heads=2, patch=4, size=16, batch=4),
    "transformer": dict(depth=2, dim=32, heads=2, seq=16, batch=4, vocab=64),
    "vgg": dict(size=32, batch=4),
    "unet": dict(width=8, size=16, batch=4),
}


def _flat(task):
  """The task's step over flat leaves, its leaves, and the argument groups
  (state, batch) as leaf positions."""
  state, batch = task.init()
  leaves, tree = jax.tree_util.tree_flatten((state, batch))
  n_state = len(jax.tree_util.tree_leaves(state))

  def step(*flat):
    return jax.tree_util.tree_leaves(task.step(*jax.tree_util.tree_unflatten(tree, flat)))

  return step, leaves, [tuple(range(n_state)), tuple(range(n_state, len(leaves)))]


def _split(step, leaves, groups):
  return split_batch(build_graph(jax.make_jaxpr(step)(*leaves)), groups, ["state", "batch"])


@pytest.mark.parametrize("name", some_slow(sorted(ZOO), ("vgg", "unet", "vit")))
def test_zoo_updates_match_the_step(name):
  task = M.get(name, optimizer=optax.sgd(0.5), **ZOO[name])
  step, leaves, groups = _flat(task)
  split = _split(step, leaves, groups)
  assert split.batch == ZOO[name]["batch"] and 2 in split.sizes()
  want = jax.jit(step)(*leaves)
  for k in (2, split.batch):
    got = jax.jit(micro_batched(split, k))(*leaves)
    # The outputs: the new state's leaves (each against its old value), the loss.
    assert_updates_close(got, want, leaves[:len(groups[0])] + [0.0], rtol=1e-4)


@pytest.mark.parametrize("name,config", [
    ("resnet18", dict(width=8, stages=(1, 1), size=16, batch=4)),
    ("cnn", dict(batch=4)),
])
def test_batchnorm_refuses(name, config):
  step, leaves, groups = _flat(M.get(name, **config))
  with pytest.raises(NotSplittable, match=r"BatchNorm in training mode") as err:
    _split(step, leaves, groups)
  assert "reduce_sum" in str(err.value) and ".py:" in str(err.value)  # where, in the model


def _mlp_step(params, batch):
  """An SGD step of a residual tanh MLP on ``batch = (x, y)``; its
  activations, not its parameters, make its footprint."""
  def loss(params):
    h = batch["x"]
    for w in params:
      h = h + jnp.tanh(h @ w)
    return jnp.mean((h - batch["y"]) ** 2)
  loss_value, grads = jax.value_and_grad(loss)(params)
  return [w - 0.1 * g for w, g in zip(params, grads)], loss_value


def _mlp_args(batch=512, width=64, depth=8):
  keys = jax.random.split(jax.random.key(0), depth + 2)
  params = [jax.random.normal(k, (width, width)) / width for k in keys[:depth]]
  return params, {"x": jax.random.normal(keys[-2], (batch, width)),
                  "y": jax.random.normal(keys[-1], (batch, width))}


def _footprint(fitted, *args) -> int:
  return xla_footprint(fitted.lower(*args).compile())


def test_transform_micro_batches_where_nothing_else_fits():
  params, batch = _mlp_args()
  with pytest.raises(jaxmem.BudgetError) as whole:
    jaxmem.transform(_mlp_step, budget="20%", micro_batches=1).fit(params, batch)
  fitted = jaxmem.transform(_mlp_step, budget="20%")
  fit = fitted.fit(params, batch)
  assert fit.micro is not None and fit.micro.count > 1
  assert fit.micro.arguments == ("batch",) and fit.micro.batch == 512
  budget = int(0.2 * xla_footprint(jax.jit(_mlp_step).lower(params, batch).compile()))
  assert budget < whole.value.smallest
  assert _footprint(fitted, params, batch) <= budget
  report = fit.report()
  assert f"{fit.micro.count} micro-batches of {512 // fit.micro.count} examples" in report
  assert len(repr(fit)) < 2000
  got, want = (params, batch), (params, batch)
  for _ in range(3):
    got_params, got_loss = fitted(*got)
    want_params, want_loss = jax.jit(_mlp_step)(*want)
    assert_trees_close((got_params, got_loss), (want_params, want_loss), rtol=1e-4)
    got, want = (got_params, batch), (want_params, batch)



def _masked_step(params, batch):
  """An SGD step on a token classifier whose cross-entropy is masked per
  example (padding): optax's integer-label loss gathers each example's
  label, and its gradient scatters along the class axis of each example."""
  def loss(params):
    h = batch["x"]
    for w in params:
      h = h + jnp.tanh(h @ w)
    ce = optax.softmax_cross_entropy_with_integer_labels(h, batch["labels"])
    return (ce * batch["mask"]).mean()
  value, grads = jax.value_and_grad(loss)(params)
  return [w - 0.1 * g for w, g in zip(params, grads)], value


def test_a_masked_cross_entropy_runs_in_micro_batches():
  """Each example's masked loss is its own, so its batch splits (its
  gradient's scatter, whose example axis is a whole window, was refused as
  scattering along the example axis): micro-batches meet a budget no plan
  does, with the step's updates."""
  params, batch = _mlp_args(batch=1024, depth=6)
  batch = {"x": batch["x"], "labels": jnp.arange(1024) % 64,
           "mask": (jnp.arange(1024) % 3 != 0).astype(jnp.float32)}
  fitted = jaxmem.transform(_masked_step, budget="30%")
  fit = fitted.fit(params, batch)
  assert fit.micro is not None and fit.micro.count > 1
  assert _footprint(fitted, params, batch) <= fit.budget
  got, want = fitted(params, batch), jax.jit(_masked_step)(params, batch)
  assert_updates_close(got[0], want[0], params)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5)

def _positions_step(params, x, labels, valid):
  """An SGD step whose loss picks each example's log-probability by its
  position, ``log_probs[jnp.arange(n), labels]``, over the first ``valid``
  examples (a mask by position in the whole batch: the rest are padding)."""
  def loss(params):
    h = x
    for w in params:
      h = h + jnp.tanh(h @ w)
    n = x.shape[0]
    nll = -jax.nn.log_softmax(h)[jnp.arange(n), labels]
    return jnp.sum(jnp.where(jnp.arange(n) < valid, nll, 0.0)) / valid
  value, grads = jax.value_and_grad(loss)(params)
  return [w - 0.1 * g for w, g in zip(params, grads)], value


def _positions_graph(pick=None):
  """The flat step of :func:`_positions_step` (with ``pick(n)`` in place of
  ``jnp.arange(n)`` where given), its graph and leaves."""
  keys = jax.random.split(jax.random.key(0), 5)
  args = ([jax.random.normal(k, (16, 16)) / 4 for k in keys[:3]],
          jax.random.normal(keys[3], (64, 16)), jax.random.randint(keys[4], (64,), 0, 16),
          jnp.int32(50))
  leaves, tree = jax.tree_util.tree_flatten(args)
  step = _positions_step
  if pick is not None:
    def step(params, x, labels, valid):
      def loss(params):
        h = x @ params[0]
        return -jnp.mean(jax.nn.log_softmax(h)[pick(x.shape[0]), labels])
      return jax.grad(loss)(params)
  flat = lambda *fl: jax.tree_util.tree_leaves(step(*jax.tree_util.tree_unflatten(tree, fl)))  # noqa: E731
  return flat, build_graph(jax.make_jaxpr(flat)(*leaves)), leaves


@pytest.mark.parametrize("strided", [False, True])
def test_a_loss_picked_by_position_runs_in_micro_batches(strided):
  """``log_probs[jnp.arange(n), labels]`` picks each example's own row: its
  gather and its gradient's scatter run per chunk with the chunk's
  positions, while the mask by position in the whole batch keeps the
  batch's: the updates are the step's."""
  step, graph, leaves = _positions_graph()
  split = split_batch(graph, [(0, 1, 2), (3, 4), (5,)], ["params", "batch", "valid"],
                      strided=strided)
  picked = sorted(graph.nodes[i].prim.name for i, rule in split.rules.items() if rule.own)
  assert picked == ["gather", "scatter-add"]
  want = jax.jit(step)(*leaves)
  for k in (2, 4):
    assert_updates_close(jax.jit(micro_batched(split, k))(*leaves), want,
                         leaves[:3] + [0.0], rtol=1e-5)


def test_a_scatter_by_position_into_more_rows_than_examples_is_not_run_per_chunk():
  """Each example's own position scattered into a buffer of more rows than
  examples (rows the chunks would not share out as they share the
  examples) is not taken per chunk: it sums over the examples as any
  scatter does, and the backward pass's read of that sum per example is
  refused."""
  def step(w, x, labels):
    def loss(w):
      h = jnp.tanh(x @ w)
      table = jnp.zeros((3 * x.shape[0], 8)).at[jnp.arange(x.shape[0]), labels].add(h.sum(1))
      return jnp.sum(table ** 2)
    return jax.grad(loss)(w)
  leaves = [jnp.eye(8) * 0.5, jax.random.normal(jax.random.key(1), (16, 8)),
            jnp.arange(16) % 8]
  graph = build_graph(jax.make_jaxpr(step)(*leaves))
  with pytest.raises(NotSplittable, match="reduced by .* scatter-add"):
    split_batch(graph, [(0,), (1, 2)], ["w", "batch"])


@pytest.mark.parametrize("pick", [
    lambda n: (jnp.arange(n) + 1) % n,
    lambda n: jnp.where(jnp.arange(n) % 2 == 0, jnp.arange(n), 0),
], ids=["the next example's", "the first example's for odd ones"])
def test_a_gather_by_other_examples_positions_refuses(pick):
  """Rows picked by positions that are not each example's own gather
  examples by examples, and are refused."""
  _, graph, _ = _positions_graph(pick=pick)
  with pytest.raises(NotSplittable, match="gathers examples by examples"):
    split_batch(graph, [(0, 1, 2), (3, 4), (5,)], ["params", "batch", "valid"])


def test_fewest_micro_batches_that_fit():
  params, batch = _mlp_args()
  fit = jaxmem.transform(_mlp_step, budget="20%").fit(params, batch)
  fewer = fit.micro.count // 2
  if fewer >= 2:
    with pytest.raises(jaxmem.BudgetError):
      jaxmem.transform(_mlp_step, budget="20%", micro_batches=fewer,
                       planner="recompute").fit(params, batch)


def test_planned_counts_back_off_to_the_fewest_that_fit():
  """Where a plan is needed, the count of smallest footprint is planned
  first, then fewer by bisection (footprints fall as counts grow): the
  fewest that fit are kept, or on a target with a clock the fastest."""
  import types
  from jaxmem.fit import _micro

  def fits_from(least, predicted=None):
    tried = []

    def fit(traced, micro, find_smallest, measured):
      tried.append(micro)
      return None if micro < least else types.SimpleNamespace(
          micro=types.SimpleNamespace(count=micro),
          predicted=None if predicted is None else predicted[micro])
    return fit, tried

  fewer = (2, 4, 8, 16, 32)

  def fewest(fit, found):
    return _micro._fewest(lambda i: fit(None, fewer[i], False, None), len(fewer), found)
  fit, tried = fits_from(8)
  found = fit(None, 64, True, None)
  assert fewest(fit, found).micro.count == 8
  assert tried == [64, 8, 4]  # the planned count, then a bisection of five
  # With a clock, the fastest of the fits found: here the planned count.
  fit, _ = fits_from(8, {8: 3.0, 64: 2.0})
  assert fewest(fit, fit(None, 64, True, None)).micro.count == 64
  fit, _ = fits_from(128)  # none of the fewer fits: the planned count stays
  assert fewest(fit, found).micro.count == 64


def _whole_and_chunked(whole_fits: bool, chunks, smallest: int):
  """Stubs for ``fit_whole_or_chunked``: the whole step's fit (a plan where
  ``whole_fits``, else its search for the smallest raises, naming
  ``smallest``; each call records the footprint it is to beat) and the
  chunks' (``chunks``: a fit, None, or an error)."""
  calls = []

  def whole(only_fitting=False, to_beat=None):
    calls.append(("whole", only_fitting, to_beat))
    if whole_fits and not only_fitting:
      return "whole plan"
    if only_fitting:
      return None
    raise jaxmem.BudgetError("whole", smallest=smallest)

  def chunked(error=None, fitted=None, region=None):
    calls.append((region or "chunks", None if error is None else error.smallest))
    if isinstance(chunks, Exception) and error is None:
      raise chunks
    if error is not None and not isinstance(chunks, str):
      raise jaxmem.BudgetError("why they cannot help", smallest=error.smallest)
    return chunks
  return whole, chunked, calls


def test_micro_batches_come_before_the_whole_steps_smallest():
  """Where no plan of the whole step may fit and its batch splits, the
  chunks are tried before the search for the whole step's smallest
  footprint (a compilation per candidate), which runs only where they fail
  too, for plans under the chunks' smallest (or the budget); the error
  names the least of both. A batch that cannot split keeps the search
  first, so the chunks' error can say why, and then layers' features are
  split."""
  from jaxmem.fit._micro import fit_whole_or_chunked
  whole, chunked, calls = _whole_and_chunked(False, "chunks", 50)
  assert fit_whole_or_chunked(whole, chunked, splits=lambda: True) == "chunks"
  assert calls == [("whole", True, None), ("chunks", None)]
  for chunk_least, least in ((60, 50), (40, 40)):
    whole, chunked, calls = _whole_and_chunked(
        False, jaxmem.BudgetError("chunks", smallest=chunk_least), 50)
    with pytest.raises(jaxmem.BudgetError) as error:
      fit_whole_or_chunked(whole, chunked, splits=lambda: True)
    assert error.value.smallest == least
    assert calls == [("whole", True, None), ("chunks", None), ("whole", False, chunk_least)]
  # A plan the quick search's margins passed over is still found.
  whole, chunked, calls = _whole_and_chunked(True, jaxmem.BudgetError("c", smallest=9), 50)
  assert fit_whole_or_chunked(whole, chunked, splits=lambda: True) == "whole plan"
  # Where a plan of the whole step fits, the batch is not analysed at all.
  assert fit_whole_or_chunked(lambda only_fitting=False: "plan",
                              lambda error=None, fitted=None: fitted,
                              splits=lambda: pytest.fail("the batch was analysed")) == "plan"
  whole, chunked, calls = _whole_and_chunked(False, None, 50)
  with pytest.raises(jaxmem.BudgetError, match="cannot help") as error:
    fit_whole_or_chunked(whole, chunked, splits=lambda: False)
  assert calls == [("whole", True, None), ("whole", False, None), ("chunks", 50),
                   ("features", 50)]


def test_a_fit_compiles_each_program_once():
  """``compile_placed`` with the fit's ``programs`` compiles a program met
  again (the same plan, in a second search) once, and each other anew."""
  from jaxmem.fit._arguments import Arguments
  from jaxmem.fit._host_state import compile_placed
  from jaxmem.targets import resolve
  x = jnp.ones((64, 64))
  graph = build_graph(jax.make_jaxpr(jnp.sin)(x))
  here, programs, arguments = resolve(None, [x]), {}, Arguments.resolve(jnp.sin)

  def compiled(op):
    def run(y):  # a new function each time, as each plan's emitted step is
      return op(y)
    return compile_placed(jax.jit(run), here, graph, arguments, (x,), {}, programs)
  first = compiled(jnp.sin)
  assert compiled(jnp.sin) is first and len(programs) == 1
  assert compiled(jnp.cos) is not first and len(programs) == 2


def test_given_micro_batches_and_bad_counts():
  params, batch = _mlp_args(batch=64)
  fitted = jaxmem.transform(_mlp_step, budget="100%", micro_batches=4)
  fit = fitted.fit(params, batch)
  assert fit.micro.count == 4
  assert_trees_close(fitted(params, batch), jax.jit(_mlp_step)(params, batch), rtol=1e-4)
  with pytest.raises(ValueError, match=r"3 micro-batches do not divide the batch of 64"):
    jaxmem.transform(_mlp_step, budget="100%", micro_batches=3).fit(params, batch)
  with pytest.raises(ValueError, match=r"micro_batches must be 'auto' or a number"):
    jaxmem.transform(_mlp_step, budget="100%", micro_batches=0)


def test_unmeetable_budget_names_smallest_with_micro_batches():
  params, batch = _mlp_args()
  fitted = jaxmem.transform(_mlp_step, budget="2%")
  with pytest.raises(jaxmem.BudgetError) as err:
    fitted.fit(params, batch)
  assert err.value.smallest is not None
  # The smallest named is met.
  fit = jaxmem.transform(_mlp_step, budget=err.value.smallest).fit(params, batch)
  assert fit.footprint <= err.value.smallest


def test_can_fit_answers_false_where_no_number_of_chunks_fits():
  """``can_fit`` answers, never raises, for a budget neither a plan, the
  region around the peak in chunks nor micro-batches meet (a VGG at batch 4
  against its footprint at batch 2: the error of the first that fails
  was raised)."""
  config = dict(depth=11, width=2, size=32, hidden=8)
  small = M.get("vgg", batch=2, **config)
  budget = xla_footprint(jax.jit(small.step).lower(*jax.eval_shape(small.init)).compile())
  task = M.get("vgg", batch=4, **config)
  assert not jaxmem.transform(task.step, budget=budget).can_fit(*jax.eval_shape(task.init))


def test_batchnorm_budget_error_says_why():
  task = M.get("cnn", batch=4, widths=(8, 16), size=16, blocks=1)
  state, batch = task.init()
  with pytest.raises(jaxmem.BudgetError, match=r"Micro-batching cannot help either: .*"
                     r"BatchNorm in training mode"):
    jaxmem.transform(task.step, budget="5%", max_rounds=1).fit(state, batch)


def test_saved_micro_batched_plan_reloads(tmp_path):
  params, batch = _mlp_args()
  fitted = jaxmem.transform(_mlp_step, budget="20%")
  fit = fitted.fit(params, batch)
  path = tmp_path / "plan.json"
  fitted.save_plan(path, params, batch)
  assert json.loads(path.read_text())["micro_batches"] == fit.micro.count
  again = jaxmem.transform(_mlp_step, budget="20%", plan=path).fit(params, batch)
  assert again.micro.count == fit.micro.count and again.plan == fit.plan
  assert again.footprint == fit.footprint


@pytest.mark.parametrize("config", [
    pytest.param(dict(remat="nothing_saveable"), marks=pytest.mark.slow),  # 37 s; scan-remat stays
    dict(scan=True), dict(scan=True, remat="nothing_saveable")], ids=["remat", "scan", "scan-remat"])
def test_remat_and_scanned_blocks_run_in_micro_batches(config):
  """``nn.remat`` blocks are inlined where the step runs in micro-batches
  (the chunks' residuals are planned as the step's are); ``nn.scan``
  blocks run as the same loop per chunk (``tests/test_microbatch_loops.py``)."""
  task = M.get("gpt2", optimizer=optax.sgd(0.5), **config, **ZOO["gpt2"])
  state, batch = task.init()
  fitted = jaxmem.transform(task.step, budget="100%", micro_batches=2)
  assert fitted.fit(state, batch).micro.count == 2
  assert_updates_close(fitted(state, batch), jax.jit(task.step)(state, batch), (state, 0.0),
                       rtol=1e-4)


def test_per_example_outputs_and_a_batch_passed_by_name():
  """Outputs that hold examples come back whole, in order; a batch passed
  as a keyword argument is found and named."""
  def step(params, *, batch):
    def loss(params):
      h = batch["x"]
      for w in params:
        h = jnp.tanh(h @ w)
      per_example = jnp.sum((h - batch["y"]) ** 2, axis=1)
      return jnp.mean(per_example), per_example
    (_, per_example), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return [w - 0.1 * g for w, g in zip(params, grads)], per_example

  params, batch = _mlp_args(batch=32, depth=2)
  # A step this small is no smaller in micro-batches: the budget is ample.
  fitted = jaxmem.transform(step, budget="1GiB", micro_batches=4)
  fit = fitted.fit(params, batch=batch)
  assert fit.micro.count == 4 and fit.micro.arguments == ("batch",)
  assert_trees_close(fitted(params, batch=batch), jax.jit(step)(params, batch=batch),
                     rtol=1e-5)


def _dropout_step(params, batch, key):
  """An SGD step of a tanh MLP with Flax's ``nn.Dropout`` after each layer
  (its mask drawn at the activations' full rank)."""
  import flax.linen as nn

  def loss(params):
    h = batch["x"]
    for i, w in enumerate(params):
      h = nn.Dropout(0.3).apply({}, jnp.tanh(h @ w), False,
                                rngs={"dropout": jax.random.fold_in(key, i)})
    return jnp.mean((h - batch["y"]) ** 2)
  loss_value, grads = jax.value_and_grad(loss)(params)
  return [w - 0.5 * g for w, g in zip(params, grads)], loss_value


@pytest.mark.parametrize("strided", [False, True])
def test_dropout_masks_drawn_per_micro_batch(strided):
  """Dropout's random bits are drawn inside the chunks' loop, each chunk its
  own part of the bits the step draws whole: the updates are the step's,
  and the footprint is below what the masks drawn whole would hold."""
  params, batch = _mlp_args(batch=1024, width=32, depth=8)
  key = jax.random.key(3)
  leaves = jax.tree_util.tree_leaves((params, batch, key))
  tree = jax.tree_util.tree_structure((params, batch, key))
  step = lambda *flat: jax.tree_util.tree_leaves(  # noqa: E731
      _dropout_step(*jax.tree_util.tree_unflatten(tree, flat)))
  graph = build_graph(jax.make_jaxpr(step)(*leaves))
  split = split_batch(graph, [tuple(range(8)), (8, 9), (10,)], ["params", "batch", "key"],
                      strided=strided)
  drawn = [key for key, how in split.demanded.items()
           if how is not None and graph.nodes[how[0]].prim.name == "random_bits"]
  assert len(drawn) == 8
  k = 8
  outside = [e.primitive.name for e in jax.make_jaxpr(micro_batched(split, k))(*leaves).eqns]
  run = jax.jit(micro_batched(split, k))
  assert "random_bits" not in outside and "scan" in outside
  assert_updates_close(run(*leaves), jax.jit(step)(*leaves), leaves[:8] + [0.0], rtol=1e-4)
  # Drawn whole before the loop and sliced, the bits of the eight masks
  # (uint32, the whole batch's) are held beside the chunks.
  whole = dataclasses.replace(split, demanded={
      key: None if key in drawn else how for key, how in split.demanded.items()})
  sliced = xla_footprint(jax.jit(micro_batched(whole, k)).lower(*leaves).compile())
  masks = 8 * 1024 * 32 * 4
  assert xla_footprint(run.lower(*leaves).compile()) + masks < sliced


def _with_a_large_parameter(p, x):
  """A tanh MLP beside a large parameter that no micro-batch shrinks."""
  def loss(p):
    w, big = p
    h = x
    for _ in range(6):
      h = h + jnp.tanh(h @ w)
    return jnp.sum(h) + jnp.sum(jnp.sin(big))
  return jax.tree.map(lambda a, b: a - 1e-3 * b, p, jax.grad(loss)(p))


def _measured_counts(caplog, budget) -> list[tuple[int, int]]:
  """``(count, footprint as written)`` of each count of micro-batches a fit
  of a step of its own (:func:`_with_a_large_parameter`) at ``budget``
  measures, in order."""
  import logging
  import re
  caplog.set_level(logging.INFO, logger="jaxmem")
  caplog.clear()
  args = ((jnp.eye(64) * 0.1, jnp.ones((1024, 1024))), jnp.ones((512, 64)))
  try:
    jaxmem.transform(lambda p, x: _with_a_large_parameter(p, x), budget=budget).fit(*args)
  except jaxmem.BudgetError:
    pass
  return [tuple(map(int, m.groups())) for m in re.finditer(
      r"(\d+) micro-batches of \d+ examples.*? as written: (\d+)", caplog.text)]


def test_counts_of_micro_batches_are_skipped_where_the_most_are_out_of_reach(caplog):
  """Each count of micro-batches measured is a compilation. Where the two
  fewest predict even the most chunks' footprint well above the budget,
  only the most chunks are measured after them."""
  measured = _measured_counts(caplog, "30%")
  assert [k for k, _ in measured] == [2, 4, 256], measured


def test_counts_of_micro_batches_are_skipped_once_the_footprint_levels(caplog):
  """Where the most chunks may come within the budget, counts are measured
  in turn until one more halving gains less than PLATEAU as written; only
  the most chunks are measured after it."""
  from jaxmem.fit._micro import PLATEAU
  floor = _measured_counts(caplog, "30%")[-1][1]
  measured = _measured_counts(caplog, int(0.98 * floor))
  counts = [k for k, _ in measured]
  assert counts[-1] == 256 and 3 < len(counts) < 8, measured  # 2, 4, ..., 256 otherwise
  levelled = next(i for i in range(1, len(measured))
                  if measured[i][1] >= (1 - PLATEAU) * measured[i - 1][1])
  assert levelled == len(measured) - 2, measured  # the largest count next, and last
