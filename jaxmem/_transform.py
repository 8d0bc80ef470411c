"""The public transform: a training step fitted to a memory budget,
shaped like ``jax.jit``."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any, Callable

import jax
from jax.extend import core as jex

from jaxmem import _primitives
from jaxmem._arguments import Arguments, inherited_donations
from jaxmem._batching import batchable
from jaxmem._budget import Budget, BudgetError, format_bytes
from jaxmem._decisions import Plan
from jaxmem._emit import emit
from jaxmem._evaluate import Candidate, evaluate
from jaxmem._fit import Fitter
from jaxmem._graph import Graph, build_graph, trace
from jaxmem._inner import body_graph, embedded, inner_loop
from jaxmem._memory import Liveness
from jaxmem._report import decision_label, residual_table
from jaxmem._xla_buffers import learn, with_buffers
from jaxmem._xla_clock import program_time
from jaxmem.planners import Planner, get_planner
from jaxmem.targets import Target, resolve, workspace_bytes, xla_footprint

_Tracer = jax.core.Tracer


@dataclasses.dataclass
class Fit:
  """Everything jaxmem decided for one argument signature.

  Attributes:
    graph: the analyzed joint graph.
    result: the plan taken (with its schedule and memory model).
    planner: the planner that proposed it.
    budget: the budget in bytes.
    target: the device the fit compiled for (:class:`~jaxmem.targets.Target`):
      its compiler's footprints are the ones below.
    unconstrained: XLA's footprint of the untransformed step on the target.
    unconstrained_model: the memory model's footprint of the untransformed step.
    footprint: XLA's footprint of the transformed step (for an offload plan
      on a backend that ignores host memory, the model's; None if
      unavailable).
    added_flops: FLOPs the recomputation adds per step.
    base_flops: FLOPs of the untransformed step (jaxmem's rule table).
    attempts: planning rounds (the model target tightens when XLA disagrees).
    seconds: planning time, compilation included.
    jitted: the ``jax.jit``-wrapped transformed step.
    reserve: bytes of the budget kept free for the runtime beyond XLA's
      footprint (:func:`~jaxmem.targets.runtime_reserve`).
    nested: the same step without per-compilation options, for calls under
      an outer transformation (``jax.jit`` takes ``compiler_options`` only at
      the top level; there the outer compilation is the one XLA runs).
    loop: where the step's passes run inside a loop (gradient accumulation
      over a ``lax.scan``), the loop's source line: ``graph``, the plan and
      the FLOPs are then one iteration's (``_inner``); else None.
    out_tree: the tree of the step's outputs.
    run: the emitted step over flat leaves (what every ``jax.jit`` above wraps).
    runners: its ``jax.jit`` per device it is called or lowered on
      (``jitted`` for the device of the call that fitted it).
    predicted: the transformed step's predicted seconds on a GPU target
      (the clock over XLA:GPU's program, ``_xla_clock``); None on XLA:CPU.
    unconstrained_predicted: the same for the untransformed step.
  """
  graph: Graph
  result: Candidate
  planner: Planner
  budget: int
  target: Target
  unconstrained: int
  unconstrained_model: int
  footprint: int | None
  added_flops: float
  base_flops: float
  attempts: int
  seconds: float
  jitted: Any = dataclasses.field(repr=False, default=None)
  nested: Any = dataclasses.field(repr=False, default=None)
  reserve: int = 0
  loop: str | None = None
  out_tree: Any = None
  run: Callable | None = dataclasses.field(repr=False, default=None)
  runners: dict = dataclasses.field(repr=False, default_factory=dict)
  predicted: float | None = None
  unconstrained_predicted: float | None = None

  @property
  def plan(self) -> Plan:
    return self.result.plan

  @property
  def memory(self) -> Liveness:
    return self.result.memory

  def report(self, top: int | None = 20) -> str:
    """A readable summary of the budget, the plan and the residuals."""
    p = self.memory
    decisions = {vid: decision_label(d) for vid, d in self.plan}
    # Stacks kept in host memory one slice per iteration of their loop
    # (pieces of stacks, version < 0, keep their chunks' labels).
    decisions.update({k[0]: "offload/iter" for k in p.schedule.hosted if k[1] == 0})
    fp = "n/a" if self.footprint is None else format_bytes(self.footprint)
    saved = self.plan.values_with("save")
    saved_bytes = sum(self.graph.values[v].nbytes for v in saved)
    lines = [
        f"budget            {format_bytes(self.budget)}"
        + (f" ({format_bytes(self.reserve)} of it kept for the runtime)"
           if self.reserve else ""),
        f"unconstrained     {format_bytes(self.unconstrained)} (XLA), "
        f"{format_bytes(self.unconstrained_model)} (model)",
        f"planned           {fp} (XLA), {format_bytes(p.peak)} (model)",
        f"target            {self.target.name}",
        f"planner           {self.planner.describe()}",
        *([f"planned per pass  inside the loop at {self.loop}: one iteration's forward "
           "and backward pass (residuals, decisions and FLOPs below are one "
           "iteration's)"] if self.loop else []),
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
    if self.result.details is not None:
      lines += ["", self.result.details.table()]
    return "\n".join(lines)


def _signature(arguments: Arguments, args, kwargs):
  """The cache key (static values, tree and avals of the dynamic
  arguments), the dynamic arguments and their leaves."""
  statics, dyn_args, dyn_kwargs = arguments.split(args, kwargs)
  leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
  return (statics, tree, tuple(jax.typeof(x) for x in leaves)), leaves


class Transformed:
  """A training step fitted to a memory budget; made by :func:`transform`.

  Call it like the step. ``.lower(*args)`` gives ``jax.jit``'s AOT stages
  (``.compile().memory_analysis()``), ``.fit(*args)`` the :class:`Fit`
  (what was decided) and ``.report(*args)`` a readable summary, for the
  given arguments' shapes.
  """

  def __init__(self, fun, budget, planner, static_argnums, static_argnames,
               jit_kwargs, max_rounds, reserve=None, target=None):
    self.fun = fun
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
    self._fits: dict = {}
    self._batched: dict = {}
    try:
      self.__wrapped__ = fun
      self.__name__ = getattr(fun, "__name__", "step")
      self.__doc__ = getattr(fun, "__doc__", None)
    except AttributeError:  # pragma: no cover
      pass

  def __call__(self, *args, **kwargs):
    fit = self.fit(*args, **kwargs)
    if not any(isinstance(leaf, _Tracer) for leaf in jax.tree_util.tree_leaves((args, kwargs))):
      return self._runner(fit, args, kwargs)(*args, **kwargs)
    # Under an outer transformation; under jax.vmap, planned again for the
    # batched shapes (_batching).
    statics, dyn_args, dyn_kwargs = self.arguments.split(args, kwargs)
    leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))

    flat = self._over_leaves(fit.nested, statics, tree)
    step = batchable(flat, functools.partial(self._vmapped, statics, tree))
    return fit.out_tree.unflatten(step(*leaves))

  def _over_leaves(self, fun: Callable, statics, tree) -> Callable:
    """``fun`` (called like the step) over the dynamic arguments' flat
    leaves, with these static values, returning its output's leaves."""
    def flat(*leaves):
      args, kwargs = self.arguments.merge(statics, *tree.unflatten(leaves))
      return jax.tree_util.tree_leaves(fun(*args, **kwargs))
    return flat

  def _placed(self, target: Target, args, kwargs) -> tuple[tuple, dict]:
    """The call's arguments as the target compiles them (dynamic ones
    abstract on its compile-only device, where it has one)."""
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
                                       {}, self.max_rounds, self.reserve, self.target)
    return self._batched[key]

  def lower(self, *args, **kwargs):
    """``jax.jit``'s ``lower`` for the transformed step."""
    return self._runner(self.fit(*args, **kwargs), args, kwargs).lower(*args, **kwargs)

  def _runner(self, fit: Fit, args, kwargs):
    """The fit's ``jax.jit`` for the platform these arguments are on or
    placed on (a fit for a target runs here as it lowers there)."""
    _, dyn_args, dyn_kwargs = self.arguments.split(args, kwargs)
    where = resolve(None, jax.tree_util.tree_leaves((dyn_args, dyn_kwargs)))
    if where.name not in fit.runners:
      fit.runners[where.name] = self._jit(fit.run, fit.out_tree, where.options())
    return fit.runners[where.name]

  def report(self, *args, **kwargs) -> str:
    return self.fit(*args, **kwargs).report()

  def fit(self, *args, **kwargs) -> Fit:
    """Fits the step (once per shapes, dtypes and static values) and returns
    what was decided."""
    return self._cached(args, kwargs, find_smallest=True)

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
      key, leaves = _signature(self.arguments, args, kwargs)
    except TypeError:
      # An argument that is not an array: jax.jit's error names its path.
      self.arguments.tracing(self.fun).trace(*args, **kwargs)
      raise
    target = resolve(self.target, leaves)
    key = (*key, target.name)  # arguments placed elsewhere: another target
    if key not in self._fits:
      fit = self._build(args, kwargs, leaves, target, find_smallest)
      if fit is None:
        return None
      self._fits[key] = fit
    return self._fits[key]

  def _build(self, args, kwargs, leaves, target: Target,
             find_smallest: bool = True) -> Fit | None:
    """Traces, analyzes and runs the fit loop (:class:`~jaxmem._fit.Fitter`)."""
    start = time.perf_counter()
    self.arguments = self.arguments.with_donations(
        *inherited_donations(self.fun, args, kwargs, self.arguments))
    planner = get_planner(self._planner_spec, target.profile)
    here = resolve(None, leaves)  # where the step runs, which the target may not be
    options = here.options()
    closed, out_tree = trace(self.arguments.tracing(self.fun), *args, **kwargs)
    graph = build_graph(closed)
    _no_collectives(graph, self.__name__)
    loop = inner_loop(graph)
    # The graph planned (the loop's body where the passes run in a loop) is
    # the one the memory model learns the target's buffers for.
    planned = _modelled(graph if loop is None else body_graph(graph, loop), target)
    if loop is None:
      graph = planned
    placed_args, placed_kwargs = self._placed(target, args, kwargs)
    baseline = jax.jit(jex.jaxpr_as_fun(closed), compiler_options=target.options() or None
                       ).lower(*target.place(leaves)).compile()
    base_memory = evaluate(graph, Plan())[1]
    unconstrained = xla_footprint(baseline)
    if unconstrained is None:
      unconstrained = base_memory.peak

    def emitter(candidate: Candidate) -> Callable:
      if not len(candidate.plan):
        return jex.jaxpr_as_fun(closed)  # the step as written: never above it
      schedule = candidate.schedule
      return emit(schedule if loop is None else embedded(graph, loop, schedule))

    if not planned.has_backward:
      warnings.warn(
          "jaxmem: the step has no backward pass (no transposed equations in "
          "its jaxpr), so there are no residuals to recompute or offload; it "
          "is compiled unchanged.", stacklevel=4)

    def jit(candidate: Candidate):
      measuring = self._jit(emitter(candidate), out_tree, target.options(measuring=True))
      return measuring.lower(*placed_args, **placed_kwargs).compile()

    budget = self.budget.resolve(unconstrained)
    # A fraction is of XLA's footprint, which the runtime's workspaces add to
    # as much for the step as written: only a budget in bytes keeps a reserve.
    reserve = self.reserve if self.reserve is not None else (
        0 if self.budget.fraction is not None else target.reserve())
    if budget <= reserve:
      raise BudgetError(
          f"jaxmem: budget {format_bytes(budget)} leaves nothing for the step once "
          f"{format_bytes(reserve)} is kept free for the runtime's workspaces; pass a "
          f"budget above {reserve} bytes, or a smaller transform(..., reserve=).",
          smallest=reserve + 1)
    model = base_memory if loop is None else evaluate(planned, Plan())[1]
    fixed = workspace_bytes(baseline)
    clock = _clock(target)
    fitter = Fitter(planned, planner, budget - reserve, unconstrained,
                    model.peak / max(unconstrained - fixed, 1), jit, self.max_rounds,
                    reserve, target.name, fixed, clock)
    found = fitter.fit(find_smallest)
    if found is None:
      return None
    trial, attempts = found
    run_flat = emitter(trial.candidate)
    jitted = self._jit(run_flat, out_tree, options)
    return Fit(planned, trial.candidate, planner, budget, target, unconstrained,
               model.peak, trial.footprint, trial.candidate.schedule.recompute_flops,
               sum(n.flops for n in planned.nodes), attempts, time.perf_counter() - start,
               jitted, self._jit(run_flat, out_tree, {}) if options else jitted,
               reserve, None if loop is None else graph.nodes[loop].source, out_tree,
               run_flat, {here.name: jitted}, trial.seconds,
               None if clock is None else clock(baseline))

  def _jit(self, run_flat: Callable, out_tree, options: dict):
    """The ``jax.jit`` of an emitted step (``run_flat`` over flat leaves);
    ``options`` (compiler options that keep recomputation,
    :meth:`~jaxmem.targets.Target.options`) go under any the user passed."""
    arguments = self.arguments

    def run(*args, **kwargs):
      _, dyn_args, dyn_kwargs = arguments.split(args, kwargs)
      leaves = jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))
      return jax.tree_util.tree_unflatten(out_tree, run_flat(*leaves))

    kwargs = dict(self.jit_kwargs)
    kwargs["compiler_options"] = {**options, **(kwargs.get("compiler_options") or {})} or None
    return arguments.jit(run, self.fun, **kwargs)


def _modelled(graph: Graph, target: Target) -> Graph:
  """``graph`` with the buffers its target's compiler gives it (one
  compilation, ``_xla_buffers.learn``) where the target is a GPU; on
  XLA:CPU the memory model emulates its fusion."""
  return graph if target.platform == "cpu" else with_buffers(graph, learn(graph, target))


def _clock(target: Target) -> Callable | None:
  """The predicted seconds of a compiled program on a GPU target's profile
  (``_xla_clock``); None on XLA:CPU, where plans keep the planner's cost."""
  if target.platform == "cpu" or target.profile is None:
    return None
  return lambda compiled: program_time(compiled.as_text(), target.profile).seconds


def _no_collectives(graph: Graph, name: str) -> None:
  """jaxmem compiles a step on its own to measure it, which a step reducing
  over mesh axes (``psum`` inside ``shard_map``) cannot be."""
  found = sorted({n.prim.name for n in graph.nodes
                  if _primitives.classify(n.prim.name) == _primitives.COLLECTIVE})
  if found:
    raise NotImplementedError(
        f"jaxmem: step {name} runs collectives over mesh axes ({', '.join(found)}); "
        "jaxmem measures a step by compiling it on its own, outside the mesh, so it "
        "cannot fit one yet. Fit the per-device part and reduce outside it, e.g. "
        "shard_map(lambda w, x: jax.lax.pmean(fitted(w, x), 'd'), ...) with fitted = "
        "jaxmem.transform(per_device_step, budget=...).")


def transform(fun: Callable, budget, *, planner="recompute", target=None,
              static_argnums=(), static_argnames=(), max_rounds: int = 4,
              reserve: int | None = None, **jit_kwargs) -> Transformed:
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
    planner: a name from ``jaxmem.PLANNERS`` or a :class:`jaxmem.Planner`.
    static_argnums, static_argnames: as for ``jax.jit`` (a name also makes
      its position static, an index its name; negative indices count from
      the end of the call's positional arguments).
    max_rounds: how often to re-plan with a tighter model target when XLA's
      footprint exceeds the budget.
    reserve: bytes of the budget kept free for what the runtime allocates
      beyond XLA's compiled footprint (cuDNN/cuBLAS workspaces): XLA's
      footprint is held to ``budget - reserve``. None: 128 MiB on GPU and
      other accelerators (the most seen over the footprint on an H200 was
      92 MB), 0 on CPU.
    **jit_kwargs: passed to ``jax.jit``. ``donate_argnums`` /
      ``donate_argnames`` donate as there; a step already wrapped in
      ``jax.jit`` with donated arguments keeps its donation.

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
                     jit_kwargs, max_rounds, reserve, target)


@dataclasses.dataclass
class Analysis:
  """What :func:`analyze` finds in a step."""
  graph: Graph
  memory: Liveness

  @property
  def residuals(self):
    return self.graph.residuals

  @property
  def peak(self) -> int:
    return self.memory.peak

  def report(self, top: int | None = 30) -> str:
    return (f"predicted footprint {format_bytes(self.peak)} at "
            f"{self.memory.peak_name}\n" + residual_table(self.graph, top=top))


def analyze(fun: Callable, *args, **kwargs) -> Analysis:
  """Traces a step and lists its residuals with sizes, lifetimes and layers.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    >>> a = jaxmem.analyze(step, jnp.ones((4, 4)), jnp.ones((2, 4)))
    >>> [r.primitive for r in a.residuals]  # tanh(y) and 1 - tanh(y)**2
    ['tanh', 'sub']
  """
  closed, _ = trace(jax.jit(fun), *args, **kwargs)
  graph = build_graph(closed)
  return Analysis(graph, evaluate(graph, Plan())[1])
