"""A fit's optimizer state in host memory, at the step's boundary.

Where a fit keeps optimizer state in host memory between steps
(``graph._state``), the step's arguments at those leaves are placed there
before each call (:func:`place_state`), the step's outputs get their memory
kinds (:func:`output_kinds`, so that ``jax.jit`` reuses a donated host
buffer only for a host output), and the fit loop compiles with them there
(:func:`compile_placed`). Arguments that come back in host memory are
traced and keyed as device arrays (:func:`on_device`): the step as written
computes on its arguments where they are.
"""

from __future__ import annotations

import jax

from jaxmem.fit._arguments import Arguments
from jaxmem.graph._graph import Graph
from jaxmem.graph._state import hosted_leaves, hosted_outputs, hosted_state
from jaxmem.targets import Target, resolve
from jaxmem.targets._host_args import (
    HOST, as_device, compile_with_host_args, device_of, devices_of, mark_host_args, on_host,
    to_host)


def place_state(arguments: Arguments, positions: tuple, args, kwargs,
                abstract: bool = False) -> tuple[tuple, dict]:
  """The call's arguments with the dynamic leaves at ``positions`` (the
  optimizer state a fit keeps in host memory, ``Fit.hosted``) placed there:
  copied on the first call, a donated leaf's device copy deleted as the
  call would have; with ``abstract``, described there (to lower or
  compile, moving nothing)."""
  if not positions:
    return args, kwargs
  statics, dyn_args, dyn_kwargs = arguments.split(args, kwargs)
  leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
  gone = frozenset() if abstract else arguments.donated_leaves(args, kwargs)
  leaves = to_host(leaves, positions, gone, abstract)
  return arguments.merge(statics, *tree.unflatten(leaves))


def on_device(arguments: Arguments, args, kwargs) -> tuple[tuple, dict, list]:
  """The call's arguments with leaves in host memory (state a fit returned
  there) described in device memory, with the dynamic leaves: what is
  traced and measured."""
  statics, dyn_args, dyn_kwargs = arguments.split(args, kwargs)
  leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
  if any(map(on_host, leaves)):
    leaves = [as_device(x) for x in leaves]
    args, kwargs = arguments.merge(statics, *tree.unflatten(leaves))
  return args, kwargs, leaves


def compile_placed(jitted, target: Target, graph: Graph, arguments: Arguments, args, kwargs,
                   programs: dict | None = None):
  """``jitted`` lowered for ``args`` and compiled, with the optimizer state
  ``graph`` keeps in host memory placed there (marked so in the module on
  a compile-only device, whose shardings carry no memory kind). Where
  ``programs`` is given (lowered module text -> executable), a program
  compiled before is not compiled again: a fit that searches again (for
  the smallest footprint, after micro-batches) meets the same plans."""
  positions = hosted_leaves(graph)
  if positions:
    args, kwargs = place_state(arguments, positions, args, kwargs, abstract=True)
  lowered = jitted.lower(*args, **kwargs)
  key = None if programs is None else (lowered.as_text(), positions, target.name)
  if key in (programs or {}):
    return programs[key]
  if not positions or not target.compile_only:
    compiled = lowered.compile()
  else:
    nbytes = sum(leaf.nbytes for leaf in hosted_state(graph))
    compiled = compile_with_host_args(lowered, positions, nbytes)
  if key is not None:
    programs[key] = compiled
  return compiled


def placed_compile_only(args, kwargs) -> bool:
  """Whether the call's arguments are placed on a compile-only device
  (:func:`jaxmem.targets.placed`): lowered for a GPU that is not here."""
  return any(resolve(None, [leaf]).compile_only
             for leaf in jax.tree_util.tree_leaves((args, kwargs))
             if isinstance(leaf, jax.ShapeDtypeStruct))


def lower_placed(lowered, positions: tuple, args, kwargs):
  """``lowered`` (a fit's step lowered for ``args``) with the leaves at
  ``positions`` marked host memory where ``args`` are placed on a
  compile-only device (:func:`placed_compile_only`)."""
  if positions and placed_compile_only(args, kwargs):
    mark_host_args(lowered, positions)
  return lowered


def output_kinds(graph: Graph, leaves) -> list:
  """Each output's sharding on the device of the arguments ``leaves``: in
  host memory for the optimizer state ``graph`` returns there, else in
  device memory. Where ``leaves`` lie on several devices, a hosted update
  keeps its input's sharding, in host memory, and the other outputs are
  left to the partitioner (None)."""
  if devices_of(leaves) > 1:
    leaf = {s.output: s.leaf for s in hosted_state(graph) if s.output is not None}
    return [leaves[leaf[i]].sharding.with_memory_kind(HOST) if i in leaf else None
            for i in range(len(graph.outputs))]
  device, host = device_of(leaves), hosted_outputs(graph)
  return [jax.sharding.SingleDeviceSharding(device, memory_kind=HOST if i in host else "device")
          for i in range(len(graph.outputs))]


def leaf_names(arguments: Arguments, args, kwargs) -> tuple[str, ...]:
  """The path of each dynamic argument leaf (``jax.tree_util.keystr``), as
  reports name it."""
  _, dyn_args, dyn_kwargs = arguments.split(args, kwargs)
  paths = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))[0]
  return tuple(jax.tree_util.keystr(path[1:] if path[:1] else path) for path, _ in paths)
