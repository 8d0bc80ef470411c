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
from jaxmem.targets import xla_footprint
from jaxmem._flags import compiler_options

from helpers import assert_trees_close, some_slow

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


def _accumulate_fori(ws, xs):
  return jax.lax.fori_loop(0, xs.shape[0], lambda i, g: g + jax.grad(_mlp_loss)(ws, xs[i]),
                           jnp.zeros_like(ws))


def _critic(ws, x):
  """A residual MLP over a list of weights (a GAN's networks)."""
  for w in ws:
    x = x + jnp.tanh(x @ w)
  return x


def _gan():
  """Discriminator step, then a generator step through the updated one."""
  def step(wd, wg, z, x):
    d = lambda wd, h: jnp.mean(_critic(wd, h) ** 2)
    fake = _critic(wg, z)
    grads_d = jax.grad(lambda wd: d(wd, fake) - d(wd, x))(wd)
    wd = [w - 0.1 * g for w, g in zip(wd, grads_d)]
    grads_g = jax.grad(lambda wg: -d(wd, _critic(wg, z)))(wg)
    return (wd, [w - 0.1 * g for w, g in zip(wg, grads_g)]), (grads_d, grads_g)
  ws = list(_weights()[: L // 2])
  return _first_two(step), ((ws, ws), *jax.random.normal(jax.random.key(1), (2, B, D)))


def _gradient_penalty():
  """A loss holding the norm of its input gradient (a WGAN-GP critic)."""
  def loss(ws, x):
    grad_x = jax.grad(lambda x: jnp.mean(_critic(ws, x) ** 2))(x)
    return jnp.mean(_critic(ws, x) ** 2) + jnp.mean(grad_x ** 2)
  return _sgd(loss), (list(_weights()[: L // 2]), jax.random.normal(jax.random.key(1), (B, D)))


def _first_two(step):
  """``step(a, b, *rest) -> ((a', b'), grads)`` as ``step(params, *rest)``
  with ``params = (a, b)``, the shape ``_check`` feeds back."""
  def paired(params, *rest):
    return step(*params, *rest)
  return paired


def _accumulating(accumulate):
  def step(ws, xs):
    grads = accumulate(ws, xs)
    return ws - 0.01 * grads, grads
  return step, (_weights(), jax.random.normal(jax.random.key(1), (2, B, D)))


# name -> (make, reach): the smallest budget jaxmem names must be at most
# ``reach`` of the untransformed step's XLA footprint (measured: 0.08, 0.91,
# 0.38, 0.25, 0.42, 0.42, 0.34 and 0.66). The remat stack keeps only its
# layer inputs, which a nested loop halves. Steps with several backward
# passes are planned pass by pass; where the passes run inside a loop, its
# body is planned as a step of its own.
MODELS = {
    "nn.scan": (lambda: _flax(False), 0.15),
    "nn.scan(nn.remat)": (lambda: _flax(True), 0.95),
    "cond+custom_vjp+while": (_control, 0.5),
    "accumulate-python": (lambda: _accumulating(_accumulate_python), 0.35),
    "accumulate-scan": (lambda: _accumulating(_accumulate_scan), 0.5),
    "accumulate-fori_loop": (lambda: _accumulating(_accumulate_fori), 0.5),
    "gan": (_gan, 0.45),
    "gradient-penalty": (_gradient_penalty, 0.75),
}
# Steps written as a loop -> the length of the loop the planned step still
# runs at its top (layers; micro-batches): no unrolling.
LOOPS = {"nn.scan": L, "accumulate-scan": 2, "accumulate-fori_loop": 2}
FRACTIONS = [(name, f) for name, (_, reach) in MODELS.items() for f in (1.0, 0.7, 0.5)
             if f >= reach]


def _footprint(step, args) -> int:
  options = compiler_options(jax.default_backend()) or None
  return xla_footprint(jax.jit(step, compiler_options=options).lower(*args).compile())


def _smallest(step, args, **options) -> int:
  with pytest.raises(jaxmem.BudgetError) as error:
    jaxmem.transform(step, budget=1, **options).fit(*args)
  return error.value.smallest


def _check(step, args, budget: int):
  fitted = jaxmem.transform(step, budget=budget)
  assert xla_footprint(fitted.lower(*args).compile()) <= budget
  expected, got = args, args
  for _ in range(3):
    (params, grads), (want, want_grads) = fitted(*got), jax.jit(step)(*expected)
    assert_trees_close(grads, want_grads, rtol=1e-5)
    got, expected = (params,) + got[1:], (want,) + expected[1:]


# CI fits the scanned stack as written and with nn.remat; its plans below
# (18-21 s each there) are model-scale.
@pytest.mark.parametrize("name,fraction",
                         some_slow(FRACTIONS, (("nn.scan", 0.7), ("nn.scan", 0.5))))
def test_fits_and_matches(name, fraction):
  make, _ = MODELS[name]
  step, args = make()
  _check(step, args, int(_footprint(step, args) * fraction))


# The scanned stack's smallest (38 s in CI) is model-scale; with nn.remat it stays.
@pytest.mark.parametrize("name", some_slow(list(MODELS), ("nn.scan",)))
def test_the_smallest_budget_named_fits_and_matches(name):
  make, reach = MODELS[name]
  step, args = make()
  smallest, footprint = _smallest(step, args), _footprint(step, args)
  assert smallest <= reach * footprint
  _check(step, args, smallest)
  if name in LOOPS:
    emitted = jax.make_jaxpr(jaxmem.transform(step, budget=smallest))(*args)
    assert LOOPS[name] in _loops(emitted.jaxpr), "the planned step is still a loop"


_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vmap_call": "call"}


def _loops(jaxpr) -> list:
  """Lengths of the scans, through nested calls (jits and the custom_jvp /
  custom_vmap a traced fitted step runs in) and other scans (a step run in
  micro-batches runs its layers' loop in the loop over them)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      found.append(eqn.params["length"])
      found += _loops(eqn.params["jaxpr"].jaxpr)
    elif eqn.params.get(_CALLS.get(eqn.primitive.name)) is not None:
      inner = eqn.params[_CALLS[eqn.primitive.name]]
      found += _loops(getattr(inner, "jaxpr", inner))
  return found


@pytest.mark.slow
@pytest.mark.parametrize("remat,within", [(False, 1.05), (True, 1.10)],
                         ids=["nn.scan", "nn.scan(nn.remat)"])
def test_a_scanned_stack_reaches_what_the_unrolled_one_does(remat, within):
  """Plans of residuals reach near the same stack unrolled (measured: 1.99
  MB scanned against 2.0 MB unrolled; with nn.remat 1.84 MB against 1.73
  MB, the unrolled stack's recomputation being chosen per layer). Both are
  planned whole (``micro_batches=1``): the unrolled stack alone could run
  in micro-batches (0.77 MB), which a step with ``nn.scan`` layers is not
  cut into."""
  scanned, unrolled = (_smallest(*_flax(remat, scan), micro_batches=1)
                       for scan in (True, False))
  assert scanned <= within * unrolled
