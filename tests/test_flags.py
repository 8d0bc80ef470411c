"""Where the XLA:CPU option that keeps recomputation applies (jaxmem._flags).

XLA:GPU cannot compile optimization barriers with the pass disabled, so the
option must never be global where an accelerator may run; jaxmem's own steps
carry it per compilation on CPU instead.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from jaxmem import _flags
from tests.helpers import some_slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compiler_options_only_on_cpu(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  assert _flags.compiler_options("cpu") == {"xla_disable_hlo_passes": "cse_barrier_expander"}
  assert _flags.compiler_options("gpu") == {}
  assert _flags.compiler_options("tpu") == {}


def test_flag_set_for_cpu_remat_is_taken_back_on_gpu_compilations(monkeypatch):
  """``XLA_FLAGS`` disabling the CPU barrier pass (``import jaxmem`` sets it
  in CPU-only processes) would make XLA:GPU refuse every barrier; a GPU
  compilation's options give the list of disabled passes again without it
  (tests/test_target.py compiles for a T4 in this process)."""
  monkeypatch.setenv("XLA_FLAGS", _flags.CPU_REMAT_FLAG)
  assert _flags.compiler_options("gpu") == {"xla_disable_hlo_passes": ""}
  monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=cse_barrier_expander,foo")
  assert _flags.compiler_options("gpu") == {"xla_disable_hlo_passes": "foo"}


def test_a_plugin_without_an_accelerator_is_cpu_only(monkeypatch):
  """JAX's CUDA plugin installed to compile for GPU targets, on a machine
  with no GPU: the process runs on the CPU alone."""
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.delenv("JAX_PLATFORM_NAME", raising=False)
  monkeypatch.setattr(_flags, "_accelerator_plugins", lambda: ["xla_cuda13"])
  monkeypatch.setattr(_flags, "_accelerator_present", lambda: False)
  assert _flags.cpu_only()
  monkeypatch.setattr(_flags, "_accelerator_present", lambda: True)
  assert not _flags.cpu_only()


@pytest.mark.parametrize("platforms, expected", [
    ("cpu", True), ("cuda", False), ("cpu,cuda", False), ("tpu", False)])
def test_cpu_only_reads_jax_platforms(monkeypatch, platforms, expected):
  monkeypatch.setenv("JAX_PLATFORMS", platforms)
  assert _flags.cpu_only() is expected


def test_no_global_flag_where_an_accelerator_may_run(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
  with pytest.warns(UserWarning, match="needs that pass"):
    assert _flags.enable_cpu_remat() is False
  assert os.environ["XLA_FLAGS"] == "--xla_foo=1"


def test_fitted_step_keeps_recomputation_without_the_global_flag():
  """A process whose backend starts before jaxmem is imported never gets the
  global flag; jaxmem's compiled step still keeps its recomputation (without
  the per-compilation option, XLA:CPU merges it back and the budget fails)."""
  script = textwrap.dedent("""
      import os, jax, jax.numpy as jnp
      jnp.ones(1).block_until_ready()  # the backend starts here
      import jaxmem
      from jaxmem.targets import xla_footprint
      assert "cse_barrier_expander" not in os.environ.get("XLA_FLAGS", "")

      def step(w, x):
        def loss(w):
          h = x
          for _ in range(16):
            h = jnp.tanh(h @ w)
          return jnp.sum(h * h)
        return jax.grad(loss)(w)

      w, x = jnp.full((128, 128), 0.01), jnp.ones((512, 128))
      plain = xla_footprint(jax.jit(step).lower(w, x).compile())
      fitted = jaxmem.transform(step, budget=int(0.6 * plain))
      compiled = fitted.lower(w, x).compile()
      assert xla_footprint(compiled) <= int(0.6 * plain), (xla_footprint(compiled), plain)
      assert jnp.allclose(fitted(w, x), jax.jit(step)(w, x), rtol=1e-5, atol=1e-6)
      print("ok")
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("target", some_slow(["cpu", "t4", "h100"], ("h100",)))  # XLA:GPU: t4
@pytest.mark.parametrize("name,config", [
    ("gpt2", dict(scan=True, depth=2, dim=32, heads=2, seq=32, vocab=64, batch=4)),
    ("resnet18", dict(width=8, stages=[1, 1], size=16, batch=4))])
def test_measuring_compiles_give_the_footprint_of_the_real_one(name, config, target):
  """The fit loop reads footprints from compilations without LLVM's
  optimization (nor, on a GPU, ptxas's); the step the user runs is
  compiled with both (on XLA:CPU, and on XLA:GPU for T4 and H100 targets:
  an option that changes a GPU's convolution workspaces, such as
  autotuning off, would show on the H100)."""
  import jax
  from jaxmem.targets import placed, resolve, xla_footprint
  from jaxmem._zoo import models
  task = models().get(name, **config)
  shapes = jax.eval_shape(task.init)
  if target != "cpu":
    shapes = placed(shapes, target)
  on = resolve(None if target == "cpu" else target, jax.tree_util.tree_leaves(shapes))
  footprints = {xla_footprint(jax.jit(task.step, compiler_options=options or None)
                              .lower(*shapes).compile())
                for options in (on.options(), on.options(measuring=True))}
  assert len(footprints) == 1
  assert on.options(measuring=True)["xla_backend_optimization_level"] == 0
  assert on.options(measuring=True).get("xla_gpu_disable_gpuasm_optimizations",
                                         False) == (target != "cpu")
