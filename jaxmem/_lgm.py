"""The Layered Graph Model (vTensor): swap only the bytes each peak lacks.

Whole-tensor swapping moves more bytes than a peak needs: to free 1.2 MiB it
may move two 1 MiB tensors. The vTensor seed virtualizes tensors into
smaller *vTensors* (``split`` / ``salloc`` / ``merge``, see
:class:`~jaxmem._plan.Chunked` and ``_rewrite``) and plans their swapping on
a Layered Graph Model:

* **Layers.** The step is cut into layers: module blocks (the module path cut
  after two names, ``GPT2/block0``, as the rewrite scopes recomputation), or,
  for a step without modules, equal runs of its equations. A schedule op
  belongs to the layer of the equation it runs or serves.
* **Demand and deficit.** Per layer, the memory model's device bytes over
  the step; where they exceed the aim (the target less the reserved
  headroom), the excess at the layer's peak is its *deficit*.
* **Mapping tensors to vTensors.** For the worst deficit, the residuals
  whose buffers are live at the peak and idle there (made and last read by
  the forward pass before it, read again by the backward pass after it) are
  swapped, those with the most compute before their first backward reader
  (the most room to hide the copy back) first: whole while the deficit left
  is at least their size, then the last one split into chunks and only as
  many chunks swapped as cover the rest. Each swapped tensor *swaps for*
  that peak (the ``covers`` relation of :class:`SwapRecord`). Then the
  model is run again (a swap also lowers the other peaks it spans) and the
  next deficit is covered, until none is left.
* **Prefetch order.** Each swapped chunk is copied back at its own point:
  after the peak it covers, as late as the compute before its reader still
  hides the copy (as early after the peak as possible where none does); a
  tensor's chunks queue on one link, so each later chunk starts earlier by
  the time of those before it. A copy back that a later peak finds back on
  the device and idle is issued again after that peak, before anything more
  is swapped.
* **Memory reservation.** No chunk smaller than the size where the host
  link's efficiency falls below ``efficiency`` (from the device profile's
  latency and bandwidth: small copies are slow), and ``reserve`` of the
  target held back as headroom, so a plan does not sit on the budget's edge.
  Both are options (``min_chunk``, ``reserve``); ``whole=True`` swaps whole
  tensors only (the ablation the seed compares against).

Example:
  >>> import jax, models
  >>> from jaxmem._graph import build_graph
  >>> from jaxmem._planners import evaluate
  >>> task = models.get("mlp", depth=6, width=32, batch=256, features=16)
  >>> g = build_graph(jax.make_jaxpr(task.step)(*task.init()))
  >>> base = evaluate(g, Plan())[1].peak
  >>> result = LGM("t4", min_chunk=4096).plan(g, int(base * 0.8))
  >>> result.fits, result.details.chunked > 0
  (True, True)
"""

from __future__ import annotations

import dataclasses
import math
import time

from jaxmem._devices import get_profile
from jaxmem._graph import Graph
from jaxmem._perf import schedule_costs
from jaxmem._plan import KEEP, RECOMPUTE, Chunked, Offload, Plan
from jaxmem._planners import (PlanResult, _paused_gc, _prefetch_point, evaluate,
                              fused_values, recomputable)
from jaxmem._rewrite import _scope, chunk_bytes


@dataclasses.dataclass(frozen=True)
class SwapRecord:
  """One tensor swapped (whole or in part) to cover one layer's deficit.

  Attributes:
    layer: the layer whose peak it covers.
    deficit: bytes that peak lacked when the tensor was chosen.
    value: the residual's value id; name: its readable name.
    nbytes: the tensor's bytes.
    chunks: how many chunks it was cut into (1: whole).
    swapped: how many of them go to host memory.
    swapped_bytes: bytes they free at that peak.
    peak: which of the plan's peaks, in the order they were covered.
    delayed: an earlier swap's copy back moved after this peak (nothing
      more goes to the host).
  """
  layer: str
  deficit: int
  value: int
  name: str
  nbytes: int
  chunks: int
  swapped: int
  swapped_bytes: int
  peak: int = 0
  delayed: bool = False


@dataclasses.dataclass
class LayerReport:
  """The Layered Graph Model of a plan: layers with their demand and
  deficit before and after, and the swaps that cover them."""
  layers: list[str]
  demand_before: dict
  demand_after: dict
  aim: int
  records: list[SwapRecord]
  min_chunk: int

  @property
  def chunked(self) -> int:
    """Tensors split into vTensors."""
    return sum(1 for r in self.records if r.chunks > 1)

  def moved(self) -> dict:
    """Bytes sent to host memory per layer covered."""
    out: dict = {}
    for r in self.records:
      if not r.delayed:
        out[r.layer] = out.get(r.layer, 0) + r.swapped_bytes
    return out

  def table(self) -> str:
    """The swaps as a readable table."""
    from jaxmem._budget import format_bytes
    lines = [f"{'layer':<28} {'deficit':>10} {'tensor':>10} {'chunks':>7} "
             f"{'swapped':>10}  name", "-" * 90]
    for r in self.records:
      lines.append(f"{r.layer[:28]:<28} {format_bytes(r.deficit):>10} "
                   f"{format_bytes(r.nbytes):>10} {f'{r.swapped}/{r.chunks}':>7} "
                   f"{format_bytes(r.swapped_bytes):>10}  {r.name[:40]}")
    return "\n".join(lines)


def reservation_floor(profile, efficiency: float = 0.8) -> int:
  """The smallest copy that reaches ``efficiency`` of the host link's
  bandwidth on ``profile`` (each copy pays the link's latency once).

  Example:
    >>> reservation_floor("t4")  # 10 us latency, 12 GB/s: 4 x 120 KB
    480000
  """
  profile = get_profile(profile)
  if not 0 <= efficiency < 1:
    raise ValueError(f"efficiency must be in [0, 1), got {efficiency!r}")
  wire = efficiency / (1 - efficiency) * profile.link_latency
  return int(round(wire * min(profile.h2d_bandwidth, profile.d2h_bandwidth)))


def op_layers(schedule, runs: int = 8) -> list[str]:
  """The layer of each op of ``schedule``: the block of the equation it runs
  or, for ops a rewrite added, of the equation they serve (the next one);
  a step without module blocks is cut into ``runs`` equal runs of ops."""
  graph = schedule.graph
  ops = schedule.ops
  names: list = [None] * len(ops)
  following = None
  for pos in range(len(ops) - 1, -1, -1):
    if ops[pos].kind == "node":
      following = _scope(graph.nodes[ops[pos].node])
    names[pos] = following or "<end>"
  if len(set(names)) < 2:
    size = math.ceil(len(ops) / runs) or 1
    names = [f"ops {i // size * size}-{min(len(ops), (i // size + 1) * size) - 1}"
             for i in range(len(ops))]
  return names


def demand(profile, names: list[str]) -> dict:
  """Per layer, the most device bytes the step holds while it runs."""
  out: dict = {}
  for name, live in zip(names, profile.timeline):
    out[name] = max(out.get(name, 0), live)
  return out


@dataclasses.dataclass
class LGM:
  """The vTensor planner: swap (chunks of) residuals to cover each layer's
  deficit, planned on the Layered Graph Model (see the module docstring).

  Attributes:
    profile: the device (a name in ``jaxmem.PROFILES`` or a
      ``DeviceProfile``): link speed for the chunk floor and prefetch points;
      a unified-memory device never swaps.
    min_chunk: the smallest chunk in bytes; None derives it from the
      profile (:func:`reservation_floor` at ``efficiency``); 0 allows any.
    efficiency: the share of link bandwidth a chunk must reach.
    reserve: share of the target held back as headroom.
    max_chunks: the most chunks one tensor is cut into.
    whole: swap whole tensors only (no vTensors; the ablation).
    host_budget: cap on pinned host bytes (None: no cap).
  """
  profile: object = "t4"
  min_chunk: int | None = None
  efficiency: float = 0.8
  reserve: float = 0.02
  max_chunks: int = 16
  whole: bool = False
  host_budget: int | None = None
  name: str = "lgm"

  def __post_init__(self):
    get_profile(self.profile)  # an unknown name fails here, with the choices
    if not 0 <= self.reserve < 1:
      raise ValueError(f"LGM: reserve is a share of the target in [0, 1), got "
                       f"{self.reserve!r}")
    if self.min_chunk is not None and self.min_chunk < 0:
      raise ValueError(f"LGM: min_chunk must be >= 0 bytes, got {self.min_chunk!r}")
    if self.max_chunks < 1:
      raise ValueError(f"LGM: max_chunks must be >= 1, got {self.max_chunks!r}")

  @property
  def floor(self) -> int:
    """The chunk floor in bytes (memory reservation)."""
    if self.min_chunk is not None:
      return self.min_chunk
    return reservation_floor(self.profile, self.efficiency)

  def plan(self, graph: Graph, target: int, start: Plan | None = None) -> PlanResult:
    """Swaps toward ``target`` bytes on top of ``start`` (e.g. a
    recomputation plan, when LGM is the hybrid's swap step)."""
    began = time.perf_counter()
    with _paused_gc():
      result = self._plan(graph, target, start or Plan())
    result.seconds = time.perf_counter() - began
    return result

  def lowest(self, graph: Graph) -> list[PlanResult]:
    """The candidate for the smallest footprint: every deficit covered as
    far as swapping can (the host budget permitting)."""
    return [self.plan(graph, 0)]

  def _plan(self, graph, target, plan) -> PlanResult:
    device = get_profile(self.profile)
    aim = int(target * (1 - self.reserve))
    rebuildable = recomputable(graph)
    riders: dict = {}
    for vid, bufs in fused_values(graph).items():
      if vid in rebuildable:
        for buf in bufs:
          riders.setdefault(buf, []).append(vid)
    schedule, profile = evaluate(graph, plan)
    names = op_layers(schedule)
    report = LayerReport(list(dict.fromkeys(names)), demand(profile, names), {}, aim, [],
                         self.floor)
    steps = 0
    while profile.peak > aim and not device.unified:
      # The layer with the largest demand holds the step's peak.
      peak_at = profile.peak_op
      layer = op_layers(schedule)[peak_at]
      deficit = profile.peak - aim
      # vTensors first; where their merges make a new peak as high (a merge
      # holds the chunks and the joined copy at once), whole tensors.
      for whole in (self.whole, True):
        moves = self._cover(graph, plan, schedule, profile, peak_at, deficit, layer,
                            device, whole)
        trial = _applied(plan, moves)
        for vid, _, _ in moves:
          # Residuals XLA computes from this buffer inside their readers
          # would keep it on the device: they are rebuilt from its copy.
          for rider in riders.get(vid, ()):
            if trial[rider].kind == "keep":
              trial = trial.with_decision(rider, RECOMPUTE)
        t_schedule, t_profile = evaluate(graph, trial)
        if moves and t_profile.peak < profile.peak and (
            self.host_budget is None or t_profile.host_peak <= self.host_budget):
          break
        moves = []
        if whole:
          break
      if not moves:
        break  # nothing lowers the peak: it is not one swapping can lower
      plan, schedule, profile = trial, t_schedule, t_profile
      report.records.extend(dataclasses.replace(record, peak=steps)
                            for _, _, record in moves)
      steps += 1
    report.demand_after = demand(profile, op_layers(schedule))
    return PlanResult(plan, schedule, profile, target, profile.peak <= target, 0.0, steps,
                      report)

  def _cover(self, graph, plan, schedule, profile, peak_at, deficit, layer, device,
             whole):
    """The swaps that cover ``deficit`` at op ``peak_at``: a list of (value
    id, decision, :class:`SwapRecord`).

    Two passes over the candidates, the most room first: the first swaps
    only the chunks whose copies back the compute before their reader hides
    (a tensor gives as many chunks as its window carries; whole, only a
    tensor whose whole copy hides), the second whatever is still needed.
    """
    costs = schedule_costs(schedule)
    elapsed = [0.0]
    for c in costs:
      elapsed.append(elapsed[-1] + device.op_seconds(c.flops, c.nbytes))
    moves, left = self._delay(graph, plan, schedule, profile, peak_at, deficit, layer,
                              device, costs)
    plan = _applied(plan, moves)
    found = self._candidates(graph, plan, profile, peak_at, elapsed)
    units: dict = {}  # vid -> [(chunk index or None for whole, bytes)] not swapped yet
    cuts: dict = {}  # vid -> (axis, bounds) of a vTensor
    for vid, _ in found:
      current = plan[vid]
      if isinstance(current, Chunked):
        cuts[vid] = (current.axis, current.bounds)
        sizes = chunk_bytes(graph.values[vid], current)
        units[vid] = [(i, sizes[i]) for i, d in enumerate(current.chunks)
                      if d.kind == "keep"]
        continue
      n, axis = (1, 0) if whole else self._split(graph, vid)
      if n == 1:
        units[vid] = [(None, graph.values[vid].nbytes)]
        continue
      length = graph.values[vid].aval.shape[axis]
      cuts[vid] = (axis, tuple((length * i // n, length * (i + 1) // n) for i in range(n)))
      sizes = chunk_bytes(graph.values[vid], Chunked(axis, cuts[vid][1], (KEEP,) * n))
      units[vid] = list(enumerate(sizes))
    picked: dict = {}  # vid -> [(chunk index or None, bytes)], in pick order
    order: dict = {}  # vid -> when it was last picked from
    count = 0
    for hidden in (True, False):
      for vid, room in found:
        window = room
        while left > 0 and units[vid]:
          index, nbytes = units[vid][0]
          if hidden and device.transfer_seconds(nbytes, "h2d") > window:
            break
          window -= device.transfer_seconds(nbytes, "h2d")
          units[vid].pop(0)
          picked.setdefault(vid, []).append((index, nbytes))
          order[vid] = count = count + 1
          left -= nbytes
      if left <= 0:
        break
    for vid in sorted(picked, key=order.get):
      r = graph.residual(vid)
      chunks = picked[vid]
      freed = sum(nbytes for _, nbytes in chunks)
      fresh = not isinstance(plan[vid], Chunked)
      if chunks[0][0] is None or (fresh and not units[vid]):  # all of it: whole
        at = _prefetch_point(schedule, r, device, costs=costs, after=peak_at)
        moves.append((vid, Offload(at=at),
                      SwapRecord(layer, deficit, vid, r.name, r.nbytes, 1, 1, freed)))
        continue
      axis, bounds = cuts[vid]
      swapped = {i for i, _ in chunks} | set(() if fresh else plan[vid].offloaded)
      decision = self._chunked(schedule, r, axis, bounds, swapped, device, costs, peak_at,
                               None if fresh else plan[vid])
      moves.append((vid, decision, SwapRecord(layer, deficit, vid, r.name, r.nbytes,
                                              len(bounds), len(chunks), freed)))
    return moves

  def _delay(self, graph, plan, schedule, profile, peak_at, deficit, layer, device,
             costs):
    """Copies back issued before the peak whose reader comes after it: each
    is issued again after the peak (the prefetch order follows the peaks),
    which frees its bytes there without moving anything more. Returns the
    moves and the deficit left."""
    moves, left = [], deficit
    first_read = schedule.first_reads()
    made = {op.outs[0]: pos for pos, op in enumerate(schedule.ops) if op.kind == "prefetch"}
    for key in profile.live_at_peak:
      unit = schedule.fetched.get(key)
      if unit is None or left <= 0 or made[key] > peak_at or \
          first_read.get(key, peak_at) <= peak_at:
        continue
      vid = unit if isinstance(unit, int) else unit[0]
      r, nbytes = graph.residual(vid), schedule.nbytes(key)
      at = _prefetch_point(schedule, r, device, costs=costs, after=peak_at)
      current = plan[vid]
      if isinstance(unit, int):
        decision = Offload(at=at)
      else:
        chunks = list(current.chunks)
        chunks[unit[1]] = Offload(at=at)
        decision = dataclasses.replace(current, chunks=tuple(chunks))
      plan = plan.with_decision(vid, decision)
      moves.append((vid, decision, SwapRecord(layer, deficit, vid, r.name, r.nbytes,
                                              1 if isinstance(unit, int) else
                                              len(current.bounds), 0, nbytes,
                                              delayed=True)))
      left -= nbytes
    return moves, left

  def _candidates(self, graph, plan, profile, peak_at, elapsed):
    """Residuals whose buffers (a vTensor: its kept chunks) are live and idle
    at the peak (op ``peak_at``), with the predicted compute seconds between
    the peak and their first backward reader; the most room first."""
    fused = fused_values(graph)
    ops = profile.schedule.ops
    position, chunk_of = {}, {}
    for pos, op in enumerate(ops):
      if op.kind == "node":
        position.setdefault(op.node, pos)
      elif op.kind == "split":
        chunk_of.update((key, op.ins[0]) for key in op.outs)
    found = {}
    for key in profile.live_at_peak:
      key = chunk_of.get(key, key)  # a kept chunk stands for its vTensor
      vid = key[0]
      if key[1] != 0 or vid not in graph._by_value or vid in fused or \
          vid in graph.output_ids or vid in found:
        continue
      if plan[vid].kind not in ("keep", "chunked"):
        continue
      r = graph.residual(vid)
      reads = profile.reads.get(key, [])
      if any(p > peak_at and not graph.nodes[ops[p].node].backward
             for p in reads if ops[p].kind == "node"):
        continue  # the forward pass still reads it after the peak
      first = position.get(r.first_backward_use)
      if first is None or first <= peak_at:
        continue
      found[vid] = elapsed[first] - elapsed[peak_at + 1]
    return sorted(found.items(), key=lambda item: (-item[1], item[0]))

  def _split(self, graph, vid) -> tuple[int, int]:
    """(chunks, axis) a tensor is cut into: as many chunks as the floor
    allows (at most ``max_chunks``) along its first axis long enough; 1
    (whole) if no two chunks of at least the floor fit."""
    value = graph.values[vid]
    want = min(self.max_chunks, value.nbytes // max(self.floor, 1))
    for axis, length in enumerate(value.aval.shape):
      n = min(want, length)
      if n >= 2:
        return n, axis
    return 1, 0

  def _chunked(self, schedule, residual, axis, bounds, offloaded, device, costs,
               peak_at, decided=None):
    """The :class:`Chunked` decision with chunks ``offloaded`` swapped, each
    copied back at its own point (later chunks of the queue earlier), none
    before the peak they cover (op ``peak_at``); chunks already swapped in
    ``decided`` keep their points."""
    row = residual.nbytes // schedule.graph.values[residual.value].aval.shape[axis]
    chunks, queued = [], 0
    for i in range(len(bounds)):
      if i in offloaded:
        queued += (bounds[i][1] - bounds[i][0]) * row
        if decided is not None and decided.chunks[i].kind == "offload":
          chunks.append(decided.chunks[i])
        else:
          chunks.append(Offload(at=_prefetch_point(schedule, residual, device, queued,
                                                   costs, peak_at)))
      else:
        chunks.append(KEEP)
    return Chunked(axis, tuple(bounds), tuple(chunks))



def _applied(plan: Plan, moves) -> Plan:
  for vid, decision, _ in moves:
    plan = plan.with_decision(vid, decision)
  return plan
