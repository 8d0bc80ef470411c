"""A fitted step under ``jax.vmap``: planned again for the batched shapes.

A plan is made for the shapes a step is traced with; under ``jax.vmap``
those are one example's, while the program XLA compiles is the batched one,
so a per-example plan does not hold the budget. A fitted step's traced call
is therefore a ``custom_vmap`` whose rule fits the step vmapped over the
batched arguments (``refit``): the budget, absolute or a fraction, holds for
the whole batched program, wherever the vmap sits (around an inner
``jax.jit`` too, since the rule runs when the jaxpr is batched).

``custom_vmap`` has no reverse-mode rule, so a ``custom_jvp`` around it
differentiates the per-example program; the plan under ``vmap`` of ``grad``
of a fitted step is the per-example one.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.custom_batching import custom_vmap


def batchable(flat: Callable, refit: Callable[[tuple[bool, ...]], Callable]) -> Callable:
  """``flat`` (flat leaves -> list of leaves), batched by the function
  ``refit(in_batched)`` returns for the batched leaves (every output
  batched along axis 0).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> seen = []
    >>> def refit(in_batched):
    ...   seen.append(in_batched)
    ...   return lambda *leaves: [jax.vmap(lambda a, b: a * b, (0, None))(*leaves)]
    >>> f = batchable(lambda a, b: [a * b], refit)
    >>> jax.vmap(f, in_axes=(0, None))(jnp.ones((3, 2)), jnp.ones(2))[0].shape, seen
    ((3, 2), [(True, False)])
  """
  @custom_vmap
  def call(*leaves):
    return flat(*leaves)

  @call.def_vmap
  def rule(axis_size, in_batched, *leaves):
    del axis_size  # in the leaves' shapes
    out = list(refit(tuple(in_batched))(*leaves))
    return out, [True] * len(out)

  @jax.custom_jvp
  def step(*leaves):
    return call(*leaves)

  step.defjvp(lambda primals, tangents: jax.jvp(flat, primals, tangents))
  return step
