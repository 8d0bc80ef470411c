"""Plan -> schedule: the step's equations in order, with the plan applied.

A schedule is the rewritten program as data: a list of :class:`Op`, each
reading and writing *keys* ``(value id, version)``. Version 0 is the value as
the original step makes it; recomputed copies get new versions. The memory
model (``_memory``) simulates a schedule and the emitter (``_emit``) runs it,
so what is predicted is exactly what is compiled.

Recomputation (:class:`~jaxmem._plan.Recompute`): before a backward equation
that reads a dropped residual, the forward equations that rebuild it are
re-run from *kept* values only (step inputs, constants, kept residuals, and
copies recomputed earlier and still in use), never from a forward value that
happens to be at hand (that would keep it alive and save nothing). The kept
values enter the recomputation through one ``optimization_barrier`` together
with the backward equation's most recent backward input, so XLA can neither
merge the copy with the forward value (CSE) nor hoist it to the start of the
backward pass. A dropped residual rebuilt on the way is kept for its own later
backward uses; other forward intermediates die inside their group.
"""

from __future__ import annotations

import dataclasses
import itertools

from jax.extend import core as jex

from jaxmem._graph import Graph
from jaxmem._plan import Plan

Key = tuple  # (value id, version)


@dataclasses.dataclass(frozen=True)
class Op:
  """One step of a schedule.

  Attributes:
    kind: ``"node"`` (an original equation), ``"recompute"`` (a re-run forward
      equation) or ``"barrier"`` (an ``optimization_barrier``; outputs alias
      inputs).
    node: index of the graph node run (None for a barrier).
    ins: input keys or ``jex.Literal``.
    outs: output keys.
  """
  kind: str
  node: int | None
  ins: tuple
  outs: tuple


@dataclasses.dataclass
class Schedule:
  """A rewritten step: ops over keys, with its inputs and outputs."""
  graph: Graph
  plan: Plan
  ops: list[Op]
  inputs: list[Key]
  outputs: list  # keys or jex.Literal
  recompute_flops: float

  @property
  def nodes(self):
    return self.graph.nodes


class _Rewriter:
  """Walks the graph once, emitting ops; the env maps value id -> live key."""

  def __init__(self, graph: Graph, plan: Plan, fused: dict):
    self.graph = graph
    self.plan = plan
    self.dropped = plan.values_with("recompute")
    self.fused = fused
    # Buffers that kept fused residuals are computed from stay alive for
    # their backward reads, so recomputation may read them too.
    self.held = {b for vid, bufs in fused.items()
                 if vid in graph._by_value and vid not in self.dropped for b in bufs}
    self.ops: list[Op] = []
    self.cache: dict[int, Key] = {}  # dropped residual -> recomputed key
    self._versions = itertools.count(1)
    self.recompute_flops = 0.0
    self.latest: Key | None = None  # the latest backward value emitted

  def key(self, vid: int) -> Key:
    return (vid, 0)

  def fresh(self, vid: int) -> Key:
    return (vid, next(self._versions))

  def available(self, vid: int) -> bool:
    """Whether the original value may be read in the backward pass."""
    if not self.graph.is_forward_value(vid):
      return True  # step input, constant or backward value
    # A forward value may be read only if it is a kept residual with a
    # buffer of its own: reading a pure forward intermediate, or a residual
    # XLA computes inside its readers, would give it a buffer kept alive
    # until here, and save nothing.
    return vid in self.held or (vid in self.graph._by_value
                                and vid not in self.dropped and vid not in self.fused)

  def order(self) -> list:
    """Graph nodes in emission order: optimizer-update nodes move up to just
    after their last input is made, so each gradient is consumed (and freed)
    as soon as it exists instead of waiting for the whole backward pass."""
    graph = self.graph
    if "order" in graph.derived:
      return graph.derived["order"]
    slot: dict[int, int] = {}
    for node in graph.nodes:
      if node.update:
        producers = [graph.values[a].producer for a in node.ins
                     if isinstance(a, int) and graph.values[a].producer is not None]
        slot[node.index] = max((slot[p] for p in producers), default=node.index)
      else:
        slot[node.index] = node.index
    graph.derived["order"] = sorted(graph.nodes, key=lambda n: (slot[n.index], n.index))
    return graph.derived["order"]

  def run(self) -> Schedule:
    graph = self.graph
    for node in self.order():
      if node.backward:
        missing = [a for a in node.ins if isinstance(a, int)
                   and a in self.dropped and a not in self.cache]
        tied_anchor = self.recompute(missing, node) if missing else None
      else:
        tied_anchor = None
      ins = tuple(self.read(a, node.backward) for a in node.ins)
      if tied_anchor is not None:
        # The consumer reads the anchor through the barrier, so the barrier
        # sits between the anchor's producer and the consumer and XLA cannot
        # prune the anchor out of it.
        ins = tuple(tied_anchor[1] if k == tied_anchor[0] else k for k in ins)
      self.ops.append(Op("node", node.index, ins, tuple(map(self.key, node.outs))))
      if node.backward and node.outs:
        self.latest = self.key(node.outs[0])
    outputs = [o if isinstance(o, jex.Literal) else self.read(o, True)
               for o in graph.outputs]
    return Schedule(graph, self.plan, self.ops, [self.key(v) for v in graph.inputs],
                    outputs, self.recompute_flops)

  def read(self, atom, backward: bool):
    if isinstance(atom, jex.Literal):
      return atom
    if backward and atom in self.cache:
      return self.cache[atom]
    return self.key(atom)

  def recompute(self, missing: list[int], consumer):
    """Re-runs the forward equations that rebuild ``missing`` before
    ``consumer``; returns ``(anchor, its barrier copy)`` or None."""
    graph = self.graph
    to_run: set[int] = set()
    leaves: set[int] = set()
    stack = list(missing)
    while stack:
      vid = stack.pop()
      if vid in self.cache:
        continue
      if self.available(vid):
        leaves.add(vid)
        continue
      producer = graph.values[vid].producer
      if producer in to_run:
        continue
      to_run.add(producer)
      stack.extend(a for a in graph.nodes[producer].ins if isinstance(a, int))
    local: dict[int, Key] = {}
    tied = sorted(v for v in leaves if v not in graph.consts)
    anchor = self.anchor(consumer)
    tied_anchor = None
    if tied:
      ins = tuple(self.key(v) for v in tied) + ((anchor,) if anchor else ())
      outs = tuple(self.fresh(k[0]) for k in ins)
      self.ops.append(Op("barrier", None, ins, outs))
      local.update(zip(tied, outs))
      if anchor:
        tied_anchor = (anchor, outs[-1])
    for index in sorted(to_run):
      node = graph.nodes[index]
      ins = tuple(a if isinstance(a, jex.Literal) else
                  local.get(a) or self.cache.get(a) or self.key(a)
                  for a in node.ins)
      outs = tuple(self.fresh(v) for v in node.outs)
      for vid, key in zip(node.outs, outs):
        local[vid] = key
        if vid in self.dropped:
          self.cache[vid] = key
      self.recompute_flops += node.flops
      self.ops.append(Op("recompute", index, ins, outs))
    return tied_anchor

  def anchor(self, consumer) -> Key | None:
    """The consumer's most recently made backward input, to order the group;
    for a consumer that reads only forward values, the latest backward value
    emitted (without an anchor XLA may hoist the group into the forward)."""
    best = None
    for atom in consumer.ins:
      if isinstance(atom, int):
        producer = self.graph.values[atom].producer
        if producer is not None and self.graph.nodes[producer].backward:
          if best is None or producer > self.graph.values[best].producer:
            best = atom
    return self.latest if best is None else self.read(best, True)


def build_schedule(graph: Graph, plan: Plan, fused: dict | None = None) -> Schedule:
  """Applies ``plan`` to ``graph``; see the module docstring.

  Args:
    graph: the step's joint graph.
    plan: decisions per residual.
    fused: forward values that XLA computes inside their readers rather than
      in a buffer of their own, each with the buffers it is computed from
      (see ``_memory.fused_values``); recomputation reads those buffers
      instead of the value.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem._graph import build_graph
    >>> from jaxmem._plan import Plan, RECOMPUTE
    >>> step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4))))
    >>> s = build_schedule(g, Plan().with_decision(g.residuals[0].value, RECOMPUTE))
    >>> [op.kind for op in s.ops].count("recompute")
    2
  """
  return _Rewriter(graph, plan, fused or {}).run()
