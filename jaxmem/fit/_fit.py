"""The fit loop: plan, compile, and keep what XLA says fits the budget.

The memory model and XLA disagree by a few percent, so a planned step is
judged by its compiled footprint on the target (XLA:GPU's for a GPU
target, compiled here where the GPU is not; on a backend that ignores host
memory, XLA:CPU, an offload plan's device footprint is the model's).
:class:`Fitter` runs the loop for one graph:

1. *Tighten*: plan toward the budget scaled by model/XLA on the
   untransformed step; while XLA is over the budget, aim the model lower.
   Where a round after the first is over too and planned over twice as long
   as it compiled, the plans of 3. that may fit are compiled; where one
   fits, one more round is planned and the cheaper taken.
2. *Loosen*: a plan far under the budget recomputes more than it needs;
   plan for a looser aim and keep it where XLA fits and it costs less.
3. *Structured*: plans shaped like per-block remat policies, which XLA
   follows closely, replace the plan where they fit and cost less (on a
   GPU target: run faster by the clock).
4. *Lowest*: where the search toward the budget does not fit, every
   candidate for the smallest footprint is compiled (only those that may fit
   where micro-batches may, ``only_fitting``); the cheapest that fits is
   taken, the plans of 3. that may fit tried against it, or the error names
   the smallest footprint XLA gives. A quick answer skips this.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from typing import Callable

from jaxmem._budget import BudgetError, format_bytes
from jaxmem._decisions import Plan
from jaxmem.cost._evaluate import (Candidate, candidate, model_floor, unplanned,
                                   unplanned_liveness)
from jaxmem.fit._aims import reaim
from jaxmem.fit._forewarn import forewarn
from jaxmem.fit._shared import once
from jaxmem.fit._trial import Trial, compiled_line
from jaxmem.fit._unmet import NoPlanFits, budget_error
from jaxmem.graph._graph import Graph
from jaxmem.schedule._scan_remat import loop_variants
from jaxmem.planners._blocks import rebuilt_as_checkpointed
from jaxmem.planners import Planner
from jaxmem.targets import holds_host_memory, xla_footprint

# Plans shaped like the per-block policies a fit compiles on a clock's target.
STRUCTURED_COMPILES = 4

_log = logging.getLogger("jaxmem")  # each plan and compilation, at INFO level

# How far under the budget's share of the model the first plan aims.
FIRST_MARGIN = 0.01

# A fitting plan is loosened (``Fitter.loosen``) where XLA's footprint leaves this share of the
# budget free and a plan may fit for an aim this much looser: closer, a compilation buys a
# few recomputations back (GPT-2 at 70%: 1% looser, 38 decisions to 41).
LOOSEN_MARGIN = 0.05

# Plans of the first search for the smallest footprint that a second fit of the same step
# (its optimizer state on the host) compiles again: on a 2-layer GPT-2 for a T4 at 10%, the
# smallest named is 0.6% over compiling all 16 candidates again, failing in 178 s not 253 s.
SMALLEST_AGAIN = 3

# How far above the most model bytes per XLA byte seen a plan for the smallest
# footprint, or a kind's first shaped form, may lie (``Fitter.may_beat``,
# ``Fitter.structured``): lowest plans span 0.95-1.08 (ResNet-18), 0.59-0.88
# (GPT-2); the U-Net's first shaped form for a T4 fit at 2.9% above the rest.
LOWEST_MARGIN = 0.1

# The same from the shaped forms of its kind compiled so far (block-rebuilt
# forms of GPT-2 at CPU sizes for an H100: 0.92-0.95).
ALIKE_MARGIN = 0.03

# How much slower than the best plan a shaped form may be predicted and
# still be compiled (``Fitter.slower``). At the GPU check's edge sizes for an
# H200, shaped forms ran up to 3.2% faster than predicted (ViT at 50%).
TIME_MARGIN = 0.05


@dataclasses.dataclass
class Fitter:
  """The fit loop for one graph (see the module docstring).

  Attributes:
    graph: the step's joint graph.
    planner: proposes the candidates.
    budget: the bytes XLA's footprint must fit: the user's budget less
      ``reserve``.
    unconstrained: XLA's footprint of the untransformed step.
    model_scale: the memory model's footprint of the untransformed step
      over XLA's, less ``fixed``.
    jit: compiles a candidate's step to read its footprint:
      ``candidate -> compiled``.
    max_rounds: planning rounds while XLA is over the budget.
    reserve: bytes kept free for the runtime beyond the footprint
      (:func:`~jaxmem.targets.runtime_reserve`); errors name budgets with it
      added back.
    where: the target's name, for errors (``"t4 (XLA:GPU ...)"``).
    fixed: bytes of XLA's footprint no plan changes and the memory model
      does not hold (the workspace XLA:GPU gives cuBLAS and cuDNN,
      :func:`~jaxmem.targets.workspace_bytes`, where the model has not
      learned each call's own): the model's part of a budget is the budget
      less these.
    clock: a compiled program's predicted seconds on the target; where
      set, compiled plans are compared by it (a plan's cost is its time on
      the target), else by the planner's cost model.
    smallest_from: where given, the plans the search for the smallest
      footprint compiles (besides the last plan tried) instead of the
      planner's candidates: the smallest plans another fit of the same step
      found (:func:`search`'s second fit).
    plans: where given, the plans made so far in the transform's fits:
      ``(graph, aim, start) -> (planner, candidate)``, and ``(graph,
      "lowest") -> (planner, candidates)``. A fit asking its planner for plans
      made before (seeking the smallest after a quick fit) takes them there.
    to_beat: a footprint reached otherwise (the step in micro-batches), as
      errors name it, where given: the search for the smallest footprint
      compiles only candidates that may come under it (or the budget).
    own_footprint: XLA's footprint of this graph's step as written where it is
      not the untransformed step's (in micro-batches): a budget it meets needs no plan.
    program_key: all that decides a plan's program beside the plan and its
      graph (``fit._shared.once``), where given: a plan an earlier fit of
      the step compiled under the same key is not compiled again.
  """
  graph: Graph
  planner: Planner
  budget: int
  unconstrained: int
  model_scale: float
  jit: Callable[[Candidate], tuple]
  max_rounds: int = 4
  reserve: int = 0
  where: str = ""
  fixed: int = 0
  clock: Callable[[object], float] | None = None
  smallest_from: tuple[Plan, ...] | None = None
  plans: dict | None = None
  to_beat: int | None = None
  own_footprint: int | None = None
  program_key: tuple | None = None
  # Model bytes per XLA byte of each planned trial compiled: what the
  # model's peaks have been worth on the target so far in this fit.
  _ratios: list = dataclasses.field(default_factory=list, init=False, repr=False)
  # Each plan compiled in this fit, with its trial (:meth:`compile`).
  _trials: dict = dataclasses.field(default_factory=dict, init=False, repr=False)
  # The best trial compiled so far (:meth:`best_so_far`), for the log.
  _best: Trial | None = dataclasses.field(default=None, init=False, repr=False)

  def _model_part(self, footprint: int) -> int:
    """The part of an XLA footprint the memory model's figures stand for."""
    return max(footprint - self.fixed, 1)

  def fit(self, find_smallest: bool = True,
          only_fitting: bool = False) -> tuple[Trial, int] | None:
    """The trial that fits and the planning rounds it took. Where none fits,
    :class:`NoPlanFits` names the smallest footprint reached; without
    ``find_smallest`` the answer is None before searching for it (after the
    structured plans that may fit, which can fit where a search toward the
    budget fails), and with ``only_fitting`` it is None after compiling only
    the candidates for the smallest that may fit the budget (where micro-batches
    may fit instead, the smallest is sought only where they do not)."""
    trial, rounds = self.tighten()
    if trial.measured <= self.budget:
      if find_smallest and len(trial.candidate.plan):
        trial = self.structured(self.loosen(trial))
      return trial, rounds
    if not find_smallest:
      shaped = self.structured(trial, cheaper=False, sparing=True)
      return (shaped, rounds) if shaped.measured <= self.budget else None
    _log.info("jaxmem: no plan toward the budget fits; compiling the candidates for "
              "the smallest footprint%s", " that may fit it" if only_fitting else "")
    trials = self.lowest(trial, only_fitting)
    fitting = [t for t in trials if t.measured <= self.budget]
    if not fitting:
      if only_fitting:
        return None
      least = sorted(trials, key=lambda t: t.measured)
      raise NoPlanFits(self.error(least[0].measured),
                       tuple(t.candidate.plan for t in least[:SMALLEST_AGAIN]), self.graph)
    cheapest = functools.reduce(lambda a, b: self.best_so_far(b, a), fitting)
    return self.structured(cheapest, sparing=True), rounds

  def plan(self, aim: int, start: Plan | None = None) -> Candidate:
    """The planner's plan for ``aim`` model bytes (logged)."""
    return self._remembered((self.graph, aim, start), lambda: self._planned(aim, start))

  def _planned(self, aim: int, start: Plan | None) -> Candidate:
    began = time.perf_counter()
    found = self.planner.plan(self.graph, aim, start=start)
    _log.info("jaxmem: %s planned for %s (model bytes): %d decisions, model peak %s "
              "(%s) in %.1f s", self.planner.name, format_bytes(aim), len(found.plan),
              format_bytes(found.peak), "fits" if found.fits else "over",
              time.perf_counter() - began)
    return found

  def _remembered(self, key: tuple, make: Callable[[], object]):
    """``make()`` (the planner's answer for ``key``), or what it gave for
    ``key`` before in the transform's fits (``plans``)."""
    known = (self.plans or {}).get(key)
    if known is not None and known[0] is self.planner:
      return known[1]
    found = make()
    if self.plans is not None:
      self.plans[key] = (self.planner, found)
    return found

  def compile(self, candidate: Candidate) -> Trial:
    """``candidate`` compiled, with its footprint (see :class:`Trial`); not
    again where this fit or an earlier fit of the step (``program_key``) did."""
    key = (candidate.plan, candidate.changes_step)  # an empty plan may separate reads
    known = self._trials.get(key)
    if known is not None:
      return dataclasses.replace(known, candidate=candidate)
    made = []  # the candidate, where this fit compiles it (not an earlier fit)
    measure = lambda: made.append(candidate) or self._compiled(candidate)  # noqa: E731
    footprint, seconds, took, ratio = measure() if self.program_key is None else once(
        candidate.schedule.graph, ("plan", *key, self.program_key), measure)
    trial = self._trials[key] = Trial(candidate, footprint, seconds, took)
    if ratio is not None:
      self._ratios.append(ratio)
    self._best = self.best_so_far(trial, self._best)
    _log.info(compiled_line(trial, self._best, self.budget, compiled=bool(made)))
    return trial

  def best_so_far(self, trial: Trial, best: Trial | None) -> Trial:
    """The better of two compiled trials: of those that fit the budget the
    cheaper (:meth:`cheaper`), else the smaller footprint."""
    if best is None:
      return trial
    fits, best_fits = trial.measured <= self.budget, best.measured <= self.budget
    if fits != best_fits:
      return trial if fits else best
    if fits:
      return trial if self.cheaper(trial, best) else best
    return trial if trial.measured < best.measured else best

  def _compiled(self, candidate: Candidate) -> tuple:
    """``candidate``'s :class:`Trial` figures and its model bytes per XLA byte (or None)."""
    began = time.perf_counter()
    compiled = self.jit(candidate)
    seconds = None if self.clock is None else self.clock(compiled)
    took = time.perf_counter() - began
    if candidate.uses_host and not holds_host_memory(compiled):  # the model's, in XLA's scale
      return int(candidate.peak / self.model_scale) + self.fixed, seconds, took, None
    footprint = xla_footprint(compiled)
    measured = footprint is not None and candidate.changes_step
    return footprint, seconds, took, (candidate.peak / self._model_part(footprint)
                                      if measured else None)

  def may_fit(self, candidate: Candidate) -> bool:
    """Whether ``candidate``'s model peak is within :meth:`most_that_may_fit`."""
    return candidate.peak <= self.most_that_may_fit()

  def most_that_may_fit(self) -> float:
    """The largest model peak that may fit the budget by the least model
    bytes per XLA byte the steps compiled so far show (the step as written
    included); unbounded before any plan is compiled."""
    if not self._ratios:
      return float("inf")
    least = min(self.model_scale, *self._ratios)  # the step as written's included
    return (self.budget - self.fixed) * least

  def cost(self, trial: Trial | Candidate) -> float:
    """The planner's cost of a plan (its cost model's, before compiling)."""
    candidate = trial.candidate if isinstance(trial, Trial) else trial
    return self.planner.cost(candidate.schedule)

  def cheaper(self, trial: Trial, than: Trial) -> bool:
    """Whether ``trial`` costs less than ``than``: by their predicted times
    on the target where both have one, else by the planner's cost."""
    if trial.seconds is not None and than.seconds is not None:
      return trial.seconds < than.seconds
    return self.cost(trial) < self.cost(than)

  def tighten(self) -> tuple[Trial, int]:
    """Plans toward the budget in the model's scale; while XLA's footprint
    is over it and the plan met its aim, aims lower. The step as written
    where it is already within the aim. A planner that answers a lower
    aim with the plan just compiled (a saved plan's) ends the search:
    compiling it again would change nothing."""
    # The first aim keeps FIRST_MARGIN under the budget's share, about as far
    # as the model tracks XLA: a first plan that fits saves a compilation.
    graph, previous, trial, shaped, detoured = self.graph, None, None, None, False
    room = self._model_part(self.budget)
    aim = int(room * self.model_scale * (1 - FIRST_MARGIN))
    # (model peak, XLA's footprint less ``fixed``) of each step compiled;
    # the first, the step as written's (which ``model_scale`` is of).
    written = unplanned(graph, 0).peak
    points = [(written, written / self.model_scale)]
    for rounds in itertools.count(1):
      if self.needs_plan(aim):
        if rounds == 1 and self.smallest_from is None:  # the first search only
          forewarn(self.graph, self.where, self.planner)
        began = time.perf_counter()
        candidate = self.plan(aim, start=previous)
        planning = time.perf_counter() - began
        if trial is not None and candidate.plan == trial.candidate.plan:
          return self.best_so_far(trial, shaped), rounds - 1
        previous = candidate.plan
      else:
        candidate, planning = self.start(aim), 0.0
      trial = self.compile(candidate)
      if shaped is not None:  # one round after a plan shaped like the policies fit
        return self.best_so_far(trial, shaped), rounds
      if (trial.measured <= self.budget or not candidate.fits
          or rounds >= self.max_rounds):
        return trial, rounds
      if rounds >= 2 and not detoured and planning > 2 * trial.took:
        # Over the budget where the model said it fits: the model misjudges
        # this step's plans. Where a round after the first (which reuses the
        # planner's table; MobileNetV2 for a T4 at 70%: 38 s, then 0.8 s,
        # against 13 s compiles) still plans slower than it compiles, the
        # plans shaped like per-block policies, which XLA follows closely,
        # are compiled where they may fit; where one does, one more round is
        # planned and the cheaper that fits taken. Where planning is quicker,
        # a round costs about one such compilation and finds a cheaper plan.
        detoured = True
        found = self.structured(trial, cheaper=False, sparing=True)
        shaped = found if found.measured <= self.budget else None
      points.append((candidate.peak, self._model_part(trial.measured)))
      aim = reaim(points, room, aim)

  def needs_plan(self, aim: int) -> bool:
    """Whether the step must be planned: :meth:`_under_written`, and the
    planners' starting point is over ``aim``."""
    return self._under_written() and unplanned_liveness(self.graph).peak > aim

  def _under_written(self) -> bool:
    """A backward pass, and a budget under the step's footprint as written."""
    return self.graph.has_backward and self.budget < (self.own_footprint or self.unconstrained)

  def start(self, aim: int) -> Candidate:
    """Where no plan is needed for ``aim``: the step as written, or under its footprint the
    planners' start (each residual kept, backward reads separated), which XLA:GPU may shrink."""
    if self._under_written():
      return candidate(self.graph, Plan(), aim)
    return unplanned(self.graph, aim)

  def loosen(self, found: Trial, rounds: int = 2) -> Trial:
    """A fitting plan well under the budget, where the model rates the
    plan's savings below what XLA gives them, recomputes more than it needs
    to: re-planned up to ``rounds`` times for a looser aim in model bytes
    (bisecting between the last aim that fit and the first that did not),
    a plan is compiled where the plans compiled so far say it may fit
    (:meth:`may_fit`), and taken if XLA's footprint still fits and it
    costs less (:meth:`Planner.cost`). No aim is looser than a plan that
    may fit can peak at, nor planned under ``LOOSEN_MARGIN`` above the
    plan's own."""
    room = self._model_part(self.budget)
    low, high = found.candidate.aim / room, None
    for _ in range(rounds):
      if found.measured >= (1 - LOOSEN_MARGIN) * self.budget:
        break
      scale = ((low + high) / 2 if high else
               low * room / self._model_part(found.measured) * 0.99)
      scale = min(scale, self.most_that_may_fit() / room)
      if scale < low * (1 + LOOSEN_MARGIN):
        break
      candidate = self.plan(int(room * scale))
      if (candidate.fits and candidate.plan != found.candidate.plan
          and self.may_fit(candidate)):
        trial = self.compile(candidate)
        if trial.measured <= self.budget and self.cheaper(trial, found):
          found, low = trial, scale
          continue
      high = scale
    return found

  def structured(self, found: Trial, cheaper: bool = True, sparing: bool = False) -> Trial:
    """The planner's plans shaped like the per-block remat policies
    (:meth:`Planner.structured`) against the plan found.

    With a clock, the cheapest :data:`STRUCTURED_COMPILES` that may fit
    the budget are compiled, each rebuilt as ``jax.checkpoint`` rebuilds a
    block (:func:`~jaxmem.planners._blocks.rebuilt_as_checkpointed`) and,
    where that does not fit, as planned. A form may fit by
    :meth:`may_come_under`, with the model-to-XLA ratios of the forms of its
    kind compiled so far where there are any (XLA follows forms of one kind
    alike). A planned form must also be under the model peak of any planned
    form that did not fit, and of its block-rebuilt form where that one was
    not compiled; and, where a plan fits, it may be faster (:meth:`slower`).
    The fastest on the target whose XLA footprint
    fits replaces the plan where it is faster (without ``cheaper``,
    whatever its time): the planner's cost model does not rank these as
    the clock does.
    Without a clock, the first, cheapest first, that the planner's cost
    rates below the plan and that fits and is cheaper compiled replaces
    it; once a form is compiled, one that the forms of its kind say cannot
    fit is not; with ``sparing``, only forms that may fit are compiled, as
    with a clock."""
    best = found
    limit = self.cost(found) if cheaper else float("inf")
    ceiling = float("inf")
    ratios: dict[bool, list] = {True: [], False: []}  # block-rebuilt? -> ratios
    rates: list = []  # seconds per unit of planner cost of the forms compiled
    compiles = 0
    for shaped in self.planner.structured(self.graph):
      if self.clock is None and self.cost(shaped) >= limit:
        break
      # On a clock's target a block rebuilds all at once first (fewer
      # kernels), then each residual when first read (less held at once).
      forms = [shaped] if self.clock is None else [
          candidate(self.graph, rebuilt_as_checkpointed(self.graph, shaped.plan)), shaped]
      below = ceiling
      for form in forms:
        rebuilt = form is not shaped
        if (self.clock is None and not sparing and ratios[rebuilt]
            and not self.may_come_under(form.peak, self.budget, ratios[rebuilt])):
          continue  # the forms of its kind compiled so far say it cannot fit
        if self.clock is not None or sparing:
          if not (self.may_come_under(form.peak, self.budget, ratios[rebuilt])
                  and (rebuilt or form.peak < below)):
            below = min(below, form.peak)  # the planned form must hold less
            continue
          if self.slower(form, rates, best):
            break  # its planned form recomputes the same: within 1.5% as slow
          compiles += 1
          if compiles > STRUCTURED_COMPILES:
            return best
        trial = self.compile(dataclasses.replace(form, aim=found.candidate.aim, fits=True))
        ratios[rebuilt].append(form.peak / self._model_part(trial.measured))
        if trial.seconds is not None:
          rates.append(trial.seconds / max(self.cost(form), 1e-30))
        if trial.measured > self.budget:
          if form is shaped:  # plans the model rates as large will not fit either
            ceiling = min(ceiling, form.peak)
          continue
        if (best is found and not cheaper) or self.cheaper(trial, best):
          best = trial
          if self.clock is None:
            return best
        break
    return best

  def slower(self, form: Candidate, rates: list, best: Trial) -> bool:
    """Whether a shaped ``form`` is predicted slower than ``best`` (a plan
    that fits) by over :data:`TIME_MARGIN`, at the least seconds per unit of
    planner cost of the shaped forms compiled so far (``rates``): the
    planner's cost ranks them as the clock does, if not against other plans."""
    if not rates or best.seconds is None or best.measured > self.budget:
      return False
    return min(rates) * self.cost(form) > best.seconds * (1 + TIME_MARGIN)

  def lowest(self, tried: Trial, only_fitting: bool = False) -> list[Trial]:
    """The planner's candidates for the smallest footprint
    (:meth:`Planner.lowest`) and the last plan with its loops in each shape
    (:func:`~jaxmem.schedule._scan_remat.loop_variants`), compiled with ``tried``
    (the last plan compiled): the smallest of them is the smallest budget an
    error names (XLA's figure), and of those that fit the fit takes the
    cheapest. Compiled are those that may beat the smallest so far as it falls
    (:meth:`may_beat`), or with ``only_fitting`` fit the budget; none is
    sought where the floor may not (:func:`model_floor`)."""
    trials, seen = [tried], {tried.candidate.plan}
    wanted = ((lambda peak: self.may_come_under(peak, self.budget)) if only_fitting
              else (lambda peak: self.may_beat(peak, trials)))
    if not wanted(model_floor(self.graph)):
      return trials
    candidates = [unplanned(self.graph, 0)]  # the step as written is always one
    if self.smallest_from is not None:
      candidates += [candidate(self.graph, p) for p in self.smallest_from]
    elif self.graph.has_backward:
      candidates += self._remembered((self.graph, "lowest"),
                                     lambda: list(self.planner.lowest(self.graph)))
    variants = [candidate(self.graph, p)
                for p in loop_variants(self.graph, tried.candidate.plan,
                                       host=self.planner.may_offload())]
    # Lowest model peak first; one that cannot come under the smallest
    # footprint so far (or the budget) is not compiled.
    for option in sorted(list(candidates) + variants, key=lambda c: c.peak):
      if option.plan in seen or not wanted(option.peak):
        continue
      seen.add(option.plan)
      trials.append(self.compile(option))
    return trials

  def may_beat(self, peak: int, trials: list[Trial]) -> bool:
    """Whether a plan of model peak ``peak`` may come under the smallest
    footprint of ``trials`` and ``to_beat``, or the budget where one fits
    (:meth:`may_come_under`)."""
    least = min(t.measured for t in trials)
    least = least if self.to_beat is None else min(least, self.to_beat - self.reserve)
    return self.may_come_under(peak, max(least, self.budget))

  def may_come_under(self, peak: int, footprint: int, alike: list | None = None) -> bool:
    """Whether XLA's footprint of a plan of model peak ``peak`` may come under
    ``footprint``, by the most model bytes per XLA byte the steps compiled
    so far show, ``LOWEST_MARGIN`` more (the smallest footprint it may
    have); or, where given, by those of the plans ``alike`` it (ratios),
    ``ALIKE_MARGIN`` more."""
    most = (max(alike) * (1 + ALIKE_MARGIN) if alike else
            max([self.model_scale, *self._ratios]) * (1 + LOWEST_MARGIN))
    return peak / most + self.fixed <= footprint

  def error(self, smallest: int) -> BudgetError:
    """The error for a budget under ``smallest``, the least reached."""
    return budget_error(self.budget + self.reserve, self.reserve, self.unconstrained,
                        smallest, self.planner.name, self.where)
