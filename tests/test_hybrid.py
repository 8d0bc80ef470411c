"""The hybrid (Libra) and offload-only planners: choices by predicted time,
same numbers, budgets below what recomputation alone reaches."""

import dataclasses

import jax
import pytest

import jaxmem
from jaxmem.targets import get_profile
from jaxmem._decisions import KEEP
from jaxmem.cost._evaluate import evaluate, prefetch_point
from jaxmem.planners import Greedy, Hybrid, hybrid, offload_only
from jaxmem.schedule._emit import emit
from tests.dataflow import assert_offloads_flow
from tests.helpers import assert_trees_close, xla_budget


def offloads(result):
  return len(result.plan.values_with("offload"))


def test_planner_choices_follow_the_target(mlp):
  _, _, graph, base = mlp
  t4 = get_profile("t4")
  fast = dataclasses.replace(t4, name="fast-link", h2d_bandwidth=1e12, d2h_bandwidth=1e12,
                             link_latency=0.0)
  slow = dataclasses.replace(t4, name="slow-link", h2d_bandwidth=1e7, d2h_bandwidth=1e7)
  aim = int(0.6 * base)
  # A link fast enough to hide every copy: offloading is free, and chosen.
  assert offloads(hybrid(fast).plan(graph, aim)) > 0
  # A slow link makes every copy stall: recomputation is preferred.
  slow_plan = hybrid(slow).plan(graph, aim)
  assert slow_plan.fits and offloads(slow_plan) == 0
  # Unified memory: moving a tensor to "host" frees nothing; never chosen.
  unified = dataclasses.replace(fast, name="unified", unified=True)
  assert offloads(hybrid(unified).plan(graph, aim)) == 0
  with pytest.raises(ValueError, match="offload needs a target"):
    Greedy(offload=True)


def test_hybrid_goes_below_recomputation_alone_and_host_budget_holds(mlp):
  _, _, graph, base = mlp
  lowest = min(r.peak for r in Greedy().lowest(graph))
  result = hybrid().plan(graph, int(lowest * 0.95))
  assert result.fits and result.peak < lowest and offloads(result) > 0
  capped = hybrid(host_budget=result.memory.host_peak // 2).plan(graph, int(lowest * 0.95))
  assert capped.memory.host_peak <= result.memory.host_peak // 2


# Offload alone stops higher: each copy comes back before the backward pass
# reads it, so the backward peak stays.
@pytest.mark.parametrize("planner,budget", [("hybrid", "60%"), ("offload", "85%")])
def test_offload_plans_give_the_same_numbers(mlp, planner, budget):
  task, args, _, _ = mlp
  fitted = jaxmem.transform(task.step, budget=budget, planner=planner)
  plan = fitted.fit(*args)
  # The budget from XLA's footprint of the step as written; on CPU an
  # offload plan's device footprint is the model's (XLA:CPU ignores host
  # memory).
  assert plan.footprint <= xla_budget(task.step, args, budget) == plan.budget
  moved = plan.plan.values_with("offload")
  assert moved
  if planner == "offload":
    assert not plan.plan.values_with("recompute")
  # The rewritten step really moves each chosen residual to pinned_host and
  # its backward readers read the copy brought back.
  flat = jax.tree_util.tree_leaves(args)
  emitted = jax.make_jaxpr(emit(plan.result.schedule))(*flat).jaxpr
  assert assert_offloads_flow(emitted) == len(moved)
  state, batch = args
  want, got = [], []
  for steps, fn in ((want, jax.jit(task.step)), (got, fitted)):
    s = state
    for _ in range(3):
      s, loss = fn(s, batch)
      steps.append((s, loss))
  assert_trees_close(got, want)


def test_copy_back_is_ready_for_the_recomputation_that_reads_it(mlp):
  """A kept residual that a recomputation reads is needed there, before its
  own first backward reader: its copy back is placed ahead of that."""
  _, _, graph, base = mlp
  result = Greedy().plan(graph, int(0.6 * base))
  schedule, dropped = result.schedule, set(result.plan.values_with("recompute"))
  position = {op.node: i for i, op in enumerate(schedule.ops) if op.kind == "node"}
  rebuilt_from = {}
  for i, op in enumerate(schedule.ops):
    if op.kind == "recompute":
      for key in op.ins:
        if isinstance(key, tuple) and graph.is_forward_value(key[0]):
          rebuilt_from.setdefault(key[0], i)
  read = [r for r in graph.residuals if r.value in rebuilt_from and r.value not in dropped
          and rebuilt_from[r.value] < position[r.first_backward_use]]
  assert read, "no kept residual is read by a recomputation in this plan"
  t4 = get_profile("t4")
  slow = dataclasses.replace(t4, name="slow-link", h2d_bandwidth=1e7)
  for r in read:
    for profile in (t4, slow):
      # The copy back is issued at the start of node ``at``'s turn: no
      # backward node may run between the recomputation and that turn.
      at = prefetch_point(schedule, r.value, r.nbytes, profile, late=True)
      assert not any(op.kind == "node"
                     for op in schedule.ops[rebuilt_from[r.value]:position[at]])


def test_offload_only_moves_no_more_than_the_aim_needs(mlp):
  """Where the offload-only greedy reaches the aim only on its ladder,
  the plan the ladder hands over keeps on the device again every copy the
  aim does not need, largest first."""
  _, _, graph, base = mlp
  planner = offload_only()
  lowest = min(planner.lowest(graph), key=lambda r: r.peak)
  aim = (lowest.peak + base) // 2
  found = planner.plan(graph, aim)
  assert found.fits and found.memory.host_peak < lowest.memory.host_peak
  for vid in found.plan.values_with("offload"):  # each copy left is needed
    _, memory = evaluate(graph, found.plan.with_decision(vid, KEEP))
    assert memory.peak > aim or len(found.plan) > planner.refine


# The hybrid's two greedy planners keep their scores the same way (30 s).
@pytest.mark.parametrize("make", [Greedy, pytest.param(lambda: hybrid("t4"),
                                                       marks=pytest.mark.slow)],
                         ids=["greedy", "hybrid"])
def test_kept_scores_plan_as_evaluating_every_move_does(mlp, monkeypatch, make):
  """A planner keeps each move's score (``planners/_scores.py``) instead of
  evaluating the plan again: it plans as one that evaluates every move, at
  each aim and at the lowest, with fewer evaluations; a score's excess is
  the memory model's."""
  import jaxmem.planners._scores as scores
  _, _, graph, base = mlp
  evaluated = []
  real = scores.candidate
  monkeypatch.setattr(scores, "candidate", lambda g, p: evaluated.append(p) or real(g, p))
  found = {}
  for size in (512, 0):  # 0: every score dropped at once, every move evaluated
    planner = make()
    for greedy in (planner.first, planner.then) if isinstance(planner, Hybrid) else (planner,):
      greedy._scores.size = size
    evaluated.clear()
    plans = [planner.plan(graph, int(f * base)) for f in (0.6, 0.3)]
    plans.append(planner.lowest(graph)[0])
    found[size] = ([(c.plan, c.peak) for c in plans], len(evaluated))
  assert found[512][0] == found[0][0]
  assert found[512][1] < found[0][1]
  lowest = planner.lowest(graph)[0]
  score = scores.Score.of(lowest, 0.0)
  for level in (0, lowest.peak // 2, lowest.peak, lowest.peak + 1):
    assert score.excess(level) == lowest.memory.excess(level)


def test_groups_freeing_a_sliver_of_the_deficit_rank_last():
  """A BatchNorm statistic costs next to no FLOPs to rebuild, so by bytes per
  FLOP it leads; far above the goal it ranks after every group that frees a
  real share of the bytes there, and near the goal by bytes per FLOP again."""
  import flax.linen as nn
  import jax.numpy as jnp
  from jaxmem._decisions import Plan
  from jaxmem.cost._evaluate import candidate, chain_flops, recomputable
  from jaxmem.graph._graph import build_graph
  from jaxmem.planners._scores import SMALL_SHARE, ranked_groups

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(4):
        x = x + jnp.tanh(nn.BatchNorm(use_running_average=False)(nn.Dense(64)(x)))
      return jnp.sum(x ** 2)

  net, x = Net(), jnp.ones((256, 64))
  variables = net.init(jax.random.key(0), x)
  loss = lambda p: net.apply({**variables, "params": p}, x, mutable=["batch_stats"])[0]
  graph = build_graph(jax.make_jaxpr(jax.grad(loss))(variables["params"]))
  current = candidate(graph, Plan())
  ratio = lambda group, nbytes: nbytes / (sum(chain_flops(graph, r.value, set())
                                              for r in group) + 1.0)
  near = ranked_groups(graph, current, recomputable(graph), 0)
  assert [ratio(*g) for g in near] == sorted((ratio(*g) for g in near), reverse=True)
  first_small = next(i for i, (_, n) in enumerate(near) if n < 1024)
  assert any(n >= 1024 for _, n in near[first_small:])  # a vector leads a larger group
  far = ranked_groups(graph, current, recomputable(graph), current.peak)
  large = [n >= SMALL_SHARE * current.peak for _, n in far]
  assert large == sorted(large, reverse=True) and 0 < sum(large) < len(large)
