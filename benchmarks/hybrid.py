"""Hybrid vs recompute-only vs offload-only, by predicted step time.

For each model, device profile and budget (a fraction of the memory model's
unconstrained peak), every planner plans for that profile and the table gives
whether its plan fits, its predicted step time over the unconstrained step's
(both predicted on the same profile), its stall time and its pinned host
bytes. Planning only: nothing is compiled, so this runs on CPU in minutes and
its times are the performance model's, not measured.

Example:
  python benchmarks/hybrid.py --models mlp transformer --profiles t4 rtx3060
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jaxmem  # noqa: F401  (sets the XLA:CPU remat flag first)
import jax
import optax

import models
from jaxmem._devices import PROFILES
from jaxmem._graph import build_graph
from jaxmem._perf import predict_schedule
from jaxmem._planners import PLANNERS, unplanned

# Test models at the tests' sizes, and two zoo models at small sizes.
CONFIGS = {
    "mlp": dict(depth=16, width=64, batch=512, features=32),
    "cnn": dict(widths=(8, 16), batch=8, size=16, blocks=6),
    "transformer": dict(depth=2, dim=32, heads=2, seq=32, batch=16, vocab=64),
    "resnet18": dict(width=8, stages=[1, 1, 1, 1], size=32, batch=32),
    "gpt2": dict(dim=64, depth=4, heads=2, seq=128, vocab=256, batch=8),
}


def rows(name: str, profiles, budgets, planners):
  task = models.get(name, optimizer=optax.adam(1e-3, eps=1e-3), **CONFIGS[name])
  args = jax.eval_shape(task.init)
  graph = build_graph(jax.make_jaxpr(task.step)(*args))
  base = unplanned(graph, 0)
  for profile_name in profiles:
    profile = PROFILES[profile_name]
    base_seconds = predict_schedule(base.schedule, profile).seconds
    for fraction in budgets:
      target = int(base.peak * fraction)
      for planner_name in planners:
        began = time.perf_counter()
        result = PLANNERS[planner_name](profile=profile).plan(graph, target)
        timing = predict_schedule(result.schedule, profile)
        yield dict(model=name, profile=profile_name, budget=fraction,
                   planner=planner_name, fits=result.fits, peak=result.peak / base.peak,
                   time_ratio=timing.seconds / base_seconds,
                   stall_ratio=timing.stall / base_seconds,
                   host_bytes=result.profile.host_peak,
                   recomputed=len(result.plan.values_with("recompute")),
                   offloaded=len(result.plan.values_with("offload")),
                   planning_s=time.perf_counter() - began)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", nargs="+", default=sorted(CONFIGS), choices=sorted(CONFIGS))
  parser.add_argument("--profiles", nargs="+", default=["t4", "rtx3060"],
                      choices=sorted(PROFILES))
  parser.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.33, 0.25])
  parser.add_argument("--planners", nargs="+", default=["recompute", "offload", "hybrid"])
  parser.add_argument("--json", help="write the rows here")
  opts = parser.parse_args(argv)
  print("| model | profile | budget | planner | fits | peak / unconstrained | predicted time x "
        "| stall x | host bytes | recomputed | offloaded | plan s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  found = []
  for name in opts.models:
    for row in rows(name, opts.profiles, opts.budgets, opts.planners):
      found.append(row)
      print(f"| {row['model']} | {row['profile']} | {row['budget']:.0%} | {row['planner']} | "
            f"{'yes' if row['fits'] else 'NO'} | {row['peak']:.3f} | {row['time_ratio']:.3f} | "
            f"{row['stall_ratio']:.3f} | {row['host_bytes']} | {row['recomputed']} | "
            f"{row['offloaded']} | {row['planning_s']:.1f} |", flush=True)
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump({"command": "python benchmarks/hybrid.py " + " ".join(sys.argv[1:]),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": found,
                 "profiles": {p: PROFILES[p].source for p in opts.profiles}}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
