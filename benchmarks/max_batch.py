"""The largest batch that trains in a fixed budget on a target, per method.

Everything is compiled here for the target (a GPU preset's compile-only
device, no GPU needed, judged by XLA:GPU's footprint; or ``cpu``, this
machine's XLA:CPU). For one zoo model:

* the step as written;
* the step with every block (every convolution of a VGG) under
  ``nn.remat`` with each per-block policy;
* ``jaxmem.transform`` with each planner (``--planners``), planning and
  judging on the target: a batch counts where its fit meets the budget
  (``Transformed.can_fit``, which never overstates it); ``ilp@1`` is the
  planner with ``micro_batches=1`` (no gradient accumulation).

The budget is a size (``2GiB``) or a share of the step as written's
footprint at the configured batch (``100%``). The search doubles the batch
from the configured one, then bisects.

  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/max_batch.py --model vgg \\
      --config depth=19 width=32 size=224 hidden=512 batch=4 --target t4 \\
      --budget 100% --out benchmarks/results/max-batch-vgg19-t4
  PYTHONPATH=. python benchmarks/max_batch.py --model gpt2 --config dim=64 depth=4 \
      heads=2 seq=128 vocab=256 batch=8 --target cpu --planners auto --limit 8 \
      --out benchmarks/results/max-batch-gpt2-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import jaxmem  # noqa: E402
from jaxmem._benchmark import largest_batch  # noqa: E402
from jaxmem._budget import Budget, format_bytes  # noqa: E402
from jaxmem._zoo import models  # noqa: E402
from jaxmem.targets import placed, xla_footprint  # noqa: E402

from benchmarks._results import write  # noqa: E402
from benchmarks._steps import compile_for, task as zoo_task  # noqa: E402

POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")


def _on(target: str) -> str | None:
  """A GPU preset's name, or None for ``cpu``: this machine's XLA:CPU."""
  return None if target == "cpu" else target


def footprint(name: str, config: dict, target: str, remat: str | None = None) -> int:
  """The target compiler's footprint of the step (under ``remat``)."""
  task = zoo_task(name, config, remat)
  compiled, _, _ = compile_for(task.step, jax.eval_shape(task.init), _on(target))
  return xla_footprint(compiled)


def fits(name: str, config: dict, target: str, budget: int, method: str) -> bool:
  """Whether ``method`` (``unmodified``, ``remat:<policy>`` or
  ``jaxmem:<planner>``) trains ``config`` within ``budget`` bytes on
  ``target``."""
  kind, _, option = method.partition(":")
  if kind != "jaxmem":
    return footprint(name, config, target, option or None) <= budget
  planner, _, micro = option.partition("@")  # ``ilp@1``: micro_batches=1
  task = zoo_task(name, config)
  fitted = jaxmem.transform(task.step, budget=budget, target=_on(target), planner=planner,
                            reserve=0, micro_batches=int(micro) if micro else "auto")
  shapes = jax.eval_shape(task.init)
  return fitted.can_fit(*(shapes if _on(target) is None else placed(shapes, target)))


def measure(name: str, config: dict, target: str, budget: int, methods, limit: int):
  rows = []
  for method in methods:
    began, probes = time.perf_counter(), []

    def probe(batch: int) -> bool:
      ok = fits(name, dict(config, batch=batch), target, budget, method)
      probes.append((batch, ok))
      return ok

    best = largest_batch(probe, config["batch"], limit)
    rows.append(dict(method=method, max_batch=best, probes=probes,
                     seconds=time.perf_counter() - began))
    print(f"{method:45s} max batch {best:5d}  ({len(probes)} probes, "
          f"{rows[-1]['seconds']:.0f} s)", flush=True)
  return rows


def table(rows, budget: int) -> str:
  best_remat = max((r["max_batch"] for r in rows if r["method"].startswith("remat:")),
                   default=0)
  lines = [f"Budget: {format_bytes(budget)} ({budget} bytes).", "",
           "| method | max batch | over the best per-block remat | probes | seconds |",
           "|---|---|---|---|---|"]
  for r in rows:
    ratio = f"{r['max_batch'] / best_remat:.2f}" if best_remat else "-"
    lines.append(f"| {r['method']} | {r['max_batch']} | {ratio} | {len(r['probes'])} | "
                 f"{r['seconds']:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="vgg")
  parser.add_argument("--config", nargs="*", default=[], metavar="KEY=JSON")
  parser.add_argument("--target", default="t4", help="a GPU preset, or cpu (XLA:CPU here)")
  parser.add_argument("--budget", default="100%")
  parser.add_argument("--planners", nargs="+", default=["ilp", "recompute"],
                      help="planner names; NAME@K fits in K micro-batches (@1: the "
                      "batch whole, plans of residuals alone)")
  parser.add_argument("--limit", type=int, default=16,
                      help="largest batch tried, as a multiple of the configured one")
  parser.add_argument("--out", required=True)
  opts = parser.parse_args(argv)
  config = {k: json.loads(v) for k, v in (item.split("=", 1) for item in opts.config)}
  config.setdefault("batch", models().options(opts.model)["batch"])
  budget = Budget.parse(opts.budget).resolve(footprint(opts.model, config, opts.target))
  methods = (["unmodified"] + [f"remat:{p}" for p in POLICIES]
             + [f"jaxmem:{p}" for p in opts.planners])
  rows = measure(opts.model, config, opts.target, budget, methods, opts.limit)
  text = table(rows, budget)
  print(text)
  write(opts.out, "benchmarks/max_batch.py", sys.argv[1:] if argv is None else argv,
        f"Max batch of {opts.model} in a fixed budget",
        "XLA:CPU" if opts.target == "cpu" else f"XLA:GPU for {opts.target}, "
        "compiled on this machine (no GPU)", text, rows, model=opts.model, config=config,
        target=opts.target, budget=budget)


if __name__ == "__main__":
  main()
