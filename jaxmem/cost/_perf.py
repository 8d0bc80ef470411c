"""Performance model (UDNN's): predicted step time of a schedule on a device.

Each op of a schedule takes its roofline time on the profile (FLOPs against
throughput, bytes read and written against memory bandwidth; views and
barriers are free). Copies between device and host run on two more streams,
one each way, in the order they are issued: a copy starts when its stream is
free and its value exists, and an op that needs a prefetched value waits
until the copy is done (``ready <= start``; the wait is a *stall*). Where
the target's compiler waits for each copy where it issues it
(``DeviceProfile.copies_wait``, XLA:GPU's default schedule), the compute
stream waits there for the copy, one copy after another: the whole copy is
a stall. The step time is when the last op or copy finishes.

Example:
  >>> from jaxmem.targets._profiles import get_profile
  >>> ops = [OpCost("a", 1e9, 0), OpCost("b", 1e9, 0)]
  >>> t = predict(ops, [], get_profile("t4"))
  >>> round(t.seconds * 1e3, 3), t.stall
  (0.246, 0.0)
  >>> import dataclasses
  >>> copy = [Transfer("d2h", 2**20, 0)]  # 1 MiB down after op a: 97 us at 12 GB/s
  >>> round(predict(ops, copy, get_profile("t4")).seconds * 1e3, 3)
  0.246
  >>> waits = dataclasses.replace(get_profile("t4"), copies_wait=True)
  >>> round(predict(ops, copy, waits).seconds * 1e3, 3), round(predict(ops, copy, waits).stall * 1e6)
  (0.343, 97)
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxmem.cost._xla_clock import occupancy, program_time, roofline_seconds
from jaxmem.graph import _primitives
from jaxmem.graph._graph import Graph, analysis
from jaxmem.targets._profiles import DeviceProfile


# Primitives whose FLOPs run at the profile's matmul throughput.
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})


@dataclasses.dataclass(frozen=True)
class OpCost:
  """One op on the compute stream: a label, its FLOPs and the bytes it
  moves; whether its FLOPs are a matrix product's or a convolution's (they
  run at the profile's matmul throughput), whether it ends a kernel (it
  pays the profile's kernel latency), the bytes a collective moves
  between devices (on the profile's interconnect), and the library call
  the target's compiler runs it as (a custom call's target; ``""`` for
  XLA's own kernels, or where the program is not known) and the elements
  it writes (what a library call splits its work over)."""
  label: str
  flops: float
  nbytes: int
  matmul: bool = False
  launch: bool = False
  exchanged: int = 0
  library: str = ""
  outputs: int = 0

  def seconds(self, profile: DeviceProfile) -> float:
    """Its roofline time on ``profile`` (a library call's as the clock
    gives it: :func:`~jaxmem.cost._xla_clock.roofline_seconds` at its
    :func:`~jaxmem.cost._xla_clock.occupancy`)."""
    rate = profile.matmul_throughput if self.matmul else profile.flops
    rate *= occupancy(self.library, self.outputs, profile)
    return (roofline_seconds(self.library, self.flops / rate,
                             self.nbytes / profile.memory_bandwidth,
                             profile.collective_seconds(self.exchanged))
            + (profile.kernel_latency if self.launch else 0.0))


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One copy between device and host.

  Attributes:
    direction: ``"d2h"`` (offload) or ``"h2d"`` (prefetch).
    nbytes: bytes copied.
    issue: index of the op after which the copy may start (its value exists,
      or the plan's prefetch point is reached); -1 for the step's start.
    need: index of the op that must wait for the copy: the reader of its
      result, or the op after a loop that copies per iteration; None if
      nothing waits (an offload, which only frees memory).
  """
  direction: str
  nbytes: int
  issue: int
  need: int | None = None


@dataclasses.dataclass
class Timing:
  """A predicted step: total seconds, the part spent computing, the time
  ops waited for copies, and each copy's (start, end)."""
  seconds: float
  compute: float
  stall: float
  transfers: list
  op_end: list


def predict(ops: list[OpCost], transfers: list[Transfer],
            profile: DeviceProfile, scale: float = 1.0, seconds: list | None = None) -> Timing:
  """Simulates the compute stream and the two copy streams; see the module
  docstring. ``scale`` multiplies every op's time (not the copies');
  ``seconds``: each op's own time on ``profile``, where known."""
  own = [op.seconds(profile) for op in ops] if seconds is None else seconds
  durations = [t * scale for t in own]
  if not transfers:  # the compute stream alone: one op after another
    op_end = list(itertools.accumulate(durations))
    return Timing(op_end[-1] if op_end else 0.0, sum(durations), 0.0, [], op_end)
  by_issue: dict[int, list[int]] = {}
  for i, t in enumerate(transfers):
    if t.need is not None and t.need <= t.issue:
      raise ValueError(f"transfer {i} is needed at op {t.need} but issued after op "
                       f"{t.issue}; a copy must be issued before the op that reads it")
    by_issue.setdefault(t.issue, []).append(i)
  waits: dict[int, list[int]] = {}
  for i, t in enumerate(transfers):
    if t.need is not None:
      waits.setdefault(t.need, []).append(i)
  stream_free = {"d2h": 0.0, "h2d": 0.0}
  span: list = [None] * len(transfers)

  def issue(after: int, now: float) -> float:
    """Starts the copies issued after op ``after`` at ``now``; returns when
    the compute stream goes on: at once, or where copies wait, when the
    last of them ends."""
    for i in by_issue.get(after, ()):
      t = transfers[i]
      start = max(now, stream_free[t.direction])
      end = start + profile.transfer_seconds(t.nbytes, t.direction)
      stream_free[t.direction] = end
      span[i] = (start, end)
      if profile.copies_wait:
        now = end
    return now

  clock = stall = issue(-1, 0.0)
  op_end = []
  for pos, seconds in enumerate(durations):
    ready = max((span[i][1] for i in waits.get(pos, ())), default=0.0)
    if ready > clock:
      stall += ready - clock
      clock = ready
    clock += seconds
    op_end.append(clock)
    went_on = issue(pos, clock)
    stall, clock = stall + went_on - clock, went_on
  end = max([clock] + [s[1] for s in span if s is not None])
  return Timing(end, sum(durations), stall, span, op_end)


# A barrier's cost: it runs no kernel.
_BARRIER = OpCost("optimization_barrier", 0.0, 0)


def _buffered(graph: Graph):
  """Whether a value id gets a buffer of its own: every value, or where the
  graph carries its target compiler's buffers, those it materializes."""
  buffers = graph.buffers
  return (lambda v: True) if buffers is None else (lambda v: v in buffers.materialized)


@analysis
def node_costs(graph: Graph) -> tuple[OpCost, ...]:
  """Each equation's cost as an op of a schedule that reads and writes its
  values whole (what every op running it does but where a vTensor's chunk
  is read): its FLOPs, and the bytes of the values it reads and writes that
  have a buffer of their own (see :func:`schedule_costs`)."""
  buffers, moves = graph.buffers, _buffered(graph)
  costs = []
  for node in graph.nodes:
    name = node.prim.name
    if _primitives.is_free(name):
      costs.append(OpCost(name, 0.0, 0))
      continue
    outs = sum(graph.values[v].nbytes for v in node.outs)
    moved = (sum(graph.values[a].nbytes for a in node.ins if isinstance(a, int) and moves(a))
             + sum(graph.values[v].nbytes for v in node.outs if moves(v)))
    library = "" if buffers is None else buffers.library.get(node.index, "")
    costs.append(OpCost(name, node.flops, moved, matmul=name in _MATMULS,
                        launch=buffers is not None and node.index in buffers.launches,
                        exchanged=outs if _primitives.communicates(name) else 0,
                        library=library,
                        outputs=sum(graph.values[v].aval.size for v in node.outs)
                        if library else 0))
  return tuple(costs)


def schedule_costs(schedule) -> list[OpCost]:
  """The compute-stream costs of a rewritten step's ops (``_schedule``):
  node FLOPs, and bytes read and written; views and barriers cost nothing.
  Where the graph carries the buffers its target's compiler gives it
  (``Graph.buffers``, learned from XLA:GPU's program), an op moves only the
  values that have a buffer (the rest live inside the kernel that reads
  them) and ends a kernel where its node ended one in that program; else
  every op is a kernel that reads and writes all its values."""
  graph, sizes = schedule.graph, schedule.sizes
  own, buffered = node_costs(graph), _buffered(graph)

  def moved(op) -> int:
    return (sum(schedule.nbytes(k) for k in op.ins if isinstance(k, tuple) and buffered(k[0]))
            + sum(schedule.nbytes(k) for k in op.outs if buffered(k[0])))

  costs = []
  for op in schedule.ops:
    if op.kind in ("split", "merge"):  # a vTensor's chunks copied out / in
      costs.append(OpCost(op.kind, 0.0, moved(op)))
    elif op.node is None:
      costs.append(_BARRIER)
    elif sizes and any(k in sizes for k in op.ins + op.outs if isinstance(k, tuple)):
      cost = own[op.node]  # reads or writes a chunk: its own bytes
      costs.append(cost if not cost.nbytes else dataclasses.replace(cost, nbytes=moved(op)))
    else:
      costs.append(own[op.node])
  return costs


def schedule_transfers(schedule) -> list[Transfer]:
  """The copies of a rewritten step: each offload starts where it is
  issued (right after its value is made); each copy back is issued at its
  op and needed by the first op that reads the copy. A loop that stacks
  slices in host memory, or reads them from there, copies one slice per
  iteration beside its compute: its copies start with it and the op after
  it waits for them (the loop takes the longer of the two)."""
  first_read = (schedule.first_reads() if any(op.kind == "prefetch" for op in schedule.ops)
                else {})
  transfers = []
  last = len(schedule.ops) - 1
  for pos, op in enumerate(schedule.ops):
    for direction, keys in (("d2h", op.outs), ("h2d", op.ins)) if schedule.hosted else ():
      looped = sum(schedule.nbytes(k) for k in {k for k in keys if isinstance(k, tuple)}
                   if k in schedule.hosted)
      if looped and op.kind == "node":
        transfers.append(Transfer(direction, looped, pos - 1, pos + 1 if pos < last else None))
    if op.kind in ("offload", "prefetch"):
      nbytes = schedule.nbytes(op.outs[0])
      need = first_read.get(op.outs[0]) if op.kind == "prefetch" else None
      transfers.append(Transfer("d2h" if op.kind == "offload" else "h2d", nbytes,
                                pos, need))
  return transfers


def timed(graph: Graph, compiled, profile: DeviceProfile | None) -> Graph:
  """``graph``, which carries the buffers the program ``compiled`` (its step
  as written, tagged) gives it, with its op times scaled so that the step
  as written takes the clock's time for ``compiled`` on ``profile``
  (``Buffers.time_scale``); as it is without a profile."""
  if profile is None:
    return graph
  clock = program_time(compiled.as_text(), profile).seconds
  model = sum(node_seconds(graph, profile))
  scale = clock / model if clock > 0 and model > 0 else 1.0
  return dataclasses.replace(graph, buffers=dataclasses.replace(graph.buffers, time_scale=scale))


@analysis
def node_seconds(graph: Graph, profile: DeviceProfile) -> tuple[float, ...]:
  """Each equation's time on ``profile`` as an op of a schedule that runs
  it whole (:func:`node_costs`), unscaled."""
  return tuple(op.seconds(profile) for op in node_costs(graph))


def rerun_seconds(graph: Graph, profile: DeviceProfile) -> tuple[float, ...]:
  """What running each equation of ``graph`` once more adds to a schedule's
  predicted time on ``profile`` where no copy waits on it (a recomputed
  op's, as :func:`predict_schedule` prices it: its node's cost, scaled as
  every op is)."""
  scale = _time_scale(graph)
  return tuple(t * scale for t in node_seconds(graph, profile))


def _time_scale(graph: Graph) -> float:
  """What every op's time is scaled by: the target compiler's program's
  clock over the model's (``Buffers.time_scale``), or 1."""
  return 1.0 if graph.buffers is None else graph.buffers.time_scale


def predict_schedule(schedule, profile: DeviceProfile) -> Timing:
  """Predicted time of a schedule on ``profile``: its ops (recomputation
  included), scaled to the target compiler's program where the graph
  carries its buffers (``Buffers.time_scale``), and its copies to and from
  the host."""
  graph, costs = schedule.graph, schedule_costs(schedule)
  own, known = node_costs(graph), node_seconds(graph, profile)
  # Most ops run their node whole: its time is known once per graph.
  seconds = [known[op.node] if op.node is not None and cost is own[op.node]
             else cost.seconds(profile) for op, cost in zip(schedule.ops, costs)]
  return predict(costs, schedule_transfers(schedule), profile, _time_scale(graph), seconds)
