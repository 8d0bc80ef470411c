"""Recomputation inside a loop: stacked residuals rebuilt per iteration of the
backward scan.

A forward scan emits each residual of its body stacked as ``[L, ...]``; the
backward scan reads slice ``i`` in its iteration ``i`` (``_loops``). To drop
such a stacked output, the forward scan is re-emitted without it, and the
backward scan's body first runs the forward body for its iteration — from
the forward scan's constants, its ``xs`` slice and the carry slice it kept
— and reads the dropped slice from that. This is what ``jax.checkpoint``
around a scan body does, decided after differentiation and per residual:
the stack's bytes go, one iteration's forward work is added per backward
iteration, and the program stays a scan (its size does not grow with L).

A stacked output can be rebuilt when the backward scans read it only as a
per-iteration ``xs`` slice (:func:`rebuildable`). The rebuild starts from
the body's carry-ins kept stacked: the scan's own output where it stacks
one (a matmul's input is a residual), else an output the re-emitted scan
adds (a Flax pre-LN block's input, which only its LayerNorm reads). Random
keys are values in JAX, so a rebuilt dropout mask is the forward one, bit
for bit.

A stacked output read the same way can instead go to host memory one slice
per iteration (:func:`hostable`): the forward body copies its slice to
``pinned_host``, so the scan stacks it there, and the backward body copies
its slice back before reading it (:func:`fetching`), so only one iteration's
slice is on the device at a time. This is what an offload policy
(``save_and_offload_only_these_names``) inside a scanned ``jax.checkpoint``
does, decided per residual after differentiation.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> def step(ws, x):
  ...   def loss(ws):
  ...     h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, ws)
  ...     return jnp.sum(h)
  ...   return jax.grad(loss)(ws)
  >>> g = build_graph(jax.make_jaxpr(step)(jnp.ones((8, 4, 4)), jnp.ones((2, 4))))
  >>> [g.values[v].aval.shape for v in sorted(rebuildable(g))]  # tanh, 1 - tanh
  [(8, 2, 4), (8, 2, 4)]
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
from jax.extend import core as jex

from jaxmem._decisions import OFFLOAD, RECOMPUTE, Plan
from jaxmem.graph._graph import Graph, Node, analysis
from jaxmem.graph._loops import loops


@dataclasses.dataclass(frozen=True)
class Iteration:
  """One iteration of a rewritten backward scan, for the memory model to
  size its body by (``cost._memory._held_inside``).

  Attributes:
    backward: the backward scan's node index.
    forward: the forward scan whose body rebuilds the ``xs`` at ``rebuilt``.
    rebuilt: ``(input position, forward output position)`` pairs of the
      ``xs`` made again each iteration.
    fetched: bytes of the slices copied from host memory each iteration.
    done: keys of the op's inputs that only the segments run before this
      one read (gone while it runs where the op reads them last).
    once: input positions of the ``xs`` read from the segment's own kept
      pieces where it runs one iteration: XLA inlines a loop of one
      iteration, so each such slice goes once its last reader has run.
  """
  backward: int
  forward: int | None = None
  rebuilt: tuple = ()
  fetched: int = 0
  done: tuple = ()
  once: tuple = ()


@dataclasses.dataclass(frozen=True)
class Inside:
  """What a rewritten backward scan's op holds while it runs beyond its
  inputs and outputs: the largest body of its ``iterations`` (one per
  segment it runs, :class:`Iteration`), with ``beside`` bytes (a nested
  loop's group of rebuilt slices). The op's params are ``(run, inside)``."""
  iterations: tuple
  beside: int = 0


def scan_shape(node: Node) -> tuple[int, int, int]:
  p = node.params
  return p["num_consts"], p["num_carry"], p["length"]


def carry_outputs(node: Node) -> dict[int, int]:
  """Carry position -> the forward scan's output that stacks the body's
  carry-in, for the carries it stacks."""
  consts, carries, _ = scan_shape(node)
  body = node.params["jaxpr"].jaxpr
  found = {}
  for out, var in enumerate(body.outvars):
    if out < carries or isinstance(var, jex.Literal):
      continue
    for c in range(carries):
      if var is body.invars[consts + c]:
        found.setdefault(c, out)
  return found


def unstacked_carries(node: Node) -> list[int]:
  """The carry positions whose carry-ins the forward scan does not stack."""
  stacked = carry_outputs(node)
  return [c for c in range(scan_shape(node)[1]) if c not in stacked]


def _xs_position(node: Node, position: int) -> bool:
  consts, carries, _ = scan_shape(node)
  return position >= consts + carries


def _read_per_iteration(graph: Graph, forward: Node, vid: int) -> bool:
  """Whether only backward scans of the same length read ``vid``, each once
  and as an ``xs`` slice."""
  readers = [graph.nodes[u] for u in graph.values[vid].uses]
  return bool(readers) and all(
      r.prim.name == "scan" and r.backward
      and r.params["length"] == forward.params["length"]
      and r.ins.count(vid) == 1 and _xs_position(r, r.ins.index(vid)) for r in readers)


@analysis
def rebuildable(graph: Graph) -> dict[int, tuple[int, int]]:
  """Stacked residual value id -> (forward scan node, output position), for
  those that can be rebuilt in their backward scans (module docstring):
  not a carry slice, read only by backward scans as ``xs``, once per scan.
  The carries are kept stacked to rebuild from (a carry the scan does not
  stack already becomes an output of the re-emitted scan): the
  :func:`hostable` stacks less the carry stacks."""
  return {vid: (forward, output) for vid, (forward, output) in hostable(graph).items()
          if output not in carry_outputs(graph.nodes[forward]).values()}


@analysis
def hostable(graph: Graph) -> dict[int, tuple[int, int]]:
  """Stacked residual value id -> (forward scan node, output position), for
  those that can go to host memory one slice per iteration (module
  docstring): read only by backward scans as ``xs``, once per scan. Carry
  stacks qualify too (a rebuild reads their slices through a copy back)."""
  found = {}
  for loop in loops(graph):
    forward = graph.nodes[loop.forward]
    if forward.params.get("unroll", 1) not in (1, True, False):
      continue
    for stacked in loop.stacked:
      if _read_per_iteration(graph, forward, stacked.value):
        found[stacked.value] = (forward.index, stacked.output)
  return found


def _whole(length: int) -> Callable:
  """The loop over all its iterations: ``jax.lax.scan``."""
  return lambda step, init, xs, reverse: jax.lax.scan(step, init, xs, length=length,
                                                      reverse=reverse)


def _on_device(xs: Sequence) -> list:
  """Slices of stacks in host memory copied to the device (the others as
  they are): what a backward body reads first each iteration."""
  return [jax.device_put(x, jax.memory.Space.Device)
          if jax.typeof(x).memory_space == jax.memory.Space.Host else x for x in xs]


def group_size(length: int) -> int | None:
  """Layers per group of a nested scan: the divisor of ``length`` nearest
  its square root (None where there is none but 1 and ``length``).

  Example:
    >>> group_size(16), group_size(12), group_size(7)
    (4, 3, None)
  """
  divisors = [d for d in range(2, length) if length % d == 0]
  return min(divisors, key=lambda d: (abs(d - length ** 0.5), d)) if divisors else None


@analysis
def nestable(graph: Graph) -> dict[int, tuple[int, int]]:
  """Carry stacks (the stacked layer inputs) whose loop can run nested: its
  forward scan keeps only each group's first carry (``L / group`` of them)
  and the backward scan rebuilds a group's slices before running its
  iterations (the sqrt(L) schedule of ``nn.remat_scan``). Every stacked
  residual of the loop must be rebuildable or a carry stack read per
  iteration. Value id -> (forward scan node, output position)."""
  found = {}
  others = rebuildable(graph)
  for loop in loops(graph):
    forward = graph.nodes[loop.forward]
    carries = carry_outputs(forward)
    if len(carries) < scan_shape(forward)[1] or group_size(loop.length) is None or any(
        s.value not in others and not (s.output in carries.values()
                                       and _read_per_iteration(graph, forward, s.value))
        for s in loop.stacked):
      continue
    for s in loop.stacked:
      if s.output in carries.values():
        found[s.value] = (forward.index, s.output)
  return found


def forward_without(node: Node, dropped: frozenset[int],
                    hosted: frozenset[int] = frozenset(), scan: Callable | None = None) -> Callable:
  """The forward scan without the stacked outputs at ``dropped``, and with
  those at ``hosted`` stacked in host memory (each slice copied there as it
  is made): ``run(*ins) -> outs`` with None where an output is dropped,
  then, where an output is dropped, the stacked carry-ins of the carries
  it does not stack itself (:func:`unstacked_carries`): a rebuild reads
  them. ``scan(step, init, xs, reverse) -> (carry, ys)`` runs the loop
  (``jax.lax.scan`` by default; a segment of it, ``_loop_segments``)."""
  consts, carries, length = scan_shape(node)
  scan = scan or _whole(length)
  body = jex.jaxpr_as_fun(node.params["jaxpr"])
  kept = [o for o in range(len(node.outs)) if o >= carries and o not in dropped]
  extra = unstacked_carries(node) if dropped else []  # to rebuild from

  def run(*ins):
    const_in, carry_in, xs = ins[:consts], ins[consts:consts + carries], ins[consts + carries:]

    def step(carry, x):
      outs = body(*const_in, *carry, *x)
      ys = [jax.device_put(outs[o], jax.memory.Space.Host) if o in hosted else outs[o]
            for o in kept]
      return list(outs[:carries]), ys + [carry[c] for c in extra]

    carry, ys = scan(step, list(carry_in), list(xs), node.params["reverse"])
    out = list(carry) + [None] * (len(node.outs) - carries)
    for o, y in zip(kept, ys):
      out[o] = y
    return out + list(ys[len(kept):])

  return run


def backward_rebuilding(node: Node, forward: Node, rebuilt: dict[int, int],
                        scan: Callable | None = None) -> Callable:
  """The backward scan ``node`` with some of its ``xs`` rebuilt per
  iteration: ``rebuilt`` maps an input position of ``node`` to the forward
  scan's output position that made it. ``run(ins, forward_ins,
  carry_stacks) -> outs``, where ``ins`` has None at the rebuilt positions
  and ``carry_stacks`` are the forward body's carry-ins stacked, in carry
  order; ``scan`` as in :func:`forward_without`."""
  consts, carries, length = scan_shape(node)
  scan = scan or _whole(length)
  f_consts, f_carries, _ = scan_shape(forward)
  iteration = _Rebuilding(node, forward, rebuilt)

  def run(ins: Sequence, forward_ins: Sequence, f_carry_stacks: Sequence):
    b_consts, b_carry = ins[:consts], ins[consts:consts + carries]
    f_const_in = forward_ins[:f_consts]
    xs = ([ins[i] for i in iteration.xs_positions] + list(forward_ins[f_consts + f_carries:])
          + list(f_carry_stacks))
    # A stack read twice (a layer input the backward body reads, which the
    # rebuild starts from too) is scanned, and copied back, once.
    unique = [x for i, x in enumerate(xs) if not any(x is y for y in xs[:i])]
    where = [next(j for j, u in enumerate(unique) if u is x) for x in xs]

    def step(carry, x):
      fetched = _on_device(x)
      return iteration(b_consts, f_const_in, carry, [fetched[j] for j in where])

    carry, ys = scan(step, list(b_carry), unique, node.params["reverse"])
    return list(carry) + list(ys)

  return run


class _Rebuilding:
  """One iteration of the backward scan ``node`` whose ``xs`` at the
  positions of ``rebuilt`` (input position -> forward output position) the
  forward body makes again first: ``self(b_consts, f_consts, carry, x) ->
  (carry, ys)``, ``x`` the iteration's own ``xs`` slices (at
  ``xs_positions``), then the forward body's ``xs`` slices, then its
  carry-ins."""

  def __init__(self, node: Node, forward: Node, rebuilt: dict[int, int]):
    consts, self.carries, _ = scan_shape(node)
    f_consts, f_carries, _ = scan_shape(forward)
    self.body = jex.jaxpr_as_fun(node.params["jaxpr"])
    self.f_body = jex.jaxpr_as_fun(forward.params["jaxpr"])
    self.rebuilt, self.n_ins = rebuilt, len(node.ins)
    self.first_xs = consts + self.carries
    self.xs_positions = [i for i in range(self.first_xs, len(node.ins)) if i not in rebuilt]
    self.n_fxs = len(forward.ins) - f_consts - f_carries

  def __call__(self, b_consts, f_const_in, carry, x):
    n_xs = len(self.xs_positions)
    own, fx, fcarry = x[:n_xs], x[n_xs:n_xs + self.n_fxs], x[n_xs + self.n_fxs:]
    f_outs = self.f_body(*f_const_in, *fcarry, *fx)
    full = dict(zip(self.xs_positions, own))
    full.update({i: f_outs[o] for i, o in self.rebuilt.items()})
    outs = self.body(*b_consts, *carry, *(full[i] for i in range(self.first_xs, self.n_ins)))
    return list(outs[:self.carries]), list(outs[self.carries:])


@analysis
def rebuilding_iteration(graph: Graph, backward: int, forward: int,
                         rebuilt: tuple[tuple[int, int], ...]) -> tuple[jex.ClosedJaxpr, dict]:
  """One iteration of backward scan ``backward`` with the ``xs`` at
  ``rebuilt``'s ``(input position, forward output position)`` pairs made
  again by forward scan ``forward``'s body, as a jaxpr over the iteration's
  constants, carries and slices, and the index among its inputs of each
  ``xs`` slice it reads, by input position of ``backward``: what the memory
  model sizes the body of a rebuilding loop by (``cost._memory``)."""
  node, f_node = graph.nodes[backward], graph.nodes[forward]
  iteration = _Rebuilding(node, f_node, dict(rebuilt))
  consts, carries, _ = scan_shape(node)
  f_consts, f_carries, _ = scan_shape(f_node)

  def aval(a, sliced: bool = False):
    if not isinstance(a, int):
      return a.val  # a literal stays a constant of the iteration
    shaped = graph.values[a].aval
    return jax.ShapeDtypeStruct(shaped.shape[1:] if sliced else shaped.shape, shaped.dtype)

  args = ([aval(a) for a in node.ins[:consts]], [aval(a) for a in f_node.ins[:f_consts]],
          [aval(a) for a in node.ins[consts:consts + carries]],
          [aval(node.ins[i], True) for i in iteration.xs_positions]
          + [aval(a, True) for a in f_node.ins[f_consts + f_carries:]]
          + [aval(a) for a in f_node.ins[f_consts:f_consts + f_carries]])
  traced = [[isinstance(a, jax.ShapeDtypeStruct) for a in group] for group in args]
  leaves = [[a for a, t in zip(group, mask) if t] for group, mask in zip(args, traced)]

  def one(*groups):
    filled = [iter(g) for g in groups]
    full = [[next(it) if t else a for a, t in zip(group, mask)]
            for group, mask, it in zip(args, traced, filled)]
    return iteration(*full)

  before = sum(len(group) for group in leaves[:3])
  return (jax.make_jaxpr(one)(*leaves),
          {p: before + j for j, p in enumerate(iteration.xs_positions)})


def fetching(node: Node, scan: Callable | None = None) -> Callable:
  """The backward scan ``node`` reading its ``xs`` slices that are stacked
  in host memory through a copy to the device per iteration:
  ``run(*ins) -> outs``; ``scan`` as in :func:`forward_without`."""
  consts, carries, length = scan_shape(node)
  scan = scan or _whole(length)
  body = jex.jaxpr_as_fun(node.params["jaxpr"])

  def run(*ins):
    def step(carry, x):
      outs = body(*ins[:consts], *carry, *_on_device(x))
      return list(outs[:carries]), list(outs[carries:])

    carry, ys = scan(step, list(ins[consts:consts + carries]), list(ins[consts + carries:]),
                     node.params["reverse"])
    return list(carry) + list(ys)

  return run


def _grouped(x, groups: int):
  return x.reshape(groups, x.shape[0] // groups, *x.shape[1:])


def _ungrouped(x):
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def forward_nested(node: Node, dropped: frozenset[int], group: int) -> Callable:
  """The forward scan as a scan over groups of ``group`` iterations, without
  the stacked outputs at ``dropped``: ``run(*ins) -> outs`` with None where
  an output is dropped, then each carry at each group's start (``[L /
  group, ...]``)."""
  consts, carries, length = scan_shape(node)
  body = jex.jaxpr_as_fun(node.params["jaxpr"])
  kept = [o for o in range(carries, len(node.outs)) if o not in dropped]
  reverse = node.params["reverse"]

  def run(*ins):
    const_in, carry_in, xs = ins[:consts], ins[consts:consts + carries], ins[consts + carries:]

    def inner(carry, x):
      outs = body(*const_in, *carry, *x)
      return list(outs[:carries]), [outs[o] for o in kept]

    def outer(carry, xs_group):
      new, ys = jax.lax.scan(inner, carry, list(xs_group), reverse=reverse)
      return new, (list(carry), ys)

    carry, (starts, ys) = jax.lax.scan(
        outer, list(carry_in), [_grouped(x, length // group) for x in xs], reverse=reverse)
    out = list(carry) + [None] * (len(node.outs) - carries)
    for o, y in zip(kept, ys):
      out[o] = _ungrouped(y)
    return out + list(starts)

  return run


def backward_nested(node: Node, forward: Node, rebuilt: dict[int, int],
                    group: int) -> Callable:
  """The backward scan over the groups of :func:`forward_nested`: for each
  group (in the backward order) the forward body re-runs from the group's
  start carry, making the group's slices of the forward outputs in
  ``rebuilt`` (input position of ``node`` -> forward output position), then
  the group's backward iterations run. ``run(ins, forward_ins, starts) ->
  outs``, ``ins`` with None at the rebuilt positions."""
  consts, carries, length = scan_shape(node)
  f_consts, f_carries, _ = scan_shape(forward)
  body = jex.jaxpr_as_fun(node.params["jaxpr"])
  f_body = jex.jaxpr_as_fun(forward.params["jaxpr"])
  xs_positions = [i for i in range(consts + carries, len(node.ins)) if i not in rebuilt]
  needed = sorted(set(rebuilt.values()))
  groups = length // group

  def run(ins: Sequence, forward_ins: Sequence, starts: Sequence):
    b_consts, f_const_in = ins[:consts], forward_ins[:f_consts]
    own = [_grouped(ins[i], groups) for i in xs_positions]
    f_xs = [_grouped(x, groups) for x in forward_ins[f_consts + f_carries:]]

    def rebuild(carry, x):
      outs = f_body(*f_const_in, *carry, *x)
      return list(outs[:f_carries]), [outs[o] for o in needed]

    def outer(carry, x):
      own_g, f_xs_g, start = (x[:len(own)], x[len(own):len(own) + len(f_xs)],
                              x[len(own) + len(f_xs):])
      _, made = jax.lax.scan(rebuild, list(start), list(f_xs_g),
                             reverse=forward.params["reverse"])

      def step(c, xs_slice):
        full = dict(zip(xs_positions, xs_slice[:len(own_g)]))
        full.update({i: xs_slice[len(own_g) + needed.index(o)] for i, o in rebuilt.items()})
        outs = body(*b_consts, *c, *(full[i] for i in range(consts + carries, len(ins))))
        return list(outs[:carries]), list(outs[carries:])

      return jax.lax.scan(step, carry, list(own_g) + list(made),
                          reverse=node.params["reverse"])

    carry, ys = jax.lax.scan(outer, list(ins[consts:consts + carries]),
                             own + f_xs + list(starts), reverse=node.params["reverse"])
    return list(carry) + [_ungrouped(y) for y in ys]

  return run


def loop_variants(graph: Graph, plan: Plan, host: bool = False) -> list[Plan]:
  """``plan`` with its loops in each shape: every stack rebuilt per
  iteration, and every nestable loop nested; with ``host``, also the
  stacks rebuilt per iteration from carry stacks in host memory, and every
  stack in host memory. The memory model can rank the shapes the wrong way
  round where a layer's slices are small (measured: a 16-layer MLP of 8 KiB
  slices is 300 KiB per iteration and 376 KiB nested in XLA, 344 and 312
  KiB in the model), so each is worth compiling; a greedy search reaches
  only one of them (nesting a loop leaves nothing there to host)."""
  per_iteration, nested, hosted = rebuildable(graph), nestable(graph), hostable(graph)
  looped = per_iteration.keys() | nested.keys() | hosted.keys()
  base = {v: d for v, d in plan.items if v not in looped}
  shapes = [{v: RECOMPUTE for v in per_iteration},
            {v: RECOMPUTE for v in {**per_iteration, **nested}} if nested else {}]
  if host:
    carries = {v: OFFLOAD for v in hosted if v not in per_iteration}
    shapes += [{**shapes[0], **carries} if carries and per_iteration else {},
               {v: OFFLOAD for v in hosted}]
  return [Plan.of({**base, **shape}) for shape in shapes if shape]
