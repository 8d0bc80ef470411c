"""Offload inside loops (``jaxmem.schedule._loop_schedule``): a scanned stack's stacked
residuals kept in host memory one slice per iteration.

XLA:CPU ignores host memory, so these checks read the
emitted program's data flow (which values are in host memory, what copies
them and what reads them), the memory and performance models against
figures computed here from the graph, and the gradients against the
untransformed step."""

import jax
import pytest

import jaxmem
from jaxmem._decisions import OFFLOAD, RECOMPUTE, Plan
from jaxmem.targets import get_profile
from jaxmem.schedule._emit import emit
from jaxmem.cost._evaluate import evaluate
from jaxmem.targets import xla_footprint
from jaxmem.graph._graph import build_graph
from jaxmem.graph._loops import stacked_residuals
from jaxmem.cost._perf import predict_schedule, schedule_transfers
from jaxmem.schedule._scan_remat import hostable, rebuildable

from tests.dataflow import assert_hosted_loops_flow
from tests.helpers import assert_trees_close
from test_loops import _flax, _plain
from test_scan_remat import _compiled, _dropout

MODELS = pytest.mark.parametrize("make", [_plain, _flax, _dropout],
                                 ids=["lax.scan", "nn.scan", "dropout"])


def _all_hosted(graph):
  return {v: OFFLOAD for v in hostable(graph)}


def _rebuilt_from_hosted_carries(graph):
  """Stacks rebuilt per iteration from the layer inputs, kept on the host."""
  rebuilt = rebuildable(graph)
  return {v: RECOMPUTE if v in rebuilt else OFFLOAD for v in hostable(graph)}


@MODELS
@pytest.mark.parametrize("shape", [_all_hosted, _rebuilt_from_hosted_carries],
                         ids=["hosted", "rebuilt-from-host"])
def test_hosted_stacks_flow_through_host_memory_one_slice_at_a_time(make, shape):
  step, args = make()
  graph = build_graph(jax.make_jaxpr(step)(*args))
  plan = shape(graph)
  hosted = {v for v, d in plan.items() if d.kind == "offload"}
  assert hosted
  flat = jax.tree_util.tree_leaves(args)
  schedule, _ = evaluate(graph, Plan.of(plan))
  emitted = jax.make_jaxpr(emit(schedule))(*flat).jaxpr
  assert sorted(assert_hosted_loops_flow(emitted)) == sorted(graph.values[v].aval.shape for v in hosted)
  got = jax.jit(emit(schedule))(*flat)
  expected = jax.jit(emit(evaluate(graph, Plan())[0]))(*flat)
  assert_trees_close(got, expected)
  # The step as the user wrote it, not only the emitted unplanned schedule.
  assert_trees_close(jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(jax.eval_shape(step, *args)), got), jax.jit(step)(*args))


@MODELS
def test_the_memory_model_holds_hosted_stacks_on_the_host(make):
  step, args = make()
  graph = build_graph(jax.make_jaxpr(step)(*args))
  plan = _all_hosted(graph)
  stacked = stacked_residuals(graph)
  freed = sum(graph.values[v].nbytes for v in plan)
  slices = sum(stacked[v].per_iteration for v in plan)
  _, kept = evaluate(graph, Plan())
  _, hosted = evaluate(graph, Plan.of(plan))
  assert hosted.host_peak == freed
  # The stacks leave the device; at most one iteration's slices stay.
  assert freed - slices <= kept.peak - hosted.peak <= freed, (kept.peak, hosted.peak)


@pytest.mark.parametrize("shape", [_all_hosted, _rebuilt_from_hosted_carries],
                         ids=["hosted", "rebuilt-from-host"])
def test_the_performance_model_copies_each_stack_beside_its_loop(shape):
  """Each stack on the host goes out once and comes back once, also the
  layer input that the backward body and the rebuild both read."""
  step, args = _plain()
  graph = build_graph(jax.make_jaxpr(step)(*args))
  plan = {v: d for v, d in shape(graph).items() if d.kind == "offload"}
  freed = sum(graph.values[v].nbytes for v in plan)
  schedule, _ = evaluate(graph, Plan.of(plan))
  transfers = schedule_transfers(schedule)
  assert sorted(t.direction for t in transfers) == ["d2h", "h2d"]
  assert all(t.nbytes == freed for t in transfers)
  scans = [pos for pos, op in enumerate(schedule.ops)
           if op.kind == "node" and graph.nodes[op.node].prim.name == "scan"]
  # Each copy starts with its loop and the op after the loop waits for it.
  assert sorted((t.issue + 1, t.need - 1) for t in transfers) == [(p, p) for p in scans]
  t4 = get_profile("t4")
  unplanned = predict_schedule(evaluate(graph, Plan())[0], t4).seconds
  assert predict_schedule(schedule, t4).seconds >= max(
      unplanned, t4.transfer_seconds(freed, "h2d"))


def test_an_offloading_planner_fits_below_what_recomputation_reaches():
  """The 16-layer scanned MLP: recomputation alone (rebuilt per iteration,
  or nested) reaches about 54% of XLA's footprint; with the stacks on the
  host the hybrid planner fits 45%."""
  step, args = _plain()
  budget = int(0.45 * xla_footprint(_compiled(step, args)))
  with pytest.raises(jaxmem.BudgetError):
    jaxmem.transform(step, budget=budget, micro_batches=1).fit(*args)
  fitted = jaxmem.transform(step, budget=budget, planner="hybrid")
  fit = fitted.fit(*args)
  assert fit.footprint <= budget
  assert fit.result.plan.values_with("offload") & set(hostable(fit.graph))
  assert fit.result.memory.schedule.hosted, "a stack is made in host memory"
  assert "offload/iter" in fit.report()
  assert_trees_close(fitted(*args), jax.jit(step)(*args))


def test_the_layer_inputs_a_remat_stack_keeps_can_go_to_the_host():
  """``nn.scan(nn.remat(Block))`` keeps only each layer's input; nesting the
  loop is all recomputation can add (smallest: about 91% of XLA's
  footprint). With those inputs on the host, one slice per iteration, the
  hybrid planner fits 70% (issue 17 part 4)."""
  from test_written_steps import _flax as transformer
  step, args = transformer(remat=True)
  budget = int(0.7 * xla_footprint(_compiled(step, args)))
  with pytest.raises(jaxmem.BudgetError):
    jaxmem.transform(step, budget=budget, micro_batches=1).fit(*args)
  fitted = jaxmem.transform(step, budget=budget, planner="hybrid")
  fit = fitted.fit(*args)
  assert fit.footprint <= budget and fit.result.memory.schedule.hosted
  params, x = args
  for _ in range(3):  # updated parameters and gradients, step after step
    got, expected = fitted(params, x), jax.jit(step)(params, x)
    assert_trees_close(got, expected)
    params = expected[0]


def test_an_offload_plan_hosts_only_the_layers_a_budget_needs():
  """At 80% of XLA's footprint the offload planner keeps the first layers'
  stacks on the host and the last ones on the device: fewer bytes copied
  than hosting every layer."""
  step, args = _plain()
  budget = int(0.8 * xla_footprint(_compiled(step, args)))
  fitted = jaxmem.transform(step, budget=budget, planner="offload")
  fit = fitted.fit(*args)
  assert fit.footprint <= budget
  every_layer = sum(fit.graph.values[v].nbytes for v in hostable(fit.graph))
  assert 0 < fit.result.memory.host_peak < every_layer
  assert any(d.kind == "chunked" and d.chunks[0].kind == "offload" for _, d in fit.plan)
  assert_trees_close(fitted(*args), jax.jit(step)(*args))
