"""Device profiles: a GPU as jaxmem plans for it.

A profile is data: compute throughput, device-memory bandwidth, the host
link's bandwidth each way with its per-transfer latency (small copies are
slow: a 64 KiB copy on PCIe spends longer in setup than on the wire), the
device memory size, and whether that memory is unified with the host's (a
Jetson board: moving a tensor to "host" frees nothing, so offload is never
chosen there).

A profile also carries XLA's description of the GPU
(:class:`~jaxmem.targets.GpuDescription`), from which jaxmem makes a
compile-only device, so a step is planned and judged by XLA:GPU's own
compilation for that GPU on any machine (``transform(..., target="t4")``).

Presets (:data:`PROFILES`) carry the source of every figure. Link figures
are typical *measured* pinned-memory rates (CUDA's ``bandwidthTest``), not
the PCIe line rate, because that is what a plan can expect.
:func:`jaxmem.calibrate` measures the current device instead.

Example:
  >>> from jaxmem.targets import get_profile
  >>> t4 = get_profile("t4")
  >>> round(t4.transfer_seconds(64 * 2**20, "d2h") * 1e3, 2)  # 64 MiB down
  5.6
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from jaxmem.targets._description import GpuDescription


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
    description: XLA's description of the GPU, for compiling on a
      compile-only device (None: the profile can time plans but not be a
      compilation target).
    matmul_flops: the throughput of the step's matrix products and
      convolutions at their default precision, FLOP/s: fp32 operands run as
      TF32 on tensor cores from Ampere's data-center parts on (None: ``flops``).
    kernel_latency: the least time one kernel of a compiled program takes,
      launch and tail included, seconds (what the clock charges a kernel
      beyond its roofline time).
    interconnect_bandwidth: bytes/s one GPU sends to the others in one
      direction (NVLink, or PCIe where the GPUs have none): what a
      collective of a sharded step, an FSDP weight gathered again among
      them, takes (None: one GPU; collectives are priced at memory
      bandwidth).
    copies_wait: the step's compiler waits for each host copy right where
      it issues it (XLA:GPU's default schedule, which puts every
      ``copy-done`` right after its ``copy-start``), so a copy adds its
      time to the step instead of running beside the kernels. A fit learns
      it from the target's compiler (``targets.timing_profile``); False in
      the presets: what the hardware allows.
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
  description: GpuDescription | None = dataclasses.field(default=None, repr=False)
  matmul_flops: float | None = None
  kernel_latency: float = 2e-6
  interconnect_bandwidth: float | None = None
  copies_wait: bool = False

  @property
  def matmul_throughput(self) -> float:
    return self.matmul_flops or self.flops

  def __post_init__(self):
    for field in ("flops", "memory_bandwidth", "h2d_bandwidth", "d2h_bandwidth"):
      if not getattr(self, field) > 0:
        raise ValueError(f"DeviceProfile {self.name!r}: {field} must be > 0, got "
                         f"{getattr(self, field)!r}")
    if self.link_latency < 0 or self.memory <= 0:
      raise ValueError(f"DeviceProfile {self.name!r}: expected link_latency >= 0 and "
                       f"memory > 0, got {self.link_latency!r} and {self.memory!r}")

  def to_dict(self) -> dict:
    """The profile as JSON-ready data (its description's fields included),
    for :meth:`from_dict` on another machine: a profile calibrated on a GPU
    plans for that GPU wherever it is loaded."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: dict) -> DeviceProfile:
    """The profile :meth:`to_dict` wrote (lists read back as tuples)."""
    data = dict(data)
    described = data.pop("description", None)
    if described is not None and not isinstance(described, GpuDescription):
      described = GpuDescription(**{k: tuple(v) if isinstance(v, list) else v
                                     for k, v in described.items()})
    return cls(**data, description=described)

  def transfer_seconds(self, nbytes: int, direction: str) -> float:
    """Time of one copy of ``nbytes`` (``direction`` ``"d2h"`` or ``"h2d"``)."""
    if direction not in ("d2h", "h2d"):
      raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
    bandwidth = self.d2h_bandwidth if direction == "d2h" else self.h2d_bandwidth
    return self.link_latency + nbytes / bandwidth

  def collective_seconds(self, nbytes: int) -> float:
    """Time of a collective that moves ``nbytes`` between the GPUs (its
    result's bytes): over the interconnect where the profile gives one,
    else at memory bandwidth."""
    return nbytes / (self.interconnect_bandwidth or self.memory_bandwidth)

  def efficiency(self, nbytes: int, direction: str = "d2h") -> float:
    """Share of the link's bandwidth a copy of ``nbytes`` achieves (falls off
    for small copies, where the latency dominates)."""
    wire = nbytes / (self.d2h_bandwidth if direction == "d2h" else self.h2d_bandwidth)
    return wire / self.transfer_seconds(nbytes, direction) if nbytes else 0.0


_GB = 1e9
_GIB = 2**30
_MIB = 2**20
_KIB = 2**10


def _profile(name: str, description: GpuDescription, *, link: float, latency: float = 10e-6,
             unified: bool = False, matmul: float | None = None,
             interconnect: float | None = None, source: str) -> DeviceProfile:
  """A preset whose compute, memory and size figures are its description's."""
  return DeviceProfile(
      name, flops=description.fp32_flops, memory_bandwidth=description.memory_bandwidth,
      h2d_bandwidth=link, d2h_bandwidth=link, link_latency=latency,
      memory=description.device_memory_size, unified=unified, source=source,
      description=description, matmul_flops=matmul, interconnect_bandwidth=interconnect)


# Per compute capability, from the CUDA C++ Programming Guide's technical
# specifications: shared memory per SM, shared memory one block may opt
# into, resident threads per SM.
_SM_LIMITS = {
    (7, 5): (64 * _KIB, 64 * _KIB, 1024),
    (8, 0): (164 * _KIB, 163 * _KIB, 2048),
    (8, 6): (100 * _KIB, 99 * _KIB, 1536),
    (8, 7): (164 * _KIB, 163 * _KIB, 1536),
    (9, 0): (228 * _KIB, 227 * _KIB, 2048),
}


def _gpu(name: str, compute_capability: tuple[int, int], **figures) -> GpuDescription:
  """A datasheet GPU's description, its SM limits those of its compute
  capability."""
  shared, optin, threads = _SM_LIMITS[compute_capability]
  return GpuDescription(name, compute_capability, shared_memory_per_core=shared,
                        shared_memory_per_block_optin=optin, threads_per_core_limit=threads,
                        **figures)


_HOPPER = dict(compute_capability=(9, 0), core_count=132, fpus_per_core=128,
               clock_rate_ghz=1.98, l2_cache_size=50 * _MIB)

PROFILES: dict[str, DeviceProfile] = {
    "t4": _profile(
        "t4", _gpu(
            "Tesla T4", (7, 5), core_count=40, fpus_per_core=64, clock_rate_ghz=1.59,
            device_memory_size=15360 * _MIB, memory_bandwidth=320 * _GB,
            l2_cache_size=4 * _MIB),
        link=12 * _GB, interconnect=12 * _GB,
        source="NVIDIA T4 datasheet (40 Turing SMs x 64 FP32 units at 1.59 GHz boost = "
               "8.1 TFLOPS fp32, 16 GB GDDR6 (15,360 MiB as the driver reports it), "
               "320 GB/s, 4 MB L2, PCIe Gen3 x16); SM limits: CUDA programming guide, "
               "compute capability 7.5; link: typical pinned bandwidthTest on PCIe Gen3 "
               "x16 (~12 GB/s of the 15.75 GB/s line rate), ~10 us per copy; between T4s (no "
               "NVLink) the same PCIe"),
    "rtx3060": _profile(
        "rtx3060", _gpu(
            "NVIDIA GeForce RTX 3060", (8, 6), core_count=28, fpus_per_core=128,
            clock_rate_ghz=1.777, device_memory_size=12288 * _MIB,
            memory_bandwidth=360 * _GB, l2_cache_size=3 * _MIB),
        link=24 * _GB, interconnect=24 * _GB,
        source="NVIDIA GeForce RTX 3060 specifications (28 Ampere SMs x 128 FP32 units "
               "at 1.777 GHz boost = 12.7 TFLOPS fp32; 12 GB GDDR6, 192-bit at 15 Gbps = "
               "360 GB/s; 3 MB L2; PCIe Gen4 x16); SM limits: CUDA programming guide, "
               "compute capability 8.6; link: typical pinned bandwidthTest on PCIe Gen4 "
               "x16 (~24 GB/s of 31.5 GB/s), ~10 us per copy; between GPUs (no NVLink) "
               "the same PCIe"),
    "orin-nano": _profile(
        "orin-nano", _gpu(
            "Orin", (8, 7), core_count=8, fpus_per_core=128, clock_rate_ghz=0.625,
            device_memory_size=8 * _GIB, memory_bandwidth=68 * _GB,
            l2_cache_size=2 * _MIB),
        link=68 * _GB, latency=5e-6, unified=True,
        source="NVIDIA Jetson Orin Nano 8GB module datasheet (1024-core Ampere GPU, "
               "8 SMs, at 625 MHz = 1.28 TFLOPS fp32; 8 GB LPDDR5 128-bit, 68 GB/s, "
               "shared by CPU and GPU: unified); SM limits: CUDA programming guide, "
               "compute capability 8.7; L2 2 MB (Orin SoC technical reference)"),
    "a100": _profile(
        "a100", _gpu(
            "NVIDIA A100-SXM4-80GB", (8, 0), core_count=108, fpus_per_core=64,
            clock_rate_ghz=1.41, device_memory_size=81920 * _MIB,
            memory_bandwidth=2039 * _GB, l2_cache_size=40 * _MIB),
        link=24 * _GB, matmul=156e12, interconnect=300 * _GB,
        source="NVIDIA A100 datasheet and Ampere whitepaper (SXM4 80GB: 108 SMs x 64 "
               "FP32 units at 1.41 GHz boost = 19.5 TFLOPS fp32, TF32 tensor cores "
               "156 TFLOPS dense, 80 GB HBM2e at 2,039 "
               "GB/s, 40 MB L2, PCIe Gen4 x16); SM limits: CUDA programming guide, "
               "compute capability 8.0; link: typical pinned bandwidthTest on Gen4 "
               "(~24 GB/s); NVLink 3: 600 GB/s both ways, 300 GB/s each way"),
    "h100": _profile(
        "h100", _gpu(
            "NVIDIA H100 80GB HBM3", device_memory_size=81559 * _MIB,
            memory_bandwidth=3350 * _GB, **_HOPPER),
        link=50 * _GB, matmul=494.7e12, interconnect=450 * _GB,
        source="NVIDIA H100 datasheet and Hopper whitepaper (SXM5: 132 SMs x 128 FP32 "
               "units at 1.98 GHz boost = 67 TFLOPS fp32, TF32 tensor cores 989 TFLOPS "
               "with sparsity = 494.7 dense, 80 GB HBM3 (81,559 MiB as the "
               "driver reports it) at 3.35 TB/s, 50 MB L2, PCIe Gen5 x16); SM limits: "
               "CUDA programming guide, compute capability 9.0; link: typical pinned "
               "bandwidthTest on Gen5 (~50 GB/s); NVLink 4: 900 GB/s both ways, 450 GB/s "
               "each way"),
    "h200": _profile(
        "h200", _gpu(
            "NVIDIA H200", device_memory_size=143771 * _MIB,
            memory_bandwidth=4800 * _GB, **_HOPPER),
        link=50 * _GB, matmul=494.7e12, interconnect=450 * _GB,
        source="NVIDIA H200 datasheet (SXM: the H100's 132 Hopper SMs = 67 TFLOPS fp32, "
               "TF32 tensor cores 494.7 TFLOPS dense; "
               "141 GB HBM3e (143,771 MiB as the driver reported it on the H200 the GPU "
               "check ran on) at 4.8 TB/s, 50 MB L2, PCIe Gen5 x16); link: typical "
               "pinned bandwidthTest on Gen5 (~50 GB/s); NVLink 4: 900 GB/s both ways, "
               "450 GB/s each way"),
}


def get_profile(profile) -> DeviceProfile:
  """A profile from a preset name in :data:`PROFILES`, a JSON file that
  :meth:`DeviceProfile.to_dict` wrote, or a profile itself."""
  if isinstance(profile, DeviceProfile):
    return profile
  if isinstance(profile, str) and profile in PROFILES:
    return PROFILES[profile]
  if isinstance(profile, (str, os.PathLike)) and str(profile).endswith(".json"):
    # Planners read their target's profile for every plan they price: the
    # file is read once per version of it.
    path = os.path.abspath(profile)
    return _saved_profile(path, os.stat(path).st_mtime_ns)
  raise ValueError(
      f"jaxmem: unknown device profile {profile!r}; expected one of "
      f"{sorted(PROFILES)}, a DeviceProfile, a profile saved as JSON "
      "(json.dump(profile.to_dict(), f)), or jaxmem.calibrate() for this device.")


@functools.lru_cache(maxsize=16)
def _saved_profile(path: str, stamp: int) -> DeviceProfile:
  """The profile saved as JSON at ``path`` (``stamp``: its modification
  time, so a rewritten file is read again)."""
  with open(path) as f:
    return DeviceProfile.from_dict(json.load(f))


@functools.lru_cache(maxsize=None)
def profile_for_kind(device_kind: str) -> DeviceProfile | None:
  """The preset whose GPU is ``device_kind`` (``jax.Device.device_kind``):
  the same name, else the one preset whose short name it contains
  (``"NVIDIA H100 PCIe"`` -> ``h100``); None where none or several match."""
  kind = device_kind.lower()
  exact = [p for p in PROFILES.values()
           if p.description is not None and p.description.name.lower() == kind]
  if exact:
    return exact[0]
  squeezed = kind.replace(" ", "").replace("-", "")
  partial = [p for p in PROFILES.values() if p.name.replace("-", "") in squeezed]
  return partial[0] if len(partial) == 1 else None
