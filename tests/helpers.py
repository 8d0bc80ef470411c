"""Shared checks: tree comparison scaled by magnitude (DESIGN.md fact 8)."""

import jax
import numpy as np


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, f"tree structures differ: {ta} vs {tb}"
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape and x.dtype == y.dtype
    if np.issubdtype(x.dtype, np.floating):
      scale = max(float(np.max(np.abs(y))), 1.0) if y.size else 1.0
      np.testing.assert_allclose(x, y, rtol=0, atol=rtol * scale + atol)
    else:
      np.testing.assert_array_equal(x, y)
