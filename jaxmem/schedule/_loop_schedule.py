"""A plan's decisions on stacked residuals, applied inside their loops.

The schedule builder (``_schedule``) treats a scan as one equation, so a
stacked residual (``[L, ...]``, ``_loops``) dropped or offloaded there would
be handled whole: rebuilt by re-running the whole forward scan, or copied to
the host after the forward scan has stacked all of it on the device. Where
a stacked residual is read one slice per backward iteration, this pass
rewrites the schedule's scans instead (the re-emitted scans are
``_scan_remat``'s):

* a recomputed one is not made by its forward scan but rebuilt per
  iteration inside the backward scans (or the loop runs nested in groups
  of about sqrt(L) layers: :func:`~jaxmem.schedule._scan_remat.nestable`);
* an offloaded one is stacked in host memory one slice per iteration and
  copied back one slice per backward iteration
  (:func:`~jaxmem.schedule._scan_remat.hostable`): its key is in
  ``Schedule.hosted`` and the memory model counts it on the host.

Each backward scan rewritten says what it holds while it runs
(:class:`~jaxmem.schedule._scan_remat.Inside`: the body it runs per
iteration, with the slices it rebuilds or fetches), so the memory model
sizes its body there.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> from jaxmem._decisions import OFFLOAD, Plan
  >>> layers = lambda ws, x: jax.lax.scan(lambda h, w: (jnp.sin(h @ w), None), x, ws)[0]
  >>> step = jax.grad(lambda ws, x: jnp.sum(layers(ws, x)))
  >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((6, 4, 4)), jnp.ones((2, 4))))
  >>> inner, in_loops = split_plan(g, Plan.of({v: OFFLOAD for v in hostable(g)}))
  >>> len(inner), sorted(g.values[v].aval.shape for v in in_loops.hosted)
  (0, [(6, 2, 4), (6, 2, 4)])
"""

from __future__ import annotations

import dataclasses

from jaxmem._decisions import Plan
from jaxmem.graph._graph import Graph, Node
from jaxmem.schedule._loop_segments import (added_flops, segmented_backward,
                                            segmented_forward, segments_of)
from jaxmem.graph._loops import loops
from jaxmem.schedule._scan_remat import (Inside, Iteration, backward_nested,
                                         backward_rebuilding, carry_outputs,
                                fetching, forward_nested, forward_without, group_size,
                                hostable, nestable, rebuildable, scan_shape,
                                unstacked_carries)
from jaxmem.schedule._schedule import Op, Schedule


@dataclasses.dataclass(frozen=True)
class InLoops:
  """Stacked residuals whose decision is carried out inside their loops.

  Attributes:
    rebuilt: recomputed per iteration (or, their loop nested, per group).
    hosted: offloaded one slice per iteration.
    segmented: forward scan node -> its loop run in segments
      (:class:`~jaxmem.schedule._loop_segments.Segmented`).
    nested: the forward scan nodes of the loops run nested (a carry stack
      among ``rebuilt``): all their stacks are dropped.
  """
  rebuilt: frozenset = frozenset()
  hosted: frozenset = frozenset()
  segmented: dict = dataclasses.field(default_factory=dict)
  nested: frozenset = frozenset()

  def __bool__(self) -> bool:
    return bool(self.rebuilt or self.hosted or self.segmented)

  @property
  def in_segments(self) -> frozenset:
    """The stacks of the loops run in segments."""
    return frozenset(v for seg in self.segmented.values() for v in seg.kinds)


def split_plan(graph: Graph, plan: Plan) -> tuple[Plan, InLoops]:
  """``plan`` without its decisions on stacked residuals that are carried
  out inside their loops, and those values. A nested loop drops all its
  stacks, so an offload among them is a rebuild too. A stack chunked along
  its layer axis runs its loop in segments (``_loop_segments``); a chunk
  rebuilt anywhere else raises ValueError. A single chunk is its decision
  whole."""
  plan = Plan.of({v: d.chunks[0] if d.kind == "chunked" and len(d.chunks) == 1 else d
                  for v, d in plan.items})
  rebuilt = plan.values_with("recompute") & (rebuildable(graph).keys() | nestable(graph).keys())
  nested = {nestable(graph)[v][0] for v in rebuilt if v in nestable(graph)}
  in_nested = {s.value for loop in loops(graph) if loop.forward in nested
               for s in loop.stacked}
  segmented = segments_of(graph, plan, nested)
  in_segments = {v for seg in segmented.values() for v in seg.kinds}
  rebuilt -= in_segments
  hosted = {v for v in plan.values_with("offload") & hostable(graph).keys()
            if v not in in_nested} - in_segments
  moved = rebuilt | hosted | in_segments | (in_nested & (
      plan.values_with("offload") | plan.values_with("chunked")))
  for vid, d in plan.with_kind("chunked").items():
    if vid not in moved and any(c.kind == "recompute" for c in d.chunks):
      raise ValueError(
          f"value {vid}: chunks are rebuilt only along the layers of a loop that can run "
          "in segments (a forward lax.scan whose stacks only backward scans in reverse "
          f"read, one slice per iteration); this value is not such a stack. Got {d!r}; "
          "recompute it whole, or keep and offload its chunks")
  if not moved:
    return plan, InLoops()
  return (Plan.of({v: d for v, d in plan.items if v not in moved}),
          InLoops(frozenset(rebuilt), frozenset(hosted), segmented, frozenset(nested)))


def apply_in_loops(schedule: Schedule, in_loops: InLoops, plan: Plan) -> Schedule:
  """The schedule with ``in_loops`` carried out (module docstring). A
  rebuilt stack is not made by its forward scan: each backward scan
  that reads it reads the forward scan's constants and ``xs`` and its
  stacked (or, nested, its groups' first) carries instead. A hosted stack
  is made in host memory and read through a copy per iteration. Barrier
  copies of either go (the backward scan reads the forward scan's own)."""
  graph = schedule.graph
  where = {**rebuildable(graph), **nestable(graph)}
  nested = in_loops.nested
  looped = in_loops.rebuilt | {s.value for loop in loops(graph) if loop.forward in nested
                               for s in loop.stacked}
  hosted = in_loops.hosted
  segmented, in_segments, host_keys = in_loops.segmented, in_loops.in_segments, set()
  where_seg = {v: f for f, seg in segmented.items() for v in seg.kinds}
  changed_at: dict[int, dict[int, int]] = {}
  for vid in looped | hosted:
    forward, output = where.get(vid) or hostable(graph)[vid]
    changed_at.setdefault(forward, {})[vid] = output
  forward_ops, ops, flops, sizes = {}, [], schedule.recompute_flops, dict(schedule.sizes)
  gone_from_barriers = looped | hosted | in_segments
  for op in schedule.ops:
    if op.node is None and any(_of(k) in gone_from_barriers for k in op.ins):
      live = [i for i, k in enumerate(op.ins) if _of(k) not in gone_from_barriers]
      if live:  # a barrier copy of values rebuilt or hosted drops them
        ops.append(Op(op.kind, None, tuple(op.ins[i] for i in live),
                      tuple(op.outs[i] for i in live), op.params))
      continue
    if op.kind != "node":
      ops.append(op)
      continue
    if op.node in segmented:
      new, made, host = segmented_forward(graph, graph.nodes[op.node], op,
                                            segmented[op.node])
      forward_ops[op.node] = new
      sizes.update(made)
      host_keys |= host
      ops.append(new)
      continue
    seg = next((segmented[where_seg[_of(k)]] for k in op.ins if _of(k) in where_seg), None)
    if seg is not None:
      node = graph.nodes[op.node]
      stacks = {_of(k) for k in op.ins if _of(k) in seg.kinds}
      new = segmented_backward(graph, node, op, forward_ops[seg.forward], seg)
      flops += added_flops(graph, seg, stacks)
      ops.append(new)
      continue
    if op.node in changed_at:
      node = graph.nodes[op.node]
      group = group_size(node.params["length"]) if op.node in nested else None
      forward_ops[op.node] = new = _forward_op(node, op, changed_at[op.node], looped,
                                               group)
      length = node.params["length"]
      sizes.update({k: graph.values[k[0]].nbytes * length // (group or 1)
                    for k in new.outs if k[1] in (_START, _STACK)})
      ops.append(new)
      continue
    # A hosted stack is read as its forward scan made it (version 0).
    op = dataclasses.replace(op, ins=tuple((k[0], 0) if _of(k) in hosted else k
                                           for k in op.ins))
    gone = [i for i, k in enumerate(op.ins) if _of(k) in looped]
    fetched = [i for i, k in enumerate(op.ins) if _of(k) in hosted]
    if not gone and not fetched:
      ops.append(op)
      continue
    node, group = graph.nodes[op.node], None
    if gone:
      forward = where[op.ins[gone[0]][0]][0]
      group = group_size(graph.nodes[forward].params["length"]) if forward in nested else None
      new = _backward_op(graph, node, op, forward_ops[forward], gone, where, group)
      flops += graph.nodes[forward].flops
    else:
      new = Op("node", op.node, op.ins, op.outs, (fetching(node),))
    ops.append(dataclasses.replace(
        new, params=new.params + (_inside(graph, new, op, gone, where, hosted, group),)))
  return dataclasses.replace(schedule, plan=plan, ops=ops, recompute_flops=flops, sizes=sizes,
                             hosted=frozenset({(v, 0) for v in hosted} | host_keys))


def _of(key) -> int | None:
  """The value id of a key (None for a literal)."""
  return key[0] if isinstance(key, tuple) else None


def _inside(graph: Graph, new: Op, op: Op, gone: list, where: dict, hosted,
            group: int | None) -> Inside:
  """What a rewritten backward scan holds while it runs: its body with
  the slices it rebuilds (a nested loop: a group's of them beside) and
  those it copies back from host memory (one iteration's)."""
  length = graph.nodes[op.node].params["length"]
  fetched = sum(graph.values[v].nbytes // length
                for v in {_of(k) for k in new.ins if _of(k) in hosted})
  if group is not None:
    return Inside((Iteration(op.node, fetched=fetched),),
                  group * sum(graph.values[op.ins[i][0]].nbytes // length for i in gone))
  if not gone:
    return Inside((Iteration(op.node, fetched=fetched),))
  rebuilt = tuple(sorted((i, where[op.ins[i][0]][1]) for i in gone))
  return Inside((Iteration(op.node, where[op.ins[gone[0]][0]][0], rebuilt, fetched),))


# Copy indices of the keys the rewrite adds. A re-emitted forward scan's are
# keyed by the scan's final carry (a value of the graph: the key names its
# carry).
_START = -1  # a nested loop's group-start carries
_STACK = -3  # a carry-in the forward scan did not stack, stacked to rebuild from
# A loop run in segments adds versions -100 - k and -200 - k for segment k
# (``_loop_segments``): apart from these, and keyed by the stacks' own ids.


def _forward_op(node: Node, op: Op, changed: dict[int, int], looped, group: int | None) -> Op:
  """The forward scan's op: its kept outputs (those hosted made in host
  memory), then (nested) its groups' start carries."""
  dropped = {vid: o for vid, o in changed.items() if vid in looped}
  hosted = frozenset(o for vid, o in changed.items() if vid not in looped)
  keep = [i for i, vid in enumerate(node.outs) if vid not in dropped]
  outs = tuple(op.outs[i] for i in keep)
  if group is None:
    run = forward_without(node, frozenset(dropped.values()), hosted)
    starts = tuple((node.outs[c], _STACK) for c in unstacked_carries(node) if dropped)
  else:
    run = forward_nested(node, frozenset(dropped.values()), group)
    starts = tuple((node.outs[c], _START) for c in range(scan_shape(node)[1]))
  n = len(node.outs)

  def call(*args):
    out = run(*args)
    return [out[i] for i in keep] + list(out[n:])

  return Op("node", op.node, op.ins, outs + starts, (call,))


def _backward_op(graph: Graph, node: Node, op: Op, forward_op: Op, gone: list[int],
                 where: dict, group: int | None) -> Op:
  """The backward scan's op: its own inputs less the dropped slices, then
  the forward scan's constants and ``xs``, then its stacked carries (its
  group-start carries, nested)."""
  forward = graph.nodes[forward_op.node]
  f_consts, f_carries, _ = scan_shape(forward)
  carry_outs = carry_outputs(forward)
  rebuilt = {i: where[op.ins[i][0]][1] for i in gone}
  own = [i for i in range(len(op.ins)) if i not in rebuilt]
  f_in = [i for i in range(len(forward.ins)) if not f_consts <= i < f_consts + f_carries]
  if group is None:
    out_key = {k[0]: k for k in forward_op.outs}  # its kept outputs, by value id
    tail = [out_key[forward.outs[carry_outs[c]]] if c in carry_outs
            else (forward.outs[c], _STACK) for c in range(f_carries)]
    run = backward_rebuilding(node, forward, rebuilt)
  else:
    tail = [k for k in forward_op.outs if k[1] == _START]
    run = backward_nested(node, forward, rebuilt, group)

  def call(*args):
    ins = [None] * len(op.ins)
    for i, a in zip(own, args):
      ins[i] = a
    forward_ins = [None] * len(forward.ins)
    for i, a in zip(f_in, args[len(own):]):
      forward_ins[i] = a
    return run(ins, forward_ins, args[len(own) + len(f_in):])

  ins = (tuple(op.ins[i] for i in own) + tuple(forward_op.ins[i] for i in f_in)
         + tuple(tail))
  return Op("node", op.node, ins, op.outs, (call,))
