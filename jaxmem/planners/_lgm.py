"""The Layered Graph Model (vTensor): swap only the bytes each peak lacks.

Whole-tensor swapping moves more bytes than a peak needs: to free 1.2 MiB it
may move two 1 MiB tensors. The vTensor seed virtualizes tensors into
smaller *vTensors* (``split`` / ``salloc`` / ``merge``, see
:class:`~jaxmem._decisions.Chunked` and ``_schedule``) and plans their swapping on
a Layered Graph Model:

* **Layers.** The step is cut into layers: module blocks (the module path cut
  after two names, ``GPT2/block0``, as the rewrite scopes recomputation), or,
  for a step without modules, equal runs of its equations. A schedule op
  belongs to the layer of the equation it runs or serves.
* **Demand and deficit.** Per layer, the memory model's device bytes over
  the step; where they exceed the ceiling (the aim less the reserved
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
  link's efficiency falls below ``efficiency`` (from the target's profile:
  its latency and bandwidth; small copies are slow), and ``reserve`` of the
  aim held back as headroom, so a plan does not sit on the budget's edge.
  Both are options (``min_chunk``, ``reserve``); ``whole=True`` swaps whole
  tensors only (the ablation the seed compares against).

Example:
  >>> import jax, jaxmem_models as models
  >>> from jaxmem.graph._graph import build_graph
  >>> from jaxmem.cost._evaluate import evaluate
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

from jaxmem._budget import format_bytes
from jaxmem._decisions import KEEP, RECOMPUTE, Chunked, Offload, Plan
from jaxmem.targets._profiles import DeviceProfile, get_profile
from jaxmem.cost._evaluate import (Candidate, Details, clipped, evaluate, fused_values,
                                   paused_gc, prefetch_point)
from jaxmem.graph._graph import Graph
from jaxmem.cost._memory import Liveness
from jaxmem.cost._perf import schedule_costs
from jaxmem.schedule._schedule import Schedule
from jaxmem.planners._base import Planner, with_target
from jaxmem.planners._choices import riders


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
class LayerReport(Details):
  """The Layered Graph Model of a plan: layers with their demand and
  deficit before and after, and the swaps that cover them (``ceiling``:
  the plan's aim less the reserved headroom, the demand above which is a
  deficit)."""
  layers: list[str]
  demand_before: dict
  demand_after: dict
  ceiling: int
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

  def rows(self) -> list[dict]:
    return [dataclasses.asdict(r) for r in self.records]

  def table(self, top: int | None = None) -> str:
    """The swaps as a readable table (the first ``top``; for 0, one line
    that counts them)."""
    if top == 0:
      layers = {r.layer for r in self.records}
      swapped = format_bytes(sum(r.swapped_bytes for r in self.records))
      return (f"LGM planner's vTensor swaps: {len(self.records)} tensors "
              f"({self.chunked} split into chunks), {swapped} to host memory over "
              f"{len(layers)} layer(s); report(top=None) lists them")
    lines = ["LGM planner's vTensor swaps (layer, its deficit, tensor, chunks "
             "swapped/cut, bytes):",
             f"{'layer':<28} {'deficit':>10} {'tensor':>10} {'chunks':>7} "
             f"{'swapped':>10}  name", "-" * 90]
    rows = [f"{r.layer[:28]:<28} {format_bytes(r.deficit):>10} "
            f"{format_bytes(r.nbytes):>10} {f'{r.swapped}/{r.chunks}':>7} "
            f"{format_bytes(r.swapped_bytes):>10}  {r.name[:40]}" for r in self.records]
    return "\n".join(lines + clipped(rows, top, "more swaps"))


def reservation_floor(target, efficiency: float = 0.8) -> int:
  """The smallest copy that reaches ``efficiency`` of the host link's
  bandwidth on ``target`` (a name in ``jaxmem.PROFILES`` or a
  ``DeviceProfile``; each copy pays the link's latency once).

  Example:
    >>> reservation_floor("t4")  # 10 us latency, 12 GB/s: 4 x 120 KB
    480000
  """
  profile = get_profile(target)
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
      following = graph.nodes[ops[pos].node].scope()
    names[pos] = following or "<end>"
  if len(set(names)) < 2:
    size = math.ceil(len(ops) / runs) or 1
    names = [f"ops {i // size * size}-{min(len(ops), (i // size + 1) * size) - 1}"
             for i in range(len(ops))]
  return names


def demand(memory: Liveness, names: list[str]) -> dict:
  """Per layer, the most device bytes the step holds while it runs."""
  out: dict = {}
  for name, live in zip(names, memory.timeline):
    out[name] = max(out.get(name, 0), live)
  return out


@dataclasses.dataclass(frozen=True)
class _Peak:
  """The peak a step of the LGM covers.

  Attributes:
    schedule, memory: the plan so far and its memory model.
    at: the schedule position of the peak.
    deficit: the bytes above the ceiling there.
    layer: the layer that holds it.
    profile: the target's profile.
    costs: the compute cost of each op (``_perf.schedule_costs``).
  """
  schedule: Schedule
  memory: Liveness
  at: int
  deficit: int
  layer: str
  profile: DeviceProfile
  costs: list

  def record(self, r, chunks: int, swapped: int, freed: int,
             delayed: bool = False) -> SwapRecord:
    """A :class:`SwapRecord` of residual ``r`` swapped for this peak."""
    return SwapRecord(self.layer, self.deficit, r.value, r.name, r.nbytes, chunks,
                      swapped, freed, delayed=delayed)

  def copy_back(self, r, nbytes: int | None = None) -> int | None:
    """Where a copy back of ``r`` (``nbytes`` of it queued) is issued: after
    this peak, as late as the compute before its reader hides it."""
    return prefetch_point(self.schedule, r.value, r.nbytes if nbytes is None else nbytes,
                          self.profile, self.costs, self.at)


@dataclasses.dataclass
class LGM(Planner):
  """The vTensor planner: swap (chunks of) residuals to cover each layer's
  deficit, planned on the Layered Graph Model (see the module docstring).

  Attributes:
    target: the GPU (a name in ``jaxmem.PROFILES`` or a
      ``DeviceProfile``; None assumes ``"t4"`` and reports say so): link
      speed for the chunk floor and prefetch points; a unified-memory target
      never swaps.
    min_chunk: the smallest chunk in bytes; None derives it from the
      target (:func:`reservation_floor` at ``efficiency``); 0 allows any.
    efficiency: the share of link bandwidth a chunk must reach.
    reserve: share of the aim held back as headroom.
    max_chunks: the most chunks one tensor is cut into.
    whole: swap whole tensors only (no vTensors; the ablation).
    host_budget: cap on pinned host bytes (None: no cap).
  """
  target: object = None
  min_chunk: int | None = None
  efficiency: float = 0.8
  reserve: float = 0.02
  max_chunks: int = 16
  whole: bool = False
  host_budget: int | None = None
  name: str = "lgm"
  assumed_target: bool = False

  def __post_init__(self):
    self.target, assumed = with_target(self.target)  # checks the name
    self.assumed_target = self.assumed_target or assumed
    if not 0 <= self.reserve < 1:
      raise ValueError(f"LGM: reserve is a share of the aim in [0, 1), got "
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
    return reservation_floor(self.target, self.efficiency)

  def may_offload(self) -> bool:
    return not self.target_profile.unified

  def plan(self, graph: Graph, aim: int, start: Plan | None = None) -> Candidate:
    """Swaps toward ``aim`` bytes on top of ``start`` (e.g. a
    recomputation plan, when LGM is the hybrid's swap step)."""
    began = time.perf_counter()
    with paused_gc():
      result = self._plan(graph, aim, start or Plan())
    result.seconds = time.perf_counter() - began
    return result

  def _plan(self, graph, aim, plan) -> Candidate:
    profile = self.target_profile
    ceiling = int(aim * (1 - self.reserve))
    fused_onto = riders(graph)
    schedule, memory = evaluate(graph, plan)
    names = op_layers(schedule)
    report = LayerReport(list(dict.fromkeys(names)), demand(memory, names), {}, ceiling,
                         [], self.floor)
    steps = 0
    while memory.peak > ceiling and not profile.unified:
      # The layer with the largest demand holds the step's peak.
      peak = _Peak(schedule, memory, memory.peak_op, memory.peak - ceiling,
                   op_layers(schedule)[memory.peak_op], profile, schedule_costs(schedule))
      found = self._step(graph, plan, peak, fused_onto)
      if found is None:
        break  # nothing lowers the peak: it is not one swapping can lower
      (plan, schedule, memory), moves = found
      report.records.extend(dataclasses.replace(record, peak=steps)
                            for _, _, record in moves)
      steps += 1
    report.demand_after = demand(memory, op_layers(schedule))
    return Candidate(plan, schedule, memory, aim, memory.peak <= aim, 0.0, steps,
                     report)

  def _step(self, graph, plan, peak: _Peak, fused_onto: dict):
    """Covers one peak: ``((plan, schedule, memory), moves)`` with the moves
    taken, or None where no swap lowers it. vTensors first; where their
    merges make a new peak as high (a merge holds the chunks and the joined
    copy at once), whole tensors."""
    for whole in dict.fromkeys((self.whole, True)):
      moves = self._cover(graph, plan, peak, whole)
      trial = _applied(plan, moves)
      for vid, _, _ in moves:
        # Residuals XLA computes from this buffer inside their readers
        # would keep it on the device: they are rebuilt from its copy.
        for rider in fused_onto.get(vid, ()):
          if trial[rider].kind == "keep":
            trial = trial.with_decision(rider, RECOMPUTE)
      t_schedule, t_memory = evaluate(graph, trial)
      if moves and t_memory.peak < peak.memory.peak and (
          self.host_budget is None or t_memory.host_peak <= self.host_budget):
        return (trial, t_schedule, t_memory), moves
    return None

  def _cover(self, graph, plan, peak: _Peak, whole: bool) -> list:
    """The swaps that cover ``peak``: a list of (value id, decision,
    :class:`SwapRecord`).

    Two passes over the candidates, the most room first: the first swaps
    only the chunks whose copies back the compute before their reader hides
    (a tensor gives as many chunks as its window carries; whole, only a
    tensor whose whole copy hides), the second whatever is still needed.
    """
    moves, left = self._delay(graph, plan, peak)
    plan = _applied(plan, moves)
    found = self._candidates(graph, plan, peak)
    units, cuts = self._units(graph, plan, found, whole)
    picked: dict = {}  # vid -> [(chunk index or None, bytes)], in pick order
    order: dict = {}  # vid -> when it was last picked from
    count = 0
    for hidden in (True, False):
      for vid, room in found:
        window = room
        while left > 0 and units[vid]:
          index, nbytes = units[vid][0]
          seconds = peak.profile.transfer_seconds(nbytes, "h2d")
          if hidden and seconds > window:
            break
          window -= seconds
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
        moves.append((vid, Offload(at=peak.copy_back(r)), peak.record(r, 1, 1, freed)))
        continue
      axis, bounds = cuts[vid]
      swapped = {i for i, _ in chunks} | set(() if fresh else plan[vid].offloaded)
      decision = self._chunked(peak, r, axis, bounds, swapped,
                               None if fresh else plan[vid])
      moves.append((vid, decision, peak.record(r, len(bounds), len(chunks), freed)))
    return moves

  def _units(self, graph, plan, found, whole: bool) -> tuple[dict, dict]:
    """What each candidate can still swap: value id -> [(chunk index, or
    None for the whole tensor, bytes)] not swapped yet, and value id ->
    (axis, bounds) of the vTensors among them."""
    units: dict = {}
    cuts: dict = {}
    for vid, _ in found:
      value = graph.values[vid]
      current = plan[vid]
      if isinstance(current, Chunked):
        cuts[vid] = (current.axis, current.bounds)
        sizes = current.chunk_bytes(value.aval.shape, value.nbytes)
        units[vid] = [(i, sizes[i]) for i, d in enumerate(current.chunks)
                      if d.kind == "keep"]
        continue
      n, axis = (1, 0) if whole else self._split(graph, vid)
      if n == 1:
        units[vid] = [(None, value.nbytes)]
        continue
      length = value.aval.shape[axis]
      cuts[vid] = (axis, tuple((length * i // n, length * (i + 1) // n) for i in range(n)))
      sizes = Chunked(axis, cuts[vid][1], (KEEP,) * n).chunk_bytes(value.aval.shape,
                                                                 value.nbytes)
      units[vid] = list(enumerate(sizes))
    return units, cuts

  def _delay(self, graph, plan, peak: _Peak) -> tuple[list, int]:
    """Copies back issued before the peak whose reader comes after it: each
    is issued again after the peak (the prefetch order follows the peaks),
    which frees its bytes there without moving anything more. Returns the
    moves and the deficit left."""
    schedule = peak.schedule
    moves, left = [], peak.deficit
    first_read = schedule.first_reads()
    made = {op.outs[0]: pos for pos, op in enumerate(schedule.ops) if op.kind == "prefetch"}
    for key in peak.memory.live_at_peak:
      unit = schedule.fetched.get(key)
      if unit is None or left <= 0 or unit in graph.hosted or made[key] > peak.at or \
          first_read.get(key, peak.at) <= peak.at:
        continue
      vid = unit if isinstance(unit, int) else unit[0]
      r, nbytes = graph.residual(vid), schedule.nbytes(key)
      at = peak.copy_back(r)
      current = plan[vid]
      if isinstance(unit, int):
        decision = Offload(at=at)
      else:
        chunks = list(current.chunks)
        chunks[unit[1]] = Offload(at=at)
        decision = dataclasses.replace(current, chunks=tuple(chunks))
      plan = plan.with_decision(vid, decision)
      cut = 1 if isinstance(unit, int) else len(current.bounds)
      moves.append((vid, decision, peak.record(r, cut, 0, nbytes, delayed=True)))
      left -= nbytes
    return moves, left

  def _candidates(self, graph, plan, peak: _Peak) -> list[tuple[int, float]]:
    """Residuals whose buffers (a vTensor: its kept chunks) are live and idle
    at the peak, with the predicted compute seconds between the peak and
    their first backward reader; the most room first."""
    elapsed = [0.0]
    for c in peak.costs:
      elapsed.append(elapsed[-1] + c.seconds(peak.profile))
    fused = fused_values(graph)
    ops = peak.schedule.ops
    position, chunk_of = {}, {}
    for pos, op in enumerate(ops):
      if op.kind == "node":
        position.setdefault(op.node, pos)
      elif op.kind == "split":
        chunk_of.update((key, op.ins[0]) for key in op.outs)
    found = {}
    for key in peak.memory.live_at_peak:
      key = chunk_of.get(key, key)  # a kept chunk stands for its vTensor
      vid = key[0]
      if key[1] != 0 or not graph.is_residual(vid) or vid in fused or \
          vid in graph.output_ids or vid in found:
        continue
      if plan[vid].kind not in ("keep", "chunked"):
        continue
      r = graph.residual(vid)
      reads = peak.memory.reads.get(key, [])
      if any(p > peak.at and not graph.nodes[ops[p].node].backward
             for p in reads if ops[p].kind == "node"):
        continue  # the forward pass still reads it after the peak
      first = position.get(r.first_backward_use)
      if first is None or first <= peak.at:
        continue
      found[vid] = elapsed[first] - elapsed[peak.at + 1]
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

  def _chunked(self, peak: _Peak, residual, axis, bounds, offloaded,
               decided=None) -> Chunked:
    """The :class:`Chunked` decision with chunks ``offloaded`` swapped, each
    copied back at its own point (later chunks of the queue earlier), none
    before the peak they cover; chunks already swapped in ``decided`` keep
    their points."""
    row = residual.nbytes // peak.schedule.graph.values[residual.value].aval.shape[axis]
    chunks, queued = [], 0
    for i in range(len(bounds)):
      if i in offloaded:
        queued += (bounds[i][1] - bounds[i][0]) * row
        if decided is not None and decided.chunks[i].kind == "offload":
          chunks.append(decided.chunks[i])
        else:
          chunks.append(Offload(at=peak.copy_back(residual, queued)))
      else:
        chunks.append(KEEP)
    return Chunked(axis, tuple(bounds), tuple(chunks))


def _applied(plan: Plan, moves) -> Plan:
  for vid, decision, _ in moves:
    plan = plan.with_decision(vid, decision)
  return plan
