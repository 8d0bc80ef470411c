"""Memory model: program-order liveness over a schedule.

The footprint is counted the way XLA reports one (temp + arguments + outputs
- aliases): step inputs, constants and outputs are live throughout, every
other buffer from its producing op to its last reader. These refinements
bring the walk close to XLA:CPU's fusion and buffer assignment:

* outputs are live for the whole step (XLA allocates them up front), and
  until an output is written a temporary no larger may use its buffer,
  placed as XLA's buffer assignment does (``_share_output_buffers``: optimizer
  states' outputs are written as soon as each gradient exists);
* views (``reshape``, ``squeeze``, ``expand_dims``, ``optimization_barrier``)
  share their input's buffer;
* a convolution computing a kernel gradient also holds transposed copies of
  its inputs while it runs (XLA:CPU's layout for that convolution; the
  rewrite keeps XLA from making them earlier); XLA:GPU's copies made for an
  equation are learned with its buffers;
* a value that XLA's fusion computes inside its readers gets no buffer; its
  own inputs are read at those readers' positions instead
  (``_xla_cpu_fusion`` decides which on XLA:CPU; for a GPU target,
  ``_xla_buffers`` reads them off XLA:GPU's program for the step).
"""

from __future__ import annotations

import collections
import dataclasses

from jax.extend import core as jex

from jaxmem._decisions import Plan
from jaxmem.graph import _primitives
from jaxmem.graph._graph import TOP, Graph, analysis, build_graph
from jaxmem.schedule._scan_remat import rebuilding_iteration
from jaxmem.schedule._schedule import Schedule, build_schedule
from jaxmem.cost._learned_fusion import LearnedFusion
from jaxmem.graph._xla_cpu_fusion import Fusion, node_kinds

# What the ops a rewrite adds are, by schedule op kind (see ``_schedule.Op``):
# copies between memories, and a vTensor's split and merge (copies into
# buffers of their own); any other is an optimization barrier.
_OPS = {"offload": "device_put", "prefetch": "device_put", "split": "slice",
        "merge": "concatenate"}


@dataclasses.dataclass
class Liveness:
  """What the memory model predicts for one schedule.

  Attributes:
    peak: predicted footprint in bytes (arguments included).
    peak_op: index into ``schedule.ops`` where the peak is reached.
    arguments: bytes of step inputs and constants.
    timeline: live bytes after each op allocates (arguments and outputs
      included).
    live_at_peak: buffer keys live at the peak.
    reads: buffer key -> positions of the ops that read it.
    root: key -> the key owning its buffer (views share their source's).
    fused_reads: fused key -> the buffers it reads where it is consumed.
    fused: keys that never get a buffer (computed inside every reader).
    in_outputs: temporaries placed in an output's buffer before the output
      is written (they add no bytes).
    host_peak: most bytes held in host memory at once (offloaded copies).
    host_timeline: host bytes after each op.
  """
  schedule: Schedule
  peak: int
  peak_op: int
  arguments: int
  timeline: list[int]
  live_at_peak: list
  reads: dict
  root: dict
  fused_reads: dict
  fused: frozenset
  in_outputs: frozenset = frozenset()
  host_peak: int = 0
  host_timeline: list = dataclasses.field(default_factory=list)

  def node_levels(self) -> list[int]:
    """Live bytes at each of the step's own equations (recomputation and
    the copies and barriers a rewrite adds left out)."""
    return [t for t, op in zip(self.timeline, self.schedule.ops) if op.kind == "node"]

  def excess(self, level: int) -> int:
    """Byte-ops above ``level`` bytes: how far and how long the step exceeds it,
    counted at the step's own equations only (:meth:`node_levels`), so plans
    with more recomputation are not charged for their extra ops."""
    return sum(max(0, t - level) for t in self.node_levels())

  @property
  def peak_name(self) -> str:
    """Readable name of the operation at the peak: the equation's module
    path and primitive (with its source line where no module names it: an
    NNX model, plain JAX; ``recomputed`` for a rebuilt one), or the copy or
    barrier a rewrite added, and its place in the rewritten step."""
    op = self.schedule.ops[self.peak_op]
    where = f"op {self.peak_op} of {len(self.schedule.ops)} in the rewritten step"
    if op.node is None:
      return f"{_OPS.get(op.kind, 'optimization_barrier')} ({op.kind}; {where})"
    node = self.schedule.nodes[op.node]
    name = node.label if node.readable != TOP else f"{node.label} {node.source}".strip()
    return f"{name} ({'recomputed; ' if op.kind == 'recompute' else ''}{where})"


def simulate(schedule: Schedule) -> Liveness:
  """Predicts the device footprint of ``schedule`` (see the module docstring).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph._graph import build_graph
    >>> from jaxmem._decisions import Plan
    >>> from jaxmem.schedule._schedule import build_schedule
    >>> step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4))))
    >>> simulate(build_schedule(g, Plan())).peak >= 4 * (16 + 8 + 16)
    True
  """
  prepared = _prepare(schedule)
  walk = _walk(schedule, *prepared.walk_args)
  return Liveness(schedule, walk.peak, walk.peak_op, prepared.arguments, walk.timeline,
                  walk.live_at_peak, prepared.reads, prepared.root, prepared.fused_reads,
                  prepared.fused, frozenset(prepared.in_outputs),
                  max(walk.host_timeline, default=0), walk.host_timeline)


def buffer_spans(schedule: Schedule) -> tuple[int, list[tuple[int, int, int]]]:
  """The bytes held from the start (arguments and outputs), and every
  other device buffer the walk allocates as ``(first op, last op, bytes)``:
  what a compiler packs into its heap of temporaries (``cost._heap``).
  Their most bytes live at one op, with the start's, is :func:`simulate`'s
  peak."""
  prepared = _prepare(schedule)
  spans: list = []
  _walk(schedule, *prepared.walk_args, spans=spans)
  return prepared.start, spans


def stacked(schedule: Schedule) -> dict[str, list[int]]:
  """The model's live device bytes after each op of ``schedule``, by what
  holds them: ``arguments and outputs`` (the step's inputs, constants and
  output buffers, from the start), ``residuals`` (forward values the
  backward pass reads, kept), ``recomputed`` (values rebuilt in the
  backward pass), ``copied back`` (copies back from host memory) and
  ``temporaries`` (the rest, and what an op holds only while it runs).
  They add up to :func:`simulate`'s timeline."""
  graph = schedule.graph
  made = {k: op.kind for op in schedule.ops for k in op.outs}

  def kind(key) -> str:
    if made.get(key) == "recompute":
      return "recomputed"
    if made.get(key) == "prefetch":
      return "copied back"
    return "residuals" if key[1] == 0 and graph.is_residual(key[0]) else "temporaries"

  prepared = _prepare(schedule)
  walk = _walk(schedule, *prepared.walk_args, classify=kind)
  return {"arguments and outputs": [prepared.start] * len(walk.timeline), **walk.kinds}


@dataclasses.dataclass
class _Prepared:
  """What the liveness walk needs of a schedule (see :func:`_prepare`)."""
  arguments: int
  reads: dict
  root: dict
  fused_reads: dict
  fused: frozenset
  fusion: Fusion
  owned_by: dict  # op position -> the buffers it allocates
  free_at: dict  # op position -> the buffers it reads last
  host: set  # keys in host memory
  in_outputs: set  # temporaries placed in output buffers
  start: int  # device bytes held from the start
  on_host: int  # host bytes held from the start
  loops: dict  # op position -> what the loop it runs holds while it runs
  copies_free_at: dict  # op position -> the keys whose copies beside it free there
  held: list  # (first op, last op, bytes) the compiler holds beyond the values

  @property
  def walk_args(self) -> tuple:
    """:func:`_walk`'s arguments after the schedule."""
    return (self.fusion, self.owned_by, self.free_at, self.host, self.in_outputs,
            self.start, self.on_host, self.loops, self.copies_free_at, self.held)


_HELD = "held"  # the key of a compiler's own buffer among the temporaries


def _prepare(schedule: Schedule) -> _Prepared:
  """Each buffer's owner and last reader, the host's and the output
  buffers' share, under the target's fusion: :func:`_walk`'s arguments."""
  graph = schedule.graph
  ops = schedule.ops
  nbytes = schedule.nbytes
  fusion = fusion_of(schedule)
  root = _buffer_roots(ops, fusion.names)
  reads, fused, fused_reads = fusion.buffer_reads(root)
  producer_of, outputs = fusion.producer_of, fusion.outputs

  inputs = set(schedule.inputs) | {(v, 0) for v in graph.consts}
  # Host copies (offloads), stacks a loop makes on the host, optimizer state
  # kept there between steps, and their views live in host memory.
  hosted_in = {(v, 0) for v in graph.hosted}
  host = ({k for op in ops if op.kind == "offload" for k in op.outs} | schedule.hosted
          | hosted_in)
  host |= {k for k in root if root[k] in host}
  arguments = sum(nbytes(k) for k in inputs - hosted_in)
  free_at: dict[int, list] = {}
  owned_by: dict[int, list] = {}
  for key, buf in root.items():
    if key != buf or key in fused or key in inputs:
      continue
    owned_by.setdefault(producer_of[key], []).append(key)
    if key in outputs:
      continue
    last = max(reads.get(key, [producer_of[key]]))
    free_at.setdefault(last, []).append(key)
  # Buffers aliased by an output live to the end.
  pinned = {root.get(k, k) for k in outputs}
  for pos in list(free_at):
    free_at[pos] = [k for k in free_at[pos] if k not in pinned]
  # XLA allocates output buffers before the program runs: count them from
  # the start, once per distinct buffer.
  out_bytes = sum(nbytes(b) for b in {root.get(k, k) for k in outputs} - host)
  for pos in owned_by:
    owned_by[pos] = [k for k in owned_by[pos] if k not in pinned]

  # The compiler's own buffers (``Fusion.held``) go into output buffers as
  # values do: a weight relaid for a convolution, dead before its update.
  held = fusion.held(root)
  temps = {k: (producer_of[k], pos) for pos, keys in free_at.items() for k in keys
           if k not in host}
  temps.update({(_HELD, i): (first, last) for i, (first, last, _) in enumerate(held)})
  in_outputs = _share_output_buffers(
      {b: producer_of.get(b, -1) for b in {root.get(k, k) for k in outputs}
       if b not in inputs and b not in host},
      temps, lambda k: held[k[1]][2] if k[0] == _HELD else nbytes(k))
  held = [h for i, h in enumerate(held) if (_HELD, i) not in in_outputs]
  in_outputs = {k for k in in_outputs if k[0] != _HELD}
  loops = {pos: _held_inside(graph, op, set(free_at.get(pos, ())) - host, nbytes)
           for pos, op in enumerate(ops)
           if op.kind == "node" and fusion.names[pos] == "scan"}
  return _Prepared(arguments, reads, root, fused_reads, fused, fusion, owned_by, free_at,
                   host, in_outputs, arguments + out_bytes,
                   sum(nbytes(k) for k in hosted_in), loops, _copies_free_at(ops, fusion),
                   held)


def fusion_of(schedule: Schedule) -> Fusion:
  """The target's fusion over ``schedule``'s ops: XLA:CPU's emulated, else XLA:GPU's learned."""
  graph = schedule.graph
  node_names, node_backward = node_kinds(graph)
  names = [_OPS.get(op.kind, "optimization_barrier") if op.node is None
           else node_names[op.node] for op in schedule.ops]
  # Recomputed values and barriers belong to the backward pass.
  backward = [op.kind != "node" or node_backward[op.node] for op in schedule.ops]
  if graph.buffers is None:
    return Fusion(schedule, names, backward)
  return LearnedFusion(schedule, names, backward)


def _copies_free_at(ops, fusion: Fusion) -> dict[int, list]:
  """Op position -> the keys whose copies beside their buffer
  (:meth:`Fusion.beside`: the padded copy a convolution and its backward
  pass share) free there: after the last op that reads the key itself.
  A read through a barrier's output is not one: XLA pads the value again
  behind the barrier (a block checkpointed whole reads its input that
  way), so the copy made for the forward pass dies with it."""
  free_at: dict[int, list] = {}
  for key, pos in fusion.producer_of.items():
    if fusion.beside(key):
      last = max((p for p in fusion.readers.get(key, ()) if ops[p].kind != "barrier"),
                 default=pos)
      free_at.setdefault(max(last, pos), []).append(key)
  return free_at


def floor(schedule: Schedule) -> int:
  """Model bytes every plan of ``schedule``'s graph holds at one op at
  least: what is held from the start (arguments, constants and output
  buffers, none of which a plan moves) with the largest scratch of one of
  the step's own equations (a library's workspace), which every plan runs.
  No plan's model peak is under it (loops' bodies left out)."""
  prepared = _prepare(schedule)
  return prepared.start + max((prepared.fusion.scratch(pos) for pos, op
                               in enumerate(schedule.ops) if op.kind == "node"), default=0)


@analysis
def loop_scratch(graph: Graph, index: int) -> int:
  """Bytes the body of scan ``index`` holds beyond its arguments and results
  while the loop runs: its own temporaries at their peak, which XLA
  allocates once for every iteration (the chunks of a step run in
  micro-batches, a layer of a scanned stack): on a GPU target, what
  XLA:GPU gives the body compiled alone where learned (``_xla_loops``)."""
  if graph.buffers is not None and index in graph.buffers.bodies:
    return graph.buffers.bodies[index]
  return _body_scratch(build_graph(graph.nodes[index].params["jaxpr"]))


@analysis
def _rebuilding_scratch(graph: Graph, backward: int, forward: int, rebuilt: tuple,
                        once: tuple = ()) -> int:
  """:func:`loop_scratch` of backward scan ``backward`` whose body first
  rebuilds the slices at ``rebuilt`` with forward scan ``forward``'s body;
  with ``once`` (input positions of ``backward``), of one iteration inlined
  (:func:`_body_scratch`'s ``freed``)."""
  jaxpr, at = rebuilding_iteration(graph, backward, forward, rebuilt)
  return _body_scratch(build_graph(jaxpr), tuple(at[p] for p in once))


@analysis
def _inlined_scratch(graph: Graph, index: int, once: tuple) -> int:
  """:func:`loop_scratch` of scan ``index`` run for one iteration, inlined:
  its ``xs`` at input positions ``once`` go after their last reader."""
  return _body_scratch(build_graph(graph.nodes[index].params["jaxpr"]), once)


def _body_scratch(body: Graph, freed: tuple = ()) -> int:
  """What ``body`` holds beyond its inputs and results at its peak. With
  ``freed`` (indices among its inputs), those inputs' bytes go after their
  last reader, so the figure can be negative: the body inlined holds less
  than the slices it was given."""
  schedule = build_schedule(body, Plan())
  liveness = simulate(schedule)
  results = sum(body.values[v].nbytes for v in body.output_ids)
  if not freed:
    return max(0, liveness.peak - liveness.arguments - results)
  last = {}
  for i in freed:
    key = (body.inputs[i], 0)
    last[key] = max(liveness.reads.get(key, [-1]))
  peak = max(level - sum(schedule.nbytes(k) for k, at in last.items() if at < pos)
             for pos, level in enumerate(liveness.timeline))
  return peak - liveness.arguments - results


def _held_inside(graph: Graph, op, last_read: set, nbytes) -> int:
  """What the loop an op runs holds while it runs: its body's scratch
  (:func:`loop_scratch`), or, for a backward scan a plan rewrote, the
  largest of its segments' bodies (rebuilding or fetching slices, with the
  slices a nested loop rebuilds beside) less the inputs that the segments
  run before it read last (in ``last_read``)."""
  inside = op.params[1] if len(op.params) > 1 else None
  if inside is None:
    return loop_scratch(graph, op.node)
  return inside.beside + max(
      (_rebuilding_scratch(graph, it.backward, it.forward, it.rebuilt, it.once) if it.rebuilt
       else _inlined_scratch(graph, it.backward, it.once) if it.once
       else loop_scratch(graph, it.backward))
      + it.fetched - sum(nbytes(k) for k in it.done if k in last_read)
      for it in inside.iterations)


def _buffer_roots(ops, names) -> dict:
  """Key -> the key owning its buffer: views (reshapes, barriers) share
  their source's."""
  root: dict = {}
  for pos, op in enumerate(ops):
    for i, key in enumerate(op.outs):
      src = op.ins[i if op.node is None else 0] if _primitives.is_view(names[pos]) else None
      root[key] = key if src is None or isinstance(src, jex.Literal) else root.get(src, src)
  return root


@dataclasses.dataclass
class _Walk:
  """The liveness walk's figures (see :func:`_walk`)."""
  peak: int
  peak_op: int
  live_at_peak: list
  timeline: list
  host_timeline: list
  kinds: dict = dataclasses.field(default_factory=dict)  # kind -> its timeline


KINDS = ("residuals", "recomputed", "copied back", "temporaries")


def _walk(schedule, fusion: Fusion, owned_by: dict, free_at: dict, host: set,
          in_outputs: set, start: int, on_host: int = 0, loops: dict | None = None,
          copies_free_at: dict | None = None, held_spans: list = (), classify=None,
          spans: list | None = None) -> _Walk:
  """Walks the ops in order: each op's own buffers are allocated with the
  copies beside them (host copies on the host; temporaries placed in
  output buffers add nothing), the timeline records the live bytes with
  the op's scratch, and buffers whose last reader it is are freed, and
  copies at ``copies_free_at``. ``start`` device bytes and ``on_host``
  host bytes are held from the start; ``loops`` holds, per op that runs a
  loop, what its body holds while it runs (:func:`loop_scratch`);
  ``held_spans``, the compiler's own buffers (:meth:`Fusion.held`). With ``classify`` (key -> one of
  :data:`KINDS`), ``kinds`` splits the timeline less ``start`` by kind (an
  op's scratch among the temporaries). With ``spans`` (a list), each device
  buffer's ``(first op, last op, bytes)`` is appended to it: a value's, its
  copies' and each op's scratch apart."""
  ops, nbytes = schedule.ops, schedule.nbytes
  live = start
  live_set: set = set()
  walk = _Walk(live, 0, [], [], [], {k: [] for k in KINDS} if classify else {})
  held = dict.fromkeys(KINDS, 0)
  besides: dict = {}  # key -> bytes of its copies still held
  opened: dict = {}  # key -> the op that allocated it (where ``spans`` is kept)

  def release(key, pos: int, copies_only: bool = False) -> None:
    nonlocal live
    copies = besides.pop(key, 0)
    freed = copies + (0 if copies_only else nbytes(key))
    live -= freed
    if classify:
      held[classify(key)] -= freed
    if spans is not None:
      spans.extend((opened[key], pos, n) for n in (copies, 0 if copies_only else nbytes(key))
                   if n)

  opening, closing = collections.Counter(), collections.Counter()
  for first, last, size in held_spans:
    opening[first] += size
    closing[last] += size
    if spans is not None:
      spans.append((first, last, size))
  for pos in range(len(ops)):
    live += opening.get(pos, 0)
    if classify:
      held["temporaries"] += opening.get(pos, 0)
    for key in owned_by.get(pos, ()):
      if key in host:
        on_host += nbytes(key)
        continue
      if key in in_outputs:
        continue
      besides[key] = fusion.beside(key)
      live += nbytes(key) + besides[key]
      live_set.add(key)
      if spans is not None:
        opened[key] = pos
      if classify:
        held[classify(key)] += nbytes(key) + besides[key]
    scratch = fusion.scratch(pos) + (loops or {}).get(pos, 0)
    if spans is not None and scratch > 0:
      spans.append((pos, pos, scratch))
    walk.timeline.append(live + scratch)
    walk.host_timeline.append(on_host)
    for kind, series in walk.kinds.items():
      series.append(held[kind] + (scratch if kind == "temporaries" else 0))
    if walk.timeline[-1] > walk.peak:
      walk.peak, walk.peak_op, walk.live_at_peak = walk.timeline[-1], pos, list(live_set)
    live -= closing.get(pos, 0)
    if classify:
      held["temporaries"] -= closing.get(pos, 0)
    for key in (copies_free_at or {}).get(pos, ()):
      if key in live_set:
        release(key, pos, copies_only=True)
    for key in free_at.get(pos, ()):
      if key in host:
        on_host -= nbytes(key)
      elif key in live_set:
        release(key, pos)
        live_set.discard(key)
  return walk


def _share_output_buffers(outputs: dict, temps: dict, nbytes) -> set:
  """Temporaries XLA places in output buffers before the outputs are written.

  XLA's buffer assignment (``BufferAssigner::AssignSingleHloBuffer``) gives
  every output an allocation up front, then visits the other buffers largest
  first (program order among equals) and puts each in the smallest output
  allocation at least as large whose values so far do not overlap it in
  time; only the rest go to the temp heap.

  Args:
    outputs: output buffer -> position where it is written.
    temps: temporary buffer -> (first, last) position it is live.
    nbytes: buffer -> size.

  Returns:
    The temporaries that cost no bytes of their own.
  """
  allocations = sorted(((nbytes(b), at) for b, at in outputs.items()),
                       key=lambda a: (a[0], -a[1]))  # smallest first
  busy: list[list] = [[] for _ in allocations]
  shared = set()
  largest = allocations[-1][0] if allocations else 0
  order = sorted((k for k in temps if nbytes(k) <= largest),
                 key=lambda k: (-nbytes(k), temps[k][0]))
  first = 0
  for key in order:
    size, (start, end) = nbytes(key), temps[key]
    while first < len(allocations) and allocations[first][0] < size:
      first += 1
    for i in range(first, len(allocations)):
      if end >= allocations[i][1] or any(
          s <= end and start <= e for s, e in busy[i]):
        continue
      busy[i].append((start, end))
      shared.add(key)
      break
  return shared
