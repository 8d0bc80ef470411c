"""Initializers and dropout that draw their random numbers as flat vectors.

JAX's default (partitionable) threefry gives XLA:CPU a rank-N counter
computation for an N-d random array, and LLVM takes seconds to optimize it
for rank 3 and 4 (a 3x3x8x16 ``jax.random.normal`` compiles in ~4 s against
~0.3 s for the same 1152 numbers drawn flat). The zoo's conv kernels,
attention kernels and dropout masks are rank 3 or 4, so they are drawn flat
and reshaped: same distributions, a fraction of the compile time. (The three
original models keep Flax's initializers and dropout, and so their numbers.)

Example:
  >>> import jax
  >>> init = variance_scaling(2.0, "fan_out", "normal")
  >>> init(jax.random.PRNGKey(0), (3, 3, 8, 16)).shape
  (3, 3, 8, 16)
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp


def _fans(shape) -> tuple[int, int]:
  receptive = math.prod(shape[:-2]) if len(shape) > 2 else 1
  fan_in = shape[-2] * receptive if len(shape) > 1 else shape[-1]
  return fan_in, shape[-1] * receptive


def variance_scaling(scale: float, mode: str, distribution: str):
  """``jax.nn.initializers.variance_scaling`` (default axes), drawn flat.

  Args:
    scale: variance scale.
    mode: ``"fan_in"``, ``"fan_out"`` or ``"fan_avg"``.
    distribution: ``"truncated_normal"``, ``"normal"`` or ``"uniform"``.

  Example:
    >>> import jax
    >>> w = variance_scaling(1.0, "fan_in", "truncated_normal")(
    ...     jax.random.PRNGKey(0), (3, 3, 4, 4))
    >>> bool(abs(float(w.std()) - (1 / 36) ** 0.5) < 0.05)
    True
  """
  def init(key, shape, dtype=jnp.float32):
    fan_in, fan_out = _fans(shape)
    fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
    variance = scale / max(1.0, fan)
    size = (math.prod(shape),)
    if distribution == "truncated_normal":
      std = math.sqrt(variance) / .87962566103423978
      x = jax.random.truncated_normal(key, -2.0, 2.0, size, dtype) * std
    elif distribution == "normal":
      x = jax.random.normal(key, size, dtype) * math.sqrt(variance)
    elif distribution == "uniform":
      x = jax.random.uniform(key, size, dtype, -1.0, 1.0) * math.sqrt(3 * variance)
    else:
      raise ValueError(f"unknown distribution {distribution!r}")
    return x.reshape(shape)
  return init


def lecun_normal():
  """Flax's default kernel initializer (truncated normal, fan-in), drawn flat.

  Example:
    >>> import jax
    >>> lecun_normal()(jax.random.PRNGKey(0), (3, 3, 2, 4)).shape
    (3, 3, 2, 4)
  """
  return variance_scaling(1.0, "fan_in", "truncated_normal")


def normal(std: float):
  """Normal with standard deviation ``std``, drawn flat.

  Example:
    >>> import jax
    >>> normal(0.02)(jax.random.PRNGKey(0), (4, 2, 8)).shape
    (4, 2, 8)
  """
  def init(key, shape, dtype=jnp.float32):
    return (jax.random.normal(key, (math.prod(shape),), dtype) * std).reshape(shape)
  return init


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  """Inverted dropout with a flat mask; identity for ``key=None`` or ``rate=0``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> dropout(jnp.ones((2, 3, 4)), 0.5, jax.random.PRNGKey(0)).shape
    (2, 3, 4)
  """
  if key is None or rate == 0.0:
    return x
  if rate >= 1.0:
    return jnp.zeros_like(x)
  keep = jax.random.bernoulli(key, 1.0 - rate, (x.size,)).reshape(x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


class Dropout(nn.Module):
  """``nn.Dropout`` with a flat mask (uses the ``"dropout"`` rng stream).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> Dropout(0.1).apply({}, jnp.ones((1, 2, 2, 3)), True).shape
    (1, 2, 2, 3)
  """
  rate: float

  @nn.compact
  def __call__(self, x, deterministic: bool):
    if deterministic or self.rate == 0.0:
      return x
    return dropout(x, self.rate, self.make_rng("dropout"))
