"""Choices alike: columns priced in one layer of a stack and moved to the
others, on the memory model learned for a GPU target."""

import numpy as np

import jax
import jax.numpy as jnp
import flax.linen as nn
import pytest

from jaxmem.cost._evaluate import unplanned_liveness
from jaxmem.graph._graph import build_graph
from jaxmem.planners import ILP
from jaxmem.planners import _alike as alike
from jaxmem.planners._choices import Choice
from jaxmem.targets import get_profile


class _Sub(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(32)(jnp.tanh(nn.Dense(32)(nn.LayerNorm()(x))))


class _Layer(nn.Module):
  """Two sublayers built alike in different places of the layer: their
  choices are not moved to one another."""
  @nn.compact
  def __call__(self, x):
    return _Sub()(_Sub()(x))


class _Stack(nn.Module):
  depth: int = 8

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32)(x)  # a stem, so the first layer's input has a gradient too
    for _ in range(self.depth):
      x = _Layer()(x)
    return jnp.sum(x ** 2)


@pytest.fixture(scope="module")
def stack():
  net, x = _Stack(), jnp.ones((256, 32))
  params = net.init(jax.random.key(0), x)
  return build_graph(jax.make_jaxpr(jax.grad(lambda p: net.apply(p, x)))(params))


@pytest.fixture(scope="module")
def t4_stack(stack):
  from jaxmem.fit._traced import modelled
  from jaxmem.targets import resolve
  return modelled(stack, resolve("t4", ()))


def _home(graph, choice):
  return alike._home(graph, choice)


def test_stacks_are_repeats_of_one_layer(stack):
  """Each stack holds one choice per layer, in the order the layers run;
  its layers' paths differ only in the layer's number, so the two
  sublayers of a layer never share a stack."""
  table = ILP(lazy=False).table(stack)
  stacks = alike.groups(stack, table.choices)
  assert len(stacks) >= 10
  for members in stacks:
    homes = [_home(stack, table.choices[i]) for i in members]
    assert len(set(homes)) == len(homes) >= 3
    names = [h.split("/") for h in homes]
    assert all(n[:1] + n[2:] == names[0][:1] + names[0][2:] for n in names)
    assert [n[1] for n in names] == [f"_Layer_{k}" for k in
                                     sorted(int(n[1].rsplit("_", 1)[1]) for n in names)]
  subs = {h.split("/", 2)[-1] for m in stacks for h in
          (_home(stack, table.choices[i]) for i in m) if h.count("/") == 2}
  assert subs == {"_Sub_0", "_Sub_1"}  # both sublayers have stacks, apart


def test_a_moved_column_is_near_the_priced_one(t4_stack):
  """On the buffers learned for a T4, a column moved from the second layer
  lies within 1% of the largest column of the one pricing finds at every
  equation, and its cost within 1% or one kernel's launch; choices whose
  rebuild reaches back through earlier layers (a residual stream XLA
  computes inside its readers) are priced, not moved."""
  moving = ILP(target="t4").table(t4_stack)
  eager = ILP(target="t4", lazy=False).table(t4_stack)
  assert eager.exact.all() and not eager.moved.any()
  at = {c: i for i, c in enumerate(eager.choices)}
  largest = np.abs(eager.delta).max()
  t4 = get_profile("t4")
  launch = t4.kernel_latency * t4.flops  # a rebuild's kernel, fused apart in one layer
  moved = np.flatnonzero(moving.moved)
  assert len(moved) >= 10
  for i in moved:
    j = at[moving.choices[i]]
    assert np.abs(moving.delta[:, i] - eager.delta[:, j]).max() <= 0.01 * largest
    assert moving.cost[i] == pytest.approx(eager.cost[j], rel=0.01, abs=launch)
  stacks = alike.groups(t4_stack, moving.choices)
  inner = {i for members in stacks for i in members[2:-2]}
  assert len(inner) > len(moved)  # some rebuilds reach outside their layer


def test_a_plan_over_moved_columns_costs_what_pricing_every_column_finds(t4_stack):
  """On the buffers learned for a T4, the columns of the third layer on are
  moved where their rebuilds stay in their layer, not priced; plans at 90%,
  70% and 50% fit where those of the program with every column priced do
  and cost at most 1% more, and the report says how many columns the bound
  rests on unpriced."""
  moving, eager = ILP(target="t4"), ILP(target="t4", lazy=False)
  table = moving.table(t4_stack)
  assert (table.exact | table.moved).all()
  assert table.moved.sum() >= 10 and table.priced == len(table.choices) - table.moved.sum()
  base = unplanned_liveness(t4_stack).peak
  for fraction in (0.9, 0.7, 0.5):
    got, want = moving.plan(t4_stack, int(base * fraction)), eager.plan(t4_stack, int(base * fraction))
    assert got.fits == want.fits
    if want.fits:
      assert moving.cost(got.schedule) <= eager.cost(want.schedule) * 1.01
    if got.details.moved:
      assert f"bound over {got.details.moved} columns moved" in got.details.table()
  chosen = [i for i, c in enumerate(table.choices) if isinstance(c, Choice)]
  assert not table.moved[chosen].all()  # the first two layers are priced


def test_pricing_a_moved_column_makes_it_exact(t4_stack):
  """A moved column a solution takes is priced: it is exact after, and
  moved no longer."""
  table = ILP(target="t4").table(t4_stack)
  i = int(np.flatnonzero(table.moved)[0])
  assert table.price([i]) == 1
  assert table.exact[i] and not table.moved[i]
  assert (table.guess[:, i] == table.delta[:, i]).all()


def test_the_benchmark_compares_moved_columns_with_every_column_priced(tmp_path):
  """benchmarks/alike.py on a small GPT-2 of five blocks: a table row that
  counts moved columns and measures them against priced ones (a
  second-to-last block moved from the second is off by about the whole
  largest column, as its next layer feeds the head), and a row for its one
  budget."""
  import json
  import sys
  root = __file__.rsplit("/tests/", 1)[0]
  sys.path.insert(0, root)
  from benchmarks import alike as bench
  bench.main(["--models", "gpt2", "--set", "depth=5", "dim=32", "seq=32", "vocab=64",
              "batch=2", "--budgets", "1", "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "results.json").read_text())["rows"]
  (table,) = [r for r in rows if r["kind"] == "table"]
  assert 1 <= table["moved"] < table["choices"] and table["unfreeing"] < table["moved"]
  assert table["column_share"] <= 0.01 and table["cost_share"] <= 0.01
  plans = [r for r in rows if r["kind"] == "plans"]
  assert [round(r["fraction"], 2) for r in plans] == [0.95]
  assert plans[0]["fits"] and plans[0]["added_cost_ratio"] <= 1.01
  assert "| gpt2 | 95% |" in (tmp_path / "results.md").read_text()
