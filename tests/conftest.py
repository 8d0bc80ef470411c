"""Fixtures and markers of the tests (the platform and jaxmem's import
come first, from the repository's own conftest.py)."""

import os
import sys

import jaxmem
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: model-scale checks; CI runs a subset")


@pytest.fixture(scope="module")
def mlp():
  """A small residual-MLP Adam step: (task, args, graph, model peak of the
  untransformed step), for planner tests."""
  import jax
  import optax

  import jaxmem_models as models
  from jaxmem.graph._graph import build_graph
  from jaxmem.cost._evaluate import evaluate
  task = models.get("mlp", optimizer=optax.adam(1e-3, eps=1e-3), depth=6, width=32,
                    batch=256, features=16)
  args = task.init()
  graph = build_graph(jax.make_jaxpr(task.step)(*args))
  return task, args, graph, evaluate(graph, jaxmem.Plan())[1].peak
