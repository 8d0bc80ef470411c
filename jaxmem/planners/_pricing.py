"""The exact planner's coefficients, priced as the program needs them.

A choice's column (what it adds to the live bytes at each equation) and its
cost are exact when the memory model has evaluated the plan that takes it,
one whole-schedule evaluation each. Most choices are never taken at a given
budget, so a :class:`Table` starts from an *optimistic* estimate of every
column, read off the reference plan's memory model at no evaluation: each
residual the choice recomputes frees its whole buffer from its making to
its first backward read, or to its last where XLA may compute the rebuilt
copy inside its readers (no transient bytes), but for the values the
rebuild reads (it reads them through a barrier, as buffers, and no sooner
than the first backward read of what it rebuilds: up to there they stay,
and those the step as written frees sooner are charged), and the choice
costs what running again the equations that rebuild its residuals adds to
the planner's cost (their FLOPs, or on a target their predicted time, as a
plan's is priced; no copies, no barriers). On a T4 a rebuild's time is
mostly memory traffic, which its FLOPs leave out: GPT-2's first plan at
70% of its peak on XLA:CPU's emulated fusion, costed for a T4, takes 0.7
s, against 7.7 s with estimates costed by FLOPs
(``benchmarks/results/planning-costs-by-time-t4``). On the zoo's GPT-2 (its
default size) at 70% of its peak, charging what the rebuild reads takes
pricing from 220 choices (all) to 75. The planner solves over the
estimates, prices the choices its solution takes that are still estimated
(:meth:`Table.price`), and solves again until every choice it takes is
exact. Where the memory model puts a
solution's plan over the aim, the choices whose guesses (below) differ
from their estimates where it goes over are priced first, alone
(:meth:`Table.suspects`): on the zoo's ViT, a second plan at 70% of its
peak then prices 9 choices of 44.

Beside each estimate, the table keeps a *guess* of the column (what the
memory model likely gives it: buffers that forward equations read as
buffers whatever the plan are held through them, backward reads of values
the plan keeps hold theirs, and the values the rebuild reads live on to it).
A guess bounds nothing, but a plan found on guesses and judged whole can be
taken unpriced where its cost is within the planner's gap of the bound the
estimates prove (``ILP.guess_gap``): on the zoo's GPT-2 at 80% of its peak,
0.1 s with 17 choices priced, where pricing what solutions take over
estimates alone takes 3.2 s and prices 81.

Why this finds the optimum of the program over exact columns: a column that
frees at least the bytes the exact one frees at every equation and costs no
more makes the program over estimates a relaxation of the exact one; its
optimum costs no more than the exact optimum, and once every choice it takes
is exact that optimum is a plan of the exact program, optimal there too,
and its bound a bound there. The estimate is such a column at every forward
equation; in the backward pass XLA's fusion (emulated by the memory model)
can free a few more bytes at an equation that reads the rebuilt values (on
the zoo's GPT-2, at 1-9 of its 2,600 equations for a fifth of the choices),
so the lazy optimum can differ from the fully priced one where such an
equation binds. On buffers learned from a GPU compiler's program a rebuild
may also move backward equations, and an estimate may free much less than
the exact column where it does (GPT-2 for a T4 at 70%: rebuilding ``ln_f``
frees 2 MiB at the loss head's gradient, estimated 0.25 MiB), so a bound
over estimates proves nothing: there every column is priced first (a plan
taken on estimates predicts 0.8-1.2% slower than the optimum on GPT-2,
ViT and MobileNetV2 at 70%; a plan runs every step, planning once).
Where the program over estimates has no solution, every
column is priced before the planner gives up on it, and once the programs
have taken as long as pricing the rest would (:meth:`Table.lazy`), every column
is: at worst, planning costs about twice what pricing every choice first
costs.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxmem.graph import _primitives as primitives
from jaxmem._decisions import RECOMPUTE, Plan
from jaxmem.cost._evaluate import candidate, fused_values
from jaxmem.graph._graph import Graph
from jaxmem.cost._memory import Liveness, fusion_of
from jaxmem.planners import _alike as alike
from jaxmem.planners._choices import Drop, levels, plan_of
from jaxmem.graph._xla_cpu_fusion import readable


@dataclasses.dataclass
class Table:
  """The program's coefficients for one graph.

  Attributes:
    choices: the choices, one variable each.
    base: live bytes at each row (an equation; see :func:`levels`) of the
      step as written.
    delta: what each choice adds to each row (rows x choices), on top of
      the reference plan.
    cost: what each choice adds to the plan's cost.
    exact: per choice, whether its column and cost come from the memory
      model (else they are the optimistic estimate).
    guess: each choice's likely column (rows x choices): the exact one
      where priced, else read off the reference plan with what the
      estimate leaves out (buffers the forward pass reads whatever the
      plan, backward reads of values kept, what the rebuild reads); it
      may lie above or below the exact column, so it bounds nothing.
    moved: per choice, whether its column and cost (and guess) are those
      of the same choice in an alike layer, moved to its own
      (:mod:`~jaxmem.planners._alike`) and not yet priced: near the exact
      ones, but no bound either way.
    overhead: what any recomputation adds to each row (the reference plan
      against the step as written); ``overhead_cost`` likewise.
    base_cost: the cost of the step as written.
    exclusive: groups of choices at most one of which is taken.
    reference: the residuals the reference plan recomputes.
    priced: the memory model evaluations spent on columns so far.
    seconds: the time they took.
    rows: the node index of each row (``-1``: after the last equation).
  """
  choices: list
  base: np.ndarray
  delta: np.ndarray
  cost: np.ndarray
  exact: np.ndarray
  overhead: np.ndarray
  overhead_cost: float
  base_cost: float
  exclusive: list
  reference: tuple
  priced: int = 0
  seconds: float = 0.0
  rows: list = dataclasses.field(default_factory=list, repr=False)
  guess: np.ndarray | None = dataclasses.field(default=None, repr=False)
  moved: np.ndarray | None = dataclasses.field(default=None, repr=False)
  # How to price: the graph, the planner's cost of a schedule, and the
  # reference plan's rows and cost.
  _graph: Graph | None = dataclasses.field(default=None, repr=False)
  _cost_of: object = dataclasses.field(default=None, repr=False)
  _reference_rows: dict = dataclasses.field(default_factory=dict, repr=False)
  # Per priced choice, the equations its plan runs again (the reference's
  # included): where a rebuild reaches, which moving a column needs.
  _reruns: dict = dataclasses.field(default_factory=dict, repr=False)
  _reference_cost: float = 0.0

  def plan(self, graph: Graph, chosen) -> Plan:
    """The plan of the choices at indices ``chosen``, with the reference
    drop the overhead was measured with where any is taken."""
    choices = [self.choices[i] for i in chosen]
    if choices:
      choices.append(Drop(self.reference))
    return plan_of(graph, choices)

  def price(self, chosen) -> int:
    """Makes the columns of ``chosen`` exact (one memory model evaluation
    each not yet priced); returns how many it priced."""
    todo = [i for i in chosen if not self.exact[i]]
    began = time.perf_counter()
    for i in todo:
      self.delta[:, i], self.cost[i], self._reruns[self.choices[i]] = (
          self._evaluated(self.choices[i]))
      self.guess[:, i] = self.delta[:, i]
      self.exact[i] = True
      self.moved[i] = False
    self.priced += len(todo)
    self.seconds += time.perf_counter() - began
    return len(todo)

  def suspects(self, chosen, memory: Liveness, aim: int) -> list:
    """The choices of ``chosen`` still estimated whose guess differs from
    their estimate at a row where ``memory`` (their plan's, evaluated
    whole) exceeds ``aim``: those whose estimates likely miss the bytes
    that put the plan over."""
    found = levels(memory)
    over = np.array([found.get(k, 0) > aim for k in self.rows])
    return [i for i in chosen
            if not self.exact[i] and (self.guess[over, i] != self.delta[over, i]).any()]

  def lazy(self, spent: float) -> bool:
    """Whether the next pricing is of the choices a solution took alone,
    else of every choice left: lazy until the programs solved (``spent``
    seconds) have cost what pricing the rest would (a rent-or-buy rule:
    never more than twice the better of the two). On the zoo's GPT-2 at
    60% of its peak, each program takes 0.1-0.4 s and most price 2-3
    choices of 20 ms each."""
    rest = self.rest_seconds()
    return rest is None or spent < rest

  def rest_seconds(self) -> float | None:
    """What pricing every choice not yet priced would take, at the time
    each has taken so far (None before any is priced)."""
    if not self.priced:
      return None
    return self.seconds / self.priced * (len(self.choices) - int(self.exact.sum()))

  def _evaluated(self, choice) -> tuple[np.ndarray, float, frozenset]:
    """A choice's exact column and cost: the plan that takes it alone (on
    top of the reference) against the reference; and the equations that
    plan runs again."""
    decisions = {v: RECOMPUTE for v in self.reference}
    decisions.update(plan_of(self._graph, [choice]).as_dict())
    memory = candidate(self._graph, Plan.of(decisions)).memory
    found = levels(memory)
    column = np.array([found.get(k, 0) - self._reference_rows.get(k, 0) for k in self.rows],
                      dtype=float)
    reruns = frozenset(op.node for op in memory.schedule.ops if op.kind == "recompute")
    return column, self._cost_of(memory.schedule) - self._reference_cost, reruns


def build(graph: Graph, choices: list, plans: list, base: Liveness, reference: tuple,
          cost_of, rerun: tuple, exclusive: list, lazy: bool) -> Table:
  """The table of ``choices`` (whose plans alone are ``plans``), against
  the step as written (``base``) and the plan that recomputes
  ``reference``, a schedule costing ``cost_of`` it and running an equation
  again ``rerun`` its index: estimated columns where ``lazy`` and the
  memory model emulates XLA:CPU's fusion, else every one priced.
  Choices whose estimate frees nothing anywhere are left out (their exact
  column frees nothing either)."""
  rows = levels(base)
  keys = list(rows)
  ref = candidate(graph, Plan.of({v: RECOMPUTE for v in reference})).memory
  ref_rows = levels(ref)
  estimate = _Estimator(graph, ref, {k: i for i, k in enumerate(keys)}, reference, rerun)
  columns, guesses, costs, kept = [], [], [], []
  for i, plan in enumerate(plans):
    column, guess, cost = estimate(plan)
    if column.min() < 0:
      kept.append(i)
      columns.append(column)
      guesses.append(guess)
      costs.append(cost)
  ref_cost, base_cost = cost_of(ref.schedule), cost_of(base.schedule)
  table = Table(
      [choices[i] for i in kept], np.array([rows[k] for k in keys], dtype=float),
      np.array(columns, dtype=float).T.reshape(len(keys), len(kept)),
      np.array(costs, dtype=float), np.zeros(len(kept), dtype=bool),
      np.array([ref_rows.get(k, 0) - rows[k] for k in keys], dtype=float),
      ref_cost - base_cost, base_cost, exclusive([choices[i] for i in kept]), reference,
      _graph=graph, _cost_of=cost_of, rows=keys, _reference_rows=ref_rows,
      _reference_cost=ref_cost,
      guess=np.array(guesses, dtype=float).T.reshape(len(keys), len(kept)),
      moved=np.zeros(len(kept), dtype=bool))
  # On buffers learned from a GPU compiler's program estimates bound
  # nothing (see the module docstring): every column is priced, but where
  # ``lazy`` those of layers alike to two priced, which are moved.
  if not lazy or graph.buffers is not None:
    stacks = alike.groups(graph, table.choices) if lazy else []
    inner = {i for stack in stacks for _, i in alike.targets(stack)}
    table.price([i for i in range(len(kept)) if i not in inner])
    rerun = frozenset(op.node for op in ref.schedule.ops if op.kind == "recompute")
    for stack in stacks:
      _move(table, stack, rerun)
    freeing = [i for i in range(len(kept)) if table.delta[:, i].min() < 0]
    table = _only(table, freeing, exclusive)
  return table


def _move(table: Table, stack: tuple, reference: frozenset) -> None:
  """The priced column and cost of the second choice of ``stack`` (the same
  choice in alike layers) moved to the stack's :func:`alike.targets`
  (:func:`alike.moved`) where its rebuild runs again only its own layer's
  equations beyond the ``reference`` plan's, else those priced."""
  graph, source = table._graph, stack[1]
  choice, inner = table.choices[source], alike.targets(stack)
  if not alike.inside(graph, choice, table._reruns[choice] - reference):
    table.price([i for _, i in inner])
    return
  layers = alike.homes(graph, table.choices, stack)
  for target, i in inner:
    column = alike.moved(graph, table.rows, table.delta[:, source], layers, 1, target)
    if column is None:
      table.price([i])
      continue
    table.delta[:, i] = table.guess[:, i] = column
    table.cost[i] = table.cost[source]
    table.moved[i] = True


def _only(table: Table, kept: list, exclusive) -> Table:
  """``table`` with the choices at indices ``kept`` alone."""
  choices = [table.choices[i] for i in kept]
  return dataclasses.replace(
      table, choices=choices, delta=table.delta[:, kept], guess=table.guess[:, kept],
      cost=table.cost[kept], exact=table.exact[kept], moved=table.moved[kept],
      exclusive=exclusive(choices))


class _Estimator:
  """Optimistic columns read off the reference plan's memory model, and
  costs from ``rerun`` (what running each equation again costs)."""

  def __init__(self, graph: Graph, ref: Liveness, row_of_node: dict, reference: tuple,
               rerun: tuple):
    self.graph, self.ref, self.reference, self.rerun_cost = graph, ref, reference, rerun
    self.fused = fused_values(graph)
    self.fusion = fusion_of(ref.schedule)
    # Equations the reference plan runs again already (its drop, and the
    # values XLA would compute inside backward readers from a bias add):
    # a choice's cost is counted on top of them.
    self.rerun = {op.node for op in ref.schedule.ops if op.kind == "recompute"}
    ops = ref.schedule.ops
    self.backward = [op.kind != "node" or graph.nodes[op.node].backward for op in ops]
    # The row each op counts at: the next equation's (see ``levels``).
    self.row_at = np.empty(len(ops), dtype=int)
    pending = []
    for pos, op in enumerate(ops):
      pending.append(pos)
      if op.kind == "node":
        self.row_at[pending] = row_of_node[op.node]
        pending = []
    self.row_at[pending] = row_of_node[-1]
    self.rows = len(row_of_node)
    self.producer_at = {k: pos for pos, op in enumerate(ops) for k in op.outs}
    self.kept = set(ref.schedule.inputs) | {k for k in ref.schedule.outputs
                                            if isinstance(k, tuple)}
    # Value -> the first backward op that reads it (any copy).
    self.first_need: dict = {}
    for pos in reversed(range(len(ops))):
      if self.backward[pos]:
        self.first_need.update((k[0], pos) for k in ops[pos].ins if isinstance(k, tuple))
    # Buffer -> (position, value read, whether computed from the buffer
    # inside the reader) of each backward read.
    self.reads_of: dict = {}
    for pos, op in enumerate(ops):
      if self.backward[pos]:
        for key in op.ins:
          if isinstance(key, tuple):
            for buf in self._read_as(key):
              self.reads_of.setdefault(buf, []).append((pos, key[0], key in ref.fused))

  def __call__(self, plan: Plan) -> tuple[np.ndarray, np.ndarray, float]:
    """The column of ``plan`` (one choice's) at its most, its likely
    column, and its cost.

    At its most, each buffer it may free (:meth:`_buffers`) is freed from
    its making to its first backward read (its last, where the copy may
    be fused), and the buffers the rebuild reads are held from their
    making up to the first backward read of what it rebuilds (counted on
    whole rows only, where each op of the row holds them). Likely, a
    buffer is freed only after the forward ops that read it as a buffer
    under any plan (:meth:`_freed_from`) and the backward ops that read it
    for values the plan keeps, a transcendental's copy read by more than
    one backward op is held from the first (:meth:`_free`), and the values
    the rebuild reads live on to its first backward read. The cost is what
    running the equations that rebuild its residuals from the values the
    backward pass may read (as the schedule builder rebuilds them) once
    each costs (``rerun``)."""
    rebuilt = plan.values_with("recompute")
    dropped = rebuilt | set(self.reference)
    run, sources = self._rebuilt_by(rebuilt, dropped, plan.values_with("save"))
    most, likely = np.zeros(self.rows), np.zeros(self.rows)
    # The rebuild reads its sources through a barrier, as buffers, no
    # sooner than the first backward read of what it rebuilds: up to there
    # a source's buffer stays (its copy may die sooner after).
    rebuilds = self._first_read(rebuilt)
    read = {self.ref.root.get((v, 0), (v, 0)) for v in sources - dropped}
    for buf in self._buffers(rebuilt):
      # From the producer on: a residual read again only where it is
      # rebuilt may fuse into its forward readers and get no buffer.
      start = self.producer_at[buf]
      self._free(most, buf, max(start, rebuilds) if buf in read else start)
    for buf in read - self.kept - self.ref.in_outputs:
      # A source the reference frees before the rebuild lives on to it.
      if buf in self.producer_at:
        most[self._whole_rows(self._last_read(buf) + 1, rebuilds)] += self.ref.schedule.nbytes(buf)
    # Backward reads of values the rebuild makes on the way are redirected
    # to its copies (the schedule builder reuses them within the block).
    remade = dropped | {v for n in run for v in self.graph.nodes[n].outs}
    # A buffer the rebuild reads is not freed, though a dropped value XLA
    # computes inside its readers reads it too (saved attention scores).
    held = self._buffers(sources)
    freed = {b for b in self._buffers(remade - set(self.reference))
             if b not in self.ref.in_outputs} - held  # those cost nothing as written
    first = min((p for b in freed for p in self.ref.reads.get(b, ()) if self.backward[p]),
                default=None)
    for buf in held if first is not None else ():
      likely[np.unique(self.row_at[self._last_read(buf) + 1:first])] += \
          self.ref.schedule.nbytes(buf)
    for buf in freed:
      self._free(likely, buf, max(self._freed_from(buf), self._held_back(buf, remade) + 1),
                 likely=True)
    return most, likely, float(sum(self.rerun_cost[n] for n in run - self.rerun))

  def _first_read(self, values) -> int:
    """The first backward op of the reference plan that reads ``values``
    (any copy) or a buffer of theirs (their own, or those they are computed
    from inside their readers): no rebuild of them runs before it."""
    return min([self.first_need.get(v, len(self.backward)) for v in values]
               + [p for v in values for buf in self._read_as((v, 0))
                  for p in self.ref.reads.get(buf, ()) if self.backward[p]],
               default=len(self.backward))

  def _read_as(self, key) -> tuple:
    """The buffers a read of ``key`` reads in the reference plan: its own,
    or those it is computed from inside its readers."""
    if key in self.ref.fused:
      return tuple(self.ref.fused_reads.get(key, ()))
    return (self.ref.root.get(key, key),)

  def _last_read(self, buf) -> int:
    """The last op of the reference plan that reads ``buf``; its producer
    where none does."""
    return max(self.ref.reads.get(buf, [self.producer_at[buf]]))

  def _whole_rows(self, start: int, end: int) -> np.ndarray:
    """The rows all of whose ops lie in ``[start, end)``."""
    if start >= end:
      return np.zeros(0, dtype=int)
    rows = set(self.row_at[start:end].tolist())
    if start > 0 and self.row_at[start - 1] == self.row_at[start]:
      rows.discard(self.row_at[start])
    if end < len(self.row_at) and self.row_at[end] == self.row_at[end - 1]:
      rows.discard(self.row_at[end - 1])
    return np.array(sorted(rows), dtype=int)

  def _free(self, column: np.ndarray, buf, start: int, likely: bool = False) -> None:
    """Takes ``buf``'s bytes off ``column`` from op ``start`` up to its
    first backward read, where its copy is made, or, where XLA may compute
    the copy inside its readers (an elementwise equation's), through the
    last. ``likely``: XLA gives an expensive copy (a transcendental) read
    more than once a buffer of its own, as it does the original
    (``Fusion.duplicable``)."""
    back = [p for p in self.ref.reads.get(buf, ()) if self.backward[p]]
    if back:
      made_by = self._made_by(buf)
      inside = (made_by is not None and primitives.fuses_elementwise(made_by)
                and not (likely and len(set(back)) > 1 and primitives.is_expensive(made_by)))
      end = max(back) + 1 if inside else min(back)
      column[np.unique(self.row_at[start:end])] -= self.ref.schedule.nbytes(buf)

  def _freed_from(self, buf) -> int:
    """The first op after the last forward op that reads ``buf``'s own
    buffer under any plan; its producer where none must (the value may
    then be computed inside its readers, with no buffer)."""
    held = [r for r in self.fusion.readers.get(buf, ())
            if not self.backward[r] and self.fusion.always_reads(buf, r)]
    return max(held) + 1 if held else self.producer_at[buf]

  def _held_back(self, buf, dropped: set) -> int:
    """The last backward op that reads ``buf`` for a value the plan keeps
    (one computed from it inside the reader counts only where neither is
    rebuilt); -1 where none does."""
    return max((pos for pos, vid, through in self.reads_of.get(buf, ())
                if vid not in dropped and not (through and buf[0] in dropped)), default=-1)

  def _made_by(self, buf) -> str | None:
    """The primitive whose equation makes ``buf``'s value; None for a step
    input (whose barrier copy XLA never computes inside its readers, such
    as a master weight a cast fused into its readers reads)."""
    producer = self.graph.values[buf[0]].producer
    return None if producer is None else self.graph.nodes[producer].prim.name

  def _buffers(self, values) -> set:
    """The buffers recomputing ``values`` may free: each value's own, the
    one a view of it shares, and those a value computed inside its
    readers is computed from."""
    found = {buf for vid in values for buf in self._read_as((vid, 0))}
    return {b for b in found if b not in self.kept and b in self.producer_at}

  def _rebuilt_by(self, rebuilt: frozenset, dropped: set, saved: frozenset) -> tuple:
    """The equations that rebuild the residuals in ``rebuilt``, with those
    in ``dropped`` recomputed, from values the backward pass may read (the
    schedule builder's rule, :func:`readable`), and the values they read
    there."""
    graph, available = self.graph, readable(self.graph, self.fused, dropped, saved)
    run, sources, stack = set(), set(), [v for v in rebuilt if graph.is_residual(v)]
    while stack:
      vid = stack.pop()
      if available(vid):
        sources.add(vid)
        continue
      producer = graph.values[vid].producer
      if producer not in run:
        run.add(producer)
        stack.extend(a for a in graph.nodes[producer].ins if isinstance(a, int))
    return run, sources
