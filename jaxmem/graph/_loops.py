"""Loops in the joint graph: a forward scan and the backward scans that read
its stacked outputs.

In the joint jaxpr of a step whose layers run under ``lax.scan`` (plain,
Flax ``nn.scan``, ...), the forward scan emits every residual of its body
stacked as ``[L, ...]`` and a backward scan (``reverse=True``) reads them
one slice per iteration. To the graph such a value is
one residual; this module says what it is inside the loop: which output of
which scan, how many iterations, the bytes of one slice, and which forward
body value it stacks, so that reports read "per layer bytes x L" and a
planner can decide per iteration.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> def step(ws, x):
  ...   def loss(ws):
  ...     h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, ws)
  ...     return jnp.sum(h)
  ...   return jax.grad(loss)(ws)
  >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((8, 4, 4)), jnp.ones((2, 4))))
  >>> [(s.length, s.per_iteration) for s in loops(g)[0].stacked]
  [(8, 32), (8, 32), (8, 32)]
"""

from __future__ import annotations

import dataclasses

from jaxmem.graph._graph import Graph, analysis


@dataclasses.dataclass(frozen=True)
class Stacked:
  """A residual that a forward scan stacks over its iterations.

  Attributes:
    value: the residual's value id in the graph.
    loop: the forward scan's node index.
    output: which of the scan's outputs it is (carries first), and so which
      of its body's outputs makes one slice.
    length: the iterations (slices) it stacks.
    per_iteration: bytes of one slice.
    slice_of: what makes one slice in the body: a primitive's name, or
      ``"carry"`` / ``"input"`` for a value the body passes through.
    readers: the backward nodes that read it, each with the position of
      the value among that node's inputs.
  """
  value: int
  loop: int
  output: int
  length: int
  per_iteration: int
  slice_of: str
  readers: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Loop:
  """A forward scan whose stacked outputs the backward pass reads.

  Attributes:
    forward: the forward scan's node index.
    backward: the backward scans among the readers of its stacked outputs.
    length: its iterations.
    stacked: its stacked residuals, in output order.
  """
  forward: int
  backward: tuple[int, ...]
  length: int
  stacked: tuple[Stacked, ...]

  @property
  def nbytes(self) -> int:
    """Bytes of all its stacked residuals."""
    return sum(s.per_iteration * s.length for s in self.stacked)


@analysis
def loops(graph: Graph) -> tuple[Loop, ...]:
  """The forward scans of ``graph`` with stacked residuals, in program order."""
  found = []
  for node in graph.nodes:
    if node.backward or node.prim.name != "scan":
      continue
    length, carries = node.params["length"], node.params["num_carry"]
    made_by = _body_producers(node.params["jaxpr"].jaxpr, node.params["num_consts"],
                              carries)
    stacked = []
    for output, vid in enumerate(node.outs):
      if output < carries or not graph.is_residual(vid):
        continue
      value = graph.values[vid]
      readers = tuple((u, graph.nodes[u].ins.index(vid)) for u in value.uses
                      if graph.nodes[u].backward)
      stacked.append(Stacked(vid, node.index, output, length,
                             value.nbytes // max(length, 1), made_by[output], readers))
    if stacked:
      backward = sorted({u for s in stacked for u, _ in s.readers
                         if graph.nodes[u].prim.name == "scan"})
      found.append(Loop(node.index, tuple(backward), length, tuple(stacked)))
  return tuple(found)


def _body_producers(body, consts: int, carries: int) -> list[str]:
  """For each output of a scan body, what makes it (see ``Stacked.slice_of``)."""
  made = {v: e.primitive.name for e in body.eqns for v in e.outvars}
  role = {v: "carry" if consts <= i < consts + carries else "input"
          for i, v in enumerate(body.invars)}
  return [made.get(v) or role.get(v, "constant") for v in body.outvars]


@analysis
def stacked_residuals(graph: Graph) -> dict[int, Stacked]:
  """Value id -> :class:`Stacked`, for every residual a forward scan stacks."""
  return {s.value: s for loop in loops(graph) for s in loop.stacked}
