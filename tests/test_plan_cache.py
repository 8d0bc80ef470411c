"""The persistent plan cache: a restarted run takes its plan from disk
without planning; a step that changed, or an entry that no longer fits or
cannot be read, is planned again."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.fit._saved import dumps
from jaxmem._decisions import Plan
from tests.helpers import tanh_step


@dataclasses.dataclass
class Counting(jaxmem.Greedy):
  """The recompute greedy, counting what the fit loop asks of it."""
  name: str = "counting"
  calls: list = dataclasses.field(default_factory=list)

  def plan(self, graph, aim, start=None):
    self.calls.append("plan")
    return super().plan(graph, aim, start)

  def lowest(self, graph, start=None):
    self.calls.append("lowest")
    return super().lowest(graph, start)

  def structured(self, graph):
    self.calls.append("structured")
    return super().structured(graph)


def _step(w, x, layers=6):
  return tanh_step(w, x, layers=layers, lr=1e-3)


@pytest.fixture(scope="module")
def args():
  return jax.block_until_ready((jnp.eye(64) * 0.1, jnp.ones((512, 64))))


def _entries(where):
  return sorted(p for p in os.listdir(where) if p.endswith(".json"))


def test_a_restarted_run_takes_its_plan_without_planning(args, tmp_path):
  first = Counting()
  fitted = jaxmem.transform(_step, budget="60%", planner=first, plan_cache=tmp_path)
  fit = fitted.fit(*args)
  assert first.calls and len(fit.plan)
  entry, = _entries(tmp_path)
  # A new transform (as after a restart) with a new planner: no planner call.
  again = Counting()
  refitted = jaxmem.transform(_step, budget="60%", planner=again, plan_cache=tmp_path)
  refit = refitted.fit(*args)
  assert again.calls == []
  assert refit.plan == fit.plan and refit.footprint == fit.footprint
  assert refit.footprint <= fit.budget
  assert entry in refit.report()
  assert jnp.array_equal(refitted(*args), fitted(*args))
  assert jnp.allclose(refitted(*args), jax.jit(_step)(*args), atol=1e-6)


def test_a_changed_step_or_shape_is_planned_again(args, tmp_path):
  jaxmem.transform(_step, budget="60%", planner=Counting(), plan_cache=tmp_path).fit(*args)
  changed = Counting()
  deeper = lambda w, x: _step(w, x, layers=7)
  jaxmem.transform(deeper, budget="60%", planner=changed, plan_cache=tmp_path).fit(*args)
  assert "plan" in changed.calls
  reshaped = Counting()
  jaxmem.transform(_step, budget="60%", planner=reshaped, plan_cache=tmp_path).fit(
      args[0], jnp.ones((256, 64)))
  assert "plan" in reshaped.calls
  assert len(_entries(tmp_path)) == 3


def test_an_entry_that_does_not_fit_or_read_is_replaced(args, tmp_path, monkeypatch):
  monkeypatch.setenv("JAXMEM_PLAN_CACHE_DIR", str(tmp_path))  # the cache from the environment
  fit = jaxmem.transform(_step, budget="60%", planner=Counting()).fit(*args)
  entry = tmp_path / _entries(tmp_path)[0]
  record = json.loads(entry.read_text())
  # An entry for this step whose plan keeps everything: over the budget.
  entry.write_text(dumps(Plan(), record["step"]))
  over = Counting()
  assert jaxmem.transform(_step, budget="60%", planner=over).fit(*args).plan == fit.plan
  assert "plan" in over.calls
  assert json.loads(entry.read_text())["decisions"]  # replaced by the new plan
  entry.write_text("{not json")
  broken = Counting()
  with pytest.warns(UserWarning, match="not a usable plan"):
    assert jaxmem.transform(_step, budget="60%", planner=broken).fit(*args).plan == fit.plan
  assert "plan" in broken.calls
