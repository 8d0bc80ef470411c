"""The names planner: which of the step's named values a per-layer
``jax.checkpoint`` policy over ``checkpoint_name``\\ s saves, offloads or
rebuilds.

Models written for rematerialization name their intermediate values with
``jax.ad_checkpoint.checkpoint_name`` (MaxText's ``query_proj``,
``mlpwo``, ...), wrap each layer in ``nn.remat`` (or ``jax.checkpoint``)
under a policy such as
``jax.checkpoint_policies.save_and_offload_only_these_names``, and pick
the names by hand. This planner searches that space for the budget: the
model's layers (the blocks that repeat, :func:`named_blocks`) are
checkpointed, their inputs saved, and each name is saved, offloaded (with a
target that has a host link) or rebuilt in every layer alike; every other
value a layer makes is rebuilt from its input. Its plans are written out as
that policy by :func:`jaxmem.fit._policies.name_policy`, so the model's
code can train them without jaxmem.

The search is greedy: from every name saved, each step changes the one
name whose change lowers the model's peak most per unit of added cost,
until the peak fits; then names are saved again, the costliest to rebuild
first, wherever the peak stays within the aim.
"""

from __future__ import annotations

import dataclasses
import time

from jaxmem._decisions import OFFLOAD, SAVE as SAVED, Plan
from jaxmem.cost._evaluate import Candidate, candidate, fused_values, paused_gc
from jaxmem.graph._graph import Graph, analysis
from jaxmem.planners._base import Planner
from jaxmem.planners._blocks import Segment, checkpoint_moves, repeated, segments

# What a policy does with a name.
SAVE, OFFLOADED, REBUILT = "save", "offload", "rebuild"


class NoNames(ValueError):
  """A step whose layers name none of their values, given to the names
  planner."""


@analysis
def named_values(graph: Graph) -> dict[str, tuple[int, ...]]:
  """``checkpoint_name`` -> the forward values it names (each ``name``
  equation's operand and its named view, one buffer), in forward order."""
  found: dict[str, list[int]] = {}
  for node in graph.nodes:
    if node.prim.name == "name" and not node.backward:
      vids = found.setdefault(node.params["name"], [])
      vids += [v for v in (*node.ins, *node.outs) if isinstance(v, int) and v not in vids]
  return {name: tuple(vids) for name, vids in found.items()}


@analysis
def named_blocks(graph: Graph) -> tuple[Segment, ...]:
  """The blocks a names policy wraps: the model's layers (blocks that
  repeat, at module depth 2, else 3) that make a named value; none where
  no layer does."""
  named = {v for vids in named_values(graph).values() for v in vids}
  for depth in (2, 3):
    found = segments(graph, (depth,))
    layers = repeated([seg.name for seg in found])
    chosen = tuple(seg for seg in found if seg.name in layers and any(
        graph.values[v].producer in graph.blocks(depth)[seg.name] for v in named))
    if chosen:
      return chosen
  return ()


@analysis
def _layer_values(graph: Graph) -> tuple[tuple[Segment, tuple[tuple[str, int], ...]], ...]:
  """Each layer (:func:`named_blocks`) with the named values it makes, as
  ``(name, value id)`` pairs in forward order."""
  named = named_values(graph)
  found = []
  for seg in named_blocks(graph):
    inside = set(graph.blocks(seg.depth)[seg.name])
    found.append((seg, tuple((name, v) for name, vids in named.items() for v in vids
                             if graph.values[v].producer in inside)))
  return tuple(found)


def names_plan(graph: Graph, choice: dict[str, str]) -> Plan:
  """The plan of the layers checkpointed under a names policy: each layer's
  input saved and the residuals it makes rebuilt, but a named one saved
  (kept) or offloaded as ``choice`` says (saved where it does not say); a
  named value no backward equation reads, where saved, is kept for the
  rebuild to start from."""
  decisions: dict = {}
  for seg, values in _layer_values(graph):
    decisions.update(checkpoint_moves(graph, seg, decisions))
    drops = set(seg.drops)
    for name, vid in values:
      place = choice.get(name, SAVE)
      if place == REBUILT:
        continue
      if vid in drops:
        if place == SAVE:
          decisions.pop(vid)
        else:
          decisions[vid] = OFFLOAD
      elif place == SAVE and not graph.is_residual(vid):
        decisions[vid] = SAVED
  return Plan.of(decisions)


@dataclasses.dataclass
class Names(Planner):
  """Plans over the step's ``checkpoint_name``\\ s (``planner="names"``; see
  the module docstring): its layers checkpointed, each name saved,
  offloaded or rebuilt in every layer. With a target that has a host link,
  names may be offloaded; a plan's cost is its predicted time there
  (recomputed FLOPs without a target).

  Raises (from :meth:`plan`):
    NoNames: where no layer of the step names a value.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> from jaxmem.graph._graph import build_graph
    >>> class Layer(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     h = checkpoint_name(jnp.tanh(nn.Dense(64)(x)), "hidden")
    ...     return x + nn.Dense(64)(h)
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     for _ in range(4):
    ...       x = Layer()(x)
    ...     return jnp.sum(x ** 2)
    >>> net, x = Net(), jnp.ones((256, 64))
    >>> p = net.init(jax.random.key(0), x)
    >>> g = build_graph(jax.make_jaxpr(jax.grad(lambda p: net.apply(p, x)))(p))
    >>> [seg.name for seg in named_blocks(g)]
    ['Net/Layer_0', 'Net/Layer_1', 'Net/Layer_2', 'Net/Layer_3']
    >>> everything = Names().plan(g, aim=10 ** 9)
    >>> choice_of(g, everything.plan)
    {'hidden': 'save'}
    >>> choice_of(g, Names().plan(g, aim=Names().lowest(g)[0].peak).plan)
    {'hidden': 'rebuild'}
  """
  name: str = "names"
  target: object = None
  assumed_target: bool = False
  # Evaluations the give-back pass may spend saving names again.
  refine: int = 16

  def may_offload(self) -> bool:
    profile = self.target_profile
    return profile is not None and not profile.unified

  def weighs(self, graph: Graph) -> int:
    """A step changes one name, trying every name's moves."""
    k = len(named_values(graph))
    return 2 * k * k + self.refine + 2

  def plan(self, graph: Graph, aim: int, start: Plan | None = None) -> Candidate:
    """The greedy's plan for ``aim`` (``start`` is not used: a search over
    a few names starts from all saved)."""
    began = time.perf_counter()
    names = self._names(graph)
    with paused_gc():
      choice = {name: SAVE for name in names}
      current = candidate(graph, names_plan(graph, choice), aim)
      while not current.fits:
        step = self._step(graph, choice, current, aim)
        if step is None:
          break
        choice, current = step
      if current.fits:
        choice, current = self._saved_again(graph, choice, current, aim)
    current.seconds = time.perf_counter() - began
    return current

  def lowest(self, graph: Graph, start: Plan | None = None) -> list[Candidate]:
    """Every name rebuilt, and with a host link every name offloaded that
    can be, lowest model peak first."""
    names = self._names(graph)
    plans = [{name: REBUILT for name in names}]
    away = {name: self._away(graph, name) for name in names}
    if away != plans[0]:
      plans.append(away)
    return sorted((candidate(graph, names_plan(graph, c)) for c in plans),
                  key=lambda c: c.peak)

  def _names(self, graph: Graph) -> tuple[str, ...]:
    names = tuple(_in_blocks(graph))
    if not names:
      raise NoNames(
          "jaxmem: planner 'names' chooses which values a checkpoint policy over "
          "jax.ad_checkpoint.checkpoint_name saves in each of the model's layers, and "
          "no layer of this step (no module that repeats) names a value. Name them in "
          "the layer's code (h = checkpoint_name(h, 'mlp_hidden')), or use "
          "planner='auto'.")
    return names

  def _away(self, graph: Graph, name: str) -> str:
    """Offloaded where the target has a host link and the name can be
    (:func:`offloadable`); else rebuilt."""
    return OFFLOADED if self.may_offload() and name in offloadable(graph) else REBUILT

  def _step(self, graph: Graph, choice: dict, current: Candidate,
            aim: int) -> tuple[dict, Candidate] | None:
    """The one change of a saved name (to offloaded, to rebuilt) that
    lowers the peak most per added cost; None where none lowers it."""
    base = self.cost(current.schedule)
    best = None
    for name, place in choice.items():
      if place != SAVE:
        continue
      for moved in dict.fromkeys((self._away(graph, name), REBUILT)):
        trial = {**choice, name: moved}
        found = candidate(graph, names_plan(graph, trial), aim)
        gain = current.peak - found.peak
        if gain <= 0:
          continue
        score = gain / (max(self.cost(found.schedule) - base, 0.0) + 1.0)
        if best is None or score > best[0]:
          best = (score, trial, found)
    return None if best is None else best[1:]

  def _saved_again(self, graph: Graph, choice: dict, current: Candidate,
                   aim: int) -> tuple[dict, Candidate]:
    """Names saved again, the costliest to rebuild or fetch first, wherever
    the peak stays within ``aim`` (within ``refine`` evaluations): a step
    taken early may leave more room than the last one needed."""
    moved = [name for name, place in choice.items() if place != SAVE]
    base = self.cost(current.schedule)
    ranked = []
    for name in moved:
      found = candidate(graph, names_plan(graph, {**choice, name: SAVE}), aim)
      ranked.append((base - self.cost(found.schedule), name, found))
    for _, name, found in sorted(ranked, key=lambda r: -r[0])[:self.refine]:
      trial = {**choice, name: SAVE}
      plan = names_plan(graph, trial)
      if found.plan != plan:  # another name saved again since it was ranked
        found = candidate(graph, plan, aim)
      if found.fits and self.cost(found.schedule) <= self.cost(current.schedule):
        choice, current = trial, found
    return choice, current


def _in_blocks(graph: Graph) -> dict[str, list[int]]:
  """Each name made in a layer (:func:`named_blocks`) -> its values there."""
  found: dict[str, list[int]] = {}
  for _, values in _layer_values(graph):
    for name, vid in values:
      found.setdefault(name, []).append(vid)
  return {name: found[name] for name in named_values(graph) if name in found}


def _layer_drops(graph: Graph) -> set[int]:
  """The residuals the layers rebuild where nothing of them is saved."""
  return {v for seg, _ in _layer_values(graph) for v in seg.drops}


@analysis
def offloadable(graph: Graph) -> frozenset[str]:
  """The names the backward pass reads in the layers (a residual among
  each name's values there), each such residual one the layers rebuild,
  with a buffer of its own: what a plan may offload."""
  fused, drops = fused_values(graph), _layer_drops(graph)
  read = {name: [v for v in vids if graph.is_residual(v)]
          for name, vids in _in_blocks(graph).items()}
  return frozenset(name for name, vids in read.items()
                   if vids and all(v in drops and v not in fused for v in vids))


def choice_of(graph: Graph, plan: Plan) -> dict[str, str]:
  """Each name's place that ``plan`` gives its first residual made in a
  layer (saved for a name with none): the names policy nearest to it."""
  kinds = {"offload": OFFLOADED, "recompute": REBUILT}
  drops = _layer_drops(graph)
  choice = {}
  for name, vids in _in_blocks(graph).items():
    residuals = [v for v in vids if v in drops]
    if residuals:
      choice[name] = kinds.get(plan[residuals[0]].kind, SAVE)
    else:
      choice[name] = SAVE if any(plan[v].kind == "save" for v in vids) else REBUILT
  return choice
