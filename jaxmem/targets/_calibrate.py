"""``jaxmem.calibrate()``: a :class:`DeviceProfile` measured on this device.

It times a square matmul (compute throughput), a large elementwise op
(memory bandwidth: one read and one write per element) and copies to and
from ``pinned_host`` memory across transfer sizes; a least-squares line
through (bytes, seconds) gives each direction's bandwidth (the slope). Two
programs, one a chain of ``SHORT`` tiny matrix products and one of
``LONG``, give the time one more kernel of a compiled program takes (the
clock's ``kernel_latency``: launch and the runtime's own work per kernel,
which dominate a step of many small kernels); the same chains with a round
trip through host memory in each link give the per-copy latency of a
program's copies (``link_latency``; on CPU, where both memories are one,
the fitted line's intercept).
On a GPU it also records XLA's description of the device (the
``GpuTargetConfig`` of its topology), so the profile can be a compilation
target elsewhere: ``transform(..., target=profile)`` on a machine without
that GPU compiles for it.
"""

from __future__ import annotations

import logging
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.targets._description import GpuDescription, parse
from jaxmem.targets._profiles import DeviceProfile

_log = logging.getLogger("jaxmem")

# Boards whose GPU shares the host's DRAM (offload frees nothing there).
UNIFIED_KINDS = ("orin", "xavier", "tegra", "jetson")
# Runs of the matmul and the elementwise op queued per timed sample.
QUEUED = 8
# Kernels in the two chains that time one kernel. Both chains keep the
# device busier than the host's dispatch of a call (tens of microseconds),
# so neither times dispatch: a chain of 8 tiny kernels did, and the slope
# read 0.8-3.1 us on one H100 from run to run.
SHORT, LONG = 64, 320


def median_seconds(fn, args, repeats: int, calls: int = 1) -> float:
  """Median wall time of one ``fn(*args)`` over ``repeats`` samples after a
  warm-up (which compiles it). Each sample dispatches ``calls`` runs back
  to back and waits for them all, so an accelerator's queue hides the
  per-call dispatch that would otherwise be timed with a sub-millisecond
  kernel (and would swing with the host's load)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(max(repeats, 1)):
    start = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(max(calls, 1))])
    times.append((time.perf_counter() - start) / max(calls, 1))
  return statistics.median(times)


def _chain_slope(device, link, repeats: int, queued: int) -> float:
  """Seconds one more link of a compiled chain takes: the slope between a
  chain of ``SHORT`` and of ``LONG`` links, each ``link(x)`` then a 16x16
  matrix product (its own kernel; the programs' fixed costs cancel)."""
  w = jax.device_put(jnp.full((16, 16), 1 / 16, jnp.float32), device)
  short, long = (median_seconds(chain(link, n), (w, w), repeats, queued)
                 for n in (SHORT, LONG))
  return max((long - short) / (LONG - SHORT), 0.0)


def chain(link, length: int, **jit_options):
  """A jitted chain of ``length`` links: ``x = link(x) @ w`` each."""
  def run(x, w):
    for _ in range(length):
      x = link(x) @ w
    return x
  return jax.jit(run, **jit_options)


def round_trip(x):
  """``x`` copied to host memory and back (the barrier keeps XLA from
  folding the pair away)."""
  hosted = jax.lax.optimization_barrier(jax.device_put(x, jax.memory.Space.Host))
  return jax.device_put(hosted, jax.memory.Space.Device)


def _copy_latency(device, kernel: float, repeats: int, queued: int) -> float | None:
  """Seconds one copy between device and host memory takes inside a
  compiled program beyond its bytes (1 KiB here): chains whose links are
  round trips through host memory, less ``kernel`` (the same chains
  without them), over two copies a link. None where the chains time no
  copy (a backend without host memory spaces, or a reading at or under
  ``kernel``). A copy timed from Python (``jax.device_put``) pays
  dispatch and a wait for the host as well, which a planned copy does
  not: on an H100 its fitted intercept read 135 us, and priced at it a
  host plan's step came to 1.55 times its measured time."""
  try:
    slope = _chain_slope(device, round_trip, repeats, queued)
  except Exception as err:  # noqa: BLE001 - no host memory space: the caller falls back
    _log.warning("jaxmem.calibrate: cannot time copies inside a program (%s: %s)",
                 type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    return None
  return (slope - kernel) / 2 if slope > kernel else None


def _link(device, sizes, repeats) -> tuple[float, float, float]:
  """(d2h bandwidth, h2d bandwidth, latency) from copies of ``sizes`` bytes."""
  host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  back = jax.sharding.SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
  d2h, h2d = [], []
  for nbytes in sizes:
    x = jax.device_put(jnp.zeros(nbytes // 4, jnp.float32), back)
    on_host = jax.device_put(x, host)
    d2h.append(median_seconds(lambda a: jax.device_put(a, host), (x,), repeats))
    h2d.append(median_seconds(lambda a: jax.device_put(a, back), (on_host,), repeats))
  fits = [np.polyfit(np.asarray(sizes, float), np.asarray(t), 1) for t in (d2h, h2d)]
  (slope_d, lat_d), (slope_h, lat_h) = fits
  bandwidth = lambda slope: 1.0 / max(float(slope), 1e-15)
  return bandwidth(slope_d), bandwidth(slope_h), max(float(lat_d), float(lat_h), 0.0)


def calibrate(device=None, *, matmul: int | None = None,
              sizes: tuple = (2**16, 2**20, 2**22, 2**24),
              repeats: int = 5, unified: bool | None = None) -> DeviceProfile:
  """Measures ``device`` (default: the first device) into a profile.

  Args:
    device: a ``jax.Device``.
    matmul: side of the square fp32 matmul timed (default 4096 on a GPU or
      TPU, 1024 on CPU).
    sizes: copy sizes in bytes for the host-link fit.
    repeats: timed runs per measurement (median taken).
    unified: whether device memory is the host's; by default True on CPU and
      on Jetson-class boards (``UNIFIED_KINDS`` in the device kind).

  Returns:
    A :class:`DeviceProfile` named after the device kind.

  Example:
    >>> import jaxmem
    >>> profile = jaxmem.calibrate(matmul=256, sizes=(2**12, 2**16), repeats=2)
    >>> profile.flops > 0 and profile.h2d_bandwidth > 0
    True
    >>> 0 < profile.kernel_latency < 1e-3  # one more kernel of a program, measured
    True
  """
  device = device or jax.devices()[0]
  cpu = device.platform == "cpu"
  n = matmul or (1024 if cpu else 4096)
  queued = 1 if cpu else QUEUED
  a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
  flops = 2.0 * n**3 / median_seconds(jax.jit(jnp.matmul), (a, a), repeats, queued)
  # On an accelerator a 16 MiB op is over before the launch overhead is paid;
  # 256 MiB reads the memory's bandwidth, not the dispatch's.
  elementwise = max(sizes) if cpu else max(max(sizes), 2**28)
  big = jax.device_put(jnp.ones(elementwise // 4, jnp.float32), device)
  bandwidth = 2.0 * big.nbytes / median_seconds(jax.jit(lambda x: x * 2.0), (big,), repeats,
                                                  queued)
  d2h, h2d, latency = _link(device, sizes, repeats)
  kernel = _chain_slope(device, lambda x: x, max(repeats, 10), QUEUED)
  if not cpu:  # the host copies of a program (on CPU both memories are one)
    in_program = _copy_latency(device, kernel, max(repeats, 10), QUEUED)
    if in_program is None:
      _log.warning("jaxmem.calibrate: no copy latency inside a program measured; "
                   "link_latency is that of copies timed from Python (%.0f us)", latency * 1e6)
    latency = latency if in_program is None else in_program
  stats = device.memory_stats() or {}
  memory = int(stats.get("bytes_limit") or _host_memory())
  kind = device.device_kind
  if unified is None:
    unified = cpu or any(k in kind.lower() for k in UNIFIED_KINDS)
  return DeviceProfile(
      kind.lower().replace(" ", "-"), flops=flops, memory_bandwidth=bandwidth,
      h2d_bandwidth=h2d, d2h_bandwidth=d2h, link_latency=latency, memory=memory,
      unified=unified, description=None if cpu else described(device), kernel_latency=kernel,
      source=f"jaxmem.calibrate() on {kind} ({device.platform}), "
             f"{time.strftime('%Y-%m-%d')}: {n}x{n} fp32 matmul, "
             f"{elementwise}-byte elementwise op, copies of {list(sizes)} bytes, "
             f"chains of {SHORT} and {LONG} 16x16 matmuls"
             + ("" if cpu else ", with and without host round trips"))


def described(device) -> GpuDescription | None:
  """XLA's description of a GPU present (:func:`target_config`, parsed);
  None where the backend has none (CPU, TPU, or a JAX that moved it)."""
  try:
    config = target_config(device)
    return parse(config.decode() if isinstance(config, bytes) else str(config))
  except Exception:  # private API; several error types across releases
    return None


def target_config(device):
  """XLA's ``GpuTargetConfig`` of ``device`` as its topology gives it (a
  text proto; raises where the backend has none)."""
  from jax._src.lib import xla_client
  return xla_client.get_topology_for_devices([device]).target_config


def _host_memory() -> int:
  import os
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return 2**34
