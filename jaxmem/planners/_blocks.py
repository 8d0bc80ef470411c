"""Module blocks: the unit per-block ``jax.checkpoint`` works on.

A *segment* is a module block (its module path cut at depth 2 or 3,
``GPT2/block0``) with the residuals made and used inside it and the values it
reads from outside it. Checkpointing a segment drops the first and saves
the second, so recomputation starts at the block's boundary instead of
running back through earlier blocks (XLA follows such plans closely). The greedy's block
moves and the plans shaped like the per-block remat baselines are built
from these.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from jaxmem.graph import _primitives
from jaxmem._decisions import KEEP, RECOMPUTE, SAVE, Plan, Recompute
from jaxmem.cost._evaluate import Candidate, candidate, recomputable
from jaxmem.graph._graph import Graph, analysis


@dataclasses.dataclass(frozen=True)
class Segment:
  """A module block that a planner can checkpoint in one move.

  Attributes:
    name: the block's module path (``GPT2/block0``).
    drops: recomputable residuals made in the block and read by no forward
      equation outside it.
    saves: forward values made outside the block that it reads: where its
      recomputation starts.
    flops: FLOPs of the block's forward equations.
    depth: the module depth its path is cut at.
  """
  name: str
  drops: tuple
  saves: tuple
  flops: float
  depth: int


@analysis
def segments(graph: Graph, depths: tuple = (2, 3)) -> list[Segment]:
  """The blocks of ``graph`` at module depths ``depths`` that hold residuals
  to drop (duplicates of a shallower block left out); computed once per
  graph.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return x + nn.Dense(8)(jnp.tanh(nn.Dense(8)(x)))
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     h = Block()(x)
    ...     return jnp.sum(Block()(h) ** 2)
    >>> from jaxmem.graph._graph import build_graph
    >>> net, x = Net(), jnp.ones((4, 8))
    >>> p = net.init(jax.random.key(0), x)
    >>> g = build_graph(jax.make_jaxpr(jax.grad(lambda p: net.apply(p, x)))(p))
    >>> [(s.name, len(s.drops), len(s.saves)) for s in segments(g)]
    [('Net/Block_0', 2, 0), ('Net/Block_1', 2, 1)]
  """
  candidates = recomputable(graph)
  found, seen = [], set()
  for depth in depths:
    for name, nodes in graph.blocks(depth).items():
      inside = set(nodes)
      drops = tuple(r.value for r in graph.residuals
                    if r.produced_at in inside and r.value in candidates
                    and all(u in inside for u in graph.values[r.value].uses
                            if not graph.nodes[u].backward))
      saves = tuple(sorted({a for i in nodes for a in graph.nodes[i].ins
                            if isinstance(a, int) and graph.is_forward_value(a)
                            and graph.values[a].producer not in inside}))
      if drops and (drops, saves) not in seen:
        seen.add((drops, saves))
        found.append(Segment(name, drops, saves,
                             sum(graph.nodes[i].flops for i in nodes), depth))
  return found


def checkpoint_moves(graph: Graph, seg: Segment, decisions: dict) -> list[tuple]:
  """The decisions that checkpoint ``seg`` on top of ``decisions``: its
  residuals recomputed, its boundary saved (a dropped residual there kept
  again)."""
  move = [(v, RECOMPUTE) for v in seg.drops if v not in decisions]
  for v in seg.saves:
    if not graph.is_residual(v):
      if v not in decisions:
        move.append((v, SAVE))
    elif decisions.get(v, KEEP).kind == "recompute":
      move.append((v, KEEP))
  return move


def checkpoint_block(graph: Graph, seg: Segment, keep: str, decisions: dict) -> None:
  """Checkpoints ``seg`` under the per-block policy ``keep`` (a key of
  :data:`KEEPS`) on top of ``decisions``, in place: its boundary saved
  (:func:`checkpoint_moves`), the outputs of its equations the policy saves
  kept, the rest of its residuals recomputed. Blocks applied in forward
  order give what per-block ``jax.checkpoint`` would."""
  keeps = KEEPS[keep]
  decisions.update(checkpoint_moves(graph, seg, decisions))
  for index in graph.blocks(seg.depth)[seg.name]:
    node = graph.nodes[index]
    if keeps(node):
      for vid in node.outs:  # kept: a residual, or saved for rebuilding
        if graph.is_residual(vid):
          decisions.pop(vid, None)
        else:
          decisions[vid] = SAVE


def rebuilt_as_checkpointed(graph: Graph, plan: Plan) -> Plan:
  """``plan`` rebuilding its blocks as per-block ``jax.checkpoint`` does:
  each residual it recomputes is rebuilt with its block
  (``Recompute(with_block=True)``), but for one that an equation outside
  the block that made it reads (the block's output, which a module after
  it reads), kept as a checkpointed function's outputs are. A residual the
  target's program reads only through values it fuses (``read_through``
  residuals, which no equation outside the block reads) is rebuilt with
  its block: once the block's output is kept, nothing after the block
  reads it."""
  block = lambda index: graph.nodes[index].scope()
  leaves = lambda vid: any(block(u) != block(graph.values[vid].producer)
                           for u in graph.values[vid].uses)
  decisions, rebuilt = {}, set()
  for vid, decision in plan:
    if decision.kind == "recompute":
      if leaves(vid):
        continue
      decision = Recompute(with_block=True)
      rebuilt.add(block(graph.values[vid].producer))
    decisions[vid] = decision
  # A rebuilt block's outputs stay, as a checkpointed function's do, so
  # the modules after it read them and not what the block rebuilds.
  for scope in rebuilt:
    for index in graph.blocks(2).get(scope, ()):
      for vid in graph.nodes[index].outs:
        if (vid not in decisions and not graph.is_residual(vid) and leaves(vid)
            and graph.is_forward_value(vid)):
          decisions[vid] = SAVE
  return Plan.of(decisions)


def _no_batch_dims(node) -> bool:
  """A matrix product without batch dimensions (a projection, not an
  attention score): what ``dots_with_no_batch_dims_saveable`` keeps."""
  if node.prim.name != "dot_general":
    return False
  (_, _), (lhs_batch, rhs_batch) = node.params["dimension_numbers"]
  return not lhs_batch and not rhs_batch


# What each per-block policy keeps of a block's own equations, by the name
# of the ``jax.checkpoint_policies`` policy it mirrors.
KEEPS = {
    "nothing_saveable": lambda node: False,
    "dots_saveable": lambda node: _primitives.is_matmul(node.prim.name),
    "dots_with_no_batch_dims_saveable": _no_batch_dims,
}


def repeated(names: list[str]) -> set[str]:
  """The names that are layers of a stack: those that, digits aside, more
  than one name shares (``GPT2/block0``, ``GPT2/block1``; not
  ``GPT2/ln_f``)."""
  shapes = collections.Counter(re.sub(r"\d+", "#", n) for n in names)
  return {n for n in names if shapes[re.sub(r"\d+", "#", n)] > 1}


@analysis
def block_plans(graph: Graph, keep: str = "nothing_saveable",
                layers: bool = False) -> list[Plan]:
  """Every block checkpointed, at module depth 2 and at depth 3: the plans
  per-block ``jax.checkpoint`` with policy ``keep`` (a key of
  :data:`KEEPS`) would give: the outputs of the block's equations the
  policy saves are kept, the rest recomputed from the block's boundary.
  With ``layers``, only the blocks that repeat (:func:`repeated`), as
  wrapping a model's layers in ``nn.remat`` leaves its embedding and head
  alone. They serve as starting points and as candidates for the lowest
  footprint and for a plan's time (XLA follows them closely:
  recomputation starts at saved block boundaries)."""
  plans = []
  for depth in (2, 3):
    decisions: dict = {}
    found = segments(graph, (depth,))
    chosen = repeated([seg.name for seg in found]) if layers else None
    for seg in found:
      if chosen is None or seg.name in chosen:
        checkpoint_block(graph, seg, keep, decisions)
    if any(d.kind == "recompute" for d in decisions.values()) and \
        Plan.of(decisions) not in plans:
      plans.append(Plan.of(decisions))
  return plans


@analysis
def block_candidates(graph: Graph, keeps: tuple = tuple(KEEPS)) -> list[Candidate]:
  """The plans of :func:`block_plans` under each policy of ``keeps`` (keys
  of :data:`KEEPS`), every block's first, then the layers', each plan once,
  evaluated once per graph."""
  plans = []
  for layers in (False, True):
    for keep in keeps:
      plans += [p for p in block_plans(graph, keep, layers) if p not in plans]
  return [candidate(graph, plan) for plan in plans]
