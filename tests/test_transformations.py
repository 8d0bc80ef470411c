"""Transformations of a fitted step (issue 20, part 2): under ``jax.vmap``
the step is planned for the batched shapes, so an absolute or fractional
budget holds for the whole batched program (it once compiled a per-example
plan, 2.36 MB against a 300 kB budget, with no error) or a BudgetError
says it cannot; ``jit``, ``grad`` and ``jvp`` through it keep the numbers;
inside ``shard_map`` the budget is per device."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.targets import xla_footprint
from jaxmem._flags import compiler_options

from helpers import assert_trees_close, tanh_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E = 4  # ensemble members under vmap


def step(w, x):
  return tanh_step(w, x)


def _args():
  return jnp.eye(64) * 0.1, jax.random.normal(jax.random.key(0), (256, 64))


def _footprint(fun, *args) -> int:
  options = compiler_options(jax.default_backend()) or None
  return xla_footprint(jax.jit(fun, compiler_options=options).lower(*args).compile())


VMAPS = {
    "vmap": lambda f: jax.vmap(f, in_axes=(0, None)),
    "vmap(jit)": lambda f: jax.vmap(jax.jit(f), in_axes=(0, None)),
    "jit(vmap)": lambda f: jax.jit(jax.vmap(f, in_axes=(0, None))),
}


@pytest.mark.parametrize("how,fraction", [(how, "absolute") for how in VMAPS] + [("vmap", 0.6)])
def test_under_vmap_the_budget_holds_for_the_batched_program(how, fraction):
  w, x = _args()
  ws = jnp.stack([w * (i + 1) for i in range(E)])
  want = jax.vmap(step, in_axes=(0, None))(ws, x)
  batched = _footprint(jax.vmap(step, in_axes=(0, None)), ws, x)
  budget = int(0.6 * batched) if fraction == "absolute" else fraction
  limit = int(0.6 * batched)
  assert limit > _footprint(step, w, x)  # a per-example plan is the unplanned step
  wrapped = VMAPS[how](jaxmem.transform(step, budget=budget))
  assert _footprint(wrapped, ws, x) <= limit
  assert_trees_close(wrapped(ws, x), want)


def test_a_budget_the_batched_program_cannot_meet_is_an_error():
  w, x = _args()
  # Run whole: in micro-batches of x, the batched program may meet it.
  fitted = jaxmem.transform(step, budget=_footprint(step, w, x), micro_batches=1)
  fitted(w, x)  # meets it for one example
  with pytest.raises(jaxmem.BudgetError, match="shrink the batch") as error:
    jax.vmap(fitted, in_axes=(0, None))(jnp.stack([w] * E), x)
  assert error.value.smallest > _footprint(step, w, x)


def test_a_batched_fit_is_kept_per_batching():
  fitted = jaxmem.transform(step, budget="60%")
  w, x = _args()
  ws, xs = jnp.stack([w] * E), jnp.stack([x] * E)
  for _ in range(2):
    jax.vmap(fitted, in_axes=(0, None))(ws, x)
    jax.vmap(fitted, in_axes=(None, 0))(w, xs)
  assert len(fitted._batched) == 2


def test_grad_and_jvp_through_a_fitted_step_match_the_step():
  w, x = _args()
  fitted = jaxmem.transform(step, budget="60%")
  outer = lambda f: lambda w: jnp.sum(jnp.sin(f(w, x)))
  assert_trees_close(jax.grad(outer(fitted))(w), jax.grad(outer(step))(w))
  assert_trees_close(jax.jit(jax.grad(outer(fitted)))(w), jax.grad(outer(step))(w))
  got = jax.jvp(lambda w: fitted(w, x), (w,), (jnp.ones_like(w),))
  want = jax.jvp(lambda w: step(w, x), (w,), (jnp.ones_like(w),))
  assert_trees_close(got, want)


def test_static_arguments_pass_through_vmap():
  def scaled(w, x, n):
    return step(w, x) * n
  w, x = _args()
  ws = jnp.stack([w] * E)
  fitted = jaxmem.transform(scaled, budget="60%", static_argnums=2)
  assert_trees_close(jax.vmap(lambda w: fitted(w, x, 3))(ws),
                     jax.vmap(lambda w: scaled(w, x, 3))(ws))


SHARD_MAP = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, jaxmem
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxmem.targets import xla_footprint
    from test_transformations import step
    try:
      from jax import shard_map
    except ImportError:  # JAX before shard_map left experimental
      from jax.experimental.shard_map import shard_map

    mesh = Mesh(jax.devices()[:2], ("d",))
    # check_vma=False: no pvary / psum_invariant inside the per-device step.
    spmd = lambda f: jax.jit(shard_map(lambda w, x: w - 0.01 * jax.lax.pmean(f(w, x), "d"),
                                       mesh=mesh, in_specs=(P(), P("d")), out_specs=P(),
                                       check_vma=False))
    w, x = jnp.eye(64) * 0.1, jax.random.normal(jax.random.key(0), (512, 64))
    per_device = xla_footprint(spmd(step).lower(w, x).compile())
    budget = int(0.6 * per_device)
    fitted = spmd(jaxmem.transform(step, budget=budget))
    got = xla_footprint(fitted.lower(w, x).compile())
    assert got <= budget, (got, budget, per_device)
    assert jnp.allclose(fitted(w, x), spmd(step)(w, x), rtol=1e-5, atol=1e-6)
    def refusal(fun, **options):
      try:
        jax.jit(shard_map(fun, mesh=mesh, in_specs=(P(), P("d")), **options)).lower(w, x)
      except NotImplementedError as error:
        return str(error)
      raise AssertionError("a step with collectives was fitted apart from its mesh")

    reducing = lambda w, x: jax.lax.pmean(step(w, x), "d")
    assert "over mesh axes (psum)" in refusal(jaxmem.transform(reducing, budget=budget),
                                              out_specs=P(), check_vma=False)
    # Replicated weights under varying-axes typing: pvary / psum_invariant.
    assert "over mesh axes" in refusal(jaxmem.transform(step, budget=budget), out_specs=P("d"))
    print("ok", got, budget, per_device)
""")


def test_under_shard_map_the_budget_holds_per_device():
  """Inside ``shard_map`` the step is traced with one shard's shapes, so the
  plan and its budget are per device (two CPU devices, in a process of
  their own); a step that itself reduces over the mesh is refused with a
  way out, not mis-compiled."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      filter(None, [ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH")])))
  done = subprocess.run([sys.executable, "-c", SHARD_MAP], env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
