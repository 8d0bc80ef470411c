"""``jaxmem-bench``: fit a model's train step into budgets and compare.

Run ``python -m jaxmem.bench --help``. The default run builds a residual MLP,
measures the unconstrained step, transforms it at 70% and 50% of its
footprint (or at the smallest budget jaxmem reaches, if one is not
reachable) and prints one row per budget.

On CPU the step times are CPU times (DESIGN.md fact 9: they are not the
GPU's); footprints are XLA's compiled numbers with the remat flag of fact 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jaxmem  # sets the XLA:CPU remat flag before JAX starts

import jax


def _median_time(fn, args, repeats: int) -> float:
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _parse_config(items):
  config = {}
  for item in items or ():
    key, _, value = item.partition("=")
    config[key] = json.loads(value)
  return config


def main(argv=None) -> int:
  import models
  parser = argparse.ArgumentParser(prog="jaxmem-bench", description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="mlp", choices=sorted(models.REGISTRY))
  parser.add_argument("--config", nargs="*", metavar="KEY=JSON",
                      help="model options, e.g. depth=24 batch=512")
  parser.add_argument("--budgets", nargs="+", default=["70%", "50%"])
  parser.add_argument("--planner", default="recompute", choices=sorted(jaxmem.PLANNERS))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--json", help="write the results here")
  opts = parser.parse_args(argv)

  task = models.get(opts.model, **_parse_config(opts.config))
  state, batch = task.init()
  base = jax.jit(task.step)
  unconstrained = jaxmem.xla_footprint(base.lower(state, batch).compile())
  base_time = _median_time(base, (state, batch), opts.repeats)
  print(f"jaxmem-bench: model {opts.model} {task.config}, backend "
        f"{jax.default_backend()}, jax {jax.__version__}")
  print(f"unconstrained step: {jaxmem.format_bytes(unconstrained)}, "
        f"{base_time * 1e3:.1f} ms\n")
  header = f"{'budget':>8} {'asked':>11} {'XLA':>11} {'model':>11} {'fits':>5} " \
           f"{'+FLOPs':>7} {'plan s':>7} {'time x':>7}"
  print(header)
  print("-" * len(header))
  rows = []
  for text in opts.budgets:
    fitted = jaxmem.transform(task.step, budget=text, planner=opts.planner)
    try:
      plan = fitted.plan(state, batch)
      note = ""
    except jaxmem.BudgetError as err:
      smallest = err.smallest
      fitted = jaxmem.transform(task.step, budget=smallest, planner=opts.planner)
      plan = fitted.plan(state, batch)
      note = f"  ({text} unreachable; smallest reachable shown)"
    step_time = _median_time(fitted, (state, batch), opts.repeats)
    row = {"budget": text, "budget_bytes": plan.budget, "xla_bytes": plan.footprint,
           "model_bytes": plan.profile.peak, "fits": plan.footprint <= plan.budget,
           "added_flops_ratio": plan.added_flops / max(plan.base_flops, 1.0),
           "planning_s": plan.seconds, "time_ratio": step_time / base_time}
    rows.append(row)
    print(f"{text:>8} {jaxmem.format_bytes(plan.budget):>11} "
          f"{jaxmem.format_bytes(plan.footprint):>11} "
          f"{jaxmem.format_bytes(plan.profile.peak):>11} {str(row['fits']):>5} "
          f"{row['added_flops_ratio']:>6.1%} {plan.seconds:>7.2f} "
          f"{row['time_ratio']:>6.2f}x{note}")
  print("\nXLA = compiled footprint (temp + args + outputs - aliases); "
        "model = jaxmem's prediction; time x = step time / unconstrained "
        "(CPU time on CPU).")
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump({"model": opts.model, "config": task.config, "backend": jax.default_backend(),
                 "jax": jax.__version__, "command": " ".join(sys.argv),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "unconstrained_bytes": unconstrained, "rows": rows}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
