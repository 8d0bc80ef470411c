"""Steps written the way production JAX code writes them (issue 17): a
transformer stack under Flax ``nn.scan``, the same over ``nn.remat`` blocks,
a step with ``lax.cond``, a ``custom_vjp`` activation and a ``while_loop``,
gradient accumulation over micro-batches (a Python loop and a ``lax.scan``).

Each is fitted at 100%, 70%, 50% and the smallest budget jaxmem names, the
budgets resolved here from XLA's footprint of the untransformed step: the
fitted step's XLA footprint is within the budget and its gradients match
the untransformed step's over three steps."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem._fit import xla_footprint
from jaxmem._flags import compiler_options

from helpers import assert_trees_close

L, B, D, T = 16, 512, 16, 8


class _Block(nn.Module):
  """A pre-LN transformer block over sequences of ``T`` rows: a scan body."""
  @nn.compact
  def __call__(self, h, _):
    q, k, v = (nn.Dense(D)(nn.LayerNorm()(h)).reshape(-1, T, D) for _ in range(3))
    att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / D ** 0.5)
    h = h + jnp.einsum("bts,bsd->btd", att, v).reshape(h.shape)
    return h + nn.Dense(D)(jax.nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(h)))), None


def _stack(remat: bool, scan: bool = True):
  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      block = nn.remat(_Block) if remat else _Block
      if not scan:
        for _ in range(L):
          x, _ = block()(x, None)
        return jnp.mean(x ** 2)
      stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=L)
      h, _ = stack()(x, None)
      return jnp.mean(h ** 2)
  return Stack()


def _sgd(loss):
  """A step returning the updated parameters and the gradients."""
  def step(params, x):
    grads = jax.grad(loss)(params, x)
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), grads
  return step


def _flax(remat: bool, scan: bool = True):
  model, x = _stack(remat, scan), jax.random.normal(jax.random.key(1), (B, D))
  return _sgd(model.apply), (model.init(jax.random.key(0), x), x)


@jax.custom_vjp
def _act(x):
  return jnp.tanh(x)


def _act_fwd(x):
  y = jnp.tanh(x)
  return y, y


_act.defvjp(_act_fwd, lambda y, g: (g * (1 - y ** 2),))


def _control_loss(ws, x):
  h = x
  for w in ws:
    h = h + _act(h @ w)
    h = jax.lax.cond(jnp.sum(h) > 0, lambda h: h * 0.9, lambda h: h * 1.1, h)
  norm = jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.sqrt(c[0] + 1.0), c[1] + 1),
                            (jax.lax.stop_gradient(jnp.sum(h ** 2)), 0))[0]
  return jnp.mean((h / norm) ** 2)


def _weights():
  return jax.random.normal(jax.random.key(0), (L, D, D)) * 0.3


def _control():
  """A Python loop over a list of weights."""
  return _sgd(_control_loss), (list(_weights()), jax.random.normal(jax.random.key(1), (B, D)))


def _mlp_loss(ws, x):
  h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, ws)
  return jnp.mean(h ** 2)


def _accumulate_python(ws, xs):
  return sum(jax.grad(_mlp_loss)(ws, xs[i]) for i in range(xs.shape[0]))


def _accumulate_scan(ws, xs):
  return jax.lax.scan(lambda g, x: (g + jax.grad(_mlp_loss)(ws, x), None),
                      jnp.zeros_like(ws), xs)[0]


def _accumulating(accumulate):
  def step(ws, xs):
    grads = accumulate(ws, xs)
    return ws - 0.01 * grads, grads
  return step, (_weights(), jax.random.normal(jax.random.key(1), (2, B, D)))


# name -> (make, reach): the smallest budget jaxmem names must be at most
# ``reach`` of the untransformed step's XLA footprint (measured: 0.08, 0.91,
# 0.38, 0.62 and 1.0). The remat stack keeps only its layer inputs, which a
# nested loop halves; several backward passes in one step are not yet
# planned pass by pass (issue 17, part 6), so the accumulating steps reach
# little.
MODELS = {
    "nn.scan": (lambda: _flax(False), 0.15),
    "nn.scan(nn.remat)": (lambda: _flax(True), 0.95),
    "cond+custom_vjp+while": (_control, 0.5),
    "accumulate-python": (lambda: _accumulating(_accumulate_python), 0.7),
    "accumulate-scan": (lambda: _accumulating(_accumulate_scan), 1.0),
}
FRACTIONS = [(name, f) for name, (_, reach) in MODELS.items() for f in (1.0, 0.7, 0.5)
             if f >= reach]


def _footprint(step, args) -> int:
  options = compiler_options(jax.default_backend()) or None
  return xla_footprint(jax.jit(step, compiler_options=options).lower(*args).compile())


def _smallest(step, args) -> int:
  with pytest.raises(jaxmem.BudgetError) as error:
    jaxmem.transform(step, budget=1).fit(*args)
  return error.value.smallest


def _check(step, args, budget: int):
  fitted = jaxmem.transform(step, budget=budget)
  assert xla_footprint(fitted.lower(*args).compile()) <= budget
  expected, got = args, args
  for _ in range(3):
    (params, grads), (want, want_grads) = fitted(*got), jax.jit(step)(*expected)
    assert_trees_close(grads, want_grads, rtol=1e-5)
    got, expected = (params,) + got[1:], (want,) + expected[1:]


@pytest.mark.parametrize("name,fraction", FRACTIONS)
def test_fits_and_matches(name, fraction):
  make, _ = MODELS[name]
  step, args = make()
  _check(step, args, int(_footprint(step, args) * fraction))


@pytest.mark.parametrize("name", list(MODELS))
def test_the_smallest_budget_named_fits_and_matches(name):
  make, reach = MODELS[name]
  step, args = make()
  smallest, footprint = _smallest(step, args), _footprint(step, args)
  assert smallest <= reach * footprint
  _check(step, args, smallest)
  if name.startswith("nn.scan"):
    emitted = jax.make_jaxpr(jaxmem.transform(step, budget=smallest))(*args)
    assert "scan[" in str(emitted), "the planned step is still a loop"


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True], ids=["nn.scan", "nn.scan(nn.remat)"])
def test_a_scanned_stack_reaches_what_the_unrolled_one_does(remat):
  """Within 5% of the same stack unrolled (measured: 1.99 MB scanned, 2.0 MB unrolled)."""
  scanned, unrolled = (_smallest(*_flax(remat, scan)) for scan in (True, False))
  assert scanned <= 1.05 * unrolled
