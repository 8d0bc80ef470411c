"""Where a step's examples go: the axis each value carries them on, and
how a step splits into micro-batches.

A step whose arguments hold a batch computes, for most of its values, one
slice per example along some axis: the activations, their cotangents, the
per-example losses. Those values split along that axis into ``k`` chunks,
and the equations that make them run once per chunk. What reduces over the
examples (the loss sum, each weight gradient, a ``scatter-add`` into an
embedding's gradient) is *combined*: each chunk's partial result is added
(or maxed) into an accumulator. Everything else runs once, before the
chunks (parameters, constants, random bits) or after them (the optimizer
update reads the combined gradients).

:func:`split_batch` finds this from the joint graph by following the example
axis through each equation (a rule per primitive, :data:`RULES`); it
refuses a step where a value reduced over the examples is read again per
example (BatchNorm in training mode normalizes each example by the batch's
statistics: micro-batches would each see their own). A value that has no
example axis of its own but meets one elementwise (the loss's cotangent
broadcast to the batch, an ``iota`` for a one-hot, a dropout mask) is
*demanded* along it: broadcasts, ``iota``, random bits (a dropout mask's,
drawn per chunk with the numbers drawn whole: ``graph._random_bits``),
reshapes and elementwise equations over them are made again at the chunk's
size, anything else is made once at full size and sliced per chunk, so the
numbers stay the step's own.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> def step(w, x):
  ...   return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w)))(w)
  >>> g = build_graph(jax.make_jaxpr(step)(jnp.eye(4), jnp.ones((8, 4))))
  >>> split = split_batch(g, [(1,)])
  >>> split.batch, split.sizes()
  (8, (2, 4, 8))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Sequence

import jax
from jax.extend import core as jex

from jaxmem.graph._axis_rules import ELEMENTWISE, RULES, Refuse, Rule
from jaxmem.graph._graph import Graph
from jaxmem.graph._random_bits import chunkable


class NotSplittable(ValueError):
  """The step cannot run in micro-batches; the message says why and where."""


@dataclasses.dataclass(frozen=True)
class Split:
  """A step split into micro-batches (see the module docstring).

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
    for i, taken in [(i, self.rules[i].demand) for i in self.region] + [
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

  def sizes(self) -> tuple[int, ...]:
    """The numbers of micro-batches every split value divides into."""
    extents = [self.graph.values[v].aval.shape[a] for v, a in self.axes.items()]
    extents += [self.graph.values[v].aval.shape[a] for v, a in self.demanded]
    common = math.gcd(*extents)
    return tuple(k for k in range(2, common + 1) if common % k == 0)

  def combined(self) -> tuple[int, ...]:
    """The equations whose results are combined across chunks."""
    return tuple(i for i in self.region if self.rules[i].combine is not None)


def shape_of(graph: Graph, atom) -> tuple:
  """The shape of ``atom``: a value id of ``graph``, or a literal."""
  return tuple(getattr(atom.aval if isinstance(atom, jex.Literal) else
                       graph.values[atom].aval, "shape", ()))


def _rule(graph: Graph, node, axes: list) -> Rule:
  rule = RULES.get(node.prim.name)
  if rule is None:
    raise Refuse(f"jaxmem does not know how {node.prim.name} treats examples")
  if node.effects:
    raise Refuse("it has side effects, which would run once per micro-batch")
  shapes = [shape_of(graph, a) for a in node.ins]
  return rule(node, axes, shapes, [graph.values[o].aval.shape for o in node.outs])


def where(node) -> str:
  """``node``'s label and, where known, the line of the user's code it came
  from: how messages and reports name an equation."""
  return f"{node.label}" + (f" at {node.source}" if node.source else "")


def _follow(graph: Graph, inputs: Sequence[int]) -> tuple[dict, dict]:
  """Every value's example axis and every equation's rule, from ``inputs``
  (examples along axis 0)."""
  axes = {v: 0 for v in inputs}
  rules = {}
  for node in graph.nodes:
    in_axes = [None if isinstance(a, jex.Literal) else axes.get(a) for a in node.ins]
    if all(a is None for a in in_axes):
      continue
    try:
      rule = rules[node.index] = _rule(graph, node, in_axes)
    except Refuse as why:
      raise NotSplittable(f"{where(node)} reads a batch value, and {why}") from None
    axes.update((o, a) for o, a in zip(node.outs, rule.outs) if a is not None)
  return axes, rules


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


def _remade(graph: Graph, vid: int, axis: int, memo: dict, strided: bool = False):
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
  again = lambda i, a: isinstance(i, int) and _remade(graph, i, a, memo, strided)  # noqa: E731
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


def _cross_example(combiner, reader) -> NotSplittable:
  return NotSplittable(
      f"the examples are reduced by {where(combiner)}, and the result is read "
      f"again per example by {where(reader)}: each micro-batch would see its own "
      "reduction instead of the batch's (BatchNorm in training mode normalizes by "
      "the batch's statistics so). Micro-batching needs a step whose examples meet "
      "only in what it returns: the loss, the metrics and the gradients")


def _place(graph: Graph, axes: dict, rules: dict, inputs: tuple, names,
           region: set | None = None, strided: bool = False) -> Split:
  """The equations before, per chunk (``region``: by default every one that
  reads examples) and after, with the demanded values."""
  whole = region is None
  region = set(rules) if whole else region
  made = {o for i in region for o in graph.nodes[i].outs}
  origin = {o: i for i in region if rules[i].combine for o in graph.nodes[i].outs}
  after = []
  for node in graph.nodes:
    read = [origin[a] for a in node.ins if isinstance(a, int) and a in origin]
    if node.index in region:
      if read:
        raise _cross_example(graph.nodes[read[0]], node)
      continue
    reads_made = [graph.values[a].producer for a in node.ins if isinstance(a, int) and a in made]
    if read or reads_made:
      after.append(node.index)
      origin.update((o, (read or reads_made)[0]) for o in node.outs)
  demanded: dict = {}
  memo: dict = {}
  for i in region:
    for position, axis in rules[i].demand:
      vid = graph.nodes[i].ins[position]
      if isinstance(vid, jex.Literal):
        continue
      if vid in origin:
        raise _cross_example(graph.nodes[origin[vid]], graph.nodes[i])
      stack = [(vid, axis)]
      while stack:
        key = stack.pop()
        if key not in demanded:
          demanded[key] = _remade(graph, *key, memo, strided)
          if demanded[key] is not None:
            ins = graph.nodes[demanded[key][0]].ins
            stack += [(ins[p], a) for p, a in demanded[key][1]]
  if whole and not any(graph.nodes[i].backward for i in region):
    raise NotSplittable("no part of the backward pass runs per example")
  if not whole:
    inputs = tuple(sorted({a for i in region for a in graph.nodes[i].ins
                           if isinstance(a, int) and a in axes and a not in made}))
    axes = {v: axes[v] for v in (*inputs, *made) if v in axes}
  done = region | set(after)
  return Split(graph, tuple(inputs), axes, {i: rules[i] for i in region},
               tuple(i for i in range(len(graph.nodes)) if i not in done),
               tuple(sorted(region)), tuple(after), demanded, tuple(names), whole, strided)


def _grown(graph: Graph, axes: dict, rules: dict, seed: int, share: float) -> set:
  """The equations that make or read ``seed``, and, in turn, those that make
  or read their values holding examples of at least ``share`` of its bytes."""
  floor = share * graph.values[seed].nbytes
  region, seen, stack = set(), {seed}, [seed]
  while stack:
    value = graph.values[stack.pop()]
    for i in ([] if value.producer is None else [value.producer]) + list(value.uses):
      if i not in rules or i in region:
        continue
      region.add(i)
      for v in (*graph.nodes[i].ins, *graph.nodes[i].outs):
        if isinstance(v, int) and v in axes and v not in seen and graph.values[v].nbytes >= floor:
          seen.add(v)
          stack.append(v)
  return region


def _convex(graph: Graph, rules: dict, region: set) -> set:
  """``region`` with every equation on a path between two of its own added,
  so that it runs as one piece between what comes before and after."""
  while True:
    later, reached = set(), {o for i in region for o in graph.nodes[i].outs}
    for node in graph.nodes:
      if node.index not in region and any(a in reached for a in node.ins if isinstance(a, int)):
        later.add(node.index)
        reached.update(node.outs)
    between, needed = set(), {a for i in region for a in graph.nodes[i].ins if isinstance(a, int)}
    for node in reversed(graph.nodes):
      if node.index not in region and any(o in needed for o in node.outs):
        needed.update(a for a in node.ins if isinstance(a, int))
        if node.index in later:
          between.add(node.index)
    if not between:
      return region
    outside = [i for i in sorted(between) if i not in rules]
    if outside:
      raise NotSplittable(f"{where(graph.nodes[outside[0]])} runs between two parts of the "
                          "region and holds no examples")
    region |= between


def _candidates(graph: Graph, groups: Sequence[Sequence[int]]) -> dict[int, list[int]]:
  """Arguments that may hold a batch, by its size: every leaf an array with
  the same leading dimension, none read by the optimizer update or returned
  as it came."""
  found: dict[int, list[int]] = {}
  for g, positions in enumerate(groups):
    vids = [graph.inputs[p] for p in positions]
    shapes = [graph.values[v].aval.shape for v in vids]
    if not vids or any(not s or s[0] < 2 or s[0] != shapes[0][0] for s in shapes):
      continue
    if any(jax.dtypes.issubdtype(graph.values[v].aval.dtype, jax.dtypes.extended)
           or v in graph.output_ids or any(graph.nodes[u].update for u in graph.values[v].uses)
           for v in vids):
      continue
    found.setdefault(shapes[0][0], []).append(g)
  return found


def _split(graph: Graph, groups, names, place) -> Split:
  """``place(axes, rules, inputs, names)`` for the first batch (of the
  arguments' candidates, the largest first) whose examples can be followed
  through the step; :class:`NotSplittable` says why none can."""
  found = _candidates(graph, groups)
  if not found:
    raise NotSplittable("no argument holds a batch: micro-batching splits the "
                        "arguments whose every leaf has the same leading dimension")
  order = sorted(found, key=lambda n: -sum(graph.values[graph.inputs[p]].nbytes
                                           for g in found[n] for p in groups[g]))
  reasons = []
  for size in order:
    chosen = found[size]
    inputs = tuple(graph.inputs[p] for g in chosen for p in groups[g])
    try:
      axes, rules = _follow(graph, inputs)
      return place(axes, rules, inputs, [names[g] for g in chosen if g < len(names)])
    except NotSplittable as why:
      reasons.append(str(why))
  raise NotSplittable(reasons[0])


def split_batch(graph: Graph, groups: Sequence[Sequence[int]],
                names: Sequence[str] = (), strided: bool = False) -> Split:
  """The step split into micro-batches along the batch its arguments hold.

  ``groups`` holds each argument's leaf positions among the step's inputs
  (``names`` its name, for reports). The batch is the arguments whose
  leaves all share one leading dimension, where following that axis through
  the step works (several sizes are each tried, the largest arguments
  first); :class:`NotSplittable` says why none does. ``strided``: chunks
  of examples ``c, c + k, ...`` (:attr:`Split.strided`).
  """
  return _split(graph, groups, names, functools.partial(_place, graph, strided=strided))


def split_region(graph: Graph, groups: Sequence[Sequence[int]], near: Sequence[int],
                 names: Sequence[str] = (), share: float = 0.25,
                 strided: bool = False) -> Split:
  """The region of the step around its largest value holding examples among
  ``near`` (the values live at its peak), split along the batch's axis.

  The region is the equations that make or read that value and, in turn,
  those that make or read values with examples of at least ``share`` of its
  bytes, closed so that it runs as one piece: a softmax cross-entropy over a
  large vocabulary, its logits' matmul and their gradients, where the
  hidden states and their gradient are much smaller. Only the region runs
  per chunk; the rest of the step runs whole, so reductions over the
  examples elsewhere (BatchNorm) stay as they are. A region that holds the
  whole backward pass is refused: that is :func:`split_batch`'s split.
  """
  def place(axes, rules, inputs, chosen):
    held = [v for v in near if v in axes]
    if not held:
      raise NotSplittable("none of the values live at the step's peak holds examples")
    seed = max(held, key=lambda v: graph.values[v].nbytes)
    region = _convex(graph, rules, _grown(graph, axes, rules, seed, share))
    if all(i in region for i in rules if graph.nodes[i].backward):
      raise NotSplittable("the region holds the whole backward pass: that is the step "
                          "in micro-batches (split_batch)")
    return _place(graph, axes, rules, inputs, chosen, region, strided)
  return _split(graph, groups, names, place)
