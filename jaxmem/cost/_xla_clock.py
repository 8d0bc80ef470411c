"""A clock that follows the target's compiled program.

A step's time on a GPU is the time of the kernels its compiler emits, not of
its jaxpr's equations: XLA fuses a chain of elementwise equations into one
kernel that reads its inputs once and writes its outputs once. This clock
prices the optimized HLO (``compiled.as_text()``) kernel by kernel on a
:class:`~jaxmem.targets.DeviceProfile`:

* a kernel (a fusion, an unfused instruction) takes its roofline time, the
  larger of the bytes it moves over the memory bandwidth and its matrix
  products' FLOPs over the matmul throughput, plus the profile's per-kernel
  latency. A cuBLAS or cuDNN call combines the two times as its kind does
  on a GPU (:data:`LIBRARY_CALLS`). The bytes are its operands' and outputs'
  (an operand a fusion only slices counts the slice; the buffer an in-place
  update writes into counts the update), its workspace not;
* a copy to or from host memory (``copy-start``/``copy-done`` between memory
  spaces) runs on the host link, beside the kernels: it starts when it is
  issued and the link is free in its direction (PCIe carries both
  directions at once, each on a copy engine of its own), and ``copy-done``
  waits for it;
* a loop runs its body its known trip count times; a conditional its
  slowest branch.

A collective is a kernel that also moves its result's bytes between the
GPUs, on the profile's interconnect (``DeviceProfile.collective_seconds``),
whichever takes longer.

Example:
  >>> from jaxmem.targets import get_profile
  >>> text = '''
  ... ENTRY %main (p: f32[1024,1024]) -> f32[1024,1024] {
  ...   %p = f32[1024,1024]{1,0} parameter(0)
  ...   ROOT %n = f32[1024,1024]{1,0} negate(%p)
  ... }'''
  >>> t4 = get_profile("t4")
  >>> timing = program_time(text, t4)
  >>> timing.count, round(timing.seconds * 1e6, 1)  # 4 MiB in, 4 out at 320 GB/s, + 2 us
  (1, 28.2)
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

from jaxmem.cost import _hlo as hlo
from jaxmem.targets import DeviceProfile

# Instructions that run no kernel: those that write no buffer, and more that
# wait for work priced where it was issued or only order others.
_FREE = hlo.NO_BUFFER | {
    "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done",
    "async-update", "add-dependency", "domain"}
# Instructions that run the computations they call (priced through them).
CONTROL = frozenset({"while", "conditional", "call"})
_SLICES = frozenset({"slice", "dynamic-slice", "gather"})
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
# How a library call's compute time (its FLOPs at the matmul rate) and
# memory time (its bytes at the memory bandwidth) make its time: their
# p-norm (1 adds them, the roofline's max is the infinite norm) over the
# share of the rate its kind reaches. Fitted to an H100's trace of GPT-2,
# ResNet-18 and a U-Net (``benchmarks/results/kernel-times-h100``), where
# the roofline's max put the library calls at 0.27-0.77 of their traced
# time while pricing XLA's own kernels within 4%: near the roofline's
# ridge a convolution neither reaches the matmul rate nor hides its memory
# traffic under it (the sum follows its rate from 4 to 400 TFLOP/s);
# cuBLAS's matmuls come closer (the 2-norm); cuDNN's filter gradients run
# at half the rate of forward and input-gradient convolutions of the same
# arithmetic intensity. First match wins; other calls (cuDNN's attention
# and norms, Triton) take the roofline's max as XLA's own kernels do.
LIBRARY_CALLS = (("__cublas", 2.0, 1.0), ("__cudnn$convBackwardFilter", 1.0, 0.5),
                 ("__cudnn$conv", 1.0, 1.0))
# cuDNN's forward convolutions split their work over output tiles of
# TILE_ELEMENTS (the 128x128 tiles the traced kernels name) and nothing
# else, so one with fewer tiles than the GPU has multiprocessors leaves the
# rest idle: its compute runs at tiles / multiprocessors of the rate. The
# filter gradient of a strided transposed convolution is such a call (XLA
# emits it as a forward convolution whose output is the small filter and
# whose window spans the image); on the H100's trace these ran 4-60x over
# the rate-only price. A forward convolution fused with a bias or side
# input (XLA:GPU's convBiasActivationForward: a filter gradient summed over
# micro-batches in a loop takes the running sum as its side input) runs the
# same tiles. Filter-gradient and matmul kernels also split the reduction,
# so the rule leaves them alone.
TILED_CALLS = ("__cudnn$convForward", "__cudnn$convBiasActivationForward")
TILE_ELEMENTS = 128 * 128


@dataclasses.dataclass(frozen=True)
class Timing:
  """A program's predicted time on a profile.

  Attributes:
    seconds: the step's time: kernels, and host copies where the kernels
      wait for them.
    kernels: seconds the kernels take, one after another.
    link: seconds the host link is busy.
    count: kernels launched (a loop's body counted once per trip).
    unknown_trips: loops whose trip count the program does not state
      (priced as one trip).
  """
  seconds: float
  kernels: float
  link: float
  count: int
  unknown_trips: int = 0


@dataclasses.dataclass
class _Clock:
  """Three streams: the kernels', and the host link's in each direction."""
  compute: float = 0.0
  link_free: dict = dataclasses.field(default_factory=lambda: {"d2h": 0.0, "h2d": 0.0})
  link_busy: float = 0.0
  kernels: float = 0.0
  count: int = 0
  unknown_trips: int = 0
  pending: dict = dataclasses.field(default_factory=dict)

  @property
  def end(self) -> float:
    return max(self.compute, *self.link_free.values())

  def run(self, seconds: float) -> None:
    self.compute += seconds
    self.kernels += seconds
    self.count += 1


def program_time(text: str, profile: DeviceProfile) -> Timing:
  """The predicted time of the compiled program ``text`` on ``profile``
  (see the module docstring)."""
  program = hlo.parse(text)
  clock = _Clock()
  _schedule(program, program.entry, profile, clock)
  return Timing(clock.end, clock.kernels, clock.link_busy,
                clock.count, clock.unknown_trips)


def _schedule(program: hlo.Program, name: str, profile: DeviceProfile, clock: _Clock,
              ) -> None:
  """Advances ``clock`` through computation ``name``'s instructions."""
  shapes = {i.name: i.arrays() for i in program.computations.get(name, [])}
  for inst in program.computations.get(name, []):
    if inst.opcode == "copy-done":  # the kernels wait for a copy to the host or back
      clock.compute = max(clock.compute, clock.pending.pop(inst.operands()[0], 0.0))
    elif inst.crosses_memory():
      _copy(inst, profile, clock)
    elif inst.opcode in CONTROL:
      _control(program, inst, profile, clock)
    elif launches_kernel(inst):
      clock.run(kernel_seconds(inst, shapes, program, profile))


def launches_kernel(inst: hlo.Instruction) -> bool:
  """Whether the clock prices ``inst`` as a kernel (or a library call) of
  its own: not free (a host copy's end is), not a host copy's start, not
  control flow."""
  return not (inst.opcode in _FREE or inst.crosses_memory() or inst.opcode in CONTROL)


def _copy(inst: hlo.Instruction, profile: DeviceProfile, clock: _Clock) -> None:
  """A copy between device and host memory on the link, issued now."""
  destination = inst.arrays()[0]
  direction = "d2h" if destination.host else "h2d"
  seconds = profile.transfer_seconds(destination.nbytes, direction)
  start = max(clock.compute, clock.link_free[direction])
  clock.link_free[direction] = start + seconds
  clock.link_busy += seconds
  clock.pending[inst.name] = start + seconds


def _control(program: hlo.Program, inst: hlo.Instruction, profile: DeviceProfile,
             clock: _Clock) -> None:
  """A loop (its body and condition per trip), a conditional (its slowest
  branch) or a call, priced on a clock of its own and added to ``clock``."""
  parts = []
  for _, called in inst.called():
    inner = _Clock()
    _schedule(program, called, profile, inner)
    parts.append(inner)
  trips = 1
  if inst.opcode == "while":
    found = _TRIPS.search(inst.rest)
    trips = int(found.group(1)) if found else 1
    clock.unknown_trips += found is None
  if inst.opcode == "conditional":
    parts = [max(parts, key=lambda p: p.end)] if parts else []
  for inner in parts:
    clock.compute += trips * inner.end
    clock.kernels += trips * inner.kernels
    clock.count += trips * inner.count
    clock.link_busy += trips * inner.link_busy
    clock.unknown_trips += trips * inner.unknown_trips


def kernel_seconds(inst: hlo.Instruction, shapes: dict, program: hlo.Program,
                   profile: DeviceProfile) -> float:
  """One kernel's roofline time plus the profile's kernel latency."""
  body = program.fused_body(inst)
  nbytes = _bytes(inst, shapes, body)
  flops = _matmul_flops(inst, shapes, body)
  exchanged = (sum(a.nbytes for a in inst.results()) if inst.opcode in hlo.COLLECTIVES else 0)
  target = inst.call_target()
  outputs = sum(a.size for a in inst.results()) if target else 0
  return profile.kernel_latency + roofline_seconds(
      target, flops / profile.matmul_throughput / occupancy(target, outputs, profile),
      nbytes / profile.memory_bandwidth, profile.collective_seconds(exchanged))


def roofline_seconds(target: str, compute: float, memory: float,
                     collective: float = 0.0) -> float:
  """A kernel's time but its launch, from its compute, memory and
  collective times: a library call's by its kind (:func:`library_seconds`;
  ``target``: a custom call's target), else the largest."""
  call = library_seconds(target, compute, memory)
  return max(compute, memory, collective) if call is None else call


def occupancy(target: str, outputs: int, profile: DeviceProfile) -> float:
  """The share of the GPU's multiprocessors a call to ``target`` (a custom
  call's target) that writes ``outputs`` elements keeps busy, by
  :data:`TILED_CALLS`; 1 for every other kernel, and where the profile
  does not say how many multiprocessors the GPU has.

  Example:
    >>> from jaxmem.targets import get_profile
    >>> occupancy("__cudnn$convForward", 2 * 128 * 128, get_profile("h100"))  # 2 of 132
    0.015151515151515152
    >>> occupancy("__cublas$gemm", 16, get_profile("h100"))
    1.0
  """
  cores = profile.description.core_count if profile.description else 0
  if not (cores and outputs and target.startswith(TILED_CALLS)):
    return 1.0
  return min(1.0, -(-outputs // TILE_ELEMENTS) / cores)


def library_seconds(target: str, compute: float, memory: float) -> float | None:
  """The time of a library call to ``target`` (a custom call's target)
  whose compute and memory times are given, by :data:`LIBRARY_CALLS`;
  None for anything else (XLA's own kernels take the larger).

  Example:
    >>> library_seconds("__cudnn$convForward", 3.0, 1.0)  # the sum
    4.0
    >>> library_seconds("__cublas$lt$matmul", 3.0, 4.0)  # the 2-norm
    5.0
    >>> library_seconds("", 3.0, 1.0) is None
    True
  """
  found = next(((norm, rate) for prefix, norm, rate in LIBRARY_CALLS
                if target and target.startswith(prefix)), None)
  if found is None:
    return None
  norm, rate = found
  return (compute**norm + memory**norm) ** (1 / norm) / rate


def _bytes(inst: hlo.Instruction, shapes: dict, body: list[hlo.Instruction]) -> int:
  """Bytes a kernel reads and writes (see the module docstring)."""
  operands = [sum(a.nbytes for a in shapes.get(o, [])) for o in inst.operands()]
  written = sum(a.nbytes for a in inst.results())
  if inst.opcode in _SLICES:
    return 2 * written
  if inst.opcode == "dynamic-update-slice" and len(operands) > 1:
    return 2 * operands[1]
  if not body:
    return sum(operands) + written
  params = {hlo.parameter_number(i): i.name for i in body if i.opcode == "parameter"}
  users: dict[str, list[hlo.Instruction]] = {}
  for i in body:
    for o in i.operands():
      users.setdefault(o, []).append(i)
  root = next((i for i in body if i.root), None)
  in_place = (root.operands()[0] if root is not None and root.opcode == "dynamic-update-slice"
              else None)
  total = 0
  for k, full in enumerate(operands):
    param = params.get(k)
    readers = users.get(param, [])
    if param is not None and param == in_place:
      written = sum(a.nbytes for a in _update_arrays(root, body))  # the rest stays
    elif readers and all(r.opcode in _SLICES for r in readers):
      total += min(full, sum(sum(a.nbytes for a in r.arrays()) for r in readers))
    else:
      total += full
  return total + written


def _update_arrays(root: hlo.Instruction, body: list[hlo.Instruction]) -> list[hlo.Array]:
  by_name = {i.name: i for i in body}
  update = root.operands()[1] if len(root.operands()) > 1 else None
  return by_name[update].arrays() if update in by_name else root.arrays()


def _matmul_flops(inst: hlo.Instruction, shapes: dict, body: list[hlo.Instruction]) -> float:
  """FLOPs of a kernel's matrix products and convolutions: a cuBLAS or
  cuDNN call's, or the dots and convolutions inside a fusion."""
  if body:
    inner = {i.name: i.arrays() for i in body}
    return sum(_matmul_flops(i, inner, []) for i in body
               if i.opcode in ("dot", "convolution", "custom-call"))
  out = inst.results()
  operands = [shapes.get(o, []) for o in inst.operands()]
  if not out or len(operands) < 2 or not operands[0] or not operands[1]:
    return 0.0
  labels = _DIM_LABELS.search(inst.rest)
  target = inst.call_target()
  if labels and (inst.opcode == "convolution" or target.startswith("__cudnn$conv")):
    output, kernel = _forward_convolution(target, out[0],
                                          operands[0][0], operands[1][0])
    feature = labels.group(2).find("o")
    per_output = kernel.size / max(kernel.dims[feature], 1) if feature >= 0 else kernel.size
    return 2.0 * output.size * per_output
  contracting = _contracting(inst)
  if contracting is None:
    return 0.0
  lhs = operands[0][0]
  depth = int(np.prod([lhs.dims[d] for d in contracting if d < len(lhs.dims)]))
  return 2.0 * out[0].size * depth


def _forward_convolution(call: str, result: hlo.Array, first: hlo.Array,
                         second: hlo.Array) -> tuple[hlo.Array, hlo.Array]:
  """(output, filter) of the forward convolution a convolution kernel
  computes or differentiates: a cuDNN call keeps the forward convolution's
  dimension labels and permutes its arrays by kind (the filter's gradient
  from the input and the output's gradient; the input's from the output's
  gradient and the filter); an HLO convolution is its own forward one."""
  if call.endswith("BackwardFilter"):
    return second, result
  if call.endswith("BackwardInput"):
    return first, second
  return result, second


def _contracting(inst: hlo.Instruction) -> list[int] | None:
  """The lhs contracting dimensions of a dot or a cuBLAS GEMM; None for
  anything else."""
  if inst.opcode == "dot":
    found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.rest)
    return [int(d) for d in found.group(1).split(",") if d] if found else []
  found = re.search(r'"lhs_contracting_dimensions":(\[[^\]]*\])', inst.rest)
  return [int(d) for d in json.loads(found.group(1))] if found else None
