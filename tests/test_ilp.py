"""The exact planner: the optimum over its choices, found by a 0/1 program."""

import itertools

import numpy as np
from scipy import optimize

import jax
import jax.numpy as jnp
import flax.linen as nn
import pytest

import jaxmem
from jaxmem.cost._evaluate import candidate, model_floor, unplanned_liveness
from jaxmem.cost._xla_buffers import with_buffers
from jaxmem.graph._graph import build_graph
from jaxmem.planners import ILP, Greedy, Hybrid, _greedy, auto, hybrid
from jaxmem.planners import _highs as highs
from jaxmem.planners._blocks import segments
from jaxmem.planners._choices import Choice, Drop, _parent, levels, plan_of
from jaxmem.targets import xla_footprint
from tests.helpers import assert_trees_close, assert_updates_close, xla_budget


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(48)(jax.nn.gelu(nn.Dense(48)(nn.LayerNorm()(x))))


class _Net(nn.Module):
  block: type = _Block  # three of them

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = self.block()(x)
    return jnp.sum(x ** 2)


@pytest.fixture(scope="module")
def blocks():
  net, x = _Net(), jnp.ones((128, 48))
  params = net.init(jax.random.key(0), x)
  graph = build_graph(jax.make_jaxpr(jax.grad(lambda p: net.apply(p, x)))(params))
  return graph, unplanned_liveness(graph).peak


@pytest.fixture(scope="module")
def plain_mlp():
  """A residual tanh MLP written without modules: the program's choices are
  lone rebuilds, whose lowest peak lies above what the greedy reaches."""
  from tests.test_microbatch import _mlp_step
  ws, batch = [jnp.ones((64, 64))] * 12, {"x": jnp.ones((512, 64)), "y": jnp.ones((512, 64))}
  graph = build_graph(jax.make_jaxpr(_mlp_step)(ws, batch))
  return graph, unplanned_liveness(graph).peak


def _enumerate(graph, planner):
  """Every combination of the program's choices, one policy (or none) per
  block, as the planner's plans make them: (plan, model peak, cost)."""
  table = planner.table(graph)
  per_block: dict = {}
  for i, choice in enumerate(table.choices):
    assert isinstance(choice, Choice)
    per_block.setdefault(choice.segment.name, [None]).append(i)
  assert len(per_block) > 3  # the three blocks and blocks nested in them
  found = []
  for combo in itertools.product(*per_block.values()):
    chosen = {i for i in combo if i is not None}
    if any(len(chosen & set(group)) > 1 for group in table.exclusive):
      continue  # a block and one nested in it
    result = candidate(graph, table.plan(graph, sorted(chosen)))
    found.append((result.plan, result.peak, planner.cost(result.schedule)))
  return found


@pytest.mark.parametrize("fraction", [0.95, 0.85, 0.75])
def test_block_program_finds_the_enumerated_optimum(blocks, fraction):
  graph, full = blocks
  planner = ILP(drops=False, refine=False, mip_gap=0.0)
  aim = int(full * fraction)
  fitting = [(cost, peak) for _, peak, cost in _enumerate(graph, planner) if peak <= aim]
  found = planner.plan(graph, aim)
  if not fitting:
    assert not found.fits
    return
  assert found.fits and found.peak <= aim
  assert planner.cost(found.schedule) == pytest.approx(min(fitting)[0], rel=1e-9)
  assert found.details.status == "optimal"
  assert found.details.gap == pytest.approx(0, abs=1e-4)  # HiGHS's default tolerance


@pytest.mark.parametrize("fraction", [0.9, 0.8])  # within the program's reach
def test_a_near_optimal_plan_is_within_its_gap_of_the_optimum(mlp, fraction):
  """A program stopped at ``mip_gap`` reports a bound no higher than the
  optimum, and its plan costs at most ``mip_gap`` over that bound."""
  _, _, graph, base = mlp
  aim = int(base * fraction)
  loose = ILP(mip_gap=0.25, refine=False).plan(graph, aim).details
  exact = ILP(mip_gap=0.0, refine=False).plan(graph, aim).details
  assert exact.status == "optimal" and loose.status in ("optimal", "near-optimal")
  assert loose.bound <= exact.cost * (1 + 1e-6)
  assert loose.cost * (1 - 0.25) <= exact.cost * (1 + 1e-6)
  assert loose.gap <= 0.25 + 1e-9


def test_the_solver_status_names_what_was_proved(monkeypatch):
  """HiGHS's answer read as the report words it: closed to its default
  tolerance, stopped at ``mip_gap``, or stopped by the time limit."""
  import types
  from jaxmem.planners import _ilp
  seen = {}

  def fake(status, gap):
    def milp(cost, **kwargs):
      seen.update(kwargs["options"])
      return types.SimpleNamespace(x=cost * 0, fun=1.0, mip_dual_bound=1.0 - gap,
                                   status=status, mip_gap=gap)
    return milp

  planner = ILP(mip_gap=0.03, time_limit=1.5)
  for status, gap, words in [(0, 0.0, "optimal"), (0, 0.02, "near-optimal"),
                             (1, 0.2, "time limit")]:
    monkeypatch.setattr(_ilp.optimize, "milp", fake(status, gap))
    assert planner._milp(jnp.ones(3), [], 3)[2] == words
  assert seen == {"time_limit": 1.5, "mip_rel_gap": 0.03}


def test_lowest_is_no_higher_than_any_combination(blocks):
  graph, _ = blocks
  planner = ILP(drops=False)
  lowest = min(peak for _, peak, _ in _enumerate(graph, planner))
  assert planner.lowest(graph)[0].peak == lowest


@pytest.mark.parametrize("fraction", [0.7, 0.6, 0.5])
@pytest.mark.parametrize("model", ["blocks", "mlp", "plain_mlp"])
def test_never_costlier_than_the_greedy(request, model, fraction):
  """Also where the aim lies under the program's lowest peak but within the
  greedy's reach (the plain MLP at 70% and 60%): the greedy's own plan is
  weighed against its descent from the program's lowest plan, which
  recomputes 5.7x as much there."""
  fixture = request.getfixturevalue(model)
  graph, base = fixture[-2:]
  aim = int(base * fraction)
  exact, greedy = ILP().plan(graph, aim), Greedy().plan(graph, aim)
  assert exact.fits == greedy.fits or exact.fits
  if greedy.fits:
    assert exact.schedule.recompute_flops <= greedy.schedule.recompute_flops
  else:  # neither fits: the lowest it names is no higher
    assert exact.peak <= greedy.peak


def test_a_budget_no_choice_meets_gives_the_lowest(blocks):
  graph, full = blocks
  found = ILP().plan(graph, 1)
  assert not found.fits and found.details.status == "infeasible"
  assert found.peak == ILP().lowest(graph)[0].peak


def test_fitted_step_matches_jit_within_budget(mlp):
  task, args, _, _ = mlp
  fitted = jaxmem.transform(task.step, budget="60%", planner="ilp")
  assert len(fitted.fit(*args).plan) and "exact planner" in fitted.report(*args)
  assert xla_footprint(fitted.lower(*args).compile()) <= xla_budget(task.step, args, "60%")
  (got_state, got_loss), (want_state, want_loss) = fitted(*args), jax.jit(task.step)(*args)
  assert_trees_close(got_loss, want_loss)
  assert_updates_close(got_state, want_state, args[0])  # the gradients, through Adam


def test_auto_offloads_where_recomputation_does_not_reach(mlp):
  _, _, graph, _ = mlp
  floor = Greedy().lowest(graph)[0].peak
  found = auto("t4").plan(graph, int(floor * 0.95))
  assert found.fits and found.plan.uses_host
  assert found.details.status == "fallback" and found.details.fallback == "hybrid"
  # Without a host link of its own, nothing is offloaded.
  assert auto("orin-nano").fallback is None
  assert auto().fallback is None


def test_auto_offloads_from_the_descent_and_searches_once_from_nothing(mlp, monkeypatch):
  """Under what recomputation reaches, auto's hybrid goes on from the
  recompute greedy's descent from the program's lowest plan: its run toward
  the aim does not start from nothing (on MobileNetV2 for a T4 at 50%, 163
  greedy steps), and its offload greedy climbs no ladder of its own."""
  _, _, graph, _ = mlp
  floor = Greedy().lowest(graph)[0].peak
  runs, climbed = [], []
  greedy, ladder = Greedy._greedy, Greedy._ladder
  monkeypatch.setattr(Greedy, "_greedy", lambda self, g, aim, goal, c, plan: (
      runs.append((goal, len(plan))), greedy(self, g, aim, goal, c, plan))[1])
  monkeypatch.setattr(Greedy, "_ladder", lambda self, *a: (
      climbed.append(self.offload), ladder(self, *a))[1])
  aim = int(floor * 0.95)
  found = auto("t4").plan(graph, aim)
  assert found.fits and found.plan.uses_host
  assert runs and all(n > 0 for goal, n in runs if goal == aim)
  assert climbed == [False]  # the recompute greedy's, once
  climbed.clear()
  assert not auto("t4").plan(graph, int(floor * 0.2)).fits
  assert True not in climbed  # nor where its offloads stall
  auto("t4").lowest(graph)
  assert True not in climbed  # nor for the smallest footprint


def test_auto_climbs_no_ladder_where_offloading_from_the_descent_fits(plain_mlp, monkeypatch):
  """Where the offload greedy reaches the aim from the recompute greedy's
  descent (and the block descents), the recompute greedy's ladder from
  nothing, most of a search, is not climbed. Offloading from the descent
  reaches lower on this MLP than from the ladder's lowest plan alone."""
  graph, _ = plain_mlp
  floor = Greedy().lowest(graph)[0].peak
  climbed = []
  ladder = Greedy._ladder
  monkeypatch.setattr(Greedy, "_ladder", lambda self, *a: (
      climbed.append(self.offload), ladder(self, *a))[1])
  found = auto("t4").plan(graph, int(floor * 0.95))
  assert found.fits and found.plan.uses_host
  assert climbed == []


@pytest.mark.parametrize("fraction", [0.85, 0.75])
def test_gap_of_a_combination_is_its_distance_to_the_enumerated_optimum(blocks, fraction):
  graph, full = blocks
  planner = ILP(drops=False, refine=False)
  combos = _enumerate(graph, planner)
  # The costliest combination within the aim, judged at its own peak.
  plan, peak, cost = max((c for c in combos if c[1] <= int(full * fraction)),
                         key=lambda c: c[2])
  best = min(c for _, p, c in combos if p <= peak)
  gap = planner.gap(graph, candidate(graph, plan, peak))
  base = planner.cost(unplanned_liveness(graph).schedule)
  assert gap.cost == pytest.approx(cost - base, rel=1e-9)
  assert gap.bound == pytest.approx(best - base, rel=1e-4)
  assert gap.gap == pytest.approx((cost - best) / (cost - base), abs=1e-4)
  assert f"save at most {gap.gap:.1%} of its cost" in gap.text()


def test_every_report_states_the_gap(mlp):
  task, args, graph, _ = mlp
  fit = jaxmem.transform(task.step, budget="60%", planner="recompute").fit(*args)
  gap = fit.gap()
  assert gap.cost == pytest.approx(fit.added_flops, rel=1e-9)  # FLOPs: the greedy's cost
  assert gap.bound is not None and gap.status == "optimal"
  assert gap.text() in fit.report()
  assert fit.gap() is gap  # found once
  # Below every combination's reach the gap is unknown, and says so.
  lowest = Greedy().lowest(graph)[0]
  assert ILP(drops=False).gap(graph, lowest).bound is None
  assert "gap unknown" in ILP(drops=False).gap(graph, lowest).text()


@pytest.mark.parametrize("model", ["blocks", "mlp"])
def test_lazy_pricing_finds_what_pricing_every_choice_finds(request, model):
  graph, base = request.getfixturevalue(model)[-2:]
  lazy, eager = ILP(lazy=True, refine=False), ILP(lazy=False, refine=False)
  for fraction in (0.9, 0.7, 0.5):
    got, want = lazy.plan(graph, int(base * fraction)), eager.plan(graph, int(base * fraction))
    assert got.fits == want.fits
    if want.fits and want.details.status == "optimal":
      assert lazy.cost(got.schedule) == pytest.approx(eager.cost(want.schedule), rel=1e-4)
    if got.fits:  # proved against the bound of its program, priced or not
      assert got.details.bound <= lazy.cost(got.schedule) - lazy.table(graph).base_cost + 1e-6
      assert got.details.gap <= lazy.mip_gap
    if fraction == 0.9:  # at most what the solutions took is priced
      assert lazy.table(graph).priced < len(lazy.table(graph).choices) / 2


def test_learned_buffers_price_every_column_up_front(t4_blocks):
  """On buffers learned from XLA:GPU's program estimated columns may free
  less than exact ones (a rebuild may move backward equations), so a bound
  over them proves nothing: every column is priced (or, in a stack of four
  layers or more, moved from an alike layer's: ``tests/test_alike.py``; the
  three blocks here are too few), and the plan is the one pricing every
  column finds; under XLA:CPU's emulated fusion none is priced before a
  solution takes it."""
  planner = ILP(target="t4", refine=False)
  assert planner.table(t4_blocks).exact.all()
  aim = int(unplanned_liveness(t4_blocks).peak * 0.97)  # lower, the workspace does not fit
  got = planner.plan(t4_blocks, aim)
  want = ILP(target="t4", lazy=False, refine=False).plan(t4_blocks, aim)
  assert got.fits and got.details.status == "optimal"
  assert planner.cost(got.schedule) == pytest.approx(planner.cost(want.schedule), rel=1e-9)
  assert ILP(target="t4").table(with_buffers(t4_blocks, None)).priced == 0


def test_a_plan_over_its_aim_prices_its_suspects_first(mlp, monkeypatch):
  """A plan on estimates that the memory model puts over the aim prices
  first only the choices whose guesses differ from their estimates (on the
  test MLP at 70%: one of eleven), and planning ends where pricing every
  choice does."""
  from jaxmem.planners import _pricing
  graph, base = mlp[-2:]
  events = []
  weighed, price = ILP._weighed, _pricing.Table.price

  over = []

  def judged(self, graph, table, chosen, aim, *args):
    found = weighed(self, graph, table, chosen, aim, *args)
    events.append(("judged", len(chosen), found.fits))
    reached = levels(found.memory)
    over[:] = [reached.get(k, 0) > aim for k in table.rows]
    return found

  def priced(self, chosen):
    todo = [i for i in chosen if not self.exact[i]]
    # Differing where the plan judged last went over the aim.
    differing = [i for i in todo if (self.guess[over, i] != self.delta[over, i]).any()]
    events.append(("priced", len(todo), len(differing)))
    return price(self, chosen)

  monkeypatch.setattr(ILP, "_weighed", judged)
  monkeypatch.setattr(_pricing.Table, "price", priced)
  planner = ILP(refine=False)
  got = planner.plan(graph, int(base * 0.7))
  misses = [i for i, e in enumerate(events) if e[0] == "judged" and not e[2]]
  assert misses and events[misses[0] + 1][0] == "priced"
  _, todo, differing = events[misses[0] + 1]
  assert 0 < todo < events[misses[0]][1] and todo == differing
  want = ILP(lazy=False, refine=False).plan(graph, int(base * 0.7))
  assert got.fits and want.fits
  assert planner.cost(got.schedule) == pytest.approx(planner.cost(want.schedule), rel=1e-4)


@pytest.mark.parametrize("target", [None, "t4"])
def test_estimated_columns_are_optimistic(blocks, target):
  """On FLOPs and, for a T4, on predicted time (the planner's cost)."""
  graph = blocks[0]
  table = ILP(lazy=True, target=target).table(graph)
  estimated, cost = table.delta.copy(), table.cost.copy()
  table.price(range(len(table.choices)))
  assert table.exact.all() and table.priced == len(table.choices)
  # Each choice costs no more than it really does and, at every forward
  # equation, frees at least what it really frees (in the backward pass
  # XLA's fusion may free a little more: see jaxmem.planners._pricing).
  assert (cost <= table.cost * (1 + 1e-9) + 1e-6).all()
  # The cost is the rebuild's, priced as the planner prices a plan: most
  # estimates are exact (a rebuild's memory traffic is most of its time
  # on a T4, which its FLOPs leave out).
  assert np.median(cost / table.cost) > 0.99
  forward = [i for i, node in enumerate(table.rows) if node >= 0
             and not graph.nodes[node].backward]
  assert len(forward) > 50
  assert (estimated[forward] <= table.delta[forward] + 1e-6).all()
  assert (estimated < 0).sum() >= (table.delta < 0).sum() * 0.9
  # And close: the buffers a rebuild reads stay in the estimate up to the
  # rebuild (without that, the error is 28% of the columns' bytes here).
  assert np.abs(estimated - table.delta).sum() < 0.2 * np.abs(table.delta).sum()


def test_an_aim_under_the_lowest_reached_fails_at_once(mlp, monkeypatch):
  _, _, graph, base = mlp
  planner = Greedy()
  first = planner.plan(graph, int(base * 0.05))
  assert not first.fits
  calls = []
  monkeypatch.setattr(_greedy, "candidate", lambda *a, **k: calls.append(a))
  monkeypatch.setattr(_greedy, "evaluate", lambda *a, **k: calls.append(a))
  again = planner.plan(graph, int(base * 0.04))
  assert not again.fits and again.plan == first.plan and again.peak == first.peak
  assert calls == []  # no evaluation: the search reached no lower for a higher aim
  monkeypatch.undo()
  # An aim the lowest plan meets is searched as before.
  assert planner.plan(graph, int(first.peak)).fits


def test_an_aim_under_the_programs_reach_takes_the_greedys_descent(blocks, monkeypatch):
  """Under the program's lowest peak the recompute greedy goes on from the
  program's lowest plan, as low as its own whole search reaches, without
  that search (its ladder of runs from nothing)."""
  graph, _ = blocks
  whole = Greedy().plan(graph, 1)  # the greedy's own search, ladder and all
  monkeypatch.setattr(Greedy, "_ladder", lambda *a, **k: pytest.fail("ladder climbed"))
  planner = ILP()
  found = planner.plan(graph, 1)
  assert not found.fits and found.details.status in ("fallback", "infeasible")
  assert found.peak <= min(c.peak for c in planner.lowest(graph))
  assert found.peak <= whole.peak * 1.02


def test_guessed_columns_come_closer_to_the_exact_ones(blocks):
  graph, _ = blocks
  table = ILP(lazy=True).table(graph)
  estimated, guessed = table.delta.copy(), table.guess.copy()
  table.price(range(len(table.choices)))
  assert (table.guess == table.delta).all()  # priced: the guess is the column
  assert np.abs(guessed - table.delta).sum() < 0.75 * np.abs(estimated - table.delta).sum()


def test_a_guessed_transcendental_copy_read_twice_keeps_its_buffer():
  """The memory model gives a rebuilt ``tanh`` that more than one backward
  equation reads a buffer of its own (XLA fuses an expensive value only
  into a sole reader), so the guessed column of rebuilding it frees
  nothing the exact one does not from the first of those reads on (the
  estimate, optimistic, frees it through the last). On the zoo's ViT at
  70% of its footprint, that lets the planner take a plan judged on
  guesses, pricing none of 141 choices."""
  def step(ws, x):
    def loss(ws):
      h = x
      for w, a, b in ws:
        t = jnp.tanh(h @ w)
        h = t * a + t * b  # the gradients of a and b each read t
      return jnp.sum(h ** 2)
    return jax.grad(loss)(ws)

  ws = [(jnp.eye(64) * 0.5, jnp.ones(64), jnp.ones(64)) for _ in range(4)]
  graph = build_graph(jax.make_jaxpr(step)(ws, jnp.ones((256, 64))))
  table = ILP().table(graph)
  tanh = lambda v: graph.nodes[graph.values[v].producer].prim.name == "tanh"  # noqa: E731
  checked = 0
  for i, choice in enumerate(table.choices):
    # A tanh rebuilt with the one value computed from it alone.
    if not (isinstance(choice, Drop) and len(choice.values) == 2 and tanh(choice.values[0])):
      continue
    guessed = table.guess[:, i].copy()
    table.price([i])
    reads = [n.index for n in graph.nodes if n.backward and choice.values[0] in n.ins]
    assert len(reads) > 1
    after = [r for r, node in enumerate(table.rows) if node >= min(reads)]
    assert (guessed[after] == table.delta[after, i]).all()
    checked += 1
  assert checked >= 2


def test_a_guessed_column_holds_the_saved_values_its_rebuild_reads():
  """Under ``dots_saveable`` an attention block keeps its scores (a dot's
  output the step as written frees in the forward pass) to rebuild the
  softmax from; the softmax's shifted scores, computed inside their
  readers, read them too. The guessed column holds the scores from their
  last forward read on, so in the forward pass it is the exact one."""
  class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
      q, k, v = (nn.Dense(32)(x) for _ in range(3))
      p = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k), axis=-1)
      return x + nn.Dense(32)(jnp.einsum("bqk,bkd->bqd", p, v))

  net, x = _Net(block=Attention), jnp.ones((8, 64, 32))
  params = net.init(jax.random.key(0), x)
  graph = build_graph(jax.make_jaxpr(jax.grad(lambda p: net.apply(p, x)))(params))
  table = ILP().table(graph)
  forward = [r for r, node in enumerate(table.rows)
             if node >= 0 and not graph.nodes[node].backward]
  saving = [i for i, c in enumerate(table.choices)
            if isinstance(c, Choice) and c.keep == "dots_saveable"]
  assert len(saving) == 3
  for i in saving:
    guessed = table.guess[:, i].copy()
    table.price([i])
    assert (guessed[forward] == table.delta[forward, i]).all()


@pytest.mark.parametrize("fraction", [0.9, 0.8])
def test_a_plan_taken_on_guesses_prices_nothing_and_is_within_its_gap(blocks, fraction):
  graph, base = blocks
  planner, eager = ILP(refine=False), ILP(lazy=False, refine=False)
  got = planner.plan(graph, int(base * fraction))
  assert got.fits and planner.table(graph).priced == 0
  cost = planner.cost(got.schedule) - planner.table(graph).base_cost
  assert got.details.bound <= cost + 1e-6 and got.details.gap <= planner.mip_gap
  best = eager.plan(graph, int(base * fraction))
  assert cost <= (eager.cost(best.schedule) - eager.table(graph).base_cost) * (1 + planner.mip_gap)


def test_binding_rows_keep_the_programs_solutions():
  """Rows merged or dropped as implied by others leave the 0/1 points that
  meet every row unchanged (enumerated), and drop the dominated ones."""
  rng = np.random.default_rng(0)
  rows = rng.integers(-3, 4, size=(60, 8)).astype(float)
  rows = np.vstack([rows, rows[:5], rows[:5] - 1])  # repeated and dominated rows
  base = rng.integers(0, 10, size=len(rows)).astype(float)
  kept, top = highs.binding_rows(rows, base)
  assert len(kept) < len(np.unique(rows, axis=0))
  for x in itertools.product((0, 1), repeat=8):
    for limit in (4.0, 9.0):
      assert (base + rows @ x <= limit).all() == (top + kept @ x <= limit).all()


@pytest.mark.parametrize("first", [highs.FIRST_ROWS, 1])
def test_rows_brought_in_lazily_give_the_whole_programs_optimum(monkeypatch, first):
  """A program whose memory rows come in as its solutions break them
  reaches the optimum of the program over every row (to the gap of 0
  asked), meets every row, and bounds that optimum; from one row it takes
  several rounds. A program without a solution is reported so."""
  monkeypatch.setattr(highs, "FIRST_ROWS", first)
  solves = []
  solve = highs.solve
  monkeypatch.setattr(highs, "solve", lambda *a: solves.append(a) or solve(*a))
  for seed in range(4):
    rng = np.random.default_rng(seed)
    n = 24
    frees = rng.uniform(0, 1, size=(3 * highs.LAZY_FROM, n))  # what each choice frees per row
    need = frees.sum(axis=1) * rng.uniform(0.2, 0.5, size=len(frees))
    cost = rng.uniform(1, 2, size=n)
    one = [optimize.LinearConstraint(np.eye(n)[:n // 2].reshape(2, -1, n).sum(axis=1), 0, 1)]
    whole, _, _ = highs.solve(cost, [*one, optimize.LinearConstraint(-frees, -np.inf, -need)],
                              n, 10.0, 0.0)
    solves.clear()
    x, bound, status = highs.solve_rows(cost, one, -frees, -need, n, 10.0, 0.0)
    assert status == "optimal" and (-frees @ x <= -need + 1e-6).all()
    assert cost @ x == pytest.approx(cost @ whole, rel=1e-9)
    assert bound <= cost @ whole + 1e-9
    assert len(solves) >= (2 if first == 1 else 1)
    # More than every choice together frees: no solution, and it says so.
    assert highs.solve_rows(cost, one, -frees, -2 * frees.sum(axis=1), n, 10.0, 0.0) == (
        None, None, "infeasible")


def test_exclusive_groups_forbid_exactly_the_clashing_pairs(blocks):
  """Clique rows forbid the pairs that a block's policies, nested blocks
  and a rebuild group's clashing block choices make, and no other pair."""
  graph, _ = blocks
  table = ILP().table(graph)
  choices = table.choices
  decided = {i: plan_of(graph, [c]).as_dict() for i, c in enumerate(choices)
             if isinstance(c, Choice)}
  segs = segments(graph)
  names = {s.name for s in segs if s.depth == 2}
  pairs = set()
  for group in table.exclusive:
    pairs |= {frozenset(p) for p in itertools.combinations(group, 2)}
  for i, j in itertools.combinations(range(len(choices)), 2):
    a, b = choices[i], choices[j]
    if isinstance(a, Drop) and isinstance(b, Drop):
      clash = False
    elif isinstance(a, Drop) or isinstance(b, Drop):
      drop, k = (a, j) if isinstance(a, Drop) else (b, i)
      clash = any(v in decided[k] for v in drop.values)
    else:
      clash = a.segment.name == b.segment.name or any(
          _parent(x.segment, names) == y.segment.name for x, y in ((a, b), (b, a)))
    assert (frozenset((i, j)) in pairs) == clash, (a, b)


@pytest.fixture(scope="module")
def t4_blocks(blocks):
  """The blocks' graph with the buffers XLA:GPU gives it for a T4: every
  matmul holds cuBLAS's workspace while it runs, which no plan frees."""
  from jaxmem.fit._traced import modelled
  from jaxmem.targets import resolve
  return modelled(blocks[0], resolve("t4", ()))


def test_no_plan_is_under_the_model_floor(blocks, t4_blocks):
  """``model_floor`` bounds every plan's model peak from below: the lowest
  plans of the exact planner, the greedy and the hybrid, on XLA:CPU's
  emulated fusion and on a T4's learned buffers (where a matmul's
  workspace is most of it)."""
  for graph in (blocks[0], t4_blocks):
    floor = model_floor(graph)
    lowest = [*auto("t4").lowest(graph), *hybrid("t4").lowest(graph), *Greedy().lowest(graph)]
    assert min(c.peak for c in lowest) >= floor
  assert model_floor(t4_blocks) > 2 * model_floor(blocks[0])  # the workspace


def test_an_aim_under_the_model_floor_is_not_searched_for(t4_blocks, monkeypatch):
  """Under the floor no plan fits: the exact planner's fallback (the
  hybrid) does not search toward the aim, nor does the hybrid itself;
  each answers with a lowest plan. At the floor the fallback searches."""
  graph = t4_blocks
  floor = model_floor(graph)
  searched, plan = [], Hybrid.plan

  def recorded(self, g, aim, start=None):
    searched.append(aim)
    return plan(self, g, aim, start)
  monkeypatch.setattr(Hybrid, "plan", recorded)
  found = auto("t4").plan(graph, floor - 1)
  assert not found.fits and found.peak >= floor
  assert found.details.status in ("fallback", "infeasible") and searched == []
  monkeypatch.setattr(Greedy, "plan", lambda *a, **k: pytest.fail("a greedy searched"))
  lowest = hybrid("t4").plan(graph, floor - 1)
  assert not lowest.fits and lowest.peak == hybrid("t4").lowest(graph)[0].peak
  monkeypatch.undo()
  searched.clear()
  monkeypatch.setattr(Hybrid, "plan", recorded)
  auto("t4").plan(graph, floor)
  assert searched == [floor]


def test_search_state_is_kept_per_graph(blocks, plain_mlp, monkeypatch):
  """A fit plans several graphs of one step (whole, in micro-batches, with
  its optimizer state on the host) and comes back to them: what the exact
  planner found for a graph (its program's table, its lowest plans, its
  greedy's runs) outlives planning another one."""
  from jaxmem.planners import _pricing
  built, runs = [], []
  build, greedy = _pricing.build, Greedy._greedy
  monkeypatch.setattr(_pricing, "build", lambda graph, *a: (built.append(graph),
                                                             build(graph, *a))[1])
  monkeypatch.setattr(Greedy, "_greedy", lambda self, graph, *a: (runs.append(graph),
                                                                  greedy(self, graph, *a))[1])
  planner = ILP()
  first = planner.lowest(blocks[0])
  planner.lowest(plain_mlp[0])
  made = len(runs)
  again = planner.lowest(blocks[0])
  assert built == [blocks[0], plain_mlp[0]] and len(runs) == made
  assert [c.plan for c in again] == [c.plan for c in first]
