"""What a transform compiles: a budget the step as written meets costs the
one compilation jax.jit makes; an impossible budget fails at once the
second time; a saved plan is compiled once; a looser plan is compiled only
where the plans compiled say it may fit."""

import contextlib
import time
import dataclasses

import jax
import jax.numpy as jnp
from jax import monitoring
import optax
import pytest

import jaxmem
from jaxmem._budget import format_bytes
from jaxmem.schedule._emit import emit
from jaxmem.cost._evaluate import unplanned_liveness
from jaxmem.fit import _fit
from jaxmem.fit._fit import Fitter
from jaxmem.graph._graph import build_graph
from jaxmem.planners import Fixed, Greedy
from jaxmem.targets import xla_footprint
import jaxmem_models as models
from tests.helpers import tanh_step
from tests.test_target import SMALL

_COMPILES: list = []
_COUNTING = [False]


def _listen(name, secs, **kwargs):
  if _COUNTING[0] and "backend_compile" in name:
    _COMPILES.append(name)


monitoring.register_event_duration_secs_listener(_listen)


@contextlib.contextmanager
def counted():
  """The backend compilations made inside the block (a list filled as they
  happen)."""
  _COMPILES.clear()
  _COUNTING[0] = True
  try:
    yield _COMPILES
  finally:
    _COUNTING[0] = False


def compiles(fn, *args):
  """``fn(*args)``'s result, with the backend compilations it made."""
  with counted() as made:
    out = jax.block_until_ready(fn(*args))
  return out, len(made)


def _step(w, x):
  return tanh_step(w, x, layers=6, lr=1e-3)


@pytest.fixture(scope="module")
def args():
  return jax.block_until_ready((jnp.eye(64) * 0.1, jnp.ones((512, 64))))


def test_a_budget_the_step_meets_compiles_once(args):
  step = lambda w, x: _step(w, x)  # a step of its own: nothing compiled for it yet
  want, plain = compiles(jax.jit(step), *args)
  fitted = jaxmem.transform(step, budget="100%")
  got, made = compiles(fitted, *args)
  assert plain == 1 and made == 1
  assert not len(fitted.fit(*args).plan)
  assert jnp.array_equal(got, want)
  _, again = compiles(fitted, *args)
  assert again == 0


def _conv_step(w, x):
  """A convolution whose kernel gradient the memory model sees run on
  pinned input copies (XLA:CPU's habit): the step as written all the same."""
  def loss(w):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(jnp.tanh(y) ** 2)
  return w - 1e-3 * jax.grad(loss)(w)


def test_a_conv_step_the_budget_meets_compiles_once():
  w, x = jnp.ones((3, 3, 8, 8)) * 0.1, jnp.ones((4, 16, 16, 8))
  want, plain = compiles(jax.jit(_conv_step), w, x)
  fitted = jaxmem.transform(_conv_step, budget="100%")
  got, made = compiles(fitted, w, x)
  assert plain == 1 and made == 1
  fit = fitted.fit(w, x)
  assert not len(fit.plan) and not fit.result.changes_step
  assert jnp.array_equal(got, want)


def test_a_donated_step_is_measured_undonated(args):
  # The budget is a fraction of the step's footprint without donation, a
  # second program: two compilations, the donated one serving the calls.
  fitted = jaxmem.transform(lambda w, x: _step(w, x), budget="100%", donate_argnums=0)
  w, x = jnp.array(args[0]), args[1]
  _, made = compiles(fitted, w, x)
  assert made == 2
  assert w.is_deleted()


def test_a_second_impossible_budget_fails_at_once(args):
  step = lambda w, x: _step(w, x)  # a step of its own: nothing remembered yet
  with pytest.raises(jaxmem.BudgetError) as first:
    jaxmem.transform(step, budget="10%").fit(*args)
  # Another transform of the same step, under the smallest footprint named:
  # the same error, no compilation.
  fitted = jaxmem.transform(step, budget=first.value.smallest - 4096)
  with counted() as made, pytest.raises(jaxmem.BudgetError) as second:
    fitted.fit(*args)
  assert not made
  assert second.value.smallest == first.value.smallest
  assert not fitted.can_fit(*args)
  # A budget at the smallest named is still planned, and fits.
  assert jaxmem.transform(step, budget=first.value.smallest).can_fit(*args)


def test_a_second_fit_compiles_no_micro_batches_measured_before(args):
  """The micro-batched forms an impossible budget's fit measured are not
  compiled again to be measured by a fit of the same step at the budget
  its error named: that fit compiles fewer programs than a fit of a step of
  its own, to the same plan."""
  step = lambda w, x: _step(w, x)  # steps of their own: nothing remembered yet
  fresh = lambda w, x: _step(w, x)
  with pytest.raises(jaxmem.BudgetError) as first:
    jaxmem.transform(step, budget=1).fit(*args)
  budget = first.value.smallest
  with counted() as made:
    fit = jaxmem.transform(step, budget=budget).fit(*args)
  again = len(made)
  with counted() as made:
    own = jaxmem.transform(fresh, budget=budget).fit(*args)
  assert fit.micro is not None and fit.micro == own.micro
  assert fit.plan == own.plan and fit.footprint == own.footprint <= budget
  assert again < len(made), (again, len(made))


def test_the_budget_an_error_named_takes_the_plan_that_reached_it(args, tmp_path):
  """The error of an impossible budget carries the plan that reached the
  smallest footprint it names. Another transform of the step at that
  budget applies that plan without searching or compiling (the step, its
  chunks as written and the plan are the first fit's compilations); a budget
  well above it is planned as any budget is. The plan, saved, applies to
  the step as ``plan=`` does."""
  step = lambda w, x: _step(w, x)  # a step of its own: nothing remembered yet
  with pytest.raises(jaxmem.BudgetError) as first:
    jaxmem.transform(step, budget=1).fit(*args)
  budget = first.value.smallest
  assert first.value.plan is not None
  with counted() as made:
    fit = jaxmem.transform(step, budget=budget).fit(*args)
  assert "of the smallest footprint" in fit.planner.name
  assert fit.footprint <= budget
  assert fit.micro is not None and not made, made
  above = jaxmem.transform(step, budget=int(budget * 1.2)).fit(*args)
  assert "of the smallest footprint" not in above.planner.name
  path = tmp_path / "smallest.json"
  path.write_text(first.value.plan)
  again = jaxmem.transform(step, budget=budget, plan=path)
  assert again.fit(*args).plan == fit.plan
  assert jnp.allclose(again(*args), jax.jit(_step)(*args), atol=1e-6)


def test_a_search_that_fails_where_a_remembered_plan_fits_takes_that_plan(args, monkeypatch):
  """Where a later fit's search finds nothing at a budget the plan that
  reached a remembered smallest meets (a search's path depends on its
  aim), that plan is taken; and the least smallest reached stays
  remembered."""
  import jaxmem._fitting as fitting
  from jaxmem.fit import _unmet
  step = lambda w, x: _step(w, x)  # a step of its own: nothing remembered yet
  with pytest.raises(jaxmem.BudgetError) as first:
    jaxmem.transform(step, budget=1, micro_batches=1).fit(*args)
  smallest = first.value.smallest
  searched = fitting.search

  def fails(fitter, graph, planner, *rest, **options):  # every search but a given plan's
    if isinstance(planner, Fixed):
      return searched(fitter, graph, planner, *rest, **options)
    raise jaxmem.BudgetError("no plan", smallest=2 * smallest)
  monkeypatch.setattr(fitting, "search", fails)
  fit = jaxmem.transform(step, budget=int(1.5 * smallest), micro_batches=1).fit(*args)
  assert "of the smallest footprint" in fit.planner.name and fit.footprint <= smallest
  with pytest.raises(jaxmem.BudgetError):  # under the smallest: fails at once, as before
    jaxmem.transform(step, budget=smallest - 1, micro_batches=1).fit(*args)
  memo, = _unmet._SMALLEST[step]
  _unmet.remember(step, memo, 2 * smallest, fit.unconstrained, None)  # a larger one
  assert _unmet.remembered(step, memo)[0] == smallest


def test_a_chunked_form_is_measured_once_and_kept_once_planned():
  """A later fit of the same step reads a form's footprint as written from
  the first fit's measure, without compiling it; where a fit takes a
  form's compilation (to plan it), later fits take that compilation too."""
  import types
  from jaxmem.fit._shared import measuring
  made = []

  def compile(traced):
    made.append(traced)
    return types.SimpleNamespace(footprint=7)

  step = lambda x: x + 1  # a function of its own: nothing measured for it yet
  traced = jax.make_jaxpr(step)(1.0)
  first = measuring(step, ("here",), compile)(traced)
  assert first.footprint == 7 and len(made) == 1
  later = measuring(step, ("here",), compile)(traced)
  assert later.footprint == 7 and len(made) == 1  # not compiled to be measured again
  assert later.written.footprint == 7 and len(made) == 2  # compiled where it is planned
  kept = measuring(step, ("here",), compile)(traced)
  assert kept.written is later.written and len(made) == 2
  assert measuring(step, ("elsewhere",), compile)(traced).footprint == 7 and len(made) == 3


def test_the_compilations_kept_for_a_step_go_with_it(args):
  """What fits keep per step function (its graphs, the compilation of the
  step as written, its planned forms, the plan of its smallest footprint)
  holds no reference back to the function: they go when it goes."""
  import gc
  import weakref
  step = lambda w, x: _step(w, x)
  with pytest.raises(jaxmem.BudgetError):
    jaxmem.transform(step, budget=1).fit(*args)
  jaxmem.transform(step, budget="60%")(*args)
  gone = weakref.ref(step)
  del step
  gc.collect()
  assert gone() is None


def test_micro_batches_that_fit_as_written_are_taken_as_compiled(caplog):
  """Where the step runs in micro-batches, the count whose step as written
  fits the budget is taken as it was compiled to be measured, on a GPU
  target too, where a plan of it or its backward reads separated could
  compile smaller: no other form of it is compiled, and it needs no plan.
  (6 tanh layers over 4096 examples of 256 for a T4: at 40%, no plan of the
  whole step fits, 4 micro-batches do as written.)"""
  from jaxmem.targets import placed
  step = lambda w, x: tanh_step(w, x, layers=6, lr=1e-3)
  args = placed((jnp.eye(256) * 0.1, jnp.ones((4096, 256))), "t4")
  caplog.set_level("INFO", logger="jaxmem")
  fit = jaxmem.transform(step, budget="40%", target="t4").fit(*args)
  logged = [r.getMessage() for r in caplog.records]
  assert fit.micro is not None and not len(fit.plan), fit
  measured = [m for m in logged if "micro-batches of" in m and "as written:" in m]
  assert measured[-1].endswith(f"as written: {fit.footprint}"), logged
  assert not any("backward reads separated" in m for m in logged), logged


def test_a_second_transform_of_a_step_plans_on_its_graph_with_its_planner(args):
  """Another transform of the same function, traced to the same program,
  plans on the graph and with the planner the first one set up (their
  searches done), and takes the first one's compilations of the step as
  written and of the plans it compiled: it compiles nothing. One whose
  options make another program (a donated argument) compiles its own."""
  step = lambda w, x: _step(w, x)
  first = jaxmem.transform(step, budget="60%").fit(*args)
  with counted() as made:
    second = jaxmem.transform(step, budget="60%").fit(*args)
  assert second.graph is first.graph and second.planner is first.planner
  assert second.plan == first.plan and second.footprint == first.footprint
  assert second.attempts == first.attempts and not made
  with counted() as made:
    donated = jaxmem.transform(step, budget="60%", donate_argnums=0).fit(*args)
  assert len(made) >= 1 + donated.attempts  # the step as written, each plan compiled


def test_a_step_closing_over_other_constants_is_planned_afresh(args):
  """A step traced again to the same equations with another constant (an
  array it closes over) gets a graph of its own, and its own numbers."""
  held = {"scale": jnp.full((64,), 0.5)}
  step = lambda w, x: _step(w * held["scale"], x)
  first = jaxmem.transform(step, budget="60%")
  first.fit(*args)
  held["scale"] = jnp.full((64,), 0.25)
  jax.clear_caches()  # else jax.jit's trace of the function keeps the old constant
  second = jaxmem.transform(step, budget="60%")
  assert second.fit(*args).graph is not first.fit(*args).graph
  assert jnp.allclose(second(*args), jax.jit(step)(*args), rtol=1e-5, atol=1e-6)


def test_a_saved_plan_reloads_to_the_same_program(args, tmp_path):
  fitted = jaxmem.transform(_step, budget="60%")
  fit = fitted.fit(*args)
  assert len(fit.plan)
  path = tmp_path / "plan.json"
  fitted.save_plan(path)
  again = jaxmem.transform(_step, budget="60%", plan=path)
  refit = again.fit(*args)
  assert refit.plan == fit.plan
  assert refit.footprint == fit.footprint
  assert [op.kind for op in refit.memory.schedule.ops] == [
      op.kind for op in fit.memory.schedule.ops]
  assert refit.attempts == 1 and "saved plan" in refit.report()
  assert jnp.array_equal(again(*args), fitted(*args))
  # Planned for other shapes: refused, and the error says why.
  with pytest.raises(ValueError, match="made for another step"):
    again.fit(args[0], jnp.ones((256, 64)))
  # A budget the saved plan does not meet: the error names its footprint.
  with pytest.raises(jaxmem.BudgetError) as error:
    jaxmem.transform(_step, budget=fit.footprint - 1, plan=path).fit(*args)
  assert error.value.smallest == fit.footprint


def test_a_plan_that_comes_back_unchanged_is_not_compiled_again(args):
  # A saved plan's planner answers every aim with the same plan: once XLA
  # rates it over the budget, aiming lower cannot change it.
  graph = build_graph(jax.make_jaxpr(_step)(*args))
  full = unplanned_liveness(graph).peak
  found = Greedy().plan(graph, int(0.6 * full))
  plan, compiled = found.plan, []

  def jit(c):
    compiled.append(c.plan)
    return jax.jit(emit(c.schedule)).lower(*args).compile()

  # A budget XLA's footprint of the plan is over, and a model scale that
  # puts the first aim between the plan's model peak and the step's.
  budget = xla_footprint(jax.jit(emit(found.schedule)).lower(*args).compile()) - 1
  fitter = Fitter(graph, Fixed(plan), budget, 10 * budget,
                  (found.peak + full) / 2 / budget, jit)
  assert found.peak < fitter.model_scale * budget * 0.99 < full
  trial, rounds = fitter.tighten()
  assert trial.measured > fitter.budget and trial.candidate.plan == plan
  assert compiled == [plan] and rounds == 1


def test_a_plan_compiled_over_the_budget_tries_the_policy_shaped_plans_before_planning_again(
    args):
  # The model rates the plans within their aims, XLA over the budget, and
  # a round after the first still plans slower than it compiles: a plan
  # shaped like the per-block policies that XLA fits is compiled, and taken
  # after one more round (whose planner answers the plan just compiled,
  # which is not compiled again).
  graph = build_graph(jax.make_jaxpr(_step)(*args))
  full = unplanned_liveness(graph).peak
  found, shaped = Greedy().plan(graph, int(0.6 * full)), Greedy().plan(graph, int(0.55 * full))
  looser = Greedy().plan(graph, int(0.65 * full))
  planned, compiled, programs = [], [], {}

  def jit(c):  # each plan compiled once up front: the fit's compiles take no time
    compiled.append(c.plan)
    if c.plan not in programs:
      programs[c.plan] = jax.jit(emit(c.schedule)).lower(*args).compile()
    return programs[c.plan]

  def slow(answers):
    class Slow(Fixed):
      def plan(self, graph, aim, start=None):
        planned.append(aim)
        time.sleep(0.05)  # longer than twice a compile (a look-up)
        return next(answers)

      def structured(self, graph):
        return [shaped]
    return Slow(found.plan)

  budget = xla_footprint(jit(found)) - 1
  assert xla_footprint(jit(shaped)) <= budget < xla_footprint(jit(looser))
  compiled.clear()
  fitter = Fitter(graph, slow(iter([found, looser, looser])), budget, 10 * budget,
                  (found.peak + full) / 2 / budget, jit)
  trial, rounds = fitter.tighten()
  assert trial.candidate.plan == shaped.plan and trial.measured <= budget
  assert len(planned) == 3 and rounds == 2
  assert compiled == [found.plan, looser.plan, shaped.plan]
  # Where that round's plan fits and costs less, it is taken.
  middle = Greedy().plan(graph, int(0.3 * full))
  assert Greedy().cost(middle.schedule) < Greedy().cost(shaped.schedule)
  jit(middle)
  fitter = Fitter(graph, slow(iter([found, looser, middle])), budget, 10 * budget,
                  (found.peak + full) / 2 / budget, jit)
  trial, rounds = fitter.tighten()
  assert trial.candidate.plan == middle.plan and trial.measured <= budget and rounds == 3


def test_a_plan_compiled_over_the_budget_plans_again_first_where_planning_is_quick(args):
  # The first round plans slower than it compiles (it builds the planner's
  # table), the next ones quicker: another round costs about what a plan
  # shaped like the policies does to compile, and finds a cheaper plan; the
  # shaped plan is not compiled.
  graph = build_graph(jax.make_jaxpr(_step)(*args))
  full = unplanned_liveness(graph).peak
  found, shaped = Greedy().plan(graph, int(0.6 * full)), Greedy().plan(graph, int(0.3 * full))
  lower = Greedy().plan(graph, int(0.55 * full))
  answers, compiled, programs = iter([found, lower]), [], {}

  class SlowFirst(Fixed):
    def plan(self, graph, aim, start=None):
      answer = next(answers)
      if answer is found:
        time.sleep(0.05)  # longer than twice a compile (a look-up)
      return answer

    def structured(self, graph):
      return [shaped]

  def jit(c):
    compiled.append(c.plan)
    if c.plan not in programs:
      programs[c.plan] = jax.jit(emit(c.schedule)).lower(*args).compile()
    return programs[c.plan]

  budget = xla_footprint(jit(found)) - 1
  assert xla_footprint(jit(lower)) <= budget and xla_footprint(jit(shaped)) <= budget
  compiled.clear()
  fitter = Fitter(graph, SlowFirst(found.plan), budget, 10 * budget,
                  (found.peak + full) / 2 / budget, jit)
  trial, rounds = fitter.tighten()
  assert trial.candidate.plan == lower.plan and rounds == 2
  assert compiled == [found.plan, lower.plan]


def test_a_fit_found_among_the_lowest_compiles_the_shaped_plans_that_may_fit(args):
  """Where only a candidate for the smallest footprint fits (a budget at
  the smallest an error named), the plans shaped like per-block policies
  that cost less are compiled against it only where they may fit."""
  graph = build_graph(jax.make_jaxpr(_step)(*args))
  full = unplanned_liveness(graph).peak
  over, low = Greedy().plan(graph, int(0.6 * full)), Greedy().plan(graph, 0)
  shaped = [Greedy().plan(graph, int(f * full)) for f in (0.9, 0.8, 0.7)]
  assert len({over.plan, low.plan, *(s.plan for s in shaped)}) == 5
  assert all(Greedy().cost(s.schedule) < Greedy().cost(low.schedule) for s in shaped)
  compiled = []

  def jit(c):
    compiled.append(c.plan)
    return jax.jit(emit(c.schedule)).lower(*args).compile()

  class Lowest(Fixed):
    def plan(self, graph, aim, start=None):
      return over.aimed(0)

    def lowest(self, graph, start=None):
      return [low]

    def structured(self, graph):
      return shaped

  budget = xla_footprint(jit(low))
  compiled.clear()
  fitter = Fitter(graph, Lowest(over.plan), budget, 10 * budget, full / (10 * budget), jit)
  trial, _ = fitter.fit()
  assert trial.candidate.plan == low.plan
  assert low.plan in compiled and not any(s.plan in compiled for s in shaped), compiled


def test_a_looser_plan_is_sought_only_where_it_may_fit(args):
  # Loosening a plan far under the budget aims no higher than a plan that
  # may fit can peak at (:meth:`Fitter.may_fit`): a plan for a looser aim
  # would not be compiled, and planning it would be wasted.
  graph, full, unconstrained, fitter = _fitter(args, 0.7)
  aims = []

  class Recorded(Greedy):
    def plan(self, graph, aim, start=None):
      aims.append(aim)
      return super().plan(graph, aim, start)

  fitter.planner = Recorded()
  trial = fitter.compile(Greedy().plan(graph, int(0.6 * full)))
  assert trial.measured < (1 - _fit.LOOSEN_MARGIN) * fitter.budget
  cap = fitter.most_that_may_fit()
  # Uncapped, the first looser aim scales the plan's by what XLA left free.
  room = fitter.budget
  assert trial.candidate.aim / trial.measured * room * 0.99 > cap
  fitter.loosen(trial)
  assert aims and max(aims) <= cap
  # Where the most that may fit is under LOOSEN_MARGIN above the plan's own
  # aim (XLA's footprint holding more that no plan changes), nothing is
  # planned.
  aims.clear()
  least = fitter.most_that_may_fit() / fitter.budget  # the looser plans compiled included
  fitter.fixed = fitter.budget - int(trial.candidate.aim * (1 + _fit.LOOSEN_MARGIN / 2) / least)
  assert fitter.fixed > 0 and trial.measured < (1 - _fit.LOOSEN_MARGIN) * fitter.budget
  fitter.loosen(trial)
  assert not aims


def test_a_plan_is_compiled_once_per_fit(args):
  graph, full, _, fitter = _fitter(args, 0.7)
  plan = Greedy().plan(graph, int(0.6 * full))
  with counted() as made:
    first = fitter.compile(plan)
    again = fitter.compile(dataclasses.replace(plan, aim=1))
  assert len(made) == 1
  assert (again.footprint, again.candidate.aim) == (first.footprint, 1)


def _fitter(args, fraction: float):
  """A fit loop for ``_step`` at ``fraction`` of its footprint, with its
  graph, model peak and footprint."""
  graph = build_graph(jax.make_jaxpr(_step)(*args))
  full = unplanned_liveness(graph).peak
  jit = lambda c: jax.jit(emit(c.schedule)).lower(*args).compile()
  unconstrained = xla_footprint(jax.jit(_step).lower(*args).compile())
  fitter = Fitter(graph, Greedy(), int(fraction * unconstrained), unconstrained,
                  full / unconstrained, jit)
  return graph, full, unconstrained, fitter


def test_a_looser_plan_is_compiled_only_where_the_compiled_ones_say_it_may_fit(args):
  graph, full, unconstrained, fitter = _fitter(args, 0.7)
  tight, loose = Greedy().plan(graph, int(0.6 * full)), Greedy().plan(graph, int(0.9 * full))
  assert fitter.may_fit(loose)  # nothing compiled yet: no evidence against it
  trial = fitter.compile(tight)
  # The least model bytes per XLA byte seen (the step as written's included)
  # rates the looser plan's footprint; over the budget it is not compiled.
  least = min(full / unconstrained, tight.peak / trial.footprint)
  assert fitter.may_fit(loose) == (loose.peak / least <= fitter.budget)
  assert not fitter.may_fit(loose)
  assert fitter.may_fit(tight)


def test_a_plan_for_the_smallest_footprint_is_compiled_only_where_it_may_come_under(args):
  graph, full, unconstrained, fitter = _fitter(args, 0.05)
  low, high = Greedy().plan(graph, 0), Greedy().plan(graph, int(0.9 * full))
  trials = [fitter.compile(low)]
  # The most model bytes per XLA byte seen, 10% more, rates the higher
  # plan's smallest footprint: over the smallest so far (and the budget),
  # it is not compiled; the plan compiled may always come under itself.
  most = max(full / unconstrained, low.peak / trials[0].footprint) * (1 + _fit.LOWEST_MARGIN)
  assert not fitter.may_beat(high.peak, trials)
  assert high.peak / most > trials[0].footprint
  assert fitter.may_beat(low.peak, trials)
  # Where a plan fits the budget, any that may fit it too may be cheaper.
  fitter.budget = unconstrained
  assert fitter.may_beat(high.peak, trials)
  with counted() as made:
    fitter.budget = int(0.05 * unconstrained)
    assert len(fitter.lowest(trials[0])) < len(Greedy().lowest(graph)) + 1
  assert len(made) < len(Greedy().lowest(graph))
  # Where micro-batches may fit instead, only those that may fit the budget:
  # none at 5%, though the search for the smallest would compile some.
  tried = fitter.compile(high)
  assert any(fitter.may_beat(c.peak, [tried]) for c in Greedy().lowest(graph))
  with counted() as made:
    assert fitter.lowest(tried, only_fitting=True) == [tried]
  assert not made


def test_a_quick_fit_compiles_only_the_block_shaped_plans_that_may_fit():
  """A quick answer (``can_fit``; the fewest micro-batches that fit) at a
  budget no plan meets compiles the plans shaped like per-block policies
  only while the forms compiled so far say one may fit, not each of them."""
  task = models.get("transformer", optimizer=optax.adam(1e-3, eps=1e-3), **SMALL["transformer"])
  args = task.init()
  shaped = Greedy().structured(build_graph(jax.make_jaxpr(task.step)(*args)))
  assert len(shaped) > 2
  step = lambda *a: task.step(*a)  # a step of its own: nothing remembered yet
  fitted = jaxmem.transform(step, budget="5%", micro_batches=1)
  with counted() as made:
    assert not fitted.can_fit(*args)
  # Every form's model peak is over 5x the budget: none may fit, so none is
  # compiled, the first included (no forms of its kind compiled to say so).
  budget = 0.05 * xla_footprint(jax.jit(task.step).lower(*args).compile())
  assert min(s.peak for s in shaped) > 5 * budget
  # The step as written and a plan toward the budget.
  assert len(made) == 2, (len(made), len(shaped))


def test_each_plan_and_compilation_is_logged(args, caplog):
  """A long fit is not silent to whoever asks: each plan and each compilation
  of the fit loop at INFO on the ``jaxmem`` logger (jaxmem-bench shows them);
  a plan an earlier fit of the step compiled is logged as taken."""
  import logging
  step = lambda w, x: _step(w, x)  # a step of its own: nothing compiled before
  with caplog.at_level(logging.INFO, logger="jaxmem"), counted() as made:
    fit = jaxmem.transform(step, budget="60%").fit(*args)
  lines = [r.getMessage() for r in caplog.records if r.name == "jaxmem"]
  planned = [m for m in lines if " planned for " in m]
  compiled = [m for m in lines if m.startswith("jaxmem: compiled a plan of")]
  assert planned and compiled and len(fit.plan)
  assert len(compiled) <= len(made)  # one line per compilation of a plan
  assert all("against the budget" in m for m in compiled)
  # The last compilation's line names the best trial so far: the plan taken.
  assert compiled[-1].endswith(f"best so far: a plan of {len(fit.plan)} decisions at "
                               f"{format_bytes(fit.footprint)} (fits)")
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="jaxmem"):
    jaxmem.transform(step, budget="60%").fit(*args)
  lines = [r.getMessage() for r in caplog.records if r.name == "jaxmem"]
  assert not [m for m in lines if m.startswith("jaxmem: compiled")]
  taken = [m for m in lines if m.startswith("jaxmem: took, as an earlier fit compiled it,")]
  assert len(taken) == len(compiled), (taken, compiled)


class _Analysis:
  """What ``memory_analysis()`` gives: ``temp`` bytes, nothing else."""

  def __init__(self, temp: int):
    self.temp_size_in_bytes, self.argument_size_in_bytes = temp, 0
    self.output_size_in_bytes = self.alias_size_in_bytes = 0


class _Compiled:
  def __init__(self, footprint: int):
    self.footprint = footprint

  def memory_analysis(self):
    return _Analysis(self.footprint)


def test_a_footprint_with_a_part_no_plan_changes_is_met_on_the_second_plan(args):
  # A compiler that keeps half the step's bytes whatever a plan does: each
  # model byte saved saves half a byte. Aiming by the ratio of the last
  # plan's footprint to its model peak lands over the budget round after
  # round; the line through the step as written and the last plan does not.
  graph = build_graph(jax.make_jaxpr(_step)(*args))
  full = unplanned_liveness(graph).peak
  footprint = lambda peak: full // 2 + peak // 2  # noqa: E731
  peaks = []

  def jit(candidate):
    peaks.append(candidate.peak)
    return _Compiled(footprint(candidate.peak))

  budget = footprint(int(0.6 * full))
  fitter = Fitter(graph, Greedy(), budget, footprint(full), 1.0, jit)
  trial, rounds = fitter.tighten()
  assert trial.measured <= budget and rounds == len(peaks) == 2, peaks


def test_a_budget_above_the_footprint_needs_no_plan_and_says_so(args):
  """"150%" reads as it reads: one compilation, and the report says that
  nothing needed planning."""
  step = lambda w, x: _step(w, x)  # a step of its own: nothing compiled for it yet
  fitted = jaxmem.transform(step, budget="150%")
  _, made = compiles(fitted, *args)
  fit = fitted.fit(*args)
  assert made == 1 and not len(fit.plan) and fit.budget > fit.footprint
  assert "the step as written fits the budget, nothing needed planning" in fit.report()


@dataclasses.dataclass
class _Asked(Greedy):
  """The greedy, recording what each call to its ``plan`` asked for."""
  asked: list = dataclasses.field(default_factory=list)

  def plan(self, graph, aim, start=None):
    self.asked.append((len(graph.nodes), len(graph.values), aim, start))
    return super().plan(graph, aim, start)


@pytest.mark.parametrize("target", [None, "t4"])
def test_a_plan_is_made_once_per_transform(args, target):
  # Under the smallest footprint the quick fit fails, the micro-batches do
  # too, and the fit that seeks the smallest footprint asks for the same
  # plans again (of the same graph: for a GPU target, the one with the
  # buffers its compiler gives): each is planned once.
  step = lambda w, x: _step(w, x)
  planner = _Asked()
  with pytest.raises(jaxmem.BudgetError):
    jaxmem.transform(step, budget="10%", planner=planner, target=target).fit(*args)
  assert planner.asked and len(set(planner.asked)) == len(planner.asked), planner.asked


def test_a_budget_the_step_meets_on_a_gpu_target_compiles_it_once_for_the_target(args):
  # The step as written is compiled for the target once, its equations
  # tagged: that compilation measures it, stands for the plan that keeps
  # everything and teaches the memory model the target's buffers.
  from jaxmem.targets import timing_profile
  timing_profile("t4")  # how its compiler schedules host copies: probed once a process
  fitted = jaxmem.transform(lambda w, x: _step(w, x), budget="100%", target="t4")
  with counted() as made:
    fit = fitted.fit(*args)
  assert not len(fit.plan) and fit.target.compile_only
  assert len(made) == 1, made


def test_the_check_of_drawing_per_chunk_is_one_compilation_and_refuses_another_layout(
    monkeypatch):
  """``exact`` checks every width and axis in one compilation (eagerly it
  made one per draw: 46 on this JAX), also from inside a caller's trace,
  and answers False where chunks are not slices of the whole draw."""
  from jaxmem.graph import _random_bits

  _random_bits.exact.cache_clear()
  try:
    with counted() as made:
      got = jax.jit(lambda x: x + _random_bits.exact())(0)
    assert int(got) == 1 and len(made) == 2  # the check's program and the caller's
    right = _random_bits.chunk_bits
    monkeypatch.setattr(_random_bits, "chunk_bits",
                        lambda key, width, shape, axis, start, step, size: right(
                            key, width, shape, axis, start, 1, size))
    _random_bits.exact.cache_clear()
    assert not _random_bits.exact()  # strided chunks read as blocks
  finally:
    _random_bits.exact.cache_clear()
