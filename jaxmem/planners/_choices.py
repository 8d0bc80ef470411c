"""The exact planner's choices: what a plan may do to a block or a residual.

A :class:`Choice` checkpoints one module block under a per-block policy; a
:class:`Drop` recomputes one rebuild group (a residual with the residuals
XLA computes from its buffer) on its own. :func:`plan_of` turns a set of
them into a :class:`~jaxmem.Plan`; :func:`levels` reads the live bytes at
each equation off a schedule's memory model, the rows of the program the
planner solves; :func:`exclusive` lists the choices that cannot be taken
together.
"""

from __future__ import annotations

import dataclasses

from jaxmem.planners._blocks import Segment, checkpoint_block
from jaxmem._decisions import RECOMPUTE, Plan
from jaxmem.cost._evaluate import fused_values, recomputable
from jaxmem.graph._graph import Graph
from jaxmem.cost._memory import Liveness


@dataclasses.dataclass(frozen=True)
class Choice:
  """One block checkpointed under one policy (a key of :data:`KEEPS`)."""
  segment: Segment
  keep: str

  def decisions(self, graph: Graph, into: dict) -> None:
    checkpoint_block(graph, self.segment, self.keep, into)

  def describe(self, graph: Graph) -> tuple[str, str]:
    return self.segment.name, self.keep


@dataclasses.dataclass(frozen=True)
class Drop:
  """Residuals recomputed on their own, from the values their rebuild
  reads (a residual with the kept residuals XLA computes from its buffer:
  :func:`rebuild_groups`)."""
  values: tuple

  def decisions(self, graph: Graph, into: dict) -> None:
    into.update({v: RECOMPUTE for v in self.values if v not in into})

  def describe(self, graph: Graph) -> tuple[str, str]:
    more = f" (+{len(self.values) - 1})" if len(self.values) > 1 else ""
    return f"{graph.producer(self.values[0]).label}{more}", "recompute"


def riders(graph: Graph) -> dict:
  """Buffer id -> the recomputable residuals XLA computes from it inside
  their readers (fused onto it)."""
  candidates = recomputable(graph)
  found: dict = {}
  for vid, bufs in fused_values(graph).items():
    if vid in candidates:
      for buf in bufs:
        found.setdefault(buf, []).append(vid)
  return found


def rebuild_groups(graph: Graph) -> list[tuple]:
  """Each recomputable residual with the recomputable residuals fused onto
  its buffer (:func:`riders`: XLA computes them from it where they are
  read, so dropping one without the others frees nothing), each group
  once."""
  candidates, fused_onto = recomputable(graph), riders(graph)
  found = []
  for vid in candidates:
    group = tuple(sorted({vid, *fused_onto.get(vid, ())}))
    if group not in found and vid not in fused_values(graph):
      found.append(group)
  return found


def levels(memory: Liveness) -> dict[int, int]:
  """Live bytes at each equation of a schedule: node index -> the most
  bytes live from the op after the previous equation up to its own (the
  recomputations and copies a rewrite puts before an equation count at
  it); ``-1``: the ops after the last equation.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph._graph import build_graph
    >>> from jaxmem.cost._evaluate import unplanned_liveness
    >>> g = build_graph(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jnp.sin(x))))(jnp.ones(8)))
    >>> memory = unplanned_liveness(g)
    >>> max(levels(memory).values()) == memory.peak
    True
  """
  found, pending = {}, 0
  for op, live in zip(memory.schedule.ops, memory.timeline):
    pending = max(pending, live)
    if op.kind == "node":
      found[op.node] = max(found.get(op.node, 0), pending)
      pending = 0
  found[-1] = pending
  return found


def plan_of(graph: Graph, chosen) -> Plan:
  """The plan of ``chosen`` :class:`Choice` s, applied in forward order as
  per-block ``jax.checkpoint`` would be."""
  decisions: dict = {}
  blocks = [c for c in chosen if isinstance(c, Choice)]
  first = lambda c: graph.blocks(c.segment.depth)[c.segment.name][0]
  for choice in sorted(blocks, key=first) + [c for c in chosen if isinstance(c, Drop)]:
    choice.decisions(graph, decisions)
  return Plan.of(decisions)


def _parent(seg: Segment, names: set) -> str | None:
  """The depth-2 block ``seg`` (a depth-3 one) lies in, if that is a block
  of its own."""
  parent = "/".join(seg.name.split("/")[:2])
  return parent if seg.depth == 3 and parent in names else None


def exclusive(graph: Graph, choices: list, segs: list) -> list[list[int]]:
  """Groups of choices at most one of which a plan takes: a block's
  policies; a block's and those of the blocks nested in it; a rebuild
  group and any block choice that decides one of its residuals."""
  names = {s.name for s in segs if s.depth == 2}
  groups: dict = {}
  for i, choice in enumerate(choices):
    if isinstance(choice, Choice):
      groups.setdefault(choice.segment.name, []).append(i)
  exclusive = list(groups.values())
  for seg in segs:
    parent = _parent(seg, names)
    if parent is not None and seg.name in groups:
      exclusive.append(groups.get(parent, []) + groups[seg.name])
  decided = {i: plan_of(graph, [c]).as_dict() for i, c in enumerate(choices)
             if isinstance(c, Choice)}
  blocks = list(exclusive)
  for i, choice in enumerate(choices):
    if isinstance(choice, Drop):
      clash = {j for j, d in decided.items() if any(v in d for v in choice.values)}
      # With each block group its clashing choices form a clique: one row
      # each, fewer and tighter than a row per pair.
      exclusive += [[i, *sorted(clash.intersection(g))] for g in blocks
                    if clash.intersection(g)]
  return _maximal(exclusive)


def _maximal(groups: list[list[int]]) -> list[list[int]]:
  """``groups`` less those inside another (which that one implies)."""
  sets = sorted({frozenset(g) for g in groups}, key=len, reverse=True)
  kept: list[frozenset] = []
  for g in sets:
    if not any(g <= k for k in kept):
      kept.append(g)
  return [sorted(g) for g in kept]
