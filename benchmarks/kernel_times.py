"""The clock kernel by kernel, against a profiler trace of a real GPU.

Two modes:

* ``--record MODEL...`` (on a GPU): compiles each zoo model's unmodified
  step (the GPU check's sizes, ``gpu.CONFIGS``; ``MODEL:POLICY`` for its
  blocks under a per-block ``nn.remat`` policy), times it (steps queued as a
  training loop runs them, and each waited for), and traces three steps
  with ``jax.profiler``. Writes, per model, the compiled program
  (``<model>.hlo.txt.gz``) and every kernel the GPU ran
  (``<model>.events.json.gz``: name, start and duration in ns), and
  ``summary.json``.
* ``--compare DIR`` (anywhere): prices each recorded program with the
  clock (``_xla_clock``) on ``--profile`` and sets each kind of kernel's
  predicted time beside the traced one: XLA's own kernels (fusions), and
  the library calls (cuBLAS, cuDNN), aligned call by call. Library calls
  and XLA's kernels run in program order on one stream, so the runs of
  adjacent library calls in the program and the runs of library kernels in
  the trace pair up in order (a cuDNN call can launch several kernels: a
  layout conversion, the convolution, a reduction).

  PYTHONPATH=.:benchmarks python benchmarks/kernel_times.py --record gpt2 resnet18 unet \\
      --out $OUT
  PYTHONPATH=.:benchmarks JAX_PLATFORMS=cpu python benchmarks/kernel_times.py \\
      --compare benchmarks/results/kernel-times-h100 \\
      --profile benchmarks/results/gpu-check-h100/7-gpt2-host-plan/rows.jsonl
"""

from __future__ import annotations

import argparse
import glob
import gzip
import heapq
import json
import os
import shutil
import sys
import tempfile

import jax

from jaxmem.cost import _hlo as hlo
from jaxmem.cost import _xla_clock as xla_clock
from jaxmem.targets import get_profile
from jaxmem.targets._calibrate import QUEUED, median_seconds
from jaxmem.targets._profiles import DeviceProfile

# Words of the kernels a library call launches (XLA names its own kernels
# after their fusions).
LIBRARY = ("xmma", "gemm", "cudnn", "cutlass", "converttensor", "cublas", "nvjet", "void ",
           "kernel")
TRACED_STEPS = 3
# The custom calls that run library kernels (a Triton or Pallas call runs
# XLA-named kernels, counted as XLA's own).
LIBRARY_CALLS = ("__cublas", "__cudnn")


def is_library(name: str) -> bool:
  lower = name.lower()
  return "fusion" not in lower and any(word in lower for word in LIBRARY)


def record(models: list[str], out: str) -> dict:
  """Traces each model's unmodified step on this machine's GPU."""
  from jaxmem._zoo import models as zoo
  import gpu
  os.makedirs(out, exist_ok=True)
  summary = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "models": {}}
  for spec in models:
    model, _, remat = spec.partition(":")
    name = spec.replace(":", "-")
    task = zoo().get(model, remat=remat or None, **gpu.CONFIGS[model])
    with jax.default_device(jax.devices("cpu")[0]):
      host = jax.device_get(task.init())
    args = jax.device_put(host, jax.devices()[0])
    compiled = jax.jit(task.step).lower(*args).compile()
    with gzip.open(os.path.join(out, f"{name}.hlo.txt.gz"), "wt") as f:
      f.write(compiled.as_text())
    queued = median_seconds(compiled, args, 5, calls=QUEUED)
    waited = median_seconds(compiled, args, 5)
    trace = tempfile.mkdtemp(prefix=f"trace-{name}-")
    jax.profiler.start_trace(trace)
    for _ in range(TRACED_STEPS):
      jax.block_until_ready(compiled(*args))
    jax.profiler.stop_trace()
    path = glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)[0]
    events = [[event.name, event.start_ns, event.duration_ns]
              for plane in jax.profiler.ProfileData.from_file(path).planes
              if plane.name.startswith("/device")
              for line in plane.lines for event in line.events]
    shutil.rmtree(trace, ignore_errors=True)
    with gzip.open(os.path.join(out, f"{name}.events.json.gz"), "wt") as f:
      json.dump(sorted(events, key=lambda e: e[1]), f)
    summary["models"][name] = {"step_ms": queued * 1e3, "call_ms": waited * 1e3,
                               "kernels_traced": len(events), "steps_traced": TRACED_STEPS}
    print(name, summary["models"][name], flush=True)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return summary


def steps(events: list, count: int = TRACED_STEPS) -> list[list]:
  """The trace's kernels (sorted by start) split into its ``count`` steps,
  at the widest gaps; an error where the steps ran different numbers of
  kernels (the trace holds something besides ``count`` steps)."""
  if len(events) < count:
    raise ValueError(f"{len(events)} kernels traced: fewer than {count} steps")
  gaps = heapq.nlargest(count - 1, range(len(events) - 1),
                        key=lambda i: events[i + 1][1] - events[i][1] - events[i][2])
  cuts = [0] + sorted(i + 1 for i in gaps) + [len(events)]
  found = [events[a:b] for a, b in zip(cuts, cuts[1:])]
  if len({len(step) for step in found}) != 1:
    raise ValueError(f"the trace's {count} steps ran {[len(s) for s in found]} kernels: "
                     "not the same step each time")
  return found


def _library_runs(items, is_call) -> list[list]:
  """Maximal runs of adjacent items ``is_call`` says are library calls."""
  runs, run = [], []
  for item in items:
    if is_call(item):
      run.append(item)
    elif run:
      runs.append(run)
      run = []
  return runs + ([run] if run else [])


def compare(text: str, events: list, profile: DeviceProfile) -> dict:
  """One step's traced kernel times against the clock's, by kind (ms)."""
  program = hlo.parse(text)
  entry = program.computations[program.entry]
  shapes = {inst.name: inst.arrays() for inst in entry}
  if any(inst.opcode in xla_clock.CONTROL for inst in entry):
    raise ValueError("kernel_times compares straight-line programs only")
  kernels = [inst for inst in entry if xla_clock.launches_kernel(inst)]
  step = [e for e in events if not e[0].startswith("Memset")]
  calls = _library_runs(kernels, lambda inst: inst.call_target().startswith(LIBRARY_CALLS))
  launched = _library_runs(step, lambda e: is_library(e[0]))
  if len(calls) != len(launched):
    raise ValueError(f"{len(calls)} runs of library calls in the program, "
                     f"{len(launched)} in the trace: they do not pair up")
  seconds = lambda inst: xla_clock.kernel_seconds(inst, shapes, program, profile) * 1e3
  pairs = [(sum(map(seconds, run)), sum(e[2] for e in traced) / 1e6,
            _targets(run)) for run, traced in zip(calls, launched)]
  own = [inst for inst in kernels if not inst.call_target().startswith(LIBRARY_CALLS)]
  return {"clock_library_ms": sum(p[0] for p in pairs),
          "traced_library_ms": sum(p[1] for p in pairs),
          "clock_xla_ms": sum(map(seconds, own)),
          "traced_xla_ms": sum(e[2] for e in step if not is_library(e[0])) / 1e6,
          "clock_ms": xla_clock.program_time(text, profile).seconds * 1e3,
          "traced_ms": (max(e[1] + e[2] for e in step) - step[0][1]) / 1e6,
          "xla_kernels": len(own), "traced_xla_kernels": sum(not is_library(e[0]) for e in step),
          "calls": [{"clock_ms": c, "traced_ms": t, "targets": n} for c, t, n in pairs]}


def _targets(run) -> str:
  return ",".join(inst.call_target().split("$")[-1] for inst in run)


def profile_from(path: str | None) -> DeviceProfile:
  """A preset's name, a profile JSON, or a GPU check's ``rows.jsonl`` (its
  calibration)."""
  if path is None or not path.endswith((".json", ".jsonl")):
    return get_profile(path or "h100")
  with open(path) as f:
    if not path.endswith(".jsonl"):
      return DeviceProfile.from_dict(json.load(f))
    rows = [json.loads(line) for line in f if line.strip()]
  found = [r["profile"] for r in rows if r.get("kind") == "calibrate" and r.get("profile")]
  if not found:
    raise ValueError(f"{path} holds no calibration (a row with kind 'calibrate' and a profile)")
  return DeviceProfile.from_dict(found[0])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  mode = parser.add_mutually_exclusive_group(required=True)
  mode.add_argument("--record", nargs="+", metavar="MODEL")
  mode.add_argument("--compare", metavar="DIR")
  parser.add_argument("--profile", default=None, help="preset name, profile JSON or rows.jsonl")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if args.record:
    record(args.record, args.out or "kernel-times")
    return
  profile = profile_from(args.profile)
  rows = []
  for path in sorted(glob.glob(os.path.join(args.compare, "*.hlo.txt.gz"))):
    name = os.path.basename(path).split(".")[0]
    with gzip.open(path, "rt") as f:
      text = f.read()
    with gzip.open(os.path.join(args.compare, f"{name}.events.json.gz"), "rt") as f:
      traced = steps(json.load(f))
    rows.append({"model": name, **compare(text, traced[-1], profile)})
  from _results import write
  table = render(rows)
  print(table)
  write(args.out or args.compare, "benchmarks/kernel_times.py", sys.argv[1:] if argv is None
        else argv, "The clock kernel by kernel against an H100's trace",
        f"profile {profile.name}", table, rows)


def render(rows: list[dict]) -> str:
  """Per model: the clock's time and the trace's, by kind of kernel."""
  lines = ["| model | step: clock / traced ms | XLA's kernels: clock / traced ms (count) "
           "| library calls: clock / traced ms | worst call: traced / clock |",
           "|---|---|---|---|---|"]
  for r in rows:
    worst = max(r["calls"], key=lambda c: c["traced_ms"] / max(c["clock_ms"], 1e-9))
    lines.append(
        f"| {r['model']} | {r['clock_ms']:.2f} / {r['traced_ms']:.2f} "
        f"| {r['clock_xla_ms']:.2f} / {r['traced_xla_ms']:.2f} "
        f"({r['xla_kernels']} / {r['traced_xla_kernels']}) "
        f"| {r['clock_library_ms']:.2f} / {r['traced_library_ms']:.2f} "
        f"| {worst['traced_ms'] / worst['clock_ms']:.1f}x ({worst['targets']}, "
        f"{worst['traced_ms']:.2f} ms) |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
