"""The public transform: a training step fitted to a budget, shaped like ``jax.jit``."""

from __future__ import annotations

import functools
from typing import Callable

import jax

from jaxmem._budget import Budget, BudgetError
from jaxmem._fitting import Fitting
from jaxmem.cost._evaluate import paused_gc
from jaxmem.fit._arguments import Arguments, as_sharded
from jaxmem.fit._batching import batchable
from jaxmem.fit._fitted import Fit
from jaxmem.fit._host_state import lower_placed, on_device, place_state, placed_compile_only
from jaxmem.fit._micro import AUTO, checked_count
from jaxmem.planners import get_planner
from jaxmem.targets import resolve

_Tracer = jax.core.Tracer


class Transformed(Fitting):
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
