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

import jax
from jax.extend import core as jex

from jaxmem.schedule._emit import emit
from jaxmem.cost._evaluate import unplanned
from jaxmem.graph._graph import Graph, analysis, build_graph
from jaxmem.schedule._schedule import Schedule


BODIES = ("scan", "shard_map")


@analysis
def body_graph(graph: Graph, index: int) -> Graph:
  """The graph of the body of node ``index`` (a loop or a ``shard_map``)."""
  body = graph.nodes[index].params["jaxpr"]
  return build_graph(body if isinstance(body, jex.ClosedJaxpr) else jex.ClosedJaxpr(body, ()))


@analysis
def inner_body(graph: Graph) -> int | None:
  """The scan or ``shard_map`` whose body holds a forward and a backward
  pass, where the step has none outside them (the one doing most work, if
  several); None where there is none."""
  if graph.has_backward:
    return None
  found = [node.index for node in graph.nodes if node.prim.name in BODIES
           and body_graph(graph, node.index).has_backward]
  return max(found, key=lambda i: sum(n.flops for n in body_graph(graph, i).nodes),
             default=None)


@dataclasses.dataclass(frozen=True)
class Body:
  """Where a step's passes run, for reports: inside a ``scan`` (one
  iteration's passes) or a ``shard_map`` (one device's), at ``source``."""
  kind: str
  source: str = ""

  @property
  def per_device(self) -> bool:
    """Whether the planned graph holds one device's shapes."""
    return self.kind == "shard_map"

  def describe(self) -> str:
    at = f" at {self.source}" if self.source else ""
    if self.per_device:
      return (f"inside the shard_map{at}: each device's forward and backward pass "
              "(residuals, decisions and FLOPs below are one device's)")
    return (f"inside the loop{at}: one iteration's forward and backward pass "
            "(residuals, decisions and FLOPs below are one iteration's)")


def body_of(graph: Graph, index: int) -> Body:
  """The :class:`Body` of ``graph``'s node ``index``."""
  node = graph.nodes[index]
  return Body(node.prim.name, node.source)


# A planned body runs under ``shard_map(..., check_vma=False)``: its
# barriers join values that vary over mesh axes with values that do not,
# which the varying-axes typing refuses. Its equations that exist only for
# that typing run as their untyped forms (the same collectives, or nothing).
_UNTYPED = {
    "pvary": lambda node, args: list(args),
    "pbroadcast": lambda node, args: list(args),
    "psum_invariant": lambda node, args: [jax.lax.psum(a, node.params["axes"]) for a in args],
    "psum2": lambda node, args: [jax.lax.psum(a, node.params["axes"]) for a in args],
    "all_gather_invariant": lambda node, args: [jax.lax.all_gather(
        a, node.params["axis_name"], axis=node.params["all_gather_dimension"],
        tiled=node.params["tiled"]) for a in args],
}


def _per_device(params: dict, body: Schedule):
  """``body`` run under the ``shard_map`` of ``params``, on the step's mesh
  and specs."""
  run_body = emit(body, binds=_UNTYPED)
  manual = params.get("manual_axes", params.get("newly_manual_axes"))
  mapped = jax.shard_map(lambda *ins: tuple(run_body(*ins)), mesh=params["mesh"],
                         in_specs=tuple(params["in_specs"]),
                         out_specs=tuple(params["out_specs"]), check_vma=False,
                         **({} if manual is None else {"axis_names": set(manual)}))
  return lambda *ins: list(mapped(*ins))


def _looped(params: dict, body: Schedule):
  """``body`` run as the body of the scan of ``params``."""
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
  return run


def embedded(graph: Graph, index: int, body: Schedule) -> Schedule:
  """The step as written, with its loop or ``shard_map`` ``index`` running
  ``body`` (a schedule of its body graph)."""
  node = graph.nodes[index]
  wrap = _per_device if node.prim.name == "shard_map" else _looped
  run = wrap(node.params, body)
  outer = unplanned(graph, 0).schedule
  ops = [dataclasses.replace(op, params=(run,)) if op.kind == "node" and op.node == index
         else op for op in outer.ops]
  return dataclasses.replace(outer, ops=ops)
