"""The memory model against XLA:GPU's footprint, per zoo model and target.

For each zoo model (at the GPU check's edge sizes, or the zoo's CPU sizes
with ``--cpu-sizes``), the untransformed step is compiled for each GPU
target on this machine (compile-only devices; no GPU needed) and for
XLA:CPU, and jaxmem's memory model of the step is set beside them:
model / XLA per compiler. Arguments are abstract (``jax.eval_shape``), so
edge sizes cost compile time only.

  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/target_accuracy.py \\
      --targets t4 h100 --out benchmarks/results/memory-model-vs-xla-gpu
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
from jaxmem._provenance import provenance  # noqa: E402
from jaxmem.targets import placed, resolve, xla_footprint  # noqa: E402
from jaxmem._zoo import models  # noqa: E402

from benchmarks.gpu import CONFIGS  # noqa: E402


def _footprint(step, shapes, target: str | None) -> tuple[int, float]:
  """XLA's footprint of ``step`` for ``target`` (None: XLA:CPU) and the
  seconds its compilation took."""
  where = resolve(target, jax.tree_util.tree_leaves(shapes))
  args = shapes if target is None else placed(shapes, target)
  start = time.perf_counter()
  compiled = jax.jit(step, compiler_options=where.options(measuring=True)).lower(
      *args).compile()
  return xla_footprint(compiled), time.perf_counter() - start


def measure(name: str, config: dict, targets: list[str]) -> dict:
  zoo = models()
  config = dict(config)
  task = zoo.get(config.pop("zoo", name), **config)
  shapes = jax.eval_shape(task.init)
  model = jaxmem.analyze(task.step, *shapes).peak
  row = {"model": name, "config": config, "memory_model": model}
  for target in [None, *targets]:
    label = target or "xla:cpu"
    footprint, seconds = _footprint(task.step, shapes, target)
    row[label] = {"footprint": footprint, "model_over_xla": model / footprint,
                  "compile_s": seconds}
    print(f"{name:12s} {label:8s} XLA {footprint / 2**20:9.1f} MiB  model/XLA "
          f"{model / footprint:5.2f}  compile {seconds:5.1f} s", flush=True)
  return row


def render(rows: list[dict], targets: list[str]) -> str:
  labels = ["xla:cpu", *targets]
  head = "| model | memory model | " + " | ".join(f"{t}: XLA, model/XLA" for t in labels) + " |"
  lines = [head, "|" + "---|" * (2 + len(labels))]
  for row in rows:
    cells = [f"{row[t]['footprint'] / 2**20:.1f} MiB, {row[t]['model_over_xla']:.2f}"
             for t in labels]
    lines.append(f"| {row['model']} | {row['memory_model'] / 2**20:.1f} MiB | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", nargs="*", default=["t4", "h100"])
  parser.add_argument("--models", nargs="*", default=None)
  parser.add_argument("--cpu-sizes", action="store_true",
                      help="the zoo's CPU sizes instead of the GPU check's edge sizes")
  parser.add_argument("--out", default=None, help="folder for results.md and results.json")
  opts = parser.parse_args(argv)
  zoo = models()
  configs = ({k: dict(v) for k, v in zoo.CPU_SIZES.items()} if opts.cpu_sizes
             else {k: dict(v) for k, v in CONFIGS.items()})
  names = opts.models or sorted(configs)
  rows = [measure(name, configs[name], opts.targets) for name in names]
  table = render(rows, opts.targets)
  print(table)
  if opts.out:
    os.makedirs(opts.out, exist_ok=True)
    header = {**provenance("benchmarks/target_accuracy.py", sys.argv[1:] if argv is None
                           else argv), "jax": jax.__version__}
    with open(os.path.join(opts.out, "results.json"), "w") as f:
      json.dump({"header": header, "rows": rows}, f, indent=1)
    with open(os.path.join(opts.out, "results.md"), "w") as f:
      f.write(f"# Memory model / XLA footprint, untransformed steps\n\n"
              f"Command: `{header['command']}`  \nCommit: {header.get('commit')} "
              f"(dirty: {header.get('dirty')}), jax {jax.__version__}, "
              f"{header['date']}, compiled on a 2-core CPU-only machine.\n\n{table}\n")


if __name__ == "__main__":
  main()
