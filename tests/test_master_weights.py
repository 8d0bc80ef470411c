"""Mixed precision's fp32 master weights in host memory between steps
(``graph._state``).

A Flax model with ``param_dtype=float32, dtype=bfloat16`` reads each
parameter in the forward pass only through a cast to bfloat16, and in the
update. Where keeping the optimizer state alone in host memory does not
meet a GPU target's budget, the fit keeps those parameters there too: the
step copies each to the device for its cast (the copy dies after it) and
again for its update. Checked here: which leaves are master weights, what
the memory model counts, XLA:GPU's program for a T4 compiled on this
machine, the numbers of the step as written over three steps, and that the
moments alone go first.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem
from jaxmem._decisions import RECOMPUTE
from jaxmem.cost._evaluate import evaluate
from jaxmem.graph._graph import build_graph
from jaxmem.graph._state import optimizer_state, with_hosted
from jaxmem.schedule._emit import emit
from jaxmem.targets import placed

pytest.importorskip("jax_plugins.xla_cuda13", reason="compiles for a T4 target")

OPT = optax.adamw(1e-2)
WIDTH, DEPTH = 512, 4


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(DEPTH):
      x = jnp.tanh(nn.Dense(WIDTH, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x))
    return x


MODEL = MLP()


def step(params, state, x):
  def loss(p):
    return jnp.mean(MODEL.apply(p, x).astype(jnp.float32) ** 2)
  value, grads = jax.value_and_grad(loss)(params)
  updates, state = OPT.update(grads, state, params)
  return optax.apply_updates(params, updates), state, value


def _args(seed=0):
  x = jax.random.normal(jax.random.key(seed + 1), (16, WIDTH))
  params = MODEL.init(jax.random.key(seed), x)
  return params, OPT.init(params), x


def _paths(kind):
  """Flat leaf positions among the step's arguments: the kernels
  (``"kernel"``) or Adam's moments of the kernels (``"moments"``)."""
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(_args())[0]]
  moment = lambda p: ".mu" in p or ".nu" in p
  return [i for i, p in enumerate(paths)
          if "kernel" in p and (moment(p) if kind == "moments" else not moment(p))]


def _assert_close(got, want):
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)) + 1e-6


@pytest.fixture(scope="module")
def graph():
  return build_graph(jax.make_jaxpr(step)(*_args()))


def test_master_weights_are_the_parameters_read_through_narrowing_casts(graph):
  state = optimizer_state(graph)
  assert [leaf.leaf for leaf in state if leaf.master] == _paths("kernel")
  assert [leaf.leaf for leaf in state if not leaf.master] == _paths("moments")
  # Each kernel is paired with its update, at the same place in the output.
  assert all(leaf.output == leaf.leaf for leaf in state)
  # The input batch is cast too, but no update reads it.
  assert len(jax.tree_util.tree_leaves(_args())) - 1 not in {leaf.leaf for leaf in state}


def test_a_parameter_the_forward_pass_reads_in_full_precision_is_no_master():
  def fp32_step(w, s, x):
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w.astype(jnp.bfloat16)).astype(jnp.float32)
                                   + jnp.sum(w) * 0))(w)
    u, s = OPT.update(g, s, w)
    return optax.apply_updates(w, u), s

  w = jnp.ones((128, 128))
  args = w, OPT.init(w), jnp.ones((4, 128), jnp.bfloat16)
  state = optimizer_state(build_graph(jax.make_jaxpr(fp32_step)(*args)))
  assert state and not any(leaf.master for leaf in state)
  assert 0 not in {leaf.leaf for leaf in state}


def test_memory_model_counts_master_weights_on_the_host(graph):
  state = optimizer_state(graph)
  masters = [leaf for leaf in state if leaf.master]
  moments = with_hosted(graph, [leaf.value for leaf in state if not leaf.master])
  both = with_hosted(graph, [leaf.value for leaf in state])
  _, alone = evaluate(moments, jaxmem.Plan())
  schedule, memory = evaluate(both, jaxmem.Plan())
  nbytes = sum(leaf.nbytes for leaf in masters)
  assert memory.arguments == alone.arguments - nbytes
  assert memory.host_peak >= alone.host_peak + nbytes
  # Undonated, each weight was on the device twice (in and out): at least
  # one of those leaves the device's peak, at most both.
  assert alone.peak - 2 * nbytes <= memory.peak <= alone.peak - nbytes
  # Each weight comes in twice: for its cast, and for its update; the
  # first copy is read by forward equations only.
  copies = {leaf.value: [op for op in schedule.ops
                         if op.kind == "prefetch" and op.ins[0][0] == leaf.value]
            for leaf in masters}
  assert all(len(ops) == 2 for ops in copies.values())
  for leaf in masters:
    first = copies[leaf.value][0].outs[0]
    readers = [op for op in schedule.ops if first in op.ins]
    assert readers and all(op.kind == "node" and not both.nodes[op.node].backward
                           for op in readers)


def test_casts_rebuilt_in_the_backward_pass_read_the_weights_copied_in(graph):
  """A plan that rebuilds the bf16 casts (residuals of the input
  gradients' matmuls) reads each weight from its copy in for the update;
  no equation reads host memory, and the numbers are the step's."""
  hosted = with_hosted(graph, [leaf.value for leaf in optimizer_state(graph)])
  casts = [r.value for r in graph.residuals
           if graph.nodes[graph.values[r.value].producer].prim.name == "convert_element_type"]
  schedule, _ = evaluate(hosted, jaxmem.Plan.of({v: RECOMPUTE for v in casts}))
  assert sum(op.kind == "recompute" for op in schedule.ops) >= len(casts) >= DEPTH - 1
  on_host = {(v, 0) for v in hosted.hosted}
  for op in schedule.ops:  # a barrier's copy of a host buffer is one too
    reads = [isinstance(k, tuple) and k in on_host for k in op.ins]
    assert op.kind in ("prefetch", "barrier") or not any(reads), op
    on_host.update(k for k, read in zip(op.outs, reads) if read and op.kind == "barrier")
  got = jax.jit(emit(schedule))(*jax.tree_util.tree_leaves(_args()))
  _assert_close(got, jax.jit(step)(*_args()))


@pytest.fixture(scope="module")
def fits():
  """The step at two budgets under what recomputation reaches on a T4: at
  60% its moments alone go to host memory, at 35% its kernels too."""
  return {frac: (transformed, transformed.fit(*_args()))
          for frac in ("60%", "35%")
          for transformed in [jaxmem.transform(step, budget=frac, target="t4")]}


def test_moments_go_first_then_master_weights(fits):
  _, moments = fits["60%"]
  _, both = fits["35%"]
  assert set(moments.hosted) == set(_paths("moments"))
  assert set(both.hosted) == set(_paths("moments") + _paths("kernel"))
  assert "(4 master weights" in both.report() and "master weights" not in moments.report()


def test_t4_program_holds_master_weights_in_host_memory(fits):
  transformed, fit = fits["35%"]
  compiled = transformed.lower(*placed(_args(), "t4")).compile()
  stats = compiled.memory_analysis()
  nbytes = sum(leaf.nbytes for leaf in optimizer_state(fit.graph) if leaf.value in fit.graph.hosted)
  assert stats.host_argument_size_in_bytes == stats.host_output_size_in_bytes == nbytes
  assert jaxmem.targets.xla_footprint(compiled) <= fit.budget
  # Below what the moments alone reach on the target's compiler.
  alone, _ = fits["60%"]
  assert jaxmem.targets.xla_footprint(compiled) < jaxmem.targets.xla_footprint(
      alone.lower(*placed(_args(), "t4")).compile())


def test_numbers_of_the_step_as_written_over_three_steps(fits):
  transformed, _ = fits["35%"]
  ours, want = _args(), _args()
  for seed in range(3):
    ours, want = transformed(*ours), jax.jit(step)(*want)
    _assert_close(ours, want)
    x = _args(seed + 1)[2]
    ours, want = (*ours[:2], x), (*want[:2], x)
  kinds = {jax.tree_util.keystr(p): x.sharding.memory_kind
           for p, x in jax.tree_util.tree_flatten_with_path(ours[0])[0]}
  assert all(kind == "pinned_host" for path, kind in kinds.items() if "kernel" in path)


def test_a_mixed_precision_transformers_weights_are_master_weights():
  """The zoo's GPT-2 in bfloat16 (tied embeddings, attention, LayerNorms):
  every parameter of at least 4 KiB is a master weight (the embedding is
  cast for its lookup and for the tied head alike), its moments are state,
  and the step in float32 has no master weight."""
  import jaxmem_models as models
  from jaxmem.graph._state import MIN_BYTES
  config = dict(dim=64, depth=2, heads=2, seq=32, vocab=256, batch=2)
  for dtype in ("bfloat16", "float32"):
    task = models.get("gpt2", dtype=dtype, **config)
    args = jax.eval_shape(task.init)
    state = optimizer_state(build_graph(jax.make_jaxpr(task.step)(*args)))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    masters = {paths[leaf.leaf] for leaf in state if leaf.master}
    large = {path for path, (_, x) in zip(paths, jax.tree_util.tree_flatten_with_path(args)[0])
             if "['params']" in path and x.size * x.dtype.itemsize >= MIN_BYTES}
    assert masters == (large if dtype == "bfloat16" else set())
    assert "[0]['params']['wte']['embedding']" in large
    moments = [paths[leaf.leaf] for leaf in state if not leaf.master]
    assert len(moments) == 2 * len(large) and all(".mu" in p or ".nu" in p for p in moments)


def test_planners_price_plans_with_master_weights_on_the_host():
  """With master weights on the host, a bf16 cast fused into its readers
  reads the weight's copy in (an input's copy, no equation makes it): the
  exact planner prices choices around it (the zoo's GPT-2 in bfloat16,
  XLA:GPU's buffers for a T4) and plans under its aim."""
  import jaxmem_models as models
  from jaxmem.fit._traced import modelled
  from jaxmem.planners import get_planner
  from jaxmem.targets._compile import resolve
  task = models.get("gpt2", dtype="bfloat16", dim=64, depth=2, heads=2, seq=32, vocab=256,
                    batch=2)
  graph = build_graph(jax.make_jaxpr(task.step)(*jax.eval_shape(task.init)))
  graph = modelled(graph, resolve("t4", []))
  hosted = with_hosted(graph, [leaf.value for leaf in optimizer_state(graph)])
  peak = evaluate(hosted, jaxmem.Plan())[1].peak
  found = get_planner("ilp").plan(hosted, int(0.9 * peak))
  assert len(found.plan) and found.memory.peak <= 0.9 * peak
