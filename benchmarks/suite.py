"""Scripted benchmark suites over the model zoo, on top of ``jaxmem-bench``.

Suites:
  maxbatch  the largest batch that fits a fixed budget (by default 100%: what
            unmodified JAX needs at the configured batch): unmodified JAX,
            every per-block remat baseline and jaxmem; plus step-time ratios
            at 50% of the unconstrained footprint.
  sweep     budgets from 100% down, every method, with plots.

Each model's run is written as JSON (and plots) under ``--out``; a markdown
summary table goes to stdout and ``--out``/summary-<suite>.md.

Example (CPU, small configurations; minutes per model):
  python benchmarks/suite.py maxbatch --models vit gpt2 --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import jaxmem  # noqa: F401  (sets the XLA:CPU remat flag first)
from jaxmem import bench
from jaxmem._zoo import models as _models
from jaxmem._provenance import provenance

# The zoo's small, activation-dominated configurations.
CPU_CONFIGS = _models().CPU_SIZES


def _opts(model, budgets, out, suite, max_batch, repeats, planners):
  methods = [m.name for m in bench.default_methods(model)
             if m.kind != "jaxmem" or m.option in planners]
  return types.SimpleNamespace(
      model=model, config=[f"{k}={json.dumps(v)}" for k, v in CPU_CONFIGS[model].items()],
      budgets=budgets, methods=methods, repeats=repeats, max_batch=max_batch,
      at_baselines=suite == "maxbatch", target=None,
      json=os.path.join(out, f"{suite}-{model}.json"),
      plot=os.path.join(out, "plots") if suite == "sweep" else None, quiet=False)


def summary(results, budget: str, timed: str) -> str:
  """Markdown: per model, each method's max batch at ``budget`` and the
  step-time ratios at ``timed``."""
  lines = [f"| model | unmodified | best remat (policy) | jaxmem | jaxmem / unmodified "
           f"| time x at {timed}: jaxmem, fastest fitting remat "
           "| jaxmem time / remat time at the remat's footprint |",
           "|---|---|---|---|---|---|---|"]
  for result in results:
    rows = [r for r in result["rows"] if r.budget == budget]
    by = {r.method: r for r in rows}
    remats = [r for r in rows if r.method.startswith("remat:")]
    best = max(remats, key=lambda r: r.max_batch or 0, default=None)
    plain = by.get("unconstrained")
    at = {r.method: r for r in result["rows"] if r.budget == timed}
    ours = by.get("jaxmem:recompute")
    ours_timed = at.get("jaxmem:recompute")
    fitting = [r for m, r in at.items() if m.startswith("remat:") and r.fits]
    fast = min(fitting, key=lambda r: r.time_ratio, default=None)
    ratio = (f"{ours.max_batch / plain.max_batch:.2f}x"
             if plain and ours and plain.max_batch else "-")
    # jaxmem at each baseline's own footprint (rows labelled with its name).
    equal = []
    for remat in remats:
      twin = next((r for r in result["rows"] if r.budget == remat.method
                   and r.method == "jaxmem:recompute"), None)
      if twin is not None:
        equal.append(f"{twin.time_ratio / remat.time_ratio:.2f} ({remat.method[6:]})"
                     if twin.fits else f"no fit ({remat.method[6:]})")
    lines.append(
        f"| {result['model']} | {plain.max_batch if plain else '-'} | "
        f"{f'{best.max_batch} ({best.method[6:]})' if best else '-'} | "
        f"{ours.max_batch if ours else '-'} | {ratio} | "
        f"{f'{ours_timed.time_ratio:.2f}' if ours_timed and ours_timed.fits else 'no fit'}, "
        f"{f'{fast.time_ratio:.2f} ({fast.method[6:]})' if fast else 'none fits'} | "
        f"{', '.join(equal) or '-'} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("suite", choices=["maxbatch", "sweep"])
  parser.add_argument("--models", nargs="+", default=sorted(CPU_CONFIGS),
                      choices=sorted(CPU_CONFIGS))
  parser.add_argument("--budget", default="100%", help="maxbatch: the fixed budget")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--planners", nargs="+", default=["recompute"],
                      help="jaxmem planners to run (on CPU, offload plans' footprints "
                           "are the memory model's, so the default is recompute)")
  parser.add_argument("--out", default="benchmarks/results/latest")
  opts = parser.parse_args(argv)
  source = provenance("benchmarks/suite.py", sys.argv[1:] if argv is None else argv)
  os.makedirs(opts.out, exist_ok=True)
  budgets = ([opts.budget, "50%"] if opts.suite == "maxbatch"
             else ["100%", "85%", "70%", "60%", "50%"])
  results = []
  for model in opts.models:
    run_opts = _opts(model, budgets, opts.out, opts.suite, opts.suite == "maxbatch",
                     opts.repeats, opts.planners)
    result = bench.run(run_opts)
    result.update(command=source["command"], provenance=source)
    print(bench.table(result["rows"]), flush=True)
    bench.save(result, run_opts)
    results.append(result)
  text = summary(results, budgets[0], "50%")
  with open(os.path.join(opts.out, f"summary-{opts.suite}.md"), "w") as f:
    f.write(f"Command: `{source['command']}` at {source['commit']}"
            f"{' (dirty tree)' if source['dirty'] else ''}\n\n{text}\n")
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
