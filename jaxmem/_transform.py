"""The public transform: a training step fitted to a budget, shaped like ``jax.jit``."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable

import jax
from jax.extend import core as jex

from jaxmem.fit import _plan_cache
from jaxmem.fit._shared import graph_of, measuring, planner_of
from jaxmem.fit._arguments import Arguments, as_sharded, inherited_donations
from jaxmem.fit._batching import batchable
from jaxmem._budget import Budget, BudgetError
from jaxmem._decisions import Plan
from jaxmem.cost._evaluate import Candidate, paused_gc, unplanned
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
    AUTO, MicroBatches, argument_groups, cheaper, checked_count, fit_chunked, fit_micro_batches,
    fit_whole_or_chunked, splittable, spread)
from jaxmem.fit._saved import fingerprint, load_plan, loads_saved
from jaxmem.planners import Fixed, get_planner
from jaxmem.targets import Target, resolve, timing_profile, workspace_bytes
from jaxmem.targets._host_args import devices_of, sharding_texts
from jaxmem.fit._host_state import (
    compile_placed, leaf_names, lower_placed, on_device, place_state,
    placed_compile_only)

_Tracer = jax.core.Tracer


class Transformed:
  """A training step fitted to a memory budget; made by :func:`transform`.

  Call it like the step. ``.lower``, ``.trace``, ``.eval_shape`` and
  ``.clear_cache`` are ``jax.jit``'s; ``.fit(*args)`` gives the :class:`Fit`
  (what was decided) and ``.report(*args)`` a readable summary, for the
  given arguments' shapes."""

  def __init__(self, fun, budget, planner, static_argnums, static_argnames,
               jit_kwargs, max_rounds, reserve=None, target=None, plan=None,
               plan_cache=None, host_state=True, micro_batches=AUTO):
    self.fun = fun
    self.micro_batches = checked_count(micro_batches)
    self.saved = plan  # a Plan, or a path to a saved one
    self.plan_cache = plan_cache
    self.host_state = host_state
    self.budget = Budget.parse(budget)
    self.target = target
    if target is not None:
      resolve(target, ())  # an unknown or undescribed target fails here
    self.planner = get_planner(planner)  # a bad planner fails here
    self._planner_spec = planner
    jit_kwargs = dict(jit_kwargs)
    self.arguments = Arguments.resolve(
        fun, static_argnums, static_argnames,
        jit_kwargs.pop("donate_argnums", ()), jit_kwargs.pop("donate_argnames", ()))
    self.jit_kwargs = jit_kwargs
    self.max_rounds = max_rounds
    if reserve is not None and (not isinstance(reserve, int) or reserve < 0):
      raise BudgetError(f"jaxmem: reserve must be a number of bytes >= 0 or None (the "
                        f"platform's default), got {reserve!r}")
    self.reserve = reserve
    self._fits, self._batched = {}, {}  # fits per shapes; vmapped steps per batching
    try:
      self.__wrapped__ = fun
      self.__name__ = getattr(fun, "__name__", "step")
      self.__doc__ = getattr(fun, "__doc__", None)
    except AttributeError:  # pragma: no cover
      pass

  def __call__(self, *args, **kwargs):
    fit = self.fit(*args, **kwargs)
    if not any(isinstance(leaf, _Tracer) for leaf in jax.tree_util.tree_leaves((args, kwargs))):
      args, kwargs = place_state(self.arguments, fit.hosted, args, kwargs)
      return self._runner(fit, args, kwargs)(*args, **kwargs)
    # Under an outer transformation; under jax.vmap, planned again for the
    # batched shapes (_batching).
    statics, dyn_args, dyn_kwargs = self.arguments.split(args, kwargs)
    leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))

    flat = self._over_leaves(fit.nested, statics, tree)
    step = batchable(flat, functools.partial(self._vmapped, statics, tree))
    return fit.out_tree.unflatten(step(*leaves))

  def _over_leaves(self, fun: Callable, statics, tree) -> Callable:
    """``fun`` (called like the step) over the flat dynamic leaves, to its output's leaves."""
    def flat(*leaves):
      args, kwargs = self.arguments.merge(statics, *tree.unflatten(leaves))
      return jax.tree_util.tree_leaves(fun(*args, **kwargs))
    return flat

  def _placed(self, target: Target, args, kwargs) -> tuple[tuple, dict]:
    """The call's arguments as the target compiles them (abstract on a compile-only GPU)."""
    statics, dyn_args, dyn_kwargs = self.arguments.split(args, kwargs)
    leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
    return self.arguments.merge(statics, *tree.unflatten(target.place(leaves)))

  def _vmapped(self, statics, tree, in_batched: tuple[bool, ...]) -> "Transformed":
    """This step vmapped over the flat leaves ``in_batched`` marks, fitted
    to the same budget (one per static values, tree and batching)."""
    key = (statics, tree, in_batched)
    if key not in self._batched:
      step = self._over_leaves(self.fun, statics, tree)
      axes = tuple(0 if batched else None for batched in in_batched)
      vmapped = functools.wraps(self.fun)(jax.vmap(step, in_axes=axes))
      self._batched[key] = Transformed(vmapped, self.budget, self._planner_spec, (), (),
                                       {}, self.max_rounds, self.reserve, self.target,
                                       plan_cache=self.plan_cache,
                                       host_state=self.host_state,
                                       micro_batches=self.micro_batches)
    return self._batched[key]

  def lower(self, *args, **kwargs):
    """``jax.jit``'s ``lower`` for the transformed step."""
    fit = self.fit(*args, **kwargs)
    # Described in host memory, not copied there: lowering moves nothing.
    args, kwargs = place_state(self.arguments, fit.hosted, args, kwargs,
                               abstract=True)
    return lower_placed(self._runner(fit, args, kwargs).lower(*args, **kwargs), fit.hosted,
                        args, kwargs)

  def trace(self, *args, **kwargs):
    """``jax.jit``'s ``trace`` for the transformed step: the planned step
    traced for these arguments (``.jaxpr``, ``.lower()``)."""
    fit = self.fit(*args, **kwargs)
    if fit.hosted and placed_compile_only(args, kwargs):
      raise NotImplementedError("jaxmem: trace() cannot mark the optimizer state a fit for a GPU "
                                "not here keeps in host memory; use .lower(*args) instead.")
    args, kwargs = place_state(self.arguments, fit.hosted, args, kwargs, abstract=True)
    return self._runner(fit, args, kwargs).trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    """``jax.jit``'s ``eval_shape``, without fitting (a plan changes no output)."""
    return self.arguments.tracing(self.fun).eval_shape(*args, **kwargs)

  def clear_cache(self) -> None:
    """``jax.jit``'s ``clear_cache``: forgets the fits made, so the next call fits again."""
    self._fits.clear()
    self._batched.clear()

  def _runner(self, fit: Fit, args, kwargs):
    """The fit's ``jax.jit`` for the platform these arguments are on or
    placed on (a fit for a target runs here as it lowers there)."""
    leaves = jax.tree_util.tree_leaves(self.arguments.split(args, kwargs)[1:])
    where = resolve(None, leaves)
    if where.name not in fit.runners:
      fit.runners[where.name] = self._jit(fit.run, fit.out_tree, where, fit.graph, leaves)
    return fit.runners[where.name]

  def report(self, *args, **kwargs) -> str:
    """:meth:`Fit.report` of the fit for these arguments (``top``: ``.fit(*args).report(top=)``)."""
    return self.fit(*args, **kwargs).report()

  def fit(self, *args, **kwargs) -> Fit:
    """Fits the step (once per shapes, dtypes and static values) and returns
    what was decided."""
    return self._cached(args, kwargs, find_smallest=True)

  def save_plan(self, path, *args, **kwargs) -> None:
    """Saves the plan fitted for these arguments (or, with none given, the
    one signature fitted so far) as JSON; ``transform(step, budget,
    plan=path)`` applies it again without planning."""
    if not (args or kwargs) and len(self._fits) != 1:
      raise ValueError(
          f"jaxmem: save_plan(path) without arguments needs exactly one fitted "
          f"signature, got {len(self._fits)}; pass the step's arguments "
          "(save_plan(path, *args)) to say which plan.")
    fit = self.fit(*args, **kwargs) if args or kwargs else next(iter(self._fits.values()))
    fit.save_plan(path)

  def can_fit(self, *args, **kwargs) -> bool:
    """A quick check that the budget can be met for these arguments
    (shapes suffice, e.g. from ``jax.eval_shape``), for batch-size searches.

    Fits like :meth:`fit` and keeps a fit that succeeds, but where the
    planner's search toward the budget fails, and no plan shaped like the
    per-block remat baselines fits either, it answers False instead of
    looking for the smallest footprint (which :meth:`fit`'s error names,
    and which can occasionally still fit): True means :meth:`fit`
    succeeds; False means it most likely raises.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> step = lambda w, x: w - jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
      >>> jaxmem.transform(step, budget="100%").can_fit(jnp.eye(8), jnp.ones((4, 8)))
      True
    """
    return self._cached(args, kwargs, find_smallest=False) is not None

  def _cached(self, args, kwargs, find_smallest: bool) -> Fit | None:
    """The fit for these arguments' signature, built once (see ``_build``;
    a None is not kept)."""
    try:
      key, leaves = self.arguments.signature(args, kwargs)
    except TypeError:
      # An argument that is not an array: jax.jit's error names its path.
      self.arguments.tracing(self.fun).trace(*args, **kwargs)
      raise
    target = resolve(self.target, leaves)
    key = (*key, target.name)  # arguments placed elsewhere: another target
    if key not in self._fits:
      args, kwargs, leaves = as_sharded(self.arguments, self.jit_kwargs.get("in_shardings"),
                                        *on_device(self.arguments, args, kwargs))
      with paused_gc(), target.compiling():  # gc: many objects made, few in cycles
        fit = self._build(args, kwargs, leaves, target, find_smallest)
      if fit is None:
        return None
      self._fits[key] = fit
    return self._fits[key]

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
      loaded = load_plan(self.saved, step, self.micro_batches)
      count, region = loaded.micro_batches, loaded.region
      planner = Fixed(loaded.plan, source=loaded.source, around=loaded.around)
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
    written = self._written(closed, out_tree, target, leaves, args, kwargs, graph)

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

    if self.saved is None and (snug := snug_plan(self.fun, memo, in_bytes)):
      # The budget an error named: the plan that reached it (else planned as any budget is).
      loaded = loads_saved(snug, step, "of the smallest footprint (an earlier fit's)")
      with contextlib.suppress(BudgetError):
        found = fitted(loaded.micro_batches, loaded.region,
                       Fixed(loaded.plan, source=loaded.source, around=loaded.around))
        if found is not None:  # can_fit's quick answer may be no
          return found
    try:
      return fitted(count, region, planner)
    except BudgetError as err:
      remember(self.fun, memo, err.smallest - self._reserve(target), written.footprint, err.plan)
      raise

  def _micro_batched(self, fitting: Callable, closed, planner, written: Written, args,
                     kwargs, error: BudgetError | None = None,
                     counts=None, region: bool | None = None, fitted=None) -> Fit | None:
    """``fit._micro.fit_chunked`` by ``fitting`` (``cheaper`` where a plan ``fitted``)."""
    where = fitting.keywords
    budget, reserve = self._budget_bytes(written.footprint or 0, where["target"])
    measure = measuring(self.fun, (
        where["target"].name, sharding_texts(where["leaves"]),
        self.arguments.donates, repr(sorted(self.jit_kwargs.items()))),
        functools.partial(self._written, out_tree=where["out_tree"], args=args,
                          target=where["target"], leaves=where["leaves"], kwargs=kwargs))
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


def transform(fun: Callable, budget, *, planner="auto", target=None,
              static_argnums=(), static_argnames=(), max_rounds: int = 4,
              reserve: int | None = None, plan=None, plan_cache=None,
              host_state: bool = True, micro_batches="auto", **jit_kwargs) -> Transformed:
  """Fits a training step into a device-memory budget.

  The step (forward, backward and optimizer update in one function) is
  traced once per argument signature, its residuals planned so that XLA's
  compiled footprint stays within ``budget``, and the joint jaxpr rewritten
  with the plan and compiled with ``jax.jit``; it computes ``fun``'s numbers.

  Args:
    fun: the training step.
    budget: bytes (int), a string with a unit (``"3GiB"``, ``"512MB"``) or a
      fraction of the unconstrained footprint (``"60%"``, ``0.6``).
    planner: a name from ``jaxmem.PLANNERS`` or a :class:`jaxmem.Planner`.
      The default, ``"auto"``, solves for the cheapest combination of
      per-block policies and lone recomputations (:class:`jaxmem.ILP`), and
      where none fits takes the greedy's plan, or on a ``target`` with a
      host link of its own the hybrid's (recomputation and offload).
    target: the device planned and compiled for; None: the one the
      arguments are on (this machine's GPU or CPU). A name in
      ``jaxmem.PROFILES`` (``"t4"``) or a :class:`jaxmem.DeviceProfile`:
      XLA:GPU's program for that GPU, compiled here with JAX's CUDA plugin
      (``jaxmem[target]``). A planner object keeps its own target.
    static_argnums, static_argnames: as for ``jax.jit`` (a name also makes
      its position static, an index its name; negative indices count from
      the end of the call's positional arguments).
    max_rounds: how often to re-plan with a tighter model target when XLA's
      footprint exceeds the budget.
    reserve: bytes of the budget kept free for what the runtime allocates
      beyond XLA's footprint (cuDNN/cuBLAS workspaces). None: 128 MiB for a
      budget in bytes on a GPU or other accelerator; 0 on CPU and for a
      fraction (a share of XLA's footprint, which leaves them out).
    plan: a plan to apply instead of planning: a path to one saved by
      :meth:`Fit.save_plan` (refused if the step or its argument shapes
      changed since) or a :class:`jaxmem.Plan`. It is compiled once and kept
      if it fits the budget.
    plan_cache: a directory that keeps plans across runs (None: the
      environment variable ``JAXMEM_PLAN_CACHE_DIR``, or none), keyed by the
      traced step, the arguments' shapes and shardings, the budget, target,
      planner and the versions of jaxmem and JAX; a hit is compiled once
      without planning and taken where it fits (else planned again).
    host_state: whether, on a GPU with a host link, the optimizer state
      (arguments only its update reads: Adam's moments), then a mixed-precision
      step's float32 master weights, may stay in ``pinned_host`` memory between
      steps where no plan fits with them on the device (``Fit.hosted``).
    micro_batches: ``"auto"``: where no plan fits, the region around the
      step's peak (a loss head) runs over chunks of the batch, else the whole
      step over micro-batches with gradients accumulated, as few as fit
      (``Fit.micro``); the batch is the arguments whose leaves share one
      leading dimension. A number: that many micro-batches (1: no chunks).
    **jit_kwargs: passed to ``jax.jit``. ``donate_argnums`` /
      ``donate_argnames`` donate as there; a step already wrapped in
      ``jax.jit`` with donated arguments keeps its donation.

  Returns:
    A :class:`Transformed` callable.

  Raises:
    BudgetError: for a budget that cannot be read or met (naming the
      smallest footprint reached).

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def step(w, x):
    ...   def loss(w):
    ...     h = x
    ...     for _ in range(8):
    ...       h = h + jnp.tanh(h @ w)
    ...     return jnp.sum(h)
    ...   return w - 0.1 * jax.grad(loss)(w)
    >>> fitted = jaxmem.transform(step, budget="70%")
    >>> w, x = jnp.eye(64), jnp.ones((256, 64))
    >>> bool(jnp.allclose(fitted(w, x), jax.jit(step)(w, x), atol=1e-6))
    True
  """
  return Transformed(fun, budget, planner, static_argnums, static_argnames,
                     jit_kwargs, max_rounds, reserve, target, plan, plan_cache,
                     host_state, micro_batches)
