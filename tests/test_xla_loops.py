"""What a loop holds on a GPU target, asked of XLA:GPU (``cost._xla_loops``)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmem.cost._evaluate import unplanned
from jaxmem.cost._xla_buffers import with_buffers
from jaxmem.fit._traced import modelled
from jaxmem.graph._graph import build_graph
from jaxmem.targets import placed, resolve, xla_footprint


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    for width in (16, 16, 16):
      x = nn.relu(nn.Conv(width, (3, 3))(x))
    return jnp.mean(x ** 2)


def _accumulated():
  """A user's gradient accumulation: a small conv net's gradients summed
  over 4 micro-batches in a ``lax.scan``."""
  net = _Net()
  params = jax.eval_shape(lambda: net.init(jax.random.key(0), jnp.ones((8, 32, 32, 8))))
  xs = jax.ShapeDtypeStruct((4, 8, 32, 32, 8), jnp.float32)

  def step(params, xs):
    def body(total, x):
      grads = jax.grad(lambda p: net.apply(p, x))(params)
      return jax.tree.map(jnp.add, total, grads), None
    return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), xs)[0]

  return step, (params, xs)


def test_a_loop_holds_what_xla_gpu_gives_it_compiled_alone():
  """For a T4, each top-level scan's loop is compiled alone and what it
  holds beyond its operands and results taken from XLA:GPU: the memory
  model of the step as written is then within 5% of XLA:GPU's footprint,
  closer than with the body's fusion emulated as XLA:CPU's."""
  step, args = _accumulated()
  where = resolve("t4", ())
  graph = modelled(build_graph(jax.make_jaxpr(step)(*args)), where)
  scans = [n.index for n in graph.nodes if n.prim.name == "scan"]
  assert sorted(graph.buffers.bodies) == scans and len(scans) == 1
  xla = xla_footprint(jax.jit(step, compiler_options=where.options(measuring=True))
                      .lower(*placed(args, "t4")).compile())
  learned = unplanned(graph, 0).peak
  emulated = unplanned(with_buffers(graph, dataclasses.replace(graph.buffers, bodies={})), 0).peak
  assert abs(learned / xla - 1) <= 0.05, (learned, xla)
  assert abs(learned / xla - 1) < abs(emulated / xla - 1), (learned, emulated, xla)
