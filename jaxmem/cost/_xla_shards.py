"""One device's bytes of each value of a sharded step, read off XLA's
partitioned program.

A step under ``jax.jit`` whose arguments are sharded over several devices
is traced at its global shapes; XLA's SPMD partitioner decides how every
value is sharded, and each device's program holds its shards. The memory
model plans one device's memory, so each value's bytes are divided by how
many shards it has: the step as written is emitted with every equation
under a name scope of its own (``_xla_names.TAG``), compiled with the
arguments' shardings, and each instruction's per-device shape in the
partitioned program is read back against the global shape of the value its
equation makes. A value the program never shows (computed inside another
instruction) takes the share of a value of the same shape that its
equation reads or its readers make; the rest are counted whole.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> g = build_graph(jax.make_jaxpr(lambda x: jnp.tanh(x) * 2)(jnp.ones((8, 4))))
  >>> [v.nbytes for v in per_device(g, {}).values.values()]  # nothing known: whole
  [128, 128, 128]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax

from jaxmem.cost import _hlo as hlo
from jaxmem.cost._xla_buffers import tagged
from jaxmem.cost._xla_names import tag_of
from jaxmem.graph._graph import Graph, residuals_of


def _shard_of(shape: tuple, itemsize: int, arrays) -> int | None:
  """The elements of the largest of ``arrays`` that is a shard of ``shape``
  (same rank, each dimension a divisor of the global one); where none is,
  of the largest of its item size whose elements divide the global ones
  (a cuBLAS call's result, flattened to a matrix)."""
  found = [a.size for a in arrays if len(a.dims) == len(shape) and a.dims
           and all(d and g % d == 0 for d, g in zip(a.dims, shape))]
  if not found:
    size = math.prod(shape)
    found = [a.size for a in arrays if hlo.itemsize(a.dtype) == itemsize
             and a.size <= size and size % a.size == 0]
  return max(found, default=None)


def partitioned(graph: Graph, args, target):
  """``graph``'s step as written, its equations tagged, compiled by
  ``target`` (a :class:`~jaxmem.targets.Target`) for ``args`` (the step's
  flat arguments, placed with their shardings): one device's program, which
  :func:`shard_elements` reads each value's shard off and, on a GPU,
  ``_xla_buffers.read`` the buffers."""
  return jax.jit(target.compiles(tagged(graph), args),
                 compiler_options=target.options(measuring=True) or None
                 ).lower(*args).compile()


def shard_elements(graph: Graph, args, compiled) -> dict[int, int]:
  """Value id -> its elements on one device, for the values of ``graph``'s
  step as written that ``compiled`` (:func:`partitioned` for ``args``)
  shows, its inputs included. An all-gather (or another collective that
  copies what devices hold) runs for the equation that reads what it
  gathers, so its arrays say nothing of that equation's values."""
  local = {v: arg.sharding.shard_shape(arg.shape) for v, arg in zip(graph.inputs, args)
           if getattr(arg, "sharding", None) is not None}
  found = {v: math.prod(shape) for v, shape in local.items()}
  by_tag: dict[int, list] = {}
  for instructions in hlo.parse(compiled.as_text()).computations.values():
    for inst in instructions:
      tag = tag_of(inst)
      if (tag is not None and tag < len(graph.nodes)
          and (inst.opcode not in hlo.EXCHANGES or inst.opcode in hlo.REDUCTIONS)):
        by_tag.setdefault(tag, []).extend(inst.arrays())
  for tag, arrays in by_tag.items():
    for v in graph.nodes[tag].outs:
      shape = tuple(graph.values[v].aval.shape)
      if v not in found and shape:
        size = _shard_of(shape, graph.values[v].aval.dtype.itemsize, arrays)
        if size is not None:
          found[v] = size
  return found


def elements(graph: Graph, known: Mapping[int, int]) -> dict[int, int]:
  """Each value's elements on one device, as :func:`per_device` counts its
  bytes."""
  share = _share(graph, known)
  return {v: max(1, round(value.aval.size * share[v])) if share.get(v, 1) < 1
          else value.aval.size for v, value in graph.values.items()}


def _share(graph: Graph, known: Mapping[int, int]) -> dict[int, float]:
  """Each value's share on one device: known, or that of a value of the
  same shape that its equation reads, or else that its readers make."""
  share = {v: n / max(graph.values[v].aval.size, 1) for v, n in known.items()}

  def take(v: int, others) -> None:
    shape = graph.values[v].aval.shape
    match = next((share[a] for a in others if isinstance(a, int) and a in share
                  and graph.values[a].aval.shape == shape), None)
    if match is not None:
      share[v] = match

  for node in graph.nodes:
    for v in node.outs:
      if v not in share:
        take(v, node.ins)
  for node in reversed(graph.nodes):
    for v in node.outs:
      if v not in share:
        take(v, [o for u in graph.values[v].uses for o in graph.nodes[u].outs])
  return share


def per_device(graph: Graph, known: Mapping[int, int]) -> Graph:
  """``graph`` with each value's bytes one device's (:func:`shard_elements`
  gives ``known``; see the module docstring); analyses start afresh."""
  share = _share(graph, known)
  values = {vid: dataclasses.replace(value, nbytes=max(1, round(value.nbytes * share[vid])))
            if vid in share and share[vid] < 1 else value
            for vid, value in graph.values.items()}
  return dataclasses.replace(graph, values=values, residuals=residuals_of(graph.nodes, values))
