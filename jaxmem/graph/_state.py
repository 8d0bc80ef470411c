"""Optimizer state: step inputs only the optimizer update reads.

Adam's moments, and any other leaf of a step's state that no forward or
transposed equation reads, are needed on the device only while the update
runs. Such a leaf may live in host memory between steps (ZeRO-Offload's
placement): the step copies it to the device right before its first
reader, and copies the output it becomes back to host memory as soon as
that output is made. So may a mixed-precision step's *master weights*:
float parameters the forward pass reads only through casts to a narrower
float (Flax's ``param_dtype=float32, dtype=bfloat16``), beside their
update. The step copies such a weight to the device for its casts (the copy
dies after them; the narrow cast is what the passes read) and again for
its update. :func:`optimizer_state` finds those leaves and the output each
one becomes; :func:`with_hosted` marks a graph whose schedules do so
(``_schedule`` emits the copies, ``_memory`` counts them).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxmem._decisions import Host, Plan
from jaxmem.graph._graph import Graph, analysis

# A leaf smaller than this stays on the device: its copies would cost a
# transfer's latency each and save nothing (an Adam step count).
MIN_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class StateLeaf:
  """A step input the optimizer update alone reads.

  Attributes:
    value: its value id (one of ``graph.inputs``).
    leaf: its position among the step's flat input leaves.
    nbytes: its size.
    output: the position among the step's outputs of the value it becomes
      (its update), or None where the step returns no update of it.
    name: the module path of its first reader, for reports.
    master: whether the forward pass reads it too, through narrowing casts
      (a mixed-precision step's master weight; see the module docstring).
  """
  value: int
  leaf: int
  nbytes: int
  output: int | None
  name: str
  master: bool = False


@analysis
def optimizer_state(graph: Graph) -> tuple[StateLeaf, ...]:
  """The step's inputs of at least :data:`MIN_BYTES` read only by optimizer
  updates (``Node.update``), or by updates and forward casts to a narrower
  float (master weights), each paired with the output it becomes.

  An output made by the update is paired with the nearest input of its own
  shape and dtype among the values it is computed from (Adam's new first
  moment with the old one, not with the parameters it also reads), each
  input with one output at most.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from jaxmem.graph._graph import build_graph
    >>> opt = optax.adam(1e-3)
    >>> def step(w, s, x):
    ...   g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    ...   u, s = opt.update(g, s)
    ...   return optax.apply_updates(w, u), s
    >>> w = jnp.ones((64, 64))
    >>> g = build_graph(jax.make_jaxpr(step)(w, opt.init(w), jnp.ones((2, 64))))
    >>> [(leaf.leaf, leaf.output) for leaf in optimizer_state(g)]  # mu, nu
    [(2, 2), (3, 3)]
  """
  candidates, masters = {}, set()
  for position, vid in enumerate(graph.inputs):
    uses = [graph.nodes[u] for u in graph.values[vid].uses]
    casts = [node for node in uses if not node.update]
    if (vid in graph.consts or graph.values[vid].nbytes < MIN_BYTES
        or len(casts) == len(uses)
        or not all(_narrowing_cast(graph, node, vid) for node in casts)):
      continue
    candidates[vid] = position
    if casts:
      masters.add(vid)
  paired: dict[int, int] = {}
  for position, out in enumerate(graph.outputs):
    if not isinstance(out, int):
      continue
    if out in candidates:  # returned as it came in
      paired.setdefault(out, position)
      continue
    source = _nearest_input(graph, out)
    if source in candidates and source not in paired:
      paired[source] = position
  return tuple(
      StateLeaf(vid, leaf, graph.values[vid].nbytes, paired.get(vid),
                graph.nodes[graph.values[vid].uses[0]].readable, vid in masters)
      for vid, leaf in candidates.items())


def _narrowing_cast(graph: Graph, node, vid: int) -> bool:
  """Whether ``node`` is a forward cast of the float ``vid`` to a narrower
  float (a mixed-precision step's compute copy of a master weight)."""
  if node.backward or node.prim.name != "convert_element_type":
    return False
  source, made = graph.values[vid].aval.dtype, graph.values[node.outs[0]].aval.dtype
  return (jnp.issubdtype(source, jnp.floating) and jnp.issubdtype(made, jnp.floating)
          and made.itemsize < source.itemsize)


def _nearest_input(graph: Graph, out: int) -> int | None:
  """The step input of ``out``'s shape and dtype nearest to it, walking
  back through the optimizer update that makes it (breadth first)."""
  aval = graph.values[out].aval
  frontier, seen = [out], {out}
  while frontier:
    found, step = [], []
    for vid in frontier:
      producer = graph.values[vid].producer
      if producer is None:
        other = graph.values[vid].aval
        if vid in graph.inputs and other.shape == aval.shape and other.dtype == aval.dtype:
          found.append(vid)
        continue
      if not graph.nodes[producer].update:
        continue
      for a in graph.nodes[producer].ins:
        if isinstance(a, int) and a not in seen:
          seen.add(a)
          step.append(a)
    if found:
      return min(found)
    frontier = step
  return None


def with_hosted(graph: Graph, values, at: dict | None = None) -> Graph:
  """``graph`` with the optimizer-state inputs ``values`` kept in host
  memory between steps (see the module docstring), each copied to the
  device before the backward node ``at`` gives it (else before its first
  reader); analyses start afresh.
  """
  known = {leaf.value for leaf in optimizer_state(graph)}
  values = frozenset(values)
  if not values <= known:
    raise ValueError(f"with_hosted: values {sorted(values - known)} are not optimizer "
                     "state of this step (inputs read only by its optimizer update, or "
                     "by it and forward casts to a narrower float)")
  points = tuple(sorted((v, n) for v, n in (at or {}).items() if v in values))
  return dataclasses.replace(graph, hosted=values, hosted_at=points)


def hosted_state(graph: Graph) -> tuple[StateLeaf, ...]:
  """The optimizer state ``graph`` keeps in host memory."""
  return tuple(leaf for leaf in optimizer_state(graph) if leaf.value in graph.hosted)


def hosted_leaves(graph: Graph) -> tuple[int, ...]:
  """Positions, among the step's flat input leaves, of the optimizer state
  ``graph`` keeps in host memory."""
  return tuple(leaf.leaf for leaf in hosted_state(graph))


def hosted_outputs(graph: Graph) -> dict[int, int]:
  """Output position -> the hosted input whose update it is: the outputs a
  schedule of ``graph`` returns in host memory."""
  return {leaf.output: leaf.value for leaf in hosted_state(graph) if leaf.output is not None}


def with_host_decisions(graph: Graph, plan: Plan) -> Plan:
  """``plan`` with a :class:`~jaxmem._decisions.Host` decision for each
  input ``graph`` keeps in host memory: the whole of a fit's decisions, as
  a saved plan records them."""
  decisions = plan.as_dict()
  at = dict(graph.hosted_at)
  decisions.update((vid, Host(at=at.get(vid))) for vid in graph.hosted)
  return Plan.of(decisions)


def apply_host_decisions(graph: Graph, plan: Plan) -> tuple[Graph, Plan]:
  """A saved plan's :class:`~jaxmem._decisions.Host` decisions taken out
  of it and applied to ``graph`` (:func:`with_hosted`), with the rest of
  the plan; ``(graph, plan)`` as given where it has none."""
  hosted = plan.with_kind("host")
  if not hosted:
    return graph, plan
  rest = Plan.of({vid: d for vid, d in plan if d.kind != "host"})
  at = {vid: d.at for vid, d in hosted.items() if d.at is not None}
  return with_hosted(graph, hosted, at), rest
