"""jaxmem-bench: a small run end to end, its table, JSON and plots."""

import json

import pytest

from jaxmem import bench
from jaxmem._benchmark import Method
from jaxmem.planners import ABLATIONS, NAMED, PLANNERS

TINY = ["--model", "mlp", "--config", "depth=4", "width=16", "batch=32", "features=8"]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
  """Runs each test in its own folder: the CLI writes plots there by default."""
  monkeypatch.chdir(tmp_path)


def test_main_job_writes_plots_by_default(tmp_path):
  pytest.importorskip("matplotlib")
  bench.main(["--model", "mlp", "--config", "depth=6", "width=32", "batch=256", "features=16",
              "--budgets", "70%", "--repeats", "1", "--quiet",
              "--methods", "unconstrained", "jaxmem:auto"])  # the default planner
  plots = tmp_path / "jaxmem-bench-plots"
  assert (plots / "mlp-time-vs-footprint.png").stat().st_size > 0
  assert (plots / "mlp-jaxmem-auto-70pct-timeline.png").stat().st_size > 0


def test_stacked_timeline_adds_up_to_the_model_timeline():
  b = bench.Bench("mlp", dict(depth=6, width=32, batch=256, features=16), repeats=1)
  row = b.measure(Method.parse("jaxmem:recompute"), "70%", int(b.unconstrained * 0.7))
  assert row.fits
  assert row.stacked["recomputed"] and max(row.stacked["recomputed"]) > 0
  assert [sum(kind[i] for kind in row.stacked.values())
          for i in range(len(row.timeline))] == row.timeline
  assert row.written and max(row.written) > max(row.timeline)


def test_cli_writes_table_json_and_plots(tmp_path, capsys):
  out = tmp_path / "run.json"
  bench.main(TINY + ["--budgets", "100%", "30%", "--repeats", "1", "--quiet",
                     "--methods", "unconstrained", "jaxmem:recompute",
                     "--json", str(out), "--plot", str(tmp_path / "plots")])
  text = capsys.readouterr().out
  assert "unconstrained" in text and "jaxmem:recompute" in text
  result = json.loads(out.read_text())
  for key in ("model", "config", "unconstrained_bytes", "unconstrained_step_ms", "rows",
              "command", "date", "machine", "versions"):
    assert key in result, key
  rows = {(r["method"], r["budget"]): r for r in result["rows"]}
  assert len(rows) == 4
  plain = rows["unconstrained", "100%"]
  assert plain["fits"] and plain["xla_bytes"] == result["unconstrained_bytes"]
  assert plain["time_ratio"] == pytest.approx(1.0)
  assert not rows["unconstrained", "30%"]["fits"]
  fitted = rows["jaxmem:recompute", "100%"]
  assert fitted["fits"] and fitted["xla_bytes"] <= fitted["budget_bytes"]
  assert fitted["time_ratio"] > 0 and fitted["flops_ratio"] >= 1.0
  # 30% is below what recomputation reaches: not fitting, smallest shown.
  tight = rows["jaxmem:recompute", "30%"]
  assert not tight["fits"] and tight["xla_bytes"] > tight["budget_bytes"]
  assert (tmp_path / "plots" / "mlp-time-vs-footprint.png").stat().st_size > 0
  assert (tmp_path / "plots" / "mlp-jaxmem-recompute-100pct-timeline.png").exists()


def test_max_batch_search_matches_footprints():
  b = bench.Bench("mlp", dict(depth=4, width=16, batch=32, features=8), repeats=1)
  method = Method("unconstrained")
  best = b.max_batch(method, b.unconstrained * 2)
  assert best >= 32
  assert b.fits_at(method, b.unconstrained * 2, best)
  assert not b.fits_at(method, b.unconstrained * 2, best + 1)


def test_methods_parse_and_refuse_unknown_names():
  assert Method.parse("remat:nothing_saveable").name == "remat:nothing_saveable"
  with pytest.raises(ValueError, match="unknown method 'remat:everything'"):
    Method.parse("remat:everything")
  assert [m.name for m in bench.default_methods("mlp")] == ["unconstrained"] + [
      f"jaxmem:{p}" for p in sorted(PLANNERS) if p not in ABLATIONS | NAMED]
  assert Method.parse("jaxmem:lgm-whole").option == "lgm-whole"  # ablations by name
  assert "remat" in [m.kind for m in bench.default_methods("vit")]


def test_at_baselines_runs_jaxmem_at_each_baseline_footprint(tmp_path):
  out = tmp_path / "run.json"
  bench.main(["--model", "resnet_deep", "--config", "depth=3", "width=4", "size=16",
              "batch=8", "--budgets", "100%", "--repeats", "1", "--quiet",
              "--methods", "unconstrained", "remat:nothing_saveable", "jaxmem:recompute",
              "--at-baselines", "--json", str(out)])
  rows = {(r["method"], r["budget"]): r for r in json.loads(out.read_text())["rows"]}
  remat = rows["remat:nothing_saveable", "100%"]
  twin = rows["jaxmem:recompute", "remat:nothing_saveable"]
  assert twin["budget_bytes"] == remat["xla_bytes"] < rows["unconstrained", "100%"]["xla_bytes"]
  # Fitting or not, the row is consistent with XLA's own footprint.
  assert twin["fits"] == (twin["xla_bytes"] <= twin["budget_bytes"])
  if twin["fits"]:
    assert twin["time_ratio"] > 0


def test_target_profile_plans_and_predicts(tmp_path):
  out = tmp_path / "run.json"
  bench.main(TINY + ["--budgets", "95%", "--repeats", "1", "--quiet", "--target", "rtx3060",
                     "--methods", "unconstrained", "jaxmem:hybrid", "--json", str(out)])
  result = json.loads(out.read_text())
  assert result["target_profile"]["name"] == "rtx3060"
  row = {r["method"]: r for r in result["rows"]}["jaxmem:hybrid"]
  assert row["fits"] and row["xla_bytes"] <= row["budget_bytes"]
  assert row["predicted_ms"] > 0 and row["predicted_ratio"] >= 1.0
  with pytest.raises(SystemExit, match="unknown --target 'k80'"):
    bench.main(TINY + ["--target", "k80", "--quiet"])


def test_table_leaves_out_empty_columns_and_marks_modelled_footprints():
  from jaxmem._benchmark import Row
  plain = Row("unconstrained", "70%", 70, False, 100, time_ratio=1.0, flops_ratio=1.0)
  hosted = Row("jaxmem:hybrid", "70%", 70, True, 60, model_bytes=60, time_ratio=1.1,
               flops_ratio=1.0, planning_s=2.0, footprint_modelled=True)
  text = bench.table([plain, hosted])
  header = text.splitlines()[0]
  assert "pred x" not in header and "max batch" not in header  # no row has one
  assert "time x" in header and "model" in header
  # The offload row's footprint is the model's: it shows under "model" only.
  cells = text.splitlines()[3].split()
  assert "n/a*" in cells and cells.count("60") == 1 and "100" not in cells
  assert "pred x" in bench.table([Row("jaxmem:ilp", "70%", 70, True, 60,
                                      predicted_ratio=1.2)]).splitlines()[0]


def test_time_ratios_are_timed_in_pairs():
  from jaxmem._benchmark import paired_seconds
  calls = []
  base = lambda: calls.append("base")
  step = lambda: calls.append("step")
  seconds, ratio = paired_seconds(base, (), step, (), repeats=3)
  # A warm-up of each, then base before step in every pair.
  assert calls == ["base", "step"] + ["base", "step"] * 3
  assert seconds > 0 and ratio > 0
