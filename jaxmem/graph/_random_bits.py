"""Random bits drawn one chunk at a time, the same numbers as drawn whole.

JAX's threefry draws (with ``jax_threefry_partitionable``, the default) give
the element at flat index ``i`` of ``random_bits(key, shape)`` as a hash of
``key`` and ``i`` alone, so a chunk of the array along one axis is the hash
of the chunk's own flat indices: a dropout mask can be drawn per chunk
inside the chunks' loop instead of whole before it, and the step's numbers
stay its own. :func:`exact` checks once, on this JAX, that the chunks drawn
so equal slices of ``jax.random.bits``; where they do not (another PRNG
layout), nothing is drawn per chunk and masks are made whole and sliced.

Example:
  >>> import jax, numpy as np
  >>> key = jax.random.key(0)
  >>> whole = jax.random.bits(key, (4, 6))
  >>> part = chunk_bits(key, 32, (4, 6), axis=0, start=2, step=1, size=2)
  >>> bool(np.array_equal(part, whole[2:4]))
  True
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

_WIDTHS = {8: np.uint8, 16: np.uint16, 32: np.uint32}


def _threefry():
  return jax.random.key(0, impl="threefry2x32").dtype


def chunkable(key_aval, params, axis: int) -> bool:
  """Whether a ``random_bits`` equation (on a key of ``key_aval``, with
  ``params``) can be drawn one chunk along ``axis`` at a time, exactly."""
  shape = tuple(params["shape"])
  return (getattr(key_aval, "shape", None) == () and key_aval.dtype == _threefry()
          and params["bit_width"] in _WIDTHS and axis < len(shape)
          and math.prod(shape) < 2**32 and bool(jax.config.jax_threefry_partitionable)
          and exact())


def chunk_bits(key, bit_width: int, shape: Sequence[int], axis: int, start, step: int,
               size: int):
  """The bits ``random_bits(key, shape)`` holds at indices ``start, start +
  step, ...`` (``size`` of them, ``start`` possibly traced) along ``axis``,
  and all of every other axis."""
  shape = tuple(shape)
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  part = shape[:axis] + (size,) + shape[axis + 1:]
  flat = jnp.zeros(part, np.uint32)
  for d, stride in enumerate(strides):
    index = lax.broadcasted_iota(np.uint32, part, d)
    if d == axis:
      index = jnp.asarray(start, np.uint32) + index * np.uint32(step)
    flat = flat + index * np.uint32(stride)
  data = jax.random.key_data(key)
  bits1, bits2 = threefry2x32_p.bind(data[0], data[1], jnp.zeros(part, np.uint32), flat)
  return lax.convert_element_type(bits1 ^ bits2, _WIDTHS[bit_width])


@functools.lru_cache(maxsize=None)
def exact() -> bool:
  """Whether :func:`chunk_bits` gives ``jax.random.bits``'s numbers on this
  JAX (checked once, on a small array of each width and each axis, in one
  program compiled without LLVM's optimizations: eagerly, each draw
  compiles on its own, and optimized, the draws take seconds to compile
  where the check runs in well under one)."""
  shape = (4, 6, 4)

  def agree():
    key = jax.random.key(11, impl="threefry2x32")
    same = []
    for width, dtype in _WIDTHS.items():
      whole = jax.random.bits(key, shape, dtype)
      for axis in range(len(shape)):
        for start, step, picked in ((2, 1, [2, 3]), (1, 2, [1, 3])):
          part = chunk_bits(key, width, shape, axis, start, step, 2)
          same.append(jnp.array_equal(part, jnp.take(whole, jnp.array(picked), axis)))
    return jnp.stack(same)

  # Lowered on its own (under ``ensure_compile_time_eval`` each draw would
  # run eagerly while tracing): ``agree`` closes over no tracer, so this
  # holds inside a caller's trace too.
  compiled = jax.jit(agree).lower().compile({"xla_backend_optimization_level": 0})
  return bool(np.all(np.asarray(compiled())))
