"""The memory model's fusion interface over the buffers learned from the
target's own program (:class:`~jaxmem.cost._xla_buffers.Buffers`): which
values fuse into their readers, what a node holds while it runs, and the
buffers held between two nodes that are no value's own."""

from __future__ import annotations

from jaxmem.cost._xla_buffers import Buffers
from jaxmem.graph._graph import Graph, analysis
from jaxmem.graph._xla_cpu_fusion import Fusion, select_and_scatter_bytes


class LearnedFusion(Fusion):
  """:class:`~jaxmem.graph._xla_cpu_fusion.Fusion`'s interface over the
  schedule's graph's :class:`Buffers`: a value fuses into a reader where the
  compiler gave it no buffer in the step as written and the reader is an
  equation."""

  def __init__(self, schedule, names: list[str], backward: list[bool]):
    super().__init__(schedule, names, backward)
    self.buffers: Buffers = self.graph.buffers
    self._scratch, self._beside = _per_node(self.graph)

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
    return 0 if node is None else self._scratch[node]

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
    extra = self._beside.get(key[0])
    if not extra:
      return 0
    pos = self.producer_of.get(key)
    return 0 if pos is None or self.ops[pos].node is None else extra


@analysis
def _per_node(graph: Graph) -> tuple[list[int], dict[int, int]]:
  """What the learned buffers give each node of ``graph``, read per op of
  every schedule: the bytes it holds while it runs (its library
  workspace, its brief buffers, a max-pool gradient's scatter updates),
  and by its first output's id, the bytes made beside that output
  (``Buffers.extra``)."""
  buffers = graph.buffers
  scratch = []
  for node in graph.nodes:
    held = buffers.workspace.get(node.index, 0) + buffers.transient.get(node.index, 0)
    if node.prim.name == "select_and_scatter_add":
      held += select_and_scatter_bytes(graph, node, indexed=False)[2]
    scratch.append(held)
  beside = {graph.nodes[node].outs[0]: extra for node, extra in buffers.extra.items()
            if extra and node < len(graph.nodes) and graph.nodes[node].outs}
  return scratch, beside
