"""Static and donated arguments behave as ``jax.jit``'s (issue 20, part 1):
each case is run through ``jax.jit`` and through ``jaxmem.transform`` and
must give the same numbers and the same donation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from tests.helpers import tanh_step


def step(w, x, n=2, *, scale=1.0):
  for _ in range(n):  # n must be static: it is a Python loop count
    w = w - scale * 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w)))(w)
  return w


def _args():
  return jnp.eye(16) * 0.5, jnp.ones((8, 16))


STATIC = [
    ("names given positionally", dict(static_argnames="n"), lambda f, w, x: f(w, x, 3)),
    ("negative index", dict(static_argnums=-1), lambda f, w, x: f(w, x, 3)),
    ("index passed by keyword", dict(static_argnums=2), lambda f, w, x: f(w, x, n=3)),
    ("keyword-only name", dict(static_argnames="scale"), lambda f, w, x: f(w, x, scale=0.5)),
    ("several", dict(static_argnames=("n", "scale")),
     lambda f, w, x: f(w, x, 1, scale=0.5)),
]


@pytest.mark.parametrize("case,spec,call", STATIC, ids=[c[0] for c in STATIC])
def test_static_arguments_resolve_as_jax_jit_resolves_them(case, spec, call):
  w, x = _args()
  want = call(jax.jit(step, **spec), w, x)
  got = call(jaxmem.transform(step, budget="100%", **spec), w, x)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_static_values_are_cached_apart():
  fitted = jaxmem.transform(step, budget="100%", static_argnames="n")
  w, x = _args()
  for n in (1, 3, 1):
    np.testing.assert_allclose(fitted(w, x, n), jax.jit(step, static_argnums=2)(w, x, n),
                               rtol=1e-6)
  assert len(fitted._fits) == 2


def test_an_unhashable_static_argument_is_explained():
  w, x = _args()
  with pytest.raises(ValueError, match="static argument 'n' of step is not hashable.*tuple"):
    jaxmem.transform(step, budget="100%", static_argnames="n")(w, x, n=[3])
  with pytest.raises(ValueError, match="positional argument 2 of step is not hashable"):
    jaxmem.transform(step, budget="100%", static_argnums=2)(w, x, [3])


DONATE = [
    ("donate_argnums", lambda f: jaxmem.transform(f, budget="100%", donate_argnums=0)),
    ("donate_argnames", lambda f: jaxmem.transform(f, budget="100%", donate_argnames="w")),
    ("a jitted step's own", lambda f: jaxmem.transform(jax.jit(f, donate_argnums=0),
                                                       budget="100%")),
    ("a jitted step's own, by name", lambda f: jaxmem.transform(
        jax.jit(f, donate_argnames="w"), budget="100%")),
]


@pytest.mark.parametrize("case,make", DONATE, ids=[c[0] for c in DONATE])
def test_donation_is_kept(case, make):
  """The donated state is deleted after the call, as with ``jax.jit``, and
  XLA aliases its buffer to the output (so the budget counts it once)."""
  w, x = _args()
  want = jax.jit(step)(w, x)
  fitted = make(step)
  assert fitted.lower(w, x).compile().memory_analysis().alias_size_in_bytes == w.nbytes
  got = fitted(w, x)
  assert w.is_deleted() and not x.is_deleted()
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_nothing_is_donated_unless_asked():
  w, x = _args()
  jaxmem.transform(step, budget="100%")(w, x)
  assert not w.is_deleted()


def test_trace_eval_shape_and_clear_cache_are_jax_jits():
  """``trace`` gives the planned step's trace (its jaxpr holds the plan's
  barriers, and it lowers to what ``lower`` gives); ``eval_shape`` gives
  ``jax.jit``'s output shapes without fitting; ``clear_cache`` makes the
  next call fit again."""
  w, x = jnp.eye(64) * 0.1, jnp.ones((512, 64))
  fitted = jaxmem.transform(tanh_step, budget="60%", static_argnames="layers")
  want = jax.jit(tanh_step, static_argnames="layers")
  assert fitted.eval_shape(w, x, layers=6) == want.eval_shape(w, x, layers=6)
  assert not fitted._fits  # eval_shape fitted nothing
  traced = fitted.trace(w, x, layers=6)
  assert "optimization_barrier" in str(traced.jaxpr)
  assert "optimization_barrier" not in str(want.trace(w, x, layers=6).jaxpr)
  assert traced.lower().as_text() == fitted.lower(w, x, layers=6).as_text()
  np.testing.assert_allclose(fitted(w, x, layers=6), want(w, x, layers=6), rtol=1e-5)
  first = fitted.fit(w, x, layers=6)
  fitted.clear_cache()
  assert fitted.fit(w, x, layers=6) is not first


@pytest.mark.parametrize("call", [lambda f, w, x: f(w, x, layers=6),
                                  lambda f, w, x: f(w, x, 6)], ids=["by name", "by position"])
def test_a_jitted_steps_static_arguments_are_kept(call):
  """A step already wrapped in ``jax.jit(..., static_argnames=...)`` keeps
  its static arguments, as it keeps its donations (they were traced as
  arrays: JAX's error from inside the step)."""
  w, x = jnp.eye(64) * 0.1, jnp.ones((512, 64))
  jitted = jax.jit(tanh_step, static_argnames="layers")
  fitted = jaxmem.transform(jitted, budget="60%", micro_batches=1)
  np.testing.assert_allclose(call(fitted, w, x), call(jitted, w, x), rtol=1e-5)
  assert len(fitted.fit(w, x, layers=6).plan)


def test_a_jitted_step_that_prints_is_planned_inside(capfd):
  """A ``jax.debug.print`` inside a jitted step (or a jitted function it
  calls) does not hide the call's body: the step is planned (it was seen
  as one opaque call, with no backward pass), and prints once per call,
  what ``jax.jit`` prints."""
  @jax.jit
  def printing(w, x):
    def loss(w):
      h = x
      for _ in range(6):
        h = h + jnp.tanh(h @ w)
      return jnp.mean(h ** 2)
    value, grad = jax.value_and_grad(loss)(w)
    jax.debug.print("loss {v}", v=value)
    return w - 0.1 * grad
  w, x = jnp.eye(64) * 0.1, jnp.ones((1024, 64))
  fitted = jaxmem.transform(printing, budget="80%", micro_batches=1)
  assert len(fitted.fit(w, x).plan)
  capfd.readouterr()
  got = jax.block_until_ready(fitted(w, x))
  printed = capfd.readouterr().out
  want = jax.block_until_ready(printing(w, x))
  assert printed.count("loss") == 1 and printed == capfd.readouterr().out
  np.testing.assert_allclose(got, want, rtol=1e-5)
