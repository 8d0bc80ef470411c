"""Choices alike: the same choice in layers built alike, priced once.

A model that stacks copies of one layer (a transformer's blocks) gives the
exact planner the same choices once per layer: each policy for the layer
and for its sublayers, and each of its rebuild groups. Where the layers'
equations match one for one (the same primitives on the same shapes under
the same module paths within the layer, and where the memory model learned
a compiler's program, the same buffers), a choice frees in one layer what
it frees in the other at the equations that correspond, and the bytes it
frees between the layer's forward and backward passes stay freed over the
equations in between. So the column priced in one layer is *moved* to the
others (:func:`moved`), and the planner prices a moved column only where a
solution takes it (:mod:`~jaxmem.planners._pricing`).

The first layer reads the stem's output and the last feeds the head, so
both often price apart from the rest. Where the compiler's buffers show
it they are not alike at all (GPT-2 at CPU sizes for a T4: XLA:GPU fuses
the embedding's sum into the first block's kernels, whose policies cost
7-10% less than the later blocks', and most of its choices stand in no
stack). A moved column follows its source at the layers on either side
too (a layer's rebuild runs before the next layer's backward equations
that read its output), so the layer before the last differs as well. The
first two layers of a stack and the last two are priced, and the
second's columns are moved to the layers between (:func:`groups`,
:func:`targets`), but for a choice whose rebuild runs equations outside
its own layer (:func:`inside`).
Measured against every column priced, on GPT-2 at CPU sizes with 12
blocks on the memory model learned for a T4: 222 of its 425 columns are
moved; they differ from the priced ones by at most 36 KiB (0.6% of the
largest column), and their costs by at most 0.05% of the step's
predicted time.

Layers are alike only as repeats of one layer under the model: their module
paths differ in one name, the model's direct child, and only in its digits
(``GPT2/block1/attn`` and ``GPT2/block3/attn``, not ``ViT/block0/ln1`` and
``ViT/block0/ln2``, which match equation for equation but sit in different
places of their layer).
"""

from __future__ import annotations

import re

import numpy as np

from jaxmem.graph._graph import Graph, analysis
from jaxmem.planners._choices import Choice, Drop


def groups(graph: Graph, choices: list) -> list[tuple[int, ...]]:
  """Indices into ``choices`` of the same choice in alike layers, in the
  order the layers run, for stacks of five layers or more (the first two
  and the last two are priced, the others moved from the second)."""
  found: dict = {}
  for i, choice in enumerate(choices):
    key = _key(graph, choice)
    if key is not None:
      found.setdefault(key, []).append(i)
  return [tuple(sorted(members, key=lambda i: _layer(graph, _home(graph, choices[i]))[0][0]))
          for members in found.values() if len(members) >= 5]


def targets(stack: tuple) -> tuple:
  """The members of ``stack`` whose columns are moved from its second, each
  with its position in the stack: all but the first two and the last two."""
  return tuple(enumerate(stack))[2:-2]


def moved(graph: Graph, rows: list, column: np.ndarray, homes: list, source: int,
          target: int) -> np.ndarray | None:
  """``column`` (a choice's, over the table's ``rows`` in schedule order)
  moved from layer ``homes[source]`` of a stack to layer ``homes[target]``
  (``homes``: the stack's module paths in order): at the equations of the
  target layer and of the layers on either side (where its rebuild may
  run: before the next layer's backward equations that read its output),
  the source's at their counterparts; between the target's forward and
  backward passes, the source's there; at equations of other layers run
  inside its passes (a weight's update between its backward equations),
  its own level before them; before and after it, the source's before and
  after the source. None where a row has no counterpart, or the target's
  span between passes is not inside the source's: the column is priced
  instead."""
  position = {node: k for k, node in enumerate(rows)}
  layers = [_layer(graph, home)[0] for home in homes]
  src, dst = layers[source], layers[target]
  counterpart = {}
  for step in (-1, 0, 1):
    if not (0 <= source + step < len(layers) and 0 <= target + step < len(layers)):
      continue
    for s, t in zip(layers[source + step], layers[target + step]):
      if s not in position or t not in position:
        return None
      counterpart.setdefault(position[t], position[s])
  a_s, fwd_s, bwd_s, z_s = _span(graph, src, position)
  a_t, fwd_t, bwd_t, z_t = _span(graph, dst, position)
  before = column[a_s - 1] if a_s > 0 else 0.0
  after = column[z_s + 1] if z_s + 1 < len(rows) else 0.0
  own = set(position[n] for n in src)
  out = np.empty_like(column)
  for k in range(len(rows)):
    if k in counterpart:
      out[k] = column[counterpart[k]]
    elif k < a_t:
      out[k] = column[k] if k < a_s else before
    elif k > z_t:
      out[k] = column[k] if k > z_s else after
    elif fwd_t < k < bwd_t:
      if not fwd_s < k < bwd_s or k in own:
        return None
      out[k] = column[k]
    else:
      out[k] = out[k - 1]
  return out


def homes(graph: Graph, choices: list, stack: tuple) -> list[str]:
  """The module paths of the layers of ``stack`` (indices into ``choices``),
  in order."""
  return [_home(graph, choices[i]) for i in stack]


def inside(graph: Graph, choice, reruns: frozenset) -> bool:
  """Whether the equations ``choice``'s rebuild runs again (``reruns``) all
  lie in its own layer: a rebuild that reaches back through earlier layers
  (a residual stream XLA computes inside its readers, rebuilt from the
  last buffer before it) reaches further from later layers, and its column
  and cost grow with the layer's depth, so they are not moved."""
  nodes = set(_layer(graph, _home(graph, choice))[0])
  return reruns <= nodes


def _span(graph: Graph, nodes: list, position: dict) -> tuple[int, int, int, int]:
  """A layer's first row, its forward pass's last, its backward pass's
  first and its last row."""
  rows = [position[n] for n in nodes]
  forward = [position[n] for n in nodes if not graph.nodes[n].backward] or rows
  backward = [position[n] for n in nodes if graph.nodes[n].backward] or rows
  return min(rows), max(forward), min(backward), max(rows)


def _home(graph: Graph, choice) -> str | None:
  """The module path of the layer ``choice`` works in: a block's own, a
  rebuild group's depth-2 block where all its residuals are made there."""
  if isinstance(choice, Choice):
    return choice.segment.name
  scopes = {graph.producer(v).scope(2) for v in choice.values}
  home = scopes.pop() if len(scopes) == 1 else None
  return home if home and home.count("/") == 1 else None


def _key(graph: Graph, choice) -> tuple | None:
  """What two choices alike share: the kind of choice, the layer's shape
  (its equations) and module path less the repeated layer's digits, and
  for a rebuild group where its residuals are made in that layer."""
  home = _home(graph, choice)
  if home is None:
    return None
  names = home.split("/")
  if len(names) < 2:
    return None
  nodes, shape = _layer(graph, home)
  path = (names[0], re.sub(r"\d+", "", names[1]), *names[2:])
  if isinstance(choice, Choice):
    return ("block", choice.keep, path, shape)
  assert isinstance(choice, Drop)
  made = []
  for v in choice.values:
    node = graph.producer(v)
    if node.index not in nodes:
      return None
    made.append((nodes.index(node.index), node.outs.index(v)))
  return ("drop", tuple(made), path, shape)


@analysis
def _layer(graph: Graph, home: str) -> tuple[list, tuple]:
  """The equations of the layer at module path ``home`` (forward and
  backward, in index order) and its shape: each equation's primitive,
  module path within the layer, pass and output types."""
  nodes = [n.index for n in graph.nodes
           if n.readable == home or n.readable.startswith(home + "/")]
  shape = tuple((graph.nodes[i].prim.name, graph.nodes[i].readable[len(home):],
                 graph.nodes[i].backward,
                 tuple(str(graph.values[o].aval) for o in graph.nodes[i].outs),
                 _learned(graph, i, nodes))
                for i in nodes)
  return nodes, shape


def _learned(graph: Graph, index: int, nodes: list) -> tuple:
  """What the compiler's program says of equation ``index`` of the layer
  ``nodes`` where the memory model learned it (else nothing): layers whose
  buffers the compiler made apart (the last one's, fused into the loss)
  are not alike. Where its kernels end is left out: XLA:GPU fuses a
  dropout's key derivation into one kernel in some layers and two in
  others (GPT-2 for a T4), which changes a rebuild's time by one launch."""
  buffers = graph.buffers
  if buffers is None:
    return ()
  where = {n: k for k, n in enumerate(nodes)}
  spans = tuple(sorted((where.get(last, -1), nbytes, where.get(source, -1))
                       for first, last, nbytes, source in buffers.spans if first == index))
  return (tuple(o in buffers.materialized for o in graph.nodes[index].outs),
          buffers.extra.get(index, 0),
          buffers.workspace.get(index, 0), buffers.transient.get(index, 0),
          buffers.library.get(index, ""), spans)
