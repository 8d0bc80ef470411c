"""XLA's description of a GPU: what XLA:GPU compiles a program for.

XLA:GPU sizes its fusions, tiles and buffers by the GPU it compiles for: its
streaming multiprocessors (``core_count``), the FP32 units of each, shared
memory and registers per SM and per block, L2, clock, memory size and
bandwidth, and the compute capability (which kernels and layouts exist). It
reads those fields from a ``GpuTargetConfig`` text proto, which is what
``jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=...)`` takes to make a compile-only device: a program can then
be compiled for that GPU on a machine without one, and its
``memory_analysis()`` is XLA:GPU's, host memory included.

:class:`GpuDescription` holds those fields as data; :meth:`GpuDescription.text`
writes the proto and :func:`parse` reads one back (``jaxmem.calibrate()`` on a
GPU records the real description that way).

Example:
  >>> d = GpuDescription("Tesla T4", (7, 5), core_count=40, fpus_per_core=64,
  ...                    clock_rate_ghz=1.59, device_memory_size=15 * 2**30,
  ...                    memory_bandwidth=320e9, l2_cache_size=4 * 2**20,
  ...                    shared_memory_per_core=64 * 2**10,
  ...                    shared_memory_per_block_optin=64 * 2**10,
  ...                    threads_per_core_limit=1024)
  >>> parse(d.text()) == d
  True
  >>> round(d.fp32_flops / 1e12, 2)
  8.14
"""

from __future__ import annotations

import dataclasses
import re

# Limits every CUDA GPU since compute capability 3.0 shares (CUDA C++
# Programming Guide, "Compute Capabilities", technical specifications).
_THREADS_PER_BLOCK = 1024
_THREADS_PER_WARP = 32
_SHARED_MEMORY_PER_BLOCK = 48 * 2**10  # without opting in
_BLOCK_DIM_LIMIT = (2**31 - 1, 65535, 65535)
_REGISTERS = 64 * 2**10  # 32-bit registers per SM and per block


@dataclasses.dataclass(frozen=True)
class GpuDescription:
  """One GPU as XLA:GPU compiles for it (the fields of its
  ``GpuTargetConfig``; see the module docstring).

  Attributes:
    name: the device's own name (``jax.Device.device_kind``, e.g.
      ``"Tesla T4"``, ``"NVIDIA H100 80GB HBM3"``).
    compute_capability: ``(major, minor)``, e.g. ``(9, 0)`` for Hopper.
    core_count: streaming multiprocessors.
    fpus_per_core: FP32 units per SM.
    clock_rate_ghz: boost clock.
    device_memory_size: device memory as the driver reports it, bytes.
    memory_bandwidth: bytes/s.
    l2_cache_size: bytes.
    shared_memory_per_core: shared memory per SM, bytes.
    shared_memory_per_block_optin: shared memory one block may opt into, bytes.
    threads_per_core_limit: resident threads per SM.
    cudnn: the cuDNN version compiled against, ``(major, minor)``.
    cuda_runtime: the CUDA runtime version, ``(major, minor)``.
    shared_memory_per_block, threads_per_block_limit, threads_per_warp,
    block_dim_limit, registers_per_core_limit, registers_per_block_limit:
      limits common to CUDA GPUs (defaults from the CUDA programming guide).
  """
  name: str
  compute_capability: tuple[int, int]
  core_count: int
  fpus_per_core: int
  clock_rate_ghz: float
  device_memory_size: int
  memory_bandwidth: float
  l2_cache_size: int
  shared_memory_per_core: int
  shared_memory_per_block_optin: int
  threads_per_core_limit: int
  cudnn: tuple[int, int] = (9, 12)
  cuda_runtime: tuple[int, int] = (13, 0)
  shared_memory_per_block: int = _SHARED_MEMORY_PER_BLOCK
  threads_per_block_limit: int = _THREADS_PER_BLOCK
  threads_per_warp: int = _THREADS_PER_WARP
  block_dim_limit: tuple[int, int, int] = _BLOCK_DIM_LIMIT
  registers_per_core_limit: int = _REGISTERS
  registers_per_block_limit: int = _REGISTERS

  @property
  def fp32_flops(self) -> float:
    """Peak FP32 throughput: SMs x FP32 units x 2 (a fused multiply-add) x clock."""
    return self.core_count * self.fpus_per_core * 2 * self.clock_rate_ghz * 1e9

  def text(self) -> str:
    """The ``GpuTargetConfig`` text proto XLA:GPU reads."""
    x, y, z = self.block_dim_limit
    major, minor = self.compute_capability
    fields = [
        ("threads_per_block_limit", self.threads_per_block_limit),
        ("threads_per_warp", self.threads_per_warp),
        ("shared_memory_per_block", self.shared_memory_per_block),
        ("shared_memory_per_core", self.shared_memory_per_core),
        ("threads_per_core_limit", self.threads_per_core_limit),
        ("core_count", self.core_count),
        ("fpus_per_core", self.fpus_per_core),
        ("block_dim_limit_x", x), ("block_dim_limit_y", y), ("block_dim_limit_z", z),
        ("memory_bandwidth", int(self.memory_bandwidth)),
        ("l2_cache_size", self.l2_cache_size),
        ("clock_rate_ghz", self.clock_rate_ghz),
        ("device_memory_size", self.device_memory_size),
        ("shared_memory_per_block_optin", self.shared_memory_per_block_optin),
    ]
    info = "\n".join(f"  {key}: {value}" for key, value in fields)
    return (
        f"gpu_device_info {{\n{info}\n"
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
        f"  registers_per_core_limit: {self.registers_per_core_limit}\n"
        f"  registers_per_block_limit: {self.registers_per_block_limit}\n}}\n"
        f'platform_name: "CUDA"\n'
        f"dnn_version_info {{ major: {self.cudnn[0]} minor: {self.cudnn[1]} }}\n"
        f"runtime_version {{ major: {self.cuda_runtime[0]} minor: {self.cuda_runtime[1]} }}\n"
        f'device_description_str: "{self.name}"\n')


_FIELD = re.compile(r"^\s*([a-z_0-9]+)\s*:\s*(\"[^\"]*\"|[-+0-9.eE]+)\s*$")
# A version message, on one line or several, with fields after minor that the
# description does not hold (Hopper's ``feature_extension``).
_PAIR = re.compile(r"([a-z_]+)\s*\{\s*major:\s*(\d+)(?:\s+minor:\s*(\d+))?[^{}]*\}")
_DOTTED = re.compile(r"^(\d+)\.(\d+)")


def _dotted(version, default: tuple[int, int]) -> tuple[int, int]:
  """``(major, minor)`` of a version string such as ``"9.19.0"``."""
  match = _DOTTED.match(str(version)) if version is not None else None
  return (int(match.group(1)), int(match.group(2))) if match else default


def parse(text: str) -> GpuDescription:
  """A :class:`GpuDescription` from a ``GpuTargetConfig`` text proto (as
  :meth:`GpuDescription.text` writes it, or as XLA prints a real GPU's).

  Fields the description does not hold (autotuning results, ``dnn_version_info``'s
  patch) are ignored; a missing required field raises ``ValueError`` naming it.
  """
  values: dict[str, object] = {}
  for line in text.splitlines():
    match = _FIELD.match(line)
    if match:
      raw = match.group(2)
      values.setdefault(match.group(1), raw.strip('"') if raw.startswith('"') else
                        (float(raw) if any(c in raw for c in ".eE") else int(raw)))
  pairs = {name: (int(major), int(minor or 0)) for name, major, minor in _PAIR.findall(text)}
  try:
    return GpuDescription(
        name=str(values["device_description_str"]),
        compute_capability=pairs["cuda_compute_capability"],
        core_count=int(values["core_count"]),
        fpus_per_core=int(values["fpus_per_core"]),
        clock_rate_ghz=float(values["clock_rate_ghz"]),
        device_memory_size=int(values["device_memory_size"]),
        memory_bandwidth=float(values["memory_bandwidth"]),
        l2_cache_size=int(values["l2_cache_size"]),
        shared_memory_per_core=int(values["shared_memory_per_core"]),
        shared_memory_per_block_optin=int(values["shared_memory_per_block_optin"]),
        threads_per_core_limit=int(values["threads_per_core_limit"]),
        cudnn=pairs.get("dnn_version_info") or _dotted(values.get("dnn_version"), (9, 12)),
        cuda_runtime=pairs.get("runtime_version", (13, 0)),
        shared_memory_per_block=int(values.get("shared_memory_per_block",
                                               _SHARED_MEMORY_PER_BLOCK)),
        threads_per_block_limit=int(values.get("threads_per_block_limit",
                                               _THREADS_PER_BLOCK)),
        threads_per_warp=int(values.get("threads_per_warp", _THREADS_PER_WARP)),
        block_dim_limit=tuple(int(values.get(f"block_dim_limit_{a}", d))
                              for a, d in zip("xyz", _BLOCK_DIM_LIMIT)),
        registers_per_core_limit=int(values.get("registers_per_core_limit", _REGISTERS)),
        registers_per_block_limit=int(values.get("registers_per_block_limit", _REGISTERS)))
  except KeyError as missing:
    raise ValueError(f"jaxmem: a GPU target description needs the field {missing}; "
                     f"got a text proto with {sorted(values) + sorted(pairs)}") from None
