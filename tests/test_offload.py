"""Host offload in the rewrite: copies to pinned_host and back, same numbers,
device bytes freed in the memory model (XLA:CPU ignores memory kinds,
so the device footprint of an offload plan is the model's)."""

import jax
import optax
import pytest

import jaxmem_models as models
from jaxmem.schedule._emit import emit
from jaxmem.graph._graph import build_graph
from jaxmem.cost._evaluate import fused_values
from jaxmem.cost._memory import simulate
from jaxmem._decisions import OFFLOAD, Offload, Plan
from jaxmem.schedule._schedule import build_schedule
from tests.dataflow import assert_offloads_flow
from tests.helpers import assert_trees_close


@pytest.fixture(scope="module")
def mlp():
  task = models.get("mlp", optimizer=optax.adam(1e-3, eps=1e-3), depth=6, width=32,
                    batch=256, features=16)
  args = task.init()
  graph = build_graph(jax.make_jaxpr(task.step)(*args))
  # Materialized residuals (XLA computes fused ones inside their readers),
  # largest first.
  fused = fused_values(graph)
  kept = sorted((r for r in graph.residuals if r.value not in fused),
                key=lambda r: -r.nbytes)
  return task, args, graph, kept


def test_offload_plan_moves_values_to_host_and_back_with_same_numbers(mlp):
  task, args, graph, kept = mlp
  chosen = kept[:4]
  # One copy back issued early (before the first backward equation), the
  # others right before their first backward reader.
  first = min(r.first_backward_use for r in graph.residuals)
  plan = Plan.of({r.value: OFFLOAD for r in chosen[1:]}
                 | {chosen[0].value: Offload(at=first)})
  schedule = build_schedule(graph, plan, fused_values(graph))
  kinds = [op.kind for op in schedule.ops]
  assert kinds.count("offload") == kinds.count("prefetch") == len(chosen)
  run = emit(schedule)
  # The program really moves them (the jaxpr; XLA:CPU drops the copies,
  # fact 2): each goes to host memory, comes back, and the backward pass
  # reads the copy brought back, never the device original.
  assert assert_offloads_flow(jax.make_jaxpr(run)(*jax.tree_util.tree_leaves(args)).jaxpr) \
      == len(chosen)
  # Lowered for a GPU (from this CPU machine), each copy is an XLA placement
  # annotation: to pinned_host after the forward use, back to the device.
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args)]
  mlir = jax.export.export(jax.jit(run), platforms=["cuda"])(*shapes).mlir_module()
  assert mlir.count('_xla_buffer_placement = "pinned_host"') == len(chosen)
  assert mlir.count('_xla_buffer_placement = "device"') == len(chosen)
  got = jax.jit(run)(*jax.tree_util.tree_leaves(args))
  want = jax.tree_util.tree_leaves(jax.jit(task.step)(*args))
  assert_trees_close(got, want)
  # The early copy back comes before the first backward equation.
  early = next(i for i, op in enumerate(schedule.ops) if op.kind == "prefetch"
               and op.outs[0][0] == chosen[0].value)
  first_pos = next(i for i, op in enumerate(schedule.ops)
                   if op.kind == "node" and op.node == first)
  assert early < first_pos


def test_memory_model_frees_offloaded_device_bytes_and_counts_host(mlp):
  _, _, graph, kept = mlp
  fused = fused_values(graph)
  keep_all = simulate(build_schedule(graph, Plan(), fused))
  # Every residual made before the peak and read only by the backward pass.
  forward_only = [r for r in kept if r.last_forward_use <= r.produced_at + 1]
  plan = Plan.of({r.value: OFFLOAD for r in kept})
  offloaded = simulate(build_schedule(graph, plan, fused))
  assert offloaded.peak < keep_all.peak
  assert keep_all.host_peak == 0
  # All copies are on the host together when the backward pass begins.
  assert offloaded.host_peak == sum(r.nbytes for r in kept)
  assert forward_only  # the MLP's residuals are such values
