"""Block checkpoints: saved block boundaries, block moves, refinement.

A plan may save forward values that the backward pass does not read (block
inputs) so that recomputation starts there, as per-block ``jax.checkpoint``
does. These tests check the rewrite honours the boundaries, rebuilds each
block once, gives the untransformed step's numbers, and that jaxmem meets
the footprint of the hand-written per-block remat baseline.
"""

import collections

import jax
import optax
import pytest

import jaxmem
from jaxmem.cost._xla_clock import program_time
from jaxmem.targets import placed, resolve, xla_footprint
import jaxmem_models as models
from jaxmem.schedule._emit import emit
from jaxmem.fit._saved import dumps, loads
from jaxmem.planners._blocks import block_plans, rebuilt_as_checkpointed, segments
from jaxmem.cost._evaluate import Candidate, evaluate, unplanned
from tests.helpers import assert_trees_close, xla_budget

# Activation-dominated (the residuals outweigh parameters and Adam's state).
GPT2 = dict(dim=32, depth=2, heads=2, seq=64, vocab=64, batch=8)


@pytest.fixture(scope="module")
def gpt2():
  task = models.get("gpt2", optimizer=optax.adam(1e-3, eps=1e-3), **GPT2)
  state, batch = task.init()
  graph = jaxmem.analyze(task.step, state, batch).graph
  return task, (state, batch), graph


def test_segments_are_the_model_blocks(gpt2):
  _, _, graph = gpt2
  names = [s.name for s in segments(graph)]
  assert {"GPT2/block0", "GPT2/block1"} <= set(names), names
  for seg in segments(graph):
    inside = set(graph.blocks(seg.name.count("/") + 1)[seg.name])
    for vid in seg.drops:  # made inside, read by no forward node outside
      assert graph.residual(vid).produced_at in inside
      assert all(u in inside for u in graph.values[vid].uses
                 if not graph.nodes[u].backward)
    for vid in seg.saves:  # made outside, read inside
      assert graph.values[vid].producer not in inside
      assert inside & set(graph.values[vid].uses)


def test_block_plan_recomputes_each_block_once_from_its_boundary(gpt2):
  _, _, graph = gpt2
  plan = block_plans(graph)[0]
  assert plan.values_with("save"), "block inputs that are not residuals are saved"
  schedule, _ = evaluate(graph, plan)
  reruns = collections.Counter(op.node for op in schedule.ops if op.kind == "recompute")
  assert reruns and max(reruns.values()) == 1, reruns.most_common(3)
  # Each recomputation rebuilds values of the block whose backward pass runs
  # next: it starts at the saved boundary, not in an earlier block.
  blocks = {i: name for name, nodes in graph.blocks(2).items() for i in nodes}
  ops = schedule.ops
  for pos, op in enumerate(ops):
    if op.kind != "recompute" or op.node not in blocks:
      continue
    consumer = next(o for o in ops[pos:] if o.kind == "node")
    assert blocks[op.node] == graph.nodes[consumer.node].scope(), (
        graph.nodes[op.node].readable, graph.nodes[consumer.node].readable)


def test_block_plan_gives_the_same_numbers(gpt2):
  task, (state, batch), graph = gpt2
  schedule, _ = evaluate(graph, block_plans(graph)[0])
  run = jax.jit(emit(schedule))
  want_state, got_leaves = state, jax.tree_util.tree_leaves(((state, batch), {}))
  for _ in range(2):
    want_state, want_loss = jax.jit(task.step)(want_state, batch)
    got = run(*got_leaves)
    assert_trees_close(got, jax.tree_util.tree_leaves((want_state, want_loss)))
    got_leaves = got[:-1] + got_leaves[len(got) - 1:]


def _recomputed_producers(graph, plan) -> set:
  """The nodes whose outputs ``plan`` drops."""
  return {graph.values[v].producer for v in plan.values_with("recompute")}


def test_policy_shaped_plans_keep_what_the_policy_saves(gpt2):
  """``dots_with_no_batch_dims_saveable``'s plan keeps (or saves) every
  projection's output, so it recomputes fewer FLOPs than
  ``nothing_saveable``'s. With ``layers``, only the repeated blocks are
  checkpointed: the embedding, final norm and head keep what they made."""
  _, _, graph = gpt2
  plan = block_plans(graph, "dots_with_no_batch_dims_saveable", False)[0]
  dropped = _recomputed_producers(graph, plan)
  dots = [n for n in graph.nodes if n.prim.name == "dot_general" and not n.backward
          and n.scope(2) in ("GPT2/block0", "GPT2/block1")]
  projections = [n for n in dots if not n.params["dimension_numbers"][1][0]]
  scores = [n for n in dots if n.params["dimension_numbers"][1][0]]
  assert projections and scores
  assert not dropped & {n.index for n in projections}
  nothing = block_plans(graph, "nothing_saveable", False)[0]
  assert plan.values_with("recompute")
  assert (evaluate(graph, plan)[0].recompute_flops
          < evaluate(graph, nothing)[0].recompute_flops)
  layers = block_plans(graph, "nothing_saveable", True)[0]
  assert {graph.nodes[i].scope(2) for i in _recomputed_producers(graph, layers)} == {
      "GPT2/block0", "GPT2/block1"}
  assert len(nothing.values_with("recompute")) > len(layers.values_with("recompute"))


def test_a_blocks_backward_reads_what_its_recomputation_started_from(gpt2):
  """After a block's recomputation, the block's backward equations read
  the barrier copies of the kept values the recomputation started from (as
  ``jax.checkpoint``'s backward pass does), not the originals, so the
  compiler may fuse what they compute from them with the recomputation."""
  _, _, graph = gpt2
  ops = evaluate(graph, block_plans(graph)[0])[0].ops
  copies, scope, checked = {}, None, 0
  for pos, op in enumerate(ops):
    following = [o for o in ops[pos + 1:] if o.kind in ("recompute", "node")]
    if op.kind == "barrier" and following and following[0].kind == "recompute":
      # A recomputation's barrier: the block is that of the node it serves.
      scope = graph.nodes[next(o for o in following if o.kind == "node").node].scope()
      copies = {key[0]: copy for key, copy in zip(op.ins, op.outs)}
    elif (op.kind == "node" and graph.nodes[op.node].backward
          and graph.nodes[op.node].scope() == scope):
      for key in op.ins:
        if isinstance(key, tuple) and key[0] in copies:
          assert key == copies[key[0]], (graph.nodes[op.node].readable, key)
          checked += 1
  assert checked


def _rebuild_barriers(graph, ops) -> list:
  """``(barrier op, block scope)`` of each barrier that opens a
  recomputation, the scope being that of the node the recomputation serves."""
  found = []
  for pos, op in enumerate(ops):
    following = [o for o in ops[pos + 1:] if o.kind in ("recompute", "node")]
    if op.kind == "barrier" and following and following[0].kind == "recompute":
      found.append((op, graph.nodes[next(o for o in following if o.kind == "node").node].scope()))
  return found


def test_a_block_rebuilt_as_checkpointed_rebuilds_once_behind_one_barrier(gpt2):
  """Rebuilt as per-block ``jax.checkpoint`` rebuilds (``with_block``), each
  block's residuals are rebuilt together behind one barrier, tied to the
  gradient entering the block; the block's output, read by the module
  after it, is kept. The numbers are the step's."""
  task, (state, batch), graph = gpt2
  lazy = block_plans(graph)[0]
  plan = rebuilt_as_checkpointed(graph, lazy)
  assert plan.values_with("recompute") and all(
      d.with_block for _, d in plan if d.kind == "recompute")
  kept = lazy.values_with("recompute") - plan.values_with("recompute")
  block = lambda index: graph.nodes[index].scope()
  assert all(any(block(u) != block(graph.values[v].producer) for u in graph.values[v].uses)
             for v in kept)
  schedule, _ = evaluate(graph, plan)
  barriers = _rebuild_barriers(graph, schedule.ops)
  per_block = collections.Counter(scope for _, scope in barriers)
  assert {"GPT2/block0", "GPT2/block1"} <= set(per_block)
  assert all(n == 1 for n in per_block.values()), per_block
  lazy_barriers = _rebuild_barriers(graph, evaluate(graph, lazy)[0].ops)
  assert max(collections.Counter(scope for _, scope in lazy_barriers).values()) > 1
  checked = set()
  for op, scope in barriers:
    # The anchor is the gradient entering the block: of the backward values
    # emitted so far that the block reads and does not make, the latest.
    entering = {a for n in graph.nodes if n.backward and n.scope() == scope for a in n.ins
                if isinstance(a, int) and graph.is_backward_value(a)
                and block(graph.values[a].producer) != scope}
    made = [key[0] for o in schedule.ops[:schedule.ops.index(op)]
            if o.kind == "node" and graph.nodes[o.node].backward for key in o.outs]
    entered = [v for v in made if v in entering]
    if entered:  # none in the head: the loss's gradient enters as a constant
      assert op.ins[-1][0] == entered[-1], scope
      checked.add(scope)
  assert {"GPT2/block0", "GPT2/block1", "GPT2/ln_f"} <= checked, checked
  assert loads(dumps(plan, "step"), "step") == plan
  run = jax.jit(emit(schedule))
  want = jax.jit(task.step)(state, batch)
  assert_trees_close(run(*jax.tree_util.tree_leaves(((state, batch), {}))),
                     jax.tree_util.tree_leaves(want))


# The zoo's CPU width, two blocks: at it, XLA:GPU for an H100 computes each
# block's output inside the next block's first fusion, so the backward pass
# reads a block's residuals through the module after it.
ON_H100 = dict(dim=64, depth=2, heads=2, seq=128, vocab=256, batch=8)


def rebuilt_against_policy(model: str, config: dict, policy: str, target: str, tmp_path,
                           budget=None):
  """``model``'s per-block ``policy`` plan rebuilt as checkpointed, fitted for
  ``target`` (at ``budget``, else just under the step's footprint), and
  ``nn.remat(Block, policy=...)``'s program compiled for it."""
  task = models.get(model, optimizer=optax.adam(1e-3, eps=1e-3), **config)
  remat = models.get(model, optimizer=optax.adam(1e-3, eps=1e-3), remat=policy, **config)
  where = resolve(target, ())
  shapes = placed(jax.eval_shape(task.init), target)
  baseline = jax.jit(remat.step, compiler_options=where.options()).lower(*shapes).compile()
  written = jaxmem.transform(task.step, budget=10**12, target=target, reserve=0).fit(*shapes)
  assert written.graph.buffers is not None  # planned on XLA:GPU's own buffers
  plan = rebuilt_as_checkpointed(written.graph, block_plans(written.graph, policy, True)[0])
  path = tmp_path / "plan.json"
  path.write_text(dumps(plan, written.step))
  budget = written.unconstrained - 1 if budget is None else budget(baseline)
  fit = jaxmem.transform(task.step, budget=budget, target=target, reserve=0,
                         plan=str(path)).fit(*shapes)
  assert fit.plan == plan and fit.micro is None and not fit.graph.hosted
  return fit, xla_footprint(baseline), program_time(baseline.as_text(), where.profile).seconds


@pytest.mark.parametrize("policy", [
    "nothing_saveable", pytest.param("dots_saveable", marks=pytest.mark.slow)])  # 25 s each
def test_a_block_rebuilt_as_checkpointed_is_jax_checkpoints_program_on_an_h100(
    policy, tmp_path):
  """On an H100 target, where the memory model follows XLA:GPU's fusion
  (some residuals are read through values XLA computes inside their
  readers, across a block's boundary), the per-block ``policy`` plan
  rebuilt as checkpointed compiles to what ``nn.remat(Block, policy=...)``
  compiles to: no larger a footprint and no slower a predicted time."""
  fit, footprint, seconds = rebuilt_against_policy("gpt2", ON_H100, policy, "h100", tmp_path)
  assert fit.footprint <= footprint
  assert fit.predicted <= seconds * (1 + 1e-9)


# Two MobileNetV2 blocks of one stage, the second with its residual add.
SMALL_MOBILENET = dict(width=0.25, stages=((1, 8, 1, 1), (6, 8, 2, 2)), size=16, batch=4)


def test_a_convnets_blocks_rebuilt_as_checkpointed_are_jax_checkpoints_program(tmp_path):
  """MobileNetV2's blocks (BatchNorm, depthwise convolutions, a residual
  add) rebuilt as checkpointed compile for an H100 to exactly
  ``nn.remat``'s footprint and predicted time. As in ``jax.checkpoint``'s
  program, every parameter and residual a block's backward pass reads goes
  through the block's barrier, and so do all its reads of the gradient
  entering it. Otherwise XLA computes a BatchNorm's bias gradient apart
  from its input gradient, and transposes an activation for a kernel
  gradient in the forward pass (6% larger and 2% slower here)."""
  fit, footprint, seconds = rebuilt_against_policy(
      "mobilenetv2", SMALL_MOBILENET, "dots_saveable", "h100", tmp_path)
  assert fit.footprint == footprint
  assert fit.predicted == pytest.approx(seconds, rel=1e-9)


def test_a_block_rebuilt_as_checkpointed_leaves_kernel_gradients_unpinned():
  """Per-block ``jax.checkpoint`` reads a kernel gradient's inputs as the
  rebuild made them; a barrier copy there ends the fusion of an activation
  with its padding that XLA:GPU shares between the convolution and its
  kernel gradient (MobileNetV2 on a T4: 12.77 MiB against ``nn.remat``'s
  12.41 MiB with it, 12.41 MiB without). Elsewhere such reads are pinned."""
  task = models.get("mobilenetv2", optimizer=optax.sgd(0.1),
                    width=0.25, stages=((1, 8, 1, 1), (6, 8, 1, 2)), size=16, batch=2)
  graph = jaxmem.analyze(task.step, *task.init()).graph
  plan = block_plans(graph, "nothing_saveable", True)[0]

  def pinned(plan) -> int:  # kernel gradients reading a barrier made just for them
    ops = evaluate(graph, plan)[0].ops
    return sum(1 for before, op in zip(ops, ops[1:])
               if op.kind == "node" and graph.transposes_inputs(graph.nodes[op.node])
               and before.kind == "barrier" and set(before.outs) & set(op.ins))
  assert pinned(plan) > 0
  assert pinned(rebuilt_as_checkpointed(graph, plan)) == 0


@pytest.mark.slow  # 60 s
def test_a_block_rebuilt_as_checkpointed_meets_nn_remats_program_on_a_t4(tmp_path):
  """MobileNetV2 at the zoo's CPU size on a T4: at ``nn.remat``'s footprint,
  the per-block ``nothing_saveable`` plan rebuilt as checkpointed fits, no
  slower by the clock."""
  from jaxmem._zoo import models as zoo
  fit, footprint, seconds = rebuilt_against_policy(
      "mobilenetv2", dict(zoo().CPU_SIZES["mobilenetv2"]), "nothing_saveable", "t4",
      tmp_path, budget=xla_footprint)
  assert fit.footprint <= footprint
  assert fit.predicted <= seconds * (1 + 1e-9)


def flops(compiled) -> float:
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


@pytest.mark.parametrize("policy", [
    "nothing_saveable", pytest.param("dots_saveable", marks=pytest.mark.slow)])  # 57 s
def test_meets_the_per_block_remat_footprint_with_less_work(gpt2, policy):
  """At the XLA footprint of a per-block remat baseline, jaxmem fits (XLA's
  compiled footprint within it) with the same numbers, and XLA counts no
  more FLOPs in its step than in the baseline's."""
  task, args, _ = gpt2
  remat = models.get("gpt2", optimizer=optax.adam(1e-3, eps=1e-3), remat=policy, **GPT2)
  baseline = jax.jit(remat.step).lower(*remat.init()).compile()
  budget = xla_footprint(baseline)
  fitted = jaxmem.transform(task.step, budget=budget)
  plan = fitted.fit(*args)
  assert plan.footprint <= budget < plan.unconstrained
  assert flops(fitted.lower(*args).compile()) <= flops(baseline)
  assert_trees_close(fitted(*args), jax.jit(task.step)(*args))


def test_refinement_keeps_residuals_again_where_the_budget_allows(gpt2):
  _, _, graph = gpt2
  planner = jaxmem.Greedy()
  start = block_plans(graph)[0]
  schedule, profile = evaluate(graph, start)
  loose = int(profile.peak * 1.3)
  result = Candidate(start, schedule, profile, loose, True)
  refined = planner.refined(graph, result, loose)
  assert refined.peak <= loose
  assert len(refined.plan.values_with("recompute")) < len(start.values_with("recompute"))
  assert refined.schedule.recompute_flops < schedule.recompute_flops


def test_fits_tries_the_block_shaped_plans_before_answering_no(gpt2):
  """``fits`` (the max-batch probe) answers True where the planner's search
  toward the budget fails but a plan shaped like a per-block baseline fits."""
  task, args, _ = gpt2
  greedy = jaxmem.Greedy()

  class KeepsEverything(jaxmem.Planner):
    """A planner whose search never gets under the budget."""
    name = "keeps-everything"

    def plan(self, graph, aim, start=None):
      return unplanned(graph, aim)

    def structured(self, graph):
      return greedy.structured(graph)

  fitted = jaxmem.transform(task.step, budget="70%", planner=KeepsEverything())
  assert fitted.can_fit(*args)
  plan = fitted.fit(*args)
  assert plan.footprint <= xla_budget(task.step, args, "70%") and len(plan.plan) > 0
  assert_trees_close(fitted(*args), jax.jit(task.step)(*args))
  # With nothing to fall back on (micro-batches aside), the probe answers no at once.
  del KeepsEverything.structured
  assert not jaxmem.transform(task.step, budget="70%", planner=KeepsEverything(),
                              micro_batches=1).can_fit(*args)
