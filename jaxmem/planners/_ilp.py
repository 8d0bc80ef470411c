"""The exact planner: per-block checkpointing solved as a 0/1 program.

Each module block (:func:`~jaxmem.planners._blocks.segments`, at module depths 2
and 3) is either left as written or checkpointed under one of the per-block
policies of :data:`~jaxmem.planners._blocks.KEEPS` (``nothing_saveable``,
``dots_saveable``, ``dots_with_no_batch_dims_saveable``); residuals may
also be rebuilt on their own (:class:`~jaxmem.planners._choices.Drop`).
What each choice alone adds to the live bytes at each equation of the step
and to the plan's cost are the coefficients of a mixed-integer program,
which HiGHS solves (``scipy.optimize.milp``):

    minimize    sum_c cost_c x_c
    subject to  base_n + sum_c delta_nc x_c <= aim   for every equation n
                at most one choice per block (and per nested block)
                x_c in {0, 1}

The coefficients start as optimistic estimates; the memory model prices a
choice (evaluates the plan that takes it alone) when a solution takes it,
and the program is solved again until every choice taken is priced
(:mod:`~jaxmem.planners._pricing`). The memory model then evaluates the
plan of the chosen blocks itself. Where it disagrees with the sum (a
block's boundary that the block before recomputes is kept again; two
recomputations overlap), that combination is excluded and the program
solved again, up to ``rounds`` times. Last, the greedy's refinement
(:meth:`~jaxmem.planners.Greedy.refined`) keeps residuals of the chosen
blocks again wherever the peak stays within the aim: the program's blocks
are whole, the refinement is not.

The optimum is optimal over plans made of per-block policy choices under
the model's costs; what :class:`Solution` reports (the solver's dual bound
and gap) bounds that space. The greedy's plans lie outside it.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from scipy import optimize

from jaxmem.planners._blocks import KEEPS, block_candidates, segments
from jaxmem._decisions import KEEP, Plan
from jaxmem.cost._evaluate import Candidate, candidate, model_floor, paused_gc, unplanned_liveness
from jaxmem.graph._graph import Graph
from jaxmem.planners._base import Planner
from jaxmem.planners import _highs as highs
from jaxmem.planners import _pricing as pricing
from jaxmem.planners._choices import Choice, Drop, exclusive, plan_of, rebuild_groups
from jaxmem.planners._pricing import Table
from jaxmem.planners._solution import Gap, Solution
from jaxmem.planners._greedy import Greedy
from jaxmem.planners._scores import PerGraph


@dataclasses.dataclass
class ILP(Planner):
  """The exact planner (``planner="ilp"``): the cheapest combination of
  per-block policies whose predicted peak fits, found by a 0/1 program
  (see the module docstring); the plan's :class:`Solution` says how it
  was proved.

  Attributes:
    keeps: the policies a block may be checkpointed under (keys of
      :data:`KEEPS`).
    time_limit: seconds the solver may take per program; past it the best
      plan found is taken and its gap reported (on the zoo's ViT at 37-40%
      of its peak, 3 s instead of 10 s took the same plans, with a bound
      2% below them instead of 1%).
    mip_gap: the relative gap between a plan's cost and the solver's bound
      at which a program counts as solved (HiGHS's ``mip_rel_gap``; the
      zoo's ViT at CPU size, 30-44% of its peak, took 5 programs of 7.5 s
      each to close one under 0.01%); the bound is reported either way.
    guess_gap: the gap to the bound of the program over estimates within
      which a plan found on the table's guessed columns (what the memory
      model likely gives each choice; :mod:`~jaxmem.planners._pricing`) is
      taken without pricing any choice; ``mip_gap`` where None. Past it
      the program prices the choices its solutions take, as without
      guesses.
    rounds: programs solved at most per plan.
    drops: whether residuals may also be recomputed on their own (rebuild
      groups), not only whole blocks under a policy.
    refine: whether a plan that fits goes through the greedy's refinement.
    give_back: evaluations the refinement may spend keeping recomputed
      residuals again (over 20-budget sweeps of the zoo's GPT-2, ResNet-18
      and residual MLP, 4 saved at most 0.05% of a plan's cost, at two
      budgets, for 10% more planning time; none by default).
    lazy: whether a choice's column is priced only when a solution takes
      it (:mod:`~jaxmem.planners._pricing`), else every column first. On a
      memory model learned from XLA:GPU's program (estimates bound
      nothing) columns of layers alike are moved, not estimated
      (:mod:`~jaxmem.planners._alike`); :class:`Solution` counts them.
    fallback: the planner asked where no combination fits (a
      :class:`~jaxmem.Planner`; None: the recompute-only greedy), and for
      candidates of the lowest footprint beside the program's own.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return x + nn.Dense(64)(jnp.tanh(nn.Dense(64)(x)))
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     for _ in range(4):
    ...       x = Block()(x)
    ...     return jnp.sum(x ** 2)
    >>> from jaxmem.graph._graph import build_graph
    >>> net, x = Net(), jnp.ones((256, 64))
    >>> p = net.init(jax.random.key(0), x)
    >>> g = build_graph(jax.make_jaxpr(jax.grad(lambda p: net.apply(p, x)))(p))
    >>> full = unplanned_liveness(g).peak
    >>> found = ILP().plan(g, int(full * 0.9))
    >>> found.fits, found.details.status
    (True, 'optimal')
  """
  name: str = "ilp"
  target: object = None
  keeps: tuple = tuple(KEEPS)
  time_limit: float = 3.0
  mip_gap: float = 0.01
  guess_gap: float | None = None
  rounds: int = 8
  drops: bool = True
  refine: bool = True
  give_back: int = 0
  fallback: object = None
  lazy: bool = True
  assumed_target: bool = False
  # Search state no aim changes: per graph, the program's coefficients
  # ("table") and lowest plans ("lowest"); the greedy, which keeps its runs.
  _kept: PerGraph = dataclasses.field(default_factory=PerGraph, init=False, repr=False,
                                      compare=False)
  _greedy: Greedy | None = dataclasses.field(default=None, init=False, repr=False,
                                             compare=False)

  def _recompute_greedy(self) -> Greedy:
    """The recompute-only greedy this planner refines with and, without a
    fallback, falls back on: one per planner, so its ladder's runs serve
    every budget."""
    if self._greedy is None:
      self._greedy = Greedy(target=self.target)
    return self._greedy

  def plan(self, graph: Graph, aim: int, start: Plan | None = None) -> Candidate:
    """The cheapest combination whose model peak is at most ``aim``;
    where none is, the fallback's plan if it fits (without one, the
    recompute greedy's: :meth:`_descended`), else the lowest (``fits``
    False; under :func:`model_floor`, the descent's, the fallback's search
    skipped). ``start`` is not used: the program is solved whole."""
    began = time.perf_counter()
    with paused_gc():
      found = self._solve(graph, aim)
      if found is None:
        # Beyond the program's reach (a residual rebuilt through another
        # dropped one, or offloaded); under the floor, beyond any plan's.
        lowest = self._own_lowest(graph)[0]
        searched = self.fallback if aim >= model_floor(graph) else None
        beyond = searched or self._recompute_greedy()
        found = (self._fallback_plan(graph, lowest, aim) if searched
                 else self._descended(graph, lowest, aim))
        outside = Solution([], self.cost(found.schedule) - self.table(graph).base_cost,
                           0.0, "fallback", 0, 0.0, fallback=beyond.name)
        if not found.fits and lowest.peak <= found.peak:
          found = lowest.aimed(aim)
          outside = dataclasses.replace(found.details, status="infeasible")
        found.details = outside
      elif self.refine and len(found.plan):
        found = self._recompute_greedy().refined(
            graph, self._without_reference(graph, found, aim), aim, self.give_back)
        found.details.refined = self.cost(found.schedule) - self.table(graph).base_cost
    found.seconds = time.perf_counter() - began
    return found

  def _without_reference(self, graph: Graph, found: Candidate, aim: int) -> Candidate:
    """``found`` without the reference drop where it still fits."""
    keep = {v: KEEP for v in self.table(graph).reference}
    trial = candidate(graph, Plan.of({**found.plan.as_dict(), **keep}), aim)
    if not trial.fits or self.cost(trial.schedule) > self.cost(found.schedule):
      return found
    return dataclasses.replace(found, plan=trial.plan, schedule=trial.schedule, memory=trial.memory)

  def may_offload(self) -> bool:
    return self.fallback is not None and self.fallback.may_offload()

  def weighs(self, graph: Graph) -> int:
    """Each choice priced once at most, and per program a plan judged whole
    and the refinement's first (the fallback searches only where none fits)."""
    return len(self.table(graph).choices) + 2 * (self.rounds + _PROGRAMS)

  def lowest(self, graph: Graph, start: Plan | None = None) -> list[Candidate]:
    """The program's candidates for the lowest footprint (:meth:`_own_lowest`),
    then the fallback's, or the recompute greedy's descents from the
    program's lowest and from every block checkpointed: their plans reach
    outside the program's choices, and XLA may rate one lower."""
    own = self._own_lowest(graph)
    if self.fallback:
      return own + self.fallback.lowest(graph)
    greedy = self._recompute_greedy()
    return own + [greedy.descended(graph, own[0].plan), *greedy.block_descents(graph)]

  def _descended(self, graph: Graph, lowest: Candidate, aim: int) -> Candidate:
    """The recompute greedy's descent from the program's ``lowest`` plan
    (2 s on the zoo's GPT-2 at CPU size, where its search from nothing
    takes 39 s), its recomputation given back where under ``aim``. Where
    that fits, ``aim`` is reachable, and the greedy's own search for it
    is taken where cheaper: a descent from a plan that recomputes much
    keeps recomputing much (on a 12-layer tanh MLP under ``shard_map``
    at 70%, 2.6x the FLOPs of the greedy's own plan)."""
    greedy = self._recompute_greedy()
    found = greedy.descended(graph, lowest.plan).aimed(aim)
    if not found.fits:
      return found
    found = greedy.refined(graph, found, aim)
    own = greedy.plan(graph, aim)
    return own if own.fits and self.cost(own.schedule) < self.cost(found.schedule) else found

  def _fallback_plan(self, graph: Graph, lowest: Candidate, aim: int) -> Candidate:
    """The fallback's plan for ``aim``, from the recompute greedy's descent
    from the program's ``lowest`` plan where that does not reach ``aim``
    (a search from nothing retraces the descent: on MobileNetV2 for a T4 at
    50%, 163 greedy steps over 300 s before the first offload)."""
    descent = self._recompute_greedy().descended(graph, lowest.plan).aimed(aim)
    return self.fallback.plan(graph, aim, start=None if descent.fits else descent.plan)

  def _own_lowest(self, graph: Graph) -> list[Candidate]:
    """Plans of the lowest model peak, lowest first: the program's lowest,
    then while the memory model finds one, the cheapest combination under
    the last one's model peak (the program's sum and the model disagree by
    a little; up to ``rounds`` descents). Found once per graph."""
    kept = self._kept.get(graph, dict)
    if "lowest" in kept:
      return kept["lowest"]
    began = time.perf_counter()
    with paused_gc():
      found = [self._min_peak(graph)]
      for _ in range(self.rounds):
        lower = self._solve(graph, found[-1].peak - 1)
        if lower is None:
          break
        found.append(lower)
    for c in found:
      c.seconds = time.perf_counter() - began
    found = sorted(found, key=lambda c: c.peak)[:2]
    kept["lowest"] = found
    return found

  def structured(self, graph: Graph) -> list[Candidate]:
    """The uniform per-block policies (:func:`block_candidates`), cheapest
    first."""
    return sorted(block_candidates(graph), key=lambda r: self.cost(r.schedule))

  def table(self, graph: Graph) -> Table:
    """The program's coefficients for ``graph``, built once per graph
    (:mod:`~jaxmem.planners._pricing`): per block and policy and per
    rebuild group, a column estimated at no evaluation, priced by the
    memory model when a solution takes it (every one at once where
    ``lazy`` is False).

    Any recomputation changes the whole schedule a little (barriers keep
    XLA from merging recomputed values into the forward pass; values XLA
    fused into their backward readers are rebuilt there): that is the
    ``overhead`` column, measured on the plan that drops the smallest
    rebuild group alone (the reference; plans that take any choice drop it
    too); every other column is measured on top of that plan, so their sum
    does not count it once per choice."""
    kept = self._kept.get(graph, dict)
    if "table" in kept:
      return kept["table"]
    drops = rebuild_groups(graph)
    smallest = min(drops, key=lambda g: (sum(graph.values[v].nbytes for v in g), g),
                   default=())
    segs = segments(graph)
    choices, plans = [], []
    for seg in segs:
      seen = set()
      for keep in self.keeps:
        plan = plan_of(graph, [Choice(seg, keep)])
        if plan not in seen and plan.values_with("recompute"):
          seen.add(plan)  # a policy keeping all this block recomputes: as written
          choices.append(Choice(seg, keep))
          plans.append(plan)
    for group in drops if self.drops else ():
      if group != smallest:
        choices.append(Drop(group))
        plans.append(plan_of(graph, [Drop(group)]))
    table = pricing.build(graph, choices, plans, unplanned_liveness(graph), smallest, self.cost,
                          self.rerun_costs(graph), lambda c: exclusive(graph, c, segs), self.lazy)
    kept["table"] = table
    return table

  def _program(self, table: Table, refused: list, width: int) -> list:
    """The constraints every program shares, over ``width`` variables
    (the choices, the overhead, then any of the program's own): at most
    one choice per block, any choice brings the overhead, and the
    combinations the memory model refused are left out."""
    n = len(table.choices)
    rows = np.zeros((len(table.exclusive) + n + len(refused), width))
    lower, upper = np.full(len(rows), -np.inf), np.ones(len(rows))
    for r, group in enumerate(table.exclusive):
      rows[r, group] = 1
    at = len(table.exclusive)
    rows[at:at + n, :n] = np.eye(n)  # x_c <= z
    rows[at:at + n, n] = -1
    upper[at:at + n] = 0
    for r, chosen in enumerate(refused, at + n):  # one choice differs at least
      rows[r, :n] = 1
      rows[r, list(chosen)] = -1
      lower[r], upper[r] = 1 - len(chosen), np.inf
    return [optimize.LinearConstraint(rows, lower, upper)] if len(rows) else []

  def _milp(self, cost, constraints, n_binary: int, time_limit: float | None = None):
    """One program solved within ``time_limit`` seconds (``self.time_limit``
    by default): ``(x, bound, status)``; x None when it has no solution."""
    return highs.solve(cost, constraints, n_binary, time_limit or self.time_limit, self.mip_gap)

  def _solved(self, table: Table, columns: np.ndarray, limit: int, refused: list,
              time_limit: float | None = None) -> tuple:
    """The program over ``columns`` (the table's estimates or its guesses)
    whose sum must stay within ``limit`` at every row, solved:
    ``(chosen, bound, status)``, the bound in the cost's units less what
    the tie-break may add; chosen None where it has no solution."""
    n = len(table.choices)
    memory = np.hstack([columns, table.overhead[:, None]])
    reach = table.base + np.clip(memory, 0, None).sum(axis=1)
    binding = reach > limit  # rows no combination can push over the limit are left out
    cost = np.append(table.cost, table.overhead_cost)
    # Bytes and costs scaled to about 1, for HiGHS's tolerances.
    nbytes, unit = max(table.base.max(), 1.0), max(np.abs(cost).max(), 1.0)
    constraints = self._program(table, refused, n + 1)
    rows, base = highs.binding_rows(memory[binding], table.base[binding])
    x, bound, status = highs.solve_rows(highs.tie_broken(cost / unit, n), constraints,
                                        rows / nbytes, (limit - base) / nbytes, n + 1,
                                        time_limit or self.time_limit, self.mip_gap)
    return (None, None, status) if x is None else (
        [i for i in range(n) if x[i] > 0.5], (bound - highs.TIE * (n + 1)) * unit, status)

  def _guessed(self, graph: Graph, table: Table, aim: int, bound: float, solves: int,
               seconds: float) -> Candidate | None:
    """The program over the table's guessed columns, its plan judged whole
    against ``bound`` (the program's over estimates at ``aim``); a second
    program with its limit lowered by the first plan's overshoot where that
    one does not fit. The plan that fits where it is within ``guess_gap``
    of the bound (and not under it), else None."""
    limit = aim
    for _ in range(2):
      chosen, _, _ = self._solved(table, table.guess, limit, [])
      if chosen is None:
        return None
      found = self._weighed(graph, table, chosen, aim, bound, solves, seconds)
      if found.fits:
        # A plan cheaper than the bound shows the estimates missed what
        # some choice frees (see :mod:`_pricing`): the bound proves nothing.
        most = self.mip_gap if self.guess_gap is None else self.guess_gap
        proved = bound <= found.details.cost and found.details.gap <= most
        return found if proved else None
      limit -= found.peak - aim
    return None

  def _solve(self, graph: Graph, aim: int) -> Candidate | None:
    """The cheapest combination whose model peak fits ``aim``, or None."""
    table = self.table(graph)
    n = len(table.choices)
    refused, spent, limit, first, rounds, solves, missed, suspected = [], 0.0, aim, None, 0, 0, 0, 0
    while rounds < self.rounds:
      began = time.perf_counter()
      # Once a bound is proved (``first``) later programs' bounds go unused.
      chosen, bound, status = self._solved(table, table.delta, limit, refused,
                                           None if first is None else self.time_limit / 3)
      spent += time.perf_counter() - began
      solves += 1
      if chosen is None:
        # Estimates are optimistic but for a few bytes: where some are
        # left, the program over exact columns is solved before giving up.
        if table.price(range(n)):
          continue
        return None
      if solves == 1 and not (table.exact | table.moved).all():
        # The program over estimates bounds the exact one: a plan found on
        # the guesses within ``guess_gap`` of that bound is taken unpriced.
        found = self._guessed(graph, table, aim, bound, solves, spent)
        if found is not None:
          return found
      if limit == aim and missed < _WEIGHED and not table.exact[chosen].all():
        # A plan on estimates or moved columns that fits within the gap of
        # their bound needs no pricing; one on estimates that does not fit
        # is left out of later ones (one on moved columns is priced first).
        found = self._weighed(graph, table, chosen, aim, bound, solves, spent)
        if found.fits and found.details.gap <= self.mip_gap:
          return found
        if not found.fits and not table.moved[chosen].any():
          refused.append(chosen)
          # The choices whose guesses say their estimates miss bytes where
          # the plan goes over are priced alone first, a few times.
          suspects = table.suspects(chosen, found.memory, aim) if suspected < _SUSPECTED else ()
          if table.price(suspects):
            suspected += 1
            continue
        missed += 1
      if table.price(chosen if table.lazy(spent) else range(n)):
        continue  # taken on estimates: solved again with their exact columns
      rounds += 1
      # The first program whose plan is priced bounds the exact program at
      # ``aim`` (the estimates are optimistic), less what the tie-break may
      # add; after a tightening the plan is not proved optimal.
      first = bound if first is None else first
      if limit < aim and status in ("optimal", "near-optimal"):
        status = "aim tightened"
      found = self._candidate(graph, table, chosen, aim, first, status, rounds, spent)
      if found.fits:
        return found
      refused.append(chosen)
      # The memory model found more than the program's sum: after a first
      # refusal (whose neighbours the cut leaves out), the limit is lowered
      # by the overshoot (a few percent near the lowest peaks).
      if rounds >= 2:
        limit -= found.peak - aim
    return None

  def _weighed(self, graph: Graph, table: Table, chosen: list, aim: int, bound: float,
               solves: int, seconds: float) -> Candidate:
    """The plan of ``chosen`` judged against ``aim`` by the memory model, its
    own cost against ``bound`` (on every plan of the program's that fits)."""
    found = self._candidate(graph, table, chosen, aim, bound, "", solves, seconds)
    cost = self.cost(found.schedule) - table.base_cost
    bound = min(float(bound), cost)
    close = cost <= 0 or cost - bound <= highs.OPTIMAL_GAP * cost
    found.details = dataclasses.replace(found.details, cost=cost, bound=bound,
                                        status="optimal" if close else "near-optimal")
    return found

  def gap(self, graph: Graph, found: Candidate) -> Gap:
    """``found`` (any planner's plan for ``graph``) against the cheapest
    combination of this planner's choices whose model peak is at most
    ``found``'s."""
    if not len(found.plan):  # the step as written: nothing to price
      return Gap(0.0, 0.0, "optimal")
    began = time.perf_counter()
    with paused_gc():
      cost = self.cost(found.schedule) - self.table(graph).base_cost
      best = self._solve(graph, found.peak)
    seconds = time.perf_counter() - began
    if best is None:
      return Gap(cost, None, "unreachable", seconds)
    return Gap(cost, best.details.bound, best.details.status, seconds, best.details.moved)

  def _min_peak(self, graph: Graph) -> Candidate:
    """The combination of the lowest model peak the program finds (the
    cheapest such, up to a tie-break)."""
    table = self.table(graph)
    n = len(table.choices)
    nbytes = max(table.base.max(), 1.0)  # scaled to about 1, for HiGHS's tolerances
    began, spent = time.perf_counter(), 0.0
    while True:
      # Variables: the choices, the overhead, then the peak, minimized.
      cost = np.zeros(n + 2)
      # The plan's cost, at a millionth of a peak, breaks ties.
      cost[:n + 1] = highs.tie_broken(1e-6 * np.append(table.cost, table.overhead_cost)
                                      / max(np.abs(table.cost).max(initial=0.0), 1.0), n)
      cost[n + 1] = 1
      memory = np.hstack([table.delta, table.overhead[:, None]]) / nbytes
      rows, base = highs.binding_rows(memory, table.base / nbytes)
      rows = np.hstack([rows, -np.ones((len(rows), 1))])
      constraints = [optimize.LinearConstraint(rows, -np.inf, -base)]
      solving = time.perf_counter()
      x, bound, status = self._milp(cost, constraints + self._program(table, [], n + 2), n + 1)
      spent += time.perf_counter() - solving
      chosen = [i for i in range(n) if x[i] > 0.5]
      if not table.price(chosen if table.lazy(spent) else range(n)):
        break
    return self._candidate(graph, table, chosen, 0, bound, status, 1,
                           time.perf_counter() - began)

  def _candidate(self, graph, table: Table, chosen: list, aim: int, bound, status,
                 rounds: int, seconds: float) -> Candidate:
    """The plan of ``chosen`` evaluated by the memory model, with its
    :class:`Solution`."""
    choices = [table.choices[i] for i in chosen]
    found = candidate(graph, table.plan(graph, chosen), aim)
    cost = float(table.cost[chosen].sum()) + (table.overhead_cost if chosen else 0.0)
    if aim == 0:  # the program minimized the peak: its bound is not a cost
      bound = cost
    found.details = Solution([c.describe(graph) for c in choices], cost,
                             float(bound), status, rounds, seconds,
                             moved=int(table.moved.sum()))
    return found


# Programs a plan solves, about, before its columns are priced (``Table.lazy``).
_PROGRAMS = 12

# Rounds per aim that price only the suspects of a plan judged over it
# (``Table.suspects``): ViT at 70% of its footprint needs two; GPT-2 at 50%,
# unbounded, runs sixteen of one or two choices each.
_SUSPECTED = 3

# Misses per aim of plans judged before pricing (GPT-2 at 69%: nine in a row).
_WEIGHED = 2
