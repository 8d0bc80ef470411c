"""The memory model's fusion interface over the buffers learned from the
target's own program (:class:`~jaxmem.cost._xla_buffers.Buffers`): which
values fuse into their readers, what a node holds while it runs, and the
buffers held between two nodes that are no value's own."""

from __future__ import annotations

from jaxmem.cost._xla_buffers import Buffers
from jaxmem.graph._xla_cpu_fusion import Fusion, select_and_scatter_bytes


class LearnedFusion(Fusion):
  """:class:`~jaxmem.graph._xla_cpu_fusion.Fusion`'s interface over
  :class:`Buffers`: a value fuses into a reader where the compiler gave it
  no buffer in the step as written and the reader is an equation."""

  def __init__(self, schedule, names: list[str], backward: list[bool], buffers: Buffers):
    super().__init__(schedule, names, backward)
    self.buffers = buffers

  def fused_into(self, key, reader: int) -> bool:
    pos = self.producer_of.get(key)
    if (pos is None or key in self.outputs or self.ops[pos].node is None
        or self.ops[reader].node is None):
      return False
    return key[0] not in self.buffers.materialized

  def always_reads(self, key, reader: int) -> bool:
    return not self.fused_into(key, reader)

  def scratch(self, pos: int) -> int:
    node = self.ops[pos].node
    if node is None:
      return 0
    workspace = self.buffers.workspace.get(node, 0) + self.buffers.transient.get(node, 0)
    if self.graph.nodes[node].prim.name != "select_and_scatter_add":
      return workspace
    return workspace + select_and_scatter_bytes(self.graph, self.graph.nodes[node],
                                                indexed=False)[2]

  def held(self, root: dict) -> list[tuple[int, int, int]]:
    """The buffers of :attr:`Buffers.spans` (collectives', values made
    late, and buffers no equation names), each from the op that runs its
    first node, or the last that makes its source where that comes later
    (a plan that rebuilds a gathered activation in the backward pass, or
    copies it back from the host, gathers it there; one that rebuilds a
    pooled activation finds its argmax indices there), to the last op
    that runs its last node; none where a plan moves the one after the
    other."""
    if not self.buffers.spans:
      return []
    first, last, made = {}, {}, {}
    for pos, op in enumerate(self.ops):
      if op.kind == "prefetch":  # a copy back of what a node made
        made[self.graph.values[op.outs[0][0]].producer] = pos
      if op.node is None:
        continue
      made[op.node] = pos
      if op.kind == "node":
        first.setdefault(op.node, pos)
        last[op.node] = pos
    found = []
    for a, b, size, source in self.buffers.spans:
      if a in first and b in last:
        start = max(first[a], made.get(source, -1))
        if start <= last[b]:
          found.append((start, last[b], size))
    return found

  def beside(self, key) -> int:
    pos = self.producer_of.get(key)
    node = None if pos is None else self.ops[pos].node
    if node is None or self.graph.nodes[node].outs[:1] != (key[0],):
      return 0
    return self.buffers.extra.get(node, 0)
