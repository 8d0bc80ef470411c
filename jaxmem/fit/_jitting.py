"""The ``jax.jit`` of an emitted step, as compiled for a target: what every
program a fit compiles, measures and runs is wrapped in."""

from __future__ import annotations

from typing import Callable

import jax

from jaxmem.fit._arguments import Arguments
from jaxmem.fit._host_state import output_kinds
from jaxmem.graph._graph import Graph
from jaxmem.targets import Target


def jit_for(arguments: Arguments, fun: Callable, jit_kwargs: dict, run_flat: Callable,
            out_tree, where: Target | None, graph: Graph | None = None, leaves=(),
            measuring: bool = False):
  """The ``jax.jit`` (with the user's ``jit_kwargs``, called like ``fun``
  with ``arguments``) of an emitted step (``run_flat`` over flat
  ``leaves``) as compiled for ``where``: its compiler options (which keep
  recomputation, :meth:`~jaxmem.targets.Target.options`) go under any the
  user passed, its meshes are the target's (``Target.compiles``); None:
  neither. Where ``graph`` keeps optimizer state on the host, the
  outputs' memory kinds are given (``_host_state.output_kinds``)."""
  options = {} if where is None else where.options(measuring)
  run_flat = run_flat if where is None else where.compiles(run_flat, leaves)

  def run(*args, **kwargs):
    _, dyn_args, dyn_kwargs = arguments.split(args, kwargs)
    leaves = jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))
    return jax.tree_util.tree_unflatten(out_tree, run_flat(*leaves))

  kwargs = dict(jit_kwargs)
  kwargs["compiler_options"] = {**options, **(kwargs.get("compiler_options") or {})} or None
  if graph is not None and graph.hosted and "out_shardings" not in kwargs:
    kwargs["out_shardings"] = out_tree.unflatten(output_kinds(graph, leaves))
  return arguments.jit(run, fun, **kwargs)
