"""A plan written as per-block ``jax.checkpoint`` policies, for model code.

A plan made only of whole blocks checkpointed under a policy (the exact
planner's plans with ``drops=False, refine=False`` are) is what wrapping
those blocks in ``nn.remat(Block, policy=...)`` (or ``jax.checkpoint``)
gives: :func:`block_policies` names them, so the plan can move into the
model's own code and train without jaxmem. A plan that recomputes single
residuals, or offloads, has no such form: the error names what it does that
no per-block policy does. A plan of the model's layers checkpointed under
one policy over ``checkpoint_name``\\ s (the names planner's plans are) is
written out as that policy by :func:`name_policy`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxmem.planners._blocks import KEEPS, checkpoint_block, segments
from jaxmem.planners._names import OFFLOADED, SAVE, choice_of, named_blocks, names_plan
from jaxmem._decisions import Plan
from jaxmem.graph._graph import Graph


class NotPolicies(ValueError):
  """A plan that per-block checkpoint policies, or a policy over the step's
  ``checkpoint_name``\\ s, cannot express."""


@dataclasses.dataclass(frozen=True)
class NamePolicy:
  """A ``jax.checkpoint`` policy over ``checkpoint_name``\\ s for the
  model's layers: the names saved on the device and those offloaded to
  host memory (every other value a layer makes is rebuilt), and the
  layers (module paths) the plan checkpoints under it. Callable as the
  policy itself: ``nn.remat(Layer, policy=p)`` or
  ``jax.checkpoint(layer_fn, policy=p)``.
  """
  saved: tuple[str, ...]
  offloaded: tuple[str, ...] = ()
  layers: tuple[str, ...] = ()

  @functools.cached_property
  def policy(self):
    """The ``jax.checkpoint_policies`` policy it stands for (made once:
    ``jax.checkpoint`` calls the policy for every equation it traces)."""
    if not self.offloaded:
      return jax.checkpoint_policies.save_only_these_names(*self.saved)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(self.saved),
        names_which_can_be_offloaded=list(self.offloaded),
        offload_src="device", offload_dst="pinned_host")

  def __call__(self, *args, **params):
    return self.policy(*args, **params)


def block_policies(graph: Graph, plan: Plan) -> dict[str, str]:
  """``plan`` as module path -> policy name (a ``jax.checkpoint_policies``
  attribute): in forward order, each block (at module depth 2, else the
  depth-3 blocks inside it) whose residuals the plan recomputes, under the
  policy that recomputes exactly those; ``{}`` for a plan that recomputes
  nothing.

  Raises:
    NotPolicies: where the plan offloads, splits or recomputes residuals
      that no combination of whole blocks under those policies does.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jaxmem.graph._graph import build_graph
    >>> from jaxmem.planners._choices import Choice, plan_of
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return x + nn.Dense(8)(jnp.tanh(nn.Dense(8)(x)))
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return jnp.sum(Block()(Block()(x)) ** 2)
    >>> net, x = Net(), jnp.ones((4, 8))
    >>> p = net.init(jax.random.key(0), x)
    >>> g = build_graph(jax.make_jaxpr(jax.grad(lambda p: net.apply(p, x)))(p))
    >>> seg = {s.name: s for s in segments(g)}["Net/Block_0"]
    >>> block_policies(g, plan_of(g, [Choice(seg, "nothing_saveable")]))
    {'Net/Block_0': 'nothing_saveable'}
  """
  moved = sorted(v for v, d in plan.items if d.kind in ("offload", "chunked"))
  if moved:
    raise NotPolicies(
        f"the plan keeps {len(moved)} residual(s) in host memory or in chunks "
        f"({_names(graph, moved)}); per-block policies that offload "
        "(jax.checkpoint_policies.offload_dot_with_no_batch_dims, "
        "save_and_offload_only_these_names) are not written out from a plan")
  wanted = plan.values_with("recompute")
  if not wanted:
    return {}
  chosen: dict = {}
  decisions: dict = {}
  first = lambda seg: (graph.blocks(seg.depth)[seg.name][0], seg.depth)
  for seg in sorted(segments(graph), key=first):
    if any(seg.name.startswith(name + "/") for name in chosen):
      continue  # inside a block taken whole
    inside = wanted & set(seg.drops)
    if not inside:
      continue
    for keep in KEEPS:
      trial = dict(decisions)
      checkpoint_block(graph, seg, keep, trial)
      if _recomputed(trial) & set(seg.drops) == inside:
        chosen[seg.name], decisions = keep, trial
        break
  missing = sorted(_recomputed(decisions) ^ wanted)
  if missing:
    raise NotPolicies(
        f"{len(missing)} residual decision(s) of the plan are not those of whole "
        f"blocks under {sorted(KEEPS)} ({_names(graph, missing)}; the blocks that "
        f"match: {chosen or 'none'}); for a plan made only of per-block policies, "
        "fit with planner=jaxmem.planners.ilp(drops=False, refine=False)")
  return chosen


def _recomputed(decisions: dict) -> set:
  return {v for v, d in decisions.items() if d.kind == "recompute"}


def _names(graph: Graph, values, shown: int = 4) -> str:
  """Readable names of the first ``shown`` of ``values``."""
  return _shown([graph.producer(v).label for v in values[:shown]], shown, len(values))


def name_policy(graph: Graph, plan: Plan) -> NamePolicy:
  """``plan`` as a policy over the step's ``checkpoint_name``\\ s for
  its layers (:func:`~jaxmem.planners._names.named_blocks`): each name the
  plan keeps in the layers saved, each it offloads offloaded, every other
  value a layer makes rebuilt from the layer's input. The names planner's
  plans are such.

  Raises:
    NotPolicies: where no layer names a value, or the plan is not the one
      any names policy on the layers gives.
  """
  layers = tuple(seg.name for seg in named_blocks(graph))
  if not layers:
    raise NotPolicies("no layer of the step (no module that repeats) names a value "
                      "with checkpoint_name, so no policy over names applies")
  if not len(plan):
    raise NotPolicies("the plan keeps every residual (the step as written, or run in "
                      "micro-batches, meets the budget): no checkpoint policy applies")
  choice = choice_of(graph, plan)
  nearest = names_plan(graph, choice)
  differ = sorted(v for v in set(plan.as_dict()) | set(nearest.as_dict())
                  if plan[v] != nearest[v])
  if differ:
    raise NotPolicies(
        f"{len(differ)} residual decision(s) of the plan are not those of the layers "
        f"{_shown(layers)} checkpointed under a policy over names ({_names(graph, differ)}; "
        f"the nearest such policy: {choice}); fit with planner='names', whose plans are "
        "such policies")
  return NamePolicy(tuple(n for n, c in choice.items() if c == SAVE),
                    tuple(n for n, c in choice.items() if c == OFFLOADED), layers)


def _shown(names, shown: int = 3, total: int | None = None) -> str:
  """The first ``shown`` of ``names``, and how many more of ``total`` (all
  of ``names`` where None) there are."""
  total = len(names) if total is None else total
  more = f", and {total - shown} more" if total > shown else ""
  return ", ".join(names[:shown]) + more
