"""Host copies are timed as the target's compiler schedules them: XLA:GPU's
default schedule waits for each copy where it is issued, so a plan's copies
are stalls, and a planner that may offload or recompute takes the one that
costs less as the program runs."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmem
import jaxmem_models as models
from jaxmem.cost._evaluate import first_backward_need, prefetch_point
from jaxmem.cost._perf import predict_schedule
from jaxmem.planners import hybrid
from jaxmem.targets import get_profile, resolve, timing_profile
from jaxmem.targets import _copy_schedule

T4 = "t4"


def _copies(schedule) -> list[tuple[str, int]]:
  """(direction, bytes) of each copy a schedule makes."""
  return [("d2h" if op.kind == "offload" else "h2d", schedule.nbytes(op.outs[0]))
          for op in schedule.ops if op.kind in ("offload", "prefetch")]


def test_calibrate_times_copies_that_xla_gpu_keeps():
  """``calibrate()`` reads a program's per-copy latency from chains whose
  links are round trips through host memory: XLA:GPU keeps both copies of
  every link (without the barrier it folds each pair away, and the chains
  time no copy)."""
  from jaxmem.cost import _hlo as hlo
  from jaxmem.targets import _calibrate
  target = resolve("h100", ())
  avals = target.place([jax.ShapeDtypeStruct((16, 16), jnp.float32)] * 2)
  text = _calibrate.chain(_calibrate.round_trip, 5, compiler_options=target.options()).lower(
      *avals).compile().as_text()
  copies = [i for c in hlo.parse(text).computations.values() for i in c if i.crosses_memory()]
  assert len(copies) == 10


def test_calibrate_reads_no_copy_latency_where_the_chains_time_no_copy(monkeypatch):
  """Two copies a link beyond the chain without them; none where the
  round trips take no longer (or cannot be compiled): ``calibrate()`` then
  keeps the latency of copies timed from Python, never a free copy."""
  from jaxmem.targets import _calibrate
  cpu = jax.devices("cpu")[0]
  monkeypatch.setattr(_calibrate, "_chain_slope", lambda *args: 5e-6)
  assert _calibrate._copy_latency(cpu, 1e-6, 1, 1) == pytest.approx(2e-6)
  assert _calibrate._copy_latency(cpu, 5e-6, 1, 1) is None

  def no_host_memory(*args):
    raise ValueError("no memory space Host on this backend")
  monkeypatch.setattr(_calibrate, "_chain_slope", no_host_memory)
  assert _calibrate._copy_latency(cpu, 1e-6, 1, 1) is None


def test_xla_gpu_waits_for_each_host_copy_unless_latency_hiding_schedules_it():
  # The default schedule: each copy-done right after its copy-start.
  assert _copy_schedule.waits_for_copies(_copy_schedule.probe_program(resolve(T4, ()))) is True
  assert timing_profile(resolve(T4, ())).copies_wait is True
  # The latency-hiding scheduler puts the matrix products between them.
  assert _copy_schedule.waits_for_copies(
      _copy_schedule.probe_program(resolve(T4, ()),
                                     xla_gpu_enable_latency_hiding_scheduler=True)) is False
  # No GPU: nothing to learn, the profile as it is (none on CPU).
  assert timing_profile(resolve(None, [jnp.ones(2)])) is None


def test_a_planner_whose_copies_wait_recomputes_where_offload_only_looked_free(mlp):
  _, _, graph, base = mlp
  t4 = get_profile(T4)
  waits = dataclasses.replace(t4, copies_wait=True)
  aim = int(0.7 * base)
  overlapped, waited = hybrid(t4).plan(graph, aim), hybrid(waits).plan(graph, aim)
  assert overlapped.plan.uses_host and waited.fits and not waited.plan.uses_host
  # Timed as the program runs, the overlapped plan's copies are stalls, and
  # the plan that waits for them costs less.
  stalled, hidden = (predict_schedule(overlapped.schedule, p) for p in (waits, t4))
  copies = sum(t4.transfer_seconds(nbytes, d) for (d, nbytes) in _copies(overlapped.schedule))
  assert stalled.stall == pytest.approx(copies) and hidden.stall < copies / 2
  assert predict_schedule(waited.schedule, waits).seconds < stalled.seconds
  assert "waiting for each host copy" in hybrid(waits).describe()


def test_a_fit_for_a_gpu_target_times_copies_as_its_compiler_schedules_them():
  task = models.get("mlp", optimizer=optax.sgd(1e-3), depth=6, width=32, batch=256,
                    features=16)
  args = task.init()
  fitted = jaxmem.transform(task.step, budget="100%", planner="hybrid", target=T4)
  fit = fitted.fit(*args)
  assert fit.planner.target_profile.copies_wait is True
  assert "waiting for each host copy" in fitted.report(*args)


def test_a_copy_the_compiler_waits_for_comes_back_where_it_is_needed(mlp):
  """Waited for wherever it is issued, a copy back is issued at its reader:
  issued earlier, it only holds the device buffer longer (XLA:GPU keeps
  the copy where the plan's barrier puts it)."""
  _, _, graph, base = mlp
  t4 = get_profile(T4)
  waits = dataclasses.replace(t4, copies_wait=True)
  schedule = hybrid(t4).plan(graph, int(0.7 * base)).schedule
  offloaded = schedule.plan.values_with("offload")
  assert offloaded
  position = {op.node: pos for pos, op in enumerate(schedule.ops) if op.kind == "node"}
  earlier = 0
  for vid in offloaded:
    first = first_backward_need(schedule, vid)
    reader = next(op.node for op in schedule.ops[first:] if op.kind == "node")
    nbytes = graph.values[vid].nbytes
    assert prefetch_point(schedule, vid, nbytes, waits) == reader
    earlier += position[prefetch_point(schedule, vid, nbytes, t4)] < position[reader]
  assert earlier  # overlapped, some copy is issued ahead of its reader
