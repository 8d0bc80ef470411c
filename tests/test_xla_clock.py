"""The clock prices the target's compiled program kernel by kernel
(``_xla_clock``): on hand-written programs, figures worked out here; on an
MLP step compiled for a T4, the FLOPs of its matrix products against the
count from the layer shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxmem.cost._perf import OpCost
from jaxmem.cost._xla_clock import program_time
from jaxmem.targets import get_profile, placed, resolve

# Round figures so each expected time is worked out by hand: 1 GB/s of
# memory, 1 GFLOP/s of matmul, 0.1 GB/s of host link, no latencies.
TOY = dataclasses.replace(get_profile("t4"), name="toy", memory_bandwidth=1e9, flops=1e9,
                          matmul_flops=1e9, h2d_bandwidth=1e8, d2h_bandwidth=1e8,
                          link_latency=0.0, kernel_latency=0.0)

KERNELS = """\
HloModule m, is_scheduled=true

%fused_slice (p0: f32[1000,1000], p1: s32[]) -> f32[10,1000] {
  %p0 = f32[1000,1000]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = f32[10,1000]{1,0} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={10,1000}
  ROOT %neg = f32[10,1000]{1,0} negate(%ds)
}

%fused_update (p0: f32[1000,1000], p1: f32[10,1000], p2: s32[]) -> f32[1000,1000] {
  %p0 = f32[1000,1000]{1,0} parameter(0)
  %p1 = f32[10,1000]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %exp = f32[10,1000]{1,0} exponential(%p1)
  ROOT %dus = f32[1000,1000]{1,0} dynamic-update-slice(%p0, %exp, %p2, %zero)
}

ENTRY %main (a: f32[1000,1000], b: f32[1000,500], i: s32[]) -> f32[1000,1000] {
  %a = f32[1000,1000]{1,0} parameter(0)
  %b = f32[1000,500]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %gemm = (f32[1000,500]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %sliced = f32[10,1000]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused_slice
  ROOT %updated = f32[1000,1000]{1,0} fusion(%a, %sliced, %i), kind=kLoop, calls=%fused_update
}
"""


def test_each_kernel_takes_its_roofline_time():
  """A GEMM: 2*1000*500*1000 FLOPs = 1 s at 1 GFLOP/s, over its 6 MB of
  operands and output (its workspace not counted). A fusion that slices
  ten rows of an operand reads those 40 kB, not the 4 MB operand: 80 kB in
  all. An in-place update writes its 40 kB update into a buffer it does not
  read: 40 kB read, 40 kB written."""
  timing = program_time(KERNELS, TOY)
  assert timing.count == 3
  assert timing.seconds == pytest.approx(1.0 + 80e3 / 1e9 + 80e3 / 1e9, rel=1e-3)
  assert timing.link == 0.0


LOOP_AND_COPIES = """\
HloModule m, is_scheduled=true

%body (c: (s32[], f32[250000])) -> (s32[], f32[250000]) {
  %c = (s32[], f32[250000]{0}) parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  %x = f32[250000]{0} get-tuple-element(%c), index=1
  %y = f32[250000]{0} sine(%x)
  ROOT %t = (s32[], f32[250000]{0}) tuple(%k, %y)
}

%cond (c: (s32[], f32[250000])) -> pred[] {
  %c = (s32[], f32[250000]{0}) parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%k, %k), direction=LT
}

ENTRY %main (x: f32[250000], s: (s32[], f32[250000])) -> f32[250000] {
  %x = f32[250000]{0} parameter(0)
  %s = (s32[], f32[250000]{0}) parameter(1)
  %out = (f32[250000]{0:S(5)}, f32[250000]{0}, u32[]) copy-start(%x)
  %loop = (s32[], f32[250000]{0}) while(%s), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %done = f32[250000]{0:S(5)} copy-done(%out)
  %back = (f32[250000]{0}, f32[250000]{0:S(5)}, u32[]) copy-start(%done)
  %home = f32[250000]{0} copy-done(%back)
  ROOT %z = f32[250000]{0} negate(%home)
}
"""


def test_host_copies_run_beside_kernels_and_loops_run_their_trips():
  """The loop's body (a 2 MB sine, 2 ms) runs 4 times, 8 ms, while the
  1 MB copy to the host (10 ms at 0.1 GB/s) runs beside it; the copy back
  waits for it (10 ms more), and the negation after waits for that: 20 ms
  of link, then the 2 ms negation. The condition compares two scalars:
  9 bytes a trip."""
  timing = program_time(LOOP_AND_COPIES, TOY)
  assert timing.link == pytest.approx(0.020)
  assert timing.seconds == pytest.approx(0.020 + 0.002, rel=1e-6)
  assert timing.kernels == pytest.approx(4 * (0.002 + 9 / 1e9) + 0.002, rel=1e-9)
  assert timing.count == 4 * 2 + 1


def test_the_matrix_products_of_a_compiled_step_are_priced_by_their_flops():
  """An MLP's training step compiled for a T4: each layer's forward, input
  gradient and weight gradient products are 2*batch*in*out FLOPs each (the
  first layer's input gradient is not computed). With no memory cost and
  no latency, the clock's time is those FLOPs over the matmul rate."""
  widths, batch = (64, 128, 256, 32), 512
  params = [jnp.ones((a, b)) for a, b in zip(widths, widths[1:])]

  def loss(params, x):
    for w in params:
      x = jnp.tanh(x @ w)
    return jnp.sum(x)

  step = lambda params, x: jax.tree.map(lambda w, g: w - g, params,
                                         jax.grad(loss)(params, x))
  args = placed((params, jnp.ones((batch, widths[0]))), "t4")
  compiled = jax.jit(step, compiler_options=resolve("t4", ()).options()).lower(*args).compile()
  products = sum(2 * batch * a * b for a, b in zip(widths, widths[1:]))
  flops = 3 * products - 2 * batch * widths[0] * widths[1]
  matmul_only = dataclasses.replace(TOY, memory_bandwidth=1e30)
  assert program_time(compiled.as_text(), matmul_only).seconds == pytest.approx(
      flops / 1e9, rel=1e-6)


def test_convolutions_and_their_gradients_are_priced_by_the_forward_flops():
  """Two 3x3 convolutions: each forward pass and each filter gradient is
  N*H*W*Co*3*3*Ci multiply-adds, and so is the second's input gradient (the
  first's is not computed). cuDNN's gradient calls permute the forward
  convolution's arrays; the clock counts the forward convolution's FLOPs,
  and runs the filter gradients at half the rate (``LIBRARY_CALLS``). The
  profile names no GPU, so no call is priced by its occupancy."""
  conv = lambda x, w: jax.lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  loss = lambda ws, x: jnp.sum(jnp.tanh(conv(conv(x, ws[0]), ws[1])))
  step = lambda ws, x: jax.tree.map(lambda w, g: w - g, ws, jax.grad(loss)(ws, x))
  n, h, w, c_in, c = 2, 16, 16, 4, 8  # a batch unlike the channels
  ws = (jnp.ones((3, 3, c_in, c)), jnp.ones((3, 3, c, c)))
  args = placed((ws, jnp.ones((n, h, w, c_in))), "t4")
  compiled = jax.jit(step, compiler_options=resolve("t4", ()).options()).lower(*args).compile()
  first, second = (2 * n * h * w * c * 9 * k for k in (c_in, c))
  matmul_only = dataclasses.replace(TOY, memory_bandwidth=1e30, description=None)
  assert program_time(compiled.as_text(), matmul_only).seconds == pytest.approx(
      (first + second + 2 * (first + second) + second) / 1e9, rel=1e-6)


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_a_forward_convolution_with_fewer_output_tiles_than_multiprocessors_runs_slower(
    micro_batches):
  """The filter gradient of a stride-2 transposed convolution: XLA:GPU
  emits it as a forward convolution whose window spans the image and whose
  output is the 2x2 filter, one 128x128 tile of work, so it keeps one of the
  T4's 40 multiprocessors busy and takes 40 times its FLOPs' time; the
  forward pass and the input gradient write enough tiles to fill the GPU
  (``occupancy``). Against the same profile naming no GPU, the clock adds
  39 times the filter gradient's FLOPs over the rate, once per micro-batch
  where the gradients are summed over micro-batches in a loop: there XLA:GPU
  fuses the sum into the call (``__cudnn$convBiasActivationForward``, the
  running sum its side input), which tiles its output alike."""
  n, h, c_in, c = 8, 64, 32, 16  # the input gradient: 8*64*64*32 = 64 tiles
  up = lambda x, w: jax.lax.conv_transpose(x, w, (2, 2), "VALID",
                                           dimension_numbers=("NHWC", "HWIO", "NHWC"))
  loss = lambda w, x: jnp.sum(jnp.tanh(up(x, w)))
  summed = lambda w, xs: jax.lax.fori_loop(
      0, micro_batches, lambda i, acc: acc + jax.grad(loss)(w, xs[i]), jnp.zeros_like(w))
  step = lambda w, xs: w - summed(w, xs)
  args = placed((jnp.ones((2, 2, c_in, c)), jnp.ones((micro_batches, n, h, h, c_in))), "t4")
  text = jax.jit(step, compiler_options=resolve("t4", ()).options()).lower(
      *args).compile().as_text()
  if micro_batches > 1:
    assert "__cudnn$convBiasActivationForward" in text
  matmul_only = dataclasses.replace(TOY, memory_bandwidth=1e30, kernel_latency=0.0)
  assert matmul_only.description.core_count == 40
  filter_gradient = 2 * n * h * h * c_in * c * 2 * 2
  unnamed = dataclasses.replace(matmul_only, description=None)
  added = program_time(text, matmul_only).seconds - program_time(text, unnamed).seconds
  assert added == pytest.approx(
      micro_batches * 39 * filter_gradient / matmul_only.matmul_throughput, rel=1e-6)
  # The planners price the equation by the same rule.
  op = OpCost("conv_general_dilated", filter_gradient, 0, matmul=True,
              library="__cudnn$convForward", outputs=2 * 2 * c_in * c)
  assert op.seconds(matmul_only) == pytest.approx(
      40 * filter_gradient / matmul_only.matmul_throughput, rel=1e-6)


@pytest.mark.parametrize("name, config", [
    ("mlp", dict(depth=16, width=64, batch=512, features=32)),
    pytest.param("transformer", dict(depth=2, dim=32, heads=2, seq=32, batch=16, vocab=64),
                 marks=pytest.mark.slow),  # 15 s
    ("cnn", dict(widths=(16, 32), batch=32, size=32, blocks=4))])
def test_the_planners_cost_follows_the_clock_on_a_gpu_target(name, config):
  """With the buffers and kernels learned from XLA:GPU's program for a T4
  (``_xla_buffers``), the planners' per-equation cost of the step as written
  (``_perf``: only values with a buffer move, one launch per kernel) is
  within 25% of the clock's time for that program."""
  import jaxmem_models as models
  from jaxmem.cost._evaluate import unplanned
  from jaxmem.graph._graph import build_graph
  from jaxmem.cost._perf import predict_schedule
  from jaxmem.cost._xla_buffers import learn, with_buffers

  task = models.get(name, **config)
  shapes = jax.eval_shape(task.init)
  target = resolve("t4", jax.tree_util.tree_leaves(shapes))
  compiled = jax.jit(task.step, compiler_options=target.options()).lower(
      *placed(shapes, "t4")).compile()
  clock = program_time(compiled.as_text(), target.profile).seconds
  graph = build_graph(jax.make_jaxpr(task.step)(*shapes))
  graph = with_buffers(graph, learn(graph, target))
  modelled = predict_schedule(unplanned(graph, 0).schedule, target.profile).seconds
  assert 0.75 < modelled / clock < 1.25, (modelled, clock)


GATHER = """\
HloModule m, is_scheduled=true

ENTRY %main (x: f32[31250]) -> f32[250000] {
  %x = f32[31250]{0} parameter(0)
  ROOT %g = f32[250000]{0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
}
"""


def test_a_collective_moves_its_result_over_the_interconnect():
  # 1 MB gathered at 0.1 GB/s between GPUs: 10 ms, where its memory traffic
  # (at most 1.125 MB at 1 GB/s) takes about 1 ms.
  linked = dataclasses.replace(TOY, interconnect_bandwidth=1e8)
  assert program_time(GATHER, linked).seconds == pytest.approx(1e-2)
  alone = dataclasses.replace(TOY, interconnect_bandwidth=None)  # one GPU: memory only
  assert program_time(GATHER, alone).seconds <= 1.125e-3 + 1e-9
