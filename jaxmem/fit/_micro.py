"""Chunks of the batch, a fit's last resorts: one region of the step, or the
whole step in micro-batches.

Where no plan of the step fits (nor one with its optimizer state in host
memory), the fit first runs the region around the step's peak over chunks
of the batch, the rest whole
(:func:`~jaxmem.graph._batch_axes.split_region`), where that fits as
written (:func:`fit_chunked`); on a GPU target those chunks also replace a
plan that fits where the target's clock predicts them faster
(:func:`cheaper`). Failing that, it splits the batch its arguments hold
(:func:`~jaxmem.graph._batch_axes.split_batch`) and fits the step run in
``k`` micro-batches with accumulated gradients
(:func:`~jaxmem.schedule._microbatch.micro_batched`): of 2, then about
twice as many each time, up to chunks of two examples, the fewest whose
step as written fits (one compilation each, no planning; a micro-batch
costs no FLOPs where recomputation would); where none does, the one
smallest as written, with its residuals planned. The budget is still the
step's: a fraction is of the step as written.

Example:
  >>> sizes_to_try((2, 3, 4, 6, 8, 12, 24), batch=24)
  [2, 4, 8, 12]
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Callable, Sequence

import jax
from jax.extend import core as jex

from jaxmem._budget import BudgetError
from jaxmem.fit._arguments import Arguments
from jaxmem.fit._features import COUNTS, features_step
from jaxmem.cost._evaluate import unplanned
from jaxmem.graph._batch_axes import NotSplittable, Split, split_batch, split_region, where
from jaxmem.fit._inner import mapped_step, on_each_device
from jaxmem.graph._graph import build_graph
from jaxmem.graph._scan_axes import REMAT
from jaxmem.schedule._emit import UNTYPED
from jaxmem.schedule._microbatch import micro_batched
from jaxmem.targets._host_args import devices_of

_log = logging.getLogger("jaxmem")

# ``transform(..., micro_batches=AUTO)``: split the batch only where nothing
# else fits.
AUTO = "auto"

# ``fit_micro_batches(..., region=FEATURES)``: layers' features in chunks
# (``fit._features``) instead of the batch.
FEATURES = "features"

# Counts of chunks between are skipped (the most chunks still measured)
# once one more halving of the chunk lowers the footprint as written by
# less than this share: it falls as a fixed part plus the chunks' part over
# their count, so the counts after one that gains a share g gain about g
# more in all (a residual MLP for a T4: 0.3% from 8 to 16 micro-batches,
# and the same footprint at 32, 64, 128 and 256).
PLATEAU = 0.005

# The same fall, fitted to the two counts measured last, predicts the most
# chunks' footprint: where even that is above the budget by more than this
# share, the counts between are skipped and the most chunks measured alone
# (a Flax nn.scan transformer's 64 micro-batches, predicted from 2 and 4:
# 1002528 bytes; measured: 1018160).
OUT_OF_REACH = 0.1


def checked_count(count):
  """``transform(..., micro_batches=count)`` checked: ``AUTO`` or a count >= 1."""
  if count != AUTO and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
    raise ValueError(f"jaxmem: micro_batches must be 'auto' or a number of micro-batches "
                     f">= 1, got {count!r}")
  return count


@dataclasses.dataclass(frozen=True)
class MicroBatches:
  """How a fit splits the step's batch.

  Attributes:
    count: micro-batches per step.
    batch: examples in the step's batch.
    arguments: the arguments split (their names in the call).
    region: where only a region of the step runs in chunks, which (for
      reports); empty where the whole step runs in micro-batches.
    instead: where the chunks were chosen over a plan that fits, that
      plan's cost (for reports); empty where no plan fits.
    per_device: whether ``batch`` is each device's (a step written per
      device under ``shard_map`` runs its micro-batches on every device).
    features: where layers' features run in chunks instead of the batch
      (``fit._features``), those layers; ``count`` is then the most
      chunks a layer's features run in.
  """
  count: int
  batch: int
  arguments: tuple[str, ...]
  region: str = ""
  instead: str = ""
  per_device: bool = False
  features: tuple[str, ...] = ()

  def describe(self) -> str:
    """One line for reports."""
    if self.features:
      more = f" and {len(self.features) - 1} more" if len(self.features) > 1 else ""
      return (f"the backward passes of {self.features[0]}{more} in up to {self.count} "
              "chunks of their features, their forward work rebuilt per chunk")
    whose = "each device's batch" if self.per_device else "the batch"
    if self.region:
      return (f"{self.region} in {self.count} chunks of {self.batch // self.count} "
              f"examples ({whose} of {self.batch}); the rest of the step whole")
    return (f"{self.count} micro-batches of {self.batch // self.count} examples "
            f"({whose} of {self.batch} in {', '.join(self.arguments) or 'the arguments'}), "
            "gradients accumulated")


def argument_groups(fun, arguments: Arguments, args, kwargs) -> tuple[tuple, tuple[str, ...]]:
  """Each dynamic argument's leaf positions among the step's flat inputs,
  with the argument's name in ``fun``'s signature (``argument 1`` where it
  gives none)."""
  _, dyn_args, dyn_kwargs = arguments.split(args, kwargs)
  static = arguments.static_positions(len(args))
  positions = [i for i in range(len(args)) if i not in static]
  try:
    params = [p.name for p in inspect.signature(fun).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  except (TypeError, ValueError):
    params = []
  groups: dict = {}
  for position, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(
      (dyn_args, dyn_kwargs))[0]):
    groups.setdefault(path[:2], []).append(position)

  def name(key) -> str:
    where, which = key
    if where.idx == 1:
      return str(which.key)
    original = positions[which.idx]
    return params[original] if original < len(params) else f"argument {original}"

  return tuple(tuple(g) for g in groups.values()), tuple(name(key) for key in groups)


def sizes_to_try(sizes: Sequence[int], batch: int) -> list[int]:
  """Of the numbers of micro-batches that divide the ``batch`` (``sizes``),
  those tried in turn: the smallest, then the smallest at least twice the
  last, and the largest that leaves two examples or more in each (XLA
  compiles one-example chunks, whose arrays have a dimension of 1, to
  programs that are no smaller)."""
  sizes = [k for k in sizes if 2 * k <= batch] or list(sizes[:1])
  chosen: list[int] = []
  for k in sizes:
    if not chosen or k >= 2 * chosen[-1] or k == sizes[-1]:
      chosen.append(k)
  return chosen


def micro_step(split: Split, k: int, closed, around: dict | None = None):
  """The step of ``split`` in ``k`` micro-batches, traced like ``closed``;
  ``around``: the params of the ``shard_map`` that is the step, whose body
  ``split`` splits (None: ``split`` is the step's own)."""
  run = (micro_batched(split, k) if around is None
         else on_each_device(around, micro_batched(split, k, UNTYPED)))
  return jax.make_jaxpr(run)(*closed.in_avals)


def splittable(graph, closed, groups, names, strided: bool) -> bool:
  """Whether the traced step ``closed`` (of ``graph``) splits into
  micro-batches (see :func:`fit_micro_batches`)."""
  try:
    _split(graph, closed, groups, names, False, strided)
  except NotSplittable:
    return False
  return True


def spread(leaves) -> bool:
  """Whether the step's argument ``leaves`` lie on several devices: its
  chunks are then strided (``schedule._microbatch._chunks``), so that a
  batch sharded over devices stays spread over them in each chunk."""
  return devices_of(leaves) > 1


def _split(graph, closed, groups, names, region: bool,
           strided: bool) -> tuple[Split, float, dict | None]:
  """The split of the traced step ``closed`` (of ``graph``): its batch, or
  (``region``) the region around the largest value at its peak as
  written, in chunks ``strided`` or not; with the share of the modelled
  peak that its chunks hold (1 for the batch). A step that is a
  ``shard_map`` splits its body, each device's batch in blocks: then also
  the ``shard_map``'s params (else None)."""
  mapped = mapped_step(graph)
  around = None if mapped is None else graph.nodes[mapped].params
  if around is not None:
    closed, strided = jex.ClosedJaxpr(around["jaxpr"], ()), False
  if around is not None or any(node.prim.name in REMAT for node in graph.nodes):
    graph = build_graph(closed, inline=REMAT)  # the plan of the chunks replaces the step's
  if not region:
    return split_batch(graph, groups, names, strided), 1.0, around
  memory = unplanned(graph, 0).memory
  near = [key[0] for key in memory.live_at_peak]
  split = split_region(graph, groups, near, names, strided=strided)
  made = {o for i in split.region for o in graph.nodes[i].outs} - set(split.returned())
  held = sum(graph.values[v].nbytes for v in set(near) & made)
  return split, held / max(memory.peak, 1), around


def _chunking(graph, closed, groups, names, region, strided: bool, counts):
  """The counts of chunks to try, the share of the peak the chunks hold (1
  where unknown) and ``make(k) -> (traced step, MicroBatches)``: of the
  batch, the region around the peak (``region`` True) or layers' features
  (``region`` :data:`FEATURES`)."""
  if region == FEATURES:
    made: dict = {}

    def features(k):  # each count traced once, the probe's reused
      if k not in made:
        traced, layers = features_step(closed, k)
        made[k] = traced, MicroBatches(k, 0, (), features=layers)
      return made[k]
    features(max(counts or COUNTS))  # NotSplittable before any compilation
    return list(counts or COUNTS), 1.0, features
  split, held, around = _split(graph, closed, groups, names, region, strided)

  def make(k):
    return micro_step(split, k, closed, around), MicroBatches(
        k, split.batch, split.names, "" if split.whole else _region(split),
        per_device=around is not None)
  return counts or sizes_to_try(split.sizes(), split.batch), held, make


def fit_micro_batches(fit: Callable, measure: Callable, graph, closed, groups, names,
                      limit: int | None, error: BudgetError | None = None,
                      counts: Sequence[int] | None = None, find_smallest: bool = True,
                      region: bool | str = False, planned: bool = True,
                      written: int | None = None,
                      unmet: Callable[[int, MicroBatches], BudgetError] | None = None,
                      strided: bool = False, faster: Callable | None = None):
  """The traced step ``closed`` (of ``graph``) fitted in micro-batches, or
  with only the region around its peak in chunks (``region`` True), or
  with layers' features in chunks (``region`` :data:`FEATURES`).

  Each of ``counts`` (by default those :func:`sizes_to_try` gives) is
  measured as written (``measure(traced)``: its ``footprint``), until one
  gains less than :data:`PLATEAU` over the count before it (then the most
  chunks are measured, and where those fit, the counts between by
  bisection); the fewest
  whose footprint is within ``limit`` bytes are fitted (``fit(traced, micro,
  find_smallest, measured) -> Fit or None``), a quick answer. Where none
  is, the count with the smallest footprint as written is planned, searched
  for the smallest footprint where ``find_smallest``: the error then names
  the smallest of all (``error``, the step's own, included); None where
  there is none (or at once, where not ``planned``: then only the counts
  whose modelled chunks may bring ``written``, the step's footprint, within
  ``limit`` are compiled, and ``unmet(smallest, chunks)`` is raised where none
  fits). Where given, ``faster(measured)`` is asked of each count as
  written: the first it answers no ends the search (None), since more
  chunks only run slower. A batch that cannot be split adds why to
  ``error`` (or answers None); with ``counts`` given, it is a ValueError."""
  try:
    counts, held, make = _chunking(graph, closed, groups, names, region, strided, counts)
  except NotSplittable as why:
    if counts is not None and region != FEATURES:
      raise ValueError(f"jaxmem: micro_batches={counts[0]} asks to split the batch, but "
                       f"{why}. Pass micro_batches=1 to run the step whole.") from None
    if error is None or region is True:
      return None
    if region == FEATURES:
      raise BudgetError(f"{error} Splitting layers' features cannot help either: {why}.",
                        smallest=error.smallest, plan=error.plan) from None
    raise BudgetError(f"{error} Micro-batching cannot help either: {why}.",
                      smallest=error.smallest, plan=error.plan) from None
  if not planned:  # the largest count alone, to name the smallest, where none may fit
    counts = [k for k in counts if written is None or limit is None
              or written * (1 - held * (1 - 1 / k)) <= 1.1 * limit] or (
                  counts[-1:] if unmet else [])
  found, tried = _as_written(counts, make, measure, fit, limit, faster)
  if found is not None or tried is None:
    return found
  if not tried:
    return None
  smallest, k, traced, micro, measured = min(tried, key=lambda t: (t[0], t[1]))
  if not planned and unmet is not None and smallest:
    raise unmet(smallest, micro)
  if not planned:
    return None
  _log.info("jaxmem: no number of chunks fits as written; planning %d", k)
  try:
    found = fit(traced, micro, find_smallest, measured)
  except BudgetError as err:
    # The count as written may come under every plan of it (their backward
    # reads separated): the error names the least of both.
    written_err = unmet(smallest, micro) if unmet is not None and smallest else None
    err = written_err if written_err is not None and written_err.smallest < err.smallest else err
    raise err if error is None or err.smallest < error.smallest else error
  if found is None and error is not None and find_smallest:
    raise error
  fewer = sorted((t[1:] for t in tried if t[1] < k), key=lambda t: t[0])

  def planned_quickly(i: int):  # the i-th fewer count, its residuals planned
    _, traced, micro, measured = fewer[i]
    return _quietly(fit, traced, micro, False, measured)
  return found and _fewest(planned_quickly, len(fewer), found)


def _quietly(fit: Callable, *args):
  """``fit(*args)``, or None where it raises :class:`BudgetError`."""
  try:
    return fit(*args)
  except BudgetError:
    return None


def _as_written(counts, make: Callable, measure: Callable, fit: Callable,
                limit: int | None, faster: Callable | None):
  """``(fit, [])`` of the fewest of ``counts`` whose footprint as written is
  within ``limit`` (see :func:`fit_micro_batches`), or ``(None, tried)``:
  each count measured, ``(footprint, k, traced, micro, measured)``; or
  ``(None, None)`` where ``faster`` says a count is no faster."""
  tried, skipped, queue = [], [], list(counts)

  def at(k: int):
    traced, micro = make(k)
    measured = measure(traced)
    _log.info("jaxmem: %s, as written: %s", micro.describe(), measured.footprint)
    return traced, micro, measured

  def within(traced, micro, measured):
    if limit is None or measured.footprint is None or measured.footprint > limit:
      return None
    return fit(traced, micro, False, measured)

  while queue:
    k = queue.pop(0)
    traced, micro, measured = at(k)
    if faster is not None and not faster(measured):
      _log.info("jaxmem: no faster than the plan that fits: more chunks are slower still")
      return None, None
    found = within(traced, micro, measured)
    if found is not None:
      # Counts the plateau passed over may fit too, in fewer chunks: the
      # footprint can fall at once where chunks grow small (XLA:GPU gives
      # small matrix products no cuBLAS workspace).
      return _fewest(lambda i: _quietly(within, *at(skipped[i])), len(skipped), found), []
    tried.append((measured.footprint or 0, k, traced, micro, measured))
    if len(queue) > 1 and (_levelled([t[0] for t in tried]) or _out_of_reach(
        [t[:2] for t in tried], queue[-1], limit)):
      skipped, queue = queue[:-1], queue[-1:]
  return None, tried


def _levelled(footprints: list[int]) -> bool:
  """Whether the last count of chunks tried lowered the footprint as
  written by less than :data:`PLATEAU` of the one before it."""
  if len(footprints) < 2 or not all(footprints[-2:]):
    return False
  return footprints[-1] >= (1 - PLATEAU) * footprints[-2]


def _out_of_reach(measured: list[tuple[int, int]], most: int, limit: int | None) -> bool:
  """Whether the footprint as written predicted for ``most`` chunks, from
  the last two ``(footprint, count)`` ``measured`` falling as a fixed part
  plus a part over the count, is above ``limit`` by more than
  :data:`OUT_OF_REACH`."""
  if limit is None or len(measured) < 2:
    return False
  (before, fewer), (after, more) = measured[-2:]
  if not before or not after or after >= before:
    return False
  part = (before - after) / (1 / fewer - 1 / more)
  return after - part / more + part / most > (1 + OUT_OF_REACH) * limit


def _fewest(attempt: Callable, count: int, found):
  """``found`` (a fit in some count of chunks), or a fit in fewer chunks
  where one meets the budget too: each chunk costs a pass of the loop
  (kernel launches, the weights read again), so 2048 chunks of 2 examples
  run far slower than 256 of 16. ``attempt(i)`` fits the ``i``-th of
  ``count`` fewer counts (fewest first; a Fit or None), tried by bisection
  (footprints fall as chunks grow in number); on a target with a clock,
  the fit predicted fastest among those found."""
  fits, low, high = [found], 0, count
  while low < high:
    middle = (low + high) // 2
    got = attempt(middle)
    if got is None:
      low = middle + 1
    else:
      fits.append(got)
      high = middle
  if all(f.predicted is not None for f in fits):
    return min(fits, key=lambda f: (f.predicted, f.micro.count))
  return min(fits, key=lambda f: f.micro.count)


def fit_chunked(fit_split: Callable, error: BudgetError | None, counts,
                region: bool | str | None):
  """Where no plan of the step fits: the region around its peak in chunks
  where that fits as written, then the whole step in micro-batches (its
  residuals planned where need be), each by ``fit_split(error, counts,
  region=..., planned=...)`` (:func:`fit_micro_batches` with the rest
  bound); ``region`` True, False or :data:`FEATURES` (layers' features in
  chunks) takes only the one, planned. The error names the smallest of
  all."""
  if region == FEATURES:
    return fit_split(error, counts, region=FEATURES)
  if region is not False:
    try:
      found = fit_split(error if region else None, counts, region=True, planned=bool(region))
    except BudgetError as err:
      if region:
        raise
      found, error = None, err if error is None or err.smallest < error.smallest else error
    if found is not None or region:
      return found
  return fit_split(error, counts, region=False)


def fit_whole_or_chunked(whole: Callable, chunked: Callable, splits: Callable[[], bool],
                         find_smallest: bool = True):
  """The step fitted whole (``whole(only_fitting=...)``, ``None`` where no
  plan fits) or in chunks of its batch (``chunked(error=..., fitted=...)``,
  :func:`fit_chunked`; where a plan fits, :func:`cheaper`).

  Where no plan of the whole step may fit and its batch ``splits()``, the
  chunks are fitted before the search for the whole step's smallest
  footprint (a compilation per candidate), which runs only where they do
  not fit either; the error names the least of both. Where the batch does
  not split, that search comes first, and the chunks' error says why
  they cannot help; layers' features in chunks (:data:`FEATURES`) are
  fitted last."""
  if not find_smallest:
    found = chunked(fitted=whole())
    return chunked(region=FEATURES) if found is None and not splits() else found
  found = whole(only_fitting=True)
  if found is not None:
    return chunked(fitted=found)
  if not splits():
    try:
      found = whole()
    except BudgetError as err:
      try:
        return chunked(error=err)
      except BudgetError as unmet:
        return chunked(error=unmet, region=FEATURES)
    return chunked(fitted=found)
  first = None
  try:
    found = chunked()
  except BudgetError as err:
    first = err
  if found is not None:
    return found
  try:  # a candidate the margins passed over may still fit, or come under the chunks'
    return whole(to_beat=None if first is None else first.smallest)
  except BudgetError as err:
    if first is None:
      return chunked(error=err)
    raise err if err.smallest <= first.smallest else first from None


def cheaper(fitted, fit_split: Callable, clock: Callable | None):
  """``fitted`` (a plan that meets the budget), or the region around the
  step's peak in chunks, or the whole step in micro-batches, where that
  meets it as written in less time: each priced by the target's ``clock``
  (``compiled -> seconds``), the fewest chunks first, and no more of a kind
  once a count as written is no faster than the fastest so far. Micro-batches
  keep the step's numbers (each chunk draws its own slice of a random mask)
  but for the order of the sums. Only where the planner is ``"auto"`` (a
  named planner is the user's choice) and the target has a clock (a GPU
  target: on XLA:CPU the FLOPs cannot price the chunks' loop)."""
  if (fitted.planner.name != "auto" or fitted.predicted is None or clock is None
      or not fitted.result.changes_step):
    return fitted
  best = fitted
  for region in (True, False):  # the region around the peak, then the whole step
    try:
      other = fit_split(None, None, region=region, planned=False, unmet=None,
                        faster=lambda m: clock(m.compiled().baseline) < best.predicted)
    except BudgetError:
      continue
    if other is not None and other.predicted is not None and other.predicted < best.predicted:
      best = other
  if best is fitted:
    return fitted
  return dataclasses.replace(best, micro=dataclasses.replace(
      best.micro, instead=f"a plan that fits takes longer ({fitted.predicted * 1e3:.3g} ms "
      f"against {best.predicted * 1e3:.3g} ms predicted)"))


def _region(split: Split) -> str:
  """The region of ``split``, for reports: its size and where it starts."""
  return f"{len(split.region)} equations from {where(split.graph.nodes[split.region[0]])}"
