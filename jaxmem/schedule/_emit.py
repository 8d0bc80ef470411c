"""Schedule -> Python function over flat arrays, ready for ``jax.jit``.

The evaluation follows ``jax.core.eval_jaxpr``: one loop over the ops with an
env dict, binding each equation's primitive with its params under its original
name stack, so the rewritten program keeps readable names in HLO and profiles.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
from jax.extend import core as jex

from jaxmem.schedule._schedule import Schedule


# Where each copy op of a schedule puts its value: host memory is
# ``pinned_host`` (XLA:GPU places it there; XLA:CPU ignores memory kinds).
_SPACES = {"offload": lambda: jax.memory.Space.Host,
           "prefetch": lambda: jax.memory.Space.Device}


def bind_node(node, args, tag: str | None = None, params: dict | None = None,
              name_stack: str | None = None) -> list:
  """``node``'s equation applied to ``args`` (with ``params`` in place of its
  own where given) under its original name stack (or ``name_stack``, a
  path such as ``node.name_stack``); its outputs as a list. An equation
  inlined from a call (``custom_jvp_call``, ``pjit``) keeps the path of the
  call around it, as the step's graph reads it."""
  from jax._src import source_info_util
  params = node.prim.get_bind_params(node.params if params is None else params)
  subfuns, bind_params = params if isinstance(params, tuple) else ((), params)
  if name_stack is None and str(node.source_info.name_stack) != node.name_stack:
    name_stack = node.name_stack
  stack = (node.source_info.name_stack if name_stack is None
           else source_info_util.new_name_stack(name_stack))
  if tag is not None:
    stack = stack.extend(f"{tag}{node.index}")
  with at(node, stack):
    with node.ctx.manager:
      out = node.prim.bind(*subfuns, *args, **bind_params)
  return out if node.prim.multiple_results else [out]


def at(node, name_stack=None):
  """A context in which what is bound carries ``node``'s traceback and name
  stack (or ``name_stack``, a JAX name stack): it reads as ``node`` does,
  in the forward or the backward pass."""
  from jax._src import source_info_util
  return source_info_util.user_context(
      node.source_info.traceback,
      name_stack=node.source_info.name_stack if name_stack is None else name_stack)


# A planned body runs under ``shard_map(..., check_vma=False)``: its
# barriers join values that vary over mesh axes with values that do not,
# which the varying-axes typing refuses. Its equations that exist only for
# that typing run as their untyped forms (the same collectives, or nothing).
UNTYPED = {
    "pvary": lambda node, args: list(args),
    "pbroadcast": lambda node, args: list(args),
    "psum_invariant": lambda node, args: [jax.lax.psum(a, node.params["axes"]) for a in args],
    "psum2": lambda node, args: [jax.lax.psum(a, node.params["axes"]) for a in args],
    "all_gather_invariant": lambda node, args: [jax.lax.all_gather(
        a, node.params["axis_name"], axis=node.params["all_gather_dimension"],
        tiled=node.params["tiled"]) for a in args],
}


# Random draws read only a key, so XLA:CPU schedules them where it likes:
# it draws every mask at the start of the step and holds them all through
# the forward pass (two buffers of the mask's size per draw; a Flax MLP
# with dropout: the smallest plan 78% of the step instead of 49%). Where
# the memory model emulates XLA:CPU, each draw waits for the last array
# computed before it from more than keys and constants that is still read
# after it (an optimization barrier over the key and that array), so the
# barrier lengthens no array's life. XLA:GPU draws late enough without it
# (the same MLP's smallest is the same with it), and the barrier would
# cost it fusions (5-9% of GPT-2's predicted step on an H100).
DRAWS = frozenset({"random_bits"})
# The ops whose outputs a draw may wait for: equations run, not copies. A
# barrier's copy is made as soon as its inputs are, however early (a
# recomputation's barrier whose anchor is an optimizer update made early
# in the backward pass), so a draw tied to one is drawn there.
_COMPUTED = frozenset({"node", "recompute"})


def emit(schedule: Schedule, tag: str | None = None, binds: Mapping[str, Callable] = {}):
  """Returns ``run(*flat_inputs) -> list of flat outputs`` for ``schedule``.
  With ``tag``, each equation runs under one more name scope, ``tag``
  followed by its node index, so the compiled program names the equation
  each instruction comes from (``_xla_buffers``). ``binds`` maps a
  primitive's name to ``bind(node, args) -> outputs`` that runs its
  equations instead of binding the primitive.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph._graph import build_graph
    >>> from jaxmem._decisions import Plan
    >>> from jaxmem.schedule._schedule import build_schedule
    >>> g = build_graph(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0))
    >>> emit(build_schedule(g, Plan()))(0.0)
    [Array(0., dtype=float32, weak_type=True)]
  """
  graph = schedule.graph
  ops = schedule.ops
  last_read: dict = {}
  for pos, op in enumerate(ops):
    for key in op.ins:
      if not isinstance(key, jex.Literal):
        last_read[key] = pos
  keep = {k for k in schedule.outputs if not isinstance(k, jex.Literal)}

  def run(*flat):
    env = {(vid, 0): const for vid, const in graph.consts.items()}
    env.update(zip(schedule.inputs, flat))
    read = lambda k: k.val if isinstance(k, jex.Literal) else env[k]
    inputs = set(schedule.inputs)
    early = {k for k, v in env.items() if k not in inputs or _is_key(v)}
    anchors = []  # arrays equations computed from more than keys and constants, in order
    # The step as written (no plan) is emitted as written: it is to be the
    # program ``jax.jit`` makes of it.
    draws = DRAWS if graph.buffers is None and len(schedule.plan) else frozenset()
    for pos, op in enumerate(ops):
      args = [read(k) for k in op.ins]
      if op.node is not None and graph.nodes[op.node].prim.name in draws:
        while anchors and last_read.get(anchors[-1], -1) <= pos and anchors[-1] not in keep:
          anchors.pop()  # read for the last time before this draw: dead from here
        if anchors:
          args[0], _ = jax.lax.optimization_barrier((args[0], env[anchors[-1]]))
      if op.kind in _SPACES:
        outs = [jax.device_put(args[0], _SPACES[op.kind]())]
      elif op.kind == "split":  # vTensor split + salloc: chunks in own buffers
        axis, bounds = op.params
        outs = jax.lax.optimization_barrier(
            [jax.lax.slice_in_dim(args[0], start, stop, axis=axis)
             for start, stop in bounds])
      elif op.kind == "merge":  # vTensor merge
        outs = [jax.lax.concatenate(args, op.params[0])]
      elif op.node is None:
        outs = jax.lax.optimization_barrier(args)
      elif op.params:  # an equation re-emitted (a scan, _loop_schedule)
        outs = op.params[0](*args)
      elif graph.nodes[op.node].prim.name in binds:
        outs = binds[graph.nodes[op.node].prim.name](graph.nodes[op.node], args)
      else:
        outs = bind_node(graph.nodes[op.node], args, tag)
      env.update(zip(op.outs, outs))
      if draws:  # where no draw waits, nothing is anchored on
        if all(isinstance(k, jex.Literal) or k in early for k in op.ins):
          early.update(op.outs)
        elif op.kind in _COMPUTED:
          anchors.extend(k for k, o in zip(op.outs, outs)
                         if getattr(o, "ndim", 0) >= 1 and not _is_key(o))
      for key in op.ins:
        if (not isinstance(key, jex.Literal) and last_read.get(key) == pos
            and key not in keep):
          env.pop(key, None)
    return [read(k) for k in schedule.outputs]

  return run


def _is_key(value) -> bool:
  dtype = getattr(value, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
