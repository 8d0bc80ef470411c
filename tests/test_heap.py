"""The heap a compiler packs the memory model's buffers into
(``cost._heap``), over the buffers the model's walk allocates
(``cost._memory.buffer_spans``)."""

import random

import jax
import jax.numpy as jnp
import pytest

from helpers import tanh_step
from jaxmem._decisions import OFFLOAD, RECOMPUTE, Plan
from jaxmem.cost._evaluate import candidate
from jaxmem.cost._heap import live_peak, packed
from jaxmem.cost._memory import buffer_spans
from jaxmem.graph._graph import build_graph


def _conv_step(w, x):
  """A convolution whose kernel gradient XLA:CPU runs on transposed copies
  of its inputs: scratch held only while that equation runs."""
  def loss(w):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(jnp.tanh(jnp.tanh(y)) ** 2)
  return w - 0.1 * jax.grad(loss)(w)


STEPS = {"tanh": (tanh_step, (jnp.ones((64, 64)), jnp.ones((32, 64)))),
         "conv": (_conv_step, (jnp.ones((3, 3, 8, 8)), jnp.ones((4, 16, 16, 8))))}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_the_walks_buffers_peak_at_the_models_peak_for_every_kind_of_plan(name):
  """Every buffer the walk holds is one span, and none twice: with the
  bytes held from the start, the spans' live peak is the model's peak for
  the step as written and for plans that recompute and offload."""
  step, args = STEPS[name]
  graph = build_graph(jax.make_jaxpr(step)(*args))
  residuals = [r.value for r in graph.residuals]
  plans = [Plan(), Plan.of(dict.fromkeys(residuals, RECOMPUTE)),
           Plan.of(dict.fromkeys(residuals, OFFLOAD)),
           Plan.of({v: RECOMPUTE if i % 2 else OFFLOAD for i, v in enumerate(residuals)})]
  for plan in plans:
    found = candidate(graph, plan)
    start, spans = buffer_spans(found.schedule)
    assert start + live_peak(spans) == found.peak, plan
    assert all(0 <= first <= last < len(found.schedule.ops) and size > 0
               for first, last, size in spans)
    assert live_peak(spans) <= packed(spans, alignment=1) <= sum(s for _, _, s in spans)


def test_packing_is_at_least_the_live_peak_and_sometimes_above_it():
  rng = random.Random(0)
  above = 0
  for _ in range(300):
    spans = []
    for _ in range(rng.randint(1, 8)):
      first = rng.randint(0, 6)
      spans.append((first, rng.randint(first, 6), rng.choice([64, 128, 192, 320])))
    heap, live = packed(spans, alignment=1), live_peak(spans)
    assert live <= heap <= sum(size for _, _, size in spans)
    above += heap > live
  assert above > 0


def test_buffers_are_aligned_before_they_are_packed():
  assert packed([(0, 0, 1), (0, 0, 1)], alignment=128) == 256
  assert packed([(0, 0, 1), (1, 1, 1)], alignment=128) == 128


def test_xlas_live_bytes_read_from_its_dump_add_up_to_its_footprint(tmp_path):
  """``benchmarks/xla_live.py`` reads XLA:GPU's dump of a program for a T4:
  the parameters' and outputs' allocations and the heap of temporaries
  add up to XLA's footprint, and the heap holds the most temporaries live
  at once."""
  from benchmarks import xla_live
  from jaxmem.targets import placed, resolve, xla_footprint

  def step(x):
    pooled = jax.lax.reduce_window(jnp.tanh(x), -jnp.inf, jax.lax.max,
                                   (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return jax.grad(lambda y: jnp.sum(jax.lax.reduce_window(
        jnp.tanh(y), -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") ** 2))(x), pooled

  target = resolve("t4", ())
  x = jax.ShapeDtypeStruct((4, 32, 32, 16), jnp.float32)
  compiled = jax.jit(step, compiler_options={
      **target.options(measuring=True), "xla_dump_to": str(tmp_path)}).lower(
          *placed((x,), "t4")).compile()
  program = xla_live.read(str(tmp_path))
  found = xla_live.summary(program)
  assert found["held"] + found["heap"] == xla_footprint(compiled)
  assert found["heap"] == compiled.memory_analysis().temp_size_in_bytes
  assert 0 < found["peak"] <= found["heap"]
