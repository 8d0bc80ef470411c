"""Shared checks: tree comparison scaled by magnitude; a small step to plan;
parameters of which CI runs some."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


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


def assert_donated_steps_match(fitted, step, args, steps=3, rtol=1e-4):
  """``fitted`` and ``jax.jit(step)``, both donating the state ``args[0]``
  (copied first), give the same state and loss over ``steps`` steps."""
  copy = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)
  got, want = copy(args[0]), copy(args[0])
  reference = jax.jit(step, donate_argnums=0)
  for _ in range(steps):
    got, got_loss = fitted(got, *args[1:])
    want, want_loss = reference(want, *args[1:])
    assert_trees_close((got, got_loss), (want, want_loss), rtol=rtol)


def assert_updates_close(got, want, before, rtol=1e-3, floor=1e-3):
  """Per-leaf updates (``after - before``) of two trees compared relative to
  the update's own size, so that a gradient wrong by a fraction of itself
  fails even where the update is small beside the parameter. A leaf whose
  update is below ``floor`` of the largest update in the tree (rounding
  noise in a gradient that is zero in exact arithmetic, such as attention's
  key biases) is judged at that floor. Leaves that are not floats (step
  counts, random keys) must be equal."""
  lg, tg = jax.tree_util.tree_flatten(got)
  lw, tw = jax.tree_util.tree_flatten(want)
  lb, tb = jax.tree_util.tree_flatten(before)
  assert tg == tw == tb, f"tree structures differ: {tg} vs {tw} vs {tb}"
  floats = [np.issubdtype(np.asarray(w).dtype, np.floating) for w in lw]
  moves = [np.asarray(w, np.float64) - np.asarray(b, np.float64) if f else None
           for w, b, f in zip(lw, lb, floats)]
  largest = max((float(np.max(np.abs(m))) for m in moves if m is not None and m.size),
                default=0.0)
  assert largest > 0, "the reference step changes nothing: nothing to compare"
  for g, w, b, move in zip(lg, lw, lb, moves):
    if move is None:
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
      continue
    got_move = np.asarray(g, np.float64) - np.asarray(b, np.float64)
    scale = max(float(np.max(np.abs(move))) if move.size else 0.0, floor * largest)
    np.testing.assert_allclose(got_move, move, rtol=0, atol=rtol * scale)


def xla_budget(step, args, budget) -> int:
  """``budget`` in bytes as a user means it: a fraction (``"60%"`` or a
  float) of XLA's footprint of the step as written, compiled here (not
  jaxmem's resolution of it); bytes as they are."""
  if isinstance(budget, int):
    return budget
  fraction = float(budget.rstrip("%")) / 100 if isinstance(budget, str) else budget
  from jaxmem.targets import xla_footprint  # temp + arguments + outputs - aliases
  return int(fraction * xla_footprint(jax.jit(step).lower(*args).compile()))


def tanh_step(w, x, layers: int = 8, lr: float = 0.01):
  """A small SGD step on a residual tanh chain: its residuals are planned
  at a budget under its footprint."""
  def loss(w):
    h = x
    for _ in range(layers):
      h = h + jnp.tanh(h @ w)
    return jnp.sum(h ** 2)
  return w - lr * jax.grad(loss)(w)


def some_slow(values, slow):
  """``values`` for ``pytest.mark.parametrize``, those in ``slow`` marked
  ``slow``: model-scale variants CI leaves out, while the others keep the
  check in CI. A tuple value stands for several parameters."""
  return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
          if v in slow else v for v in values]
