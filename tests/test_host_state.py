"""Optimizer state kept in host memory between steps (``graph._state``).

Where no plan of the residuals fits a GPU target's budget, the fit keeps
the step's optimizer state (inputs only the update reads) in
``pinned_host``: the step takes it there, copies each leaf to the device
before its update and returns the update there. Checked here: which leaves
are state, what the memory model counts, XLA:GPU's program for a T4
compiled on this machine (``S(5)`` parameters and outputs), the numbers of
the step as written over three steps, donation, saved plans, and the
targets where it is never done.
"""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem
from jaxmem.cost._evaluate import evaluate
from jaxmem.graph._graph import build_graph
from jaxmem.graph._state import optimizer_state, with_hosted
from jaxmem.schedule._emit import emit
from jaxmem.schedule._order import emission_position
from jaxmem.targets import placed

pytest.importorskip("jax_plugins.xla_cuda13", reason="compiles for a T4 target")

OPT = optax.adam(1e-2)
WIDTH, DEPTH = 384, 4


def _loss(params, x):
  h = x
  for w in params:
    h = jnp.tanh(h @ w)
  return jnp.mean(h ** 2)


def step(params, state, x):
  loss, grads = jax.value_and_grad(_loss)(params, x)
  updates, state = OPT.update(grads, state, params)
  return optax.apply_updates(params, updates), state, loss


def _args():
  keys = jax.random.split(jax.random.key(0), DEPTH + 1)
  params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH ** 0.5 for k in keys[:DEPTH]]
  return params, OPT.init(params), jax.random.normal(keys[-1], (16, WIDTH))


def _state_paths():
  """Flat leaf positions of Adam's moments among the step's arguments."""
  paths = jax.tree_util.tree_flatten_with_path(_args())[0]
  return [i for i, (path, _) in enumerate(paths)
          if any(getattr(k, "name", None) in ("mu", "nu") for k in path)]


@pytest.fixture(scope="module")
def graph():
  return build_graph(jax.make_jaxpr(step)(*_args()))


@pytest.fixture(scope="module")
def fitted():
  """The step at a budget under what recomputation reaches on a T4: its
  moments go to host memory."""
  transformed = jaxmem.transform(step, budget="60%", target="t4")
  return transformed, transformed.fit(*_args())


def _assert_close(got, want):
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)) + 1e-6


def test_state_is_the_moments_each_paired_with_its_update(graph):
  state = optimizer_state(graph)
  assert [leaf.leaf for leaf in state] == _state_paths()
  # Each moment's update is the output at the same place in the returned state.
  outputs = jax.tree_util.tree_flatten_with_path(jax.eval_shape(step, *_args()))[0]
  inputs = jax.tree_util.tree_flatten_with_path(_args())[0]
  for leaf in state:
    assert outputs[leaf.output][0][1:] == inputs[leaf.leaf][0][1:]


def test_memory_model_counts_state_on_the_host(graph):
  state = optimizer_state(graph)
  nbytes = sum(leaf.nbytes for leaf in state)
  _, base = evaluate(graph, jaxmem.Plan())
  schedule, hosted = evaluate(with_hosted(graph, [leaf.value for leaf in state]), jaxmem.Plan())
  assert hosted.arguments == base.arguments - nbytes
  assert hosted.host_peak >= nbytes
  # Without donation the state is on the device twice (in and out); the
  # copies in and out of the update add at most one layer's moments.
  largest = max(leaf.nbytes for leaf in state)
  assert base.peak - 2 * nbytes <= hosted.peak <= base.peak - 2 * nbytes + 4 * largest
  kinds = [op.kind for op in schedule.ops]
  assert kinds.count("prefetch") == kinds.count("offload") == len(state)


def test_emitted_step_takes_and_returns_state_in_host_memory(graph):
  state = optimizer_state(graph)
  hosted = with_hosted(graph, [leaf.value for leaf in state])
  run = emit(evaluate(hosted, jaxmem.Plan())[0])
  leaves = jax.tree_util.tree_leaves(_args())
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  leaves = [jax.device_put(x, host) if i in _state_paths() else x
            for i, x in enumerate(leaves)]
  jaxpr = jax.make_jaxpr(run)(*leaves)
  assert sum("<host>" in str(v.aval) for v in jaxpr.jaxpr.invars) == len(state)
  assert sum("<host>" in str(v.aval) for v in jaxpr.jaxpr.outvars) == len(state)


def test_fit_keeps_state_on_the_host_where_recomputation_does_not_reach(fitted):
  transformed, fit = fitted
  assert fit.hosted == tuple(_state_paths())
  assert fit.footprint <= fit.budget
  # Without the state on the host nothing fits: recomputation's smallest.
  with pytest.raises(jaxmem.BudgetError):
    jaxmem.transform(step, budget="60%", target="orin-nano").fit(*_args())
  assert "optimizer state   8 leaves" in fit.report()
  # Each leaf's bytes: the four largest by default, every one when asked.
  every = next(l for l in fit.report(top=None).splitlines() if l.startswith("optimizer state"))
  assert "lists all" in fit.report() and "lists all" not in every
  assert every.count(" KiB") + every.count(" MiB") + every.count(" B,") >= 8
  assert "[1][0].mu[0]" in fit.report()


def test_state_is_fetched_early_enough_for_the_link(fitted):
  # On the T4's profile each copy in is issued at a backward equation at or
  # before the update reading it, so the compute in between can hide it.
  _, fit = fitted
  points, position = dict(fit.graph.hosted_at), emission_position(fit.graph)
  assert set(points) == set(fit.graph.hosted)
  for leaf in optimizer_state(fit.graph):
    first = min(fit.graph.values[leaf.value].uses, key=position.get)
    assert fit.graph.nodes[points[leaf.value]].backward
    assert position[points[leaf.value]] <= position[first]


def test_t4_program_holds_state_in_host_memory(fitted):
  transformed, fit = fitted
  compiled = transformed.lower(*placed(_args(), "t4")).compile()
  stats = compiled.memory_analysis()
  nbytes = sum(leaf.nbytes for leaf in optimizer_state(fit.graph)
               if leaf.value in fit.graph.hosted)
  assert stats.host_argument_size_in_bytes == nbytes
  assert stats.host_output_size_in_bytes == nbytes
  layout = next(line for line in compiled.as_text().splitlines()
                if "entry_computation_layout" in line)
  params, results = layout.split("->", 1)
  assert params.count("S(5)") == results.count("S(5)") == len(fit.hosted)
  assert jaxmem.targets.xla_footprint(compiled) <= fit.budget


def test_numbers_of_the_step_as_written_over_three_steps(fitted):
  transformed, _ = fitted
  ours, want = _args(), _args()
  for _ in range(3):
    ours, want = transformed(*ours), jax.jit(step)(*want)
    _assert_close(ours, want)
    ours, want = (*ours[:2], _args()[2]), (*want[:2], _args()[2])
  kinds = {jax.tree_util.keystr(p): x.sharding.memory_kind
           for p, x in jax.tree_util.tree_flatten_with_path(ours[1])[0]}
  assert all(kind == "pinned_host" for path, kind in kinds.items()
             if ".mu" in path or ".nu" in path)


def test_donated_state_stays_donated(fitted):
  _, fit = fitted
  donating = jaxmem.transform(step, budget="60%", target="t4", donate_argnums=(1,))
  params, state, x = _args()
  out = donating(params, state, x)
  assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(state))
  _assert_close(out, jax.jit(step)(*_args()))


def test_saved_plan_keeps_the_state_on_the_host(fitted, tmp_path):
  transformed, fit = fitted
  path = tmp_path / "plan.json"
  transformed.save_plan(path, *_args())
  kinds = [d["kind"] for _, d in json.loads(path.read_text())["decisions"]]
  assert kinds.count("host") == len(fit.hosted)
  again = jaxmem.transform(step, budget="60%", target="t4", plan=path).fit(*_args())
  assert again.hosted == fit.hosted and again.plan == fit.plan
  assert again.graph.hosted_at == fit.graph.hosted_at


def test_micro_batches_keep_the_state_on_the_host_too(tmp_path, caplog):
  """A budget that neither meets alone: the step runs in micro-batches, and
  its optimizer state stays in host memory between steps, copied in for
  the update after the chunks (``graph._graph``: the update after a loop
  that runs the passes). SGD with momentum: its update is linear in the
  gradient, which the chunks sum in another order."""
  sgd = optax.sgd(0.1, momentum=0.9)

  def sgd_step(params, state, x):
    loss, grads = jax.value_and_grad(_loss)(params, x)
    updates, state = sgd.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  keys = jax.random.split(jax.random.key(1), DEPTH + 1)
  params = [jax.random.normal(k, (256, 256)) / 16 for k in keys[:DEPTH]]
  args = params, sgd.init(params), jax.random.normal(keys[-1], (4096, 256))
  args = jax.jit(sgd_step)(*args)[:2] + (args[2],)  # a momentum that is not zero
  for alone in (dict(micro_batches=1), dict(host_state=False)):
    with pytest.raises(jaxmem.BudgetError):
      jaxmem.transform(sgd_step, budget="35%", target="t4", **alone).fit(*args)
  transformed = jaxmem.transform(sgd_step, budget="35%", target="t4")
  fit = transformed.fit(*args)
  assert fit.micro.count >= 2 and len(fit.hosted) == DEPTH
  # The fewest chunks whose plan meets the budget (not the most, whose
  # footprint as written is the smallest): half as many do not.
  with pytest.raises(jaxmem.BudgetError):
    jaxmem.transform(sgd_step, budget="35%", target="t4",
                     micro_batches=fit.micro.count // 2).fit(*args)
  assert "micro-batches" in fit.report() and "optimizer state   4 leaves" in fit.report()
  compiled = transformed.lower(*placed(args, "t4")).compile()
  assert compiled.memory_analysis().host_argument_size_in_bytes == DEPTH * 256 * 256 * 4
  assert jaxmem.targets.xla_footprint(compiled) <= fit.budget
  ours, want = args, args
  for _ in range(3):
    ours, want = transformed(*ours), jax.jit(sgd_step)(*want)
    _assert_close(ours, want)
    ours, want = (*ours[:2], args[2]), (*want[:2], args[2])
  # Saved, the plan keeps the step's state on the host around the chunks'
  # loop: reloaded, it is applied as saved, with nothing tried first.
  path = tmp_path / "plan.json"
  transformed.save_plan(path, *args)
  around = json.loads(path.read_text())["around_loop"]
  assert [d["kind"] for _, d in around] == ["host"] * DEPTH
  with caplog.at_level(logging.INFO, logger="jaxmem"):
    again = jaxmem.transform(sgd_step, budget="35%", target="t4", plan=path).fit(*args)
  assert again.hosted == fit.hosted and again.micro.count == fit.micro.count
  assert again.plan == fit.plan and again.footprint == fit.footprint
  compiled = [r.getMessage() for r in caplog.records if "compiled" in r.getMessage()]
  assert len(compiled) == 1 and "(fits)" in compiled[0], compiled  # nothing tried first


def test_cpu_never_moves_state():
  # XLA:CPU's host memory is its device memory: nothing would be freed.
  with pytest.raises(jaxmem.BudgetError):
    jaxmem.transform(step, budget="60%").fit(*_args())


def test_a_budget_met_by_neither_names_the_smaller_with_state_on_the_host():
  """Where no plan fits with the state on the device or on the host, the
  error names the smaller footprint, reached with the state on the host."""
  with pytest.raises(jaxmem.BudgetError) as hosted:
    jaxmem.transform(step, budget="15%", target="t4", micro_batches=1).fit(*_args())
  with pytest.raises(jaxmem.BudgetError) as device:
    jaxmem.transform(step, budget="15%", target="t4", host_state=False,
                     micro_batches=1).fit(*_args())
  assert hosted.value.smallest < device.value.smallest
  assert type(hosted.value) is jaxmem.BudgetError  # not the search's own subclass
  assert f"Pass budget >= {hosted.value.smallest} bytes" in str(hosted.value)


def test_the_search_with_state_on_the_host_starts_from_the_smallest_plans(graph):
  """The second fit (state on the host) searches for the smallest footprint
  among the plans the first fit found smallest, not over all the planner's
  candidates again (each costs a compilation); the error names the least
  of both."""
  from jaxmem._decisions import Plan
  from jaxmem.fit._unmet import NoPlanFits
  from jaxmem.fit._search import search
  from jaxmem.planners import get_planner
  smallest = (Plan(), Plan())
  calls = []

  class Fitter:
    def __init__(self, tried, planner, smallest_from=None):
      calls.append((tried, smallest_from))
      self.tried = tried

    def fit(self, find_smallest, only_fitting=False):
      raise NoPlanFits(jaxmem.BudgetError("over", smallest=100 - len(calls)), smallest,
                       self.tried)

  with pytest.raises(NoPlanFits) as error:
    search(Fitter, graph, get_planner("auto"), True, may_host=True)
  assert [from_ for _, from_ in calls] == [None, smallest]
  assert not calls[0][0].hosted and calls[1][0].hosted
  # The least of both, with the plan that reached it and the graph it is of.
  assert error.value.smallest == 98 and error.value.graph is calls[1][0]
  assert error.value.plans == smallest[:1]
