"""The joint graph of a training step: equations, values and residuals.

``build_graph`` flattens a step's closed jaxpr into one list of nodes
(inlining nested ``jit`` / ``closed_call`` / ``custom_jvp_call`` /
``custom_vjp_call``), splits it into the forward part and the backward part
(everything from the first ``transpose(...)`` equation on, optimizer included)
and finds the *residuals*: forward values that the backward part reads.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.extend import core as jex

from jaxmem import _cost

# Call-like primitives whose body is inlined, and the param holding the body.
_INLINE = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
}
_TRANSFORMS = re.compile(r"\b(?:jvp|transpose|vmap|pmap|remat|checkpoint)\(")


@dataclasses.dataclass
class Node:
  """One equation of the flattened step."""
  index: int
  prim: Any
  params: dict
  ins: tuple  # value ids (int) or jex.Literal
  outs: tuple[int, ...]
  name_stack: str
  source: str
  backward: bool
  flops: float
  effects: Any
  source_info: Any
  ctx: Any
  update: bool = False  # a backward-part node outside the transposed AD

  @property
  def readable(self) -> str:
    """Module path without transform wrappers, e.g. ``Net/Block_0/Conv_0``."""
    path = _TRANSFORMS.sub("", self.name_stack).replace(")", "").strip("/")
    path = re.sub(r"/+", "/", path)
    return path or "<top>"


@dataclasses.dataclass
class Value:
  """One value of the step: an input, a constant, or an equation's output."""
  id: int
  aval: Any
  nbytes: int
  producer: int | None = None
  uses: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Residual:
  """A forward value read by the backward pass.

  Attributes:
    value: id of the value in the graph.
    name: readable name: module path, primitive and source line.
    shape, dtype, nbytes: the array.
    primitive: name of the producing primitive.
    produced_at: index of the producing node (forward position).
    last_forward_use: last forward node reading it (``produced_at`` if none).
    first_backward_use, last_backward_use: backward nodes reading it.
    recompute_flops: FLOPs of its producer alone.
    needs: value ids its producer reads (what recomputation needs).
    recomputable: whether its producer may be re-run (pure, no effects).
  """
  value: int
  name: str
  shape: tuple
  dtype: Any
  nbytes: int
  primitive: str
  produced_at: int
  last_forward_use: int
  first_backward_use: int
  last_backward_use: int
  recompute_flops: float
  needs: tuple
  recomputable: bool


@dataclasses.dataclass
class Graph:
  """A flattened training step."""
  nodes: list[Node]
  values: dict[int, Value]
  inputs: list[int]
  outputs: list  # value ids or jex.Literal
  consts: dict[int, Any]
  backward_start: int | None
  residuals: list[Residual]

  @property
  def has_backward(self) -> bool:
    return self.backward_start is not None

  def is_forward_value(self, vid: int) -> bool:
    producer = self.values[vid].producer
    return producer is not None and not self.nodes[producer].backward

  def is_backward_value(self, vid: int) -> bool:
    producer = self.values[vid].producer
    return producer is not None and self.nodes[producer].backward

  def residual(self, vid: int) -> Residual:
    return self._by_value[vid]

  def transposes_inputs(self, node: Node) -> bool:
    """Whether XLA:CPU runs ``node`` on transposed copies of its inputs: a
    convolution computing a kernel gradient (an output smaller than both
    inputs) does."""
    if node.prim.name != "conv_general_dilated":
      return False
    out = self.values[node.outs[0]].nbytes
    return all(self.values[a].nbytes > out for a in node.ins if isinstance(a, int))

  def blocks(self, depth: int) -> dict[str, list[int]]:
    """Forward nodes grouped by module path cut after ``depth`` names:
    ``{"GPT2/block0": [node, ...], ...}`` at depth 2. Nodes whose path is
    shorter (a model's stem and head) belong to no block.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> g = build_graph(jax.make_jaxpr(jax.grad(jnp.sin))(1.0))
      >>> g.blocks(2)
      {}
    """
    key = ("blocks", depth)
    if key not in self.derived:
      found: dict[str, list[int]] = {}
      for node in self.nodes:
        parts = node.readable.split("/")
        if not node.backward and node.readable != "<top>" and len(parts) >= depth:
          found.setdefault("/".join(parts[:depth]), []).append(node.index)
      self.derived[key] = found
    return self.derived[key]

  def __post_init__(self):
    self.derived: dict = {}  # analyses computed once per graph, by name
    self._by_value = {r.value: r for r in self.residuals}
    self.output_ids = {o for o in self.outputs if isinstance(o, int)}


def _source(source_info) -> str:
  try:
    from jax._src import source_info_util
    return source_info_util.summarize(source_info)
  except Exception:  # pragma: no cover - private API moved
    return ""


def _join(outer: str, inner: str) -> str:
  return "/".join(p for p in (outer, inner) if p)


class _Builder:
  """One pass over the equations, inlining calls, with an env of value ids."""

  def __init__(self):
    self.nodes: list[Node] = []
    self.values: dict[int, Value] = {}
    self.consts: dict[int, Any] = {}
    self._next = 0

  def new_value(self, aval) -> int:
    vid = self._next
    self._next += 1
    self.values[vid] = Value(vid, aval, _cost.aval_bytes(aval))
    return vid

  def walk(self, jaxpr, env: dict, outer_stack: str, outer_source: str = ""):
    def read(atom):
      return atom if isinstance(atom, jex.Literal) else env[atom]

    for eqn in jaxpr.eqns:
      stack = _join(outer_stack, str(eqn.source_info.name_stack))
      body_key = _INLINE.get(eqn.primitive.name)
      body = eqn.params.get(body_key) if body_key else None
      if body is not None and not eqn.effects:
        closed = body if isinstance(body, jex.ClosedJaxpr) else None
        inner = closed.jaxpr if closed is not None else body
        inner_env = {}
        for var, const in zip(inner.constvars, closed.consts if closed else ()):
          inner_env[var] = self.add_const(var.aval, const)
        for var, atom in zip(inner.invars, eqn.invars):
          inner_env[var] = read(atom)
        self.walk(inner, inner_env, stack, outer_source or _source(eqn.source_info))
        for var, inner_atom in zip(eqn.outvars, inner.outvars):
          if isinstance(inner_atom, jex.Literal):
            inner_atom = self._literal_value(inner_atom)
          else:
            inner_atom = inner_env[inner_atom]
          env[var] = inner_atom
        continue
      ins = tuple(read(a) for a in eqn.invars)
      outs = tuple(self.new_value(v.aval) for v in eqn.outvars)
      for var, vid in zip(eqn.outvars, outs):
        env[var] = vid
      index = len(self.nodes)
      for vid in outs:
        self.values[vid].producer = index
      self.nodes.append(Node(
          index=index, prim=eqn.primitive, params=dict(eqn.params), ins=ins,
          outs=outs, name_stack=stack,
          source=outer_source or _source(eqn.source_info),
          backward="transpose(" in stack,
          flops=_cost.eqn_flops(eqn.primitive.name,
                                [a.aval for a in eqn.invars],
                                [v.aval for v in eqn.outvars], eqn.params),
          effects=eqn.effects, source_info=eqn.source_info, ctx=eqn.ctx))

  def add_const(self, aval, value) -> int:
    vid = self.new_value(aval)
    self.consts[vid] = value
    return vid

  def _literal_value(self, literal) -> int:
    return self.add_const(literal.aval, literal.val)


def build_graph(closed_jaxpr) -> Graph:
  """Flattens a step's closed jaxpr and finds its residuals.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def step(w, x):
    ...   return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4))))
    >>> [r.primitive for r in g.residuals]  # tanh(y) and 1 - tanh(y)**2
    ['tanh', 'sub']
  """
  builder = _Builder()
  jaxpr = closed_jaxpr.jaxpr
  env = {}
  for var, const in zip(jaxpr.constvars, closed_jaxpr.consts):
    env[var] = builder.add_const(var.aval, const)
  inputs = []
  for var in jaxpr.invars:
    env[var] = builder.new_value(var.aval)
    inputs.append(env[var])
  builder.walk(jaxpr, env, "")
  outputs = [a if isinstance(a, jex.Literal) else env[a] for a in jaxpr.outvars]
  nodes, values = builder.nodes, builder.values
  for node in nodes:
    for atom in node.ins:
      if isinstance(atom, int):
        values[atom].uses.append(node.index)
  backward_start = next((n.index for n in nodes if n.backward), None)
  residuals = []
  if backward_start is not None:
    # Everything after the first transpose equation is backward (optimizer
    # included), even where a name stack says otherwise.
    for node in nodes[backward_start:]:
      node.update = not node.backward  # optimizer / bookkeeping, not AD
      node.backward = True
    for node in nodes[:backward_start]:
      for vid in node.outs:
        value = values[vid]
        bwd = [u for u in value.uses if u >= backward_start]
        if not bwd:
          continue
        fwd = [u for u in value.uses if u < backward_start]
        residuals.append(Residual(
            value=vid,
            name=f"{node.readable} {node.prim.name} {node.source}".strip(),
            shape=tuple(value.aval.shape), dtype=value.aval.dtype,
            nbytes=value.nbytes, primitive=node.prim.name,
            produced_at=node.index,
            last_forward_use=max(fwd, default=node.index),
            first_backward_use=min(bwd), last_backward_use=max(bwd),
            recompute_flops=node.flops,
            needs=tuple(a for a in node.ins if isinstance(a, int)),
            recomputable=not node.effects))
  return Graph(nodes=nodes, values=values, inputs=inputs, outputs=outputs,
               consts=builder.consts, backward_start=backward_start,
               residuals=residuals)


def trace(fun, *args, **kwargs):
  """Traces ``fun`` over flat leaves; returns (closed_jaxpr, in_tree, out_tree).

  Example:
    >>> import jax.numpy as jnp
    >>> closed, _, out_tree = trace(lambda d: {"y": d["x"] * 2}, {"x": jnp.ones(3)})
    >>> out_tree.num_leaves
    1
  """
  flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
  found = {}

  def flat_fun(*leaves):
    a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
    out_leaves, found["tree"] = jax.tree_util.tree_flatten(fun(*a, **k))
    return out_leaves

  closed = jax.make_jaxpr(flat_fun)(*flat)
  return closed, in_tree, found["tree"]
