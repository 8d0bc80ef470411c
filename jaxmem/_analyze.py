"""What a step holds before any planning: :func:`analyze` lists its
residuals and the memory model's footprint."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from jaxmem._budget import format_bytes
from jaxmem._decisions import Plan
from jaxmem.cost._evaluate import evaluate
from jaxmem.graph._graph import Graph, build_graph, trace
from jaxmem.cost._memory import Liveness
from jaxmem.fit._report import residual_table


@dataclasses.dataclass
class Analysis:
  """What :func:`analyze` finds in a step."""
  graph: Graph
  memory: Liveness

  @property
  def residuals(self):
    return self.graph.residuals

  @property
  def peak(self) -> int:
    return self.memory.peak

  def report(self, top: int | None = 30) -> str:
    return (f"predicted footprint {format_bytes(self.peak)} at "
            f"{self.memory.peak_name}\n" + residual_table(self.graph, top=top))


def analyze(fun: Callable, *args, **kwargs) -> Analysis:
  """Traces a step and lists its residuals with sizes, lifetimes and layers.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    >>> a = jaxmem.analyze(step, jnp.ones((4, 4)), jnp.ones((2, 4)))
    >>> [r.primitive for r in a.residuals]  # tanh(y) and 1 - tanh(y)**2
    ['tanh', 'sub']
  """
  closed, _ = trace(jax.jit(fun), *args, **kwargs)
  graph = build_graph(closed)
  return Analysis(graph, evaluate(graph, Plan())[1])
