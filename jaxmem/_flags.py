"""The XLA option that recomputation on CPU depends on, and where it applies.

XLA:CPU runs the ``cse_barrier_expander`` pass early, which removes
optimization barriers; common-subexpression elimination then merges every
recomputation back into the forward pass, so a rematerialized step is
*larger* on CPU than the plain one (measured on a residual MLP with jax
0.10: 65 MiB plain, 96 MiB with per-layer ``jax.checkpoint``, 34 MiB with
the pass disabled).

XLA:GPU needs that pass: it is how barriers are lowered there. With it
disabled, every program holding a barrier (``jax.checkpoint``'s too) fails
to compile with "Unsupported instruction opcode: opt-barrier" (measured on
an H200, JAX 0.11.2). So the option is never global where an accelerator
may run:

* :func:`compiler_options` gives the option per compilation, for CPU only;
  jaxmem compiles its own steps with it, whatever the process's flags.
* :func:`enable_cpu_remat` puts it into ``XLA_FLAGS`` (for steps compiled by
  plain ``jax.jit``, such as hand-written remat baselines measured on CPU)
  only in a process that can run on nothing but the CPU. ``import jaxmem``
  calls it.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pkgutil
import warnings

CPU_REMAT_PASS = "cse_barrier_expander"
CPU_REMAT_FLAG = f"--xla_disable_hlo_passes={CPU_REMAT_PASS}"


def compiler_options(platform: str) -> dict[str, str]:
  """``jax.jit`` compiler options that keep recomputation on ``platform``:
  the barrier pass off on CPU. Elsewhere nothing, unless ``XLA_FLAGS``
  disables that pass (a CPU-only process, :func:`enable_cpu_remat`): then
  the list of disabled passes is given again without it, since a
  compilation's option replaces the flag's list. That is what lets a
  CPU-only process compile for a GPU target (a compile-only device).

  Example:
    >>> compiler_options("cpu")
    {'xla_disable_hlo_passes': 'cse_barrier_expander'}
    >>> import os
    >>> compiler_options("gpu") == ({'xla_disable_hlo_passes': ''} if flag_is_set() else {})
    True
  """
  if platform == "cpu":
    return {"xla_disable_hlo_passes": CPU_REMAT_PASS}
  if not flag_is_set():
    return {}
  return {"xla_disable_hlo_passes": ",".join(
      p for p in _disabled_passes() if p != CPU_REMAT_PASS)}


def _disabled_passes() -> list[str]:
  """The passes ``XLA_FLAGS`` disables (its last ``--xla_disable_hlo_passes``)."""
  found: list[str] = []
  for flag in os.environ.get("XLA_FLAGS", "").split():
    if flag.startswith("--xla_disable_hlo_passes="):
      found = [p for p in flag.split("=", 1)[1].split(",") if p]
  return found


def measuring_options(platform: str) -> dict[str, object]:
  """Compiler options for the fit loop's compilations, of which only XLA's
  footprint and optimized program are read: :func:`compiler_options`, and
  LLVM's optimization off; on a GPU, ``ptxas`` at ``-O0`` too (it turns
  each kernel's PTX into machine code, which nothing here runs). Buffers
  are assigned before LLVM and ``ptxas`` run, so footprints are the same
  (measured equal on the zoo's gpt2, resnet18, mobilenetv2 and unet on
  XLA:CPU, and for a T4 target; ``tests/test_flags.py`` checks it), and
  compiling takes 1.3-2.3x less time on XLA:CPU. For a T4 target the
  saving is small: 0.94-0.98x the time on the zoo's steps at the GPU
  check's edge sizes, where XLA's HLO passes and IR emission take most of
  it (``benchmarks/compile_options.py`` measures each option's share). The
  step the user runs is compiled with :func:`compiler_options`.

  Example:
    >>> measuring_options("cpu")["xla_backend_optimization_level"]
    0
    >>> measuring_options("gpu")["xla_gpu_disable_gpuasm_optimizations"]
    True
  """
  options = {**compiler_options(platform), "xla_backend_optimization_level": 0}
  if platform == "gpu":
    options["xla_gpu_disable_gpuasm_optimizations"] = True
  return options


def _backend_started() -> bool:
  try:
    from jax._src import xla_bridge
  except ImportError:  # pragma: no cover - private module moved
    return False
  return bool(getattr(xla_bridge, "_backends", None))


def _accelerator_plugins() -> list[str]:
  """JAX plugins (CUDA, ROCm, TPU, ...) installed in this environment."""
  from importlib import metadata
  found = [entry.name for entry in metadata.entry_points(group="jax_plugins")]
  try:
    import jax_plugins  # the namespace package plugins install into
    found += [module.name for module in pkgutil.iter_modules(jax_plugins.__path__)]
  except ImportError:
    pass
  if importlib.util.find_spec("libtpu") is not None:
    found.append("libtpu")
  return found


def _accelerator_present() -> bool:
  """Whether this machine shows an accelerator's device files (NVIDIA's,
  WSL's ``/dev/dxg``, AMD's ``/dev/kfd``, a TPU's ``/dev/accel*`` or
  ``/dev/vfio``). A CUDA plugin installed on a machine without a GPU only
  compiles for GPU targets."""
  return any(glob.glob(pattern) for pattern in
             ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd", "/dev/accel*", "/dev/vfio/[0-9]*"))


def cpu_only() -> bool:
  """Whether this process can run JAX on nothing but the CPU:
  ``JAX_PLATFORMS`` names only ``cpu``, or no accelerator plugin is
  installed, or no accelerator is present (a plugin installed to compile
  for GPU targets, on a machine without one)."""
  platforms = os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME")
  if platforms:
    return {p.strip().lower() for p in platforms.split(",") if p.strip()} <= {"cpu"}
  return not _accelerator_plugins() or not _accelerator_present()


def flag_is_set() -> bool:
  """Whether ``XLA_FLAGS`` carries the flag that keeps remat on XLA:CPU."""
  return CPU_REMAT_FLAG in os.environ.get("XLA_FLAGS", "")


def enable_cpu_remat(*, warn: bool = True) -> bool:
  """Puts the flag that keeps rematerialization on XLA:CPU into ``XLA_FLAGS``,
  where the process runs on the CPU alone (see the module docstring).

  Call it before the first JAX computation (``import jaxmem`` does). It returns
  whether the flag is in force for this process. Steps that jaxmem compiles
  do not need it (they carry the option themselves); plain ``jax.jit`` of a
  ``jax.checkpoint`` step measured on CPU does.

  Example:
    >>> import jaxmem
    >>> jaxmem.enable_cpu_remat() == jaxmem._flags.cpu_only()
    True
  """
  if flag_is_set():
    return True
  if not cpu_only():
    if warn:
      warnings.warn(
          f"jaxmem: not setting {CPU_REMAT_FLAG!r}: this process can run on an "
          f"accelerator ({', '.join(_accelerator_plugins()) or 'JAX_PLATFORMS'}), "
          "whose XLA needs that pass to compile programs with optimization "
          "barriers. jaxmem's own steps carry the option on CPU anyway. To "
          "measure plain jax.checkpoint steps on CPU, run with JAX_PLATFORMS=cpu.",
          stacklevel=2)
    return False
  if _backend_started():
    if warn:
      warnings.warn(
          "jaxmem: JAX's backend started before the XLA flag "
          f"{CPU_REMAT_FLAG!r} was set, so on CPU plain jax.jit will merge "
          "recomputations back into the forward pass (jaxmem's own steps are "
          "not affected). Fix: `import jaxmem` before running any JAX "
          f"computation, or export XLA_FLAGS={CPU_REMAT_FLAG} before starting "
          "Python.", stacklevel=2)
    return False
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = (flags + " " + CPU_REMAT_FLAG).strip()
  return True
