"""The clock against step times measured on a real GPU.

Reads the records of a GPU check run (``rows.jsonl`` under ``--runs``, made
by ``benchmarks/gpu.py`` on a GPU), and for each step that is not a jaxmem
plan (the unmodified step, the per-block ``nn.remat`` policies, XLA's own
rematerialization at the recorded memory-limit percentage) compiles the
same program here for that GPU's target (a compile-only device; no GPU
needed), prices it with the clock (``_xla_clock``) and sets the prediction
beside the measured median step time. A configuration measured in several
runs takes the median of the runs, and the spread between runs is shown:
it bounds how closely any clock can agree.

Two profiles price each program: the target's preset (datasheet figures)
and the preset with the matmul throughput and memory bandwidth
``jaxmem.calibrate()`` measured on the GPU (the median over the run's
calibrations that timed an elementwise op of 256 MiB or more; smaller ones
time the dispatch). The link stays the datasheet's: the calibrations timed
copies of at most 16 MiB from Python, whose 0.2-0.4 ms per copy is the
dispatch's, not the link's.

  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/clock_accuracy.py \\
      --runs benchmarks/results/gpu-check-h200 --target h200 \\
      --out benchmarks/results/clock-vs-h200
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxmem.cost._xla_clock import program_time  # noqa: E402
from jaxmem.targets import get_profile  # noqa: E402

from benchmarks._results import write  # noqa: E402
from benchmarks._steps import compile_for, task as zoo_task  # noqa: E402

# Calibrations that read the memory's bandwidth, not the dispatch's.
_LEAST_ELEMENTWISE = 2**28


def measured_steps(folders: list[str]) -> tuple[dict, list[dict]]:
  """(model, config, method, slop) -> step times measured, and the profile
  figures of the runs' calibrations, over the runs under ``folders``."""
  steps, calibrated = collections.defaultdict(list), []
  paths = [p for folder in folders
           for p in sorted(glob.glob(os.path.join(folder, "**", "rows.jsonl"), recursive=True))]
  for path in paths:
    for line in open(path):
      row = json.loads(line)
      if row.get("kind") == "calibrate" and row.get("status") == "ok":
        calibrated.append(row["profile"])
      if (row.get("kind") != "measure" or row.get("status") != "ok"
          or not row.get("step_ms") or row["method"].startswith("jaxmem")):
        continue
      key = (row["model"], json.dumps(row["config"], sort_keys=True), row["method"],
             row.get("xla_slop_percent"))
      steps[key].append(row["step_ms"])
  return steps, calibrated


def calibrated_profile(preset, figures: list[dict]):
  """``preset`` with the median matmul throughput and memory bandwidth of
  the calibrations that read the memory (see the module docstring); None
  without one."""
  read = [f for f in figures
          if any(int(n) >= _LEAST_ELEMENTWISE
                 for n in re.findall(r"(\d+)-byte elementwise", f.get("source", "")))]
  if not read:
    return None
  flops = statistics.median(f["flops"] for f in read)
  return dataclasses.replace(
      preset, name=f"{preset.name}-calibrated", flops=flops, matmul_flops=flops,
      memory_bandwidth=statistics.median(f["memory_bandwidth"] for f in read))


def compile_text(model: str, config: dict, method: str, slop, target: str) -> tuple[str, float]:
  """The optimized HLO of one measured step compiled for ``target``."""
  remat = method.split(":", 1)[1] if method.startswith("remat:") else None
  task = zoo_task(model, config, remat)
  options = {"xla_gpu_memory_limit_slop_factor": slop} if method == "xla:remat" else {}
  compiled, _, seconds = compile_for(task.step, jax.eval_shape(task.init), target, **options)
  return compiled.as_text(), seconds


def cached_text(cache: str | None, model: str, config: str, method: str, slop,
                target: str) -> tuple[str, float]:
  """:func:`compile_text`, kept under ``cache`` (a folder) where given, so
  that pricing again does not compile again."""
  path = cache and os.path.join(cache, re.sub(r"[^\w.-]", "_", "-".join(
      map(str, (model, method, slop, target, config)))) + ".hlo.gz")
  if path and os.path.exists(path):
    with gzip.open(path, "rt") as f:
      return f.read(), 0.0
  text, seconds = compile_text(model, json.loads(config), method, slop, target)
  if path:
    os.makedirs(cache, exist_ok=True)
    with gzip.open(path, "wt") as f:
      f.write(text)
  return text, seconds


def measure(steps: dict, profiles: dict, target: str, cache: str | None = None) -> list[dict]:
  rows = []
  for (model, config, method, slop), times in sorted(steps.items()):
    text, seconds = cached_text(cache, model, config, method, slop, target)
    row = {"model": model, "config": json.loads(config), "method": method, "slop": slop,
               "measured_ms": statistics.median(times), "runs_ms": times,
               "compile_s": seconds}
    for label, profile in profiles.items():
      timing = program_time(text, profile)
      row[label] = {"ms": timing.seconds * 1e3, "kernels": timing.count,
                          "link_ms": timing.link * 1e3,
                          "over_measured": timing.seconds * 1e3 / row["measured_ms"]}
    rows.append(row)
    print(f"{model:12s} {method:42s} measured {row['measured_ms']:6.1f} ms  " + "  ".join(
      f"{label} {row[label]['ms']:6.1f} ({row[label]['over_measured']:.2f})"
      for label in profiles), flush=True)
  return rows


def _ranked_pairs(rows: list[dict], label: str) -> tuple[int, int]:
  """(pairs ordered as measured, pairs) over each model's steps whose
  measured times differ by more than 10%."""
  agree = total = 0
  for a in rows:
    for b in rows:
      if (a["model"] != b["model"] or a["measured_ms"] >= b["measured_ms"]
          or b["measured_ms"] < 1.1 * a["measured_ms"]):
        continue
      total += 1
      agree += a[label]["ms"] < b[label]["ms"]
  return agree, total


def render(rows: list[dict], labels: list[str]) -> str:
  head = "| model | step | measured ms (runs) | " + " | ".join(
    f"{label}: ms, x measured" for label in labels) + " |"
  lines = [head, "|" + "---|" * (3 + len(labels))]
  for row in rows:
    step = row["method"] + (f" ({row['slop']}%)" if row["slop"] is not None else "")
    runs = ", ".join(f"{t:.1f}" for t in row["runs_ms"])
    cells = [f"{row[label]['ms']:.1f}, **{row[label]['over_measured']:.2f}**"
                 for label in labels]
    lines.append(f"| {row['model']} | {step} | {row['measured_ms']:.1f} ({runs}) | "
                     + " | ".join(cells) + " |")
  lines.append("")
  for label in labels:
    ratios = [row[label]["over_measured"] for row in rows]
    within = sum(abs(r - 1) <= 0.15 for r in ratios)
    agree, total = _ranked_pairs(rows, label)
    lines.append(f"- {label}: within 15% of the measured time on {within} of {len(ratios)} "
                     f"steps (median ratio {statistics.median(ratios):.2f}); ordered as "
                     f"measured in {agree} of {total} pairs of one model's steps whose "
                     "measured times differ by more than 10%.")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", required=True, nargs="+",
                      help="GPU check results folders (every run under each)")
  parser.add_argument("--target", required=True, help="the preset of the GPU it ran on")
  parser.add_argument("--models", nargs="*", default=None)
  parser.add_argument("--out", default=None, help="folder for results.md and results.json")
  parser.add_argument("--cache", default=None,
                      help="folder keeping the compiled programs, to price them again")
  opts = parser.parse_args(argv)
  steps, figures = measured_steps(opts.runs)
  if opts.models:
    steps = {k: v for k, v in steps.items() if k[0] in opts.models}
  preset = get_profile(opts.target)
  profiles = {"preset": preset}
  calibrated = calibrated_profile(preset, figures)
  if calibrated is not None:
    profiles["calibrated"] = calibrated
  rows = measure(steps, profiles, opts.target, opts.cache)
  table = render(rows, list(profiles))
  print(table)
  if opts.out:
    profiles = {k: dataclasses.asdict(dataclasses.replace(p, description=None))
                for k, p in profiles.items()}
    write(opts.out, "benchmarks/clock_accuracy.py", sys.argv[1:] if argv is None else argv,
          "Clock / step time measured on the GPU",
          f"compiled on a 2-core CPU-only machine for a compile-only {opts.target}",
          table, rows, profiles=profiles)

if __name__ == "__main__":
  main()
