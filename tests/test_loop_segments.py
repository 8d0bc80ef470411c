"""Per-layer plans (``jaxmem.schedule._loop_segments``): a scanned stack whose stacked
residuals are chunked along the layer axis runs in segments, each with its
own decisions, gives the untransformed step's gradients, frees each
rebuilt segment's share in XLA's footprint, and stays one scan per
segment."""

import jax
import pytest

import jaxmem
from jaxmem._decisions import KEEP, OFFLOAD, RECOMPUTE, Chunked, Plan
from jaxmem.schedule._emit import emit
from jaxmem.cost._evaluate import evaluate
from jaxmem.targets import xla_footprint
from jaxmem.graph._graph import build_graph
from jaxmem.graph._loops import loops, stacked_residuals
from jaxmem.schedule._scan_remat import hostable, rebuildable

from tests.dataflow import assert_hosted_loops_flow
from tests.helpers import assert_trees_close
from test_loops import L, _flax, _plain
from test_scan_remat import _compiled, _dropout

MODELS = pytest.mark.parametrize("make", [_plain, _flax, _dropout],
                                 ids=["lax.scan", "nn.scan", "dropout"])


def _rebuilt_first(graph, cut):
  """The first ``cut`` layers of every rebuildable stack rebuilt, the rest
  kept."""
  chunks = Chunked(0, ((0, cut), (cut, L)), (RECOMPUTE, KEEP))
  return Plan.of({v: chunks for v in rebuildable(graph)})


def _top_level_scans(schedule, flat) -> int:
  return sum(e.primitive.name == "scan" for e in jax.make_jaxpr(emit(schedule))(*flat).eqns)


@MODELS
def test_rebuilding_some_layers_frees_their_share_and_gives_the_same_gradients(make):
  step, args = make()
  graph = build_graph(jax.make_jaxpr(step)(*args))
  flat = jax.tree_util.tree_leaves(args)
  stacked = stacked_residuals(graph)
  freed = sum(graph.values[v].nbytes for v in rebuildable(graph))
  slices = sum(stacked[v].per_iteration for v in rebuildable(graph))
  plain_schedule = evaluate(graph, Plan())[0]
  expected = jax.jit(emit(plain_schedule))(*flat)
  before = xla_footprint(_compiled(emit(plain_schedule), flat))
  footprints = []
  for cut in (L // 4, L // 2):
    schedule, memory = evaluate(graph, _rebuilt_first(graph, cut))
    assert _top_level_scans(schedule, flat) == 4, "two segments, forward and backward"
    assert_trees_close(jax.jit(emit(schedule))(*flat), expected)
    after = xla_footprint(_compiled(emit(schedule), flat))
    # The rebuilt layers' stacks go; one iteration's rebuilt slices come.
    assert before - after >= cut / L * freed - 2 * slices, (cut, before, after, freed)
    assert abs(memory.peak - after) <= 0.1 * after, (memory.peak, after)
    assert schedule.recompute_flops == pytest.approx(
        cut / L * graph.nodes[loops(graph)[0].forward].flops)
    footprints.append(after)
  assert footprints[1] < footprints[0] < before


@MODELS
def test_each_segment_keeps_rebuilds_or_hosts_on_its_own(make):
  """Three segments: the first rebuilt, the middle in host memory one slice
  per iteration, the last kept; layer inputs hosted in the first half."""
  step, args = make()
  graph = build_graph(jax.make_jaxpr(step)(*args))
  flat = jax.tree_util.tree_leaves(args)
  rebuilt = rebuildable(graph)
  layered = Chunked(0, ((0, 4), (4, 12), (12, L)), (RECOMPUTE, OFFLOAD, KEEP))
  inputs = Chunked(0, ((0, 8), (8, L)), (OFFLOAD, KEEP))
  plan = Plan.of({v: layered if v in rebuilt else inputs for v in hostable(graph)})
  schedule, memory = evaluate(graph, plan)
  emitted = jax.make_jaxpr(emit(schedule))(*flat)
  # Segments at the union of the bounds: 0-4, 4-8, 8-12, 12-16.
  assert sum(e.primitive.name == "scan" for e in emitted.eqns) == 8
  on_host = sorted(assert_hosted_loops_flow(emitted.jaxpr))
  per_layer = {v: graph.values[v].aval.shape[1:] for v in hostable(graph)}
  want = sorted([(4, *per_layer[v]) for v in rebuilt for _ in range(2)]
                + [(4, *per_layer[v]) for v in per_layer if v not in rebuilt for _ in range(2)])
  assert on_host == want
  assert memory.host_peak == sum(graph.values[v].nbytes // 2 for v in hostable(graph))
  assert_trees_close(jax.jit(emit(schedule))(*flat),
                     jax.jit(emit(evaluate(graph, Plan())[0]))(*flat))


def test_a_budget_between_kept_and_rebuilt_rebuilds_only_the_layers_it_needs():
  """At 80% of XLA's footprint the 16-layer scanned MLP needs only some
  layers rebuilt: the planner keeps the last layers' stacks, at less than
  three quarters of the FLOPs of rebuilding every layer."""
  step, args = _plain()
  budget = int(0.8 * xla_footprint(_compiled(step, args)))
  fitted = jaxmem.transform(step, budget=budget)
  fit = fitted.fit(*args)
  assert fit.footprint <= budget
  graph = fit.graph
  every_layer = evaluate(graph, Plan.of({v: RECOMPUTE for v in rebuildable(graph)}))[0]
  assert fit.added_flops < 0.75 * every_layer.recompute_flops
  assert any(d.kind == "chunked" for _, d in fit.plan)
  assert f"keep[{L // 4}:{L}]" in fit.report() or f"keep[{L // 2}:{L}]" in fit.report()
  params, x = args
  for _ in range(3):
    got, want = fitted(params, x), jax.jit(step)(params, x)
    assert_trees_close(got, want)
    params = want


def test_a_chunk_no_loop_can_rebuild_is_refused():
  step, args = _plain()
  graph = build_graph(jax.make_jaxpr(step)(*args))
  carry = next(v for v in hostable(graph) if v not in rebuildable(graph))
  with pytest.raises(ValueError, match="never rebuilt"):
    evaluate(graph, Plan.of({carry: Chunked(0, ((0, 8), (8, L)), (RECOMPUTE, KEEP))}))
  plain = next(r.value for r in graph.residuals if r.value not in stacked_residuals(graph))
  n = graph.values[plain].aval.shape[0]
  with pytest.raises(ValueError, match="not such a stack"):
    evaluate(graph, Plan.of({plain: Chunked(0, ((0, 1), (1, n)), (RECOMPUTE, KEEP))}))


def test_chunks_that_do_not_cover_the_layers_or_clash_are_refused():
  """Layers no chunk covers would never run: refused, as is a decision a
  segmented loop cannot carry out; a single chunk is its decision whole."""
  step, args = _plain()
  graph = build_graph(jax.make_jaxpr(step)(*args))
  rebuilt = next(iter(rebuildable(graph)))
  carry = next(v for v in hostable(graph) if v not in rebuildable(graph))
  for bounds in (((0, 4), (4, 8)), ((2, 8), (8, L)), ((0, 8), (4, L))):
    with pytest.raises(ValueError, match=f"cover layers 0 to {L} once"):
      evaluate(graph, Plan.of({rebuilt: Chunked(0, bounds, (RECOMPUTE, KEEP))}))
  across = Chunked(1, ((0, 8), (8, 32)), (OFFLOAD, KEEP))
  with pytest.raises(ValueError, match="kept, recomputed or offloaded"):
    evaluate(graph, Plan.of({rebuilt: _rebuilt_first(graph, 4)[rebuilt], carry: across}))
  whole = evaluate(graph, Plan.of({carry: OFFLOAD}))[1]
  single = evaluate(graph, Plan.of({carry: Chunked(0, ((0, L),), (OFFLOAD,))}))[1]
  assert (single.peak, single.host_peak) == (whole.peak, whole.host_peak)


def test_a_rebuilding_loops_body_is_sized_as_xla_gpu_runs_it():
  """A scanned GPT-2 for a T4 with layers rebuilt: a rebuilding loop's body
  makes each layer's residuals again and reads most of them inside fused
  kernels, so it holds far less than the layer's slices. The memory model
  sizes that body by its own iteration's program, and each segment's after
  the segments run before it have read their pieces for the last time:
  within 8% of XLA:GPU's footprint of the emitted step with the last half
  of the layers rebuilt (that segment runs first) and with every layer
  rebuilt. With only the last layer kept, XLA:GPU inlines that one-layer
  segment's loops: the model frees its pieces as their readers run, as
  XLA does, but holds them all from the forward pass, where XLA fuses
  some into the backward pass's kernels: over XLA, by less than 22%."""
  import jaxmem_models as models
  from jaxmem.cost._memory import _rebuilding_scratch
  from jaxmem.cost._xla_buffers import learn, with_buffers
  from jaxmem.targets import placed, resolve
  task = models.get("gpt2", dim=32, depth=4, heads=2, seq=128, vocab=128, batch=4, scan=True)
  args = jax.eval_shape(task.init)
  flat = jax.tree_util.tree_leaves(args)
  where = resolve("t4", ())
  graph = build_graph(jax.make_jaxpr(task.step)(*args))
  graph = with_buffers(graph, learn(graph, where))
  stacked, rebuilt = stacked_residuals(graph), rebuildable(graph)
  plans = {"last half rebuilt": (Chunked(0, ((0, 2), (2, 4)), (KEEP, RECOMPUTE)), 0.92, 1.08),
           "all rebuilt": (RECOMPUTE, 0.92, 1.08),
           "last layer kept": (Chunked(0, ((0, 3), (3, 4)), (RECOMPUTE, KEEP)), 0.92, 1.22)}
  for name, (decision, low, high) in plans.items():
    schedule, memory = evaluate(graph, Plan.of({v: decision for v in rebuilt}))
    xla = xla_footprint(jax.jit(emit(schedule), compiler_options=where.options(measuring=True))
                        .lower(*placed(flat, "t4")).compile())
    assert low <= memory.peak / xla <= high, (name, memory.peak, xla)
  body = next(it for op in schedule.ops if len(op.params) > 1
              for it in op.params[1].iterations if it.rebuilt)
  held = _rebuilding_scratch(graph, body.backward, body.forward, body.rebuilt)
  assert held < sum(stacked[v].per_iteration for v in rebuilt), held
