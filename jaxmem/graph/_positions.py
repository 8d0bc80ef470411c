"""Values that hold each example's own position: the ``jnp.arange(n)`` of
``log_probs[jnp.arange(n), labels]``, where a step picks each example's
own entry by its position in the batch.

An index whose column holds those positions pairs every example with its
own row, so the gather it drives (and its gradient's scatter) works per
example: each micro-batch puts its own positions in that column
(``schedule._microbatch``). The positions are found from the jaxpr, one
rule per primitive: a value holds positions along ``axis`` where each of
its elements equals its index along that axis.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> g = build_graph(jax.make_jaxpr(
  ...     lambda lp, y: lp[jnp.arange(8), y])(jnp.ones((8, 5)), jnp.zeros(8, jnp.int32)))
  >>> gather = next(n for n in g.nodes if n.prim.name == "gather")
  >>> own_columns(g, gather.ins[1], 0)
  (0,)
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from jax.extend import core as jex

from jaxmem.graph._graph import Graph
from jaxmem.graph._split import shape_of


def _iota(graph: Graph, node, axis: int) -> bool:
  return node.params["dimension"] == axis


def _broadcast(graph: Graph, node, axis: int) -> bool:
  dims = tuple(node.params["broadcast_dimensions"])
  return (axis in dims and shape_of(graph, node.ins[0])[dims.index(axis)]
          == graph.values[node.outs[0]].aval.shape[axis]
          and holds_positions(graph, node.ins[0], dims.index(axis)))


def _same(graph: Graph, node, axis: int) -> bool:
  """A cast: the numbers are kept."""
  return holds_positions(graph, node.ins[0], axis)


def _reshape(graph: Graph, node, axis: int) -> bool:
  """A reshape that only adds or drops axes of extent 1."""
  shape, new = shape_of(graph, node.ins[0]), graph.values[node.outs[0]].aval.shape
  if node.params.get("dimensions") is not None or new[axis] == 1:
    return False
  kept = [d for d, n in enumerate(shape) if n != 1]
  if [shape[d] for d in kept] != [n for n in new if n != 1]:
    return False
  return holds_positions(graph, node.ins[0], kept[sum(n != 1 for n in new[:axis])])


def _select(graph: Graph, node, axis: int) -> bool:
  """``jnp`` indexing's wrap of negative indices, ``where(i < 0, i + n, i)``:
  positions are never negative, so it picks ``i``; otherwise every case
  must hold positions."""
  predicate, *cases = node.ins
  test = _producer(graph, predicate)
  if (test is not None and test.prim.name == "lt" and test.ins[0] == cases[0]
      and isinstance(test.ins[1], jex.Literal) and np.all(np.asarray(test.ins[1].val) == 0)):
    return holds_positions(graph, cases[0], axis)
  return all(holds_positions(graph, c, axis) for c in cases)


def _producer(graph: Graph, atom):
  """The equation that makes ``atom``, None for a literal or an input."""
  if isinstance(atom, jex.Literal) or graph.values[atom].producer is None:
    return None
  return graph.nodes[graph.values[atom].producer]


RULES: dict[str, Callable] = {
    "iota": _iota,
    "broadcast_in_dim": _broadcast,
    "convert_element_type": _same, "copy": _same, "copy_p": _same,
    "reshape": _reshape,
    "select_n": _select,
}


def holds_positions(graph: Graph, atom, axis: int) -> bool:
  """Whether every element of ``atom`` (a value id of ``graph`` or a literal)
  equals its index along ``axis``."""
  if isinstance(atom, jex.Literal):
    return False
  if atom in graph.consts:
    value = np.asarray(graph.consts[atom])
    return bool(value.ndim > axis and np.array_equal(
        value, np.broadcast_to(np.arange(value.shape[axis]).reshape(
            [-1 if d == axis else 1 for d in range(value.ndim)]), value.shape)))
  node = _producer(graph, atom)
  rule = None if node is None else RULES.get(node.prim.name)
  return rule is not None and not node.effects and rule(graph, node, axis)


def own_columns(graph: Graph, indices: int, axis: int) -> tuple[int, ...]:
  """The columns (along the last axis, where a gather or scatter reads its
  index vectors) of ``indices`` that hold each example's position along
  ``axis``: pieces one column wide of a ``concatenate`` along the last
  axis, or the whole of a one-column index."""
  node = _producer(graph, indices)
  last = len(shape_of(graph, indices)) - 1
  if node is not None and node.prim.name == "concatenate" and node.params["dimension"] == last:
    pieces, start = [], 0
    for piece in node.ins:
      width = shape_of(graph, piece)[last]
      pieces.append((start, piece, width))
      start += width
  else:
    pieces = [(0, indices, shape_of(graph, indices)[last])]
  return tuple(start for start, piece, width in pieces
               if width == 1 and holds_positions(graph, piece, axis))
