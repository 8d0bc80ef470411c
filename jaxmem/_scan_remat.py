"""Recomputation inside a loop: stacked residuals rebuilt per iteration of the
backward scan.

A forward scan emits each residual of its body stacked as ``[L, ...]``; the
backward scan reads slice ``i`` in its iteration ``i`` (``_loops``). To drop
such a stacked output, the forward scan is re-emitted without it, and the
backward scan's body first runs the forward body for its iteration — from
the forward scan's constants, its ``xs`` slice and the carry slice it kept
— and reads the dropped slice from that. This is what ``jax.checkpoint``
around a scan body does, decided after differentiation and per residual:
the stack's bytes go, one iteration's forward work is added per backward
iteration, and the program stays a scan (its size does not grow with L).

A stacked output can be rebuilt when every carry of the forward body is
itself kept stacked (the body's carry-in is a residual of most layers: a
matmul's input) and the backward scans read it only as a per-iteration
``xs`` slice (:func:`rebuildable`). Random keys are values in JAX, so a
rebuilt dropout mask is the forward one, bit for bit.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem._graph import build_graph
  >>> def step(ws, x):
  ...   def loss(ws):
  ...     h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, ws)
  ...     return jnp.sum(h)
  ...   return jax.grad(loss)(ws)
  >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((8, 4, 4)), jnp.ones((2, 4))))
  >>> [g.values[v].aval.shape for v in sorted(rebuildable(g))]  # tanh, 1 - tanh
  [(8, 2, 4), (8, 2, 4)]
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
from jax.extend import core as jex

from jaxmem._decisions import Plan
from jaxmem._graph import Graph, Node, analysis
from jaxmem._loops import loops
from jaxmem._schedule import Op, Schedule


def _scan_shape(node: Node) -> tuple[int, int, int]:
  p = node.params
  return p["num_consts"], p["num_carry"], p["length"]


def _carry_outputs(node: Node) -> dict[int, int] | None:
  """Carry position -> the forward scan's output that stacks the body's
  carry-in, for every carry; None where some carry is not stacked."""
  consts, carries, _ = _scan_shape(node)
  body = node.params["jaxpr"].jaxpr
  found = {}
  for out, var in enumerate(body.outvars):
    if out < carries or isinstance(var, jex.Literal):
      continue
    for c in range(carries):
      if var is body.invars[consts + c]:
        found.setdefault(c, out)
  return found if len(found) == carries else None


def _xs_position(node: Node, position: int) -> bool:
  consts, carries, _ = _scan_shape(node)
  return position >= consts + carries


@analysis
def rebuildable(graph: Graph) -> dict[int, tuple[int, int]]:
  """Stacked residual value id -> (forward scan node, output position), for
  those that can be rebuilt in their backward scans (module docstring):
  not a carry slice, every carry kept stacked, read only by backward scans
  as ``xs``, once per scan."""
  found = {}
  for loop in loops(graph):
    forward = graph.nodes[loop.forward]
    carries = _carry_outputs(forward)
    if carries is None or forward.params.get("unroll", 1) not in (1, True, False):
      continue
    keep = set(carries.values())
    for stacked in loop.stacked:
      value = graph.values[stacked.value]
      readers = [graph.nodes[u] for u in value.uses]
      if (stacked.output in keep or not readers
          or any(r.prim.name != "scan" or not r.backward
                 or r.params["length"] != forward.params["length"]
                 or r.ins.count(stacked.value) != 1
                 or not _xs_position(r, r.ins.index(stacked.value)) for r in readers)):
        continue
      found[stacked.value] = (forward.index, stacked.output)
  return found


def forward_without(node: Node, dropped: frozenset[int]) -> Callable:
  """The forward scan without the stacked outputs at ``dropped``:
  ``run(*ins) -> outs`` with None where an output is dropped."""
  consts, carries, length = _scan_shape(node)
  body = jex.jaxpr_as_fun(node.params["jaxpr"])
  kept = [o for o in range(len(node.outs)) if o >= carries and o not in dropped]

  def run(*ins):
    const_in, carry_in, xs = ins[:consts], ins[consts:consts + carries], ins[consts + carries:]

    def step(carry, x):
      outs = body(*const_in, *carry, *x)
      return list(outs[:carries]), [outs[o] for o in kept]

    carry, ys = jax.lax.scan(step, list(carry_in), list(xs), length=length,
                             reverse=node.params["reverse"])
    out = list(carry) + [None] * (len(node.outs) - carries)
    for o, y in zip(kept, ys):
      out[o] = y
    return out

  return run


def backward_rebuilding(node: Node, forward: Node, rebuilt: dict[int, int]) -> Callable:
  """The backward scan ``node`` with some of its ``xs`` rebuilt per
  iteration: ``rebuilt`` maps an input position of ``node`` to the forward
  scan's output position that made it. ``run(ins, forward_ins,
  forward_outs) -> outs``, where ``ins`` has None at the rebuilt positions
  and ``forward_outs`` holds at least the stacked carries."""
  consts, carries, length = _scan_shape(node)
  f_consts, f_carries, _ = _scan_shape(forward)
  body = jex.jaxpr_as_fun(node.params["jaxpr"])
  f_body = jex.jaxpr_as_fun(forward.params["jaxpr"])
  carry_outs = _carry_outputs(forward)
  xs_positions = [i for i in range(consts + carries, len(node.ins)) if i not in rebuilt]

  def run(ins: Sequence, forward_ins: Sequence, forward_outs: Sequence):
    b_consts, b_carry = ins[:consts], ins[consts:consts + carries]
    f_const_in = forward_ins[:f_consts]
    f_xs = list(forward_ins[f_consts + f_carries:])
    f_carry_stacks = [forward_outs[carry_outs[c]] for c in range(f_carries)]
    n_xs, n_fxs = len(xs_positions), len(f_xs)

    def step(carry, x):
      own, fx, fcarry = x[:n_xs], x[n_xs:n_xs + n_fxs], x[n_xs + n_fxs:]
      f_outs = f_body(*f_const_in, *fcarry, *fx)
      full = dict(zip(xs_positions, own))
      full.update({i: f_outs[o] for i, o in rebuilt.items()})
      outs = body(*b_consts, *carry, *(full[i] for i in range(consts + carries, len(ins))))
      return list(outs[:carries]), list(outs[carries:])

    xs = [ins[i] for i in xs_positions] + f_xs + f_carry_stacks
    carry, ys = jax.lax.scan(step, list(b_carry), xs, length=length,
                             reverse=node.params["reverse"])
    return list(carry) + list(ys)

  return run


def split_plan(graph: Graph, plan: Plan) -> tuple[Plan, frozenset[int]]:
  """``plan`` without its recomputations of stacked residuals that are
  rebuilt inside their loops, and those values."""
  looped = plan.values_with("recompute") & rebuildable(graph).keys()
  if not looped:
    return plan, frozenset()
  return Plan.of({v: d for v, d in plan.items if v not in looped}), frozenset(looped)


def rebuild_in_loops(schedule: Schedule, looped: frozenset[int], plan: Plan) -> Schedule:
  """The schedule with ``looped`` (stacked residuals) no longer made by their
  forward scans but rebuilt inside the backward scans that read them: the
  forward scan's op makes fewer outputs, each backward scan's op reads the
  forward scan's constants, ``xs`` and stacked carries instead, and both run
  re-emitted scans (``Op.params``); barrier copies of dropped values go."""
  graph = schedule.graph
  where = {vid: rebuildable(graph)[vid] for vid in looped}
  dropped_at: dict[int, dict[int, int]] = {}
  for vid, (forward, output) in where.items():
    dropped_at.setdefault(forward, {})[vid] = output
  forward_ops, ops, flops = {}, [], schedule.recompute_flops
  for op in schedule.ops:
    gone = [i for i, k in enumerate(op.ins) if isinstance(k, tuple) and k[0] in looped]
    if op.node is None and gone:  # a barrier copy of a dropped value
      live = [i for i in range(len(op.ins)) if i not in gone]
      if live:
        ops.append(Op(op.kind, None, tuple(op.ins[i] for i in live),
                      tuple(op.outs[i] for i in live), op.params))
      continue
    if op.kind == "node" and op.node in dropped_at:
      forward_ops[op.node] = op
      ops.append(_forward_op(graph.nodes[op.node], op, dropped_at[op.node]))
    elif op.kind == "node" and gone:
      node = graph.nodes[op.node]
      forward = where[op.ins[gone[0]][0]][0]
      ops.append(_backward_op(graph, node, op, forward_ops[forward], gone, where))
      flops += graph.nodes[forward].flops
    else:
      ops.append(op)
  return dataclasses.replace(schedule, plan=plan, ops=ops, recompute_flops=flops)


def _forward_op(node: Node, op: Op, dropped: dict[int, int]) -> Op:
  run = forward_without(node, frozenset(dropped.values()))
  keep = [i for i, vid in enumerate(node.outs) if vid not in dropped]
  return Op("node", op.node, op.ins, tuple(op.outs[i] for i in keep),
            (lambda *args: [run(*args)[i] for i in keep],))


def _backward_op(graph: Graph, node: Node, op: Op, forward_op: Op, gone: list[int],
                 where: dict) -> Op:
  """The backward scan's op: its own inputs less the dropped slices, then
  the forward scan's constants and ``xs``, then its stacked carries."""
  forward = graph.nodes[forward_op.node]
  f_consts, f_carries, _ = _scan_shape(forward)
  carry_outs = _carry_outputs(forward)
  rebuilt = {i: where[op.ins[i][0]][1] for i in gone}
  own = [i for i in range(len(op.ins)) if i not in rebuilt]
  f_in = [i for i in range(len(forward.ins)) if not f_consts <= i < f_consts + f_carries]
  stacks = [carry_outs[c] for c in range(f_carries)]
  out_key = dict(zip(forward.outs, forward_op.outs))
  stack_keys = [out_key[forward.outs[o]] for o in stacks]
  run = backward_rebuilding(node, forward, rebuilt)

  def call(*args):
    ins = [None] * len(op.ins)
    for i, a in zip(own, args):
      ins[i] = a
    forward_ins = [None] * len(forward.ins)
    for i, a in zip(f_in, args[len(own):]):
      forward_ins[i] = a
    forward_outs = dict(zip(stacks, args[len(own) + len(f_in):]))
    return run(ins, forward_ins, forward_outs)

  ins = (tuple(op.ins[i] for i in own) + tuple(forward_op.ins[i] for i in f_in)
         + tuple(stack_keys))
  return Op("node", op.node, ins, op.outs, (call,))
