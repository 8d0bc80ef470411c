"""A region of the step in chunks: the equations around the step's peak run
over chunks of the batch, the rest of the step whole
(``graph._batch_axes.split_region``, ``schedule._microbatch``,
``fit._micro``).

Checked here, on a language model whose vocabulary is large beside its
width (its softmax cross-entropy and the logits' matmul make its peak): the
region found is that loss head, read from the jaxpr by following the
examples (its inputs are the hidden states and the labels); in 2 and 4
chunks it gives the untransformed step's updates (gradients, through SGD);
XLA's footprint drops by at least the logits' chunked-away bytes, and the
memory model's figure for the chunked step follows XLA's; a
transform whose budget no plan meets chunks the region, within the budget
by XLA's footprint, with the step's numbers over three steps (Adam, donated
state); a saved plan reloads its chunks; a plan that fits is replaced by
chunks only where the target's clock prices them faster.
"""

import dataclasses
import json
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmem
from jaxmem.cost._evaluate import unplanned
from jaxmem.fit._micro import MicroBatches, cheaper, fit_micro_batches, sizes_to_try
from jaxmem.graph._batch_axes import split_region
from jaxmem.graph._graph import build_graph
from jaxmem.schedule._microbatch import micro_batched
from jaxmem.targets import xla_footprint
from tests.helpers import assert_donated_steps_match, assert_updates_close

VOCAB, WIDTH, SEQ, BATCH = 4096, 32, 16, 16


class _LM(nn.Module):
  centered: bool = False  # embeddings centered over the batch: examples meet

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    if self.centered:
      x = x - jnp.mean(x, axis=0, keepdims=True)
    for _ in range(2):
      x = x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))))
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _task(optimizer, centered=False, batch=BATCH):
  model = _LM(centered)
  tokens = jax.random.randint(jax.random.key(0), (batch, SEQ), 0, VOCAB)
  params = model.init(jax.random.key(1), tokens)
  state = (params, optimizer.init(params))

  def step(state, tokens, labels):
    params, opt_state = state

    def loss(params):
      logits = model.apply(params, tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), value

  return step, (state, tokens, jnp.roll(tokens, 1, axis=1))


def _split(step, args):
  leaves, tree = jax.tree_util.tree_flatten(args)
  flat = lambda *xs: jax.tree_util.tree_leaves(step(*jax.tree_util.tree_unflatten(tree, xs)))
  graph = build_graph(jax.make_jaxpr(flat)(*leaves))
  n_state = len(jax.tree_util.tree_leaves(args[0]))
  groups = [tuple(range(n_state)), (n_state,), (n_state + 1,)]
  near = [key[0] for key in unplanned(graph, 0).memory.live_at_peak]
  return flat, leaves, graph, split_region(graph, groups, near, ["state", "tokens", "labels"])


def test_the_region_is_the_loss_head():
  step, args = _task(optax.sgd(0.5))
  _, _, graph, split = _split(step, args)
  assert not split.whole and split.batch == BATCH
  logits = BATCH * SEQ * VOCAB * 4
  made = [graph.values[o].nbytes for i in split.region for o in graph.nodes[i].outs]
  assert max(made) == logits
  # It starts at the hidden states and the labels, not at the embeddings.
  assert max(graph.values[v].nbytes for v in split.inputs) == BATCH * SEQ * WIDTH * 4
  assert len(split.region) < len(graph.nodes) // 4
  assert any(graph.nodes[i].backward for i in split.region)


def test_region_chunks_give_the_step_gradients():
  step, args = _task(optax.sgd(0.5))
  flat, leaves, _, split = _split(step, args)
  want = jax.jit(flat)(*leaves)
  n_state = len(jax.tree_util.tree_leaves(args[0]))
  for k in (2, 4):
    got = jax.jit(micro_batched(split, k))(*leaves)
    assert_updates_close(got, want, leaves[:n_state] + [0.0], rtol=1e-4)


def test_region_chunks_shrink_xla_footprint():
  step, args = _task(optax.sgd(0.5))
  flat, leaves, _, split = _split(step, args)
  written = xla_footprint(jax.jit(flat).lower(*leaves).compile())
  k = 4
  chunked = xla_footprint(jax.jit(micro_batched(split, k)).lower(*leaves).compile())
  logits = BATCH * SEQ * VOCAB * 4
  assert chunked <= written - (1 - 1 / k) * logits, (chunked, written)


def test_the_memory_model_counts_the_chunks():
  """The model of the chunked step counts one chunk's working set inside
  the loop: it falls with the count as XLA's footprint does, and stays as
  near to XLA's as its figure for the step as written is (without the
  loop's working set it would read less than half of XLA's at 2 chunks)."""
  step, args = _task(optax.sgd(0.5))
  flat, leaves, graph, split = _split(step, args)
  bias = unplanned(graph, 0).memory.peak / xla_footprint(jax.jit(flat).lower(*leaves).compile())
  modelled, measured = [], []
  for k in (2, 4, 8):
    run = micro_batched(split, k)
    modelled.append(unplanned(build_graph(jax.make_jaxpr(run)(*leaves)), 0).memory.peak)
    measured.append(xla_footprint(jax.jit(run).lower(*leaves).compile()))
  assert modelled == sorted(modelled, reverse=True) and measured == sorted(measured, reverse=True)
  for model, xla in zip(modelled, measured):
    assert 0.75 < model / xla < 1.1 * bias, (modelled, measured, bias)


def _budget_only_the_region_meets():
  return "80%"


def test_transform_chunks_the_region_where_no_plan_fits():
  step, args = _task(optax.adam(1e-3))
  copy = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)
  with pytest.raises(jaxmem.BudgetError):
    jaxmem.transform(step, budget=_budget_only_the_region_meets(), micro_batches=1,
                     donate_argnums=0, max_rounds=2).fit(copy(args[0]), *args[1:])
  fitted = jaxmem.transform(step, budget=_budget_only_the_region_meets(), donate_argnums=0)
  fit = fitted.fit(copy(args[0]), *args[1:])
  assert fit.micro is not None and fit.micro.region and fit.micro.count > 1
  assert "chunked region" in fit.report() and "region_chunks=" in repr(fit)
  assert xla_footprint(fitted.lower(copy(args[0]), *args[1:]).compile()) <= fit.budget
  assert_donated_steps_match(fitted, step, args)


def test_saved_region_plan_reloads(tmp_path):
  step, args = _task(optax.adam(1e-3))
  budget = _budget_only_the_region_meets()
  fitted = jaxmem.transform(step, budget=budget)
  fit = fitted.fit(*args)
  path = tmp_path / "plan.json"
  fitted.save_plan(path, *args)
  record = json.loads(path.read_text())
  assert record["region"] is True and record["micro_batches"] == fit.micro.count
  again = jaxmem.transform(step, budget=budget, plan=path).fit(*args)
  assert again.micro == fit.micro and again.footprint == fit.footprint


def test_on_xla_cpu_a_plan_that_fits_is_kept():
  """Without a target clock (XLA:CPU) chunks are priced by nothing, so a
  plan that fits is kept, though it recomputes."""
  step, args = _task(optax.adam(1e-3))
  fit = jaxmem.transform(step, budget="95%").fit(*args)
  assert fit.micro is None and fit.added_flops > 0


@dataclasses.dataclass(frozen=True)
class _Priced:
  """What :func:`cheaper` reads of a fit."""
  predicted: float | None
  planner: object = dataclasses.field(default_factory=lambda: types.SimpleNamespace(
      name="auto"))
  result: object = dataclasses.field(default_factory=lambda: types.SimpleNamespace(
      changes_step=True))
  micro: MicroBatches | None = None


def test_chunks_replace_a_plan_only_where_the_clock_says_they_are_faster():
  chunks = _Priced(1.0, micro=MicroBatches(4, 16, ("tokens",), region="the head"))
  offer = lambda *args, **kwargs: chunks
  clock = lambda compiled: compiled.seconds
  chosen = cheaper(_Priced(2.0), offer, clock)
  assert chosen.micro.region == "the head" and "takes longer (2e+03 ms" in chosen.micro.instead
  assert cheaper(_Priced(0.5), offer, clock).micro is None  # the plan is faster
  assert cheaper(_Priced(None), offer, clock).micro is None  # no time: nothing to price by
  assert cheaper(_Priced(2.0), offer, None).micro is None  # no clock
  named = _Priced(2.0, planner=types.SimpleNamespace(name="recompute"))
  assert cheaper(named, offer, clock) is named  # a named planner is the user's choice
  unchanged = _Priced(2.0, result=types.SimpleNamespace(changes_step=False))
  assert cheaper(unchanged, offer, clock) is unchanged  # as written: nothing to replace


def test_micro_batches_of_the_whole_step_replace_a_plan_where_they_are_faster():
  """Where the region around the peak in chunks is no faster than the plan
  (or does not fit), the whole step in micro-batches is weighed too; of
  several that fit, the fastest is taken."""
  region = _Priced(1.5, micro=MicroBatches(4, 16, ("tokens",), region="the head"))
  whole = _Priced(1.0, micro=MicroBatches(2, 16, ("tokens",)))
  clock = lambda compiled: compiled.seconds
  asked = []

  def offer(*args, region: bool, **kwargs):
    asked.append(region)
    return {True: offered[0], False: offered[1]}[region]

  for offered, want in [((None, whole), whole), ((region, whole), whole),
                        ((region, _Priced(1.8, micro=whole.micro)), region),
                        ((None, _Priced(2.5, micro=whole.micro)), None)]:
    asked.clear()
    chosen = cheaper(_Priced(2.0), offer, clock)
    assert asked == [True, False]
    if want is None:
      assert chosen.micro is None  # the plan is the fastest
    else:
      assert chosen.predicted == want.predicted and "takes longer (2e+03 ms" in chosen.micro.instead


def test_chunks_no_faster_than_the_plan_end_the_search_for_a_count():
  """Weighing chunks against a plan that fits, the fewest chunks are
  measured first; where they are predicted no faster than the plan, no
  more are measured (more chunks only run slower), nor is any planned."""
  step, args = _task(optax.sgd(0.5))
  flat, leaves, graph, split = _split(step, args)
  closed = jax.make_jaxpr(flat)(*leaves)
  counts, measured, planned = [], [], []

  def measure(traced):
    measured.append(traced)
    return types.SimpleNamespace(footprint=10 ** 9)  # over the limit as written

  def fit(*args):
    planned.append(args)

  def faster(form):
    counts.append(len(measured))
    return len(counts) < 2  # the second count measured is no faster

  groups = [tuple(range(len(leaves) - 2)), (len(leaves) - 2,), (len(leaves) - 1,)]
  found = fit_micro_batches(fit, measure, graph, closed, groups,
                            ["state", "tokens", "labels"], 1, region=True, planned=False,
                            written=None, unmet=None, faster=faster)
  assert found is None and len(measured) == 2 and not planned
  assert len(sizes_to_try(split.sizes(), split.batch)) > 2  # more counts were left


def test_counts_the_plateau_passed_over_are_tried_where_the_last_fits():
  """Once the footprint levels, only the most micro-batches are measured;
  where that count fits, the counts passed over are tried too, by
  bisection, and the fewest that fits is taken (XLA:GPU's footprint can
  fall at once where chunks grow small enough that their matrix products
  get no cuBLAS workspace: a data-parallel MLP for 8 T4s took 2048
  micro-batches at 377 ms predicted where 512 fit at 36 ms)."""
  step, args = _task(optax.sgd(0.5), batch=128)
  flat, leaves, graph, split = _split(step, args)
  closed = jax.make_jaxpr(flat)(*leaves)
  drop = 16  # from this count on the footprint falls at once
  measured = []

  def measure(traced):
    k = max(e.params["length"] for e in traced.jaxpr.eqns if e.primitive.name == "scan")
    measured.append(k)
    return types.SimpleNamespace(footprint=100 if k >= drop else 1000 + (k == 2))

  def fit(traced, micro, find_smallest, measured):
    return types.SimpleNamespace(micro=micro, predicted=None)

  groups = [tuple(range(len(leaves) - 2)), (len(leaves) - 2,), (len(leaves) - 1,)]
  found = fit_micro_batches(fit, measure, graph, closed, groups,
                            ["state", "tokens", "labels"], 500)
  counts = sizes_to_try(split.sizes(), split.batch)
  assert counts == [2, 4, 8, 16, 32, 64], counts
  assert found.micro.count == drop, (found.micro, measured)
  assert measured[:3] == [2, 4, counts[-1]]  # levelled at 4: the most next
  assert len(measured) < len(counts) + 1  # passed-over counts bisected, not all


def test_the_smallest_named_counts_the_region_where_micro_batches_cannot_help():
  """Where examples meet in the trunk (the embeddings centered over the
  batch), micro-batches are refused but the loss head still runs in chunks:
  a budget below everything names the smallest of the plans and of the
  region in chunks, and that smallest is met."""
  step, args = _task(optax.sgd(0.5), centered=True)
  flat, leaves, _, split = _split(step, args)
  chunked = min(xla_footprint(jax.jit(micro_batched(split, k)).lower(*leaves).compile())
                for k in (2, 4, 8))
  with pytest.raises(jaxmem.BudgetError, match="Micro-batching cannot help") as err:
    jaxmem.transform(step, budget=1, max_rounds=2).fit(*args)
  assert err.value.smallest <= chunked
  fitted = jaxmem.transform(step, budget=err.value.smallest, max_rounds=2)
  fit = fitted.fit(*args)
  assert fit.micro is not None and fit.micro.region
  assert xla_footprint(fitted.lower(*args).compile()) <= err.value.smallest
