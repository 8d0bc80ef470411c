"""What a loop's body holds on a GPU target, asked of XLA:GPU.

The memory model sizes the body of a ``lax.scan`` by simulating it: its
temporaries at their peak, which XLA allocates once for every iteration
(``_memory.loop_scratch``). The values of a step's top level get their
buffers from XLA:GPU's own program (``_xla_buffers``), but a body's
equations all carry the tag of the scan that runs them, so its fusion would
be XLA:CPU's emulated, which gives XLA:GPU's bodies far more than they hold
(the zoo's U-Net in micro-batches for a T4: 916 MiB modelled for a chunk).
:func:`loop_bodies` compiles each scan alone for the target instead and
takes its temporaries from XLA:GPU's memory analysis (the body's, the
slices it reads and writes, the carries' buffers), less the largest library
workspace (held for the scan's equation already, as learned).
"""

from __future__ import annotations

import jax

from jaxmem.graph._graph import Graph, Node
from jaxmem.targets import workspace_bytes


def loop_bodies(graph: Graph, target) -> dict[int, int]:
  """Scan node index -> bytes its loop holds on ``target`` (a GPU
  :class:`~jaxmem.targets.Target`) beyond its operands and results, for
  each scan at ``graph``'s top level, from one compilation of the scan
  alone."""
  return {node.index: loop_scratch_on(node, graph, target)
          for node in graph.nodes if node.prim.name == "scan"}


def loop_scratch_on(node: Node, graph: Graph, target) -> int:
  """Bytes scan ``node`` holds on ``target`` while it runs beyond its
  operands and results (its body's temporaries, the slices it reads and
  writes, its carries' buffers), its largest library workspace apart."""
  literal = {i: a.val for i, a in enumerate(node.ins) if not isinstance(a, int)}
  avals = [jax.ShapeDtypeStruct(graph.values[a].aval.shape, graph.values[a].aval.dtype)
           for a in node.ins if isinstance(a, int)]

  def run(*operands):
    given = iter(operands)
    return node.prim.bind(*(literal[i] if i in literal else next(given)
                            for i in range(len(node.ins))), **node.params)

  compiled = jax.jit(target.compiles(run, avals, one_device=True),
                     compiler_options=target.options(measuring=True) or None
                     ).lower(*target.place(avals)).compile()
  return max(0, compiled.memory_analysis().temp_size_in_bytes - workspace_bytes(compiled))
