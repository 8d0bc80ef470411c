"""The memory model learns what XLA:GPU gives a buffer from XLA:GPU's own
program for the step (``_xla_buffers``), compiled here for a T4."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmem
import jaxmem_models as models
from jaxmem.cost._evaluate import unplanned
from jaxmem.graph._graph import build_graph
from jaxmem.cost import _hlo as hlo
from jaxmem.cost._xla_buffers import (WrittenBuffer, assign, compile_tagged, learn, read,
                                      rewritten, with_buffers, workspaces, written_buffers)
from jaxmem.cost._xla_loops import loop_bodies
from jaxmem.cost._xla_shards import elements, shard_elements
from jaxmem.targets import placed, resolve, workspace_bytes, xla_footprint
from tests.helpers import some_slow

# A scheduled program as XLA:GPU prints it, cut to what the reader uses: a
# cuBLAS call with its workspace, a multi-output fusion whose second output
# is a reshape, a loop whose body writes one buffer, and instructions that
# write none (parameters, tuples, bitcasts, get-tuple-element).
HLO = """\
HloModule jit_run, is_scheduled=true

%fused_pair (p0: f32[8,4]) -> (f32[8,4], f32[32]) {
  %p0 = f32[8,4]{1,0} parameter(0)
  %tanh.1 = f32[8,4]{1,0} tanh(%p0), metadata={op_name="jit(run)/jvp(Net)/jaxmem#3/tanh"}
  %mul.1 = f32[8,4]{1,0} multiply(%tanh.1, %tanh.1), metadata={op_name="jit(run)/jaxmem#4/mul"}
  %bitcast.1 = f32[32]{0} bitcast(%mul.1), metadata={op_name="jit(run)/jaxmem#5/reshape"}
  ROOT %tuple.1 = (f32[8,4]{1,0}, f32[32]{0}) tuple(%tanh.1, %bitcast.1)
}

%body (carry: (s32[], f32[16])) -> (s32[], f32[16]) {
  %carry = (s32[], f32[16]{0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%carry), index=0
  %gte.1 = f32[16]{0} get-tuple-element(%carry), index=1
  %sin.1 = f32[16]{0} sine(%gte.1), metadata={op_name="jit(run)/while/body/jaxmem#9/sin"}
  ROOT %tuple.2 = (s32[], f32[16]{0}) tuple(%gte.0, %sin.1)
}

%cond (carry: (s32[], f32[16])) -> pred[] {
  %carry = (s32[], f32[16]{0}) parameter(0)
  %gte.2 = s32[] get-tuple-element(%carry), index=0
  ROOT %lt = pred[] compare(%gte.2, %gte.2), direction=LT
}

ENTRY %main (x: f32[8,16], w: f32[16,4], c: (s32[], f32[16])) -> f32[8,4] {
  %x = f32[8,16]{1,0} parameter(0), metadata={op_name="x"}
  %w = f32[16,4]{1,0} parameter(1), metadata={op_name="w"}
  %c = (s32[], f32[16]{0}) parameter(2)
  %gemm = (f32[8,4]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(run)/jvp(Net)/Dense_0/jaxmem#2/dot_general" source_file="net.py"}
  %gte.3 = f32[8,4]{1,0} get-tuple-element(%gemm), index=0, metadata={op_name="jit(run)/jvp(Net)/Dense_0/jaxmem#2/dot_general"}
  %pair = (f32[8,4]{1,0}, f32[32]{0}) fusion(%gte.3), kind=kLoop, calls=%fused_pair, metadata={op_name="jit(run)/jaxmem#4/mul"}
  %loop = (s32[], f32[16]{0}) while(%c), condition=%cond, body=%body, metadata={op_name="jit(run)/jaxmem#8/while"}
  %gte.4 = f32[8,4]{1,0} get-tuple-element(%pair), index=0
  ROOT %bitcast.2 = f32[8,4]{1,0} bitcast(%gte.4)
}
"""


def test_the_buffers_a_program_writes_are_read_off_its_text():
  """Each buffer is named by the equation whose tag its producing
  instruction carries: a fusion's outputs by the fused instructions that
  make them (through a reshape to what it reshapes), a library call by its
  result (its workspace is not a value), a loop by its carries and its
  body's own buffers."""
  written = written_buffers(HLO)
  assert {tag: [b[:3] for b in found] for tag, found in written.items()} == {
      # (elements, bytes, readers)
      2: [(32, 128, 1)],  # the GEMM's result, not its 4 MiB workspace; the fusion reads it
      3: [(32, 128, 1)],  # tanh, the fusion's first output: the result, through views
      4: [(32, 128, 1)],  # the reshaped product: its buffer is the multiply's
      8: [(1, 4, 0), (16, 64, 0)],  # the loop's carries, which nothing reads
      9: [(16, 64, 1)],  # the body's sine, in the body's result
  }
  # What the kernel writing each buffer runs: the fusion its three equations.
  assert written[3][0].runs == written[4][0].runs == {3, 4, 5}
  assert written[2][0].runs == {2} and written[9][0].runs == {9}


# A program with buffers no equation names: a max-pool's argmax indices,
# which a fusion with no name finds beside the pooled value it does not
# keep, run after the forward pass's equation 2 and read by the gradient's
# scatter (equation 7); and a weight relaid from an argument, read by a
# convolution and by the update (equation 9) that writes an output of its
# size in its place.
UNNAMED = """\
HloModule jit_run, is_scheduled=true

%fused_window (p0: f32[4,8]) -> (f32[2,8], s32[2,8], s32[2,8]) {
  %p0 = f32[4,8]{1,0} parameter(0)
  %relu = f32[4,8]{1,0} maximum(%p0, %p0), metadata={op_name="jit(run)/jaxmem#1/max"}
  %i0 = s32[4,8]{1,0} iota(), iota_dimension=0
  %i1 = s32[4,8]{1,0} iota(), iota_dimension=1
  ROOT %window = (f32[2,8]{1,0}, s32[2,8]{1,0}, s32[2,8]{1,0}) reduce-window(%relu, %i0, %i1), window={size=2x1 stride=2x1}
}

%fused_relaid (p0: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  ROOT %t = f32[8,8]{0,1} transpose(%p0), dimensions={1,0}
}

ENTRY %main (x: f32[4,8], w: f32[8,8]) -> (f32[8,8], f32[4,8]) {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %relaid = f32[8,8]{0,1} fusion(%w), kind=kLoop, calls=%fused_relaid
  %conv = f32[4,8]{1,0} custom-call(%x, %relaid), custom_call_target="__cudnn$convForward", metadata={op_name="jit(run)/jaxmem#2/conv"}
  %window = (f32[2,8]{1,0}, s32[2,8]{1,0}, s32[2,8]{1,0}) fusion(%x), kind=kLoop, calls=%fused_window
  %rows = s32[2,8]{1,0} get-tuple-element(%window), index=1
  %cols = s32[2,8]{1,0} get-tuple-element(%window), index=2
  %grad = f32[4,8]{1,0} scatter(%conv, %rows, %cols), metadata={op_name="jit(run)/jaxmem#7/select_and_scatter_add"}
  %update = f32[8,8]{1,0} add(%relaid, %w), metadata={op_name="jit(run)/jaxmem#9/add"}
  ROOT %out = (f32[8,8]{1,0}, f32[4,8]{1,0}) tuple(%update, %grad)
}
"""


def test_buffers_no_equation_names_are_held_from_where_they_are_made_to_their_reader():
  """A buffer written by a kernel with no name is held from the last named
  equation before it to its last reader, its source the last equation it
  runs; an array nothing reads is not held. One made from arguments alone
  is relaid, and where its last reader writes a step output of its size it
  takes no bytes of its own."""
  from jaxmem.cost._xla_unnamed import Unnamed, unnamed, unnamed_spans
  found = unnamed(hlo.parse(UNNAMED))
  assert [(u.first, u.last, u.nbytes, u.source, u.relaid) for u in found] == [
      (0, 9, 256, None, True),  # the relaid weight, from the program's start
      (2, 7, 64, 1, False),  # the row indices, from after the convolution
      (2, 7, 64, 1, False),  # the column indices; the pooled value, unread, is not held
  ]
  assert found[0].last_runs == {9}

  step = lambda w, x: (w * 2.0, jnp.tanh(x))  # noqa: E731
  graph = build_graph(jax.make_jaxpr(step)(jnp.ones((8, 8)), jnp.ones((4, 8))))
  update = next(n.index for n in graph.nodes if n.prim.name == "mul")
  spans = unnamed_spans(graph, [
      Unnamed(0, update, 256, None, True, frozenset({update})),  # in the update's place
      Unnamed(0, update, 64, None, True, frozenset({update})),  # not of its size
      Unnamed(0, update, 256, 0, False, frozenset({update})),  # not relaid
  ])
  assert spans == ((0, update, 64, None), (0, update, 256, 0))


# A max-pool gradient's scatter as XLA:GPU emits it: into a copy of zeros
# that the forward kernel of the activation also writes, a copy only the
# scatter reads and updates in place (inside a fusion, through a reshape);
# and into a copy of the activation read again after it.
IN_PLACE = """\
HloModule jit_run, is_scheduled=true

%fused_forward (p0: f32[4,8]) -> (f32[4,8], f32[4,8]) {
  %p0 = f32[4,8]{1,0} parameter(0)
  %e = f32[4,8]{1,0} exponential(%p0), metadata={op_name="jit(run)/jaxmem#1/exp"}
  %zero = f32[] constant(0)
  %zeros = f32[4,8]{1,0} broadcast(%zero), dimensions={}
  ROOT %t = (f32[4,8]{1,0}, f32[4,8]{1,0}) tuple(%e, %zeros)
}

%fused_scatter (p0: f32[4,8], p1: s32[2,8], p2: f32[2,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = s32[2,8]{1,0} parameter(1)
  %p2 = f32[2,8]{1,0} parameter(2)
  %b = f32[4,8]{1,0} bitcast(%p0)
  ROOT %s = f32[4,8]{1,0} scatter(%b, %p1, %p2), metadata={op_name="jit(run)/jaxmem#3/select_and_scatter_add"}
}

ENTRY %main (x: f32[4,8], i: s32[2,8], u: f32[2,8]) -> (f32[4,8], f32[4,8]) {
  %x = f32[4,8]{1,0} parameter(0)
  %i = s32[2,8]{1,0} parameter(1)
  %u = f32[2,8]{1,0} parameter(2)
  %fwd = (f32[4,8]{1,0}, f32[4,8]{1,0}) fusion(%x), kind=kLoop, calls=%fused_forward, metadata={op_name="jit(run)/jaxmem#1/exp"}
  %act = f32[4,8]{1,0} get-tuple-element(%fwd), index=0
  %zeros = f32[4,8]{1,0} get-tuple-element(%fwd), index=1
  %copy = f32[4,8]{1,0} copy(%zeros)
  %grad = f32[4,8]{1,0} fusion(%copy, %i, %u), kind=kInput, calls=%fused_scatter, metadata={op_name="jit(run)/jaxmem#3/select_and_scatter_add"}
  %again = f32[4,8]{1,0} copy(%act)
  %grad2 = f32[4,8]{1,0} scatter(%again, %i, %u), metadata={op_name="jit(run)/jaxmem#4/select_and_scatter_add"}
  %sum = f32[4,8]{1,0} add(%again, %grad2), metadata={op_name="jit(run)/jaxmem#5/add"}
  ROOT %out = (f32[4,8]{1,0}, f32[4,8]{1,0}) tuple(%grad, %sum)
}
"""


def test_a_scatters_base_is_its_value_and_zeros_beside_an_activation_are_not_its_copy():
  """XLA writes a scatter's (or a dynamic-update-slice's) result into its
  first operand where nothing reads the operand afterwards: a copy of an
  activation that only a max-pool gradient's scatter reads is then the
  gradient's own buffer, held as the gradient's value and not beside it.
  A copy read again after the scatter is held to its last reader. Zeros
  that the activation's kernel writes beside it are no copy of the
  activation: they are held from that kernel to the scatter that reads
  their copy, whatever becomes of the activation."""
  from jaxmem.cost._xla_buffers import written_buffers
  from jaxmem.cost._xla_unnamed import unnamed
  program = hlo.parse(IN_PLACE)
  grad = next(i for i in program.entry_instructions if i.name == "grad")
  assert hlo.in_place(grad, program) == 0
  assert [(u.first, u.last, u.nbytes, u.source) for u in unnamed(program)] == [
      (0, 3, 128, 1),  # the zeros
      (3, 5, 128, 1),  # the copy read again
  ]
  assert [b.nbytes for b in written_buffers(IN_PLACE)[1]] == [128]  # the activation alone


# One device's program of a partitioned step, cut to its collectives: a
# matmul's partial result summed over devices (all-reduce), and two
# operands gathered in one transfer for the equations that read them.
PARTITIONED = """\
HloModule jit_run, is_scheduled=true

ENTRY %main (x: f32[4,8], w: f32[8,4]) -> f32[4,4] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,4]{1,0} parameter(1)
  %gemm = f32[4,4]{1,0} custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(run)/jaxmem#0/dot_general"}
  %sum-start = f32[4,4]{1,0} all-reduce-start(%gemm), metadata={op_name="jit(run)/jaxmem#0/dot_general"}
  %sum-done = f32[4,4]{1,0} all-reduce-done(%sum-start), metadata={op_name="jit(run)/jaxmem#0/dot_general"}
  %gather-start = ((f32[4,4]{1,0}, f32[4,8]{1,0}), (f32[16,4]{1,0}, f32[16,8]{1,0})) all-gather-start(%sum-done, %x), dimensions={0}, metadata={op_name="jit(run)/jaxmem#1/tanh"}
  %gather-done = (f32[16,4]{1,0}, f32[16,8]{1,0}) all-gather-done(%gather-start), metadata={op_name="jit(run)/jaxmem#1/tanh"}
  %first = f32[16,4]{1,0} get-tuple-element(%gather-done), index=0
  %second = f32[16,8]{1,0} get-tuple-element(%gather-done), index=1
  %tanh = f32[4,4]{1,0} tanh(%first), metadata={op_name="jit(run)/jaxmem#1/tanh"}
  %mul = f32[4,4]{1,0} multiply(%tanh, %tanh), metadata={op_name="jit(run)/jaxmem#2/mul"}
  %late = f32[4,4]{1,0} slice(%second), slice={[0:4], [0:4]}, metadata={op_name="jit(run)/jaxmem#3/add"}
  ROOT %add = f32[4,4]{1,0} add(%mul, %late), metadata={op_name="jit(run)/jaxmem#3/add"}
}
"""


def test_a_partitioned_programs_collectives_hold_their_buffers():
  """In one device's program of a partitioned step (its examples over 4
  devices): each value's shard is read off the instructions its equation
  runs as, not off what an all-gather run for it gathers; a node's partial
  results summed over devices are that node's value (the partial a copy
  held while the node runs); what an all-gather gathers for its readers is
  no value's: each result is held from the node the gather runs for to the
  last node that reads it, and names the node that made what it gathers
  (None for an argument)."""
  def run(x, w):
    y = x @ w
    t = jnp.tanh(y)
    return t * t + y
  graph = build_graph(jax.make_jaxpr(run)(jnp.ones((16, 8)), jnp.ones((8, 4))))
  assert [n.prim.name for n in graph.nodes] == ["dot_general", "tanh", "mul", "add"]
  compiled = type("Compiled", (), {"as_text": lambda self: PARTITIONED})()
  known = shard_elements(graph, [], compiled)
  assert known == {n.outs[0]: 16 for n in graph.nodes}  # a quarter of each [16, 4]
  buffers = read(graph, compiled, elements(graph, known))
  made = graph.nodes[0].outs[0]
  assert made in buffers.materialized and buffers.transient[0] == 64  # the partial
  assert buffers.extra == {}
  assert sorted(buffers.spans) == [(1, 1, 256, 0), (1, 3, 512, None)]


def test_a_library_calls_workspace_is_scratch_of_its_equation():
  """The cuBLAS call's workspace belongs to the equation it runs (the
  memory model holds it while that equation runs, in any plan)."""
  assert workspaces(hlo.parse(HLO)) == {2: 4194304}


def test_each_equation_knows_the_library_call_it_runs_as():
  """A small CNN's step compiled for a T4: its convolution equations run as
  cuDNN calls of each kind (the forward pass, the input and the filter
  gradients), and the planners' cost of each gives it that kind's time,
  the clock's (a filter gradient at half the rate of the others)."""
  from jaxmem.cost._perf import node_costs
  task = models.get("cnn", widths=(8, 16), batch=8, size=16, blocks=2)
  graph = build_graph(jax.make_jaxpr(task.step)(*jax.eval_shape(task.init)))
  graph = with_buffers(graph, learn(graph, resolve("t4", ())))
  kinds = set(graph.buffers.library.values())
  assert {"__cudnn$convBackwardFilter", "__cudnn$convBackwardInput"} <= kinds, kinds
  assert kinds & {"__cudnn$convForward", "__cudnn$convBiasActivationForward"}, kinds
  profile = dataclasses.replace(resolve("t4", ()).profile, kernel_latency=0.0)
  filters = 0
  for node, cost in zip(graph.nodes, node_costs(graph)):
    if graph.buffers.library.get(node.index) == "__cudnn$convBackwardFilter":
      compute = cost.flops / profile.matmul_throughput
      memory = cost.nbytes / profile.memory_bandwidth
      assert cost.seconds(profile) == pytest.approx(2 * (compute + memory))
      assert cost.seconds(profile) > 2 * max(compute, memory)  # not the roofline's max
      filters += 1
  forward = [n for n in graph.nodes if n.prim.name == "conv_general_dilated" and not n.backward]
  assert filters == len(forward) > 0  # one filter gradient per convolution


def test_the_time_model_gives_the_step_as_written_the_clocks_time():
  """The time model prices each equation as a kernel of its own, and
  XLA:GPU fuses many into one, so alone it is off the program's time.
  Learned from the program, its op times are scaled so that the step as
  written takes the clock's time on the target (and a plan's copies to the
  host weigh against compute that lasts as long as the program's)."""
  from jaxmem.cost._perf import predict_schedule, timed
  from jaxmem.cost._xla_buffers import tagged_program
  from jaxmem.cost._xla_clock import program_time
  task = models.get("cnn", widths=(8, 16), batch=8, size=16, blocks=2)
  shapes = jax.eval_shape(task.init)
  graph = build_graph(jax.make_jaxpr(task.step)(*shapes))
  target = resolve("t4", ())
  tagged = tagged_program(graph, target)
  clock = program_time(tagged.as_text(), target.profile).seconds
  learned = timed(with_buffers(graph, read(graph, tagged)), tagged, target.profile)
  assert abs(learned.buffers.time_scale - 1) > 0.05, "the model alone is the clock's: no check"
  written = unplanned(learned, 0).schedule
  assert predict_schedule(written, target.profile).seconds == pytest.approx(clock, rel=0.01)
  # Without a profile, nothing to scale to.
  assert timed(with_buffers(graph, read(graph, tagged)), tagged, None).buffers.time_scale == 1


def test_buffers_go_to_the_values_of_equal_size_and_the_rest_is_extra():
  step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
  graph = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4))))
  dot = next(n for n in graph.nodes if n.prim.name == "dot_general")
  tanh = next(n for n in graph.nodes if n.prim.name == "tanh")
  buffers = assign(graph, {dot.index: [WrittenBuffer(8, 32, 1), WrittenBuffer(16, 64, 2)],
                           tanh.index: [WrittenBuffer(8, 32, 1)]})
  assert buffers.materialized == {dot.outs[0], tanh.outs[0]}
  assert buffers.extra == {dot.index: 64}  # a copy the size of w, not an output
  # A padded copy that is tanh's only buffer: tanh lives in it, and its
  # padding is held beside it.
  padded = assign(graph, {tanh.index: [WrittenBuffer(10, 40, 1)]})
  assert padded.materialized == {tanh.outs[0]} and padded.extra == {tanh.index: 8}
  # A copy beside tanh's own buffer that one instruction reads (a dilated
  # input for a transposed convolution) is held only while tanh runs.
  dilated = assign(graph, {tanh.index: [WrittenBuffer(8, 32, 3), WrittenBuffer(30, 120, 1)]})
  assert dilated.extra == {} and dilated.transient == {tanh.index: 120}


def test_a_forward_value_made_in_a_backward_kernel_is_held_beside_its_readers_only():
  """XLA:GPU makes a ReLU's mask again in the backward pass, in the kernel
  that reduces the gradient, from the activation it keeps anyway: the mask
  has no buffer through the step, only one from the first backward
  equation that kernel runs (or its first reader, if earlier) to its last
  reader. A buffer made by a kernel of forward equations only is the value's
  own."""
  step = lambda w, x: jax.grad(lambda w: jnp.sum(jax.nn.relu(x @ w) ** 2))(w)
  graph = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4))))
  mask = next(n for n in graph.nodes if not n.backward and n.outs
              and graph.values[n.outs[0]].aval.dtype == jnp.bool_
              and graph.values[n.outs[0]].uses
              and all(graph.nodes[u].backward for u in graph.values[n.outs[0]].uses))
  readers = graph.values[mask.outs[0]].uses
  backward = next(n.index for n in graph.nodes if n.backward)
  late = assign(graph, {mask.index: [WrittenBuffer(8, 8, 1, frozenset({mask.index, backward}))]})
  assert mask.outs[0] not in late.materialized
  assert backward < min(readers)  # the kernel runs an earlier backward equation too
  assert late.spans == ((backward, max(readers), 8, None),)
  early = assign(graph, {mask.index: [WrittenBuffer(8, 8, 1, frozenset({mask.index}))]})
  assert mask.outs[0] in early.materialized and early.spans == ()


def test_a_loops_buffers_beyond_its_outputs_are_not_extra():
  """A scan's body writes temporaries under the scan's tag, and its loop
  state passes its operands through: neither is held beside its outputs."""
  def step(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
  graph = build_graph(jax.make_jaxpr(step)(jnp.ones((3, 4, 4)), jnp.ones((2, 4))))
  scan = next(n for n in graph.nodes if n.prim.name == "scan")
  buffers = assign(graph, {scan.index: [WrittenBuffer(8, 32, 1), WrittenBuffer(48, 192, 1),
                                        WrittenBuffer(8, 32, 1)]})
  assert buffers.materialized == {scan.outs[0]} and buffers.extra == {}


SMALL = {
    "mlp": ("mlp", dict(depth=16, width=64, batch=512, features=32)),
    "cnn": ("cnn", dict(widths=(8, 16), batch=8, size=16, blocks=6)),
    "transformer": ("transformer", dict(depth=2, dim=32, heads=2, seq=32, batch=16, vocab=64)),
    # Strided depthwise convolutions, whose inputs XLA:GPU pads once and
    # keeps padded for the backward pass, and ReLU6 masks it makes again in
    # the backward pass (its first two stages at 224 pixels, where the
    # masks are 4% of the footprint).
    "mobilenetv2": ("mobilenetv2", dict(width=1.0, size=224, batch=2, stages=(
        (1, 16, 1, 1), (6, 24, 2, 2)))),
    # Max-pools after ReLUs, whose argmax indices XLA:GPU finds in the
    # forward pass, with no name, and holds for the gradient.
    "unet": ("unet", dict(width=8, depth=2, size=32, batch=4)),
    # Blocks under one nn.scan: the loops' bodies write buffers that are
    # neither their outputs nor held beside them.
    "scanned gpt2": ("gpt2", dict(dim=64, depth=4, heads=2, seq=64, vocab=256, batch=8,
                                  scan=True)),
}


# CI checks the test models; the zoo's (26-27 s each there) are model-scale.
@pytest.mark.parametrize("name", some_slow(sorted(SMALL), ("mobilenetv2", "unet", "scanned gpt2")))
def test_the_learned_model_follows_xla_gpu_on_the_step_as_written(name):
  """With what XLA:GPU fuses learned from its program for a T4, the memory
  model's footprint of the step as written is within 3% of XLA:GPU's,
  the cuBLAS/cuDNN workspaces included (the model holds each while its
  call runs). The program it is learned from, the step with its equations
  tagged, has the footprint of the step emitted from its graph untagged:
  a fit for a compile-only GPU measures the step on it."""
  model, config = SMALL[name]
  task = models.get(model, optimizer=optax.adam(1e-3, eps=1e-3), **config)
  args = task.init()
  graph = build_graph(jax.make_jaxpr(task.step)(*args))
  target = resolve("t4", ())
  compiled = jax.jit(task.step, compiler_options=target.options(measuring=True)).lower(
      *placed(args, "t4")).compile()
  # What the model must now hold (cuDNN runs the U-Net's convolutions
  # without scratch).
  assert (workspace_bytes(compiled) > 0) == (name != "unet")
  xla = xla_footprint(compiled)
  leaves = jax.tree_util.tree_leaves(args)
  tagged = compile_tagged(graph, target, leaves)
  assert xla_footprint(tagged) == xla_footprint(_compiled(rewritten(graph), leaves, target))
  learned = unplanned(with_buffers(graph, read(graph, tagged)), 0).peak
  assert abs(learned / xla - 1) <= 0.03, (learned, xla)


@pytest.mark.parametrize("target", [None, "t4"])
@pytest.mark.parametrize("shape", [(6, 64, 64, 8), (2, 16, 16, 32)])
def test_a_max_pool_gradient_holds_what_xla_expands_it_to(shape, target):
  """XLA rewrites a max-pool's gradient (``select_and_scatter_add``) into a
  scatter with temporaries several times the pooled tensor (XLA:CPU: the
  operand's indices along every axis); the model counts them while it
  runs, to within 5% of the compiler's footprint."""
  import flax.linen as nn
  step = jax.grad(lambda x: jnp.sum(nn.max_pool(x, (2, 2), (2, 2)) ** 2))
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  graph = build_graph(jax.make_jaxpr(step)(x))
  if target is None:
    xla = xla_footprint(jax.jit(step).lower(x).compile())
  else:
    where = resolve(target, ())
    xla = xla_footprint(jax.jit(step, compiler_options=where.options(measuring=True)).lower(
        *placed((x,), target)).compile())
    graph = with_buffers(graph, learn(graph, where))
  model = unplanned(graph, 0).peak
  operand = 4 * jnp.prod(jnp.array(shape))
  assert xla > 3 * operand  # the expansion is most of the footprint
  assert abs(model / xla - 1) <= 0.05, (model, xla)


def test_a_padded_copy_lives_with_the_forward_reads_of_a_block_checkpointed_whole():
  """XLA:GPU pads a convolution's input once and keeps the copy for the
  backward pass; behind a barrier (a block checkpointed whole reads its
  input through one) it pads again. The model holds the copy beside the
  value until the last op that reads the value itself, and no longer."""
  import flax.linen as nn
  from jaxmem.cost._xla_buffers import Buffers
  from jaxmem.planners._blocks import block_plans
  from jaxmem.cost._evaluate import candidate

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + nn.Dense(16)(jnp.tanh(nn.Dense(16)(x)))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jnp.sum(Block()(Block()(x)) ** 2)

  # A batch whose activations are larger than any gradient, so that no
  # output buffer holds them.
  net, x = Net(), jnp.ones((64, 16))
  params = net.init(jax.random.key(0), x)
  graph = build_graph(jax.make_jaxpr(jax.grad(lambda p: net.apply(p, x)))(params))
  # The first block's output (its residual add): the second block's input.
  made = next(n for n in graph.nodes if not n.backward and n.prim.name == "add"
              and n.label.split()[0] in ("Net/Block_0", "Net/Block_1"))
  copy = 1 << 20
  everything = frozenset(range(len(graph.values)))
  plain = with_buffers(graph, Buffers(everything, {}))
  padded = with_buffers(graph, Buffers(everything, {made.index: copy}))
  plan = block_plans(plain, "nothing_saveable")[0]
  without, held = candidate(plain, plan).memory, candidate(padded, plan).memory
  ops, key = held.schedule.ops, (made.outs[0], 0)
  assert any(op.kind == "barrier" and key in op.ins for op in ops)  # checkpointed
  start = next(i for i, op in enumerate(ops) if key in op.outs)
  last = max(i for i, op in enumerate(ops) if op.kind != "barrier" and key in op.ins)
  assert not ops[last].kind == "node" or not graph.nodes[ops[last].node].backward
  extra = [a - b for a, b in zip(held.timeline, without.timeline)]
  assert extra == [0] * start + [copy] * (last + 1 - start) + [0] * (len(ops) - last - 1)


def test_a_fit_for_a_compile_only_gpu_names_the_footprint_of_the_step_it_returns():
  """A fit for a T4 measures the step as written on its compilation with
  every equation tagged; where no plan is needed, the step it returns is
  that program untagged, of the footprint it names. (The step emitted from
  its graph may differ by a few bytes from the traced jaxpr: blocks under
  ``nn.scan`` do.)"""
  model, config = SMALL["scanned gpt2"]
  task = models.get(model, optimizer=optax.adam(1e-3, eps=1e-3), **config)
  args = task.init()
  fit = jaxmem.transform(task.step, budget="100%", target="t4").fit(*args)
  assert not len(fit.plan) and fit.target.compile_only
  returned = _compiled(fit.run, jax.tree_util.tree_leaves(args), fit.target)
  assert xla_footprint(returned) == fit.footprint <= fit.budget


def _compiled(run, leaves, target):
  """``run`` over flat ``leaves`` compiled for ``target`` as a fit measures."""
  return jax.jit(target.compiles(run, leaves), compiler_options=target.options(measuring=True)
                 ).lower(*target.place(leaves)).compile()


def test_a_fit_for_a_compile_only_gpu_plans_a_loops_body_with_the_bodys_buffers():
  """Where the step's passes run in a loop (gradient accumulation over a
  ``lax.scan``), the graph planned for a T4 is the loop's body, with the
  buffers XLA:GPU gives the body, not those of the step around it."""
  def loss(ws, x):
    return jnp.mean(jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, ws)[0] ** 2)

  def step(ws, xs):
    grads = jax.lax.scan(lambda g, x: (g + jax.grad(loss)(ws, x), None), jnp.zeros_like(ws),
                         xs)[0]
    return ws - 0.01 * grads

  args = (jnp.ones((4, 64, 64)) / 64, jnp.ones((2, 128, 64)))
  fit = jaxmem.transform(step, budget="100%", target="t4").fit(*args)
  assert not build_graph(jax.make_jaxpr(step)(*args)).residuals  # the step's: a loop
  assert fit.graph.residuals and fit.graph.buffers is not None
  learned = learn(fit.graph, fit.target)
  bodies = loop_bodies(fit.graph, fit.target)  # the body's own loops, compiled alone
  assert bodies and fit.graph.buffers.bodies == bodies
  assert dataclasses.replace(fit.graph.buffers, time_scale=learned.time_scale,
                             bodies=bodies) == dataclasses.replace(learned, bodies=bodies)
