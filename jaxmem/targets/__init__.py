"""Targets: the GPU a step is planned for, as data, and where it compiles.

* :class:`DeviceProfile` and the presets :data:`PROFILES` (``t4``,
  ``rtx3060``, ``orin-nano``, ``a100``, ``h100``, ``h200``): the figures
  plans are timed on and, in :class:`GpuDescription`, XLA's description of
  the GPU, each with its source;
* :func:`calibrate`: a profile measured on the device present (with its real
  description on a GPU);
* :class:`Target` and :func:`resolve`: the device a fit compiles for (a
  compile-only GPU made from a description, or the device present) and how
  its footprint is read (:func:`xla_footprint`, :func:`host_bytes`);
* :func:`timing_profile`: the profile plans are timed on, with how the
  target's compiler schedules host copies (:func:`copies_wait`).

Example:
  >>> from jaxmem.targets import PROFILES
  >>> PROFILES["t4"].description.compute_capability
  (7, 5)
"""

from jaxmem.targets._calibrate import calibrate
from jaxmem.targets._copy_schedule import copies_wait, timing_profile
from jaxmem.targets._compile import (
    GPU_RUNTIME_RESERVE, Target, holds_host_memory, host_bytes, placed,
    platform_of, resolve, runtime_reserve, workspace_bytes, xla_footprint)
from jaxmem.targets._description import GpuDescription, parse
from jaxmem.targets._profiles import PROFILES, DeviceProfile, get_profile, profile_for_kind

__all__ = [
    "DeviceProfile", "GPU_RUNTIME_RESERVE", "GpuDescription", "PROFILES",
    "Target", "calibrate", "copies_wait", "get_profile", "holds_host_memory", "host_bytes",
    "parse", "placed", "platform_of", "profile_for_kind", "resolve",
    "runtime_reserve", "timing_profile", "workspace_bytes", "xla_footprint",
]
