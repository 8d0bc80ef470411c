"""Device profiles, the performance model and calibration."""

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.targets import PROFILES, DeviceProfile, get_profile
from jaxmem.graph._graph import build_graph
from jaxmem.graph._primitives import is_free
from jaxmem.cost._perf import OpCost, Transfer, predict, predict_schedule, schedule_costs
from jaxmem._decisions import RECOMPUTE, Plan
from jaxmem.schedule._schedule import build_schedule


def test_presets_have_sources_and_only_jetson_is_unified():
  assert {"t4", "rtx3060", "orin-nano"} <= set(PROFILES)
  for name, profile in PROFILES.items():
    assert profile.name == name and profile.source
  assert [p.name for p in PROFILES.values() if p.unified] == ["orin-nano"]


def test_small_copies_use_the_link_badly():
  t4 = get_profile("t4")
  assert t4.efficiency(64 * 2**10) < 0.5 < 0.99 < t4.efficiency(256 * 2**20)
  assert t4.transfer_seconds(0, "h2d") == t4.link_latency
  with pytest.raises(ValueError, match="direction must be 'd2h' or 'h2d', got 'up'"):
    t4.transfer_seconds(1, "up")


def test_bad_profiles_and_names_are_refused():
  with pytest.raises(ValueError, match="flops must be > 0, got 0"):
    DeviceProfile("x", 0, 1, 1, 1, 0, 1)
  with pytest.raises(ValueError, match=r"unknown device profile 'k80'.*calibrate"):
    get_profile("k80")


def test_prefetch_that_is_not_ready_stalls_its_reader():
  profile = DeviceProfile("toy", flops=1e9, memory_bandwidth=1e12, h2d_bandwidth=1e9,
                          d2h_bandwidth=1e9, link_latency=0.0, memory=2**30)
  ops = [OpCost(f"op{i}", 1e6, 0) for i in range(4)]  # 1 ms each
  alone = predict(ops, [], profile)
  assert alone.seconds == pytest.approx(4e-3) and alone.stall == 0
  # 3 MB take 3 ms: issued after op 0, needed by op 2, which may start at 2 ms.
  late = predict(ops, [Transfer("h2d", 3_000_000, issue=0, need=2)], profile)
  start, end = late.transfers[0]
  assert start == pytest.approx(1e-3) and end == pytest.approx(4e-3)
  assert late.stall == pytest.approx(2e-3) and late.seconds == pytest.approx(6e-3)
  # A copy issued early enough hides under compute: t_ready <= start of op 2.
  early = predict(ops, [Transfer("h2d", 1_000_000, issue=-1, need=2)], profile)
  assert early.stall == 0 and early.transfers[0][1] <= early.op_end[1]
  # Offloads share one stream in order; nothing waits for them.
  down = predict(ops, [Transfer("d2h", 2_000_000, 0), Transfer("d2h", 2_000_000, 0)],
                 profile)
  assert down.transfers[1][0] == pytest.approx(down.transfers[0][1])
  assert down.seconds == pytest.approx(5e-3) and down.stall == 0
  with pytest.raises(ValueError, match="needed at op 1 but issued after op 2"):
    predict(ops, [Transfer("h2d", 1, issue=2, need=1)], profile)


def test_recomputation_costs_predicted_time():
  def step(w, x):
    def loss(w):
      h = x
      for _ in range(4):
        h = jnp.tanh(h @ w)
      return jnp.sum(h)
    return jax.grad(loss)(w)
  graph = build_graph(jax.make_jaxpr(step)(jnp.eye(64), jnp.ones((128, 64))))
  plain = build_schedule(graph, Plan())
  dropped = Plan.of({r.value: RECOMPUTE for r in graph.residuals
                     if r.primitive == "tanh"})
  redone = build_schedule(graph, dropped)
  t4 = get_profile("t4")
  costs = schedule_costs(redone)
  assert len(costs) == len(redone.ops)
  # Every op is charged its equation's FLOPs (recomputed ones too), views
  # and broadcasts nothing (XLA fuses them).
  charged = lambda s: sum(graph.nodes[op.node].flops for op in s.ops
                          if op.node is not None and not is_free(graph.nodes[op.node].prim.name))
  assert sum(c.flops for c in costs) == pytest.approx(charged(redone))
  assert charged(redone) > charged(plain) == pytest.approx(
      sum(c.flops for c in schedule_costs(plain)))
  assert predict_schedule(redone, t4).seconds > predict_schedule(plain, t4).seconds


def test_calibrate_measures_this_device():
  profile = jaxmem.calibrate(matmul=128, sizes=(2**12, 2**16, 2**18), repeats=2)
  assert profile.flops > 0 and profile.memory_bandwidth > 0
  assert profile.d2h_bandwidth > 0 and profile.h2d_bandwidth > 0
  assert profile.link_latency >= 0 and profile.memory > 0
  assert profile.unified == (jax.devices()[0].platform == "cpu")
  assert "calibrate" in profile.source


def test_a_collective_takes_its_exchanged_bytes_over_the_interconnect():
  h100 = get_profile("h100")
  gather = OpCost("all_gather", 0.0, 2 * 2**20, exchanged=2**30)
  assert gather.seconds(h100) == pytest.approx(2**30 / h100.interconnect_bandwidth)
  alone = DeviceProfile("one", flops=1e12, memory_bandwidth=1e11, h2d_bandwidth=1e10,
                        d2h_bandwidth=1e10, link_latency=0.0, memory=2**30)
  assert gather.seconds(alone) == pytest.approx(2**30 / 1e11)  # no interconnect: memory
