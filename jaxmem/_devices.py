"""Device profiles: what the performance model needs to know of a GPU.

A profile is data: compute throughput, device-memory bandwidth, the host
link's bandwidth each way with its per-transfer latency (small copies are
slow: a 64 KiB copy on PCIe spends longer in setup than on the wire), the
device memory size, and whether that memory is unified with the host's (a
Jetson board: moving a tensor to "host" frees nothing, so offload is never
chosen there).

Presets (:data:`PROFILES`) carry the source of every figure. Link figures
are typical *measured* pinned-memory rates (CUDA's ``bandwidthTest``), not
the PCIe line rate, because that is what a plan can expect.
:func:`jaxmem.calibrate` measures the current device instead.

Example:
  >>> from jaxmem._devices import get_profile
  >>> t4 = get_profile("t4")
  >>> round(t4.transfer_seconds(64 * 2**20, "d2h") * 1e3, 2)  # 64 MiB down
  5.6
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
  """One device as the performance model sees it.

  Attributes:
    name: a short name (``"t4"``).
    flops: dense fp32 throughput, FLOP/s.
    memory_bandwidth: device-memory bandwidth, bytes/s.
    h2d_bandwidth: host -> device copy bandwidth, bytes/s (pinned memory).
    d2h_bandwidth: device -> host copy bandwidth, bytes/s (pinned memory).
    link_latency: fixed cost of one copy, seconds.
    memory: device memory, bytes.
    unified: device and host share one memory (offload frees nothing).
    source: where the figures come from.
  """
  name: str
  flops: float
  memory_bandwidth: float
  h2d_bandwidth: float
  d2h_bandwidth: float
  link_latency: float
  memory: int
  unified: bool = False
  source: str = ""

  def __post_init__(self):
    for field in ("flops", "memory_bandwidth", "h2d_bandwidth", "d2h_bandwidth"):
      if not getattr(self, field) > 0:
        raise ValueError(f"DeviceProfile {self.name!r}: {field} must be > 0, got "
                         f"{getattr(self, field)!r}")
    if self.link_latency < 0 or self.memory <= 0:
      raise ValueError(f"DeviceProfile {self.name!r}: expected link_latency >= 0 and "
                       f"memory > 0, got {self.link_latency!r} and {self.memory!r}")

  def transfer_seconds(self, nbytes: int, direction: str) -> float:
    """Time of one copy of ``nbytes`` (``direction`` ``"d2h"`` or ``"h2d"``)."""
    if direction not in ("d2h", "h2d"):
      raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
    bandwidth = self.d2h_bandwidth if direction == "d2h" else self.h2d_bandwidth
    return self.link_latency + nbytes / bandwidth

  def efficiency(self, nbytes: int, direction: str = "d2h") -> float:
    """Share of the link's bandwidth a copy of ``nbytes`` achieves (falls off
    for small copies, where the latency dominates)."""
    wire = nbytes / (self.d2h_bandwidth if direction == "d2h" else self.h2d_bandwidth)
    return wire / self.transfer_seconds(nbytes, direction) if nbytes else 0.0

  def op_seconds(self, flops: float, nbytes: int) -> float:
    """Roofline time of one operation: bounded by compute or by memory."""
    return max(flops / self.flops, nbytes / self.memory_bandwidth)


_GB = 1e9
_GIB = 2**30

PROFILES: dict[str, DeviceProfile] = {
    "t4": DeviceProfile(
        "t4", flops=8.1e12, memory_bandwidth=320 * _GB, h2d_bandwidth=12 * _GB,
        d2h_bandwidth=12 * _GB, link_latency=10e-6, memory=16 * _GIB,
        source="NVIDIA T4 datasheet (8.1 TFLOPS fp32, 320 GB/s GDDR6, 16 GB, "
               "PCIe Gen3 x16); link: typical pinned bandwidthTest on PCIe Gen3 x16 "
               "(~12 GB/s of the 15.75 GB/s line rate), ~10 us per copy"),
    "rtx3060": DeviceProfile(
        "rtx3060", flops=12.7e12, memory_bandwidth=360 * _GB, h2d_bandwidth=24 * _GB,
        d2h_bandwidth=24 * _GB, link_latency=10e-6, memory=12 * _GIB,
        source="NVIDIA GeForce RTX 3060 specifications (3584 CUDA cores at 1.78 GHz "
               "boost = 12.7 TFLOPS fp32; 12 GB GDDR6, 192-bit at 15 Gbps = 360 GB/s; "
               "PCIe Gen4 x16); link: typical pinned bandwidthTest on PCIe Gen4 x16 "
               "(~24 GB/s of 31.5 GB/s), ~10 us per copy"),
    "orin-nano": DeviceProfile(
        "orin-nano", flops=1.28e12, memory_bandwidth=68 * _GB, h2d_bandwidth=68 * _GB,
        d2h_bandwidth=68 * _GB, link_latency=5e-6, memory=8 * _GIB, unified=True,
        source="NVIDIA Jetson Orin Nano 8GB module datasheet (1024-core Ampere GPU "
               "at 625 MHz = 1.28 TFLOPS fp32; 8 GB LPDDR5 128-bit, 68 GB/s, shared "
               "by CPU and GPU: unified)"),
    "h100": DeviceProfile(
        "h100", flops=67e12, memory_bandwidth=3350 * _GB, h2d_bandwidth=50 * _GB,
        d2h_bandwidth=50 * _GB, link_latency=10e-6, memory=80 * _GIB,
        source="NVIDIA H100 SXM5 datasheet (67 TFLOPS fp32, 3.35 TB/s HBM3, 80 GB, "
               "PCIe Gen5 x16); link: typical pinned bandwidthTest on Gen5 (~50 GB/s)"),
}


def get_profile(profile) -> DeviceProfile:
  """A profile from a preset name in :data:`PROFILES` or a profile itself."""
  if isinstance(profile, DeviceProfile):
    return profile
  if isinstance(profile, str) and profile in PROFILES:
    return PROFILES[profile]
  raise ValueError(
      f"jaxmem: unknown device profile {profile!r}; expected one of "
      f"{sorted(PROFILES)}, a DeviceProfile, or jaxmem.calibrate() for this device.")
