"""Measurements behind ``jaxmem-bench``: one model, several methods, budgets.

A *method* is a way to run a model's train step: ``unconstrained`` (plain
``jax.jit``), ``remat:<policy>`` (the hand-written baseline: ``nn.remat``
with a named policy around every block) or ``jaxmem:<planner>`` (the step
transformed by :func:`jaxmem.transform`). Every figure is measured in the
run that reports it; ratios are to the unconstrained step of the same run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax

from jaxmem import _zoo
from jaxmem._budget import BudgetError
from jaxmem.targets import timing_profile
from jaxmem.cost._evaluate import unplanned
from jaxmem.cost._memory import stacked
from jaxmem.targets import holds_host_memory, xla_footprint
from jaxmem.targets._calibrate import median_seconds
from jaxmem.cost._perf import predict_schedule
from jaxmem._transform import transform
from jaxmem.planners import ABLATIONS, NAMED, PLANNERS, LayerReport


@dataclasses.dataclass(frozen=True)
class Method:
  """How a step is run: ``kind`` is unconstrained, remat or jaxmem; ``option``
  the remat policy or the planner name."""
  kind: str
  option: str | None = None

  @property
  def name(self) -> str:
    return self.kind if self.option is None else f"{self.kind}:{self.option}"

  @classmethod
  def parse(cls, text: str) -> "Method":
    """``"unconstrained"``, ``"remat:<policy>"`` or ``"jaxmem:<planner>"``.

    Example:
      >>> Method.parse("remat:dots_saveable")
      Method(kind='remat', option='dots_saveable')
    """
    models = _zoo.models()
    kind, _, option = text.partition(":")
    choices = {"remat": models.REMAT_POLICIES, "jaxmem": PLANNERS}
    if kind == "unconstrained" and not option:
      return cls(kind)
    if kind in choices and option in choices[kind]:
      return cls(kind, option)
    raise ValueError(
        f"unknown method {text!r}; expected 'unconstrained', 'remat:<policy>' with a "
        f"policy in {sorted(models.REMAT_POLICIES)}, or 'jaxmem:<planner>' with a "
        f"planner in {sorted(PLANNERS)}")


def default_methods(model: str) -> list[Method]:
  """Unconstrained, every jaxmem planner (the ablation variants and the
  planner over named values left out: ask for them by name), and the
  remat baselines the model supports (models without block modules have
  none)."""
  models = _zoo.models()
  methods = [Method("unconstrained")]
  if models.supports_remat(model):
    methods += [Method("remat", p) for p in ("nothing_saveable", "dots_saveable",
                                              "dots_with_no_batch_dims_saveable")]
  return methods + [Method("jaxmem", p) for p in sorted(PLANNERS)
                    if p not in ABLATIONS | NAMED]


@dataclasses.dataclass
class Row:
  """One method at one budget. Byte figures are XLA's compiled footprints
  (temp + arguments + outputs - aliases); ``model_bytes`` is jaxmem's
  prediction. A jaxmem method that cannot meet the budget has ``fits``
  False and ``xla_bytes`` the smallest footprint it reaches.
  ``time_ratio`` is the median, over runs, of the step's time over the
  unconstrained step's timed just before it (:func:`paired_seconds`)."""
  method: str
  budget: str
  budget_bytes: int
  fits: bool
  xla_bytes: int | None
  model_bytes: int | None = None
  step_ms: float | None = None
  time_ratio: float | None = None
  flops_ratio: float | None = None
  planning_s: float | None = None
  max_batch: int | None = None
  predicted_ms: float | None = None
  predicted_ratio: float | None = None
  timeline: list | None = dataclasses.field(default=None, repr=False)
  recompute_ops: list | None = dataclasses.field(default=None, repr=False)
  copy_ops: dict | None = dataclasses.field(default=None, repr=False)
  host_timeline: list | None = dataclasses.field(default=None, repr=False)
  # The timeline by what holds the bytes (``_memory.stacked``), and the
  # step as written's timeline.
  stacked: dict | None = dataclasses.field(default=None, repr=False)
  written: list | None = dataclasses.field(default=None, repr=False)
  vtensors: list | None = None  # the LGM planner's swaps (SwapRecord fields)
  # ``xla_bytes`` is the model's device peak: an offload plan on a backend
  # that ignores host memory (XLA's footprint would count the copies).
  footprint_modelled: bool = False


# Row fields too long for the JSON file (per-op series, for plots).
SERIES = ("timeline", "recompute_ops", "copy_ops", "host_timeline", "stacked", "written")


def paired_seconds(base: Callable, base_args, fn: Callable, args,
                   repeats: int) -> tuple[float, float]:
  """``(median seconds of fn, median of fn's time over base's)``, each run
  of ``fn`` timed right after one of ``base``: a machine whose speed drifts
  during a run (a shared or throttled CPU) moves both sides of each pair."""
  jax.block_until_ready(base(*base_args))
  jax.block_until_ready(fn(*args))
  pairs = [(_seconds(base, base_args), _seconds(fn, args)) for _ in range(max(repeats, 1))]
  return (statistics.median(b for _, b in pairs),
          statistics.median(b / a for a, b in pairs))


def _seconds(fn: Callable, args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def compiled_flops(compiled) -> float | None:
  """FLOPs from XLA's cost analysis (None where the backend gives none)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return None if not cost or "flops" not in cost else float(cost["flops"])


def fits_budget(step: Callable, shapes, budget_bytes: int, planner=None) -> bool:
  """Whether ``step`` fits ``budget_bytes`` for arguments of ``shapes``,
  from compiled footprints alone (nothing runs): plain ``jax.jit``, or with
  a ``planner`` :meth:`~jaxmem.Transformed.can_fit`, which skips the search
  for the smallest footprint, so a max batch is never overstated."""
  if planner is not None:
    return transform(step, budget=budget_bytes, planner=planner).can_fit(*shapes)
  footprint = xla_footprint(jax.jit(step).lower(*shapes).compile())
  return footprint is not None and footprint <= budget_bytes


class Bench:
  """Builds one model's tasks and measures methods on them.

  Args:
    model: a registry name in ``models``.
    config: the model's options (``batch`` included or the factory's).
    repeats: timed runs per step (median reported).
    progress: called with a line of text as work proceeds.
    target: the GPU to plan for (a name in ``jaxmem.PROFILES`` or a
      ``DeviceProfile``): every jaxmem planner plans for it, and jaxmem rows
      carry the step time its profile predicts beside the measured one.
  """

  def __init__(self, model: str, config: dict, repeats: int = 5,
               progress: Callable[[str], None] = lambda line: None, target=None):
    models = _zoo.models()
    self.models = models
    self.model = model
    self.config = dict(config)
    self.repeats = repeats
    self.progress = progress
    self.target = None if target is None else timing_profile(target)
    self.base = self.task(Method("unconstrained"))
    self.args = self.base.init()
    compiled = self.base_compiled = jax.jit(self.base.step).lower(*self.args).compile()
    self.unconstrained = xla_footprint(compiled)
    self.base_flops = compiled_flops(compiled)
    self.base_seconds = median_seconds(compiled, self.args, repeats)
    self._fixed = {Method("unconstrained"): (self.unconstrained, 1.0, self.base_seconds, 1.0)}

  def task(self, method: Method, **overrides):
    remat = method.option if method.kind == "remat" else None
    return self.models.get(self.model, remat=remat, **{**self.config, **overrides})

  def measure(self, method: Method, budget: str, budget_bytes: int) -> Row:
    """Fits, footprint, step time and FLOPs of ``method`` at one budget."""
    self.progress(f"{self.model}: {method.name} at {budget}")
    row = Row(method.name, budget, budget_bytes, False, None)
    if method.kind == "jaxmem":
      fitted = transform(self.base.step, budget=budget_bytes, planner=self.planner(method))
      try:
        fit = fitted.fit(*self.args)
      except BudgetError as err:
        row.xla_bytes = err.smallest
        return row
      self._describe(row, fit)
      compiled = fitted.lower(*self.args).compile()
      figures = self._run(compiled, self.args)
      row.footprint_modelled = fit.plan.uses_host and not holds_host_memory(compiled)
    elif method in self._fixed:  # the step does not depend on the budget
      figures = self._fixed[method]
    else:
      task = self.task(method)
      args = task.init()
      figures = self._fixed[method] = self._run(
          jax.jit(task.step).lower(*args).compile(), args)
    row.xla_bytes, row.flops_ratio, seconds, row.time_ratio = figures
    if method.kind == "jaxmem":
      # The transform's own figure: XLA's, or for offload plans on a backend
      # that ignores host memory (CPU), the model's device peak.
      row.xla_bytes = fit.footprint
    row.fits = row.xla_bytes <= budget_bytes
    row.step_ms = seconds * 1e3
    return row

  def _describe(self, row: Row, fit) -> None:
    """Fills ``row`` with what the model says of a jaxmem fit: its peak,
    timelines, copies and, with a target, the predicted step time."""
    memory, written = fit.memory, unplanned(fit.graph, 0)
    row.model_bytes, row.planning_s = memory.peak, fit.seconds
    if self.target is not None:
      predicted = predict_schedule(memory.schedule, self.target).seconds
      unplanned_seconds = predict_schedule(written.schedule, self.target).seconds
      row.predicted_ms = predicted * 1e3
      row.predicted_ratio = predicted / unplanned_seconds
    row.timeline = list(memory.timeline)
    ops = memory.schedule.ops
    row.recompute_ops = [i for i, op in enumerate(ops) if op.kind == "recompute"]
    row.copy_ops = {kind: [i for i, op in enumerate(ops) if op.kind == kind]
                    for kind in ("offload", "prefetch", "split", "merge")}
    row.host_timeline = list(memory.host_timeline)
    row.stacked, row.written = stacked(memory.schedule), list(written.memory.timeline)
    if isinstance(fit.result.details, LayerReport):  # the LGM planner's swaps
      row.vtensors = fit.result.details.rows()

  def planner(self, method: Method):
    """The planner of a jaxmem method, set up for this run's target."""
    if self.target is None:
      return method.option
    return PLANNERS[method.option](target=self.target)

  def footprint(self, method: Method) -> int:
    """XLA's footprint of a method that does not depend on the budget
    (unconstrained or a remat baseline), compiled and timed once."""
    if method.kind == "jaxmem":
      raise ValueError(f"{method.name}'s footprint depends on its budget; "
                       "expected unconstrained or remat:<policy>")
    if method not in self._fixed:
      self.measure(method, "-", 0)
    return self._fixed[method][0]

  def _run(self, compiled, args) -> tuple:
    """(footprint, FLOPs ratio, median seconds, time over the unconstrained
    step's) of a compiled step, timed by calling the compiled executable
    itself (no second compilation), each run paired with one of the
    unconstrained step (:func:`paired_seconds`)."""
    seconds, ratio = paired_seconds(self.base_compiled, self.args, compiled, args,
                                    self.repeats)
    return xla_footprint(compiled), self._flops_ratio(compiled), seconds, ratio

  def _flops_ratio(self, compiled) -> float | None:
    flops = compiled_flops(compiled)
    return None if flops is None or not self.base_flops else flops / self.base_flops

  def fits_at(self, method: Method, budget_bytes: int, batch: int) -> bool:
    """Whether ``method`` fits ``budget_bytes`` at batch ``batch``, from the
    compiled footprint alone (arguments are shapes, nothing runs); for
    jaxmem, :meth:`~jaxmem.Transformed.can_fit`, which skips the search for the
    smallest footprint, so a max batch is never overstated."""
    task = self.task(method, batch=batch)
    planner = self.planner(method) if method.kind == "jaxmem" else None
    return fits_budget(task.step, jax.eval_shape(task.init), budget_bytes, planner)

  def max_batch(self, method: Method, budget_bytes: int, limit: int = 64) -> int:
    """The largest batch at which ``method`` fits ``budget_bytes``
    (:func:`largest_batch` from the configured batch, at most ``limit``
    times it)."""
    start = self.config.get("batch", self.models.options(self.model)["batch"])
    self.progress(f"{self.model}: max batch of {method.name}")
    return largest_batch(lambda b: self.fits_at(method, budget_bytes, b), start, limit)


def largest_batch(fits: Callable[[int], bool], start: int, limit: int = 64) -> int:
  """The largest batch ``b`` with ``fits(b)``: doubling from ``start``, then
  bisection; 0 if even batch 1 does not fit, and at most ``limit * start``.

  Example:
    >>> largest_batch(lambda b: b <= 37, 4)
    37
  """
  if not fits(start):
    low, high = 0, start
  else:
    low, high = start, 2 * start
    while high <= limit * start and fits(high):
      low, high = high, 2 * high
    if high > limit * start:
      return low
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if fits(mid) else (low, mid)
  return low
