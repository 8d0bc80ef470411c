"""The memory model's host accounting against figures worked out by hand.

On CPU the device footprint of an offload plan is the memory model's
(XLA:CPU ignores host memory), so the model must not be checked against itself. Here
the step is a chain of equal matmuls (no fusion, no temporaries beyond the
chain), and what each plan moves is derived from the graph's facts alone:
where each residual is made, last read forward and first read backward.
At every equation the model's device bytes must differ from the plan that
keeps everything by exactly the bytes on the host there, and its host
bytes must be exactly those.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxmem._decisions import KEEP, OFFLOAD, Chunked, Offload, Plan
from jaxmem.cost._evaluate import evaluate
from jaxmem.graph._graph import build_graph

N, B, D = 6, 128, 16
SLICE = B * D * 4  # bytes of each residual


@pytest.fixture(scope="module")
def chain():
  def step(ws, x):
    def loss(ws):
      h = x
      for w in ws:
        h = h @ w
      return jnp.sum(h)
    return jax.grad(loss)(ws)

  ws = [jnp.full((D, D), 0.1) for _ in range(N)]
  graph = build_graph(jax.make_jaxpr(step)(ws, jnp.ones((B, D))))
  residuals = sorted(graph.residuals, key=lambda r: r.produced_at)
  assert len(residuals) == N - 1 and all(r.nbytes == SLICE for r in residuals)
  return graph, residuals


def _at_each_equation(graph, plan):
  """Node -> (device bytes, host bytes) the model gives while it runs."""
  schedule, memory = evaluate(graph, plan)
  return {op.node: (memory.timeline[i], memory.host_timeline[i])
          for i, op in enumerate(schedule.ops) if op.kind == "node"}


def _away(r, n) -> bool:
  """Whether residual ``r`` is off the device at equation ``n``: after its
  last forward read and before its copy back (issued right before its
  first backward read)."""
  return r.last_forward_use < n < r.first_backward_use


def _on_host(r, n) -> bool:
  """Whether its host copy exists at ``n``: from the copy right after it is
  made until the copy back has read it."""
  return r.produced_at < n < r.first_backward_use


@pytest.mark.parametrize("k", [1, 3, N - 1])
def test_offloaded_residuals_leave_the_device_exactly_while_on_the_host(chain, k):
  graph, residuals = chain
  moved = residuals[:k]  # the first made: read last in the backward pass
  kept = _at_each_equation(graph, Plan())
  planned = _at_each_equation(graph, Plan.of({r.value: OFFLOAD for r in moved}))
  assert kept.keys() == planned.keys()
  for n in kept:
    away = sum(SLICE for r in moved if _away(r, n))
    host = sum(SLICE for r in moved if _on_host(r, n))
    assert kept[n][0] - planned[n][0] == away, (n, kept[n], planned[n])
    assert planned[n][1] == host, (n, planned[n])
  # Each copy brought back occupies the device again until its last reader.
  for r in moved:
    assert planned[r.first_backward_use][0] == kept[r.first_backward_use][0] - sum(
        SLICE for other in moved if _away(other, r.first_backward_use))


def test_a_chunked_residual_moves_exactly_its_offloaded_chunks(chain):
  graph, residuals = chain
  r = residuals[0]
  bounds = ((0, 4), (4, 10), (10, D))  # along the feature axis
  row = B * 4  # bytes per feature column
  sizes = [(stop - start) * row for start, stop in bounds]
  decision = Chunked(1, bounds, (Offload(), KEEP, Offload()))
  swapped, stays = sizes[0] + sizes[2], sizes[1]
  kept = _at_each_equation(graph, Plan())
  planned = _at_each_equation(graph, Plan.of({r.value: decision}))
  for n in kept:
    if r.produced_at < n <= r.last_forward_use:
      # The whole value is still read forward beside its kept chunk.
      want = (-stays, swapped)
    elif _away(r, n):
      want = (swapped, swapped)
    else:
      want = (0, 0)
    assert (kept[n][0] - planned[n][0], planned[n][1]) == want, (n, kept[n], planned[n])
