"""What the target's compiler gives a buffer, learned from its own program.

XLA computes many values inside the kernels that read them (fusion) and
gives a buffer only to what a kernel writes. Which values those are depends
on the compiler: XLA:GPU fuses a bias add into cuBLAS's epilogue, reductions
over any axis, transposes; XLA:CPU does less (``_xla_cpu_fusion`` emulates
it). Rather than emulate XLA:GPU too, :func:`learn` asks it: the step as
written is emitted with every equation under a name scope of its own
(``jaxmem#<node>``), compiled for the target, and the optimized HLO read
back. Each buffer a scheduled instruction writes (a fusion's outputs, a
library call's result, a loop's carries) names the equation that made it in
its ``op_name`` metadata, so the equations whose values get buffers are
read off the program instead of predicted.

The memory model reads what was learned through
:class:`~jaxmem.cost._learned_fusion.LearnedFusion`: a value with no buffer
in the step as written is computed inside its readers in every plan, unless
a plan makes a copy, a barrier or a transfer read it (those read buffers).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import jax
from jaxmem.cost import _hlo as hlo
from jaxmem.cost._xla_names import TAG, producers, runs, tag_of
from jaxmem.cost._xla_unnamed import unnamed, unnamed_spans
from jaxmem.graph import _primitives
from jaxmem._decisions import Plan
from jaxmem.schedule._emit import UNTYPED, emit
from jaxmem.graph._graph import Graph, Residual, residual_of
from jaxmem.schedule._schedule import build_schedule

@dataclasses.dataclass(frozen=True)
class Buffers:
  """The buffers of a step as its compiler wrote it.

  Attributes:
    materialized: ids of the graph values that get a buffer.
    extra: node index -> bytes of buffers made for that node beyond its
      outputs that several instructions read (a padded copy of its value
      that a convolution and its backward pass read), live as long as the
      node's first output.
    transient: node index -> bytes of such buffers that one instruction
      reads (a dilated copy for a transposed convolution), held while the
      node runs.
    launches: indices of the nodes that end a kernel: of each kernel's
      buffers, the first one's node (a kernel writing several nodes'
      values, as a multi-output fusion does, launches once).
    workspace: node index -> bytes of the scratch its library call takes
      while it runs (the workspace XLA:GPU gives a cuBLAS or cuDNN call
      beside its result), wherever the node runs in a plan.
    library: node index -> the target of the library call XLA:GPU runs it
      as (``__cublas$lt$matmul``, ``__cudnn$convBackwardFilter``): the
      kind of call whose time the clock gives it.
    time_scale: the clock's seconds for this program on the target's
      profile over the sum of its equations' times in the time model, which
      the model's op times are multiplied by (``_perf.timed``): the model
      prices each equation as a kernel of its own and XLA fuses many into
      one, so the unscaled model is slower than the program (the zoo's
      U-Net at edge size for an H200: 15.8 ms against 11.2) and copies to
      the host and back, which it prices on the link alone, look hidden
      behind compute that does not last that long. 1 where the target has
      no profile.
    spans: ``(first node, last node, bytes, source node)`` of each buffer
      held from one node to another that is no value's own from its
      producer on: one a collective of a partitioned program writes (an
      all-gathered operand, or many of them combined into one transfer),
      from the node the collective runs for to the last node that reads
      it, ``source`` having made what it exchanges (None where unknown);
      and a forward value the program makes in the backward pass beside
      its readers (``_made_late``), from the first backward equation of
      the kernel that makes it (or its first reader, if earlier) to its
      last reader; and a buffer no equation names (a max-pool's argmax
      indices: ``_xla_unnamed``), from where the program makes it to its
      last reader.
    bodies: scan node index -> bytes its body holds beyond its arguments
      and results in the target's program (``_xla_loops``).
  """
  materialized: frozenset
  extra: Mapping[int, int]
  launches: frozenset = frozenset()
  workspace: Mapping[int, int] = dataclasses.field(default_factory=dict)
  transient: Mapping[int, int] = dataclasses.field(default_factory=dict)
  library: Mapping[int, str] = dataclasses.field(default_factory=dict)
  time_scale: float = 1.0
  spans: tuple = ()
  bodies: Mapping[int, int] = dataclasses.field(default_factory=dict)


class WrittenBuffer(NamedTuple):
  """A buffer the program writes: its elements, its bytes, how many
  instructions read it, and the tags of the equations the kernel writing
  it runs (its own and those of its fusion's instructions)."""
  elements: int
  nbytes: int
  readers: int
  runs: frozenset = frozenset()


def written_buffers(text: str) -> dict[int, list[WrittenBuffer]]:
  """Node tag -> each buffer the program writes for it: outputs of the
  scheduled computations' instructions (the entry's, and the bodies of its
  loops and conditionals), a fusion's named by the fused instructions that
  produce them."""
  return _written(_kernels(hlo.parse(text)))


def _written(kernels: list[list]) -> dict[int, list[WrittenBuffer]]:
  written: dict[int, list[WrittenBuffer]] = {}
  for tags in kernels:
    for tag, array, readers, runs in tags:
      written.setdefault(tag, []).append(
          WrittenBuffer(array.size, array.nbytes, readers, runs))
  return written


def _launching(kernels: list[list]) -> frozenset:
  """The tags that end a kernel: each kernel's first buffer's."""
  return frozenset(tags[0][0] for tags in kernels if tags)


def _kernels(program: hlo.Program) -> list[list]:
  """Per instruction that writes buffers in the scheduled computations, the
  (tag, array, readers, runs) of each buffer with a tag: ``readers`` counts
  the instructions reading the instruction's results, ``runs`` the tags of
  the equations the instruction runs. Collectives' buffers are
  :func:`_exchanged`'s."""
  found = []
  for name in program.scheduled():
    instructions = program.computations[name]
    readers = _readers(instructions)
    for inst in instructions:
      if inst.opcode not in hlo.NO_BUFFER and inst.opcode not in hlo.EXCHANGES:
        ran = runs(inst, program)
        found.append([(tag, array, readers.get(inst.name, 0), ran)
                      for tag, array in producers(inst, program) if tag is not None])
  return found


def _readers(instructions: list) -> dict[str, int]:
  """Instruction name -> how many instructions read its results, through
  the views and tuple elements that write no buffer (the computation's
  result counts as read by its caller)."""
  users = hlo.users_of(instructions)
  roots = {inst.name for inst in instructions if inst.root}
  counts: dict[str, int] = {}

  def count(name: str) -> int:
    if name not in counts:
      counts[name] = 0  # a cycle reads nothing more
      counts[name] = (name in roots) + sum(
          count(u.name) if u.opcode in ("get-tuple-element", "bitcast") else 1
          for u in users.get(name, ()))
    return counts[name]

  return {inst.name: count(inst.name) for inst in instructions}


class Exchanged(NamedTuple):
  """A buffer a collective writes: the node it runs for (its start's tag),
  its array, whether it is a value summed over devices (``hlo.REDUCTIONS``:
  the node's own where one of its outputs has its size), the last node
  that reads it, and the node that made what it exchanges (None where
  unnamed)."""
  tag: int
  array: hlo.Array
  owns: bool
  last: int
  source: int | None = None


def _exchanged(program: hlo.Program) -> list[Exchanged]:
  """Every buffer the collectives of the scheduled computations write
  (``hlo.exchanges``), by the tags of the nodes they run for and are read
  by."""
  found = []
  for exchange in hlo.exchanges(program):
    tag = tag_of(exchange.start)
    if tag is None:
      continue
    read = [t for t in map(tag_of, exchange.readers) if t is not None]
    found.append(Exchanged(tag, exchange.array, exchange.reduces, max([tag, *read]),
                           None if exchange.source is None else tag_of(exchange.source)))
  return found


def _copies(copies: list[WrittenBuffer], value_bytes: int,
            has_own: bool) -> tuple[int, int]:
  """Bytes of ``copies`` (buffers a node writes beyond its outputs: padded
  or relaid copies of its value) held beside the value while it lives, and
  held only while the node runs. Where the value has no buffer of its own
  size, the largest copy is its buffer (a padded activation the backward
  convolution reads too) and its padding is held beside it; of the other
  copies, one that one instruction reads (a dilated input for a transposed
  convolution) lives only for it, one that several read lives with the
  value."""
  held = 0
  if not has_own:
    largest = max(range(len(copies)), key=lambda i: copies[i].nbytes)
    held = max(copies[largest].nbytes - value_bytes, 0)
    copies = copies[:largest] + copies[largest + 1:]
  held += sum(c.nbytes for c in copies if c.readers > 1)
  return held, sum(c.nbytes for c in copies if c.readers <= 1)


def assign(graph: Graph, written: dict[int, list[WrittenBuffer]],
           exchanged: tuple[Exchanged, ...] = (),
           elements: Mapping[int, int] | None = None) -> Buffers:
  """The graph values that own the buffers ``written`` names: each node's
  buffers are matched to its outputs by element count (``elements``, value
  id -> its elements on one device, where the program is one device's of
  a partitioned step; else each value's own); buffers left over are copies
  of its value (:func:`_copies`), but for a loop or a branch. A view's
  buffer is its source's. Of the buffers collectives write
  (``exchanged``), a sum over devices that one of its node's outputs
  matches is that output's own buffer (the node's own result before it is
  then a copy of it); the rest are :attr:`Buffers.spans`."""
  count = (lambda v: graph.values[v].aval.size) if elements is None else elements.__getitem__
  written = {tag: list(arrays) for tag, arrays in written.items()}
  spans, summed = [], {}  # node -> its outputs a sum over devices is
  for found in exchanged:
    if found.tag >= len(graph.nodes) or found.last >= len(graph.nodes):
      continue
    taken = summed.setdefault(found.tag, [])
    match = next((v for v in graph.nodes[found.tag].outs if v not in taken
                  and count(v) == found.array.size), None) if found.owns else None
    if match is not None:
      taken.append(match)
      written.setdefault(found.tag, []).insert(
          len(taken) - 1, WrittenBuffer(found.array.size, found.array.nbytes, 1))
    else:
      source = found.source if found.source is not None and found.source < len(graph.nodes) \
          else None
      spans.append((found.tag, found.last, found.array.nbytes, source))
  materialized: set[int] = set()
  extra: dict[int, int] = {}
  transient: dict[int, int] = {}
  for tag, arrays in written.items():
    if tag >= len(graph.nodes):
      continue
    node = graph.nodes[tag]
    # A loop's or branch's buffers beyond its outputs are its body's
    # temporaries, live only while it runs (the memory model holds the
    # body's peak then), and its state passed through, which shares its
    # operands' buffers: none is a copy held beside its output.
    control = _primitives.info(node.prim.name).kind == _primitives.CONTROL
    left, copies = list(node.outs), []
    for buffer in arrays:
      match = next((v for v in left if count(v) == buffer.elements), None)
      if match is None:
        copies += [] if control else [buffer]
        continue
      left.remove(match)
      late = _made_late(graph, node, match, buffer)
      if late is not None:
        spans.append(late)
      else:
        materialized.add(match)
    if copies and node.outs:
      first = node.outs[0]  # a copy of the node's value is a buffer of it
      held, brief = _copies(copies, graph.values[first].nbytes, first not in left)
      materialized.add(first)
      for nbytes, into in ((held, extra), (brief, transient)):
        if nbytes:
          into[tag] = nbytes
  for node in reversed(graph.nodes):
    if (_primitives.is_view(node.prim.name) and node.outs and node.outs[0] in materialized
        and node.ins and isinstance(node.ins[0], int)):
      materialized.add(node.ins[0])
  return Buffers(frozenset(materialized), extra, transient=transient, spans=tuple(spans))


def _made_late(graph: Graph, node, vid: int, buffer: WrittenBuffer) -> tuple | None:
  """Where the program makes forward value ``vid`` (of ``node``) in a kernel
  that runs backward equations too, next to its readers, all backward (a
  ReLU's mask, compared again from the activation it is kept beside): the
  span its buffer is held for, from the first of that kernel's backward
  equations and its readers to its last reader; else None. The value then
  has no buffer from the forward pass: its readers compute it from what it
  is made of."""
  readers = graph.values[vid].uses
  late = [t for t in buffer.runs if t < len(graph.nodes) and graph.nodes[t].backward]
  if (node.backward or not late or not readers or vid in graph.output_ids
      or not all(graph.nodes[r].backward for r in readers)):
    return None
  return (min(*readers, *late), max(readers), buffer.nbytes, None)


def tagged(graph: Graph, binds=None):
  """``graph``'s step as written, each equation under the name scope
  ``jaxmem#<node>``: what is compiled to read the target's program back."""
  return rewritten(graph, TAG, binds)


def rewritten(graph: Graph, tag: str | None = None, binds=None):
  """``graph``'s step as written, emitted from the graph (without the
  barriers a plan adds, kernel gradients' pins among them); with ``tag``,
  each equation under a name scope of its own (see ``_emit.emit``)."""
  return emit(build_schedule(graph, Plan(), separate=False, pin=False), tag=tag,
              binds=binds or {})


def learn(graph: Graph, target, mesh=None) -> Buffers:
  """What ``target``'s compiler (a :class:`~jaxmem.targets.Target`) gives a
  buffer in ``graph`` as written: :func:`read` of :func:`tagged_program`."""
  return read(graph, tagged_program(graph, target, mesh))


def tagged_program(graph: Graph, target, mesh=None):
  """``graph``'s step as written compiled for ``target`` with every
  equation tagged (see the module docstring): what :func:`read` reads.
  ``mesh``: the mesh of the ``shard_map`` whose body ``graph`` is; each of
  its devices then runs the body on its own copy of the inputs, with the
  body's collectives."""
  avals = [jax.ShapeDtypeStruct(graph.values[v].aval.shape, graph.values[v].aval.dtype)
           for v in graph.inputs]
  if mesh is None:
    return compile_tagged(graph, target, avals, one_device=True)
  run = target.compiles(_on_every_device(tagged(graph, UNTYPED), mesh), avals)
  replicated = jax.sharding.NamedSharding(target.mesh_like(mesh), jax.sharding.PartitionSpec())
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in avals]
  return jax.jit(run, compiler_options=target.options(measuring=True) or None
                 ).lower(*args).compile()


def compile_tagged(graph: Graph, target, leaves, one_device: bool = False):
  """``graph``'s step as written with every equation tagged, compiled for
  ``target`` on the flat arguments ``leaves`` (abstract or not) as
  ``target.compiles`` takes them: the program :func:`read` reads. Tags are
  name scopes, metadata only: XLA's footprint is that of the step
  :func:`rewritten` untagged."""
  run = target.compiles(tagged(graph), leaves, one_device=one_device)
  return jax.jit(run, compiler_options=target.options(measuring=True) or None
                 ).lower(*target.place(leaves)).compile()


def read(graph: Graph, compiled, elements: Mapping[int, int] | None = None) -> Buffers:
  """The buffers the program ``compiled`` (``graph``'s step with its
  equations tagged, compiled for a target) gives ``graph``'s values;
  ``elements``: where ``compiled`` is one device's program of a
  partitioned step, each value's elements on that device."""
  program = hlo.parse(compiled.as_text())
  kernels = _kernels(program)
  found = assign(graph, _written(kernels), tuple(_exchanged(program)), elements)
  ours = lambda per_tag: {t: v for t, v in per_tag.items() if t < len(graph.nodes)}
  extra = unnamed_spans(graph, unnamed(program))
  return dataclasses.replace(found, spans=found.spans + extra, launches=frozenset(
      t for t in _launching(kernels) if t < len(graph.nodes)),
      workspace=ours(workspaces(program)), library=ours(library_targets(program)))


def _on_every_device(run, mesh):
  """``run`` under a ``shard_map`` over ``mesh`` that gives every device
  the whole of each input."""
  spec = jax.sharding.PartitionSpec()
  return jax.shard_map(lambda *ins: list(run(*ins)), mesh=mesh, in_specs=spec,
                       out_specs=spec, check_vma=False)


def _library_calls(program: hlo.Program):
  """(node tag, instruction) of each library call emitted for a node."""
  for name in program.scheduled():
    for inst in program.computations[name]:
      tag = tag_of(inst) if inst.opcode == "custom-call" else None
      if tag is not None:
        yield tag, inst


def workspaces(program: hlo.Program) -> dict[int, int]:
  """Node tag -> the largest workspace a library call emitted for it takes
  (the elements of a custom call's result after the first)."""
  found: dict[int, int] = {}
  for tag, inst in _library_calls(program):
    scratch = sum(a.nbytes for a in inst.arrays()[len(inst.results()):])
    if scratch:
      found[tag] = max(found.get(tag, 0), scratch)
  return found


def library_targets(program: hlo.Program) -> dict[int, str]:
  """Node tag -> the target of the (first) library call emitted for it."""
  found: dict[int, str] = {}
  for tag, inst in _library_calls(program):
    found.setdefault(tag, inst.call_target())
  return found


def with_buffers(graph: Graph, buffers: Buffers | None) -> Graph:
  """``graph`` modelled with ``buffers`` (None: XLA:CPU's fusion emulated);
  analyses start afresh. With buffers, the buffers the backward pass reads
  only through residuals the target computes inside their readers become
  residuals too (:func:`read_through`): they are what a plan moves."""
  if buffers is None:
    return dataclasses.replace(graph, buffers=None)
  residuals = sorted(graph.residuals + read_through(graph, buffers.materialized),
                     key=lambda r: (r.produced_at, r.value))
  return dataclasses.replace(graph, buffers=buffers, residuals=tuple(residuals))


def read_through(graph: Graph, materialized: frozenset) -> tuple[Residual, ...]:
  """Forward values with a buffer that no backward equation reads but that
  residuals without a buffer are computed from (a LayerNorm's input, read
  by the backward pass through ``x - mean``): the residuals the backward
  pass reads in the target's program, spanning the backward reads of the
  residuals computed from them."""
  own = {r.value: r for r in graph.residuals}
  spans: dict[int, list] = {}
  for r in own.values():
    if r.value in materialized:
      continue
    stack, seen = list(r.needs), set()
    while stack:
      vid = stack.pop()
      if vid in seen or not graph.is_forward_value(vid):
        continue
      seen.add(vid)
      if vid in materialized:
        if vid not in own:
          spans.setdefault(vid, []).append(r)
      else:
        stack.extend(a for a in graph.producer(vid).ins if isinstance(a, int))
  found = []
  for vid, readers in spans.items():
    node = graph.producer(vid)
    found.append(residual_of(graph.nodes, graph.values, vid, node,
                             min(r.first_backward_use for r in readers),
                             max(r.last_backward_use for r in readers)))
  return tuple(found)
