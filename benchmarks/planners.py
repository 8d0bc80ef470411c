"""Planners compared by predicted step time on targets' profiles.

For each model, target (a profile in ``jaxmem.PROFILES``) and budget (a
fraction of the memory model's unconstrained peak), every planner plans for
that target and the table gives whether its plan fits, its predicted step
time over the unconstrained step's (both predicted on the same profile), its
stall time, its pinned host bytes, the bytes it copies to the host and back,
and what it decided. Planning only:
nothing is compiled or run (the step is traced from shapes), so edge-GPU
sizes plan on a CPU in minutes; the times are the performance model's, not
measured.

Suites:
  hybrid (issue 4): recompute vs offload vs hybrid,
    python benchmarks/planners.py --models mlp transformer --profiles t4 rtx3060
  vTensor ablation (issue 5): LGM vs whole-tensor swapping vs reservation off,
    at budgets where swapping is needed, on edge-GPU sizes,
    python benchmarks/planners.py --sizes edge --planners lgm lgm-whole \
        lgm-unreserved --budgets 0.9 0.8 0.7 --compare lgm lgm-whole
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jaxmem  # noqa: F401  (sets the XLA:CPU remat flag first)
import jax
import optax

from jaxmem._zoo import models as _models
models = _models()
from jaxmem.targets import PROFILES
from jaxmem._provenance import provenance
from jaxmem.graph._graph import build_graph
from jaxmem._budget import format_bytes
from jaxmem.cost._perf import predict_schedule, schedule_transfers
from jaxmem.cost._evaluate import unplanned
from jaxmem.planners import PLANNERS

SIZES = {
    # Test models at the tests' sizes, and two zoo models at small sizes.
    "cpu": {
        "mlp": dict(depth=16, width=64, batch=512, features=32),
        "cnn": dict(widths=(8, 16), batch=8, size=16, blocks=6),
        "transformer": dict(depth=2, dim=32, heads=2, seq=32, batch=16, vocab=64),
        "resnet18": _models().CPU_SIZES["resnet18"],
        "gpt2": _models().CPU_SIZES["gpt2"],
    },
    # Zoo models at the sizes an edge GPU trains (shallow, so that they plan
    # in minutes; each block as wide as the real one).
    "edge": {
        "mlp": dict(depth=8, width=1024, batch=4096, features=256),
        "resnet18": dict(width=64, stages=[1, 1, 1, 1], size=128, batch=32),
        "vit": dict(dim=192, depth=4, heads=3, patch=8, size=128, batch=32),
        "gpt2": dict(dim=512, depth=4, heads=8, seq=512, vocab=8192, batch=8),
        "unet": dict(width=32, depth=3, size=128, batch=8),
    },
}


def rows(name: str, config: dict, profiles, budgets, planners):
  task = models.get(name, optimizer=optax.adam(1e-3, eps=1e-3), **config)
  args = jax.eval_shape(task.init)
  graph = build_graph(jax.make_jaxpr(task.step)(*args))
  base = unplanned(graph, 0)
  for profile_name in profiles:
    profile = PROFILES[profile_name]
    base_seconds = predict_schedule(base.schedule, profile).seconds
    for fraction in budgets:
      aim = int(base.peak * fraction)
      for planner_name in planners:
        began = time.perf_counter()
        result = PLANNERS[planner_name](target=profile).plan(graph, aim)
        timing = predict_schedule(result.schedule, profile)
        moved = sum(t.nbytes for t in schedule_transfers(result.schedule))
        yield dict(model=name, profile=profile_name, budget=fraction,
                   planner=planner_name, fits=result.fits, peak=result.peak / base.peak,
                   time_ratio=timing.seconds / base_seconds,
                   stall_ratio=timing.stall / base_seconds,
                   host_bytes=result.memory.host_peak, moved_bytes=moved,
                   recomputed=len(result.plan.values_with("recompute")),
                   offloaded=len(result.plan.values_with("offload")),
                   chunked=len(result.plan.values_with("chunked")),
                   planning_s=time.perf_counter() - began)


def compare(found, first: str, second: str) -> str:
  """Markdown: where both planners fit, ``first``'s throughput over
  ``second``'s (1 / predicted time) and the bytes each moves."""
  lines = [f"| model | profile | budget | {first} time x | {second} time x | "
           f"throughput {first} / {second} | moved {first} | moved {second} |",
           "|---|---|---|---|---|---|---|---|"]
  by = {(r["model"], r["profile"], r["budget"], r["planner"]): r for r in found}
  for (model, profile, budget, planner), a in by.items():
    b = by.get((model, profile, budget, second))
    if planner != first or b is None:
      continue
    gain = (f"{b['time_ratio'] / a['time_ratio']:.3f}" if a["fits"] and b["fits"]
            else f"{'fits' if a['fits'] else 'NO'} / {'fits' if b['fits'] else 'NO'}")
    lines.append(f"| {model} | {profile} | {budget:.0%} | {a['time_ratio']:.3f} | "
                 f"{b['time_ratio']:.3f} | {gain} | {format_bytes(a['moved_bytes'])} | "
                 f"{format_bytes(b['moved_bytes'])} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="cpu", choices=sorted(SIZES),
                      help="model configurations: the CPU tests' or an edge GPU's")
  parser.add_argument("--models", nargs="+", help="default: every model of --sizes")
  parser.add_argument("--profiles", nargs="+", default=["t4", "rtx3060"],
                      choices=sorted(PROFILES))
  parser.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.33, 0.25])
  parser.add_argument("--planners", nargs="+", default=["recompute", "offload", "hybrid"])
  parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                      help="also print A's throughput over B's where both fit")
  parser.add_argument("--json", help="write the rows here")
  opts = parser.parse_args(argv)
  configs = SIZES[opts.sizes]
  unknown = sorted(set(opts.models or ()) - set(configs))
  if unknown:
    parser.error(f"no --sizes {opts.sizes} configuration for {unknown}; "
                 f"expected some of {sorted(configs)}")
  print("| model | profile | budget | planner | fits | peak / unconstrained | predicted time x "
        "| stall x | host bytes | moved | recomputed | offloaded | chunked | plan s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  found = []
  for name in opts.models or sorted(configs):
    for row in rows(name, configs[name], opts.profiles, opts.budgets, opts.planners):
      found.append(row)
      print(f"| {row['model']} | {row['profile']} | {row['budget']:.0%} | {row['planner']} | "
            f"{'yes' if row['fits'] else 'NO'} | {row['peak']:.3f} | {row['time_ratio']:.3f} | "
            f"{row['stall_ratio']:.3f} | {format_bytes(row['host_bytes'])} | "
            f"{format_bytes(row['moved_bytes'])} | {row['recomputed']} | "
            f"{row['offloaded']} | {row['chunked']} | {row['planning_s']:.1f} |", flush=True)
  if opts.compare:
    print()
    print(compare(found, *opts.compare))
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump({"provenance": provenance("benchmarks/planners.py",
                                          sys.argv[1:] if argv is None else argv),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": found,
                 "profiles": {p: PROFILES[p].source for p in opts.profiles}}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
