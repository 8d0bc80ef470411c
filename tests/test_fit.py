"""The fit loop's choices among compiled plans (``jaxmem.fit._fit.Fitter``),
with the compiler replaced by a table: each plan's footprint and predicted
time are given, so what the loop takes follows from its rules alone."""

import types

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem._decisions import RECOMPUTE, Plan
from jaxmem.cost._evaluate import candidate, model_floor, unplanned
from jaxmem.fit._fit import LOWEST_MARGIN, TIME_MARGIN, Fitter
from jaxmem.graph._graph import build_graph
from jaxmem.planners import Greedy, ILP
from jaxmem.planners._blocks import rebuilt_as_checkpointed


def _step(w, x):
  return jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w)))(w)


def _graph():
  return build_graph(jax.make_jaxpr(_step)(jnp.ones((16, 16)), jnp.ones((8, 16))))


def _compiled(footprint: int, seconds: float):
  """What the fit reads of a compiled program: its memory analysis and,
  through the clock below, its predicted time."""
  stats = types.SimpleNamespace(
      temp_size_in_bytes=footprint, argument_size_in_bytes=0, output_size_in_bytes=0,
      alias_size_in_bytes=0, host_temp_size_in_bytes=0, host_output_size_in_bytes=0,
      host_argument_size_in_bytes=0)
  return types.SimpleNamespace(memory_analysis=lambda: stats, seconds=seconds)


class _Table(jaxmem.Planner):
  """A planner whose search toward the budget ends on ``searched`` and
  whose candidates for the smallest footprint are ``lowest``."""
  name = "table"

  def __init__(self, searched, lowest):
    super().__init__()
    self.searched, self.low = searched, lowest

  def plan(self, graph, aim, start=None):
    return self.searched.aimed(aim)

  def lowest(self, graph, start=None):
    return list(self.low)


def _fitter(graph, planner, table: dict, budget: int) -> Fitter:
  return Fitter(graph, planner, budget, unconstrained=1000, model_scale=1.0,
                jit=lambda c: _compiled(*table[c.plan]), max_rounds=1,
                clock=lambda compiled: compiled.seconds)


def test_where_the_search_misses_the_fastest_fitting_low_plan_is_taken():
  """The search's plan compiles over the budget; of the candidates for the
  smallest footprint, two fit. The fit takes the faster, not the smaller,
  and the error it would raise without them names the smallest."""
  graph = _graph()
  residuals = [r.value for r in graph.residuals]
  assert len(residuals) >= 2
  over, small, fast = (Plan().with_decision(residuals[0], RECOMPUTE),
                       Plan().with_decision(residuals[1], RECOMPUTE),
                       Plan.of({v: RECOMPUTE for v in residuals[:2]}))
  table = {Plan(): (1000, 1.0), over: (900, 1.1), small: (500, 1.6), fast: (700, 1.2)}
  planner = _Table(candidate(graph, over), [candidate(graph, small), candidate(graph, fast)])
  trial, _ = _fitter(graph, planner, table, budget=800).fit()
  assert trial.candidate.plan == fast and trial.measured == 700
  with pytest.raises(jaxmem.BudgetError) as err:
    _fitter(graph, planner, table, budget=400).fit()
  assert err.value.smallest == 500


def test_the_step_as_written_is_taken_where_it_fits():
  """At a budget the step as written meets, nothing is planned."""
  graph = _graph()
  planner = _Table(unplanned(graph, 0), [])
  trial, _ = _fitter(graph, planner, {Plan(): (1000, 1.0)}, budget=1000).fit()
  assert not len(trial.candidate.plan)


def test_a_long_search_says_so_before_it_starts(mlp, monkeypatch, caplog, tmp_path):
  """Before its first search the fit times one evaluation and warns, with
  the estimate and why, where planning would pass ``LONG`` seconds; the
  quick fits of the test models, and a saved plan, say nothing."""
  import jaxmem.fit._forewarn as forewarn
  task, args, graph, _ = mlp
  with caplog.at_level("WARNING", logger="jaxmem"):
    jaxmem.transform(task.step, budget="60%").fit(*args)
  assert not [r for r in caplog.records if "may take" in r.getMessage()]
  estimate = forewarn.forewarn(graph, "cpu", ILP())
  assert 0 < estimate < forewarn.LONG
  # The estimate is the planner's: the exact planner prices each of its
  # choices once, the greedy weighs plans residual by residual.
  assert len(ILP().table(graph).choices) <= ILP().weighs(graph) < Greedy().weighs(graph)
  assert Greedy().weighs(graph) >= 8 * len(graph.residuals)
  monkeypatch.setattr(forewarn, "LONG", 0.0)
  with caplog.at_level("WARNING", logger="jaxmem"):
    jaxmem.transform(task.step, budget="60%").fit(*args)
  said = [r.getMessage() for r in caplog.records if "may take" in r.getMessage()]
  assert len(said) == 1
  assert f"({len(graph.residuals)} residuals)" in said[0] and "plan_cache=dir" in said[0]
  assert "planner 'auto'" in said[0]
  # A saved plan applied again searches nothing, so nothing is said.
  path = tmp_path / "plan.json"
  jaxmem.transform(task.step, budget="60%").fit(*args).save_plan(path)
  caplog.clear()
  with caplog.at_level("WARNING", logger="jaxmem"):
    jaxmem.transform(task.step, budget="60%", plan=path).fit(*args)
  assert not [r for r in caplog.records if "may take" in r.getMessage()]


def test_block_shaped_forms_are_compiled_only_where_their_kind_may_fit():
  """On a target with a clock, once a block-rebuilt form has compiled over
  its model peak by some ratio, another block-rebuilt form that the same
  ratio puts over the budget is not compiled (the model-to-XLA ratio of
  the whole step would let it be), and neither is its planned form."""
  graph = _graph()
  residuals = [r.value for r in graph.residuals]
  first, second = (candidate(graph, Plan().with_decision(v, RECOMPUTE)) for v in residuals[:2])
  rebuilt = [candidate(graph, rebuilt_as_checkpointed(graph, c.plan)) for c in (first, second)]
  # Both block-rebuilt forms may fit by the step's ratio (1.0, and 10% more);
  # the second does not by the first's (1 / 1.3, and 3% more).
  budget = int(max(c.peak for c in rebuilt) / 1.1) + 1
  assert rebuilt[1].peak * 1.3 / 1.03 > budget
  searched = candidate(graph, Plan.of({v: RECOMPUTE for v in residuals}))
  compiled = []

  def jit(c):  # XLA takes 30% more than the model for every shaped form
    compiled.append(c.plan)
    if c.plan == searched.plan:
      return _compiled(budget, 2.0)
    return _compiled(int(c.peak * 1.3), 1.0)

  class Shaped(_Table):
    def structured(self, graph):
      return [first, second]

  fitter = Fitter(graph, Shaped(searched, []), budget, unconstrained=10 * budget,
                  model_scale=1.0, jit=jit, max_rounds=1, clock=lambda c: c.seconds)
  found = fitter.compile(searched)
  assert fitter.structured(found) is found  # nothing shaped fits
  assert rebuilt[0].plan in compiled
  assert rebuilt[1].plan not in compiled and second.plan not in compiled


def test_a_shaped_form_its_kind_prices_slower_than_the_plan_is_not_compiled():
  """On a target with a clock, once a shaped form has compiled, its
  predicted seconds per unit of planner cost price the next: where that is
  over ``TIME_MARGIN`` slower than the plan that fits, it is not compiled,
  nor is its planned form (which recomputes the same)."""
  graph = _graph()
  residuals = [r.value for r in graph.residuals]
  # Plans that rebuild a residual: a plan dropping a tanh output reads it as
  # made, since XLA:CPU computes the kept 1 - tanh**2 from it in the backward
  # pass (it lives on anyway), and so costs nothing.
  dropping = [candidate(graph, Plan().with_decision(v, RECOMPUTE)) for v in residuals]
  first, second = [c for c in dropping if any(op.kind == "recompute" for op in c.schedule.ops)]
  rebuilt = [candidate(graph, rebuilt_as_checkpointed(graph, c.plan)) for c in (first, second)]
  searched = candidate(graph, Plan.of({v: RECOMPUTE for v in residuals}))
  budget, compiled = 10 ** 9, []

  def jit(c):  # every form fits; a form's time is its planner cost
    compiled.append(c.plan)
    return _compiled(budget, plan_time if c.plan == searched.plan else fitter.cost(c))

  class Shaped(_Table):
    def structured(self, graph):
      return [first, second]

  fitter = Fitter(graph, Shaped(searched, []), budget, unconstrained=10 * budget,
                  model_scale=1.0, jit=jit, max_rounds=1, clock=lambda c: c.seconds)
  costs = [fitter.cost(c) for c in rebuilt]
  assert min(costs) > 0
  plan_time = min(costs) / (1 + TIME_MARGIN) / 1.01  # both rebuilt forms are slower
  found = fitter.compile(searched)
  assert fitter.structured(found) is found
  assert compiled == [searched.plan, rebuilt[0].plan]


def test_without_a_clock_a_shaped_form_its_kind_puts_over_the_budget_is_not_compiled():
  """Without a clock (XLA:CPU), once a form shaped like a per-block policy
  has compiled over the budget, another that the same model-to-XLA ratio
  puts over it is not compiled, though it costs less than the plan found."""
  graph = _graph()
  residuals = [r.value for r in graph.residuals]
  first, second = (candidate(graph, Plan().with_decision(v, RECOMPUTE)) for v in residuals[:2])
  # XLA takes 30% more than the model for every shaped form: the first
  # compiles over the budget, and by its ratio (3% more) so would the second.
  budget = int(min(first.peak * 1.3, second.peak * 1.3 / 1.03)) - 1
  searched = candidate(graph, Plan.of({v: RECOMPUTE for v in residuals}))
  compiled = []

  def jit(c):
    compiled.append(c.plan)
    return _compiled(budget if c.plan == searched.plan else int(c.peak * 1.3), 1.0)

  class Shaped(_Table):
    def structured(self, graph):
      return [first, second]

  fitter = Fitter(graph, Shaped(searched, []), budget, unconstrained=10 * budget,
                  model_scale=1.0, jit=jit, max_rounds=1)
  found = fitter.compile(searched)
  assert max(fitter.cost(first), fitter.cost(second)) < fitter.cost(found)
  assert fitter.structured(found) is found
  assert compiled == [searched.plan, first.plan]


def _asked():
  """A graph, a plan of it that recomputes one residual, and a table
  planner class whose ``lowest`` records each graph it is asked about in
  the list returned."""
  graph = _graph()
  over = Plan().with_decision(graph.residuals[0].value, RECOMPUTE)
  asked = []

  class Asked(_Table):
    def lowest(self, graph, start=None):
      asked.append(graph)
      return super().lowest(graph, start)
  return graph, over, asked, Asked


def test_the_quick_fit_asks_for_no_low_plans_where_the_floor_cannot_fit():
  """``model_floor`` is under every plan's model peak: where even it cannot
  come under the budget (by the most model bytes per XLA byte seen), the
  quick fit's search for the smallest plans that may fit asks the planner
  for none; where it may, the planner is asked."""
  graph, over, asked, Asked = _asked()
  planner = Asked(candidate(graph, over), [candidate(graph, over)])
  table = {Plan(): (10**9, 1.0), over: (10**9, 1.0)}  # no ratio over the scale's
  floor = model_floor(graph)
  margin = 1 + LOWEST_MARGIN
  for budget, asks in ((int(floor / margin) - 1, False), (int(floor / margin) + 1, True)):
    asked.clear()
    fitter = _fitter(graph, planner, table, budget)
    tried = fitter.compile(candidate(graph, over))
    assert fitter.lowest(tried, only_fitting=True)[0] is tried
    assert asked == ([graph] if asks else [])


def test_the_smallest_is_sought_only_under_a_footprint_reached_otherwise():
  """With ``to_beat`` (the smallest footprint of the step in micro-batches,
  as errors name it), the search for the whole step's smallest compiles
  only candidates that may come under it, and asks the planner for none
  where the graph's floor may not; without it, the planner is asked."""
  graph, over, asked, Asked = _asked()
  planner = Asked(candidate(graph, over), [])
  table = {Plan(): (10**9, 1.0), over: (10**9, 1.0)}
  floor = model_floor(graph)
  for to_beat, asks in ((floor // 2, False), (None, True)):
    asked.clear()
    fitter = _fitter(graph, planner, table, budget=1)
    fitter.to_beat = to_beat
    with pytest.raises(jaxmem.BudgetError) as err:
      fitter.fit()
    assert err.value.smallest == 10**9 and asked == ([graph] if asks else [])
