"""The memory model against XLA:GPU's footprint, per zoo model and target.

For each zoo model (at the GPU check's edge sizes, or the zoo's CPU sizes
with ``--cpu-sizes``), the untransformed step is compiled for each GPU
target on this machine (compile-only devices; no GPU needed) and for
XLA:CPU, and jaxmem's memory model of the step is set beside each: the
XLA:CPU fusion emulation, and the model that learns its buffers from the
target's own program (``_xla_buffers``; what GPU targets plan with). The
learned model holds each cuBLAS/cuDNN call's workspace while the call runs
and is set beside XLA's whole footprint; the emulation holds none and is
set beside the footprint less the largest workspace. Each model's figure is also given
packed as XLA packs temporaries into its heap (``cost._heap``: the live
peak plus the gaps a greedy placement leaves). Arguments are abstract (``jax.eval_shape``),
so edge sizes cost compile time only. With ``--budgets``, each GPU target
also fits the step at those budgets and sets the plan's model beside XLA's
footprint of it (planned steps; these compile about ten candidates each).

  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/target_accuracy.py \\
      --targets t4 h100 --out benchmarks/results/memory-model-vs-xla-gpu
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import jaxmem  # noqa: E402
from jaxmem.cost._evaluate import unplanned  # noqa: E402
from jaxmem.cost._heap import packed  # noqa: E402
from jaxmem.cost._memory import buffer_spans  # noqa: E402
from jaxmem.graph._graph import build_graph, trace  # noqa: E402
from jaxmem.cost._xla_buffers import learn, with_buffers  # noqa: E402
from jaxmem.targets import placed, workspace_bytes, xla_footprint  # noqa: E402
from jaxmem._zoo import models  # noqa: E402

from benchmarks._results import write  # noqa: E402
from benchmarks._steps import compile_for, task as zoo_task  # noqa: E402
from benchmarks.gpu import configs as check_configs  # noqa: E402


def _planned(task, budget: str, target: str) -> dict:
  """The fit of ``task`` at ``budget`` on ``target``: the plan's model
  against XLA's footprint of it."""
  args = task.init()
  fitted = jaxmem.transform(task.step, budget=budget, target=target)
  try:
    fit = fitted.fit(*args)
  except jaxmem.BudgetError as err:
    return {"budget": budget, "smallest": err.smallest}
  compiled = fitted.lower(*placed(args, target)).compile()
  xla = xla_footprint(compiled)
  heap = packed_peak(fit.memory.schedule)
  return {"budget": budget, "xla": xla, "model": fit.memory.peak,
          "model_over_xla": fit.memory.peak / xla, "packed": heap,
          "packed_over_xla": heap / xla, "seconds": fit.seconds}


def packed_peak(schedule) -> int:
  """The memory model's footprint of ``schedule`` with its temporaries
  packed as XLA packs them."""
  start, spans = buffer_spans(schedule)
  return start + packed(spans)


def measure(name: str, config: dict, targets: list[str], budgets: list[str]) -> dict:
  task = zoo_task(name, config)
  shapes = jax.eval_shape(task.init)
  closed, _ = trace(jax.jit(task.step), *shapes)
  graph = build_graph(closed)
  as_written = unplanned(graph, 0)
  emulated, emulated_packed = as_written.peak, packed_peak(as_written.schedule)
  row = {"model": name, "config": config, "emulated": emulated,
         "emulated_packed": emulated_packed}
  for target in [None, *targets]:
    label = target or "xla:cpu"
    compiled, where, seconds = compile_for(task.step, shapes, target, measuring=True)
    xla, workspace = xla_footprint(compiled), workspace_bytes(compiled)
    start = time.perf_counter()
    found = unplanned(with_buffers(graph, learn(graph, where)), 0)
    learned = found.peak
    cell = {"footprint": xla, "workspace": workspace, "compile_s": seconds,
            "emulated_over_xla": emulated / (xla - workspace),
            "emulated_packed_over_xla": emulated_packed / (xla - workspace),
            "learned_over_xla": learned / xla,
            "learned_packed_over_xla": packed_peak(found.schedule) / xla,
            "learn_s": time.perf_counter() - start}
    if target is not None and budgets:
      cell["planned"] = [_planned(task, b, target) for b in budgets]
    row[label] = cell
    print(f"{name:12s} {label:8s} XLA {xla / 2**20:9.1f} MiB  emulated/XLA "
          f"{cell['emulated_over_xla']:5.2f}  learned/XLA {learned / xla:5.2f}  "
          f"{cell.get('planned', '')}", flush=True)
  return row


def render(rows: list[dict], targets: list[str]) -> str:
  labels = ["xla:cpu", *targets]
  head = ("| model | " + " | ".join(f"{t}: XLA (workspace), emulated/(XLA - workspace), "
                                    f"learned/XLA (each packed)" for t in labels)
          + " |")
  lines = [head, "|" + "---|" * (1 + len(labels))]
  for row in rows:
    cells = [f"{row[t]['footprint'] / 2**20:.1f} MiB ({row[t]['workspace'] / 2**20:.0f}), "
             f"{row[t]['emulated_over_xla']:.2f} ({row[t]['emulated_packed_over_xla']:.2f}), "
             f"**{row[t]['learned_over_xla']:.2f}** ({row[t]['learned_packed_over_xla']:.2f})"
             for t in labels]
    lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
  planned = [(row["model"], t, p) for row in rows for t in targets
             for p in row[t].get("planned", ())]
  if planned:
    lines += ["", "Planned steps (the fit's plan; model learned from the step as written):",
              "", "| model | target | budget | XLA | model | model/XLA | packed | packed/XLA |",
              "|---|---|---|---|---|---|---|---|"]
    for model, target, p in planned:
      if "xla" in p:
        lines.append(f"| {model} | {target} | {p['budget']} | {p['xla'] / 2**20:.1f} MiB | "
                     f"{p['model'] / 2**20:.1f} MiB | **{p['model_over_xla']:.2f}** | "
                     f"{p['packed'] / 2**20:.1f} MiB | **{p['packed_over_xla']:.2f}** |")
      else:
        lines.append(f"| {model} | {target} | {p['budget']} | smallest reached "
                     f"{p['smallest'] / 2**20:.1f} MiB | - | - | - | - |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", nargs="*", default=["t4", "h100"])
  parser.add_argument("--models", nargs="*", default=None)
  parser.add_argument("--cpu-sizes", action="store_true",
                      help="the zoo's CPU sizes instead of the GPU check's edge sizes")
  parser.add_argument("--budgets", nargs="*", default=[],
                      help="budgets each GPU target fits the step at (planned rows)")
  parser.add_argument("--out", default=None, help="folder for results.md and results.json")
  opts = parser.parse_args(argv)
  # The GPU check's models (a scanned GPT-2 among them) at its sizes, or the
  # zoo's CPU sizes (every zoo model's, with the check's scanned GPT-2).
  configs = {k: dict(v) for k, v in check_configs(opts.cpu_sizes).items()}
  if opts.cpu_sizes:
    configs.update({k: dict(v) for k, v in models().CPU_SIZES.items()})
  names = opts.models or sorted(configs)
  rows = [measure(name, configs[name], opts.targets, opts.budgets) for name in names]
  table = render(rows, opts.targets)
  print(table)
  if opts.out:
    write(opts.out, "benchmarks/target_accuracy.py", sys.argv[1:] if argv is None else argv,
          "Memory model / XLA footprint",
          "compiled on a 2-core CPU-only machine", table, rows)

if __name__ == "__main__":
  main()
