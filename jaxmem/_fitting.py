"""How a transform fits its step: traced, planned on its graph, compiled
and checked against the budget, whole or in chunks of its batch.

:class:`Fitting` holds the fit of :class:`jaxmem.Transformed`, which
inherits it; it reads the transform's settings, listed in its docstring.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Callable

import jax
from jax.extend import core as jex

from jaxmem.fit import _plan_cache
from jaxmem.fit._shared import graph_of, measuring, once, planner_of
from jaxmem.fit._arguments import inherited_donations
from jaxmem._budget import BudgetError
from jaxmem._decisions import Plan
from jaxmem.cost._evaluate import Candidate, unplanned
from jaxmem.graph._state import apply_host_decisions
from jaxmem.fit._checks import fittable, no_backward
from jaxmem.fit._fit import Fitter
from jaxmem.fit._search import first_fit, search, state_places
from jaxmem.fit._unmet import NoPlanFits, budget_error, known_to_fail, remember, snug_plan
from jaxmem.fit._fitted import Fit, saved_plan
from jaxmem.fit._inner import body_of
from jaxmem.fit._jitting import jit_for
from jaxmem.graph._graph import Graph, trace
from jaxmem.fit._traced import (
    Written, as_written, changes, emitted, graphs, looped, target_clock)
from jaxmem.fit._micro import (
    AUTO, MicroBatches, argument_groups, cheaper, fit_chunked, fit_micro_batches,
    fit_whole_or_chunked, splittable, spread)
from jaxmem.fit._saved import Saved, fingerprint, load_plan, loads_saved
from jaxmem.planners import Fixed, get_planner
from jaxmem.targets import Target, resolve, timing_profile, workspace_bytes
from jaxmem.targets._host_args import devices_of, sharding_texts
from jaxmem.fit._host_state import compile_placed, leaf_names


def _applied(saved: Saved) -> tuple:
  """A saved plan as a fit applies it: its chunks (count, region) and the
  planner that proposes it."""
  return saved.micro_batches, saved.region, Fixed(saved.plan, source=saved.source,
                                                  around=saved.around)


class Fitting:
  """The fit of a transformed step (``_build``), for :class:`jaxmem.Transformed`.

  Reads the transform's settings: ``fun`` (the step), ``arguments``
  (``fit._arguments.Arguments``; a fit adds the donations a jitted step
  inherits), ``jit_kwargs``, ``budget`` (``jaxmem.Budget``), ``reserve``,
  ``max_rounds``, ``host_state``, ``micro_batches``, ``saved`` (the plan
  given), ``plan_cache``, ``_planner_spec`` (the planner as given) and
  ``__name__``.
  """

  def _placed(self, target: Target, args, kwargs) -> tuple[tuple, dict]:
    """The call's arguments as the target compiles them (abstract on a compile-only GPU)."""
    statics, dyn_args, dyn_kwargs = self.arguments.split(args, kwargs)
    leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
    return self.arguments.merge(statics, *tree.unflatten(target.place(leaves)))

  def _build(self, args, kwargs, leaves, target: Target,
             find_smallest: bool = True) -> Fit | None:
    """Traces the step and fits it (:meth:`_fit_traced`); where no plan
    fits, fits it in micro-batches (``fit._micro``)."""
    start = time.perf_counter()
    self.arguments = self.arguments.with_donations(
        *inherited_donations(self.fun, args, kwargs, self.arguments))
    profile = timing_profile(target)
    planner = (get_planner(self._planner_spec, profile) if not isinstance(self._planner_spec, str)
               else planner_of(self.fun, self._planner_spec, profile,
                               lambda: get_planner(self._planner_spec, profile)))
    closed, out_tree = trace(self.arguments.tracing(self.fun), *args, **kwargs)
    step = fingerprint(closed)
    count, region = self.micro_batches, False
    if self.saved is not None:
      count, region, planner = _applied(load_plan(self.saved, step, self.micro_batches))
    memo = (step, planner.describe(), target.name, self.max_rounds, self.host_state, count, region)
    in_bytes = lambda u: self._budget_bytes(u, target)  # noqa: E731
    if known_to_fail(self.fun, memo, in_bytes, find_smallest, planner.name, target.name):
      return None
    graph = graph_of(self.fun, closed)
    fittable(graph, self.__name__)
    fitting = functools.partial(self._fit_traced, out_tree=out_tree, step=step,
                                target=target, args=args, kwargs=kwargs, leaves=leaves,
                                start=start, find_smallest=find_smallest, graph=graph,
                                programs={}, plans={})
    written = once(graph, ("written", self._deciding(target, leaves, out_tree)), lambda: (
        self._written(closed, out_tree, target, leaves, args, kwargs, graph)))

    def fitted(count, region, planner):
      chunked = functools.partial(self._micro_batched, fitting, closed, planner, written,
                                  args, kwargs)
      if count not in (AUTO, 1):
        return chunked(counts=[count], region=region)
      if count == 1:
        return fitting(closed, planner, written)
      return fit_whole_or_chunked(
          functools.partial(fitting, closed, planner, written), chunked,
          lambda: splittable(graph, closed, *argument_groups(
              self.fun, self.arguments, args, kwargs), spread(leaves)), find_smallest)

    def reached(text: str) -> Fit | None:  # the plan that reached a remembered smallest
      with contextlib.suppress(BudgetError):
        return fitted(*_applied(loads_saved(text, step,
                                            "of the smallest footprint (an earlier fit's)")))
      return None

    # The budget an error named: the plan that reached it (else planned as any budget is).
    snug = None if self.saved is not None else snug_plan(self.fun, memo, in_bytes)
    found = reached(snug) if snug else None  # None also where can_fit's quick answer is no
    if found is not None:
      return found
    try:
      found, error = fitted(count, region, planner), None
    except BudgetError as err:
      found, error = None, err
    # A search that finds nothing where a remembered plan fits (its path
    # differs from the one that reached that smallest): that plan.
    if found is None and self.saved is None:
      known = snug_plan(self.fun, memo, in_bytes, math.inf)
      found = reached(known) if known and known != snug else None
    if found is not None or error is None:
      return found
    remember(self.fun, memo, error.smallest - self._reserve(target), written.footprint,
             error.plan)
    raise error

  def _micro_batched(self, fitting: Callable, closed, planner, written: Written, args,
                     kwargs, error: BudgetError | None = None,
                     counts=None, region: bool | None = None, fitted=None) -> Fit | None:
    """``fit._micro.fit_chunked`` by ``fitting`` (``cheaper`` where a plan ``fitted``)."""
    where = fitting.keywords
    budget, reserve = self._budget_bytes(written.footprint or 0, where["target"])
    measure = measuring(self.fun, self._deciding(where["target"], where["leaves"],
                                                 where["out_tree"]),
                        functools.partial(self._written, out_tree=where["out_tree"], args=args,
                                          target=where["target"], leaves=where["leaves"],
                                          kwargs=kwargs))
    split = functools.partial(
        fit_micro_batches,
        lambda traced, micro, least, own: fitting(traced, planner, written, micro=micro,
                                                  find_smallest=least, own=own.written,
                                                  graph=None),
        measure, where["graph"], closed, *argument_groups(self.fun, self.arguments, args, kwargs),
        written.footprint and budget - reserve, find_smallest=where["find_smallest"],
        strided=spread(where["leaves"]), written=written.footprint,
        unmet=written.footprint and (lambda least, micro: budget_error(
            budget, reserve, written.footprint, least, planner.name, where["target"].name,
            plan=saved_plan(where["graph"], Plan(), where["step"], None, micro))))
    return (cheaper(fitted, split, target_clock(where["target"])) if fitted
            else fit_chunked(split, error, counts, region))

  def _fit_traced(self, closed, planner, written: Written, *, target: Target, leaves,
                  find_smallest: bool, graph=None, **options) -> Fit | None:
    """Analyzes the traced step ``closed`` (the step as written, or run in
    micro-batches) and runs the fit loop (:class:`~jaxmem.fit._fit.Fitter`,
    by :meth:`_fit_graph`) against the budget of the step as ``written``.
    Where the step's passes run in a loop (micro-batches, gradient
    accumulation) and no plan of the loop's body fits, the same with its
    optimizer state (then master weights) in host memory between steps."""
    graph = graph_of(self.fun, closed) if graph is None else graph
    fit = functools.partial(self._fit_graph, closed, planner, written, target=target,
                            leaves=leaves, find_smallest=find_smallest, **options)
    if isinstance(planner, Fixed) and planner.around:  # a saved plan's state on the host
      return fit(graph=apply_host_decisions(graph, planner.around)[0])
    if not (self._may_host(target) and looped(graph)):
      return fit(graph=graph)
    return first_fit(functools.partial(fit, graph=tried)
                     for tried in state_places(graph, timing_profile(target)))

  def _fit_graph(self, closed, planner, written: Written, *, out_tree, step: str,
                 target: Target, args, kwargs, leaves, start: float, find_smallest: bool,
                 micro: MicroBatches | None = None, own: Written | None = None,
                 graph=None, only_fitting: bool = False, to_beat: int | None = None,
                 programs: dict | None = None, plans: dict | None = None) -> Fit | None:
    """:meth:`_fit_traced` of one graph of the step (its optimizer state
    kept in host memory, ``Graph.hosted``, or not); ``only_fitting`` as
    :meth:`Fitter.fit` takes it; ``programs`` and ``plans``: the executables
    compiled and the plans made so far in this fit (each once)."""
    here = resolve(None, leaves)  # where the step runs, which the target may not be
    own = own or written
    graph, loop, planned, planner = graphs(closed, target, planner, self.__name__, graph, leaves,
                                           own)
    placed_args, placed_kwargs = self._placed(target, args, kwargs)
    base_memory = unplanned(graph, 0).memory  # the step as written
    unconstrained = written.footprint or base_memory.peak
    emitter = functools.partial(emitted, own, graph, loop)
    no_backward(planned)

    def jit(candidate: Candidate):
      if not changes(candidate, graph):  # as written: for the target, or as it runs here
        return own.baseline if own.one_program or not own.in_place else own.jitted.lower(
            *placed_args, **placed_kwargs).compile()
      hosting = candidate.schedule.graph if loop is None else graph
      measuring = self._jit(emitter(candidate), out_tree, target, hosting,
                            target.place(leaves), measuring=True)
      return compile_placed(measuring, target, hosting, self.arguments,
                            placed_args, placed_kwargs, programs)

    budget, reserve = self._budget_bytes(unconstrained, target)
    model = base_memory if loop is None else unplanned(planned, 0).memory
    fixed = 0 if graph.buffers and graph.buffers.workspace else workspace_bytes(own.baseline)
    clock = target_clock(target)
    fitter = functools.partial(Fitter, budget=budget - reserve,
                               unconstrained=unconstrained,
                               model_scale=model.peak / max((own.footprint or model.peak)
                                                            - fixed, 1), jit=jit,
                               max_rounds=self.max_rounds, reserve=reserve, where=target.name,
                               fixed=fixed, clock=clock, plans=plans, to_beat=to_beat,
                               program_key=self._deciding(target, leaves, out_tree),
                               own_footprint=None if own is written else own.footprint)
    cached = None if micro or self.saved is not None else _plan_cache.entry(
        self.plan_cache, step, leaves, target, planner, budget=budget, reserve=reserve,
        max_rounds=self.max_rounds, host_state=self.host_state)
    saved = None if cached is None else _plan_cache.get(*cached, step)
    try:
      planned, planner, found = search(
          fitter, planned, planner, find_smallest, loop is None and self._may_host(target),
          None if saved is None else (saved, _plan_cache.path(*cached)),
          timing_profile(target), only_fitting)
    except NoPlanFits as err:  # the user's error, with the plan that reached its smallest
      raise BudgetError(str(err), smallest=err.smallest, plan=saved_plan(
          err.graph, err.plans[0], step, err.graph if loop is None else graph, micro,
          target=target.name, planner=planner.describe(),
          footprint=err.smallest - reserve)) from None
    if found is None:
      return None
    trial, attempts = found
    run_flat = emitter(trial.candidate)
    hosting = planned if loop is None else graph
    jitted = (own.jitted if own.in_place and not changes(trial.candidate, graph)
              else self._jit(run_flat, out_tree, here, hosting, leaves))
    fit = Fit(planned, trial.candidate, planner, budget, target, unconstrained,
               model.peak, trial.footprint, trial.candidate.schedule.recompute_flops,
               sum(n.flops for n in planned.nodes), attempts, time.perf_counter() - start,
               jitted, self._jit(run_flat, out_tree, None) if here.options() else jitted,
               reserve, None if loop is None or micro else body_of(graph, loop), out_tree,
               run_flat, {here.name: jitted}, trial.seconds,
               None if clock is None else clock(written.baseline), step,
               leaf_names(self.arguments, args, kwargs), micro, devices_of(leaves), hosting)
    if cached is not None and fit.result.changes_step and not isinstance(planner, Fixed):
      _plan_cache.put(*cached, fit.saved())  # planned here: kept for the next run
    return fit

  def _written(self, closed, out_tree, target: Target, leaves, args, kwargs, graph=None
               ) -> Written:
    """The traced step as written (:func:`~jaxmem.fit._traced.as_written`)."""
    here, run = resolve(None, leaves), jex.jaxpr_as_fun(closed)
    return as_written(run, self._jit(run, out_tree, here, leaves=leaves), target, here, leaves,
                      self._placed(target, args, kwargs), self.arguments.donates, graph)

  def _deciding(self, target: Target, leaves, out_tree) -> tuple:
    """What decides a traced step's program beside its equations: the
    target, the arguments' shardings, the static and donated arguments, the
    ``jax.jit`` options and the output tree."""
    return (target.name, sharding_texts(leaves), self.arguments,
            repr(sorted(self.jit_kwargs.items())), out_tree)

  def _may_host(self, target: Target) -> bool:
    """Whether a fit may keep the optimizer state in host memory."""
    return self.host_state and target.may_host_state()

  def _budget_bytes(self, unconstrained: int, target: Target) -> tuple[int, int]:
    return self.budget.in_bytes(unconstrained, self._reserve(target))

  def _reserve(self, target: Target) -> int:
    return self.budget.reserve(self.reserve, target.reserve())

  def _jit(self, run_flat: Callable, out_tree, where: Target | None,
           graph: Graph | None = None, leaves=(), measuring: bool = False):
    """``fit._jitting.jit_for`` with this transform's arguments and options."""
    return jit_for(self.arguments, self.fun, self.jit_kwargs, run_flat, out_tree, where, graph,
                   leaves, measuring)
