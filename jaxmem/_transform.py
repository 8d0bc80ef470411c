"""The public transform: plan, rewrite and compile a training step."""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable

import jax
from jax.extend import core as jex

from jaxmem import _flags
from jaxmem._budget import Budget, BudgetError, format_bytes
from jaxmem._emit import emit
from jaxmem._graph import Graph, build_graph, trace
from jaxmem._memory import MemoryProfile
from jaxmem._plan import Plan
from jaxmem._devices import get_profile
from jaxmem._perf import predict_schedule
from jaxmem._planners import PlanResult, evaluate, get_planner, unplanned
from jaxmem._report import residual_table


def xla_footprint(compiled) -> int | None:
  """Device bytes of a compiled step: temp + arguments + outputs - aliases.

  This is how DESIGN.md fact 4 reads ``Compiled.memory_analysis()``; on CPU
  its ``peak_memory_in_bytes`` leaves temporaries out. Returns None where the
  backend gives no analysis.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> c = jax.jit(lambda x: x * 2).lower(jnp.ones(256)).compile()
    >>> xla_footprint(c)
    2048
  """
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes
             + stats.output_size_in_bytes - stats.alias_size_in_bytes)


@dataclasses.dataclass
class StepPlan:
  """Everything jaxmem decided for one argument signature.

  Attributes:
    graph: the analyzed joint graph.
    result: the planner's result (plan, schedule, memory profile).
    budget: the budget in bytes.
    unconstrained: XLA's footprint of the untransformed step.
    unconstrained_model: the memory model's footprint of the untransformed step.
    footprint: XLA's footprint of the transformed step (None if unavailable).
    added_flops: FLOPs the recomputation adds per step.
    base_flops: FLOPs of the untransformed step (jaxmem's rule table).
    attempts: planning rounds (the model target tightens when XLA disagrees).
    seconds: planning time, compilation included.
  """
  graph: Graph
  result: PlanResult
  budget: int
  unconstrained: int
  unconstrained_model: int
  footprint: int | None
  added_flops: float
  base_flops: float
  attempts: int
  seconds: float
  jitted: Any = dataclasses.field(repr=False, default=None)

  @property
  def plan(self) -> Plan:
    return self.result.plan

  @property
  def profile(self) -> MemoryProfile:
    return self.result.profile

  def report(self, top: int | None = 20) -> str:
    """A readable summary of the budget, the plan and the residuals."""
    p = self.result.profile
    decisions = {vid: d.kind for vid, d in self.plan}
    fp = "n/a" if self.footprint is None else format_bytes(self.footprint)
    saved = self.plan.values_with("save")
    saved_bytes = sum(self.graph.values[v].nbytes for v in saved)
    lines = [
        f"budget            {format_bytes(self.budget)}",
        f"unconstrained     {format_bytes(self.unconstrained)} (XLA), "
        f"{format_bytes(self.unconstrained_model)} (model)",
        f"planned           {fp} (XLA), {format_bytes(p.peak)} (model)",
        f"peak at           {p.peak_name}",
        f"decisions         {len(self.plan) - len(saved)} of {len(self.graph.residuals)} "
        f"residuals changed ({len(self.plan.values_with('recompute'))} recomputed, "
        f"{len(self.plan.values_with('offload'))} offloaded, "
        f"{len(self.plan.values_with('chunked'))} split into vTensors; "
        f"{format_bytes(p.host_peak)} on the host at most); {len(saved)} "
        f"block boundaries saved ({format_bytes(saved_bytes)})",
        f"added FLOPs       {self.added_flops:.3g} "
        f"({self.added_flops / max(self.base_flops, 1.0):.1%} of the step)",
        f"planning time     {self.seconds:.2f} s ({self.attempts} round(s))",
        "",
        residual_table(self.graph, top=top, decisions=decisions),
    ]
    if hasattr(self.result.details, "table"):  # the LGM planner's swaps
      lines += ["", "vTensor swaps (layer, its deficit, tensor, chunks swapped/cut, bytes):",
                self.result.details.table()]
    return "\n".join(lines)


def _as_tuple(value) -> tuple:
  return (value,) if isinstance(value, (int, str)) else tuple(value)


def _holds_host_memory(compiled) -> bool:
  """Whether a compiled program puts anything in host memory."""
  stats = compiled.memory_analysis()
  return stats is not None and bool(
      stats.host_temp_size_in_bytes or stats.host_output_size_in_bytes
      or stats.host_argument_size_in_bytes)


def _measured(result: PlanResult, footprint: int | None) -> int:
  """XLA's footprint of a planned step, or the model's where XLA gives none."""
  return result.peak if footprint is None else footprint


def _split_static(args, kwargs, static_argnums, static_argnames):
  """The dynamic positional and keyword arguments, statics left out."""
  dyn_args = tuple(a for i, a in enumerate(args) if i not in static_argnums)
  dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_argnames}
  return dyn_args, dyn_kwargs


def _signature(args, kwargs, static_argnums, static_argnames):
  dyn_args, dyn_kwargs = _split_static(args, kwargs, static_argnums, static_argnames)
  statics = (tuple(args[i] for i in static_argnums if i < len(args)),
             tuple(sorted((k, kwargs[k]) for k in static_argnames if k in kwargs)))
  leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
  key = (statics, tree, tuple(jax.typeof(x) for x in leaves))
  return key, dyn_args, dyn_kwargs, leaves


class Transformed:
  """A training step fitted to a memory budget; made by :func:`transform`.

  Call it like the step. ``.lower(*args)`` gives ``jax.jit``'s AOT stages
  (``.compile().memory_analysis()``), ``.plan(*args)`` the :class:`StepPlan`
  and ``.report(*args)`` a readable summary, for the given arguments' shapes.
  """

  def __init__(self, fun, budget, planner, static_argnums, static_argnames,
               jit_kwargs, max_rounds):
    self.fun = fun
    self.budget = Budget.parse(budget)
    self.planner = get_planner(planner)
    # Like jax.jit: a single int / str or a sequence of them.
    self.static_argnums = _as_tuple(static_argnums)
    self.static_argnames = _as_tuple(static_argnames)
    self.jit_kwargs = jit_kwargs
    self.max_rounds = max_rounds
    self._plans: dict = {}
    try:
      self.__wrapped__ = fun
      self.__name__ = getattr(fun, "__name__", "step")
      self.__doc__ = getattr(fun, "__doc__", None)
    except AttributeError:  # pragma: no cover
      pass

  def __call__(self, *args, **kwargs):
    return self.plan(*args, **kwargs).jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    """``jax.jit``'s ``lower`` for the transformed step."""
    return self.plan(*args, **kwargs).jitted.lower(*args, **kwargs)

  def report(self, *args, **kwargs) -> str:
    return self.plan(*args, **kwargs).report()

  def plan(self, *args, **kwargs) -> StepPlan:
    """Plans (once per shapes, dtypes and static values) and returns the plan."""
    return self._cached_plan(args, kwargs, find_smallest=True)

  def fits(self, *args, **kwargs) -> bool:
    """A quick check that the budget can be met for these arguments
    (shapes suffice, e.g. from ``jax.eval_shape``), for batch-size searches.

    Plans like :meth:`plan` and keeps a plan that fits, but where the
    planner's search toward the budget fails, and no plan shaped like the
    per-block remat baselines fits either, it answers False instead of
    looking for the smallest footprint (which :meth:`plan`'s error names,
    and which can occasionally still fit): True means :meth:`plan`
    succeeds; False means it most likely raises.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> step = lambda w, x: w - jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
      >>> jaxmem.transform(step, budget="100%").fits(jnp.eye(8), jnp.ones((4, 8)))
      True
    """
    return self._cached_plan(args, kwargs, find_smallest=False) is not None

  def _cached_plan(self, args, kwargs, find_smallest: bool) -> StepPlan | None:
    """The plan for these arguments' signature, built once (see ``_build``;
    a None is not kept)."""
    key, dyn_args, dyn_kwargs, leaves = _signature(
        args, kwargs, self.static_argnums, self.static_argnames)
    if key not in self._plans:
      plan = self._build(args, kwargs, dyn_args, dyn_kwargs, leaves, find_smallest)
      if plan is None:
        return None
      self._plans[key] = plan
    return self._plans[key]

  def _bound(self, args, kwargs):
    """The step with its static arguments bound, over dynamic ones only."""
    statics = {i: args[i] for i in self.static_argnums if i < len(args)}
    static_kw = {k: kwargs[k] for k in self.static_argnames if k in kwargs}
    n = len(args)

    def bound(*dyn_args, **dyn_kwargs):
      it = iter(dyn_args)
      full = [statics[i] if i in statics else next(it) for i in range(n)]
      return self.fun(*full, **dyn_kwargs, **static_kw)

    return bound

  def _build(self, args, kwargs, dyn_args, dyn_kwargs, leaves,
             find_smallest: bool = True) -> StepPlan | None:
    """Plans and compiles; a budget that cannot be met raises
    :class:`BudgetError` naming the smallest footprint (or, without
    ``find_smallest``, gives None before searching for it)."""
    start = time.perf_counter()
    _flags.enable_cpu_remat()
    closed, in_tree, out_tree = trace(self._bound(args, kwargs), *dyn_args, **dyn_kwargs)
    graph = build_graph(closed)
    baseline = jax.jit(jex.jaxpr_as_fun(closed)).lower(*leaves).compile()
    unconstrained = xla_footprint(baseline)
    _, base_profile = evaluate(graph, Plan())
    if unconstrained is None:
      unconstrained = base_profile.peak
    budget = self.budget.resolve(unconstrained)
    base_flops = sum(n.flops for n in graph.nodes)
    if not graph.has_backward:
      warnings.warn(
          "jaxmem: the step has no backward pass (no transposed equations in "
          "its jaxpr), so there are no residuals to recompute or offload; it "
          "is compiled unchanged.", stacklevel=3)
    # The model and XLA disagree by a few percent; aim the model at the budget
    # scaled by their ratio on the untransformed step, and tighten if XLA's
    # number for the planned step still exceeds the budget. Last resort: the
    # planner's lowest plan, which is what an infeasible budget's error names.
    scale = model_scale = base_profile.peak / unconstrained
    attempts = 0
    lowest = None
    previous = None
    while True:
      attempts += 1
      target = int(budget * scale)
      if graph.has_backward and budget < unconstrained and base_profile.peak > target:
        result = self.planner.plan(graph, target, start=previous)
        previous = result.plan
      else:
        result = unplanned(graph, target)
      jitted, footprint = self._compile(result, out_tree, args, kwargs, model_scale)
      if _measured(result, footprint) <= budget:
        if find_smallest and len(result.plan):
          found = self._loosen(graph, out_tree, args, kwargs, (result, jitted, footprint),
                               budget, model_scale)
          result, jitted, footprint = self._structured(graph, out_tree, args, kwargs,
                                                       found, budget, model_scale)
        break
      if result.fits and attempts < self.max_rounds:
        scale *= budget / _measured(result, footprint) * 0.99
        continue
      if lowest is None and not find_smallest:
        # A search toward the budget can fail where a plan shaped like the
        # per-block baselines fits far under it: those are compiled before
        # answering no.
        shaped = self._structured(graph, out_tree, args, kwargs,
                                  (result, jitted, footprint), budget, model_scale,
                                  cheaper=False)
        if _measured(shaped[0], shaped[2]) > budget:
          return None
        result, jitted, footprint = shaped
        break
      if lowest is None:
        lowest = self._lowest(graph, out_tree, args, kwargs, (result, jitted, footprint),
                              model_scale)
      result, jitted, footprint = lowest
      smallest = _measured(result, footprint)
      if smallest <= budget:
        break
      raise BudgetError(
          f"jaxmem: budget {format_bytes(budget)} ({budget / unconstrained:.0%} "
          f"of the unconstrained {format_bytes(unconstrained)}) cannot be met "
          f"by planner {self.planner.name!r}: the smallest footprint it reaches "
          f"for this step is {format_bytes(smallest)} ({smallest} bytes, "
          f"{smallest / unconstrained:.0%}). Pass budget >= {smallest} bytes, "
          "or shrink the batch.", smallest=smallest)
    return StepPlan(graph, result, budget, unconstrained, base_profile.peak,
                    footprint, result.schedule.recompute_flops, base_flops,
                    attempts, time.perf_counter() - start, jitted)

  def _loosen(self, graph, out_tree, args, kwargs, found, budget, model_scale,
              rounds: int = 2):
    """A fitting plan well under the budget, where the model rates the
    plan's savings below what XLA gives them, recomputes more than it needs
    to: re-planned up to ``rounds`` times for a looser model target
    (bisecting between the last target that fit and the first that did
    not), a plan is taken if XLA's footprint still fits and it costs less
    (predicted time on the planner's device profile, else recomputed
    FLOPs)."""
    result, jitted, footprint = found
    measured = _measured(result, footprint)
    low, high = result.target / budget, None
    for _ in range(rounds):
      if measured >= 0.95 * budget:
        break
      scale = (low + high) / 2 if high else low * budget / measured * 0.99
      trial = self.planner.plan(graph, int(budget * scale))
      if trial.fits and trial.plan != result.plan:
        t_jitted, t_footprint = self._compile(trial, out_tree, args, kwargs, model_scale)
        if (_measured(trial, t_footprint) <= budget
            and self._cost(trial) < self._cost(result)):
          result, jitted, footprint = trial, t_jitted, t_footprint
          measured, low = _measured(trial, t_footprint), scale
          continue
      high = scale
    return result, jitted, footprint

  def _structured(self, graph, out_tree, args, kwargs, found, budget, model_scale,
                  cheaper: bool = True):
    """The planner's plans shaped like the per-block remat baselines
    (``structured``), cheapest first, where they cost less than the plan
    found (any cost, without ``cheaper``): the first whose XLA footprint
    fits the budget replaces it."""
    if not hasattr(self.planner, "structured"):
      return found
    cost = self._cost(found[0]) if cheaper else float("inf")
    for candidate in self.planner.structured(graph):
      if self._cost(candidate) >= cost:
        break
      candidate = dataclasses.replace(candidate, target=found[0].target, fits=True)
      jitted, footprint = self._compile(candidate, out_tree, args, kwargs, model_scale)
      if _measured(candidate, footprint) <= budget:
        return candidate, jitted, footprint
    return found

  def _cost(self, result: PlanResult) -> float:
    """What a plan costs: predicted seconds on the planner's device profile,
    or without one the FLOPs it recomputes."""
    profile = getattr(self.planner, "profile", None)
    if profile is None:
      return result.schedule.recompute_flops
    return predict_schedule(result.schedule, get_profile(profile)).seconds

  def _compile(self, result, out_tree, args, kwargs, model_scale):
    """Jits ``result``'s schedule; returns it with XLA's footprint (None where
    the backend gives no memory analysis).

    A backend that ignores host memory (XLA:CPU, DESIGN.md fact 2) keeps
    offloaded values in device memory: for a plan with offloads there, the
    footprint is the memory model's device peak, in XLA's scale
    (``model_scale``: model over XLA on the untransformed step)."""
    jitted = self._jit(result, out_tree)
    compiled = jitted.lower(*args, **kwargs).compile()
    if result.plan.uses_host and not _holds_host_memory(compiled):
      return jitted, int(result.peak / model_scale)
    return jitted, xla_footprint(compiled)

  def _lowest(self, graph, out_tree, args, kwargs, tried, model_scale):
    """The planner's lowest plan, compiled: (result, jitted, footprint).

    ``tried`` is the last plan compiled, (result, jitted, footprint). A
    planner with a ``lowest(graph)`` method offers several more candidates;
    each is compiled and the one with the smallest measured footprint wins,
    so the smallest budget an error names is XLA's, not the model's.
    """
    if not graph.has_backward:
      candidates = [unplanned(graph, 0)]
    elif hasattr(self.planner, "lowest"):
      candidates = self.planner.lowest(graph)
    else:
      candidates = [self.planner.plan(graph, 0)]
    best, seen = tried, {tried[0].plan}
    for result in candidates:
      if result.plan in seen:
        continue
      seen.add(result.plan)
      compiled = (result, *self._compile(result, out_tree, args, kwargs, model_scale))
      if _measured(result, compiled[2]) < _measured(best[0], best[2]):
        best = compiled
    return best

  def _jit(self, result: PlanResult, out_tree):
    run_flat = emit(result.schedule)
    statics, static_names = self.static_argnums, self.static_argnames

    def run(*args, **kwargs):
      leaves = jax.tree_util.tree_leaves(
          _split_static(args, kwargs, statics, static_names))
      return jax.tree_util.tree_unflatten(out_tree, run_flat(*leaves))

    return jax.jit(run, static_argnums=statics, static_argnames=static_names,
                   **self.jit_kwargs)


def transform(fun: Callable, budget, *, planner="recompute",
              static_argnums=(), static_argnames=(), max_rounds: int = 4,
              **jit_kwargs) -> Transformed:
  """Fits a training step into a device-memory budget.

  The step (forward, backward and optimizer update in one function) is traced
  once per argument signature; its residuals are planned so that the
  compiled footprint stays within ``budget``, the joint jaxpr is rewritten
  with the plan and compiled with ``jax.jit``. The result computes the same
  numbers as ``fun``.

  Args:
    fun: the training step.
    budget: bytes (int), a string with a unit (``"3GiB"``, ``"512MB"``) or a
      fraction of the unconstrained footprint (``"60%"``, ``0.6``).
    planner: a name from ``jaxmem.PLANNERS`` or a planner object.
    static_argnums, static_argnames: as for ``jax.jit``.
    max_rounds: how often to re-plan with a tighter model target when XLA's
      footprint exceeds the budget.
    **jit_kwargs: passed to ``jax.jit`` (``donate_argnums``, ...).

  Returns:
    A :class:`Transformed` callable.

  Raises:
    BudgetError: for a budget that cannot be read or cannot be met (the
      message names the smallest footprint reached).

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
                     jit_kwargs, max_rounds)


@dataclasses.dataclass
class Analysis:
  """What :func:`analyze` finds in a step."""
  graph: Graph
  profile: MemoryProfile

  @property
  def residuals(self):
    return self.graph.residuals

  @property
  def peak(self) -> int:
    return self.profile.peak

  def report(self, top: int | None = 30) -> str:
    return (f"predicted footprint {format_bytes(self.peak)} at "
            f"{self.profile.peak_name}\n" + residual_table(self.graph, top=top))


def analyze(fun: Callable, *args, **kwargs) -> Analysis:
  """Traces a step and lists its residuals with sizes, lifetimes and layers.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    >>> a = jaxmem.analyze(step, jnp.ones((4, 4)), jnp.ones((2, 4)))
    >>> [r.primitive for r in a.residuals]  # tanh(y) and 1 - tanh(y)**2
    ['tanh', 'sub']
  """
  closed, _, _ = trace(fun, *args, **kwargs)
  graph = build_graph(closed)
  return Analysis(graph, evaluate(graph, Plan())[1])
