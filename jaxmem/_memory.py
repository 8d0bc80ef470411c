"""Memory model: program-order liveness over a schedule.

The footprint is counted the way XLA reports one (temp + arguments + outputs
- aliases): step inputs, constants and outputs are live throughout, every
other buffer from its producing op to its last reader. These refinements
bring the walk close to XLA:CPU's fusion and buffer assignment:

* outputs are live for the whole step (XLA allocates them up front), and
  until an output is written a temporary no larger may use its buffer,
  placed the way XLA's buffer assignment does it (``_share_output_buffers``;
  it matters for optimizer states, whose outputs have the shapes of
  parameters and are written as soon as each gradient exists);
* views (``reshape``, ``squeeze``, ``expand_dims``, ``optimization_barrier``)
  share their input's buffer;
* a convolution computing a kernel gradient also holds transposed copies of
  its inputs while it runs (XLA:CPU's layout for that convolution; the
  rewrite keeps XLA from making them earlier);
* an elementwise value that XLA's instruction fusion computes inside its
  readers (elementwise ops, and reductions over the minor-most axis) gets no
  buffer; its own inputs are read at those readers' positions instead. An
  expensive op (``EXPENSIVE``) is fused only into a sole reader; a cheap one
  into every reader that can take it, unless it reads more than one operand
  and more elements than it writes and some path from it to a reader runs
  through an op that cannot fuse (XLA's ``ComputeGloballyUnfusible``; see
  ``simulate``).
"""

from __future__ import annotations

import dataclasses

from jax.extend import core as jex

from jaxmem._plan import Plan
from jaxmem._rewrite import Schedule, build_schedule

# What the ops a rewrite adds are, by schedule op kind (see ``_rewrite.Op``):
# copies between memories, and a vTensor's split and merge (copies into
# buffers of their own); any other is an optimization barrier.
_OPS = {"offload": "device_put", "prefetch": "device_put", "split": "slice",
        "merge": "concatenate"}
VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "optimization_barrier", "name"})
ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "exp", "exp2",
    "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt",
    "square", "integer_pow", "pow", "abs", "sign", "select_n", "clamp",
    "convert_element_type", "broadcast_in_dim", "eq", "ne", "lt", "le", "gt",
    "ge", "and", "or", "not", "xor", "erf", "erfc", "erf_inv", "sin", "cos",
    "floor", "ceil", "round", "is_finite", "stop_gradient", "iota", "rem",
    "nextafter", "atan2", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "reduce_precision", "copy", "real", "imag",
})
# Elementwise ops XLA will not duplicate into several fusions.
EXPENSIVE = frozenset({
    "div", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt",
    "rsqrt", "cbrt", "pow", "erf", "erfc", "erf_inv", "atan2", "rem"})
REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
    "reduce_and", "reduce_or"})


@dataclasses.dataclass
class MemoryProfile:
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

  def excess(self, target: int) -> int:
    """Byte-ops above ``target``: how far and how long the step exceeds it,
    counted at the step's own equations only, so plans with more
    recomputation are not charged for their extra ops."""
    ops = self.schedule.ops
    return sum(max(0, t - target) for t, op in zip(self.timeline, ops)
               if op.kind == "node")

  @property
  def peak_name(self) -> str:
    """Readable name of the equation at the peak."""
    op = self.schedule.ops[self.peak_op]
    if op.node is None:
      return f"{_OPS.get(op.kind, 'optimization_barrier')} ({op.kind}, op {self.peak_op})"
    node = self.schedule.nodes[op.node]
    return f"{node.readable} {node.prim.name} ({op.kind}, op {self.peak_op})"


def simulate(schedule: Schedule) -> MemoryProfile:
  """Predicts the device footprint of ``schedule`` (see the module docstring).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem._graph import build_graph
    >>> from jaxmem._plan import Plan
    >>> from jaxmem._rewrite import build_schedule
    >>> step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4))))
    >>> simulate(build_schedule(g, Plan())).peak >= 4 * (16 + 8 + 16)
    True
  """
  graph = schedule.graph
  ops = schedule.ops
  nbytes = schedule.nbytes

  # Which key owns which buffer, and which keys are fused away.
  producer_of: dict = {}
  for pos, op in enumerate(ops):
    for key in op.outs:
      producer_of[key] = pos
  def operands(pos: int) -> list:
    return [k for k in ops[pos].ins if not isinstance(k, jex.Literal)]

  readers: dict = {}
  for pos in range(len(ops)):
    for key in operands(pos):
      readers.setdefault(key, []).append(pos)
  outputs = {k for k in schedule.outputs if not isinstance(k, jex.Literal)}

  names = [_OPS.get(op.kind, "optimization_barrier") if op.node is None
           else graph.nodes[op.node].prim.name for op in ops]
  # Recomputed values and barriers belong to the backward pass.
  backward = [op.kind != "node" or graph.nodes[op.node].backward for op in ops]

  root: dict = {}
  for pos, op in enumerate(ops):
    for i, key in enumerate(op.outs):
      src = op.ins[i if op.node is None else 0] if names[pos] in VIEWS else None
      root[key] = key if src is None or isinstance(src, jex.Literal) else root.get(src, src)

  def fuses(reader: int, key) -> bool:
    """Whether XLA:CPU can fuse ``key``'s producer into op ``reader``."""
    name = names[reader]
    if name in ELEMENTWISE:
      return True
    if name not in REDUCTIONS:
      return False
    # XLA:CPU fuses into a reduction only over the minor-most dimension.
    ndim = len(graph.values[key[0]].aval.shape)
    axes = graph.nodes[ops[reader].node].params.get("axes", ())
    return ndim == 0 or ndim - 1 in axes

  def duplicable(key) -> bool:
    """Whether XLA fuses ``key`` into every reader that can fuse it, after
    XLA's instruction fusion: a sole reader always; otherwise an expensive
    producer never, a cheap unary one (other operands literals) always, and
    any other cheap one that reads more elements than it writes only if it
    can be fused into every reader on all paths (XLA's
    ``ComputeGloballyUnfusible``)."""
    pos = producer_of.get(key)
    if pos is None or key in outputs or names[pos] not in ELEMENTWISE:
      return False
    uses = readers[key]
    if len(uses) == 1:
      return True
    if names[pos] in EXPENSIVE:
      return False
    return not globally_unfusible(key)

  unfusible: dict = {}

  def globally_unfusible(key) -> bool:
    """XLA's ``do_not_duplicate`` set: an elementwise op reading more than
    one operand and more elements than it writes, unless every path from it
    to each of its readers runs through fusible ops only."""
    if key not in unfusible:
      pos = producer_of[key]
      ins = list(dict.fromkeys(operands(pos)))
      if len(ins) <= 1 or sum(nbytes(k) for k in ins) <= nbytes(key):
        unfusible[key] = False
      elif not backward[pos] and any(backward[u] for u in readers[key]):
        # A forward value read by the backward pass: the path through the
        # loss and its cotangent crosses dots and convolutions.
        unfusible[key] = True
      else:
        reach = reachable_from(key)
        unfusible[key] = not all(
            on_all_paths(key, u, reach) for u in readers[key])
    return unfusible[key]

  def reachable_from(key) -> set:
    """Keys computed from ``key`` up to its last reader."""
    last = max(readers[key])
    reach, stack = {key}, [key]
    while stack:
      for r in readers.get(stack.pop(), ()):
        if r <= last:
          for out in ops[r].outs:
            if out not in reach:
              reach.add(out)
              stack.append(out)
    return reach

  paths: dict = {}

  def on_all_paths(key, reader: int, reach: set) -> bool:
    """XLA's ``CanFuseOnAllPaths``: every operand of ``reader`` computed
    from ``key`` fuses into it, and so on back to ``key``."""
    if (key, reader) not in paths:
      paths[key, reader] = all_fuse(key, reader, reach)
    return paths[key, reader]

  def all_fuse(key, reader: int, reach: set) -> bool:
    for k in operands(reader):
      if k not in reach:
        continue
      if not fuses(reader, k):
        return False
      if k == key:
        continue
      pos = producer_of.get(k)
      if (pos is None or names[pos] not in ELEMENTWISE or k in outputs
          or globally_unfusible(k) or not on_all_paths(key, pos, reach)):
        return False
    return True

  decided: dict = {}

  def fused_into(key, reader: int) -> bool:
    """Whether XLA computes ``key`` inside ``reader`` (no buffer there)."""
    if not fuses(reader, key):
      return False
    if key not in decided:
      decided[key] = duplicable(key)
    return decided[key]

  # A key read through fusion is read as the buffers of its producer's inputs.
  through: dict = {}

  def reads_through(key) -> list:
    if key not in through:
      pos = producer_of[key]
      through[key] = list(dict.fromkeys(
          b for k in operands(pos)
          for b in (reads_through(k) if fused_into(k, pos) else [root.get(k, k)])))
    return through[key]

  reads: dict = {}
  materialized: set = set()
  for pos in range(len(ops)):
    for key in operands(pos):
      if fused_into(key, pos):
        bufs = reads_through(key)
      else:
        bufs = [root.get(key, key)]
        materialized.add(key)
      for buf in bufs:
        reads.setdefault(buf, []).append(pos)
  # Values nobody reads still get a buffer at their producer; values read
  # only through fusion get none.
  fused = {k for k in readers if k not in materialized}

  inputs = set(schedule.inputs) | {(v, 0) for v in graph.consts}
  arguments = sum(nbytes(k) for k in inputs)
  # Host copies (offloads) and their views live in host memory.
  host = {k for op in ops if op.kind == "offload" for k in op.outs}
  host |= {k for k in root if root[k] in host}
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
  out_bytes = sum(nbytes(b) for b in {root.get(k, k) for k in outputs})
  for pos in owned_by:
    owned_by[pos] = [k for k in owned_by[pos] if k not in pinned]

  in_outputs = _share_output_buffers(
      {b: producer_of.get(b, -1) for b in {root.get(k, k) for k in outputs}
       if b not in inputs},
      {k: (producer_of[k], pos) for pos, keys in free_at.items() for k in keys
       if k not in host},
      nbytes)

  def scratch(pos: int) -> int:
    """Bytes an op needs only while it runs: the transposed input copies a
    kernel-gradient convolution runs on (the rewrite pins them there)."""
    node = None if ops[pos].node is None else graph.nodes[ops[pos].node]
    if node is None or not graph.transposes_inputs(node):
      return 0
    return sum(nbytes(k) for k in operands(pos))

  live = arguments + out_bytes
  live_set: set = set()
  peak, peak_op, live_at_peak = live, 0, []
  timeline, host_timeline, on_host = [], [], 0
  for pos in range(len(ops)):
    for key in owned_by.get(pos, ()):
      if key in host:
        on_host += nbytes(key)
        continue
      if key in in_outputs:
        continue
      live += nbytes(key)
      live_set.add(key)
    timeline.append(live + scratch(pos))
    host_timeline.append(on_host)
    if timeline[-1] > peak:
      peak, peak_op, live_at_peak = timeline[-1], pos, list(live_set)
    for key in free_at.get(pos, ()):
      if key in host:
        on_host -= nbytes(key)
      elif key in live_set:
        live -= nbytes(key)
        live_set.discard(key)
  return MemoryProfile(schedule, peak, peak_op, arguments, timeline,
                       live_at_peak, reads, root,
                       {k: reads_through(k) for k in through}, frozenset(fused),
                       frozenset(in_outputs), max(host_timeline, default=0),
                       host_timeline)


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


def unplanned_profile(graph) -> MemoryProfile:
  """The profile of the plan that keeps every residual, simulated once per
  graph: the planners' starting point (backward reads separated as in every
  planned step; ``_planners.unplanned`` gives the step as written)."""
  if "unplanned" not in graph.derived:
    graph.derived["unplanned"] = simulate(build_schedule(graph, Plan()))
  return graph.derived["unplanned"]


def fused_values(graph) -> dict:
  """Values XLA computes inside their readers in the untransformed step:
  value id -> ids of the buffers it is computed from.

  Recomputation must not read the forward ones (that would give one a
  buffer of its own); it reads the buffers they are computed from instead.
  The rewrite does not anchor barriers on the backward ones, for the same
  reason.
  """
  if "fused" not in graph.derived:
    profile = unplanned_profile(graph)
    graph.derived["fused"] = {
        k[0]: tuple(b[0] for b in profile.fused_reads.get(k, ()))
        for k in profile.fused if k[1] == 0}
  return graph.derived["fused"]
