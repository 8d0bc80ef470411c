"""Loops in the joint graph (``jaxmem.graph._loops``): a scanned layer stack's
stacked residuals are seen per iteration, in the graph and in reports."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.graph._graph import build_graph
from jaxmem.graph._loops import loops, stacked_residuals

L, B, D = 16, 64, 32


def scanned_mlp_step(ws, x):
  """A 16-layer residual MLP under ``lax.scan``, one SGD step."""
  def loss(ws):
    h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, ws)
    return jnp.sum(h ** 2)
  return ws - 0.1 * jax.grad(loss)(ws)


class Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + nn.Dense(D)(jnp.tanh(nn.Dense(D)(h))), None


class Stack(nn.Module):
  """The same stack under Flax's ``nn.scan``."""
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=L)
    h, _ = scan()(x, None)
    return jnp.sum(h ** 2)


def flax_step(params, x):
  grads = jax.grad(lambda p: Stack().apply(p, x))(params)
  return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def _plain():
  ws = jax.random.normal(jax.random.key(0), (L, D, D)) * 0.1
  return scanned_mlp_step, (ws, jnp.ones((B, D)))


def _flax():
  x = jnp.ones((B, D))
  return flax_step, (Stack().init(jax.random.key(0), x), x)


@pytest.mark.parametrize("make", [_plain, _flax], ids=["lax.scan", "nn.scan"])
def test_a_scanned_stack_is_one_loop_with_per_iteration_residuals(make):
  step, args = make()
  graph = build_graph(jax.make_jaxpr(step)(*args))
  found = loops(graph)
  assert len(found) == 1
  loop = found[0]
  assert loop.length == L and loop.backward, "the backward scan is paired"
  assert all(graph.nodes[b].prim.name == "scan" and graph.nodes[b].backward
             for b in loop.backward)
  for s in loop.stacked:
    r = graph.residual(s.value)
    assert r.shape[0] == L and s.per_iteration * L == r.nbytes
    assert all(graph.nodes[u].ins[i] == s.value for u, i in s.readers)
  # The layer input (the carry) and the tanh output are among the slices.
  assert {"carry", "tanh"} <= {s.slice_of for s in loop.stacked}
  assert set(stacked_residuals(graph)) == {s.value for s in loop.stacked}


def test_reports_read_per_layer_bytes_times_layers():
  step, args = _plain()
  report = jaxmem.analyze(step, *args).report()
  assert f"{B * D * 4 // 1024}.00 KiB x {L}" in report
  assert "scan[tanh]" in report
  assert "the whole loop's for a scan's stacked one" in report


def test_a_step_without_loops_has_none():
  step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
  graph = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4))))
  assert loops(graph) == () and stacked_residuals(graph) == {}
