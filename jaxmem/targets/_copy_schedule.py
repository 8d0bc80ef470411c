"""Whether a target's compiler runs host copies beside the kernels.

A copy between device and host memory runs on a copy engine of its own, so
it can overlap compute; whether it does is the compiler's choice. XLA:GPU's
default schedule puts each ``copy-done`` right after its ``copy-start``, and
the kernels wait for every copy where it is issued (measured with jax 0.10
for a T4: 12 of 12 copies of a ResNet-18 plan); with
``--xla_gpu_enable_latency_hiding_scheduler=true`` kernels run between them.
A plan that counts on overlap is then priced wrong: its copies are free in
the planner's model and whole stalls on the GPU.

So the fit asks the target's compiler, once per target and process: it
compiles a small probe (a value copied to the host and back, with matrix
products between) with the options and flags the step is compiled with,
and reads the schedule (:func:`copies_wait`). The planners then time plans
on the target's profile with ``copies_wait`` set as the compiler schedules
(:func:`timing_profile`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp

from jaxmem.cost import _hlo as hlo
from jaxmem.targets._compile import Target, resolve
from jaxmem.targets._profiles import DeviceProfile, get_profile

_log = logging.getLogger("jaxmem")

# Instructions between a copy's start and its end that run no kernel.
_NO_KERNEL = hlo.NO_BUFFER | {"copy-start"}


def waits_for_copies(text: str) -> bool | None:
  """Whether the compiled program ``text`` runs no kernel between any host
  copy's ``copy-start`` and its ``copy-done`` (None: it copies nothing
  between device and host).

  Example:
    >>> text = '''
    ... ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   %s = (f32[4]{0:S(5)}, f32[4]{0}, u32[]) copy-start(%p)
    ...   %d = f32[4]{0:S(5)} copy-done(%s)
    ...   ROOT %n = f32[4]{0} negate(%p)
    ... }'''
    >>> waits_for_copies(text)
    True
    >>> waits_for_copies(text.replace("  %d =", "  %m = f32[4]{0} negate(%p)\\n  %d ="))
    False
  """
  program = hlo.parse(text)
  copies = 0
  for instructions in program.computations.values():
    started: dict[str, bool] = {}  # copy-start -> whether a kernel ran since
    for inst in instructions:
      if inst.crosses_memory():
        started[inst.name] = False
      elif inst.opcode == "copy-done" and inst.operands()[0] in started:
        copies += 1
        if started.pop(inst.operands()[0]):
          return False
      elif inst.opcode not in _NO_KERNEL:
        started = dict.fromkeys(started, True)
  return True if copies else None


def _probe(x, w):
  """A value copied to the host and back, with three matrix products that
  a copy could run beside."""
  hosted = jax.device_put(jnp.tanh(x), jax.memory.Space.Host)
  y = x
  for _ in range(3):
    y = jnp.tanh(y @ w)
  hosted, y = jax.lax.optimization_barrier((hosted, y))
  return y + jax.device_put(hosted, jax.memory.Space.Device)


def probe_program(target: Target, **options) -> str:
  """The probe's program as ``target``'s compiler schedules it, with the
  step's compiler options and ``options``."""
  avals = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 2
  return jax.jit(_probe, compiler_options={**target.options(), **options}).lower(
      *target.place(avals)).compile().as_text()


@functools.lru_cache(maxsize=None)
def _copies_wait(target: Target, flags: str) -> bool | None:
  del flags  # a key: XLA_FLAGS reach the target's compiler
  try:
    text = probe_program(target)
  except Exception as err:  # a backend without host memory spaces
    _log.info("jaxmem: cannot learn how %s schedules host copies (%s: %s); plans "
              "are timed with copies beside the kernels", target.name,
              type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    return None
  return waits_for_copies(text)


def copies_wait(target: Target) -> bool | None:
  """Whether ``target``'s compiler waits for each host copy where it issues
  it (see the module docstring); None where it is not a GPU or the probe
  does not compile (copies are then timed as overlapping)."""
  if target.platform != "gpu":
    return None
  return _copies_wait(target, os.environ.get("XLA_FLAGS", ""))


def timing_profile(target: Target | DeviceProfile | str) -> DeviceProfile | None:
  """The profile plans for ``target`` are timed on: its own, with
  ``copies_wait`` as its compiler schedules copies. ``target`` is a fit's
  :class:`Target`, or a profile (or its name in ``PROFILES``), which is
  timed as XLA:GPU compiles for it where it has a description and JAX's
  CUDA plugin is installed (else as it is).

  Example:
    >>> timing_profile("orin-nano").copies_wait  # unified memory: no copies
    False
  """
  if not isinstance(target, Target):
    profile = get_profile(target)
    try:
      target = resolve(profile, ()) if profile.description is not None else None
    except RuntimeError:  # no compile-only GPU without JAX's CUDA plugin
      target = None
    if target is None:
      return profile
  profile = target.profile
  if profile is None or profile.unified:
    return profile
  waits = copies_wait(target)
  if waits is None or waits == profile.copies_wait:
    return profile
  return dataclasses.replace(profile, copies_wait=waits)
