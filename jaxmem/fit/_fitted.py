"""What a fit decided for one argument signature: :class:`Fit`, with its
report."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxmem._budget import format_bytes
from jaxmem._decisions import Plan
from jaxmem.cost._evaluate import Candidate
from jaxmem.graph._graph import Graph
from jaxmem.graph._state import hosted_leaves, hosted_state, with_host_decisions
from jaxmem.cost._memory import Liveness
from jaxmem.fit._inner import Body
from jaxmem.fit._micro import FEATURES, MicroBatches
from jaxmem.fit._policies import NamePolicy, block_policies, name_policy
from jaxmem.fit._report import decision_label, residual_table
from jaxmem.fit._saved import dumps
from jaxmem.planners import ILP, Gap, Planner
from jaxmem.targets import Target


def _chunks_name(micro: MicroBatches) -> str:
  """The option a fit's chunks read as in its repr."""
  if micro.features:
    return "feature_chunks"
  return "region_chunks" if micro.region else "micro_batches"


def saved_plan(graph: Graph, plan: Plan, step: str, stepped: Graph | None,
               micro: MicroBatches | None, **about) -> str:
  """``plan`` of ``graph`` as JSON (:mod:`jaxmem.fit._saved`), for the step
  of fingerprint ``step``, with the host decisions of ``stepped`` (the
  whole step, where ``graph`` is a loop's body) and the chunks ``micro``
  says it runs in; ``about`` as ``dumps`` takes it."""
  around = stepped is not None and stepped is not graph
  return dumps(with_host_decisions(graph, plan), step,
               with_host_decisions(stepped, Plan()) if around else None,
               **about, micro_batches=1 if micro is None else micro.count,
               region=FEATURES if micro and micro.features else bool(micro and micro.region))


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
    inner: where the step's passes run inside a body of their own
      (gradient accumulation over a ``lax.scan``, a step written per device
      under ``shard_map``: :class:`~jaxmem.fit._inner.Body`): ``graph``, the
      plan and the FLOPs are then one iteration's or one device's; else None.
    out_tree: the tree of the step's outputs.
    run: the emitted step over flat leaves (what every ``jax.jit`` above wraps).
    runners: its ``jax.jit`` per device it is called or lowered on
      (``jitted`` for the device of the call that fitted it).
    predicted: the transformed step's predicted seconds on a GPU target
      (the clock over XLA:GPU's program, ``_xla_clock``); None on XLA:CPU.
    unconstrained_predicted: the same for the untransformed step.
    step: the fingerprint of the traced step a saved plan is checked
      against (``jaxmem.fit._saved.fingerprint``).
    input_names: the path of each flat argument leaf
      (``jax.tree_util.keystr``), for reports.
    micro: where the step runs in micro-batches, how
      (:class:`~jaxmem.fit._micro.MicroBatches`); ``graph`` and the plan are
      then one micro-batch's. None: the step runs whole.
    devices: the devices the step's arguments lie on. With several, XLA's
      figures are one device's, and so are the model's (its values' bytes
      read off XLA's partitioned program, ``cost._xla_shards``, or a
      ``shard_map``'s shapes), but inside a loop, where the model sees the
      step's global shapes.
    stepped: the graph of the whole step, whose optimizer state may be kept
      in host memory between steps: ``graph`` itself, or where ``graph`` is
      a loop's body (``inner``, ``micro``) the step around it.
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
  inner: Body | None = None
  out_tree: Any = None
  run: Callable | None = dataclasses.field(repr=False, default=None)
  runners: dict = dataclasses.field(repr=False, default_factory=dict)
  predicted: float | None = None
  unconstrained_predicted: float | None = None
  step: str = ""
  input_names: tuple = ()
  micro: MicroBatches | None = None
  devices: int = 1
  stepped: Graph | None = None
  _gap: Gap | None = dataclasses.field(default=None, init=False, repr=False)

  def __repr__(self) -> str:
    fp = "n/a" if self.footprint is None else format_bytes(self.footprint)
    return (f"Fit(budget={format_bytes(self.budget)}, footprint={fp}, "
            f"unconstrained={format_bytes(self.unconstrained)}, "
            f"decisions={len(self.plan)}, planner={self.planner.name!r}, "
            + (f"{_chunks_name(self.micro)}="
               f"{self.micro.count}, " if self.micro else "") +
            f"target={self.target.name!r}); .report() for the whole")

  def save_plan(self, path) -> None:
    """Writes the plan as JSON to ``path``, for ``transform(...,
    plan=path)`` to apply without planning (to this step, with these
    argument shapes: :attr:`step` is their fingerprint)."""
    with open(path, "w") as f:
      f.write(self.saved())

  def saved(self) -> str:
    """The plan as JSON (:mod:`jaxmem.fit._saved`), with the budget, target,
    planner and footprint it was fitted for."""
    return saved_plan(self.graph, self.plan, self.step, self.stepped, self.micro,
                      budget=self.budget, target=self.target.name,
                      planner=self.planner.describe(), footprint=self.footprint)

  def gap(self) -> Gap:
    """The plan's cost against the exact planner's bound at the plan's own
    model peak (:meth:`jaxmem.ILP.gap`), found once: the fit's planner
    answers where it is the exact planner (its program is priced
    already), else an exact planner on the same target prices the step
    (a few seconds on large steps)."""
    if self._gap is None:
      exact = self.planner if isinstance(self.planner, ILP) else ILP(
          target=self.planner.target)
      self._gap = exact.gap(self.graph, self.result)
    return self._gap

  def policies(self) -> dict[str, str]:
    """The plan as per-block ``jax.checkpoint`` policies: module path ->
    the name of a ``jax.checkpoint_policies`` policy, to wrap those blocks
    in ``nn.remat(Block, policy=...)`` in the model's code and train the
    same plan without jaxmem (:func:`jaxmem.fit._policies.block_policies`).

    Raises:
      ValueError: where the plan recomputes single residuals or offloads,
        which no per-block policy does; fit with
        ``planner=jaxmem.planners.ilp(drops=False, refine=False)`` for
        plans that are per-block policies only.
    """
    return block_policies(self.graph, self.plan)

  def name_policy(self) -> NamePolicy:
    """The plan as a ``jax.checkpoint`` policy over the step's
    ``checkpoint_name``\\ s for the model's layers: the names saved, those
    offloaded to host memory, and the layers (module paths) to wrap in
    ``nn.remat(Layer, policy=fit.name_policy())``; every other value a
    layer makes is rebuilt (:func:`jaxmem.fit._policies.name_policy`).

    Raises:
      ValueError: where the plan is not such a policy; fit with
        ``planner="names"``, whose plans are.
    """
    return name_policy(self.graph, self.plan)

  @property
  def plan(self) -> Plan:
    return self.result.plan

  @property
  def hosted(self) -> tuple[int, ...]:
    """Positions, among the step's flat argument leaves, of the optimizer
    state kept in host memory between steps: the step takes them there and
    returns their updates there (``jaxmem.graph._state``)."""
    return hosted_leaves(self.stepped or self.graph)

  @property
  def memory(self) -> Liveness:
    return self.result.memory

  def _scopes(self) -> tuple[str, str]:
    """What the report's XLA and model figures cover, on several devices."""
    if self.devices < 2:
      return "", ""
    looped = self.inner is not None and not self.inner.per_device
    return ", per device", ", the global shapes" if looped else ", per device"

  def report(self, top: int | None = 4) -> str:
    """A readable summary of the budget, the plan and the ``top`` largest
    residuals, with the planner's own table in a line; ``top=None`` lists
    every residual and the planner's whole table."""
    p = self.memory
    decisions = {vid: decision_label(d) for vid, d in self.plan}
    # Stacks kept in host memory one slice per iteration of their loop
    # (pieces of stacks, version < 0, keep their chunks' labels).
    decisions.update({k[0]: "offload/iter" for k in p.schedule.hosted if k[1] == 0})
    fp = "n/a" if self.footprint is None else format_bytes(self.footprint)
    saved = self.plan.values_with("save")
    saved_bytes = sum(self.graph.values[v].nbytes for v in saved)
    xla, model = self._scopes()
    lines = [
        f"budget            {format_bytes(self.budget)}"
        + (f" ({format_bytes(self.reserve)} of it kept for the runtime)"
           if self.reserve else ""),
        f"unconstrained     {format_bytes(self.unconstrained)} (XLA{xla}), "
        f"{format_bytes(self.unconstrained_model)} (model{model})",
        f"planned           {fp} (XLA{xla}), {format_bytes(p.peak)} (model{model})",
        f"target            {self.target.name}",
        f"planner           {self.planner.describe()}",
        *([f"planned per pass  {self.inner.describe()}"] if self.inner else []),
        *([f"micro-batches     {self.micro.describe()}: "
           f"{self.micro.instead or 'no plan of the whole batch fits'} "
           "(residuals, decisions and FLOPs below are one micro-batch's)"]
          if self.micro and not self.micro.region and not self.micro.features else []),
        *([f"chunked region    {self.micro.describe()}: "
           f"{self.micro.instead or 'no plan of the step as it is fits'}"]
          if self.micro and self.micro.region else []),
        *([f"chunked features  {self.micro.describe()}: no plan of the step as it is "
           "fits, and its batch does not split"] if self.micro and self.micro.features else []),
        f"peak at           {p.peak_name}",
        ("decisions         none on residuals: with the optimizer state in host memory "
         "the step fits the budget" if not len(self.plan) and self.hosted else
         "decisions         none on residuals: in chunks the step fits the budget"
         if not len(self.plan) and self.micro else
         "decisions         none on residuals: with its backward reads separated from "
         "the forward pass (values padded or laid out again for the backward pass "
         "instead of one copy held between them) the step fits the budget"
         if not len(self.plan) and self.result.changes_step else
         "decisions         none: the step as written fits the budget, nothing needed "
         "planning" if not len(self.plan) else
         f"decisions         {len(self.plan) - len(saved)} of {len(self.graph.residuals)} "
        f"residuals changed: {self._changes(p.host_peak)}; {len(saved)} "
        f"block boundaries saved ({format_bytes(saved_bytes)})"),
        *self._host_lines(top),
        f"added FLOPs       {self.added_flops:.3g} "
        f"({self.added_flops / max(self.base_flops, 1.0):.1%} of the step)",
        *([f"against optimum   {self.gap().text()}"] if len(self.plan) else []),
        f"planning time     {self.seconds:.2f} s ({self.attempts} round(s))",
        "",
        residual_table(self.graph, top=top, decisions=decisions),
    ]
    if self.result.details is not None:
      lines += ["", self.result.details.table(None if top is None else 0)]
    return "\n".join(lines)

  def _changes(self, host_peak: int) -> str:
    """The report's count of each kind of decision the plan holds."""
    counts = [(len(self.plan.values_with(kind)), label) for kind, label in (
        ("recompute", "recomputed"), ("offload", "offloaded"),
        ("chunked", "decided per chunk (a loop's layer ranges, or vTensors)"))]
    said = ", ".join(f"{n} {label}" for n, label in counts if n) or "none"
    return said + (f", {format_bytes(host_peak)} on the host at most" if host_peak else "")

  def _host_lines(self, top: int | None) -> list[str]:
    """The report's lines on optimizer state kept in host memory: how
    much, and its ``top`` largest leaves with their bytes (by argument path
    where known; every leaf for None)."""
    state = hosted_state(self.stepped or self.graph)
    if not state:
      return []
    name = lambda leaf: (self.input_names[leaf.leaf] if leaf.leaf < len(self.input_names)
                         else f"argument leaf {leaf.leaf}")
    largest = sorted(state, key=lambda leaf: -leaf.nbytes)[:top]
    more = len(state) > len(largest)
    count = sum(leaf.master for leaf in state)
    masters = (f" ({count} master weights, also copied in for their casts in the forward "
               "pass)") if count else ""
    return [f"optimizer state   {len(state)} leaves, {format_bytes(sum(l.nbytes for l in state))}, "
            "in host memory between steps (copied in before each update, its result "
            f"copied back){masters}: "
            + ", ".join(f"{name(l)} {format_bytes(l.nbytes)}" for l in largest)
            + (", ... (report(top=None) lists all)" if more else "")]
