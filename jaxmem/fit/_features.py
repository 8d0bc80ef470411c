"""Layers' features in chunks, a fit's resort where the batch cannot be split
(BatchNorm in training mode): the backward pass of each layer whose
features are made and contracted inside its block runs over chunks of
them, its forward work rebuilt per chunk
(:func:`~jaxmem.graph._feature_axes.split_features`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> def step(w1, w2, x):
  ...   def loss(ws):
  ...     h = jax.nn.relu(x @ ws[0])
  ...     h = (h - h.mean(0)) / (h.std(0) + 1.0)
  ...     return jnp.sum((h @ ws[1]) ** 2)
  ...   return jax.grad(loss)((w1, w2))
  >>> args = jnp.ones((4, 8)), jnp.ones((8, 4)), jnp.ones((2, 4))
  >>> traced, layers = features_step(jax.make_jaxpr(step)(*args), 4)
  >>> layers  # both layers' features: the loss sums the second's
  ('<top> dot_general', '<top> dot_general')
  >>> [e.primitive.name for e in traced.eqns if e.primitive.name == "scan"]
  ['scan', 'scan']
"""

from __future__ import annotations

import jax

from jaxmem.graph._feature_axes import feature_layers, split_features
from jaxmem.graph._graph import build_graph
from jaxmem.graph._split import NotSplittable
from jaxmem.schedule._microbatch import micro_batched

# The numbers of chunks a fit tries, fewest first: each layer takes the
# largest that divides its features and is no more.
COUNTS = (4, 8)


def _named(graph) -> list[tuple[str, int]]:
  """Each of :func:`feature_layers` as its label and how many layers of that
  label come before it: how a layer is found again in the step traced anew
  after another's split."""
  seen: dict = {}
  named = []
  for i in feature_layers(graph):
    label = graph.nodes[i].label
    named.append((label, seen.get(label, 0)))
    seen[label] = seen.get(label, 0) + 1
  return named


def features_step(closed, k: int):
  """``closed`` (a traced step) with the backward pass of every layer whose
  features split run over chunks of them (about ``k``, the most that
  divide them), and those layers' labels; :class:`NotSplittable` where
  none split (the first layer's reason)."""
  done, reasons = [], []
  for name, nth in _named(build_graph(closed)):
    graph = build_graph(closed)
    layer = dict(zip(_named(graph), feature_layers(graph)))[name, nth]
    try:
      split = split_features(graph, layer)
    except NotSplittable as why:
      reasons.append(str(why))
      continue
    count = max(c for c in (1, *split.sizes()) if c <= k)
    if count > 1:
      closed = jax.make_jaxpr(micro_batched(split, count))(*closed.in_avals)
      done.append(graph.nodes[layer].label)
  if not done:
    raise NotSplittable(reasons[0] if reasons else "no layer has a parameter kernel")
  return closed, tuple(done)
