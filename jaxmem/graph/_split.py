"""A step split into micro-batches: which equations run once before the
chunks, once per chunk and once after them (:class:`Split`), and how a
value without examples is taken per chunk (:func:`remade`).

``graph._batch_axes`` finds the split of a step; ``graph._scan_axes``
that of a loop's body, which runs per chunk inside the loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from jax.extend import core as jex

from jaxmem.graph._axis_rules import ELEMENTWISE, Rule
from jaxmem.graph._graph import Graph
from jaxmem.graph._random_bits import chunkable


class NotSplittable(ValueError):
  """The step cannot run in micro-batches; the message says why and where."""


@dataclasses.dataclass(frozen=True)
class Split:
  """A step split into micro-batches (how: ``graph._batch_axes``).

  Attributes:
    graph: the step's joint graph.
    inputs: the values holding examples that the chunks read and do not
      make (the step's batch inputs, each along axis 0, where it is whole).
    axes: every value with an example axis -> that axis.
    rules: each equation that runs per chunk -> its :class:`Rule`.
    before, region, after: equations run once before the chunks, once per
      chunk, and once after them, each in step order.
    demanded: ``(value, axis)`` pairs taken per chunk though the value has no
      example axis, each with ``(equation, demands)``: the equation that
      makes it again at the chunk's size and its own demanded inputs; or
      None where it is made once and sliced.
    names: the batch arguments' names, for reports.
    whole: whether every equation reading examples runs per chunk (the step
      in micro-batches), or only a region of them (:func:`split_region`).
    strided: whether chunk ``c`` holds the examples ``c, c + k, ...``
      instead of a block (a batch sharded over devices): a demanded value
      is then made again per chunk only where its example axis keeps its
      extent through every reshape.
    rebuilt: equations of ``before`` also made again per chunk, first, at
      the chunk's size: the forward work whose values the region reads
      (``graph._feature_axes``), so that they are not held until it runs.
  """
  graph: Graph
  inputs: tuple[int, ...]
  axes: Mapping[int, int]
  rules: Mapping[int, Rule]
  before: tuple[int, ...]
  region: tuple[int, ...]
  after: tuple[int, ...]
  demanded: Mapping[tuple[int, int], tuple[int, tuple] | None]
  names: tuple[str, ...] = ()
  whole: bool = True
  strided: bool = False
  rebuilt: tuple[int, ...] = ()

  @property
  def batch(self) -> int:
    """Examples in the step's batch."""
    first = self.inputs[0]
    return self.graph.values[first].aval.shape[self.axes[first]]

  def returned(self) -> tuple[int, ...]:
    """Values with examples made per chunk and read after the chunks (or
    returned by the step): each chunk's part is kept, and they are joined."""
    made = {o for i in self.region for o in self.graph.nodes[i].outs}
    after = set(self.after)
    return tuple(v for v in sorted(made) if v in self.axes and (
        v in self.graph.output_ids or any(u in after for u in self.graph.values[v].uses)))

  def run_before(self) -> tuple[int, ...]:
    """The equations of :attr:`before` whose results are read (by the
    chunks, after them, or returned): one made again per chunk at the
    chunk's size (a dropout mask) and read nowhere else is not made whole."""
    graph = self.graph
    read = set(graph.output_ids)
    read.update(v for (v, _), how in self.demanded.items() if how is None)
    remade = [how for how in self.demanded.values() if how is not None]
    for i, taken in [(i, self.rules[i].demand) for i in self.rebuilt + self.region] + [
        (i, ()) for i in self.after] + remade:
      skip = {p for p, _ in taken}
      read.update(a for p, a in enumerate(graph.nodes[i].ins)
                  if p not in skip and isinstance(a, int))
    kept = []
    for i in reversed(self.before):
      if any(o in read for o in graph.nodes[i].outs):
        kept.append(i)
        read.update(a for a in graph.nodes[i].ins if isinstance(a, int))
    return tuple(reversed(kept))

  def deferred(self) -> tuple[int, ...]:
    """The equations of :meth:`run_before` that are optimizer updates
    (``Node.update``: Adam's decay of its moments) and that nothing per
    chunk needs: they run after the chunks instead, so that what they make
    is not held through them and the update runs whole after the
    gradients."""
    graph, before = self.graph, self.run_before()
    needed = {v for v, _ in self.demanded}
    for i in [*self.rebuilt, *self.region] + [how[0] for how in self.demanded.values() if how]:
      needed.update(a for a in graph.nodes[i].ins if isinstance(a, int))
    early = set()
    for i in reversed(before):
      node = graph.nodes[i]
      if not node.update or any(o in needed for o in node.outs):
        early.add(i)
        needed.update(a for a in node.ins if isinstance(a, int))
    return tuple(i for i in before if i not in early)

  def kept(self) -> tuple[int, ...]:
    """Values without examples made per chunk, none combined, and read after
    the chunks (or returned): a loop's outputs that no example reaches,
    the same in every chunk, so the last chunk's is kept."""
    combined = {self.graph.nodes[i].outs[p] for i, p in self.combined()}
    after = set(self.after)
    return tuple(v for i in self.region for v in self.graph.nodes[i].outs
                 if v not in self.axes and v not in combined and (
                     v in self.graph.output_ids
                     or any(u in after for u in self.graph.values[v].uses)))

  def extents(self) -> list[int]:
    """The extent of every split value's example axis, the loops' bodies'
    included."""
    found = [self.graph.values[v].aval.shape[a] for v, a in self.axes.items()]
    found += [self.graph.values[v].aval.shape[a] for v, a in self.demanded]
    for rule in self.rules.values():
      if rule.body is not None:
        found += rule.body.split.extents()
    return found

  def sizes(self) -> tuple[int, ...]:
    """The numbers of micro-batches every split value divides into."""
    common = math.gcd(*self.extents())
    return tuple(k for k in range(2, common + 1) if common % k == 0)

  def combined(self) -> tuple[tuple[int, int], ...]:
    """``(equation, output position)`` of the results combined across
    chunks."""
    return tuple((i, p) for i in self.region
                 for p, how in enumerate(self.rules[i].output_combines()) if how is not None)


def shape_of(graph: Graph, atom) -> tuple:
  """The shape of ``atom``: a value id of ``graph``, or a literal."""
  return tuple(getattr(atom.aval if isinstance(atom, jex.Literal) else
                       graph.values[atom].aval, "shape", ()))


def where(node) -> str:
  """``node``'s label and, where known, the line of the user's code it came
  from: how messages and reports name an equation."""
  return f"{node.label}" + (f" at {node.source}" if node.source else "")


def _reshape_source(shape, new, axis: int, strided: bool) -> int | None:
  """The axis of a reshape's operand (of ``shape``) whose chunks make its
  output's (of ``new``) chunks along ``axis``: the one after the same
  leading elements, of the same extent, or (blocks only) a multiple or a
  divisor of it."""
  outer = math.prod(new[:axis])
  for b, n in enumerate(shape):
    if math.prod(shape[:b]) == outer and n != 1:
      same = n == new[axis] or not strided and (n % new[axis] == 0 or new[axis] % n == 0)
      return b if same else None
  return None


def remade(graph: Graph, vid: int, axis: int, memo: dict, strided: bool = False):
  """How a demanded value is taken per chunk: ``(equation, demands)`` where
  that equation makes it again at the chunk's size (a broadcast, an
  ``iota``, random bits, a reshape or an elementwise equation of such),
  None where it is sliced."""
  key = (vid, axis)
  if key in memo:
    return memo[key]
  memo[key] = None
  producer = graph.values[vid].producer
  node = None if producer is None else graph.nodes[producer]
  if node is None or node.effects:
    return None
  name, ins = node.prim.name, node.ins
  again = lambda i, a: isinstance(i, int) and remade(graph, i, a, memo, strided)  # noqa: E731
  found = None
  if name == "iota":
    found = (producer, ()) if node.params["dimension"] != axis else None
  elif name == "random_bits":
    found = (producer, ()) if chunkable(graph.values[ins[0]].aval, node.params, axis) else None
  elif name == "reshape" and node.params.get("dimensions") is None:
    source = _reshape_source(shape_of(graph, ins[0]), graph.values[vid].aval.shape, axis,
                             strided)
    if source is not None and again(ins[0], source):
      found = (producer, ((0, source),))
  elif name == "broadcast_in_dim":
    dims = tuple(node.params["broadcast_dimensions"])
    if axis not in dims or shape_of(graph, ins[0])[dims.index(axis)] == 1:
      found = (producer, ())
    elif again(ins[0], dims.index(axis)):
      found = (producer, ((0, dims.index(axis)),))
  elif name in ELEMENTWISE and len(node.outs) == 1:
    demand = tuple((i, axis) for i, a in enumerate(ins)
                   if len(shape_of(graph, a)) > axis and shape_of(graph, a)[axis] != 1)
    found = (producer, demand) if all(again(ins[i], axis) for i, _ in demand) else None
  memo[key] = found
  return found


def demanded_values(graph: Graph, rules: Mapping, region, strided: bool = False) -> dict:
  """The values without examples that the equations of ``region`` (with
  their ``rules``) take per chunk, each with how it is taken
  (:func:`remade`), the demands of those made again followed in turn."""
  demanded, memo = {}, {}
  for i in region:
    stack = [(graph.nodes[i].ins[p], a) for p, a in rules[i].demand
             if isinstance(graph.nodes[i].ins[p], int)]
    while stack:
      key = stack.pop()
      if key not in demanded:
        demanded[key] = remade(graph, *key, memo, strided)
        if demanded[key] is not None:
          ins = graph.nodes[demanded[key][0]].ins
          stack += [(ins[p], a) for p, a in demanded[key][1]]
  return demanded
