"""A layer's features in chunks: the backward pass of the work between two
convolutions (or matmuls) run over chunks of the features the first makes.

BatchNorm in training mode reduces every feature over the batch, so a step
with it does not run in micro-batches; but it never reduces across the
features. Between a layer that makes features (``h = conv(x, W1)``: the
kernel's output axis) and the one that contracts them (``conv(r, W2)``:
``W2``'s input axis), every equation works feature by feature: the
normalization, its scale and bias, the activation. The backward pass of that
stretch (the second layer's input gradient, the normalization's and the
activation's gradients, the first layer's input gradient, the kernels' and
the scale's gradients) then runs over ``k`` chunks of those features, in a
``lax.scan``:

- each chunk makes its part of the forward values that pass reads again
  from the layer's input (read whole) and its part of the parameters
  (:attr:`~jaxmem.graph._split.Split.rebuilt`), so those values are no
  longer held from the forward pass to the backward one;
- the gradients of the parameters are made a part per chunk and joined;
- the first layer's input gradient, a contraction over the features, adds
  each chunk's part into a running total.

The working set of that backward pass falls to about a ``k``-th, the
stretch's forward work runs twice, and the numbers are the step's own up to
the order of the sums.

:func:`split_features` finds the stretch from the joint graph by following
the first kernel's output axis through the step with the rules of
``graph._axis_rules`` (where a rule refuses, the axis stops), and then each
parameter its equations take along that axis (the scale, the bias, the next
kernel's input axis) in turn, until none is new.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> def step(w1, w2, x):
  ...   def loss(ws):
  ...     h = jax.nn.relu(x @ ws[0])
  ...     h = (h - h.mean(0)) / (h.std(0) + 1.0)  # normalized over the batch
  ...     return jnp.sum((h @ ws[1]) ** 2)
  ...   return jax.grad(loss)((w1, w2))
  >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 8)), jnp.ones((8, 4)), jnp.ones((2, 4))))
  >>> [g.nodes[i].prim.name for i in feature_layers(g)]
  ['dot_general', 'dot_general']
  >>> split = split_features(g, feature_layers(g)[0])
  >>> split.batch, split.sizes()  # the first layer's 8 features
  (8, (2, 4, 8))
"""

from __future__ import annotations

import dataclasses

from jax.extend import core as jex

from jaxmem.graph._axis_rules import RULES, Refuse
from jaxmem.graph._batch_axes import place
from jaxmem.graph._graph import Graph
from jaxmem.graph._split import NotSplittable, Split, demanded_values, shape_of, where

# Equations that give a parameter another shape or type as a layer reads it.
_VIEWS = frozenset({"convert_element_type", "reshape", "transpose", "broadcast_in_dim",
                    "squeeze", "rev", "copy", "copy_p"})

# How many times the parameters taken along the axis are followed anew.
_ROUNDS = 8


def _parameter(graph: Graph, vid: int) -> bool:
  """Whether ``vid`` is a step input or constant, or one as a forward equation
  reads it (cast, reshaped, transposed, broadcast)."""
  while True:
    producer = graph.values[vid].producer
    if producer is None:
      return True
    node = graph.nodes[producer]
    ins = [a for a in node.ins if isinstance(a, int)]
    if node.backward or node.prim.name not in _VIEWS or len(ins) != 1:
      return False
    vid = ins[0]


def kernel_axis(graph: Graph, node) -> int | None:
  """The axis of ``node``'s kernel (its second operand, a parameter) along
  which it makes its output features, or None where it is no such layer."""
  if node.backward or len(node.ins) < 2 or not isinstance(node.ins[1], int):
    return None
  if not _parameter(graph, node.ins[1]):
    return None
  if node.prim.name == "conv_general_dilated":
    groups = (node.params["feature_group_count"], node.params["batch_group_count"])
    return node.params["dimension_numbers"].rhs_spec[0] if groups == (1, 1) else None
  if node.prim.name == "dot_general":
    (_, rc), (_, rb) = node.params["dimension_numbers"]
    free = [d for d in range(len(shape_of(graph, node.ins[1]))) if d not in rc and d not in rb]
    return free[0] if len(free) == 1 else None
  return None


def feature_layers(graph: Graph) -> list[int]:
  """The forward convolutions and matmuls whose kernel is a parameter with
  one axis of output features: where :func:`split_features` may start."""
  return [n.index for n in graph.nodes if kernel_axis(graph, n) is not None]


def _within(node, scope: str) -> bool:
  return not scope or node.readable == scope or node.readable.startswith(scope + "/")


def _follow(graph: Graph, seeds: dict, scope: str) -> tuple[dict, dict]:
  """Every value's feature axis and every equation's rule, from ``seeds``
  (value -> axis), inside the module ``scope`` (all: ``""``); an equation
  whose rule refuses stops the axis, as does the scope's edge."""
  axes, rules = dict(seeds), {}
  for node in graph.nodes:
    in_axes = [None if isinstance(a, jex.Literal) else axes.get(a) for a in node.ins]
    rule = RULES.get(node.prim.name)
    if (all(a is None for a in in_axes) or rule is None or node.effects
        or not _within(node, scope)):
      continue
    try:
      rules[node.index] = rule(node, in_axes, [shape_of(graph, a) for a in node.ins],
                               [graph.values[o].aval.shape for o in node.outs])
    except Refuse:
      continue
    axes.update((o, a) for o, a in zip(node.outs, rules[node.index].outs) if a is not None)
  return axes, rules


def _rebuilt(graph: Graph, axes: dict, rules: dict, region: set) -> tuple[int, ...]:
  """The forward equations that make, along the axis, what ``region`` reads."""
  made = {o for i in region for o in graph.nodes[i].outs}
  found: set = set()
  stack = [a for i in region for a in graph.nodes[i].ins
           if isinstance(a, int) and a in axes and a not in made]
  while stack:
    producer = graph.values[stack.pop()].producer
    if producer is None or producer in found or producer not in rules:
      continue
    if graph.nodes[producer].backward:
      raise NotSplittable(f"{where(graph.nodes[producer])} runs in the backward pass "
                          "before the features' stretch")
    found.add(producer)
    stack += [a for a in graph.nodes[producer].ins if isinstance(a, int) and a in axes]
  return tuple(sorted(found))


def _leading(graph: Graph, region: set) -> set:
  """``region`` less the equations that read, through an equation outside
  it, what it makes (a residual branch's gradient added to the layer's
  input gradient): they run after it, on its joined results, so that it
  runs as one piece."""
  kept, made, later = set(), set(), set()
  for node in graph.nodes:
    ins = [a for a in node.ins if isinstance(a, int)]
    if node.index in region and not any(a in later for a in ins):
      kept.add(node.index)
      made.update(node.outs)
    elif any(a in made or a in later for a in ins):
      later.update(node.outs)
  return kept


def _checked(graph: Graph, layer: int, axes: dict, rules: dict, rebuilt, remade) -> None:
  """Refuses a stretch that is no layer's alone: features that another
  layer makes too or that leave it uncontracted (a residual stream), or
  forward work that reads another layer's activations whole."""
  makes = {i: kernel_axis(graph, graph.nodes[i]) for i in rules}
  makers = [i for i, axis in makes.items()
            if axis is not None and axes.get(graph.nodes[i].ins[1]) == axis]
  if len(makers) > 1:
    raise NotSplittable(f"{len(makers)} layers make these features (a residual stream)")
  made = {o for i in rules if not graph.nodes[i].backward for o in graph.nodes[i].outs}
  for node in graph.nodes:
    if node.index not in rules and not node.backward and any(
        isinstance(a, int) and a in axes and a in made for a in node.ins):
      raise NotSplittable(f"the features reach {where(node)} before a layer contracts them")
  own = graph.nodes[layer].ins[0]
  large = graph.values[graph.nodes[layer].outs[0]].nbytes // 4
  for i in rebuilt:
    for a in graph.nodes[i].ins:
      if (isinstance(a, int) and a not in axes and a != own and a not in remade
          and not _parameter(graph, a) and graph.values[a].nbytes >= large):
        raise NotSplittable(f"{where(graph.nodes[i])} reads another layer's activations whole")


def _placed(graph: Graph, layer: int, axes: dict, rules: dict) -> Split:
  """The split of the backward equations along the features of ``axes``,
  with the forward equations they read rebuilt per chunk."""
  region = {i for i in rules if graph.nodes[i].backward and not graph.nodes[i].update}
  if not region:
    raise NotSplittable("no backward equation works along the features")
  region = _leading(graph, region)
  rebuilt = _rebuilt(graph, axes, rules, region)
  split = place(graph, axes, rules, (), (), region)
  demanded = dict(split.demanded)
  demanded.update(demanded_values(graph, rules, rebuilt))
  _checked(graph, layer, axes, rules, rebuilt, {v for (v, _), how in demanded.items() if how})
  per_chunk = set(region) | set(rebuilt)
  made = {o for i in per_chunk for o in graph.nodes[i].outs}
  inputs = tuple(sorted({a for i in per_chunk for a in graph.nodes[i].ins
                         if isinstance(a, int) and a in axes and a not in made}))
  return dataclasses.replace(
      split, inputs=inputs, axes={v: axes[v] for v in (*inputs, *made) if v in axes},
      rules={i: rules[i] for i in sorted(per_chunk)}, demanded=demanded, rebuilt=rebuilt)


def split_features(graph: Graph, layer: int) -> Split:
  """The backward pass of the features equation ``layer`` makes (one of
  :func:`feature_layers`), with the forward work it reads, split into
  chunks of those features (module docstring), followed inside the module
  that holds the layer; :class:`NotSplittable` says why it cannot be
  (features that leave that module before a layer sums over them: a
  residual stream, the logits)."""
  node = graph.nodes[layer]
  axis = kernel_axis(graph, node)
  if axis is None:
    raise NotSplittable(f"{where(node)} is no convolution or matmul of a parameter kernel")
  seeds = {node.ins[1]: axis}
  scope = node.readable.rpartition("/")[0]
  for _ in range(_ROUNDS):
    axes, rules = _follow(graph, seeds, scope)
    if layer not in rules:
      raise NotSplittable(f"{where(node)} does not make its features along its kernel")
    taken = {graph.nodes[i].ins[p]: a for i, rule in rules.items() for p, a in rule.demand}
    taken = {v: a for v, a in taken.items()
             if isinstance(v, int) and v not in seeds and _parameter(graph, v)}
    if not taken:
      return _placed(graph, layer, axes, rules)
    seeds.update(taken)
  raise NotSplittable(f"the parameters {where(node)}'s features reach keep growing")
