"""Steps with several forward/backward passes, and passes inside a loop
(issue 17, part 6): which equations are backward, what the residuals of each
pass are, that the rewritten step runs the passes in turn, and that a loop
whose body holds the passes is planned per iteration. The budgets these
reach, with gradients compared, are in ``test_written_steps.py``."""

import jax
import jax.numpy as jnp

from jaxmem._decisions import Plan
from jaxmem.graph._graph import build_graph, forward_passes
from jaxmem.fit._inner import body_graph, inner_body
from jaxmem.schedule._schedule import build_schedule


def _loss(w, x):
  return jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))


W, X = jnp.ones((8, 8)) * 0.1, jnp.ones((2, 4, 8))


def _graph(step, *args):
  return build_graph(jax.make_jaxpr(step)(*args))


def _accumulate(w, xs):
  return jax.grad(_loss)(w, xs[0]) + jax.grad(_loss)(w, xs[1])


def test_each_pass_has_residuals_of_its_own():
  """The second pass's forward values that its backward part reads are
  residuals, made after the first pass's backward part."""
  graph = _graph(_accumulate, W, X)
  first, second = forward_passes(graph)
  assert max(first) < min(second)
  in_second = [r for r in graph.residuals if r.produced_at in second]
  assert in_second and len(in_second) < len(graph.residuals)
  assert all(r.first_backward_use > max(second) for r in in_second)
  assert all(max(first) < r.last_backward_use < min(second)
             for r in graph.residuals if r not in in_second)
  between = graph.nodes[max(first) + 1:min(second)]
  assert between and all(n.backward for n in between)


def test_the_inner_gradient_of_a_penalty_is_forward_work():
  """A gradient penalty's input gradient is computed by transposed
  equations inside the outer forward pass: they are forward, and the
  outer backward pass's residuals include what they make."""
  def penalized(w, x):
    grad_x = jax.grad(lambda x: _loss(w, x))(x)
    return _loss(w, x) + jnp.sum(grad_x ** 2)

  graph = _graph(jax.grad(penalized), W, X[0])
  assert len(forward_passes(graph)) == 1
  inner = [n for n in graph.nodes if "transpose(" in n.name_stack
           and not n.name_stack.startswith("transpose(")]
  assert inner and not any(n.backward for n in inner)
  made_inside = {v for n in inner for v in n.outs}
  assert made_inside & {r.value for r in graph.residuals}


def test_a_later_pass_starts_after_the_backward_part_before_it():
  """In a planned schedule, what the second forward part reads from outside
  it passes through a barrier tied to a value of the first backward part,
  so XLA cannot run the passes side by side."""
  graph = _graph(_accumulate, W, X)
  schedule = build_schedule(graph, Plan())
  second = forward_passes(graph)[1]
  made_by = {key: op for op in schedule.ops for key in op.outs}
  first_op = next(op for op in schedule.ops if op.kind == "node" and op.node == second[0])
  barrier = next(made_by[k] for k in first_op.ins
                 if isinstance(k, tuple) and made_by.get(k) is not None
                 and made_by[k].kind == "barrier")
  tied = [k for k in barrier.ins if graph.values[k[0]].producer is not None
          and graph.nodes[graph.values[k[0]].producer].backward
          and graph.values[k[0]].producer < second[0]]
  assert tied, "the barrier holds a value of the first backward part"


def test_passes_inside_a_loop_are_planned_in_its_body():
  def step(w, xs):
    return jax.lax.scan(lambda g, x: (g + jax.grad(_loss)(w, x), None),
                        jnp.zeros_like(w), xs)[0]

  graph = _graph(step, W, X)
  loop = inner_body(graph)
  assert not graph.has_backward and len(loop) == 1 and graph.nodes[loop[0]].prim.name == "scan"
  body = body_graph(graph, loop)
  assert body.has_backward and body.residuals
  assert inner_body(_graph(_accumulate, W, X)) is None  # passes outside loops
