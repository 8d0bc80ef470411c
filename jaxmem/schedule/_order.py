"""Where the schedule builder puts things in the step: optimizer updates
just after their gradient, and the recomputation of a block's residuals
rebuilt with it where the block's backward pass starts."""

from __future__ import annotations

from jaxmem._decisions import Plan
from jaxmem.graph._graph import Graph, analysis


@analysis
def emission_order(graph: Graph) -> tuple:
  """Graph nodes in emission order: optimizer-update nodes move up to just
  after their last input is made, so each gradient is consumed (and freed)
  as soon as it exists instead of waiting for the whole backward pass."""
  slot: dict[int, int] = {}
  # Update nodes that read only step inputs and constants (Adam's step
  # count): placed just before their first reader, so they do not hold
  # the updates that read them back.
  floating: set[int] = set()
  for node in graph.nodes:
    if not node.update:
      slot[node.index] = node.index
      continue
    producers = [graph.values[a].producer for a in node.ins
                 if isinstance(a, int) and graph.values[a].producer is not None]
    placed = [slot[p] for p in producers if p not in floating]
    if placed:
      slot[node.index] = max(placed)
    else:
      floating.add(node.index)
  for index in sorted(floating, reverse=True):
    readers = [u for v in graph.nodes[index].outs for u in graph.values[v].uses]
    slot[index] = min((slot[u] for u in readers), default=index)
  return tuple(sorted(graph.nodes, key=lambda n: (slot[n.index], n.index)))


@analysis
def emission_position(graph: Graph) -> dict[int, int]:
  """Node index -> its place in emission order."""
  return {n.index: i for i, n in enumerate(emission_order(graph))}


def rebuilt_with_block(graph: Graph, plan: Plan) -> dict[str, list[int]]:
  """Block scope -> the residuals ``plan`` rebuilds with their block
  (``Recompute.with_block``), each under the scope of the block that
  makes it."""
  found: dict[str, list[int]] = {}
  for vid, decision in plan:
    if decision.kind == "recompute" and decision.with_block:
      found.setdefault(graph.producer(vid).scope(), []).append(vid)
  return found


@analysis
def backward_reads(graph: Graph, scope: str) -> frozenset:
  """Values the backward equations of block ``scope`` read (constants aside)."""
  return frozenset(a for node in graph.nodes if node.backward and node.scope() == scope
                   for a in node.ins if isinstance(a, int) and a not in graph.consts)


@analysis
def entering_values(graph: Graph, scope: str) -> frozenset:
  """Backward values that the backward equations of block ``scope`` read
  and that equations outside the block make."""
  inside = lambda vid: graph.nodes[graph.values[vid].producer].scope() == scope
  return frozenset(a for a in backward_reads(graph, scope)
                   if graph.is_backward_value(a) and not inside(a))


@analysis
def block_inputs(graph: Graph, scope: str) -> frozenset:
  """What the backward equations of block ``scope`` read that the backward
  pass does not make: step inputs (parameters) and forward values, which
  ``jax.checkpoint`` passes into the block's backward pass as residuals."""
  return frozenset(a for a in backward_reads(graph, scope) if not graph.is_backward_value(a))
