"""Deliberate breakages of jaxmem, each of which the suite must catch.

Run ``python tests/mutants.py`` (all, a few minutes on two cores) or name
some (``python tests/mutants.py offload-reads-original chunk-bounds``).
Each mutant is a text change to one file of a copy of the tree (the
tracked files, so uncommitted edits count); the named tests run on the copy
and must fail. The table says which were caught. A mutant whose text no
longer appears in its file is reported as stale: the list is kept by hand,
beside the code it breaks.

Not part of the suite (``pytest`` does not collect it): it runs the suite.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  what: str  # the breakage, in words
  path: str
  old: str
  new: str
  tests: tuple  # pytest node ids or -k expressions (after "-k")


MUTANTS = [
    Mutant("offload-reads-original",
           "the backward pass reads the device original of an offloaded value "
           "instead of the copy brought back from host",
           "jaxmem/schedule/_emit.py",
           "      if op.kind in _SPACES:\n        outs = [jax.device_put(args[0], _SPACES[op.kind]())]\n",
           "      if op.kind == 'offload':\n"
           "        outs = [jax.device_put(args[0], _SPACES[op.kind]())]\n"
           "        env['original', op.outs[0][0]] = args[0]\n"
           "      elif op.kind == 'prefetch':  # the copy is made, and not read\n"
           "        jax.device_put(args[0], _SPACES[op.kind]())\n"
           "        outs = [env['original', op.outs[0][0]]]\n",
           ("tests/test_offload.py", "tests/test_hybrid.py", "tests/test_vtensor.py")),
    Mutant("copies-back-cost-nothing",
           "the memory model charges values copied back from host 0 device bytes",
           "jaxmem/cost/_memory.py",
           'host = ({k for op in ops if op.kind == "offload" for k in op.outs}',
           'host = ({k for op in ops if op.kind in ("offload", "prefetch") for k in op.outs}',
           ("tests/test_host_accounting.py", "tests/test_offload.py", "tests/test_hybrid.py")),
    Mutant("chunk-bounds",
           "the emitter cuts equal chunks instead of the plan's bounds",
           "jaxmem/schedule/_emit.py",
           "[jax.lax.slice_in_dim(args[0], start, stop, axis=axis)\n"
           "             for start, stop in bounds]",
           "[jax.lax.slice_in_dim(args[0], i * bounds[-1][1] // len(bounds),\n"
           "                                  (i + 1) * bounds[-1][1] // len(bounds), axis=axis)\n"
           "             for i in range(len(bounds))]",
           ("tests/test_vtensor.py",)),
    Mutant("budget-fraction-of-more",
           "a fraction budget is resolved against 1.1x the unconstrained footprint",
           "jaxmem/_budget.py",
           "    return int(self.fraction * unconstrained_bytes)",
           "    return int(self.fraction * unconstrained_bytes * 1.1)",
           ("tests/test_transform.py::test_budget_is_met_and_numbers_match",
            "tests/test_hybrid.py::test_offload_plans_give_the_same_numbers")),
    Mutant("small-update-dropped",
           "a rewritten step leaves its second parameter as it was (a small "
           "gradient dropped entirely, as an attention key kernel's can be)",
           "jaxmem/schedule/_emit.py",
           "    return [read(k) for k in schedule.outputs]\n",
           "    outs = [read(k) for k in schedule.outputs]\n"
           "    return [flat[1] if i == 1 and flat[1].shape == o.shape else o\n"
           "            for i, o in enumerate(outs)]\n",
           ("tests/test_models.py::test_vtensor_and_block_plans_match_on_the_zoo[gpt2]",)),
    Mutant("backward-matmuls-off",
           "every backward matmul of a rewritten step is 1% off (a gradient error "
           "small beside the parameters)",
           "jaxmem/schedule/_emit.py",
           "      out = node.prim.bind(*subfuns, *args, **bind_params)\n",
           "      out = node.prim.bind(*subfuns, *args, **bind_params)\n"
           "      if node.backward and node.prim.name == 'dot_general':\n"
           "        out = out * 0.99\n",
           ("tests/test_models.py::test_vtensor_and_block_plans_match_on_the_zoo",)),
    Mutant("loop-stack-not-hosted",
           "a stack offloaded inside its loop stays on the device",
           "jaxmem/schedule/_scan_remat.py",
           "if o in hosted else outs[o]",
           "if False else outs[o]",
           ("tests/test_scan_offload.py",)),
    Mutant("loop-slice-not-fetched",
           "a backward scan reads its hosted slices without copying them back",
           "jaxmem/schedule/_scan_remat.py",
           "if jax.typeof(x).memory_space == jax.memory.Space.Host else x for x in xs]",
           "if False else x for x in xs]",
           ("tests/test_scan_offload.py",)),
    Mutant("hosted-stacks-on-device",
           "the memory model counts stacks a loop keeps on the host as device bytes",
           "jaxmem/cost/_memory.py",
           'if op.kind == "offload" for k in op.outs} | schedule.hosted',
           'if op.kind == "offload" for k in op.outs}',
           ("tests/test_scan_offload.py",)),
    Mutant("loop-copies-untimed",
           "the performance model ignores the copies a loop makes per iteration",
           "jaxmem/cost/_perf.py",
           'if looped and op.kind == "node":',
           "if False:",
           ("tests/test_scan_offload.py",)),
    Mutant("no-hosted-loop-variants",
           "the lowest search never tries loops with their stacks on the host",
           "jaxmem/fit/_fit.py",
           "host=self.planner.may_offload())]",
           "host=False)]",
           ("tests/test_scan_offload.py",)),
    Mutant("segments-in-forward-order",
           "a loop run in segments runs its backward segments first to last",
           "jaxmem/schedule/_loop_segments.py",
           "    for k in reversed(range(len(seg.bounds))):",
           "    for k in range(len(seg.bounds)):",
           ("tests/test_loop_segments.py",)),
    Mutant("segment-reads-wrong-layer",
           "a segment reads the whole loop's xs at its own iteration count, not "
           "at the layer's index",
           "jaxmem/schedule/_loop_segments.py",
           "    index = jnp.arange(start, stop)",
           "    index = jnp.arange(0, stop - start)",
           ("tests/test_loop_segments.py",)),
    Mutant("segment-pieces-sized-whole",
           "the memory model sizes a segment's piece of a stack as the whole stack",
           "jaxmem/schedule/_loop_segments.py",
           "        sizes[key] = graph.values[v].nbytes * (b - a) // length",
           "        sizes[key] = graph.values[v].nbytes",
           ("tests/test_loop_segments.py",)),
    Mutant("no-layers-back",
           "the planner never gives a loop's last layers back (every layer rebuilt)",
           "jaxmem/planners/_refine.py",
           "  aim allows (:func:`_layers_back`).\"\"\"\n"
           "  result = _layers_back(graph, result, aim)\n",
           "  aim allows.\"\"\"\n",
           ("tests/test_loop_segments.py",)),
    Mutant("layer-input-fetched-twice",
           "a hosted layer input that the backward body and the rebuild both read is "
           "scanned and copied back twice per iteration",
           "jaxmem/schedule/_scan_remat.py",
           "    unique = [x for i, x in enumerate(xs) if not any(x is y for y in xs[:i])]\n"
           "    where = [next(j for j, u in enumerate(unique) if u is x) for x in xs]\n",
           "    unique, where = list(xs), list(range(len(xs)))\n",
           ("tests/test_scan_offload.py",)),
    Mutant("partial-layer-chunks",
           "chunks along a loop's layers that leave layers out are accepted",
           "jaxmem/schedule/_loop_segments.py",
           "        _check_layers(v, d.bounds, length)\n",
           "        pass\n",
           ("tests/test_loop_segments.py",)),
    Mutant("offload-plans-unrefined",
           "an offload-only plan taken from the ladder keeps every copy it made",
           "jaxmem/planners/_greedy.py",
           "        best = (self.refined(graph, best, aim) if self.recompute\n"
           "                else kept_copies(graph, best, aim, self.refine))\n",
           "        best = self.refined(graph, best, aim) if self.recompute else best\n",
           ("tests/test_hybrid.py",)),
    Mutant("no-hosted-layers-back",
           "an offload-only plan never gives a loop's last layers back (every layer hosted)",
           "jaxmem/planners/_refine.py",
           "  back their last layers (:func:`_layers_back`).\"\"\"\n"
           "  result = _layers_back(graph, result, aim)\n",
           "  back their last layers.\"\"\"\n",
           ("tests/test_scan_offload.py",)),
    Mutant("dropout-chunk-offset",
           "every micro-batch draws the first chunk's dropout mask",
           "jaxmem/schedule/_microbatch.py",
           "        start, step = (self.index, self.k) if self.split.strided else (self.index * (n // self.k), 1)",
           "        start, step = (0, self.k) if self.split.strided else (0, 1)",
           ("tests/test_microbatch.py::test_dropout_masks_drawn_per_micro_batch",
            "tests/test_microbatch.py::test_zoo_updates_match_the_step")),
    Mutant("collectives-rebuilt",
           "values made by collectives may be rebuilt, running them again",
           "jaxmem/graph/_primitives.py",
           '  return name == "shard_map" or (classify(name) == COLLECTIVE',
           '  return name == "no shard_map" and (classify(name) == COLLECTIVE',
           ("tests/test_sharded_steps.py",)),
    Mutant("loop-body-free",
           "the memory model counts nothing for what a loop's body holds while it runs",
           "jaxmem/cost/_memory.py",
           "  return max(0, liveness.peak - liveness.arguments - results)",
           "  return 0",
           ("tests/test_region_split.py::test_the_memory_model_counts_the_chunks",)),
    Mutant("compile-only-fits-fill-the-persistent-cache",
           "a fit for a compile-only GPU writes its compilations to JAX's "
           "persistent cache, which cannot load them back without the GPU",
           "jaxmem/targets/_compile.py",
           "    if not self.compile_only:\n      yield\n      return\n    from jax._src",
           "    if True:\n      yield\n      return\n    from jax._src",
           ("tests/test_target.py::"
            "test_a_fit_for_a_gpu_not_here_writes_nothing_to_jaxs_persistent_cache",)),
    Mutant("effectful-calls-opaque",
           "a call whose body has effects (a jitted step that prints) is kept "
           "whole: no backward pass is seen inside it",
           "jaxmem/graph/_graph.py",
           "      if body is not None:  # its effectful",
           "      if body is not None and not _ordering(eqn.effects):  # its effectful",
           ("tests/test_jit_parity.py::test_a_jitted_step_that_prints_is_planned_inside",)),
    Mutant("jitted-statics-dropped",
           "a step already wrapped in jax.jit loses the arguments it makes static",
           "jaxmem/fit/_arguments.py",
           '    jitted = getattr(fun, "_jit_info", None)\n',
           "    jitted = None\n",
           ("tests/test_jit_parity.py::test_a_jitted_steps_static_arguments_are_kept",)),
    Mutant("scatter-window-refused",
           "a scatter whose example axis is a whole window (a masked "
           "cross-entropy's gradient) refuses micro-batches",
           "jaxmem/graph/_axis_rules.py",
           "  windowed = None if ia is not None else _scatter_window(dn, shapes, oa, ua, obatch)",
           "  windowed = None",
           ("tests/test_microbatch.py::test_a_masked_cross_entropy_runs_in_micro_batches",)),
    Mutant("own-positions-kept-whole",
           "a chunk's gather by each example's position (log_probs[jnp.arange(n), "
           "labels]) keeps the whole batch's positions instead of the chunk's",
           "jaxmem/schedule/_microbatch.py",
           "      args[position] = _own_positions(args[position], column, in_axes[position])\n",
           "      pass\n",
           ("tests/test_microbatch.py::test_a_loss_picked_by_position_runs_in_micro_batches",)),
    Mutant("positions-any-select",
           "a select between positions and anything else is taken as positions",
           "jaxmem/graph/_positions.py",
           "  return all(holds_positions(graph, c, axis) for c in cases)",
           "  return any(holds_positions(graph, c, axis) for c in cases)",
           ("tests/test_microbatch.py::test_a_loss_picked_by_position_runs_in_micro_batches",
            "tests/test_microbatch.py::test_a_gather_by_other_examples_positions_refuses")),
    Mutant("named-budget-searched-again",
           "a budget at the smallest footprint an error named is searched for "
           "again instead of taking the plan that reached it",
           "jaxmem/_fitting.py",
           "    snug = None if self.saved is not None else snug_plan(self.fun, memo, in_bytes)\n",
           "    snug = None\n",
           ("tests/test_compilations.py::"
            "test_the_budget_an_error_named_takes_the_plan_that_reached_it",)),
    Mutant("written-count-not-named",
           "where no plan of the micro-batched step comes under its count as "
           "written, the error names the plans' smallest, not the count's",
           "jaxmem/fit/_micro.py",
           "    err = written_err if written_err is not None and written_err.smallest < err.smallest else err\n",
           "",
           ("tests/test_transform.py::test_smallest_feasible_budget_fits_and_matches",)),
    Mutant("step-as-written-compiled-per-transform",
           "each transform of a step compiles the step as written again, where "
           "an earlier fit of it on the same graph did",
           "jaxmem/_fitting.py",
           "    written = once(graph, (\"written\", self._deciding(target, leaves, out_tree)), "
           "lambda: (\n",
           "    written = once(graph, (\"written\", object()), lambda: (\n",
           ("tests/test_compilations.py::"
            "test_a_second_transform_of_a_step_plans_on_its_graph_with_its_planner",)),
    Mutant("draws-where-xla-likes",
           "a planned step's random draws are left for XLA to schedule, which "
           "draws every dropout mask at the step's start",
           "jaxmem/schedule/_emit.py",
           'DRAWS = frozenset({"random_bits"})\n',
           "DRAWS = frozenset()\n",
           ("tests/test_transform.py::"
            "test_a_planned_step_draws_each_mask_where_the_step_uses_it",)),
    Mutant("lazy-rows-unchecked",
           "a program over the rows brought in so far is taken without checking "
           "the rows left out",
           "jaxmem/planners/_highs.py",
           "    if not broken.any():\n",
           "    if True:\n",
           ("tests/test_ilp.py::test_rows_brought_in_lazily_give_the_whole_programs_optimum",)),
    Mutant("draws-wait-for-copies",
           "a draw may wait for a barrier's copy, which XLA makes as early as its "
           "inputs (an update of plain Adam's early in the backward pass)",
           "jaxmem/schedule/_emit.py",
           '_COMPUTED = frozenset({"node", "recompute"})\n',
           '_COMPUTED = frozenset({"node", "recompute", "barrier"})\n',
           ("tests/test_transform.py::"
            "test_a_planned_step_draws_each_mask_where_the_step_uses_it[adam]",)),
    Mutant("fused-sources-rebuilt-on-cpu",
           "on XLA:CPU a buffer a kept fused residual is computed from is rebuilt "
           "for its own backward reads while XLA keeps the forward one alive",
           "jaxmem/graph/_xla_cpu_fusion.py",
           "          if not (learned and b in dropped)}\n",
           "          if b not in dropped}\n",
           ("tests/test_transform.py::"
            "test_on_xla_cpu_a_kept_fused_residual_reads_its_rebuilt_source_as_made",)),
    Mutant("draws-barred-for-xla-gpu",
           "draws wait behind a barrier on XLA:GPU targets too, which costs the "
           "program fusions and gains no memory",
           "jaxmem/schedule/_emit.py",
           "    draws = DRAWS if graph.buffers is None and len(schedule.plan) else frozenset()\n",
           "    draws = DRAWS\n",
           ("tests/test_blocks.py::test_a_block_rebuilt_as_checkpointed_is_jax_checkpoints_"
            "program_on_an_h100",)),
    Mutant("plans-compiled-again-per-transform",
           "each transform of a step compiles again the plans an earlier fit of it "
           "compiled for the same program",
           "jaxmem/fit/_fit.py",
           "    footprint, seconds, took, ratio = measure() if self.program_key is None else once(\n",
           "    footprint, seconds, took, ratio = measure() if True else once(\n",
           ("tests/test_compilations.py::"
            "test_a_second_transform_of_a_step_plans_on_its_graph_with_its_planner",)),
    Mutant("plans-taken-across-programs",
           "a plan an earlier fit compiled is taken by a fit whose options make "
           "another program (a donated argument)",
           "jaxmem/fit/_fit.py",
           "        candidate.schedule.graph, (\"plan\", *key, self.program_key), measure)\n",
           "        candidate.schedule.graph, (\"plan\", *key), measure)\n",
           ("tests/test_compilations.py::"
            "test_a_second_transform_of_a_step_plans_on_its_graph_with_its_planner",)),
    Mutant("planned-chunks-compiled-per-transform",
           "a chunked form a fit planned is compiled again by a later fit of the step",
           "jaxmem/fit/_shared.py",
           "    if self._keep is not None:\n      self._keep(self)\n",
           "    if self._keep is not None:\n      pass\n",
           ("tests/test_compilations.py::"
            "test_a_chunked_form_is_measured_once_and_kept_once_planned",
            "tests/test_compilations.py::"
            "test_the_budget_an_error_named_takes_the_plan_that_reached_it")),
    Mutant("counts-out-of-reach-measured",
           "counts of micro-batches between are measured where the most chunks "
           "are predicted well above the budget",
           "jaxmem/fit/_micro.py",
           "  return after - part / more + part / most > (1 + OUT_OF_REACH) * limit",
           "  return False",
           ("tests/test_microbatch.py::"
            "test_counts_of_micro_batches_are_skipped_where_the_most_are_out_of_reach",)),
    Mutant("own-rows-unequal-lengths",
           "a scatter by each example's own position into more rows than examples "
           "runs per chunk",
           "jaxmem/graph/_axis_rules.py",
           "        and shapes[0][axis] == shapes[1][ia] == shapes[2][positions[ia]]):",
           "        ):",
           ("tests/test_microbatch.py::"
            "test_a_scatter_by_position_into_more_rows_than_examples_is_not_run_per_chunk",)),
    Mutant("kept-jit-holds-the-step",
           "the jit a fit keeps for a step refers back to the step, so the "
           "compilations kept per step never go",
           "jaxmem/fit/_arguments.py",
           "    del wrapped.__wrapped__\n",
           "",
           ("tests/test_compilations.py::test_the_compilations_kept_for_a_step_go_with_it",)),
    Mutant("remembered-plan-untried-where-a-search-fails",
           "a later fit whose search finds nothing raises, where the plan that "
           "reached a remembered smallest meets its budget",
           "jaxmem/_fitting.py",
           "      found = reached(known) if known and known != snug else None",
           "      found = None",
           ("tests/test_compilations.py::"
            "test_a_search_that_fails_where_a_remembered_plan_fits_takes_that_plan",)),
    Mutant("larger-smallest-remembered",
           "a larger smallest overwrites the least one remembered",
           "jaxmem/fit/_unmet.py",
           "  if key not in known or smallest <= known[key][0]:",
           "  if True:",
           ("tests/test_compilations.py::"
            "test_a_search_that_fails_where_a_remembered_plan_fits_takes_that_plan",)),
    Mutant("measuring-skips-gpu-autotuning",
           "the fit loop's compiles for a GPU turn autotuning off (convolution "
           "workspaces grow: a ResNet-18 at CPU sizes reads 46 MiB for an H100, "
           "against 18 MiB compiled as the user's step is)",
           "jaxmem/_flags.py",
           '  options = {**compiler_options(platform), "xla_backend_optimization_level": 0}\n',
           '  options = {**compiler_options(platform), "xla_backend_optimization_level": 0,\n'
           '             **({"xla_gpu_autotune_level": 0} if platform == "gpu" else {})}\n',
           ("tests/test_flags.py::test_measuring_compiles_give_the_footprint_of_the_real_one",)),
    Mutant("block-barrier-only-rebuild-inputs",
           "a block rebuilt as checkpointed passes only what its recomputation "
           "starts from through its barrier, not every parameter and residual "
           "its backward pass reads",
           "jaxmem/schedule/_schedule.py",
           "      leaves |= {v for v in block_inputs(graph, scope) if self.available(v)\n",
           "      leaves |= {v for v in block_inputs(graph, scope) if False\n",
           ("tests/test_blocks.py::"
            "test_a_convnets_blocks_rebuilt_as_checkpointed_are_jax_checkpoints_program",)),
    Mutant("block-rebuilt-at-first-rebuilt-read",
           "a block rebuilt as checkpointed is rebuilt at its first backward "
           "equation that reads a dropped residual, not where its backward pass starts",
           "jaxmem/schedule/_schedule.py",
           "        if missing or (self.with_block and node.scope() in self.with_block\n"
           "                       and node.scope() != self.scope):",
           "        if missing:",
           ("tests/test_blocks.py::"
            "test_a_convnets_blocks_rebuilt_as_checkpointed_are_jax_checkpoints_program",)),
    Mutant("footprints-as-written-forgotten",
           "a chunked form of a step measured by an earlier fit is compiled again "
           "to be measured",
           "jaxmem/fit/_shared.py",
           "    hit = known.get(key, _UNKNOWN)\n",
           "    hit = _UNKNOWN\n",
           ("tests/test_compilations.py::"
            "test_a_chunked_form_is_measured_once_and_kept_once_planned",
            "tests/test_compilations.py::"
            "test_a_second_fit_compiles_no_micro_batches_measured_before")),
    Mutant("shared-graph-constants-ignored",
           "a step traced again to the same equations reuses the graph built before "
           "whatever constants it holds",
           "jaxmem/fit/_shared.py",
           "  if entry is not None and same_constants(entry[0], closed):\n",
           "  if entry is not None:\n",
           ("tests/test_compilations.py::"
            "test_a_step_closing_over_other_constants_is_planned_afresh",)),
    Mutant("shared-graph-not-kept",
           "a second transform of a step builds its graph and searches its plans afresh",
           "jaxmem/fit/_shared.py",
           "  known[text] = (closed, graph)\n",
           "  pass\n",
           ("tests/test_compilations.py::"
            "test_a_second_transform_of_a_step_plans_on_its_graph_with_its_planner",)),
    Mutant("quick-fit-compiles-every-shape",
           "a quick fit at a budget no plan meets compiles every plan shaped like "
           "a per-block policy",
           "jaxmem/fit/_fit.py",
           "      shaped = self.structured(trial, cheaper=False, sparing=True)\n",
           "      shaped = self.structured(trial, cheaper=False)\n",
           ("tests/test_compilations.py::"
            "test_a_quick_fit_compiles_only_the_block_shaped_plans_that_may_fit",)),
    Mutant("lowest-fit-compiles-every-cheaper-shape",
           "where only a candidate for the smallest footprint fits, every block-shaped "
           "plan that costs less is compiled against it",
           "jaxmem/fit/_fit.py",
           "    return self.structured(cheapest, sparing=True), rounds\n",
           "    return self.structured(cheapest), rounds\n",
           ("tests/test_compilations.py::"
            "test_a_fit_found_among_the_lowest_compiles_the_shaped_plans_that_may_fit",)),
    Mutant("shapes-before-a-quick-round",
           "a first plan over the budget compiles the plans shaped like the "
           "policies before planning again, however quick planning is",
           "jaxmem/fit/_fit.py",
           "      if rounds >= 2 and not detoured and planning > 2 * trial.took:\n",
           "      if not detoured:\n",
           ("tests/test_compilations.py::"
            "test_a_plan_compiled_over_the_budget_plans_again_first_where_planning_is_quick",)),
    Mutant("shapes-never-before-a-second-round",
           "a first plan over the budget plans again before compiling the shaped "
           "plans, however slow planning is",
           "jaxmem/fit/_fit.py",
           "      if rounds >= 2 and not detoured and planning > 2 * trial.took:\n",
           "      if rounds >= 2 and not detoured and planning < 0:\n",
           ("tests/test_compilations.py::"
            "test_a_plan_compiled_over_the_budget_tries_the_policy_shaped_plans_before_planning_again",)),
    Mutant("loosen-past-what-may-fit",
           "a plan far under the budget is loosened toward aims no plan that may "
           "fit reaches",
           "jaxmem/fit/_fit.py",
           "      scale = min(scale, self.most_that_may_fit() / room)\n",
           "",
           ("tests/test_compilations.py::test_a_looser_plan_is_sought_only_where_it_may_fit",)),
    Mutant("loosen-within-precision",
           "a plan is loosened for an aim barely above its own",
           "jaxmem/fit/_fit.py",
           "      if scale < low * (1 + LOOSEN_MARGIN):\n",
           "      if scale <= low:\n",
           ("tests/test_compilations.py::test_a_looser_plan_is_sought_only_where_it_may_fit",)),
    Mutant("shaped-forms-unspared-without-clock",
           "without a clock, every shaped form cheaper than the plan is compiled, "
           "though the forms of its kind compiled say it cannot fit",
           "jaxmem/fit/_fit.py",
           "        if (self.clock is None and not sparing and ratios[rebuilt]\n",
           "        if (self.clock is None and not sparing and ratios[rebuilt] and False\n",
           ("tests/test_fit.py::"
            "test_without_a_clock_a_shaped_form_its_kind_puts_over_the_budget_is_not_compiled",)),
    Mutant("guess-frees-expensive-copies",
           "the guessed column frees a rebuilt transcendental read twice through its "
           "last read, as the optimistic estimate does",
           "jaxmem/planners/_pricing.py",
           "                and not (likely and len(set(back)) > 1 and primitives.is_expensive(made_by)))\n",
           "                and not (False and len(set(back)) > 1 and primitives.is_expensive(made_by)))\n",
           ("tests/test_ilp.py::test_a_guessed_transcendental_copy_read_twice_keeps_its_buffer",)),
    Mutant("guess-frees-saved-sources",
           "the guessed column lets a saved value the rebuild reads die at its last "
           "forward read where a fused dropped value reads it too",
           "jaxmem/planners/_pricing.py",
           ("             if b not in self.ref.in_outputs} - held  # those cost nothing as written\n"
            "    first = min((p for b in freed for p in self.ref.reads.get(b, ()) if self.backward[p]),\n"
            "                default=None)\n"
            "    for buf in held if first is not None else ():\n"),
           ("             if b not in self.ref.in_outputs}  # those cost nothing as written\n"
            "    first = min((p for b in freed for p in self.ref.reads.get(b, ()) if self.backward[p]),\n"
            "                default=None)\n"
            "    for buf in held - freed if first is not None else ():\n"),
           ("tests/test_ilp.py::test_a_guessed_column_holds_the_saved_values_its_rebuild_reads",)),
    Mutant("suspects-all-chosen",
           "a plan judged over its aim prices every choice it took, not its suspects",
           "jaxmem/planners/_ilp.py",
           "          suspects = table.suspects(chosen, found.memory, aim) if suspected < _SUSPECTED else ()\n",
           "          suspects = chosen if suspected < _SUSPECTED else ()\n",
           ("tests/test_ilp.py::test_a_plan_over_its_aim_prices_its_suspects_first",)),
    Mutant("suspects-agreeing",
           "the suspects are the choices whose guesses agree with their estimates",
           "jaxmem/planners/_pricing.py",
           "            if not self.exact[i] and (self.guess[over, i] != self.delta[over, i]).any()]\n",
           "            if not self.exact[i] and (self.guess[over, i] == self.delta[over, i]).any()]\n",
           ("tests/test_ilp.py::test_a_plan_over_its_aim_prices_its_suspects_first",)),
    Mutant("iotas-only-while-the-gradient-runs",
           "the max-pool gradient's iotas are held only while the gradient runs",
           "jaxmem/graph/_xla_cpu_fusion.py",
           "      found += [(0, made, iotas), (made, pos, indices)]\n",
           "      found += [(pos, pos, iotas), (made, pos, indices)]\n",
           ("tests/test_model_accuracy.py::test_a_unets_plans_stay_near_xla_with_its_max_pools_iotas",)),
    Mutant("iotas-until-the-gradient",
           "the max-pool gradient's iotas are held from the start until the gradient",
           "jaxmem/graph/_xla_cpu_fusion.py",
           "      made = self.producer_of.get(root.get(op.ins[1], op.ins[1]), pos)\n",
           "      made = pos\n",
           ("tests/test_model_accuracy.py::test_model_peak_over_xla_footprint_stays_in_its_band",)),
    Mutant("shaped-forms-unpriced",
           "a shaped form its kind prices slower than the plan that fits is compiled",
           "jaxmem/fit/_fit.py",
           "          if self.slower(form, rates, best):\n",
           "          if False and self.slower(form, rates, best):\n",
           ("tests/test_fit.py::test_a_shaped_form_its_kind_prices_slower_than_the_plan_is_not_compiled",)),
    Mutant("chunks-slower-measured-on",
           "chunks no faster than the plan do not end the search for a count",
           "jaxmem/fit/_micro.py",
           "    if faster is not None and not faster(measured):\n",
           "    if False and faster is not None and not faster(measured):\n",
           ("tests/test_region_split.py::test_chunks_no_faster_than_the_plan_end_the_search_for_a_count",)),
    Mutant("autotuning-unshared",
           "the GPU check's workers autotune every compilation anew",
           "benchmarks/gpu.py",
           "    if autotune_cache and \"autotune_cache_dir\" not in flags:\n",
           "    if False and autotune_cache and \"autotune_cache_dir\" not in flags:\n",
           ("tests/test_gpu_script.py::test_the_workers_share_autotuning_results_through_one_folder",)),
    Mutant("time-model-unscaled",
           "the time model prices a GPU target's plans at its own per-equation times",
           "jaxmem/cost/_perf.py",
           "  return 1.0 if graph.buffers is None else graph.buffers.time_scale\n",
           "  return 1.0\n",
           ("tests/test_xla_buffers.py::test_the_time_model_gives_the_step_as_written_the_clocks_time",)),
    Mutant("shapes-by-the-first-rounds-planning",
           "the first round's planning time, which builds the planner's table, "
           "decides whether the shaped plans are compiled before planning again",
           "jaxmem/fit/_fit.py",
           "      if rounds >= 2 and not detoured and planning > 2 * trial.took:\n",
           "      if not detoured and planning > 2 * trial.took:\n",
           ("tests/test_compilations.py::"
            "test_a_plan_compiled_over_the_budget_plans_again_first_where_planning_is_quick",)),
    Mutant("estimates-cost-rebuilds-by-flops",
           "an estimated column's cost is its rebuild's FLOPs where the planner "
           "prices plans by predicted time",
           "jaxmem/planners/_pricing.py",
           "    return most, likely, float(sum(self.rerun_cost[n] for n in run - self.rerun))\n",
           "    return most, likely, float(sum(self.graph.nodes[n].flops for n in run - self.rerun))\n",
           ("tests/test_ilp.py::test_estimated_columns_are_optimistic",)),
    Mutant("learned-buffers-priced-lazily",
           "on buffers learned from XLA:GPU's program, where estimates bound "
           "nothing, columns stay estimated until a solution takes them",
           "jaxmem/planners/_pricing.py",
           "  if not lazy or graph.buffers is not None:\n",
           "  if not lazy:\n",
           ("tests/test_ilp.py::test_learned_buffers_price_every_column_up_front",)),
    Mutant("compute-stream-ends-at-its-first-op",
           "a step with no host copies is predicted to end with its first op",
           "jaxmem/cost/_perf.py",
           "    return Timing(op_end[-1] if op_end else 0.0, sum(durations), 0.0, [], op_end)\n",
           "    return Timing(op_end[0] if op_end else 0.0, sum(durations), 0.0, [], op_end)\n",
           ("tests/test_perf.py",)),
    Mutant("features-leave-uncontracted",
           "a layer's features that join the residual stream are split all the same",
           "jaxmem/graph/_feature_axes.py",
           "      raise NotSplittable(f\"the features reach {where(node)} before a layer contracts them\")",
           "      pass",
           ("tests/test_feature_split.py",)),
    Mutant("feature-sums-start-from-zeros",
           "a sum over feature chunks starts from a buffer of zeros, not the value it is added to",
           "jaxmem/schedule/_microbatch.py",
           "        and graph.values[other].aval == graph.values[v].aval):",
           "        and False):",
           ("tests/test_feature_split.py",)),
    Mutant("depthwise-groups-uncut",
           "a depthwise convolution on a chunk of its features keeps all its groups",
           "jaxmem/graph/_axis_rules.py",
           "        params[group] //= k",
           "        params[group] = params[group]",
           ("tests/test_feature_split.py",)),
    Mutant("features-made-along-the-wrong-axis",
           "a convolution whose kernel is split along its output features gives the "
           "output its batch axis",
           "jaxmem/graph/_axis_rules.py",
           "    # output features: each chunk of the kernel's makes its chunk of them;\n"
           "    return Rule(outs=(out_spec[1],))",
           "    return Rule(outs=(out_spec[0],))",
           ("tests/test_feature_split.py",)),
    Mutant("collective-buffers-unheld",
           "the buffers a partitioned program's collectives write (gathered activations) "
           "are not held",
           "jaxmem/cost/_learned_fusion.py",
           "    if not self.buffers.spans:\n      return []",
           "    if True:\n      return []",
           ("tests/test_sharded_steps.py::test_a_tensor_parallel_steps_model_follows_xla_gpu_per_device",
            "tests/test_xla_buffers.py::test_a_partitioned_programs_collectives_hold_their_buffers")),
    Mutant("collective-sums-are-copies",
           "an all-reduce's result is taken for a copy of its node's value, not the value",
           "jaxmem/cost/_xla_buffers.py",
           "                  and count(v) == found.array.size), None) if found.owns else None",
           "                  and count(v) == found.array.size), None) if False else None",
           ("tests/test_xla_buffers.py::test_a_partitioned_programs_collectives_hold_their_buffers",)),
    Mutant("plateau-skipped-counts-untried",
           "where the most micro-batches fit after the footprint levelled, the counts "
           "passed over are not tried",
           "jaxmem/fit/_micro.py",
           "      return _fewest(lambda i: _quietly(within, *at(skipped[i])), len(skipped), found), []",
           "      return found, []",
           ("tests/test_region_split.py::test_counts_the_plateau_passed_over_are_tried_where_the_last_fits",)),
    Mutant("gathers-set-shards",
           "an all-gather's arrays count as shards of the values of the equation it runs for",
           "jaxmem/cost/_xla_shards.py",
           "          and (inst.opcode not in hlo.EXCHANGES or inst.opcode in hlo.REDUCTIONS)):",
           "          and True):",
           ("tests/test_xla_buffers.py::test_a_partitioned_programs_collectives_hold_their_buffers",)),
    Mutant("rebuilt-slices-summed",
           "a rebuilding loop's body holds the sum of the slices it rebuilds beside its "
           "own scratch, not what running its iteration holds",
           "jaxmem/cost/_memory.py",
           "      (_rebuilding_scratch(graph, it.backward, it.forward, it.rebuilt, it.once) if it.rebuilt",
           "      (loop_scratch(graph, it.backward) + sum(graph.values[graph.nodes[it.backward]"
           ".ins[i]].nbytes // graph.nodes[it.backward].params['length'] for i, _ in it.rebuilt)"
           " if it.rebuilt",
           ("tests/test_loop_segments.py::test_a_rebuilding_loops_body_is_sized_as_xla_gpu_runs_it",)),
    Mutant("segments-pieces-held-throughout",
           "a segmented backward loop holds the pieces its earlier segments read through "
           "its later segments",
           "jaxmem/cost/_memory.py",
           "      + it.fetched - sum(nbytes(k) for k in it.done if k in last_read)",
           "      + it.fetched",
           ("tests/test_loop_segments.py::test_a_rebuilding_loops_body_is_sized_as_xla_gpu_runs_it",)),
    Mutant("one-layer-segments-hold-their-slices",
           "a segment of one layer, which XLA inlines, holds its pieces through its loop",
           "jaxmem/schedule/_loop_segments.py",
           "if kind == \"keep\") if b - a == 1 else ()",
           "if kind == \"keep\") if b - a == 0 else ()",
           ("tests/test_loop_segments.py::test_a_rebuilding_loops_body_is_sized_as_xla_gpu_runs_it",)),
    Mutant("loop-bodies-emulated-on-gpu",
           "on a GPU target a loop's body is sized by XLA:CPU's emulated fusion, not by "
           "XLA:GPU's compilation of the loop",
           "jaxmem/cost/_memory.py",
           "  if graph.buffers is not None and index in graph.buffers.bodies:",
           "  if False:",
           ("tests/test_xla_loops.py",)),
    Mutant("unnamed-buffers-not-held",
           "the buffers XLA:GPU writes under no equation's name (a max-pool's argmax "
           "indices, found in the forward pass for the gradient) are left out",
           "jaxmem/cost/_xla_buffers.py",
           "  extra = unnamed_spans(graph, unnamed(program))",
           "  extra = ()",
           ("tests/test_xla_buffers.py::test_the_learned_model_follows_xla_gpu_on_the_step_as_written",)),
    Mutant("in-place-update-held-beside",
           "a copy that a scatter updates in place (a max-pool gradient's, into a copy of "
           "the activation) is held beside the scatter's result, which is its buffer",
           "jaxmem/cost/_xla_unnamed.py",
           "  if len(readers) != 1:",
           "  if True:",
           ("tests/test_xla_buffers.py::test_a_scatters_base_is_its_value_and_zeros_beside_an_activation_are_not_its_copy",)),
    Mutant("zeros-held-as-a-copy",
           "zeros XLA writes beside an activation in its forward kernel (a scatter's base) "
           "are taken for a copy of the activation and held while it lives",
           "jaxmem/cost/_xla_names.py",
           "    if tag is None and not _splat(out, by_name):",
           "    if tag is None:",
           ("tests/test_xla_buffers.py::test_a_scatters_base_is_its_value_and_zeros_beside_an_activation_are_not_its_copy",)),
    Mutant("max-pool-indices-held-twice",
           "a max-pool's gradient holds its indices while it runs beside the unnamed "
           "buffers that already hold them",
           "jaxmem/graph/_xla_cpu_fusion.py",
           "    return 0, 0, item * source.size",
           "    return 0, 0, item * (padded + source.size)",
           ("tests/test_xla_buffers.py::test_a_max_pool_gradient_holds_what_xla_expands_it_to",)),
    Mutant("late-made-values-held-from-the-forward-pass",
           "a forward value XLA:GPU makes again in a backward kernel (a ReLU6 mask) keeps a "
           "buffer from the forward pass on",
           "jaxmem/cost/_xla_buffers.py",
           "      late = _made_late(graph, node, match, buffer)",
           "      late = None",
           ("tests/test_xla_buffers.py::test_the_learned_model_follows_xla_gpu_on_the_step_as_written",
            "tests/test_xla_buffers.py::"
            "test_a_forward_value_made_in_a_backward_kernel_is_held_beside_its_readers_only")),
    Mutant("moved-to-the-last-layer",
           "the last layer of a stack, which feeds the head, takes moved columns too",
           "jaxmem/planners/_alike.py",
           "  return tuple(enumerate(stack))[2:-2]",
           "  return tuple(enumerate(stack))[2:]",
           ("tests/test_alike.py",)),
    Mutant("moved-to-the-layer-before-the-last",
           "the layer before the last, whose next layer feeds the head, takes moved columns",
           "jaxmem/planners/_alike.py",
           "  return tuple(enumerate(stack))[2:-2]",
           "  return tuple(enumerate(stack))[2:-1]",
           ("tests/test_alike.py",)),
    Mutant("moved-rebuilds-reaching-outside",
           "a choice whose rebuild runs earlier layers' equations is moved as one within its layer",
           "jaxmem/planners/_alike.py",
           "  return reruns <= nodes",
           "  return True",
           ("tests/test_alike.py",)),
    Mutant("alike-sublayers-in-other-places",
           "sublayers that match equation for equation but sit in different places of their "
           "layer count as alike",
           "jaxmem/planners/_alike.py",
           '  path = (names[0], re.sub(r"\\d+", "", names[1]), *names[2:])',
           '  path = tuple(re.sub(r"\\d+", "", n) for n in names)',
           ("tests/test_alike.py",)),
    Mutant("moved-plans-refused-unpriced",
           "a plan over the aim on moved columns is excluded before its columns are priced",
           "jaxmem/planners/_ilp.py",
           "        if not found.fits and not table.moved[chosen].any():",
           "        if not found.fits:",
           ("tests/test_alike.py",)),
    Mutant("micro-batches-fitting-as-written-planned",
           "a step in micro-batches that fits the budget as written is compiled again with its "
           "backward reads separated",
           "jaxmem/_fitting.py",
           "                               own_footprint=None if own is written else own.footprint)",
           "                               own_footprint=None)",
           ("tests/test_compilations.py",)),
    Mutant("whole-step-micro-batches-not-weighed",
           "where a plan fits, only the region in chunks is weighed against it",
           "jaxmem/fit/_micro.py",
           "  for region in (True, False):  # the region around the peak, then the whole step",
           "  for region in (True,):",
           ("tests/test_region_split.py",)),
    Mutant("side-input-convolution-untiled",
           "a forward convolution fused with a side input is priced as if it filled the GPU",
           "jaxmem/cost/_xla_clock.py",
           'TILED_CALLS = ("__cudnn$convForward", "__cudnn$convBiasActivationForward")',
           'TILED_CALLS = ("__cudnn$convForward",)',
           ("tests/test_xla_clock.py",)),
]


def _copy_tree(into: pathlib.Path) -> None:
  files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
  for name in files:
    source = ROOT / name
    if source.is_file():
      (into / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(source, into / name)


def run(mutant: Mutant, tree: pathlib.Path) -> tuple[str, str, float]:
  """``(result, failing test, seconds)`` for one mutant: ``"caught"`` (a
  test failed), ``"error"`` (the tests could not run: a broken mutant),
  ``"MISSED"`` or ``"stale"`` (its text is no longer in its file)."""
  target = tree / mutant.path
  original = target.read_text()
  if original.count(mutant.old) != 1:
    return "stale", "", 0.0
  target.write_text(original.replace(mutant.old, mutant.new))
  began = time.perf_counter()
  try:
    env = dict(os.environ, PYTHONPATH=f"{tree}:{tree / 'tests'}")
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           *mutant.tests], cwd=tree, env=env, capture_output=True, text=True)
  finally:
    target.write_text(original)
  seconds = time.perf_counter() - began
  if done.returncode == 0:
    return "MISSED", "", seconds
  failed = [line.split()[1] for line in done.stdout.splitlines()
            if line.startswith("FAILED ")]
  errors = [line.split()[1] for line in done.stdout.splitlines()
            if line.startswith("ERROR ")]
  return ("caught", failed[0], seconds) if failed else ("error", "".join(errors[:1]), seconds)


def main(names: list[str]) -> int:
  chosen = [m for m in MUTANTS if not names or m.name in names]
  unknown = set(names) - {m.name for m in MUTANTS}
  if unknown:
    print(f"unknown mutants {sorted(unknown)}; expected some of "
          f"{[m.name for m in MUTANTS]}", file=sys.stderr)
    return 2
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    tree = pathlib.Path(tmp)
    _copy_tree(tree)
    for mutant in chosen:
      result, test, seconds = run(mutant, tree)
      rows.append((mutant, result, test))
      print(f"{result:7s} {seconds:6.0f} s  {mutant.name}  {test}", file=sys.stderr, flush=True)
  print("| mutant | breakage | result | first failing test |\n|---|---|---|---|")
  for mutant, result, test in rows:
    print(f"| {mutant.name} | {mutant.what} | {result} | {test or '-'} |")
  return 0 if all(result == "caught" for _, result, _ in rows) else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
