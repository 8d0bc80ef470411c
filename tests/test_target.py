"""Planning for a GPU that is not here: ``transform(..., target="t4")`` plans
and judges every candidate by XLA:GPU's own compilation for a T4, made on
this CPU-only machine (a compile-only device from the profile's description,
JAX's CUDA plugin without CUDA's libraries). Budgets are resolved in the
tests from XLA:GPU's footprint of the step as written, compiled here for the
T4; numbers are compared with the untransformed step run on the CPU."""

import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem
import jaxmem_models as models
from jaxmem.cost._xla_clock import program_time
from jaxmem.targets import (PROFILES, GpuDescription, get_profile, host_bytes, parse, placed,
                            resolve, xla_footprint)
from tests.helpers import assert_updates_close

T4 = "t4"
# Activation-dominated sizes, as in tests/test_transform.py.
SMALL = {
    "mlp": dict(depth=8, width=64, batch=512, features=32),
    "cnn": dict(widths=(8, 16), batch=8, size=16, blocks=6),
    "transformer": dict(depth=2, dim=32, heads=2, seq=32, batch=16, vocab=64),
}


def t4_footprint(fun, args, target=T4) -> int:
  """XLA:GPU's footprint of ``jax.jit(fun)`` for a T4 (or ``target``),
  compiled here."""
  compiled = jax.jit(fun, compiler_options=resolve(target, ()).options()).lower(
      *placed(args, target)).compile()
  return xla_footprint(compiled)


@pytest.mark.parametrize("name", sorted(n for n, p in PROFILES.items() if p.description))
def test_each_preset_is_a_gpu_xla_compiles_for(name):
  """Each preset's description is one XLA:GPU accepts, names its GPU, and
  agrees with the profile's own figures."""
  profile = PROFILES[name]
  description = profile.description
  assert parse(description.text()) == description
  assert profile.flops == pytest.approx(description.fp32_flops)
  assert profile.memory == description.device_memory_size
  w = placed(jnp.ones((64, 64)), name)
  assert next(iter(w.sharding.device_set)).device_kind == description.name
  step = lambda w: w - jax.grad(lambda w: jnp.sum(jnp.tanh(w @ w)))(w)
  compiled = jax.jit(step, compiler_options=resolve(name, ()).options()).lower(w).compile()
  assert xla_footprint(compiled) >= 2 * 64 * 64 * 4  # the argument and the output


def test_description_parses_what_xla_prints():
  """A real GPU's ``target_config`` as XLA prints it (fields in its order,
  nested messages, fields the description does not hold) reads back."""
  text = PROFILES["h100"].description.text().replace(
      'platform_name: "CUDA"', 'platform_name: "CUDA"\nautotune_results {\n  version: 3\n}')
  assert parse(text) == PROFILES["h100"].description
  with pytest.raises(ValueError, match="core_count"):
    parse(re.sub(r"\s*core_count: \d+", "", text))


def test_description_reads_a_real_h100s_target_config(tmp_path):
  """``tests/data/h100-target-config.txt`` is what an H100's topology gave
  under JAX 0.11.2 (compute capability ``9.0a`` with its feature extension,
  versions as strings and one-field messages, the device's own fields):
  it reads into the preset's figures, and the text the description writes
  back is one this machine's XLA:GPU compiles for (the raw proto of a newer
  XLA need not be)."""
  real = parse((pathlib.Path(__file__).parent / "data" / "h100-target-config.txt").read_text())
  preset = PROFILES["h100"].description
  assert (real.compute_capability, real.core_count, real.cudnn) == ((9, 0), 132, (9, 19))
  different = {f.name for f in dataclasses.fields(real)
               if getattr(real, f.name) != getattr(preset, f.name)}
  assert different <= {"device_memory_size", "memory_bandwidth", "cudnn"}
  profile = dataclasses.replace(PROFILES["h100"], name="recorded-h100", description=real)
  saved = tmp_path / "recorded-h100.json"
  saved.write_text(json.dumps(profile.to_dict()))  # as calibrate()'s profile is kept
  assert get_profile(str(saved)) == profile
  assert get_profile(saved) is get_profile(str(saved))  # read once, not per plan priced
  w = placed(jnp.ones((64, 64)), str(saved))
  assert next(iter(w.sharding.device_set)).device_kind == real.name
  compiled = jax.jit(lambda w: w @ w).lower(w).compile()
  assert xla_footprint(compiled) >= 2 * 64 * 64 * 4


def test_lowering_on_t4_plans_for_the_t4_not_for_this_machine():
  """Arguments placed on a T4 make it the target (no ``target=``): the fit
  is judged by XLA:GPU, whose footprint differs from XLA:CPU's, and the
  same transform called with arrays here plans for the CPU. (Planned
  budgets on the T4 are checked in ``test_target_fits``.)"""
  task = models.get("mlp", **SMALL["mlp"])
  args = task.init()
  fitted = jaxmem.transform(task.step, budget="100%")
  on_t4 = fitted.fit(*placed(args, T4))
  here = fitted.fit(*args)
  assert on_t4.target.platform == "gpu" and here.target.platform == "cpu"
  assert on_t4.unconstrained == t4_footprint(task.step, args)
  assert here.unconstrained == xla_footprint(jax.jit(task.step).lower(*args).compile())
  assert on_t4.unconstrained != here.unconstrained
  assert xla_footprint(fitted.lower(*placed(args, T4)).compile()) <= on_t4.budget
  # The memory model is learned from XLA:GPU's program for the T4, as with
  # target="t4", not from this machine's compiler.
  named = jaxmem.transform(task.step, budget="100%", target=T4).fit(*args)
  assert on_t4.memory.peak == named.memory.peak != here.memory.peak


def _offloaded(fit) -> list:
  """The values the fit's plan keeps in host memory."""
  return [fit.graph.values[v] for v in fit.plan.values_with("offload")]


def test_an_offload_plan_holds_host_memory_in_xla_gpu_program():
  """XLA:GPU's program for a T4 holds every value the plan offloads in host
  memory (``S(5)``), its host bytes are those values' bytes, and its device
  footprint meets the budget: the compiler, not the memory model, confirms
  the plan's offload (XLA:CPU ignores memory kinds). The MLP's activations
  (4 MiB each) outweigh the workspace XLA:GPU gives cuBLAS, which a smaller
  step's footprint is mostly made of."""
  task = models.get("mlp", optimizer=optax.sgd(1e-3), depth=8, width=512, batch=2048,
                    features=64)
  args = task.init()
  budget = int(0.8 * t4_footprint(task.step, args))
  fitted = jaxmem.transform(task.step, budget="80%", planner="offload", target=T4)
  fit = fitted.fit(*args)
  offloaded = _offloaded(fit)
  assert offloaded, "the plan offloads nothing: nothing to check"
  compiled = fitted.lower(*placed(args, T4)).compile()
  on_host = re.findall(r"\w+\[([\d,]*)\]\{[\d,]*:[^}]*S\(5\)", compiled.as_text())
  for value in offloaded:
    assert ",".join(map(str, value.aval.shape)) in on_host, (value.aval, sorted(set(on_host)))
  assert host_bytes(compiled) == sum(v.nbytes for v in offloaded)
  # The clock puts each offloaded value on the link twice, down and back up.
  t4 = PROFILES[T4]
  assert program_time(compiled.as_text(), t4).link == pytest.approx(sum(
      t4.transfer_seconds(v.nbytes, "d2h") + t4.transfer_seconds(v.nbytes, "h2d")
      for v in offloaded))
  assert fit.budget == budget and xla_footprint(compiled) <= budget
  state, batch = args
  assert_updates_close(fitted(state, batch)[0], jax.jit(task.step)(state, batch)[0], state)


def test_the_learned_model_follows_xla_gpu_through_an_offload_plan():
  """With buffers learned from XLA:GPU's program for a T4, the model's
  footprint of the LayerNorm MLP as written and of an offload plan are
  XLA:GPU's within 1%. XLA:GPU computes LayerNorm's ``x - mean`` and its
  kin inside their backward readers from the layer's input, so that input
  is what the backward pass holds and what the plan offloads; had the
  model kept those values in buffers of their own (as XLA:CPU does), it
  was 26% over XLA:GPU's footprint as written."""
  task = models.get("mlp", optimizer=optax.sgd(1e-3), depth=8, width=512, batch=2048,
                    features=64)
  args = task.init()
  fitted = jaxmem.transform(task.step, budget="80%", planner="offload", target=T4,
                            micro_batches=1)
  fit = fitted.fit(*args)
  assert fit.unconstrained_model == pytest.approx(fit.unconstrained, rel=0.01)
  assert _offloaded(fit)
  compiled = fitted.lower(*placed(args, T4)).compile()
  assert fit.memory.peak == pytest.approx(xla_footprint(compiled), rel=0.01)
  # Layer inputs no backward equation reads itself are residuals, and the
  # plan offloads them.
  graph = fit.graph
  through = {r.value for r in graph.residuals
             if not any(graph.nodes[u].backward for u in graph.values[r.value].uses)}
  assert through & fit.plan.values_with("offload")


def test_a_profile_without_description_is_refused_as_a_target():
  bare = jaxmem.DeviceProfile("mine", flops=1e12, memory_bandwidth=1e11, h2d_bandwidth=1e10,
                              d2h_bandwidth=1e10, link_latency=1e-5, memory=2**30)
  with pytest.raises(ValueError, match="has no GPU description"):
    jaxmem.transform(lambda w: w, budget="50%", target=bare)
  with pytest.raises(ValueError, match="unknown device profile 'k80'"):
    jaxmem.transform(lambda w: w, budget="50%", target="k80")


def test_a_calibrated_description_round_trips_through_a_profile():
  """A description made from figures (as ``calibrate()`` records a real
  GPU's) is a target: XLA:GPU compiles for it."""
  description = GpuDescription(
      "NVIDIA L4", (8, 9), core_count=58, fpus_per_core=128, clock_rate_ghz=2.04,
      device_memory_size=23034 * 2**20, memory_bandwidth=300e9, l2_cache_size=48 * 2**20,
      shared_memory_per_core=100 * 2**10, shared_memory_per_block_optin=99 * 2**10,
      threads_per_core_limit=1536)
  l4 = jaxmem.DeviceProfile("l4", flops=description.fp32_flops, memory_bandwidth=300e9,
                            h2d_bandwidth=24e9, d2h_bandwidth=24e9, link_latency=1e-5,
                            memory=description.device_memory_size, description=description)
  step = lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
  w, x = jnp.eye(64), jnp.ones((128, 64))
  fit = jaxmem.transform(step, budget="100%", target=l4).fit(w, x)
  assert fit.unconstrained == t4_footprint(step, (w, x), l4)
  np.testing.assert_allclose(jaxmem.transform(step, budget="100%", target=l4)(w, x),
                             jax.jit(step)(w, x), rtol=1e-6)




_PERSISTENT_CACHE = """
import os, sys, warnings
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import jaxmem
sys.path.insert(0, os.getcwd())
from tests.helpers import tanh_step

w, x = jnp.eye(128) * 0.1, jnp.ones((4096, 128))
before_fit = len(os.listdir(sys.argv[1]))  # the eager ops making the arguments
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  fit = jaxmem.transform(tanh_step, budget="80%", target="t4", micro_batches=1).fit(w, x)
assert len(fit.plan)  # planned: several compilations for the T4
after_fit = len(os.listdir(sys.argv[1]))
jax.jit(lambda x: jnp.sin(x) @ x.T)(x).block_until_ready()  # XLA:CPU's are cached
print(after_fit - before_fit, len(os.listdir(sys.argv[1])) - after_fit,
      sum("persistent compilation cache" in str(w.message) for w in caught))
"""


def test_a_fit_for_a_gpu_not_here_writes_nothing_to_jaxs_persistent_cache(tmp_path):
  """With JAX's persistent compilation cache on, a fit for a compile-only
  T4 writes none of its compilations there (JAX cannot load them back
  without the GPU, and warns at every later compile of the same program),
  while XLA:CPU's compilations in the same process are cached; a second
  process's fit of the same step warns of nothing."""
  import subprocess
  import sys
  cache = tmp_path / "cache"
  script = tmp_path / "fit.py"
  script.write_text(_PERSISTENT_CACHE)
  seen = []
  for _ in range(2):
    done = subprocess.run([sys.executable, str(script), str(cache)], capture_output=True,
                          text=True, cwd=pathlib.Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    seen.append(tuple(map(int, done.stdout.split()[-3:])))
  assert seen == [(0, 1, 0), (0, 0, 0)]
