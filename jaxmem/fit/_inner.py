"""Steps whose passes run inside a loop: gradient accumulation over a
``lax.scan`` (or a ``fori_loop`` with a static trip count) of micro-batches.

Such a step's jaxpr holds no backward pass outside the loop: each iteration
runs a forward and a backward pass. The loop's body is a step in its own
right, and it is planned as one: its residuals live within one iteration.
The loop then runs the planned body, so the program stays a loop and
compiles in the same time whatever the number of micro-batches, and every
planned body is judged by XLA's footprint of the whole step
(:func:`embedded`), budget and carries included.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
  >>> def step(w, xs):
  ...   return jax.lax.scan(lambda g, x: (g + jax.grad(loss)(w, x), None),
  ...                       jnp.zeros_like(w), xs)[0]
  >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 3, 4))))
  >>> g.has_backward, body_graph(g, inner_loop(g)).has_backward
  (False, True)
"""

from __future__ import annotations

import dataclasses

import jax

from jaxmem.schedule._emit import emit
from jaxmem.cost._evaluate import unplanned
from jaxmem.graph._graph import Graph, analysis, build_graph
from jaxmem.schedule._schedule import Schedule


@analysis
def body_graph(graph: Graph, index: int) -> Graph:
  """The graph of the body of loop node ``index``."""
  return build_graph(graph.nodes[index].params["jaxpr"])


@analysis
def inner_loop(graph: Graph) -> int | None:
  """The scan whose body holds a forward and a backward pass, where the
  step has none outside loops (the one doing most work, if several); None
  where there is none."""
  if graph.has_backward:
    return None
  found = [node.index for node in graph.nodes if node.prim.name == "scan"
           and body_graph(graph, node.index).has_backward]
  return max(found, key=lambda i: sum(n.flops for n in body_graph(graph, i).nodes),
             default=None)


def embedded(graph: Graph, index: int, body: Schedule) -> Schedule:
  """The step as written, with loop ``index`` running ``body`` (a schedule
  of its body graph) in each iteration."""
  node = graph.nodes[index]
  params = node.params
  consts, carries = params["num_consts"], params["num_carry"]
  run_body = emit(body)

  def run(*ins):
    const_in, carry_in, xs = ins[:consts], ins[consts:consts + carries], ins[consts + carries:]

    def step(carry, x):
      outs = run_body(*const_in, *carry, *x)
      return list(outs[:carries]), list(outs[carries:])

    carry, ys = jax.lax.scan(step, list(carry_in), list(xs), length=params["length"],
                             reverse=params["reverse"], unroll=params.get("unroll", 1))
    return list(carry) + list(ys)

  outer = unplanned(graph, 0).schedule
  ops = [dataclasses.replace(op, params=(run,)) if op.kind == "node" and op.node == index
         else op for op in outer.ops]
  return dataclasses.replace(outer, ops=ops)
