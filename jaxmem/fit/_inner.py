"""Steps whose passes run inside a body of their own: gradient accumulation
over a ``lax.scan`` (or a ``fori_loop`` with a static trip count) of
micro-batches, or a step written per device under ``jax.shard_map``.

Such a step's jaxpr holds no backward pass outside that body: each
iteration of the loop, or each device's program, runs a forward and a
backward pass. The body is a step in its own right, and it is planned as
one: its residuals live within one iteration, or on one device (at its
shard's shapes, beside its collectives). The loop or the ``shard_map`` then
runs the planned body, and every planned body is judged by XLA's footprint
of the whole step (:func:`embedded`; per device for a ``shard_map``),
budget and carries included.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
  >>> def step(w, xs):
  ...   return jax.lax.scan(lambda g, x: (g + jax.grad(loss)(w, x), None),
  ...                       jnp.zeros_like(w), xs)[0]
  >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 3, 4))))
  >>> g.has_backward, body_graph(g, inner_body(g)).has_backward
  (False, True)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
from jax.extend import core as jex

from jaxmem.schedule._emit import UNTYPED, emit
from jaxmem.cost._evaluate import unplanned
from jaxmem.graph._graph import Graph, analysis, build_graph
from jaxmem.schedule._schedule import Schedule


BODIES = ("scan", "shard_map")


@analysis
def body_graph(graph: Graph, path: tuple[int, ...]) -> Graph:
  """The graph of the body reached by ``path``: node ``path[0]``'s body (a
  loop's or a ``shard_map``'s), then node ``path[1]``'s in that, ..."""
  body = graph.nodes[path[0]].params["jaxpr"]
  inner = build_graph(body if isinstance(body, jex.ClosedJaxpr) else jex.ClosedJaxpr(body, ()))
  return inner if len(path) == 1 else body_graph(inner, path[1:])


@analysis
def inner_body(graph: Graph) -> tuple[int, ...] | None:
  """The path (:func:`body_graph`) to the scan or ``shard_map`` body that
  holds a forward and a backward pass, where the step has none outside
  such bodies (the one doing most work, if several; a loop inside a
  ``shard_map`` is reached through it); None where there is none."""
  if graph.has_backward:
    return None
  found = []
  for node in graph.nodes:
    if node.prim.name in BODIES:
      inner = body_graph(graph, (node.index,))
      below = inner_body(inner)
      if inner.has_backward or below is not None:
        found.append((node.index,) + (below or ()))
  return max(found, key=lambda p: sum(n.flops for n in body_graph(graph, p).nodes),
             default=None)


def mapped_step(graph: Graph) -> int | None:
  """The index of the ``shard_map`` that is the whole step (it reads the
  step's inputs in order and returns its outputs), or None."""
  if len(graph.nodes) != 1 or graph.nodes[0].prim.name != "shard_map":
    return None
  node = graph.nodes[0]
  same = tuple(node.ins) == tuple(graph.inputs) and tuple(node.outs) == tuple(graph.outputs)
  return 0 if same else None


@dataclasses.dataclass(frozen=True)
class Body:
  """Where a step's passes run, for reports: inside a ``scan`` (one
  iteration's passes), a ``shard_map`` (one device's), or a loop inside a
  ``shard_map``; ``kinds`` and ``sources`` from the outermost in."""
  kinds: tuple[str, ...]
  sources: tuple[str, ...] = ()

  @property
  def per_device(self) -> bool:
    """Whether the planned graph holds one device's shapes."""
    return "shard_map" in self.kinds

  def describe(self) -> str:
    places = [f"the {'loop' if kind == 'scan' else kind}" + (f" at {source}" if source else "")
              for kind, source in zip(self.kinds, self.sources)]
    if "scan" not in self.kinds:
      passes, whose = "each device's", "one device's"
    else:
      passes = "one iteration's"
      whose = "one iteration's on one device" if self.per_device else "one iteration's"
    return (f"inside {' in '.join(reversed(places))}: {passes} forward and backward pass "
            f"(residuals, decisions and FLOPs below are {whose})")


def body_of(graph: Graph, path: tuple[int, ...]) -> Body:
  """The :class:`Body` that ``path`` reaches in ``graph``."""
  nodes = [graph.nodes[path[0]]]
  for depth in range(1, len(path)):
    nodes.append(body_graph(graph, path[:depth]).nodes[path[depth]])
  return Body(tuple(n.prim.name for n in nodes), tuple(n.source for n in nodes))


def on_each_device(params: dict, run_body: Callable) -> Callable:
  """``run_body`` (over flat per-device inputs, its equations bound with
  :data:`UNTYPED`) under the ``shard_map`` of ``params``: the step's mesh
  and specs."""
  manual = params.get("manual_axes", params.get("newly_manual_axes"))
  mapped = jax.shard_map(lambda *ins: tuple(run_body(*ins)), mesh=params["mesh"],
                         in_specs=tuple(params["in_specs"]),
                         out_specs=tuple(params["out_specs"]), check_vma=False,
                         **({} if manual is None else {"axis_names": set(manual)}))
  return lambda *ins: list(mapped(*ins))


def _looped(params: dict, run_body: Callable) -> Callable:
  """``run_body`` as the body of the scan of ``params``."""
  consts, carries = params["num_consts"], params["num_carry"]

  def run(*ins):
    const_in, carry_in, xs = ins[:consts], ins[consts:consts + carries], ins[consts + carries:]

    def step(carry, x):
      outs = run_body(*const_in, *carry, *x)
      return list(outs[:carries]), list(outs[carries:])

    carry, ys = jax.lax.scan(step, list(carry_in), list(xs), length=params["length"],
                             reverse=params["reverse"], unroll=params.get("unroll", 1))
    return list(carry) + list(ys)
  return run


def embedded(graph: Graph, path: tuple[int, ...], body: Schedule,
             binds: Mapping[str, Callable] = {}) -> Schedule:
  """The step as written, with the body that ``path`` reaches running
  ``body`` (a schedule of its graph); under a ``shard_map``, equations are
  bound with :data:`UNTYPED` (``binds``)."""
  node = graph.nodes[path[0]]
  mapped = node.prim.name == "shard_map"
  inner_binds = UNTYPED if mapped else binds
  if len(path) > 1:
    body = embedded(body_graph(graph, path[:1]), path[1:], body, inner_binds)
  run_body = emit(body, binds=inner_binds)
  run = on_each_device(node.params, run_body) if mapped else _looped(node.params, run_body)
  outer = unplanned(graph, 0).schedule
  ops = [dataclasses.replace(op, params=(run,)) if op.kind == "node" and op.node == path[0]
         else op for op in outer.ops]
  return dataclasses.replace(outer, ops=ops)
