"""How a loop treats the examples: a ``scan``'s body split into micro-batches.

A step whose layers run under ``lax.scan`` (Flax's ``nn.scan``) carries its
examples through the loop: the hidden state in a carry, the residuals
stacked in its outputs, each layer's weight gradient reduced over the
examples once per iteration. Run per chunk, the loop is the same loop over
the chunk's examples. :func:`scan_rule` follows the example axis through
the body (the carries to a fixed point) and says how each of the loop's
outputs is had from the chunks':

- an output with examples (a carry, a stacked output) is the chunk's part;
- a stacked output reduced over the examples (a weight gradient per layer)
  adds up across chunks, as do the body's sums, casts and reshapes of such
  reductions;
- a carry that accumulates reductions (the gradient of a weight every
  iteration reads) runs from the running total, chunk after chunk
  (:attr:`Rule.threads`);
- an output no example reaches is the same in every chunk.

It refuses a loop over the example axis, a carry that moves its examples to
another axis, and a body that reads a reduction over the examples for more
than adding it up (a scanned BatchNorm's batch statistics).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> from jaxmem.graph._batch_axes import split_batch
  >>> def step(ws, x):
  ...   def loss(ws):
  ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
  ...     return jnp.sum(h)
  ...   return jax.grad(loss)(ws)
  >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((3, 4, 4)), jnp.ones((8, 4))))
  >>> split = split_batch(g, [(1,)])
  >>> [split.rules[i].output_combines() for i in split.region
  ...  if g.nodes[i].prim.name == "scan"][-1]  # the backward loop: carry, weight gradients
  (None, 'add')
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from jax.extend import core as jex

from jaxmem.graph._axis_rules import ADD, Refuse, Rule
from jaxmem.graph._graph import Graph, build_graph
from jaxmem.graph._split import Split, demanded_values, where

# ``jax.checkpoint`` (``nn.remat``): run in micro-batches, in a step or a
# loop's body, its body is inlined, and the chunks' residuals are planned as
# the step's are.
REMAT = frozenset({"remat2", "checkpoint"})

# Equations linear in their one operand: a reduction over the examples
# passed through them still adds up across chunks.
_SHAPING = frozenset("""convert_element_type reshape transpose squeeze neg copy copy_p
    reduce_sum broadcast_in_dim""".split())
_SUMS = frozenset({"add", "add_any", "sub"})


@dataclasses.dataclass(frozen=True)
class ScanBody:
  """A loop's body as it runs per chunk.

  Attributes:
    split: the body's split: its region runs at the chunk's size, the rest
      of it whole, each iteration, in the body's order.
    taken: body inputs without examples that the loop takes per chunk
      (value -> axis): they arrive already cut.
  """
  split: Split
  taken: Mapping[int, int]


def _axis(axes: Mapping, atom) -> int | None:
  return None if isinstance(atom, jex.Literal) else axes.get(atom)


def _linear(node, how: Mapping[int, str]) -> str | None:
  """The combine of ``node``'s outputs where it is linear in the reductions
  it reads (``how``: value -> combine), else None."""
  read = [a for a in node.ins if isinstance(a, int) and a in how]
  kinds = {how[a] for a in read}
  if len(kinds) != 1:
    return None
  kind, = kinds
  name = node.prim.name
  if name in _SHAPING and len(node.ins) == 1:
    return kind
  if kind != ADD:
    return None
  if name in _SUMS and len(read) == len(node.ins):
    return kind
  # The other factor reads no examples (else a rule would run the equation).
  return kind if name == "mul" and len(read) == 1 else None


def _reductions(body: Graph, rules: Mapping, seeds: Mapping[int, str],
                strict: bool = True) -> dict:
  """Body value -> the combine of the reduction over the examples it holds
  (made by a reduction, or linear in such values); ``seeds`` are taken as
  such. Refuses a body that reads one otherwise (``strict``), or else
  follows every read (what a running total may come from)."""
  how = dict(seeds)
  for node in body.nodes:
    read = [a for a in node.ins if isinstance(a, int) and a in how]
    rule = rules.get(node.index)
    if rule is not None:
      if read and strict:
        raise Refuse(f"its body reads a reduction over the examples at {where(node)} "
                     "per example: each micro-batch would see its own reduction instead "
                     "of the batch's (a BatchNorm in training mode inside the loop "
                     "normalizes by the batch's statistics so)")
      how.update((o, c) for o, c in zip(node.outs, rule.output_combines()) if c)
      continue
    if read:
      kind = _linear(node, how) or (None if strict else how[read[0]])
      if kind is None:
        raise Refuse(f"its body reads a reduction over the examples at {where(node)} "
                     "for more than adding it up: each micro-batch would see its own "
                     "reduction instead of the batch's")
      how.update((o, kind) for o in node.outs)
  return how


def _read_whole(split: Split) -> set:
  """The body's values some equation reads whole (or the body returns)."""
  graph = split.graph
  read = set(graph.output_ids)
  remade_by = [how for how in split.demanded.values() if how is not None]
  for i, demand in [(i, split.rules[i].demand) for i in split.region] + remade_by + [
      (i, ()) for i in split.run_before()]:
    skip = {p for p, _ in demand}
    read.update(a for p, a in enumerate(graph.nodes[i].ins)
                if p not in skip and isinstance(a, int))
  return read


def _reaches(graph: Graph, source: int, target) -> bool:
  """Whether ``target`` (a value or literal) is computed from ``source``."""
  stack, seen = [target], set()
  while stack:
    v = stack.pop()
    if v == source:
      return True
    producer = graph.values[v].producer
    if v in seen or producer is None:
      continue
    seen.add(v)
    stack += [a for a in graph.nodes[producer].ins if isinstance(a, int)]
  return False


def _fixed_point(node, axes: Sequence, body: Graph, follow: Callable, strided: bool):
  """The carries' example axes, the body's axes, rules and demanded values:
  a carry gains the axis its body gives it (or demands of it) until none
  changes."""
  nc, ncar = node.params["num_consts"], node.params["num_carry"]
  xs = [None if a is None else a - 1 for a in axes[nc + ncar:]]
  carry = list(axes[nc:nc + ncar])
  while True:
    inner = [*axes[:nc], *carry, *xs]
    found, rules = follow(body, {v: a for v, a in zip(body.inputs, inner) if a is not None})
    demanded = demanded_values(body, rules, rules, strided)
    outs = [_axis(found, o) for o in body.outputs[:ncar]]
    wanted = {body.inputs.index(v): a for v, a in demanded if v in body.inputs}
    grown = False
    for j in range(ncar):
      axis = outs[j] if outs[j] is not None else wanted.get(nc + j)
      if carry[j] is None and axis is not None:
        carry[j], grown = axis, True
      elif carry[j] is not None and outs[j] != carry[j]:
        raise Refuse("its loop carry moves its examples to another axis")
    if not grown:
      return carry, found, rules, demanded


def scan_rule(node, axes: Sequence, follow: Callable, strided: bool) -> Rule:
  """The :class:`Rule` of a ``scan`` equation whose inputs carry examples on
  ``axes``; ``follow(graph, inputs) -> (axes, rules)`` follows them through
  its body (``graph._batch_axes``)."""
  p = node.params
  nc, ncar = p["num_consts"], p["num_carry"]
  if 0 in axes[nc + ncar:]:
    raise Refuse("it loops over the example axis")
  body = build_graph(p["jaxpr"], inline=REMAT)
  carry, found, rules, demanded = _fixed_point(node, axes, body, follow, strided)
  split = Split(body, tuple(v for v in body.inputs if v in found), found, rules,
                tuple(i for i in range(len(body.nodes)) if i not in rules),
                tuple(sorted(rules)), (), demanded, whole=True, strided=strided)
  carried = body.inputs[nc:nc + ncar]
  reached = _reductions(body, rules, {}, strict=False)
  accumulating = {j for j, o in enumerate(body.outputs[:ncar])
                  if carry[j] is None and reached.get(o) == ADD}
  # The running totals are read as the reductions are.
  how = _reductions(body, rules, {carried[j]: ADD for j in accumulating})
  combines = tuple(how.get(o) if isinstance(o, int) else None for o in body.outputs)
  threads = tuple((j, nc + j) for j in sorted(accumulating)
                  if _reaches(body, carried[j], body.outputs[j]))
  taken = {}
  demand = [(nc + j, carry[j]) for j in range(ncar)
            if carry[j] is not None and axes[nc + j] is None]
  whole = _read_whole(split)
  for (v, a), remake in demanded.items():
    if v in body.inputs and remake is None:
      position = body.inputs.index(v)
      if v in whole:
        raise Refuse("its body reads a value without examples both whole and per example")
      taken[v] = a
      demand.append((position, a + 1 if position >= nc + ncar else a))
  outs = tuple(carry) + tuple(None if _axis(found, o) is None else found[o] + 1
                              for o in body.outputs[ncar:])
  return Rule(outs=outs, demand=tuple(demand), combines=combines, threads=threads,
              body=ScanBody(split, taken))
