"""Checks of the step itself before a fit: a warning where there is nothing
to plan, an error where jaxmem cannot measure it."""

from __future__ import annotations

import warnings

from jaxmem.graph import _primitives
from jaxmem.graph._graph import Graph


def no_backward(graph: Graph) -> None:
  """Warns where the step has no backward pass: nothing to plan."""
  if not graph.has_backward:
    warnings.warn(
        "jaxmem: the step has no backward pass (no transposed equations in "
        "its jaxpr), so there are no residuals to recompute or offload; it "
        "is compiled unchanged.", stacklevel=5)


def fittable(graph: Graph, name: str) -> None:
  """Refuses, with a way out, a step jaxmem cannot measure: one that runs
  collectives over mesh axes bound outside it (``psum`` in a function that
  ``shard_map`` calls; the ``shard_map`` itself can be fitted)."""
  found = sorted({n.prim.name for n in graph.nodes
                  if _primitives.classify(n.prim.name) == _primitives.COLLECTIVE})
  if found:
    raise NotImplementedError(
        f"jaxmem: step {name} runs collectives over mesh axes ({', '.join(found)}) "
        "that are bound outside it: jaxmem measures a step by compiling it on its own, "
        "and these need the shard_map around it. Transform the step with its "
        "shard_map instead: jaxmem.transform(jax.shard_map(per_device_step, mesh=mesh, "
        "in_specs=..., out_specs=...), budget=...), which plans each device's part "
        "with its collectives, against a budget per device.")
