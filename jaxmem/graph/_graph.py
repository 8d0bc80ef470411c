"""The joint graph of a training step: equations, values and residuals.

``build_graph`` flattens a step's closed jaxpr into one list of nodes
(inlining nested ``jit`` / ``closed_call`` / ``custom_jvp_call`` /
``custom_vjp_call``), marks each equation forward or backward and finds the
*residuals*: forward values that backward equations read.

A backward equation is one of the outermost transposition (its name stack's
first AD wrapper is ``transpose(``; the inner gradient of a gradient penalty
is forward work of the outer one), or one that follows a backward equation
outside any AD (optimizer updates, accumulating gradients). A step may hold
several forward/backward *passes* (gradient accumulation over a Python loop,
a GAN's discriminator then generator): an equation under ``jvp(`` after a
backward one starts the next pass's forward part (:func:`forward_passes`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import re
from typing import Any, Callable, Mapping

import jax
from jax.extend import core as jex

from jaxmem.graph import _primitives

_TRANSFORMS = re.compile(r"\b(?:jvp|transpose|vmap|pmap|remat|checkpoint)\(")
_AD = re.compile(r"\b(jvp|transpose)\(")
TOP = "<top>"  # the module path of an equation no module names


def _outer_ad(stack: str) -> str | None:
  """The outermost AD wrapper of a name stack: ``"jvp"``, ``"transpose"`` or None."""
  found = _AD.search(stack)
  return found.group(1) if found else None


@dataclasses.dataclass(frozen=True, eq=False)
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
  effects: Any  # those that order it (:func:`_ordering`)
  source_info: Any
  ctx: Any
  update: bool = False  # a backward-part node outside the transposed AD

  @property
  def readable(self) -> str:
    """Module path without transform wrappers, e.g. ``Net/Block_0/Conv_0``."""
    return _readable(self.name_stack)

  @property
  def label(self) -> str:
    """Module path and primitive, e.g. ``Net/Block_0/Dense_0 dot_general``:
    how reports and errors name the equation."""
    return f"{self.readable} {self.prim.name}"

  def scope(self, depth: int = 2) -> str:
    """The module block this node works on: its module path cut after
    ``depth`` names (``GPT2/block0``), as :meth:`Graph.blocks` groups nodes."""
    return _scope(self.name_stack, depth)


# Name stacks repeat across a step's equations, and schedules ask for them
# once per equation per evaluation: each is parsed once.
@functools.lru_cache(maxsize=None)
def _readable(name_stack: str) -> str:
  path = _TRANSFORMS.sub("", name_stack).replace(")", "").strip("/")
  path = re.sub(r"/+", "/", path)
  return path or TOP


@functools.lru_cache(maxsize=None)
def _scope(name_stack: str, depth: int) -> str:
  return "/".join(_readable(name_stack).split("/")[:depth])


@dataclasses.dataclass(frozen=True, eq=False)
class Value:
  """One value of the step: an input, a constant, or an equation's output."""
  id: int
  aval: Any
  nbytes: int
  producer: int | None = None
  uses: tuple[int, ...] = ()


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


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
  """A flattened training step; immutable once built.

  Analyses of a graph that several modules need (its unplanned memory
  profile, the values XLA fuses, ...) are functions decorated with
  :func:`analysis`: each is computed once per graph and kept with it.
  """
  nodes: tuple[Node, ...]
  values: Mapping[int, Value]
  inputs: tuple[int, ...]
  outputs: tuple  # value ids or jex.Literal
  consts: Mapping[int, Any]
  backward_start: int | None
  residuals: tuple[Residual, ...]
  # What the target's compiler gives a buffer in the step as written
  # (``_xla_buffers.Buffers``); None: the memory model emulates XLA:CPU.
  buffers: Any = None
  # Optimizer-state inputs kept in host memory between steps
  # (``_state.with_hosted``): schedules copy each to the device before its
  # first reader and return its update in host memory.
  hosted: frozenset = frozenset()
  # Hosted input -> the backward node its copy to the device is issued
  # before, as (value id, node) pairs; its first reader where absent.
  hosted_at: tuple = ()
  _by_value: dict = dataclasses.field(init=False, repr=False)
  _analyses: dict = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    object.__setattr__(self, "_by_value", {r.value: r for r in self.residuals})
    object.__setattr__(self, "_analyses", {})

  def __repr__(self) -> str:
    passes = "forward and backward" if self.has_backward else "no backward pass"
    hosted = f", {len(self.hosted)} inputs on the host" if self.hosted else ""
    return (f"Graph({len(self.nodes)} equations, {len(self.values)} values, "
            f"{len(self.residuals)} residuals, {passes}{hosted})")

  @functools.cached_property
  def output_ids(self) -> frozenset[int]:
    """Ids of the values the step returns."""
    return frozenset(o for o in self.outputs if isinstance(o, int))

  @property
  def has_backward(self) -> bool:
    return self.backward_start is not None

  def is_forward_value(self, vid: int) -> bool:
    producer = self.values[vid].producer
    return producer is not None and not self.nodes[producer].backward

  def is_backward_value(self, vid: int) -> bool:
    producer = self.values[vid].producer
    return producer is not None and self.nodes[producer].backward

  def is_residual(self, vid: int) -> bool:
    return vid in self._by_value

  def residual(self, vid: int) -> Residual:
    return self._by_value[vid]

  def producer(self, vid: int) -> Node:
    """The node that makes value ``vid`` (which must not be an input)."""
    return self.nodes[self.values[vid].producer]

  def transposes_inputs(self, node: Node) -> bool:
    """Whether XLA runs ``node`` on transposed copies of its inputs: a
    convolution computing a kernel gradient (an output smaller than both
    inputs) does on XLA:CPU, and on XLA:GPU where its layouts ask for it."""
    if node.prim.name != "conv_general_dilated":
      return False
    out = self.values[node.outs[0]].nbytes
    return all(self.values[a].nbytes > out for a in node.ins if isinstance(a, int))

  def memo(self, fn: Callable, args: tuple):
    """``fn(self, *args)``, computed once per graph (see :func:`analysis`)."""
    key = (fn, args)
    if key not in self._analyses:
      self._analyses[key] = fn(self, *args)
    return self._analyses[key]

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
    return self.memo(_blocks, (depth,))


def analysis(fn: Callable) -> Callable:
  """Memoizes an analysis ``fn(graph, *args)`` on the graph it analyzes.

  The cache lives on the graph, so it goes when the graph goes: results
  that refer back to the graph form a cycle with it, which Python's cycle
  collector frees once nothing outside holds the graph (a cache keyed
  weakly on the graph would keep such results, and so the graph, alive).
  Arguments after the graph must be hashable.
  """
  @functools.wraps(fn)
  def cached(graph: Graph, *args):
    return graph.memo(fn, args)
  return cached


def _blocks(graph: Graph, depth: int) -> dict[str, list[int]]:
  found: dict[str, list[int]] = {}
  for node in graph.nodes:
    path = node.readable
    if not node.backward and path != TOP and path.count("/") + 1 >= depth:
      found.setdefault(node.scope(depth), []).append(node.index)
  return found


# Libraries' files: a residual made inside Flax, optax or jaxmem is named by
# the line of the user's code that called into them.
_LIBRARY_DIRS = ("site-packages", "dist-packages", os.path.dirname(os.path.abspath(__file__)))


def _source(source_info) -> str:
  """The innermost line of the user's own code that made an equation:
  ``file.py:line (function)``, the file relative to the working directory
  where it lies under it."""
  try:
    from jax._src import source_info_util
    frames = list(itertools.islice(source_info_util.user_frames(source_info.traceback), 64))
  except Exception:  # pragma: no cover - private API moved
    return ""
  if not frames:
    return ""
  frame = next((f for f in frames if not any(d in f.file_name for d in _LIBRARY_DIRS)),
               frames[0])
  name = _shown_path(frame.file_name, os.getcwd())
  column = f":{frame.start_column}" if frame.start_column else ""
  return f"{name}:{frame.start_line}{column} ({frame.function_name})"


@functools.lru_cache(maxsize=4096)
def _shown_path(name: str, cwd: str) -> str:
  """A source file as reports name it: relative to ``cwd`` where it lies
  under it (asked once per file, not once per equation)."""
  if os.path.isabs(name) and name.startswith(cwd + os.sep):
    return os.path.relpath(name, cwd)
  return name


def _join(outer: str, inner: str) -> str:
  return "/".join(p for p in (outer, inner) if p)


class _Builder:
  """One pass over the equations, inlining calls, with an env of value ids."""

  def __init__(self, inline: frozenset = frozenset()):
    self.inline_also = inline
    self.nodes: list[Node] = []
    self.avals: dict[int, Any] = {}
    self.producers: dict[int, int] = {}
    self.consts: dict[int, Any] = {}
    self._next = 0

  def new_value(self, aval) -> int:
    vid = self._next
    self._next += 1
    self.avals[vid] = aval
    return vid

  def walk(self, jaxpr, env: dict, outer_stack: str, outer_source: str = ""):
    def read(atom):
      return atom if isinstance(atom, jex.Literal) else env[atom]

    for eqn in jaxpr.eqns:
      stack = _join(outer_stack, str(eqn.source_info.name_stack))
      body_key = _primitives.inlined_body(eqn.primitive.name) or (
          "jaxpr" if eqn.primitive.name in self.inline_also else None)
      body = eqn.params.get(body_key) if body_key else None
      if body is not None:  # its effectful equations (a debug print) come in as nodes too
        self.inline(body, eqn, env, stack, outer_source or _source(eqn.source_info))
        continue
      ins = tuple(read(a) for a in eqn.invars)
      outs = tuple(self.new_value(v.aval) for v in eqn.outvars)
      for var, vid in zip(eqn.outvars, outs):
        env[var] = vid
      index = len(self.nodes)
      for vid in outs:
        self.producers[vid] = index
      self.nodes.append(Node(
          index=index, prim=eqn.primitive, params=dict(eqn.params), ins=ins,
          outs=outs, name_stack=stack,
          source=outer_source or _source(eqn.source_info),
          backward=_outer_ad(stack) == "transpose",
          flops=_primitives.eqn_flops(eqn.primitive.name,
                                      [a.aval for a in eqn.invars],
                                      [v.aval for v in eqn.outvars], eqn.params),
          effects=_ordering(eqn.effects), source_info=eqn.source_info, ctx=eqn.ctx))

  def inline(self, body, eqn, env: dict, stack: str, source: str) -> None:
    """Walks a call's body in place of the call, binding its outputs in ``env``."""
    closed = body if isinstance(body, jex.ClosedJaxpr) else None
    inner = closed.jaxpr if closed is not None else body
    inner_env = {}
    for var, const in zip(inner.constvars, closed.consts if closed else ()):
      inner_env[var] = self.add_const(var.aval, const)
    for var, atom in zip(inner.invars, eqn.invars):
      inner_env[var] = atom if isinstance(atom, jex.Literal) else env[atom]
    self.walk(inner, inner_env, stack, source)
    for var, inner_atom in zip(eqn.outvars, inner.outvars):
      if isinstance(inner_atom, jex.Literal):
        env[var] = self.add_const(inner_atom.aval, inner_atom.val)
      else:
        env[var] = inner_env[inner_atom]

  def add_const(self, aval, value) -> int:
    vid = self.new_value(aval)
    self.consts[vid] = value
    return vid

  def values(self) -> dict[int, Value]:
    """The values, each with the nodes that read it."""
    uses: dict[int, list[int]] = {vid: [] for vid in self.avals}
    for node in self.nodes:
      for atom in node.ins:
        if isinstance(atom, int):
          uses[atom].append(node.index)
    return {vid: Value(vid, aval, _primitives.aval_bytes(aval), self.producers.get(vid),
                       tuple(uses[vid]))
            for vid, aval in self.avals.items()}


def _ordering(effects) -> frozenset:
  """An equation's effects less the names of mesh axes its collectives use
  (JAX's ``NamedAxisEffect``, matched by name: its home module moves
  between releases): they order nothing, and only a gather's value is
  rebuilt by running its collective again (``_primitives.rebuildable``)."""
  return frozenset(e for e in effects if type(e).__name__ != "NamedAxisEffect")


def build_graph(closed_jaxpr, inline: frozenset = frozenset()) -> Graph:
  """Flattens a step's closed jaxpr and finds its residuals; the bodies of
  the primitives named in ``inline`` (whose body is their ``jaxpr``
  param, as ``jax.checkpoint``'s ``remat2``) are inlined too.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def step(w, x):
    ...   return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4))))
    >>> [r.primitive for r in g.residuals]  # tanh(y) and 1 - tanh(y)**2
    ['tanh', 'sub']
  """
  builder = _Builder(frozenset(inline))
  jaxpr = closed_jaxpr.jaxpr
  env = {}
  for var, const in zip(jaxpr.constvars, closed_jaxpr.consts):
    env[var] = builder.add_const(var.aval, const)
  inputs = []
  for var in jaxpr.invars:
    env[var] = builder.new_value(var.aval)
    inputs.append(env[var])
  builder.walk(jaxpr, env, "")
  outputs = tuple(a if isinstance(a, jex.Literal) else env[a] for a in jaxpr.outvars)
  nodes = builder.nodes
  nodes[:] = _mark_passes(nodes)
  backward_start = next((n.index for n in nodes if n.backward), None)
  values = builder.values()
  return Graph(nodes=tuple(nodes), values=values, inputs=tuple(inputs), outputs=outputs,
               consts=builder.consts, backward_start=backward_start,
               residuals=residuals_of(nodes, values))


def _mark_passes(nodes: list[Node]) -> list[Node]:
  """``nodes`` with ``backward`` and ``update`` set by pass (module
  docstring): a transposed equation is backward; after one, equations
  outside AD are backward updates until one under ``jvp(`` starts a forward
  part again. After a loop whose body runs the passes (gradient
  accumulation, micro-batches), equations outside AD are updates too, and
  stay forward: the step's own passes are the loop's."""
  marked, in_backward, after_passes = [], False, False
  for node in nodes:
    if node.backward:
      in_backward = True
    elif in_backward and _outer_ad(node.name_stack) == "jvp":
      in_backward = False
    if in_backward and not node.backward:
      node = dataclasses.replace(node, backward=True, update=True)
    elif after_passes and _outer_ad(node.name_stack) is None:
      node = dataclasses.replace(node, update=True)
    marked.append(node)
    after_passes = after_passes or node.prim.name == "scan" and any(  # a loop of passes
        _outer_ad(str(e.source_info.name_stack)) == "transpose"
        for e in node.params["jaxpr"].jaxpr.eqns)
  return marked


@analysis
def forward_passes(graph: Graph) -> tuple[tuple[int, ...], ...]:
  """The forward parts of the step's passes, each the indices of its
  consecutive forward nodes; a later one begins after a backward node.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
    >>> step = lambda w, x: jax.grad(loss)(w, x[0]) + jax.grad(loss)(w, x[1])
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 3, 4))))
    >>> len(forward_passes(g))
    2
  """
  passes: list[list[int]] = []
  previous_backward = True
  for node in graph.nodes:
    if not node.backward:
      if previous_backward:
        passes.append([])
      passes[-1].append(node.index)
    previous_backward = node.backward
  return tuple(map(tuple, passes))


def residuals_of(nodes, values) -> tuple[Residual, ...]:
  """The forward values that backward nodes read."""
  found = []
  for node in nodes:
    if node.backward:
      continue
    for vid in node.outs:
      value = values[vid]
      bwd = [u for u in value.uses if nodes[u].backward]
      if not bwd:
        continue
      found.append(residual_of(nodes, values, vid, node, min(bwd), max(bwd)))
  return tuple(found)


def residual_of(nodes, values, vid: int, node, first: int, last: int) -> Residual:
  """The residual ``vid`` made by ``node`` (of the graph's ``nodes`` and
  ``values``), read by the backward pass from node ``first`` to node
  ``last``."""
  value = values[vid]
  fwd = [u for u in value.uses if not nodes[u].backward]
  return Residual(
      value=vid, name=f"{node.label} {node.source}".strip(),
      shape=tuple(value.aval.shape), dtype=value.aval.dtype,
      nbytes=value.nbytes, primitive=node.prim.name, produced_at=node.index,
      last_forward_use=max(fwd, default=node.index),
      first_backward_use=first, last_backward_use=last,
      recompute_flops=node.flops, needs=tuple(a for a in node.ins if isinstance(a, int)),
      recomputable=not node.effects and _primitives.rebuildable(node.prim.name))


def trace(jitted, *args, **kwargs):
  """Traces a ``jax.jit``-wrapped step (its static arguments marked there)
  for ``args``; returns (closed_jaxpr over the dynamic leaves, out_tree).

  Tracing through ``jax.jit`` makes a mistake in the step jax.jit's error,
  which names the user's function and the argument or output path.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> closed, out_tree = trace(jax.jit(lambda d: {"y": d["x"] * 2}), {"x": jnp.ones(3)})
    >>> out_tree.num_leaves
    1
  """
  traced = jitted.trace(*args, **kwargs)
  return traced.jaxpr, jax.tree_util.tree_structure(traced.out_info)
