"""XLA:CPU's fusion habits, emulated: which values get no buffer of their own.

The memory model (``_memory``) counts buffers; XLA:CPU computes many
elementwise values inside their readers instead of giving them one.
:class:`Fusion` decides that per value of a schedule the way XLA's
instruction fusion does:

* an elementwise value fuses into elementwise readers, and into a reduction
  over the minor-most axis;
* an expensive op (``_primitives.is_expensive``) is fused only into a sole
  reader; a cheap one into every reader that can take it, unless it reads
  more than one operand and more elements than it writes and some path from
  it to a reader runs through an op that cannot fuse (XLA's
  ``ComputeGloballyUnfusible``).

:func:`separated_reads` finds the backward reads the schedule builder routes
through barrier copies because XLA would otherwise share them with the
forward pass (merged broadcasts, bias adds duplicated into readers), and
:func:`readable` which values the backward pass may read as the forward
pass made them.
"""

from __future__ import annotations

from typing import Callable

from jax.extend import core as jex

from jaxmem.graph import _primitives
from jaxmem.graph._graph import Graph, analysis


@analysis
def node_kinds(graph: Graph) -> tuple[list[str], list[bool]]:
  """Each node's primitive name, and whether it is a backward node: what
  :class:`Fusion` reads per op of every schedule of ``graph``."""
  return [node.prim.name for node in graph.nodes], [node.backward for node in graph.nodes]


class Fusion:
  """Fusion decisions over the ops of one schedule.

  Args:
    schedule: the schedule (ops over keys; see ``_schedule``).
    names: the primitive name of each op (rewrite ops named by what they
      lower to).
    backward: whether each op belongs to the backward pass.

  Attributes:
    producer_of: key -> position of the op that makes it.
    readers: key -> positions of the ops that read it.
    outputs: the step's output keys.
  """

  def __init__(self, schedule, names: list[str], backward: list[bool]):
    self.graph = schedule.graph
    self.ops = schedule.ops
    self.nbytes = schedule.nbytes
    self.names = names
    self.backward = backward
    # Per op: its non-literal inputs, and whether XLA fuses into it as an
    # elementwise op or a reduction (asked once per read, so kept).
    literal = jex.Literal
    self._operands = [[k for k in op.ins if not isinstance(k, literal)] for op in self.ops]
    kinds = {n: _primitives.classify(n) for n in set(names)}
    self._elementwise = [kinds[n] == _primitives.ELEMENTWISE for n in names]
    self._reduction = [kinds[n] == _primitives.REDUCTION for n in names]
    self.producer_of: dict = {key: pos for pos, op in enumerate(self.ops) for key in op.outs}
    self.readers: dict = {}
    for pos, operands in enumerate(self._operands):
      for key in operands:
        self.readers.setdefault(key, []).append(pos)
    self.outputs = {k for k in schedule.outputs if not isinstance(k, jex.Literal)}
    self._decided: dict = {}
    self._unfusible: dict = {}
    self._paths: dict = {}
    self._through: dict = {}

  def operands(self, pos: int) -> list:
    return self._operands[pos]

  def scratch(self, pos: int) -> int:
    """Bytes op ``pos`` needs only while it runs: the transposed input
    copies XLA:CPU runs a kernel-gradient convolution on (the rewrite pins
    them there), and what XLA's select-and-scatter expander makes for a
    max-pool's gradient (:func:`select_and_scatter_bytes`) beyond what
    :meth:`held` holds."""
    node = self.ops[pos].node
    if node is None:
      return 0
    node = self.graph.nodes[node]
    if node.prim.name == "select_and_scatter_add":
      return select_and_scatter_bytes(self.graph, node, indexed=True)[2]
    if not self.graph.transposes_inputs(node):
      return 0
    return sum(self.nbytes(k) for k in self.operands(pos))

  def held(self, root: dict) -> list[tuple[int, int, int]]:
    """Buffers the compiler allocates beyond the schedule's values, each
    ``(first op, last op, bytes)``. XLA:CPU expands a max-pool's gradient
    (:func:`select_and_scatter_bytes`) into int32 iotas of the operand's
    positions, which read nothing, so XLA makes them at the program's
    start; a reduction of them with the operand over each window, run once
    the operand exists (a rebuilt one in the backward pass, so the iotas
    live that long; for a step input, at the gradient); and the indices it
    finds, held to the gradient's scatter. On a U-Net's plans this takes
    the model from 0.67-0.99 of XLA:CPU's footprint to 0.93-1.09."""
    found = []
    for pos, op in enumerate(self.ops):
      if op.node is None or self.names[pos] != "select_and_scatter_add":
        continue
      iotas, indices, _ = select_and_scatter_bytes(self.graph, self.graph.nodes[op.node],
                                                   indexed=True)
      made = self.producer_of.get(root.get(op.ins[1], op.ins[1]), pos)
      found += [(0, made, iotas), (made, pos, indices)]
    return found

  def beside(self, key) -> int:
    """Bytes the compiler allocates beside ``key``'s buffer for as long as
    it lives (none where its fusion is emulated)."""
    return 0

  def fuses(self, reader: int, key) -> bool:
    """Whether XLA:CPU can fuse ``key``'s producer into op ``reader``."""
    if self._elementwise[reader]:
      return True
    if not self._reduction[reader]:
      return False
    # XLA:CPU fuses into a reduction only over the minor-most dimension.
    ndim = len(self.graph.values[key[0]].aval.shape)
    axes = self.graph.nodes[self.ops[reader].node].params.get("axes", ())
    return ndim == 0 or ndim - 1 in axes

  def fused_into(self, key, reader: int) -> bool:
    """Whether XLA computes ``key`` inside ``reader`` (no buffer there)."""
    if not self.fuses(reader, key):
      return False
    decided = self._decided.get(key)
    if decided is None:
      decided = self._decided[key] = self.duplicable(key)
    return decided

  def always_reads(self, key, reader: int) -> bool:
    """Whether op ``reader`` reads ``key``'s own buffer whichever other ops
    read ``key`` (however a plan changes the backward pass): ``key``'s
    producer is not elementwise, the reader cannot fuse it, or it is
    expensive and read more than once in the forward pass (so never by a
    sole reader: :meth:`duplicable`)."""
    pos = self.producer_of.get(key)
    if pos is None or key in self.outputs or not self._elementwise[pos]:
      return True
    if not self.fuses(reader, key):
      return True
    return (_primitives.is_expensive(self.names[pos])
            and sum(not self.backward[r] for r in self.readers[key]) > 1)

  def duplicable(self, key) -> bool:
    """Whether XLA fuses ``key`` into every reader that can fuse it, after
    XLA's instruction fusion: a sole reader always; otherwise an expensive
    producer never, a cheap unary one (other operands literals) always, and
    any other cheap one that reads more elements than it writes only if it
    can be fused into every reader on all paths."""
    pos = self.producer_of.get(key)
    if pos is None or key in self.outputs or not self._elementwise[pos]:
      return False
    if len(self.readers[key]) == 1:
      return True
    if _primitives.is_expensive(self.names[pos]):
      return False
    return not self.globally_unfusible(key)

  def globally_unfusible(self, key) -> bool:
    """XLA's ``do_not_duplicate`` set: an elementwise op reading more than
    one operand and more elements than it writes, unless every path from it
    to each of its readers runs through fusible ops only."""
    if key not in self._unfusible:
      pos = self.producer_of[key]
      ins = list(dict.fromkeys(self.operands(pos)))
      if len(ins) <= 1 or sum(self.nbytes(k) for k in ins) <= self.nbytes(key):
        self._unfusible[key] = False
      elif not self.backward[pos] and any(self.backward[u] for u in self.readers[key]):
        # A forward value read by the backward pass: the path through the
        # loss and its cotangent crosses dots and convolutions.
        self._unfusible[key] = True
      else:
        reach = self.reachable_from(key)
        self._unfusible[key] = not all(
            self.on_all_paths(key, u, reach) for u in self.readers[key])
    return self._unfusible[key]

  def reachable_from(self, key) -> set:
    """Keys computed from ``key`` up to its last reader."""
    last = max(self.readers[key])
    reach, stack = {key}, [key]
    while stack:
      for r in self.readers.get(stack.pop(), ()):
        if r <= last:
          for out in self.ops[r].outs:
            if out not in reach:
              reach.add(out)
              stack.append(out)
    return reach

  def on_all_paths(self, key, reader: int, reach: set) -> bool:
    """XLA's ``CanFuseOnAllPaths``: every operand of ``reader`` computed
    from ``key`` fuses into it, and so on back to ``key``."""
    if (key, reader) not in self._paths:
      self._paths[key, reader] = self._all_fuse(key, reader, reach)
    return self._paths[key, reader]

  def _all_fuse(self, key, reader: int, reach: set) -> bool:
    for k in self.operands(reader):
      if k not in reach:
        continue
      if not self.fuses(reader, k):
        return False
      if k == key:
        continue
      pos = self.producer_of.get(k)
      if (pos is None or not self._elementwise[pos]
          or k in self.outputs or self.globally_unfusible(k)
          or not self.on_all_paths(key, pos, reach)):
        return False
    return True

  def reads_through(self, key, root: dict) -> list:
    """The buffers a fused ``key`` is computed from where it is read (a
    fused operand of its producer read through in turn)."""
    through = self._through.get(key)
    if through is None:
      pos = self.producer_of[key]
      through = []
      for k in self._operands[pos]:
        for b in (self.reads_through(k, root) if self.fused_into(k, pos)
                  else (root.get(k, k),)):
          if b not in through:
            through.append(b)
      self._through[key] = through
    return through

  def buffer_reads(self, root: dict) -> tuple[dict, frozenset, dict]:
    """Buffer -> positions of the ops that read it (a fused key read as
    the buffers it is computed from), the keys that never get a buffer, and
    fused key -> the buffers it reads where it is consumed."""
    reads: dict = {}
    materialized: set = set()
    fused_into, through = self.fused_into, self.reads_through
    for pos, operands in enumerate(self._operands):
      for key in operands:
        if fused_into(key, pos):
          bufs = through(key, root)
        else:
          bufs = (root.get(key, key),)
          materialized.add(key)
        for buf in bufs:
          reads.setdefault(buf, []).append(pos)
    # Values nobody reads still get a buffer at their producer; values read
    # only through fusion get none.
    fused = frozenset(k for k in self.readers if k not in materialized)
    return reads, fused, {k: self.reads_through(k, root) for k in self._through}


def select_and_scatter_bytes(graph: Graph, node, indexed: bool) -> tuple[int, int, int]:
  """What XLA allocates for a max-pool's gradient (``select_and_scatter_add``)
  beside its output: ``(iotas, indices, while it runs)`` bytes.

  XLA's ``SelectAndScatterExpander`` rewrites it as a scatter into zeros of
  the (padded) operand's shape: the scatter's updates, a copy of the
  source, the operand's position along each of its r axes (int32 iotas)
  and a window reduction over (value, r indices) per source element (the
  indices). Measured on jax 0.10.2 for 2x2/2 pools while the gradient runs
  (XLA:CPU ``4 (r N_op + (2 + r) N_src)`` bytes for float32, XLA:GPU for a
  T4 ``4 (N_op + N_src)``, both to the byte); with padding, the padded
  operand stands for the operand (within 40% of XLA:CPU on a 3x3/2 SAME
  pool). On XLA:CPU (``indexed``) where the iotas and indices live is
  :meth:`Fusion.held`'s. XLA:GPU computes the indices in a fusion of the
  iotas with no name, beside the forward pool where the operand is a
  forward value: the learned model reads them off its program
  (``cost._xla_unnamed``), and only the updates are held here.
  """
  source, operand = (graph.values[a].aval for a in node.ins[:2])
  padded = 1
  for d, (lo, hi) in zip(operand.shape, node.params.get("padding", ())):
    padded *= d + lo + hi
  padded = max(padded, operand.size)
  item = operand.dtype.itemsize
  if not indexed:
    return 0, 0, item * source.size
  rank = len(operand.shape)
  return 4 * rank * padded, (item + 4 * rank) * source.size, item * source.size


def broadcasts(own: tuple, shape: tuple) -> bool:
  """Whether an operand of shape ``own`` is broadcast to ``shape`` (size-1
  axes stretched, as jaxpr's elementwise ops do implicitly)."""
  return (len(own) == len(shape) and own != shape and any(d > 1 for d in own)
          and all(o in (1, d) for o, d in zip(own, shape)))


def computed_with_broadcast(graph: Graph, vid: int) -> bool:
  """Whether forward value ``vid`` is an op reading a broadcast operand (a
  Dense layer's bias add)."""
  node = graph.producer(vid)
  shape = graph.values[vid].aval.shape
  return len(node.ins) > 1 and any(
      isinstance(a, int) and broadcasts(graph.values[a].aval.shape, shape)
      for a in node.ins)


@analysis
def separated_reads(graph: Graph, fused_items: frozenset) -> tuple[dict, dict]:
  """Backward node -> the operands whose reads the schedule builder routes
  through a barrier copy, and backward node -> the operands rebuilt from
  such copies; ``fused_items`` are the items of the fused-values map the
  schedule is built with (``_evaluate.fused_values``).

  Separated are values made before the backward pass that a backward node
  broadcasts (a LayerNorm's scale or 1/std), and kept residuals computed
  with a broadcast (a bias add): XLA materializes a broadcast that a
  reduction reads and merges equal broadcasts (CSE), so without the copy the
  forward and the backward broadcast of one value become one full-size
  buffer living from the forward use to the backward one.

  On a target whose buffers were learned (``graph.buffers``), only values
  that get a buffer in the step as written are separated: the others the
  target's compiler computes inside each reader, the backward ones too.

  Rebuilt are forward values XLA computes inside their readers from a bias
  add (GELU's ``x**2`` from ``x = dot + bias``): XLA would compute the add
  inside the backward reader too (its ``EffectivelyAtMostUnary`` rule),
  reading the dot output, which then stays alive beside the add's own
  buffer until the backward pass.
  """
  fused = dict(fused_items)
  # With buffers learned from the target's program, a value the target
  # computes inside its readers in the step as written is left so.
  learned = graph.buffers
  with_broadcast = lambda v: (graph.is_forward_value(v) and v not in fused
                              and (learned is None or v in learned.materialized)
                              and computed_with_broadcast(graph, v))
  separated, rebuilt = {}, {}
  for node in graph.nodes:
    if not node.backward:
      continue
    shape = graph.values[node.outs[0]].aval.shape if node.outs else ()
    atoms = [a for a in dict.fromkeys(a for a in node.ins if isinstance(a, int))
             if a not in graph.consts and not graph.is_backward_value(a)]
    found = tuple(a for a in atoms if broadcasts(graph.values[a].aval.shape, shape)
                  or with_broadcast(a))
    rebuild = tuple(a for a in atoms if graph.is_forward_value(a) and a in fused
                    and any(with_broadcast(b) for b in fused[a]))
    if found:
      separated[node.index] = found
    if rebuild:
      rebuilt[node.index] = rebuild
  return separated, rebuilt


def rebuilt_in_readers(graph: Graph, plan, fused: dict) -> frozenset:
  """Kept residuals the target computes inside their readers (learned
  buffers: no buffer in the step as written) from a buffer ``plan`` (a
  :class:`~jaxmem._decisions.Plan`) rebuilds or takes off the device: the
  schedule builder rebuilds them before their backward readers, as the target's compiler
  does in the step as written, so the moved buffer is not read where the
  forward pass had it. ``fused``: value -> the buffers it is computed from
  (``_evaluate.fused_values``)."""
  learned = graph.buffers
  if learned is None:
    return frozenset()
  moved = {v for v, d in plan if d.kind in ("recompute", "offload", "chunked")}
  if not moved:  # the step as written, or a plan of saved boundaries only
    return frozenset()
  saved = plan.values_with("save")
  return frozenset(v for v, sources in fused.items()
                   if v not in moved and v not in learned.materialized
                   and graph.is_residual(v) and any(b in moved for b in sources)
                   and any(b in moved for b in _past_saved(graph, v, sources, saved)))


def _past_saved(graph: Graph, vid: int, sources, saved) -> set:
  """The buffers of ``sources`` that ``vid`` is computed from other than
  through a value ``saved`` (a kept block output stands between a block's
  residuals and the module after it that reads them)."""
  if not saved:
    return set(sources)
  sources, found, seen, stack = set(sources), set(), set(), [vid]
  while stack:
    value = stack.pop()
    if value in seen or not graph.is_forward_value(value):
      continue
    seen.add(value)
    if value != vid and value in saved:
      continue
    if value != vid and value in sources:
      found.add(value)
      continue
    stack.extend(a for a in graph.producer(value).ins if isinstance(a, int))
  return found


def readable(graph: Graph, fused: dict, dropped, saved) -> Callable[[int], bool]:
  """Whether the backward pass may read a value as the forward pass made it,
  with the residuals ``dropped`` rebuilt and the values ``saved`` kept:
  step inputs, constants and backward values; of the forward values only a
  kept residual with a buffer of its own (reading a pure intermediate, or a
  residual XLA computes inside its readers, would keep a buffer alive until
  there), a saved value, or a buffer a kept fused residual is computed from.
  On XLA:CPU that buffer is read as the forward pass made it even where the
  plan rebuilds it: XLA computes the kept residual inside its backward
  readers from the forward buffer, which so lives on anyway (a CNN's
  smallest plan: 50% of its footprint, 52% with the buffer rebuilt). On a
  memory model learned from XLA:GPU's program a rebuilt buffer is read
  rebuilt, as ``jax.checkpoint``'s program reads a block's rebuilt values."""
  learned = graph.buffers is not None
  held = {b for vid, bufs in fused.items()
          if graph.is_residual(vid) and vid not in dropped for b in bufs
          if not (learned and b in dropped)}
  return lambda vid: (not graph.is_forward_value(vid) or vid in held or vid in saved or (
      graph.is_residual(vid) and vid not in dropped and vid not in fused))
