"""XLA flags that memory measurements on CPU depend on.

XLA:CPU runs the ``cse_barrier_expander`` pass, which removes optimization
barriers; common-subexpression elimination then merges every recomputation
back into the forward pass, so a rematerialized step is *larger* on CPU than
the plain one (DESIGN.md fact 1: 65 MiB plain, 96 MiB with per-layer
``jax.checkpoint``, 34 MiB with the pass disabled). jaxmem's recomputation is
tied in place with optimization barriers, so on CPU the pass must be off for
the rewritten step to keep its savings. GPU pipelines keep barriers anyway, so
the flag is harmless there.

XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend; the flag has
to be in the environment before that.
"""

from __future__ import annotations

import os
import warnings

CPU_REMAT_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"


def _backend_started() -> bool:
  try:
    from jax._src import xla_bridge
  except ImportError:  # pragma: no cover - private module moved
    return False
  return bool(getattr(xla_bridge, "_backends", None))


def flag_is_set() -> bool:
  """Whether ``XLA_FLAGS`` carries the flag that keeps remat on XLA:CPU."""
  return CPU_REMAT_FLAG in os.environ.get("XLA_FLAGS", "")


def enable_cpu_remat(*, warn: bool = True) -> bool:
  """Puts the flag that keeps rematerialization on XLA:CPU into ``XLA_FLAGS``.

  Call it before the first JAX computation (``import jaxmem`` does). It returns
  whether the flag is in force for this process.

  Example:
    >>> import jaxmem
    >>> jaxmem.enable_cpu_remat()
    True
  """
  if flag_is_set():
    return True
  if _backend_started():
    if warn:
      warnings.warn(
          "jaxmem: JAX's backend started before the XLA flag "
          f"{CPU_REMAT_FLAG!r} was set, so on CPU the compiler will merge "
          "recomputations back into the forward pass and memory figures will "
          "not show jaxmem's savings. Fix: `import jaxmem` before running any "
          "JAX computation, or export XLA_FLAGS="
          f"{CPU_REMAT_FLAG} before starting Python.",
          stacklevel=2)
    return False
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = (flags + " " + CPU_REMAT_FLAG).strip()
  return True
