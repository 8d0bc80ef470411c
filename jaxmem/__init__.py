"""jaxmem: fit a JAX training step into a GPU memory budget.

The public face, in one screen:

* :func:`transform` (a step fitted to a budget, shaped like ``jax.jit``),
  its :class:`Transformed` and the :class:`Fit` it decides per signature;
  :func:`analyze` (residuals of a step, no planning);
* :class:`Budget`, :class:`BudgetError`;
* the decisions a plan makes per residual: :class:`Plan` of
  :class:`Keep`, :class:`Recompute`, :class:`Offload`, :class:`Chunked`
  (vTensors) and :class:`Save` (block boundaries);
* the planners: :class:`Planner` (the contract), :class:`Greedy`,
  :class:`Hybrid`, :class:`LGM`, :class:`ILP` (exact), the factory
  :func:`hybrid` and the registry :data:`PLANNERS` (``auto``,
  ``recompute``, ``hybrid``, ``offload``, ``lgm``, ``ilp``, ``names`` and
  the ablations ``lgm-whole``, ``lgm-unreserved``);
* targets, the GPUs plans are made and compiled for
  (:mod:`jaxmem.targets`): :class:`DeviceProfile` with its
  :class:`GpuDescription`, :data:`PROFILES`, :func:`calibrate`;
* :func:`progress`, what a long transform does, shown as it goes;
* :func:`enable_cpu_remat`, the XLA:CPU flag set on import.

Internals stay importable from their modules (``jaxmem.graph._graph``, ...).

Example:
  >>> import jaxmem
  >>> fitted = jaxmem.transform(lambda w: w, budget="60%")
"""

from jaxmem import _flags

# XLA:CPU merges recomputation back into the forward pass unless a pass is off
# (see _flags.py). jaxmem's own steps carry that option per compilation; for
# plain jax.jit of remat steps on CPU it goes into XLA_FLAGS before JAX's
# backend starts, but only in a CPU-only process: XLA:GPU needs the pass.
_flags.enable_cpu_remat(warn=False)

from jaxmem._budget import Budget, BudgetError  # noqa: E402
from jaxmem._decisions import Chunked, Decision, Keep, Offload, Plan, Recompute, Save  # noqa: E402
from jaxmem._flags import enable_cpu_remat  # noqa: E402
from jaxmem._analyze import Analysis, analyze  # noqa: E402
from jaxmem._transform import Fit, Transformed, transform  # noqa: E402
from jaxmem._progress import progress  # noqa: E402
from jaxmem.planners import ILP, LGM, PLANNERS, Greedy, Hybrid, Planner, hybrid  # noqa: E402
from jaxmem.targets import PROFILES, DeviceProfile, GpuDescription, calibrate  # noqa: E402

__all__ = [
    "Analysis", "Budget", "BudgetError", "Chunked", "Decision", "DeviceProfile", "Fit",
    "GpuDescription", "Greedy", "Hybrid", "ILP", "Keep", "LGM", "Offload", "PLANNERS",
    "PROFILES", "Plan",
    "Planner", "Recompute", "Save", "Transformed", "analyze", "calibrate",
    "enable_cpu_remat", "hybrid", "progress", "transform",
]
__version__ = "0.1.0"

# The error and the objects a user holds name their public home in
# tracebacks and reprs (``jaxmem.BudgetError``), not the private module
# that defines them.
for _public in (BudgetError, Transformed, Fit, Analysis):
  _public.__module__ = __name__
del _public
