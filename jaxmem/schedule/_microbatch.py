"""A step run in micro-batches: what a :class:`~jaxmem.graph._batch_axes.Split`
puts per chunk runs in a ``lax.scan`` over ``k`` chunks of the batch.

The equations before the chunks run once; the per-example inputs (and the
demanded values made once at full size) are cut into ``k`` chunks along
their example axis and scanned; the equations per chunk run at the chunk's
size, each reduction over the examples adding (or maxing) its chunk's part
into a carry (in float32 for 16-bit floats); the equations after the chunks
run once on the combined results. The step's numbers are its own up to the
order of the sums.

The emitted step is again a step whose passes run inside a loop, which the
fit plans like a user's gradient accumulation (``fit._inner``).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> from jaxmem.graph._batch_axes import split_batch
  >>> def step(w, x):
  ...   return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w)))(w)
  >>> w, x = jnp.eye(4), jnp.arange(32.0).reshape(8, 4) / 32
  >>> run = micro_batched(split_batch(build_graph(jax.make_jaxpr(step)(w, x)), [(1,)]), 4)
  >>> bool(jnp.allclose(run(w, x)[0], step(w, x), atol=1e-6))
  True
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from jaxmem.graph._axis_rules import ADD, AND, MAX, MIN, OR, chunk_params
from jaxmem.graph._graph import TOP
from jaxmem.graph._split import Split, shape_of
from jaxmem.graph._random_bits import chunk_bits
from jaxmem.schedule._emit import at, bind_node


def _chunks(x, axis: int, k: int, strided: bool = False):
  """``x`` cut into ``k`` chunks along ``axis``, stacked on a new axis 0:
  chunk ``c`` holds the examples ``c * n / k`` to ``(c + 1) * n / k``, or
  (``strided``) ``c, c + k, c + 2k, ...``, so that an axis sharded in blocks
  over devices keeps a part of each chunk on every device (at the cost of a
  copy of ``x``)."""
  shape = x.shape
  parts = (shape[axis] // k, k) if strided else (k, shape[axis] // k)
  x = x.reshape(shape[:axis] + parts + shape[axis + 1:])
  return jnp.moveaxis(x, axis + strided, 0)


def _unchunk(y, axis: int, strided: bool = False):
  """The inverse of :func:`_chunks` for ``y`` stacked on axis 0."""
  y = jnp.moveaxis(y, 0, axis + strided)
  return y.reshape(y.shape[:axis] + (-1,) + y.shape[axis + 2:])


def _accumulates_in(dtype) -> np.dtype:
  dtype = np.dtype(dtype)
  return np.dtype(np.float32) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else dtype


def _extreme(dtype, low: bool):
  if jnp.issubdtype(dtype, jnp.floating):
    return -np.inf if low else np.inf
  info = jnp.iinfo(dtype)
  return info.min if low else info.max


def _initial(how: str, aval, operand):
  """A carry's value before the first chunk: ``operand`` where the chunks
  run from the running total, else the combine's identity."""
  if operand is not None:
    return jnp.asarray(operand, dtype=aval.dtype)
  dtype = _accumulates_in(aval.dtype)
  fill = {ADD: 0, OR: False, AND: True}.get(how)
  if fill is None:
    fill = _extreme(dtype, low=how == MAX)
  return jnp.full(aval.shape, fill, dtype)


_COMBINE = {ADD: jnp.add, MAX: jnp.maximum, MIN: jnp.minimum, OR: jnp.logical_or,
            AND: jnp.logical_and}


def micro_batched(split: Split, k: int, binds: Mapping[str, Callable] = {}) -> Callable:
  """``run(*flat_inputs) -> flat outputs``: the step of ``split`` over ``k``
  micro-batches (``k`` one of ``split.sizes()``), cut as :func:`_chunks`
  cuts (strided where ``split.strided``: a batch sharded over devices);
  ``binds`` as :func:`~jaxmem.schedule._emit.emit` takes it."""
  if k not in split.sizes():
    raise ValueError(f"jaxmem: {k} micro-batches do not divide the batch of "
                     f"{split.batch}; pass one of {split.sizes()}")
  graph, nodes = split.graph, split.graph.nodes
  combined, strided = split.combined(), split.strided
  made = {o for i in split.region for o in nodes[i].outs}  # a loop's output cut as taken
  scanned = [(v, split.axes[v]) for v in split.inputs] + [
      key for key, how in split.demanded.items() if how is None and key[0] not in made]
  # Cut inside the loop: moving any other axis first would copy the value whole.
  cut = [key for key in scanned if key[1] != 0 and not strided]
  scanned = [key for key in scanned if key not in cut]
  returned, kept = split.returned(), split.kept()
  folded = _folded(split, combined)

  def run(*flat):
    env = dict(graph.consts)
    env.update(zip(graph.inputs, flat))
    read = lambda a: a.val if isinstance(a, jex.Literal) else env[a]
    once = lambda i: env.update(zip(nodes[i].outs, _bind(
        binds, nodes[i], [read(a) for a in nodes[i].ins],
        name_stack=_plain(nodes[i]) if split.whole else None)))
    deferred = split.deferred()
    for i in split.run_before():
      if i not in deferred:
        once(i)
    xs = [jnp.arange(k, dtype=np.uint32)] + [_chunks(env[v], axis, k, strided)
                                             for v, axis in scanned]
    init = [_initial(split.rules[i].output_combines()[p], graph.values[nodes[i].outs[p]].aval,
                     read(folded[i, p][1]) if (i, p) in folded else
                     _threaded(split.rules[i], p, lambda q: read(nodes[i].ins[q])))
            for i, p in combined]
    init += [jnp.zeros(graph.values[v].aval.shape, graph.values[v].aval.dtype) for v in kept]

    def body(carry, chunk):
      index, chunk = chunk[0], chunk[1:]
      chunk = list(zip(scanned, chunk)) + [(key, _part(env[key[0]], key[1], k, index))
                                           for key in cut]
      one = _Chunk(split, k, index, binds, env,
                   {v: x for (v, _), x in chunk if v in split.axes},
                   {key: x for key, x in chunk if key[0] not in split.axes})
      acc = dict(zip(combined, carry))
      for i in split.rebuilt:
        one.local.update(zip(nodes[i].outs, one.apply(i, split.rules[i].demand,
                                                      split.rules[i].outs[0])))
      for i in split.region:
        rule = split.rules[i]
        outs = one.apply(i, rule.demand, rule.outs[0],
                         {q: acc[i, p] for p, q in rule.threads})
        threaded = dict(rule.threads)
        for p, (v, how) in enumerate(zip(nodes[i].outs, rule.output_combines())):
          if how is None:
            one.local[v] = outs[p]
          else:
            part = outs[p] if p in threaded else _COMBINE[how](acc[i, p], outs[p])
            acc[i, p] = part.astype(acc[i, p].dtype)
      return ([acc[key] for key in combined] + [one.local[v] for v in kept],
              [one.local[v] for v in returned])

    with _in_pass_of(split):
      carry, ys = jax.lax.scan(body, init, xs)
    for (i, p), total in zip(combined, carry):
      v = folded[i, p][0] if (i, p) in folded else nodes[i].outs[p]
      env[v] = total.astype(graph.values[v].aval.dtype)
    env.update(zip(kept, carry[len(combined):]))
    env.update((v, _unchunk(y, split.axes[v], strided)) for v, y in zip(returned, ys))
    sums = {graph.values[v].producer for v, _ in folded.values()}
    for i in deferred + split.after:
      if i not in sums:
        once(i)
    return [read(o) for o in graph.outputs]

  return run


def _folded(split: Split, combined) -> dict:
  """Sums over the chunks whose one reader, after them, adds them to a
  value made before them (a layer's input gradient, its residual branch's
  added to its chunked branch's): ``(equation, output position) -> (that
  reader's output, the value)``. The sum then starts from the value
  instead of zeros, so no buffer of zeros is held, and the reader is
  not run."""
  graph, found = split.graph, {}
  late = {o for i in (*split.region, *split.after) for o in graph.nodes[i].outs}
  after = set(split.after)
  for i, p in combined:
    v = graph.nodes[i].outs[p]
    uses = graph.values[v].uses
    if (split.rules[i].output_combines()[p] != ADD or p in dict(split.rules[i].threads)
        or len(uses) != 1 or v in graph.output_ids or uses[0] not in after):
      continue
    reader = graph.nodes[uses[0]]
    others = [a for a in reader.ins if a != v]
    if reader.prim.name not in ("add", "add_any") or len(reader.ins) != 2 or len(others) != 1:
      continue
    other = others[0]
    if (isinstance(other, int) and other not in late
        and graph.values[other].aval == graph.values[v].aval):
      found[i, p] = (reader.outs[0], other)
  return found


def _part(x, axis: int, k: int, index, strided: bool = False):
  """Chunk ``index`` of ``k`` of ``x`` along ``axis``, as :func:`_chunks`
  cuts it: a block is sliced where it lies, with no copy of ``x``."""
  if strided:
    return jax.lax.dynamic_index_in_dim(_chunks(x, axis, k, True), index, keepdims=False)
  n = x.shape[axis] // k
  return jax.lax.dynamic_slice_in_dim(x, index * n, n, axis)


def _own_positions(indices, column: int, axis: int):
  """``indices`` with ``column`` (of its last axis) holding each example's
  position in this chunk along ``axis``: the rows of the chunk's operand
  that the step's positions in the whole batch pointed to."""
  return indices.at[..., column].set(
      jax.lax.broadcasted_iota(indices.dtype, indices.shape[:-1], axis))


def _threaded(rule, position: int, operand: Callable):
  """The input a threaded output's running total starts from
  (``operand(input position)``), None where the output is not threaded."""
  inputs = dict(rule.threads)
  return operand(inputs[position]) if position in inputs else None


class _Chunk:
  """The equations of one chunk, traced inside the scan's body.

  Attributes:
    split, k: the split and its number of chunks.
    index: which chunk this is (traced).
    binds: primitive name -> how its equations run (``emit``'s ``binds``).
    env: the values made once before the chunks (read as they are).
    local: this chunk's values with an example axis.
    taken: demanded values, this chunk's part, by ``(value, axis)`` (those
      made once and scanned, and those made again here as they are read).
  """

  def __init__(self, split: Split, k: int, index, binds, env: dict, local: dict,
               taken: dict):
    self.split, self.k, self.index, self.binds, self.env = split, k, index, binds, env
    self.local, self.taken = local, taken

  def get(self, atom):
    if isinstance(atom, jex.Literal):
      return atom.val
    return self.local[atom] if atom in self.local else self.env[atom]

  def apply(self, i: int, demand, out_axis, threads: Mapping = {}) -> list:
    """Equation ``i`` on this chunk (``threads``: input position -> a running
    total passed in its place); its demanded inputs taken (:meth:`take`)."""
    graph = self.split.graph
    node = graph.nodes[i]
    in_axes = [self.split.axes.get(a) if isinstance(a, int) else None for a in node.ins]
    args = [None if any(p == position for p, _ in demand) else self.get(a)
            for position, a in enumerate(node.ins)]
    for position, axis in demand:
      if isinstance(node.ins[position], int):
        args[position], in_axes[position] = self.take(node.ins[position], axis), axis
      else:
        args[position] = node.ins[position].val
    for position, total in threads.items():
      args[position] = total
    rule = self.split.rules.get(i)
    for position, column in rule.own if rule is not None else ():
      args[position] = _own_positions(args[position], column, in_axes[position])
    if rule is not None and rule.body is not None:
      with at(node):
        return self.loop(node, rule.body, args)
    params = chunk_params(node, in_axes, [shape_of(graph, a) for a in node.ins], out_axis,
                          graph.values[node.outs[0]].aval.shape, self.k)
    return _bind(self.binds, node, args, params=params, name_stack=node.name_stack)

  def loop(self, node, body, args) -> list:
    """A ``scan`` on this chunk: its body (``body``, a ``ScanBody``) run
    per iteration at the chunk's size, in a loop traced anew."""
    p, split = node.params, body.split
    nc, ncar = p["num_consts"], p["num_carry"]
    graph = split.graph
    whole = set(split.run_before())

    def step(carry, x):
      env, local, taken = dict(graph.consts), {}, {}
      for v, value in zip(graph.inputs, [*args[:nc], *carry, *x]):
        if v in split.axes:
          local[v] = value
        elif v in body.taken:
          taken[v, body.taken[v]] = value
        else:
          env[v] = value
      one = _Chunk(split, self.k, self.index, self.binds, env, local, taken)
      for i, inner in enumerate(graph.nodes):
        if i in split.rules:
          rule = split.rules[i]
          local.update(zip(inner.outs, one.apply(i, rule.demand, rule.outs[0])))
        elif i in whole:
          env.update(zip(inner.outs, _bind(self.binds, inner, [one.get(a) for a in inner.ins],
                                           name_stack=inner.name_stack)))
      outs = [one.get(o) for o in graph.outputs]
      return outs[:ncar], outs[ncar:]

    carry, ys = jax.lax.scan(step, list(args[nc:nc + ncar]), list(args[nc + ncar:]),
                             length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]

  def take(self, vid: int, axis: int):
    """This chunk's part of demanded value ``vid`` along ``axis``: made at the
    chunk's size where it can be (``Split.demanded``), else scanned (or, in
    a loop's body, cut from the whole value)."""
    key = (vid, axis)
    if key not in self.taken and self.split.demanded[key] is None:
      self.taken[key] = _part(self.get(vid), axis, self.k, self.index, self.split.strided)
    if key not in self.taken:
      i, demand = self.split.demanded[key]
      node = self.split.graph.nodes[i]
      if node.prim.name == "random_bits":
        n = node.params["shape"][axis]
        start, step = (self.index, self.k) if self.split.strided else (self.index * (n // self.k), 1)
        with at(node):
          self.taken[key] = chunk_bits(self.get(node.ins[0]), node.params["bit_width"],
                                       node.params["shape"], axis, start, step, n // self.k)
      else:
        self.taken[key] = self.apply(i, demand, axis)[0]
    return self.taken[key]


def _bind(binds: Mapping[str, Callable], node, args, **options) -> list:
  """``node``'s equation on ``args``: by ``binds`` where it names the
  primitive, else bound as written (``bind_node`` with ``options``)."""
  if node.prim.name in binds:
    return binds[node.prim.name](node, args)
  return bind_node(node, args, **options)


def _in_pass_of(split: Split):
  """The scan's name stack: where only a region runs per chunk, that of the
  region's first backward equation, so the rest of the step sees the scan
  in the backward pass where it runs (its residuals read there)."""
  first = next((split.graph.nodes[i] for i in split.region
                if split.graph.nodes[i].backward), None)
  return contextlib.nullcontext() if split.whole or first is None else at(first)


def _plain(node) -> str:
  """``node``'s module path without AD wrappers: what runs once outside the
  chunks is no part of a backward pass, which all runs per chunk."""
  return "" if node.readable == TOP else node.readable
