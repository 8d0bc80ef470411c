"""A plan written out as per-block checkpoint policies for the model's code."""

import jax
import pytest

import jaxmem
import jaxmem_models as models
from jaxmem.planners._blocks import block_plans, segments
from jaxmem._decisions import OFFLOAD, RECOMPUTE, Plan
from jaxmem.graph._graph import build_graph
from jaxmem.fit._policies import NotPolicies, block_policies
from jaxmem.planners import Fixed, ilp
from jaxmem.targets import xla_footprint

CONFIG = dict(dim=32, depth=2, heads=2, seq=32, vocab=64, batch=4)


@pytest.fixture(scope="module")
def gpt2():
  task = models.get("gpt2", **CONFIG)
  args = jax.jit(task.init)()
  return task, args, build_graph(jax.make_jaxpr(task.step)(*args))


def test_the_policies_of_a_block_plan_give_its_footprint_in_flax(gpt2):
  task, args, graph = gpt2
  plan = block_plans(graph, "nothing_saveable", True)[0]  # the layers
  assert block_policies(graph, plan) == {"GPT2/block0": "nothing_saveable",
                                         "GPT2/block1": "nothing_saveable"}
  # Written into the model (nn.remat around each block with that policy),
  # the plan compiles to what jaxmem's version of it compiles to.
  flax = models.get("gpt2", remat="nothing_saveable", **CONFIG)
  theirs = xla_footprint(jax.jit(flax.step).lower(*args).compile())
  fitted = jaxmem.transform(task.step, budget=int(theirs * 1.1), planner=Fixed(plan),
                            reserve=0)
  assert fitted.fit(*args).plan == plan
  ours = xla_footprint(fitted.lower(*args).compile())
  assert abs(ours / theirs - 1) <= 0.05, (ours, theirs)


def test_a_fit_of_block_choices_only_is_written_out(gpt2):
  task, args, _ = gpt2
  fit = jaxmem.transform(task.step, budget="75%",
                         planner=ilp(drops=False, refine=False)).fit(*args)
  policies = fit.policies()
  assert policies and set(policies.values()) <= {
      "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"}
  assert all(name.startswith("GPT2/") for name in policies)


def test_what_no_policy_does_is_named(gpt2):
  _, _, graph = gpt2
  assert block_policies(graph, Plan()) == {}
  # Every other residual of a block recomputed: no policy of it, or of the
  # blocks inside it, recomputes just those.
  block = {s.name: s for s in segments(graph)}["GPT2/block0"]
  some = sorted(block.drops)[::2]
  with pytest.raises(NotPolicies, match=r"drops=False, refine=False"):
    block_policies(graph, Plan.of({v: RECOMPUTE for v in some}))
  with pytest.raises(NotPolicies, match="host memory"):
    block_policies(graph, Plan.of({some[0]: OFFLOAD}))
  assert issubclass(NotPolicies, ValueError)
