"""Loops run in segments, each with a plan of its own.

A plan can give the layers of a stacked residual different decisions with
:class:`~jaxmem._decisions.Chunked` along its layer axis (axis 0): each
range of layers kept, rebuilt per iteration, or kept in host memory one
slice per iteration (what ``_scan_remat`` does for a whole loop). Such a
loop runs as consecutive scans over its *segments* (the union of its
chunks' bounds), all in one op of the schedule: the forward op runs them in
turn, chaining the carry, and stacks per segment only what that segment
keeps (its own buffer, on the device or on the host); each backward op
runs its segments in reverse, each rebuilding or fetching its own slices,
and writes their stacked outputs in place. The program holds one scan per
segment (a few), whatever the depth, and a budget between "every layer
kept" and "every layer rebuilt" is met by rebuilding only as many layers as
it needs.

Only a loop whose every stacked residual is read one slice per backward
iteration, run forward, and not nested can be segmented; a carry stack (a
layer's input, which rebuilds read) is kept or hosted, never rebuilt.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxmem._decisions import Plan
from jaxmem.graph._graph import Graph, Node
from jaxmem.graph._loops import loops
from jaxmem.schedule._scan_remat import (Inside, Iteration, backward_rebuilding,
                                         carry_outputs, fetching, forward_without, hostable,
                                         rebuildable, scan_shape, unstacked_carries)
from jaxmem.schedule._schedule import Op

KINDS = ("keep", "recompute", "offload")
# Versions of the keys a segmented loop adds: segment k's piece of a stack,
# and of a carry the forward scan does not stack itself.
_PIECE = -100
_CARRY_PIECE = -200


@dataclasses.dataclass(frozen=True)
class Segmented:
  """One loop run in segments.

  Attributes:
    forward: the forward scan's node index.
    bounds: ``(start, stop)`` of each segment, in layer order.
    kinds: stacked residual -> its decision's kind in each segment.
    outputs: stacked residual -> the forward scan's output position.
  """
  forward: int
  bounds: tuple
  kinds: dict
  outputs: dict

  def piece(self, vid: int, k: int) -> tuple:
    return (vid, _PIECE - k)

  def has_piece(self, vid: int, k: int) -> bool:
    return self.kinds[vid][k] != "recompute"

  def rebuilds(self, k: int) -> bool:
    return any(kinds[k] == "recompute" for kinds in self.kinds.values())


def segment_scan(start: int, stop: int, length: int, into: list | None = None) -> Callable:
  """A ``scan(step, init, xs, reverse)`` over iterations ``start..stop`` of
  a loop of ``length``: an ``xs`` of the whole loop (leading axis
  ``length``) is read at the iteration's index inside the body, so it is
  not sliced into a copy; one of the segment's own (a piece) is scanned as
  usual. With ``into`` (buffers of the whole loop's stacked outputs), each
  iteration's outputs are written in place there and returned instead of
  a segment's stack, so the segments' outputs need no joining copy."""
  def scan(step, init, xs, reverse):
    whole = [x.shape[0] == length for x in xs]

    def body(state, slices):
      carry, bufs = state
      i, own = slices[0], iter(slices[1:])
      x = [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) if w else next(own)
           for a, w in zip(xs, whole)]
      carry, ys = step(carry, x)
      if into is None:
        return (carry, bufs), ys
      bufs = [jax.lax.dynamic_update_index_in_dim(b, y, i, 0) for b, y in zip(bufs, ys)]
      return (carry, bufs), []

    index = jnp.arange(start, stop)
    (carry, bufs), ys = jax.lax.scan(body, (init, list(into or [])),
                                     [index] + [a for a, w in zip(xs, whole) if not w],
                                     reverse=reverse)
    return carry, (ys if into is None else bufs)
  return scan


def segmentable(graph: Graph) -> dict[int, tuple[int, ...]]:
  """Forward scan node -> its stacked residuals, for the loops that can run
  in segments (module docstring)."""
  where, found = hostable(graph), {}
  for loop in loops(graph):
    node = graph.nodes[loop.forward]
    backward = [graph.nodes[b] for b in loop.backward]
    if (node.params["reverse"] or not backward
        or not all(b.params["reverse"] for b in backward)
        or not all(s.value in where for s in loop.stacked)):
      continue
    found[loop.forward] = tuple(s.value for s in loop.stacked)
  return found


def segments_of(graph: Graph, plan: Plan, nested: set) -> dict[int, Segmented]:
  """The loops ``plan`` runs in segments: those (not ``nested``) with a
  stack chunked along its layer axis, in two chunks or more. A whole
  decision (keep, recompute, offload) applies to every segment. Raises
  ValueError for what a segmented loop cannot carry out: chunks that do
  not cover the layers once, in order; a layer input rebuilt; any other
  decision on one of its stacks."""
  found = {}
  rebuilt, carries = rebuildable(graph), set()
  for forward, stacks in segmentable(graph).items():
    chunked = {v: plan[v] for v in stacks if plan[v].kind == "chunked" and plan[v].axis == 0
               and len(plan[v].chunks) > 1}
    if not chunked or forward in nested:
      continue
    length = graph.nodes[forward].params["length"]
    for v in stacks:
      d = plan[v]
      if v in chunked:
        _check_layers(v, d.bounds, length)
      elif d.kind not in KINDS:
        raise ValueError(f"value {v}: a stack of a loop run in segments (another stack of "
                         f"it is chunked along its layers) is kept, recomputed or offloaded, "
                         f"whole or by layers; got {d!r}")
    cuts = sorted({edge for d in chunked.values() for bound in d.bounds for edge in bound})
    bounds = tuple(zip(cuts[:-1], cuts[1:]))
    kinds = {}
    for v in stacks:
      d = plan[v]
      kinds[v] = tuple(
          next(c.kind for (a, b), c in zip(d.bounds, d.chunks) if a <= start < b)
          if v in chunked else d.kind for start, _ in bounds)
      if "recompute" in kinds[v] and v not in rebuilt:
        carries.add(v)
    if carries:
      raise ValueError(f"a layer input stacked by a loop (values {sorted(carries)}) is kept "
                       "or offloaded per segment, never rebuilt: rebuilds start from it")
    node = graph.nodes[forward]
    outputs = {v: node.outs.index(v) for v in stacks}
    found[forward] = Segmented(forward, bounds, kinds, outputs)
  return found


def _check_layers(vid: int, bounds: tuple, length: int) -> None:
  """Chunks along a loop's layers must cover ``0..length`` once, in order."""
  edges = [0] + [b for _, b in bounds]
  if [a for a, _ in bounds] != edges[:-1] or edges[-1] != length or any(
      a >= b for a, b in bounds):
    raise ValueError(f"value {vid}: chunks along a loop's layers must cover layers 0 to "
                     f"{length} once, in order; got bounds {bounds}. Pass consecutive "
                     f"(start, stop) pairs from 0 to {length}")


def segmented_forward(graph: Graph, node: Node, op: Op,
                      seg: Segmented) -> tuple[Op, dict, set]:
  """The forward scan's op run in segments, with the sizes of the keys it
  adds and those of them in host memory. Outputs: the final carries; each
  stacked output not handled per segment, joined; each handled one's
  pieces (segment by segment, where it has one); the carries it does not
  stack, per segment that rebuilds."""
  consts, carries, length = scan_shape(node)
  extra = unstacked_carries(node)
  runs = []
  for k, (a, b) in enumerate(seg.bounds):
    dropped = frozenset(o for v, o in seg.outputs.items() if seg.kinds[v][k] == "recompute")
    hosted = frozenset(o for v, o in seg.outputs.items() if seg.kinds[v][k] == "offload")
    runs.append(forward_without(node, dropped, hosted, scan=segment_scan(a, b, length)))
  whole = [o for o in range(carries, len(node.outs)) if node.outs[o] not in seg.kinds]
  outs, sizes, host = list(op.outs[:carries]) + [op.outs[o] for o in whole], {}, set()
  for v, o in seg.outputs.items():
    for k, (a, b) in enumerate(seg.bounds):
      if seg.has_piece(v, k):
        key = seg.piece(v, k)
        outs.append(key)
        sizes[key] = graph.values[v].nbytes * (b - a) // length
        if seg.kinds[v][k] == "offload":
          host.add(key)
  for k, (a, b) in enumerate(seg.bounds):
    if seg.rebuilds(k):
      for c in extra:
        key = (node.outs[c], _CARRY_PIECE - k)
        outs.append(key)
        sizes[key] = graph.values[node.outs[c]].nbytes * (b - a)

  def call(*args):
    const_in, carry, xs = args[:consts], args[consts:consts + carries], args[consts + carries:]
    results = []
    for (a, b), run in zip(seg.bounds, runs):
      out = run(*const_in, *carry, *xs)
      carry = out[:carries]
      results.append(out)
    flat = list(carry) + [jax.lax.concatenate([r[o] for r in results], 0) for o in whole]
    for v, o in seg.outputs.items():
      flat += [results[k][o] for k in range(len(seg.bounds)) if seg.has_piece(v, k)]
    for k, r in enumerate(results):
      if seg.rebuilds(k):
        flat += r[len(node.outs):]
    return flat

  return Op("node", op.node, op.ins, tuple(outs), (call,)), sizes, host


def segmented_backward(graph: Graph, node: Node, op: Op, forward_op: Op,
                       seg: Segmented) -> Op:
  """The backward scan ``node``'s op run in segments, last first: each
  reads its pieces of the forward scan's stacks and rebuilds the rest from
  the forward scan's constants and ``xs`` and its carry pieces; its
  stacked outputs are written in place, segment by segment. Inputs: its own
  (less the stacks), the pieces, then (where a segment rebuilds) the
  forward scan's constants and ``xs`` and each rebuilding segment's carry
  pieces."""
  consts, carries, length = scan_shape(node)
  forward = graph.nodes[seg.forward]
  f_consts, f_carries, _ = scan_shape(forward)
  stack_at = {i: k[0] for i, k in enumerate(op.ins)
              if isinstance(k, tuple) and k[0] in seg.kinds}
  own = [i for i in range(len(op.ins)) if i not in stack_at]
  pieces = [(i, k) for i, v in stack_at.items() for k in range(len(seg.bounds))
            if seg.has_piece(v, k)]
  rebuilding = [k for k in range(len(seg.bounds))
                if any(seg.kinds[v][k] == "recompute" for v in stack_at.values())]
  f_in = ([i for i in range(len(forward.ins)) if not f_consts <= i < f_consts + f_carries]
          if rebuilding else [])
  # Each rebuilding segment's carry-ins: a piece of a carry stack, one the
  # forward op joins whole (read at each iteration's index), or a piece the
  # forward op adds.
  carry_out = carry_outputs(forward)
  carry_keys = {}
  for k in rebuilding:
    for c in range(f_carries):
      if c not in carry_out:
        carry_keys[c, k] = (forward.outs[c], _CARRY_PIECE - k)
      elif forward.outs[carry_out[c]] in seg.kinds:
        carry_keys[c, k] = seg.piece(forward.outs[carry_out[c]], k)
      else:
        carry_keys[c, k] = (forward.outs[carry_out[c]], 0)
  rebuilt = [{i: seg.outputs[v] for i, v in stack_at.items() if seg.kinds[v][k] == "recompute"}
             for k in range(len(seg.bounds))]
  stacked = [graph.values[v].aval for v in node.outs[carries:]]

  def call(*args):
    mine = dict(zip(own, args[:len(own)]))
    got = dict(zip(pieces, args[len(own):len(own) + len(pieces)]))
    rest = args[len(own) + len(pieces):]
    f_vals, carry_vals = dict(zip(f_in, rest[:len(f_in)])), dict(zip(carry_keys, rest[len(f_in):]))
    carry = [mine[i] for i in range(consts, consts + carries)]
    # The stacked outputs, written in place segment by segment.
    ys = [jnp.zeros(a.shape, a.dtype) for a in stacked]
    for k in reversed(range(len(seg.bounds))):
      a, b = seg.bounds[k]
      scan = segment_scan(a, b, length, into=ys)
      ins = [mine.get(i) for i in range(len(op.ins))]
      ins[consts:consts + carries] = carry
      for i in stack_at:
        ins[i] = got.get((i, k))
      if rebuilt[k]:
        f_ins = [f_vals.get(i) for i in range(len(forward.ins))]
        out = backward_rebuilding(node, forward, rebuilt[k], scan=scan)(
            ins, f_ins, [carry_vals[c, k] for c in range(f_carries)])
      else:
        out = fetching(node, scan=scan)(*ins)
      carry, ys = out[:carries], out[carries:]
    return list(carry) + list(ys)

  ins = (tuple(op.ins[i] for i in own) + tuple(seg.piece(stack_at[i], k) for i, k in pieces)
         + tuple(forward_op.ins[i] for i in f_in) + tuple(carry_keys.values()))
  return Op("node", op.node, ins, op.outs, (call, _inside(graph, op, seg, stack_at, carry_keys)))


def _inside(graph: Graph, op: Op, seg: Segmented, stack_at: dict, carry_keys: dict) -> Inside:
  """What the segmented backward op holds while it runs, segment by
  segment in the order they run (last first): each one's body, rebuilding
  or fetching its slices, after the segments before it have read their
  pieces for the last time (a segment of one layer reads its own as XLA
  runs it, inlined)."""
  length = scan_shape(graph.nodes[op.node])[2]
  read = {k: [seg.piece(v, k) for v in stack_at.values() if seg.has_piece(v, k)]
          + [key for (_, j), key in carry_keys.items() if j == k and key[1] != 0]
          for k in range(len(seg.bounds))}
  iterations = []
  for k in reversed(range(len(seg.bounds))):
    kinds = {i: seg.kinds[v][k] for i, v in stack_at.items()}
    rebuilt = tuple(sorted((i, seg.outputs[stack_at[i]]) for i, kind in kinds.items()
                           if kind == "recompute"))
    fetched = sum(graph.values[stack_at[i]].nbytes // length for i, kind in kinds.items()
                  if kind == "offload")
    done = tuple(dict.fromkeys(key for j in range(k + 1, len(seg.bounds))
                               for key in read[j]))
    a, b = seg.bounds[k]
    once = tuple(i for i, kind in kinds.items() if kind == "keep") if b - a == 1 else ()
    iterations.append(Iteration(op.node, seg.forward if rebuilt else None, rebuilt, fetched,
                                done, once))
  return Inside(tuple(iterations))


def added_flops(graph: Graph, seg: Segmented, stacks: set) -> float:
  """FLOPs a backward op that reads ``stacks`` adds rebuilding them: the
  forward body once per layer of each segment where one of them is
  rebuilt."""
  forward = graph.nodes[seg.forward]
  length = scan_shape(forward)[2]
  return forward.flops * sum(b - a for k, (a, b) in enumerate(seg.bounds)
                             if any(seg.kinds[v][k] == "recompute" for v in stacks)) / length
