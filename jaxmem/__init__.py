"""jaxmem: fit a JAX training step into a GPU memory budget.

Example:
  >>> import jaxmem
  >>> fitted = jaxmem.transform(lambda w: w, budget="60%")
"""

from jaxmem import _flags

# XLA:CPU merges recomputation back into the forward pass unless this pass is
# off (DESIGN.md fact 1); it must be in XLA_FLAGS before JAX's backend starts,
# so it is set on import. It is a no-op for GPU pipelines.
_flags.enable_cpu_remat(warn=False)

from jaxmem._budget import Budget, BudgetError, format_bytes  # noqa: E402
from jaxmem._calibrate import calibrate  # noqa: E402
from jaxmem._devices import PROFILES, DeviceProfile, get_profile  # noqa: E402
from jaxmem._flags import enable_cpu_remat  # noqa: E402
from jaxmem._graph import Graph, Residual  # noqa: E402
from jaxmem._memory import MemoryProfile  # noqa: E402
from jaxmem._lgm import LGM, reservation_floor  # noqa: E402
from jaxmem._plan import (KEEP, OFFLOAD, RECOMPUTE, SAVE, Chunked, Decision,  # noqa: E402
                          Keep, Offload, Plan, Recompute, Save)
from jaxmem._planners import PLANNERS, Hybrid, PlanResult, RecomputeGreedy  # noqa: E402
from jaxmem._transform import (Analysis, StepPlan, Transformed, analyze,  # noqa: E402
                               transform, xla_footprint)

__all__ = [
    "Analysis", "Budget", "BudgetError", "Chunked", "Decision", "DeviceProfile", "Graph",
    "Hybrid", "KEEP", "Keep", "LGM", "MemoryProfile", "OFFLOAD", "Offload", "PLANNERS",
    "PROFILES", "Plan", "PlanResult", "RECOMPUTE", "Recompute", "RecomputeGreedy", "Residual",
    "SAVE", "Save", "StepPlan", "Transformed", "analyze", "calibrate", "enable_cpu_remat",
    "format_bytes", "get_profile", "reservation_floor", "transform", "xla_footprint",
]
__version__ = "0.1.0"
