"""benchmarks/planning.py on a small model: its rows say what they claim
(the script's own runs plan zoo models at CPU sizes: a benchmark, not a
test)."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import planning  # noqa: E402


def test_rows_count_compilations_and_cost_plans_against_the_exact_planner(tmp_path):
  planning.main(["--models", "mlp", "--set", "depth=6", "width=64", "batch=256",
                 "--budgets", "100%", "--sweep", "3", "--jit-runs", "1", "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "results.json").read_text())["rows"]
  (fit,) = [r for r in rows if r["kind"] == "transform"]
  assert fit["fits"] and fit["compiles"] == 1  # the step as written: jax.jit's one
  sweeps = {r["planner"]: r for r in rows if r["kind"] == "sweep"}
  assert set(sweeps) == {"ilp", "recompute"}
  assert sweeps["ilp"]["cost_over_ilp_median"] == 1.0
  # Each fitting plan's gap is known (it reaches within the program's
  # choices' peak) and the exact planner's plans are no costlier than its
  # bound (refined, they may be cheaper).
  assert sweeps["recompute"]["gap_known"] >= 1
  assert sweeps["ilp"]["gap_max"] <= 1e-3
  per_budget = sweeps["ilp"]["per_budget"]
  assert len(per_budget) == 3 and sum(b["fits"] for b in per_budget) == sweeps["ilp"]["fits"]
  assert max(b["seconds"] for b in per_budget) == sweeps["ilp"]["slowest_s"]
  assert "| mlp | ilp |" in (tmp_path / "results.md").read_text()


def test_a_target_plans_on_its_compilers_program(tmp_path):
  """With ``--target``, the transform compiles for that GPU and the sweep
  plans for it, its plans costed by predicted time there."""
  planning.main(["--models", "mlp", "--set", "depth=6", "width=128", "batch=512",
                 "--budgets", "100%", "--sweep", "2", "--jit-runs", "1", "--target", "t4",
                 "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "results.json").read_text())["rows"]
  (fit,) = [r for r in rows if r["kind"] == "transform"]
  # The step's, and once a process the probe of how XLA:GPU schedules
  # host copies.
  assert fit["fits"] and fit["compiles"] == 2
  sweeps = {r["planner"]: r for r in rows if r["kind"] == "sweep"}
  assert sweeps["ilp"]["cost_over_ilp_median"] == 1.0
  assert "XLA:GPU for a t4 target" in (tmp_path / "results.md").read_text()
