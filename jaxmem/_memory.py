"""Memory model: program-order liveness over a schedule.

The footprint is counted the way XLA reports one (temp + arguments + outputs
- aliases): step inputs, constants and outputs are live throughout, every
other buffer from its producing op to its last reader. Two refinements bring the walk close to XLA's buffer assignment:

* outputs are live for the whole step (XLA allocates them up front), and
  until an output is written a temporary of the same size may use its
  buffer (XLA's buffer assignment does this; it matters for optimizer
  states, whose outputs have the shapes of parameters);
* views (``reshape``, ``squeeze``, ``expand_dims``, ``optimization_barrier``)
  share their input's buffer;
* an elementwise value read once, by an elementwise op or a reduction, is
  fused into its reader and never materialized (its own inputs are then read
  at the reader's position).
"""

from __future__ import annotations

import dataclasses

from jax.extend import core as jex

from jaxmem._rewrite import Schedule

VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "optimization_barrier"})
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
FUSING_READERS = ELEMENTWISE | frozenset({
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

  def excess(self, target: int) -> int:
    """Byte-ops above ``target``: how far and how long the step exceeds it."""
    return sum(max(0, t - target) for t in self.timeline)

  @property
  def peak_name(self) -> str:
    """Readable name of the equation at the peak."""
    op = self.schedule.ops[self.peak_op]
    if op.node is None:
      return f"optimization_barrier (op {self.peak_op})"
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
  nbytes = lambda key: graph.values[key[0]].nbytes

  # Which key owns which buffer, and which keys are fused away.
  producer_of: dict = {}
  for pos, op in enumerate(ops):
    for key in op.outs:
      producer_of[key] = pos
  readers: dict = {}
  for pos, op in enumerate(ops):
    for key in op.ins:
      if not isinstance(key, jex.Literal):
        readers.setdefault(key, []).append(pos)
  outputs = {k for k in schedule.outputs if not isinstance(k, jex.Literal)}

  def prim(op) -> str:
    return "optimization_barrier" if op.node is None else graph.nodes[op.node].prim.name

  root: dict = {}
  fused: set = set()
  for pos, op in enumerate(ops):
    name = prim(op)
    for i, key in enumerate(op.outs):
      if name in VIEWS and not isinstance(op.ins[i if op.node is None else 0], jex.Literal):
        src = op.ins[i if op.node is None else 0]
        root[key] = root.get(src, src)
      else:
        root[key] = key
      uses = readers.get(key, [])
      if (name in ELEMENTWISE and key not in outputs and len(uses) == 1
          and prim(ops[uses[0]]) in FUSING_READERS):
        fused.add(key)

  # Effective reads: a fused key is read through its producer's inputs.
  effective: dict = {}

  def reads_of(key) -> list:
    if isinstance(key, jex.Literal):
      return []
    if key not in fused:
      return [root.get(key, key)]
    if key not in effective:
      op = ops[producer_of[key]]
      effective[key] = [r for k in op.ins for r in reads_of(k)]
    return effective[key]

  reads: dict = {}
  for pos, op in enumerate(ops):
    for key in op.ins:
      for buf in reads_of(key):
        reads.setdefault(buf, []).append(pos)

  inputs = set(schedule.inputs) | {(v, 0) for v in graph.consts}
  arguments = sum(nbytes(k) for k in inputs)
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

  # Until an output is written, XLA may place a temporary of the same size in
  # its buffer: slot -> position where the output is made, busy-until.
  slots: dict[int, list] = {}
  for b in {root.get(k, k) for k in outputs}:
    if b not in inputs:
      slots.setdefault(nbytes(b), []).append([producer_of.get(b, -1), -1])
  last_read = {k: pos for pos, keys in free_at.items() for k in keys}

  def place_in_output_slot(key, pos) -> bool:
    end = last_read.get(key)
    if end is None:
      return False
    for slot in slots.get(nbytes(key), ()):
      if slot[1] < pos and end < slot[0]:
        slot[1] = end
        return True
    return False

  live = arguments + out_bytes
  live_set: set = set()
  peak, peak_op, live_at_peak = live, 0, []
  timeline = []
  for pos in range(len(ops)):
    for key in owned_by.get(pos, ()):
      if place_in_output_slot(key, pos):
        continue
      live += nbytes(key)
      live_set.add(key)
    timeline.append(live)
    if live > peak:
      peak, peak_op, live_at_peak = live, pos, list(live_set)
    for key in free_at.get(pos, ()):
      if key in live_set:
        live -= nbytes(key)
        live_set.discard(key)
  return MemoryProfile(schedule, peak, peak_op, arguments, timeline,
                       live_at_peak, reads, root,
                       {k: reads_of(k) for k in fused})
