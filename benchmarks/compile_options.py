"""What the fit loop's compiler options save: each zoo step as written,
compiled for a target with the options the step the user runs gets
(``plain``), with the fit loop's (``measuring``:
``jaxmem._flags.measuring_options``), and with the fit loop's less each
option it adds, one at a time. Each is compiled ``--repeats`` times, the
variants taking turns so that a busy machine slows them alike; a row gives
the footprint (equal on every row, or the option would change what the fit
loop reads), the median seconds and their ratio to ``plain``'s.

    python benchmarks/compile_options.py --models gpt2 resnet18 --target t4 --out DIR

``--cpu-sizes`` takes the zoo's CPU sizes instead of the GPU check's edge
sizes; ``--set KEY=VALUE ...`` changes them for every model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import jaxmem  # noqa: E402,F401  (sets the XLA:CPU remat flag first)
from jaxmem.targets import resolve, xla_footprint  # noqa: E402

from benchmarks._results import write  # noqa: E402
from benchmarks._steps import compile_for, task as zoo_task, zoo_options  # noqa: E402
from benchmarks.gpu import configs  # noqa: E402

MIB = 2.0**20


def variants(target: str | None) -> dict[str, dict]:
  """Each variant's options over ``compile_for``'s plain ones: ``measuring``
  (the fit loop's), and the fit loop's less each option it adds (that
  option at its plain value, or at XLA's default where plain leaves it
  unset: :func:`_xla_default`)."""
  where = resolve(target, ())
  plain, measuring = where.options(), where.options(measuring=True)
  added = [k for k in measuring if plain.get(k) != measuring[k]]
  found = {"plain": {}, "measuring": {"measuring": True}}
  for key in added:
    default = plain.get(key, _xla_default(measuring[key]))
    found[f"measuring less {key}"] = {"measuring": True, key: default}
  return found


def _xla_default(value):
  """XLA's default for the options the fit loop adds: LLVM at level 2
  (``xla_backend_optimization_level``), ptxas optimizing."""
  return 2 if isinstance(value, int) and not isinstance(value, bool) else False


def measure(name: str, config: dict, target: str | None, repeats: int) -> list[dict]:
  """The rows of one model (see the module docstring)."""
  task = zoo_task(name, config)
  shapes = jax.eval_shape(task.init)
  found = variants(target)
  seconds = {label: [] for label in found}
  footprints = {label: set() for label in found}
  for _ in range(repeats):
    for label, options in found.items():
      options = dict(options)
      measuring = options.pop("measuring", False)
      compiled, _, took = compile_for(task.step, shapes, target, measuring=measuring, **options)
      seconds[label].append(took)
      footprints[label].add(xla_footprint(compiled))
  base = statistics.median(seconds["plain"])
  return [dict(model=name, target=target or "cpu", variant=label,
               footprints=sorted(footprints[label]), seconds=seconds[label],
               median_s=statistics.median(seconds[label]),
               ratio=statistics.median(seconds[label]) / base) for label in found]


def table(rows: list) -> str:
  lines = ["| model | target | options | footprint (MiB) | median s | over plain |",
           "|---|---|---|---|---|---|"]
  lines += [f"| {r['model']} | {r['target']} | {r['variant']} | "
            f"{', '.join(f'{f / MIB:.1f}' for f in r['footprints'])} | {r['median_s']:.2f} | "
            f"{r['ratio']:.2f} |" for r in rows]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["gpt2", "resnet18"])
  parser.add_argument("--target", default="t4", help="a name in jaxmem.PROFILES, or cpu")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cpu-sizes", action="store_true")
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="zoo options over the sizes, such as batch=8")
  parser.add_argument("--out", required=True)
  opts = parser.parse_args(argv)
  target = None if opts.target == "cpu" else opts.target
  sizes = configs(opts.cpu_sizes)
  rows = []
  for name in opts.models:
    rows += measure(name, {**sizes[name], **zoo_options(opts.set)}, target, opts.repeats)
    print(table(rows), flush=True)
  where = ("XLA:CPU" if target is None else f"XLA:GPU for a {target} target, compiled here") + (
      ", the zoo's CPU sizes" if opts.cpu_sizes else ", the GPU check's edge sizes")
  write(opts.out, "benchmarks/compile_options.py", sys.argv[1:] if argv is None else argv,
        "What the fit loop's compiler options save", where, table(rows), rows)


if __name__ == "__main__":
  main()
