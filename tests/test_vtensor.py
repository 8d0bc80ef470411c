"""vTensors (split / salloc / merge) and the LGM planner.

XLA:CPU ignores host memory kinds: the lowered program is
checked for the copies (the jaxpr, and a CUDA lowering made on this CPU),
and the device footprint is the memory model's.
"""


import jax
import optax
import pytest

import jaxmem
import jaxmem_models as models
from jaxmem._decisions import KEEP, RECOMPUTE, Chunked, Offload, Plan
from jaxmem.targets import get_profile
from jaxmem.schedule._emit import emit
from jaxmem.cost._evaluate import fused_values
from jaxmem.cost._memory import simulate
from jaxmem.schedule._schedule import build_schedule
from jaxmem.planners import LGM, hybrid, reservation_floor
from tests.dataflow import assert_offloads_flow, chunk_merges
from tests.helpers import assert_trees_close, some_slow, xla_budget

def leaves(args):
  return jax.tree_util.tree_leaves(args)


def test_chunked_plan_moves_chunks_and_gives_the_same_numbers(mlp):
  task, args, graph, _ = mlp
  fused = fused_values(graph)
  chosen = sorted((r for r in graph.residuals if r.value not in fused),
                  key=lambda r: -r.nbytes)[:3]
  # Uneven chunks, along the batch axis and the feature axis by turns; the
  # first and last of three swapped.
  decisions = {}
  for i, r in enumerate(chosen):
    axis = i % 2
    n = r.shape[axis]
    bounds = ((0, n // 4), (n // 4, n // 2), (n // 2, n))
    decisions[r.value] = Chunked(axis, bounds, (Offload(), KEEP, Offload()))
  assert {d.axis for d in decisions.values()} == {0, 1}
  schedule = build_schedule(graph, Plan.of(decisions), fused)
  kinds = [op.kind for op in schedule.ops]
  assert kinds.count("split") == kinds.count("merge") == len(chosen)
  assert kinds.count("offload") == kinds.count("prefetch") == 2 * len(chosen)
  # The model counts chunk bytes exactly: a split's chunks add up to the tensor.
  for op in schedule.ops:
    if op.kind == "split":
      sizes = [schedule.nbytes(k) for k in op.outs]
      assert sum(sizes) == graph.values[op.ins[0][0]].nbytes
      assert sizes == decisions[op.ins[0][0]].chunk_bytes(
          graph.values[op.ins[0][0]].aval.shape, graph.values[op.ins[0][0]].nbytes)
  run = emit(schedule)
  # The program cuts each residual at the plan's bounds and axis, sends the
  # plan's chunks to the host and back, merges exactly those chunks in
  # order, and no backward reader reads a chunk's device original.
  emitted = jax.make_jaxpr(run)(*leaves(args)).jaxpr
  assert assert_offloads_flow(emitted) == 2 * len(chosen)
  planned = sorted((r.shape, d.axis, tuple((start, stop, c.kind == "offload")
                                           for (start, stop), c in zip(d.bounds, d.chunks)))
                   for r in chosen for d in [decisions[r.value]])
  assert sorted(chunk_merges(emitted)) == planned
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves(args)]
  mlir = jax.export.export(jax.jit(run), platforms=["cuda"])(*shapes).mlir_module()
  assert mlir.count('_xla_buffer_placement = "pinned_host"') == 2 * len(chosen)
  for _ in range(2):
    got = jax.jit(run)(*leaves(args))
    assert_trees_close(got, leaves(jax.jit(task.step)(*args)))
  # Host bytes: the swapped chunks (3/4 of each tensor) at most.
  profile = simulate(schedule)
  assert 0 < profile.host_peak <= sum(3 * r.nbytes // 4 for r in chosen)


def test_lgm_covers_each_deficit_with_little_excess(mlp):
  _, _, graph, base = mlp
  planner = LGM("t4", min_chunk=4096)
  result = planner.plan(graph, int(0.8 * base))
  assert result.fits and result.peak <= 0.8 * base
  records = result.details.records
  assert records and result.details.chunked > 0
  for peak in {r.peak for r in records}:
    covering = [r for r in records if r.peak == peak]
    deficit = covering[0].deficit
    swapped = sum(r.swapped_bytes for r in covering)
    assert swapped >= deficit  # the peak's deficit is covered ...
    # ... and overshoots by less than one chunk of the last tensor chosen.
    last = covering[-1]
    assert swapped - deficit < last.nbytes // last.chunks + 1
  # The plan swaps fewer bytes than whole tensors would.
  whole = LGM("t4", min_chunk=4096, whole=True).plan(graph, int(0.8 * base))
  assert result.memory.host_peak < whole.memory.host_peak


def test_chunks_respect_the_reservation_floor(mlp):
  _, _, graph, base = mlp
  floor = 8192
  for planner, allowed in ((LGM("t4", min_chunk=floor), floor), (LGM("t4", min_chunk=0), 0)):
    result = planner.plan(graph, int(0.8 * base))
    sizes = [size for vid, d in result.plan.with_kind("chunked").items()
             for size in d.chunk_bytes(graph.values[vid].aval.shape, graph.values[vid].nbytes)]
    assert sizes and min(sizes) >= allowed
  assert min(sizes) < floor  # without the floor, smaller chunks are chosen
  # The default floor comes from the link: 80% efficiency on a T4.
  t4 = get_profile("t4")
  assert LGM("t4").floor == reservation_floor(t4, 0.8)
  assert t4.efficiency(reservation_floor(t4, 0.8), "h2d") >= 0.8 - 1e-6
  # Reserved headroom: the plan aims below the aim it is given.
  result = LGM("t4", min_chunk=4096, reserve=0.05).plan(graph, int(0.8 * base))
  assert result.peak <= 0.8 * base * 0.95


def test_bad_options_are_refused():
  with pytest.raises(ValueError, match="unknown device profile 'k80'"):
    LGM("k80")
  with pytest.raises(ValueError, match="reserve is a share"):
    LGM(reserve=1.5)
  with pytest.raises(ValueError, match="one decision per chunk"):
    Chunked(0, ((0, 2),), (KEEP, KEEP))
  with pytest.raises(ValueError, match="kept or offloaded"):
    Chunked(1, ((0, 2),), (RECOMPUTE,))


def test_unified_memory_never_swaps(mlp):
  _, _, graph, base = mlp
  result = LGM("orin-nano").plan(graph, int(0.8 * base))
  assert not result.plan.uses_host and not result.fits


@pytest.mark.parametrize("name", some_slow(["mlp", "cnn", "transformer"], ("transformer",)))  # 28 s
def test_lgm_transform_gives_the_same_numbers(name):
  from tests.test_transform import SMALL
  task = models.get(name, optimizer=optax.adam(1e-3, eps=1e-3), **SMALL[name])
  args = task.init()
  fitted = jaxmem.transform(task.step, budget="85%", planner=LGM("t4", min_chunk=8192))
  plan = fitted.fit(*args)
  assert plan.plan.uses_host and plan.footprint <= xla_budget(task.step, args, "85%")
  want = jax.jit(task.step)(*args)
  assert_trees_close(fitted(*args), want)


def test_hybrid_with_lgm_as_its_swap_step(mlp):
  _, _, graph, base = mlp
  planner = hybrid("t4", swap="lgm")
  recompute_only = jaxmem.Greedy(target="t4")
  lowest = min(r.peak for r in recompute_only.lowest(graph))
  result = planner.plan(graph, int(lowest * 0.97))
  assert result.fits and result.plan.uses_host
  assert result.plan.values_with("recompute")
  with pytest.raises(ValueError, match="swap must be"):
    hybrid("t4", swap="nope")
