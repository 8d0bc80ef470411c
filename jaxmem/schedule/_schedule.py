"""The schedule builder: a plan applied to the step's equations, in order.

A schedule is the rewritten program as data: a list of :class:`Op`, each
reading and writing *keys* ``(value id, version)``. Version 0 is the value as
the original step makes it; recomputed copies get new versions. The memory
model (``_memory``) simulates a schedule and the emitter (``_emit``) runs it,
so what is predicted is exactly what is compiled.

Recomputation (:class:`~jaxmem._decisions.Recompute`): before a backward equation
that reads a dropped residual, the forward equations that rebuild it are
re-run from *kept* values only (step inputs, constants, kept residuals,
forward values the plan saves as block boundaries (:class:`~jaxmem._decisions.Save`),
and copies recomputed earlier and still in use), never from a forward value
that happens to be at hand (that would keep it alive and save nothing).
Intermediates rebuilt for one block's backward pass are reused by its later
recomputations (as ``jax.checkpoint`` rebuilds a block once) and dropped when
the backward pass moves to another block. The kept values enter the
recomputation through one ``optimization_barrier`` together with an anchor,
the latest backward value emitted that is read again (``_Builder.anchor``),
so XLA can neither merge the copy with the forward value (CSE) nor hoist it
to the start of the backward pass. A dropped residual rebuilt on the way is
kept for its own later backward uses; other forward intermediates die inside
their group. The same barrier-with-anchor (``_Builder.pin``) keeps XLA from
transposing a kernel-gradient convolution's inputs before it runs, and,
in a plan that changes anything, separates backward reads that XLA would
otherwise share with the forward pass (``_Builder.separate``). A block rebuilt
whole (``Recompute.with_block``) is rebuilt where its backward pass starts, behind
one barrier with all that pass reads from outside, as in ``jax.checkpoint``.

Optimizer updates move up to just after their gradient (:func:`emission_order`).
"""

from __future__ import annotations

import dataclasses
import itertools

from jax.extend import core as jex

from jaxmem._decisions import Plan
from jaxmem.graph._graph import Graph, forward_passes
from jaxmem.schedule._order import (block_inputs, emission_order, emission_position,
                                    entering_values, rebuilt_with_block)
from jaxmem.graph._state import hosted_outputs
from jaxmem.graph._xla_cpu_fusion import readable, rebuilt_in_readers, separated_reads

Key = tuple  # (value id, version)


@dataclasses.dataclass(frozen=True)
class Op:
  """One step of a schedule.

  Attributes:
    kind: ``"node"`` (an original equation), ``"recompute"`` (a re-run forward
      equation), ``"barrier"`` (an ``optimization_barrier``; outputs alias
      inputs), ``"offload"`` (a copy to host memory), ``"prefetch"`` (a
      copy back to the device), ``"split"`` (a value cut into chunks, each
      its own buffer) or ``"merge"`` (chunks joined into one value).
    node: index of the graph node run (None for the other kinds).
    ins: input keys or ``jex.Literal``.
    outs: output keys.
    params: ``(axis, bounds)`` of a split, ``(axis,)`` of a merge; for a
      node, ``(run,)`` where the equation is re-emitted by ``run(*ins) ->
      outs`` (a scan whose stacked residuals are rebuilt or hosted,
      ``_loop_schedule``; a backward one's ``(run, inside)``, ``Inside``).
  """
  kind: str
  node: int | None
  ins: tuple
  outs: tuple
  params: tuple = ()


@dataclasses.dataclass
class Schedule:
  """A rewritten step: ops over keys, with its inputs and outputs."""
  graph: Graph
  plan: Plan
  ops: list[Op]
  inputs: list[Key]
  outputs: list  # keys or jex.Literal
  recompute_flops: float
  sizes: dict = dataclasses.field(default_factory=dict)  # chunk key -> bytes
  # Copy back's key -> what it copies: a residual's id, or (id, chunk index).
  fetched: dict = dataclasses.field(default_factory=dict)
  hosted: frozenset = frozenset()  # host stacks of a loop (``_loop_schedule``)

  def nbytes(self, key: Key) -> int:
    """Bytes of the buffer behind ``key`` (a chunk's own size for chunks)."""
    return self.sizes.get(key) or self.graph.values[key[0]].nbytes

  def first_reads(self) -> dict:
    """Key -> position of the first op that reads it."""
    first: dict = {}
    for pos, op in enumerate(self.ops):
      for key in op.ins:
        if isinstance(key, tuple):
          first.setdefault(key, pos)
    return first

  @property
  def nodes(self):
    return self.graph.nodes


class _Builder:
  """Walks the graph once, emitting ops; the env maps value id -> live key."""

  def __init__(self, graph: Graph, plan: Plan, fused: dict, separating: bool,
               pinning: bool):
    self.graph, self.plan, self.fused = graph, plan, fused
    self.separating = separating
    self.saved = plan.values_with("save")
    # Block scope -> its residuals rebuilt with the block
    # (``Recompute.with_block``). Such a plan leaves backward reads
    # unseparated and kernel gradients unpinned, as per-block
    # ``jax.checkpoint`` does: a barrier copy ends a fusion that
    # ``jax.checkpoint``'s program keeps (on a T4, MobileNetV2's activation
    # and its padding, read by a depthwise convolution and its kernel
    # gradient).
    self.with_block = rebuilt_with_block(graph, plan)
    self.separate_reads = separating and not self.with_block
    self.pinning = pinning and not self.with_block
    # What goes to host memory is a *unit*: an offloaded residual's id, or
    # (id, chunk index) for a chunk of a vTensor. Unit -> its host copy /
    # its copy back; backward node -> the units copied back before it.
    self.offloaded = plan.with_kind("offload")
    self.chunked = plan.with_kind("chunked")
    self.dropped = plan.values_with("recompute") | rebuilt_in_readers(graph, plan, fused)
    self.available = readable(graph, fused, self.dropped, self.saved)
    self.ops: list[Op] = []
    self.cache: dict[int, Key] = {}  # dropped residual -> recomputed key
    # Other recomputed values, reused while the backward pass stays in the
    # block they were rebuilt for (``scope``).
    self.scratch: dict[int, Key] = {}
    self.scope: str | None = None
    # Kept values a recomputation in ``scope`` read through its barrier ->
    # the barrier copy, which the block's backward equations read too (as
    # in ``jax.checkpoint``), so XLA can fuse what they compute from it with
    # the recomputation (a LayerNorm's backward with its statistics).
    self.pinned: dict[int, Key] = {}
    # Backward value -> its latest barrier copy, which later readers read
    # (XLA cannot prune it out of the barrier that orders a group).
    self.routed: dict[int, Key] = {}
    self._versions = itertools.count(1)
    self.recompute_flops = 0.0
    self.made: list[int] = []  # backward values emitted so far
    # Value whose backward reads are separated -> its barrier copy.
    self.separated: dict[int, Key] = {}
    # Backward node -> operands read through a separated copy / rebuilt
    # from such copies (``_xla_cpu_fusion.separated_reads``).
    self.to_separate, self.to_rebuild = separated_reads(
        graph, frozenset(fused.items()))
    self.host: dict = {}
    self.fetched: dict = {}
    self.chunks: dict[int, list[Key]] = {}  # vTensor -> its chunks' keys
    self.sizes: dict[Key, int] = {}
    self.fetch_at: dict[int, list] = {}
    self.forward_copy: dict[int, Key] = {}  # master weight -> its copy for the casts
    # Optimizer state kept on the host comes in there, fetched like a residual.
    self.host.update((vid, self.key(vid)) for vid in graph.hosted)
    for vid, at in graph.hosted_at:
      self.fetch_at.setdefault(at, []).append(vid)
    self.state_out = {graph.outputs[pos] for pos in hosted_outputs(graph)}
    offloads = [(vid, d) for vid, d in self.offloaded.items()]
    offloads += [((vid, i), c.chunks[i]) for vid, c in self.chunked.items()
                 for i in c.offloaded]
    for unit, decision in sorted(offloads, key=lambda item: str(item[0])):
      vid = unit if isinstance(unit, int) else unit[0]
      at = decision.at if decision.at is not None else graph.residual(vid).first_backward_use
      self.fetch_at.setdefault(at, []).append(unit)

  def key(self, vid: int) -> Key:
    return (vid, 0)

  def fresh(self, vid: int) -> Key:
    return (vid, next(self._versions))

  def run(self) -> Schedule:
    graph = self.graph
    starts = {p[0]: p for p in forward_passes(graph)[1:]} if self.separating else {}
    for node in emission_order(graph):
      if node.index in starts:
        self.enter(starts[node.index], node)
      late = node.backward or node.update  # or an update after a loop of passes
      if node.backward and node.index in self.fetch_at:
        self.prefetch(self.fetch_at[node.index], node)
      if late and (self.offloaded or graph.hosted):
        self.prefetch([a for a in node.ins if isinstance(a, int)
                       and (a in self.offloaded or a in graph.hosted)], node)
      elif graph.hosted:
        self.fetch_forward(node)
      if node.backward:
        for a in node.ins if self.chunked else ():
          if isinstance(a, int) and a in self.chunked:
            self.merge(a, node)
        missing = [a for a in node.ins if isinstance(a, int)
                   and a in self.dropped and a not in self.cache] if self.dropped else ()
        if missing or (self.with_block and node.scope() in self.with_block
                       and node.scope() != self.scope):
          # A block rebuilt whole starts: its reads all go through one barrier.
          self.recompute(missing, node)
        if self.separate_reads:
          rebuild = [a for a in self.to_rebuild.get(node.index, ())
                     if a not in self.cache and a not in self.dropped]
          if rebuild:
            self.recompute(rebuild, node, separated=True)
      ins = tuple([self.read(a, late) for a in node.ins])
      if node.backward and self.pinned and node.scope() == self.scope:
        ins = self.copies_read(node, ins, self.pinned)
      if node.backward and self.separate_reads:
        ins = self.separate(node, ins)
      if node.backward and self.pinning and graph.transposes_inputs(node):
        # XLA would transpose these inputs as soon as they exist and hold
        # the copies until here; reading them through a barrier at this
        # point keeps the copies to the convolution itself.
        ins = self.pin(ins, node, max(graph.values[v].nbytes for v in node.outs))
      self.ops.append(Op("node", node.index, ins, tuple(map(self.key, node.outs))))
      if node.backward:
        self.made.extend(node.outs)
      for vid in node.outs:
        # An offloaded residual, or an update of state kept on the host.
        if vid in (self.state_out if late else self.offloaded):
          self.offload(vid, self.key(vid))
        elif not node.backward and vid in self.chunked:
          self.split(vid)
    outputs = [o if isinstance(o, jex.Literal) else self.host[o] if o in self.state_out
               else self.key(o) if o in graph.hosted else self.read(o, True)
               for o in graph.outputs]
    return Schedule(graph, self.plan, self.ops, [self.key(v) for v in graph.inputs],
                    outputs, self.recompute_flops, self.sizes,
                    {key: unit for unit, key in self.fetched.items()})

  def enter(self, nodes: tuple, first) -> None:
    """Starts a later pass's forward part (``forward_passes``): what its
    nodes read from outside the pass passes through one barrier with an
    anchor from the backward pass before it (``pin``), so XLA runs the
    passes in turn instead of this forward part beside the previous
    backward part (each pass's residuals die before the next pass starts)."""
    inside = set(nodes)
    outside = sorted({a for i in nodes for a in self.graph.nodes[i].ins
                      if isinstance(a, int) and a not in self.graph.consts
                      and self.graph.values[a].producer not in inside})
    if not outside:
      return
    size = max((self.graph.values[v].nbytes for i in nodes for v in self.graph.nodes[i].outs),
               default=0)
    copies = self.pin(tuple(self.read(a, False) for a in outside), first, size)
    self.routed.update(zip(outside, copies))

  def read(self, atom, backward: bool):
    if isinstance(atom, jex.Literal):
      return atom
    return ((self.cache if backward else self.forward_copy).get(atom)
            or self.routed.get(atom) or self.key(atom))

  def recompute(self, missing: list[int], consumer, separated: bool = False) -> None:
    """Re-runs the forward equations that rebuild ``missing`` before
    ``consumer``; with ``separated``, from the separated copies of the kept
    values it starts from (see ``separate``), and ``missing`` are kept for
    later backward reads. Where a block's backward pass starts, the block's
    residuals rebuilt with it (``Recompute.with_block``) are rebuilt, behind
    one barrier with all the block's backward pass reads from the forward
    pass and the gradient entering the block (``entering``)."""
    graph = self.graph
    scope = consumer.scope()
    entering, starting = None, False
    if scope != self.scope:
      self.scope, self.scratch, self.pinned = scope, {}, {}
      if scope in self.with_block and not separated:
        together = [v for v in self.with_block[scope]
                    if v not in self.cache and v not in missing]
        missing, entering, starting = [*missing, *together], self.entering(scope), True
    to_run: set[int] = set()
    leaves: set[int] = set()
    stack = list(missing)
    while stack:
      vid = stack.pop()
      if vid in self.offloaded or vid in graph.hosted:
        self.prefetch([vid], consumer)  # rebuilt from its copy back
      elif vid in self.chunked:
        self.merge(vid, consumer)
      if vid in self.cache or vid in self.scratch:
        continue
      if self.available(vid):
        leaves.add(vid)
        continue
      producer = graph.values[vid].producer
      if producer in to_run:
        continue
      to_run.add(producer)
      stack.extend(a for a in graph.nodes[producer].ins if isinstance(a, int))
    if starting:
      # All of them, or XLA makes what the pass needs of one (a transposed
      # activation, a flipped kernel) in the forward pass or an update.
      leaves |= {v for v in block_inputs(graph, scope) if self.available(v)
                 and v not in self.offloaded and v not in graph.hosted}
    local: dict[int, Key] = {}
    tied = sorted(v for v in leaves if v not in graph.consts)
    if separated:
      local.update((v, self.separated[v]) for v in tied if v in self.separated)
      tied = [v for v in tied if v not in self.separated]
    if tied:
      size = max((graph.values[v].nbytes for n in to_run for v in graph.nodes[n].outs),
                 default=0)
      copies = self.pin(tuple(map(self.key, tied)), consumer, size, entering)
      local.update(zip(tied, copies))
      self.pinned.update(zip(tied, copies))
      if separated:
        self.separated.update(zip(tied, copies))
    for index in sorted(to_run):
      node = graph.nodes[index]
      ins = tuple(a if isinstance(a, jex.Literal) else
                  local.get(a) or self.cache.get(a) or self.scratch.get(a) or self.key(a)
                  for a in node.ins)
      outs = tuple(self.fresh(v) for v in node.outs)
      for vid, key in zip(node.outs, outs):
        local[vid] = key
        if vid in self.dropped or (separated and vid in missing):
          self.cache[vid] = key
        else:
          self.scratch[vid] = key
      self.recompute_flops += node.flops
      self.ops.append(Op("recompute", index, ins, outs))

  def offload(self, unit, key: Key) -> None:
    """Copies a residual (or a vTensor's chunk, ``key``) to host memory
    right after it is made."""
    self.host[unit] = self.sized(self.fresh(key[0]), key)
    self.ops.append(Op("offload", None, (key,), (self.host[unit],)))

  def fetch_forward(self, node) -> None:
    """Copies the master weights kept on the host (``graph._state``) that
    forward ``node`` casts to the device; the copy dies after the casts,
    and the update fetches the weight again (``prefetch``)."""
    for vid in node.ins:
      if isinstance(vid, int) and vid in self.graph.hosted and vid not in self.forward_copy:
        self.forward_copy[vid] = self.fresh(vid)
        self.ops.append(Op("prefetch", None, (self.key(vid),), (self.forward_copy[vid],)))

  def prefetch(self, units, consumer) -> None:
    """Copies offloaded residuals and chunks back to the device before
    ``consumer``. Their host copies pass through one barrier with an anchor
    (``pin``) first, so XLA cannot issue the copies earlier than here and
    hold the device buffers from the start of the backward pass."""
    units = [u for u in dict.fromkeys(units) if u not in self.fetched]
    if not units:
      return
    size = max(self.nbytes(self.host[u]) for u in units)
    hosts = self.pin(tuple(self.host[u] for u in units), consumer, size)
    for unit, host in zip(units, hosts):
      self.fetched[unit] = self.sized(self.fresh(host[0]), host)
      if isinstance(unit, int):
        self.cache[unit] = self.fetched[unit]
      self.ops.append(Op("prefetch", None, (host,), (self.fetched[unit],)))

  def split(self, vid: int) -> None:
    """vTensor ``split`` and ``salloc``: cuts a residual into its chunks
    right after it is made, each in a buffer of its own (the emitter ties
    them with a barrier, so XLA cannot keep reading the whole value), and
    copies the offloaded ones to host memory. The whole value is freed
    after its last forward use."""
    decision = self.chunked[vid]
    keys = tuple(self.fresh(vid) for _ in decision.bounds)
    for key, nbytes in zip(keys, decision.chunk_bytes(
        self.graph.values[vid].aval.shape, self.graph.values[vid].nbytes)):
      self.sizes[key] = nbytes
    self.ops.append(Op("split", None, (self.key(vid),), keys,
                       (decision.axis, decision.bounds)))
    self.chunks[vid] = list(keys)
    for i in decision.offloaded:
      self.offload((vid, i), keys[i])

  def merge(self, vid: int, consumer) -> None:
    """vTensor ``merge``: before the first backward reader of a chunked
    residual, copies back the chunks still on the host and joins all chunks
    into one value, which the backward pass reads from then on."""
    if vid in self.cache:
      return
    decision = self.chunked[vid]
    self.prefetch([(vid, i) for i in decision.offloaded], consumer)
    ins = tuple(self.fetched.get((vid, i), key) for i, key in enumerate(self.chunks[vid]))
    self.cache[vid] = self.fresh(vid)
    self.ops.append(Op("merge", None, ins, (self.cache[vid],), (decision.axis,)))

  def sized(self, key: Key, like: Key) -> Key:
    """``key``, recorded with the size of ``like`` where that is a chunk's."""
    if like in self.sizes:
      self.sizes[key] = self.sizes[like]
    return key

  def nbytes(self, key: Key) -> int:
    return self.sizes.get(key) or self.graph.values[key[0]].nbytes

  def separate(self, node, ins: tuple) -> tuple:
    """Backward reads that XLA would otherwise share with the forward pass go
    through a barrier copy, one per value (which reads, and why:
    ``_xla_cpu_fusion.separated_reads``)."""
    wanted = self.to_separate.get(node.index, ())
    read_as = {a: k for a, k in zip(node.ins, ins) if isinstance(a, int)} if wanted else {}
    missing = sorted(a for a in wanted if read_as[a] == self.key(a) and a not in self.separated)
    if missing:
      size = self.graph.values[node.outs[0]].nbytes
      copies = self.pin(tuple(map(self.key, missing)), node, size)
      self.separated.update(zip(missing, copies))
    return self.copies_read(node, ins, self.separated)

  def copies_read(self, node, ins: tuple, copies: dict) -> tuple:
    """``node``'s input keys ``ins`` with each original value that has a
    barrier copy in ``copies`` read through the copy."""
    if not copies or not any(isinstance(a, int) and a in copies for a in node.ins):
      return ins
    return tuple(copies.get(a, k) if isinstance(a, int) and k == self.key(a)
                 else k for a, k in zip(node.ins, ins))

  def pin(self, keys: tuple, consumer, size: int, anchor: int | None = None) -> tuple:
    """Passes non-literal ``keys`` through one barrier with an anchor
    (``anchor`` where given, else see ``anchor``), so what reads the copies
    runs after the anchor; returns ``keys`` with copies in place of the
    originals."""
    real = [k for k in keys if not isinstance(k, jex.Literal)]
    if not real:
      return keys
    anchor = self.anchor(consumer, size) if anchor is None else anchor
    ins = tuple(real) + ((self.read(anchor, True),) if anchor is not None else ())
    outs = tuple(self.sized(self.fresh(k[0]), k) for k in ins)
    self.ops.append(Op("barrier", None, ins, outs))
    if anchor is not None:
      # Later readers of the anchor read its barrier copy, so XLA cannot
      # prune the anchor out of the barrier.
      self.routed[anchor] = outs[-1]
    copies = dict(zip(real, outs))
    return tuple(copies.get(k, k) if not isinstance(k, jex.Literal) else k
                 for k in keys)

  def entering(self, scope: str) -> int | None:
    """The gradient entering block ``scope``: the latest backward value
    emitted that the block's backward equations read and none of them
    made. Tied to the block's recomputation in one barrier (as per-block
    ``jax.checkpoint`` does), so XLA runs it no earlier than that."""
    outside = entering_values(self.graph, scope)
    return next((v for v in reversed(self.made) if v in outside), None)

  def anchor(self, consumer, size: int) -> int | None:
    """The backward value that orders a group before ``consumer``: the
    latest one emitted that is read again at or after ``consumer`` (those
    reads go through the barrier copy, so XLA cannot prune the anchor out
    of the barrier) and that XLA gives a buffer of its own anyway, or is
    small (under 1/16 of ``size``, the group's largest value).

    Not the consumer's own latest backward input: that may be made at the
    start of the backward pass (a cotangent of the loss, a statistic), and
    XLA's scheduler then hoists the group there and holds its results
    through the backward pass. Large values XLA computes inside their
    readers are passed over: a barrier would give one a buffer, and XLA
    merges equal broadcasts across barriers into one that lives the whole
    step.
    """
    graph = self.graph
    position = emission_position(graph)
    now = position[consumer.index]
    for vid in reversed(self.made[-64:]):
      if vid in self.fused and graph.values[vid].nbytes * 16 > size:
        continue
      if vid in graph.output_ids or any(position[u] >= now
                                        for u in graph.values[vid].uses):
        return vid
    return None


def build_schedule(graph: Graph, plan: Plan, fused: dict | None = None,
                   separate: bool = True, pin: bool | None = None) -> Schedule:
  """Applies ``plan`` to ``graph``; see the module docstring.

  Args:
    graph: the step's joint graph.
    plan: decisions per residual.
    fused: forward values that XLA computes inside their readers rather than
      in a buffer of their own, each with the buffers it is computed from
      (see ``_evaluate.fused_values``); recomputation reads those buffers
      instead of the value.
    separate: whether backward reads that XLA would share with the forward
      pass are separated from it (``_Builder.separate``); off, a plan that
      keeps everything gives back the step as it was.
    pin: whether kernel gradients read their inputs through barriers
      (below); by default in plans, and where ``graph`` has no buffers.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph._graph import build_graph
    >>> from jaxmem._decisions import Plan, RECOMPUTE
    >>> step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4))))
    >>> s = build_schedule(g, Plan().with_decision(g.residuals[0].value, RECOMPUTE))
    >>> [op.kind for op in s.ops].count("recompute")
    2
  """
  pin = (separate or graph.buffers is None) if pin is None else pin
  return _Builder(graph, plan, fused or {}, separate, pin).run()
