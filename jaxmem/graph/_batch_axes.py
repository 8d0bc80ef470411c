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

import functools
from typing import Mapping, Sequence

import jax
from jax.extend import core as jex

from jaxmem.graph._axis_rules import INDEXED, RULES, Refuse, Rule
from jaxmem.graph._graph import Graph
from jaxmem.graph._positions import own_columns
from jaxmem.graph._scan_axes import scan_rule
from jaxmem.graph._split import NotSplittable, Split, demanded_values, shape_of, where


def _rule(graph: Graph, node, axes: list, strided: bool) -> Rule:
  if node.prim.name == "scan" and not node.effects:
    return scan_rule(node, axes, functools.partial(_follow, strided=strided), strided)
  rule = RULES.get(node.prim.name)
  if rule is None:
    raise Refuse(f"jaxmem does not know how {node.prim.name} treats examples")
  if node.effects:
    raise Refuse("it has side effects, which would run once per micro-batch")
  shapes = [shape_of(graph, a) for a in node.ins]
  outs = [graph.values[o].aval.shape for o in node.outs]
  if node.prim.name in INDEXED and axes[1] is not None and isinstance(node.ins[1], int):
    return rule(node, axes, shapes, outs, own=own_columns(graph, node.ins[1], axes[1]))
  return rule(node, axes, shapes, outs)


def _follow(graph: Graph, inputs: Mapping[int, int], strided: bool = False
            ) -> tuple[dict, dict]:
  """Every value's example axis and every equation's rule, from ``inputs``
  (value -> its example axis)."""
  axes = dict(inputs)
  rules = {}
  for node in graph.nodes:
    in_axes = [None if isinstance(a, jex.Literal) else axes.get(a) for a in node.ins]
    if all(a is None for a in in_axes):
      continue
    try:
      rule = rules[node.index] = _rule(graph, node, in_axes, strided)
    except Refuse as why:
      raise NotSplittable(f"{where(node)} reads a batch value, and {why}") from None
    axes.update((o, a) for o, a in zip(node.outs, rule.outs) if a is not None)
  return axes, rules


def _cross_example(combiner, reader) -> NotSplittable:
  return NotSplittable(
      f"the examples are reduced by {where(combiner)}, and the result is read "
      f"again per example by {where(reader)}: each micro-batch would see its own "
      "reduction instead of the batch's (BatchNorm in training mode normalizes by "
      "the batch's statistics so). Micro-batching needs a step whose examples meet "
      "only in what it returns: the loss, the metrics and the gradients")


def place(graph: Graph, axes: dict, rules: dict, inputs: tuple, names,
          region: set | None = None, strided: bool = False) -> Split:
  """The equations before, per chunk (``region``: by default every one that
  reads examples) and after, with the demanded values."""
  whole = region is None
  region = set(rules) if whole else region
  made = {o for i in region for o in graph.nodes[i].outs}
  origin = {o: i for i in region
            for o, how in zip(graph.nodes[i].outs, rules[i].output_combines()) if how}
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
  for i in region:
    for position, _ in rules[i].demand:
      vid = graph.nodes[i].ins[position]
      if isinstance(vid, int) and vid in origin:
        raise _cross_example(graph.nodes[origin[vid]], graph.nodes[i])
  demanded = demanded_values(graph, rules, sorted(region), strided)
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


def _split(graph: Graph, groups, names, place, strided: bool) -> Split:
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
      axes, rules = _follow(graph, {v: 0 for v in inputs}, strided)
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
  return _split(graph, groups, names, functools.partial(place, graph, strided=strided),
                strided)


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
  def around_peak(axes, rules, inputs, chosen):
    held = [v for v in near if v in axes]
    if not held:
      raise NotSplittable("none of the values live at the step's peak holds examples")
    seed = max(held, key=lambda v: graph.values[v].nbytes)
    region = _convex(graph, rules, _grown(graph, axes, rules, seed, share))
    if all(i in region for i in rules if graph.nodes[i].backward):
      raise NotSplittable("the region holds the whole backward pass: that is the step "
                          "in micro-batches (split_batch)")
    return place(graph, axes, rules, inputs, chosen, region, strided)
  return _split(graph, groups, names, around_peak, strided)
