"""benchmarks/compile_options.py on a small ResNet for a T4: a row for the
plain options, the fit loop's, and the fit loop's less each option it adds,
all with one footprint (the script's own runs time the zoo's steps: a
benchmark, not a test)."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import compile_options  # noqa: E402


def test_every_variant_compiles_to_the_plain_options_footprint(tmp_path):
  compile_options.main(["--models", "resnet18", "--cpu-sizes", "--set", "width=8",
                        "stages=[1, 1]", "size=16", "batch=4", "--target", "t4",
                        "--repeats", "1", "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "results.json").read_text())["rows"]
  assert [r["variant"] for r in rows] == [
      "plain", "measuring", "measuring less xla_backend_optimization_level",
      "measuring less xla_gpu_disable_gpuasm_optimizations"]
  assert {tuple(r["footprints"]) for r in rows} == {tuple(rows[0]["footprints"])}
  assert len(rows[0]["footprints"]) == 1 and rows[0]["ratio"] == 1.0
  assert "| resnet18 | t4 | measuring |" in (tmp_path / "results.md").read_text()
