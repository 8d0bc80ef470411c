"""The smallest footprint jaxmem reaches per zoo model: by plans of the
residuals alone (the optimizer state on the device, the step whole:
``host_state=False, micro_batches=1``), with the optimizer state allowed in
host memory between steps, and with micro-batches too (the defaults), on
the target's compiler (XLA:GPU for a GPU target compiled here, or XLA:CPU).

For each model (the zoo's CPU sizes): the step's own footprint on the
target, the smallest footprint a fit reaches each way (the ``BudgetError``
of a budget below it names it; the compiler's figure), as fractions of the
step's own, the optimizer state's bytes, and the micro-batches of the
smallest. On XLA:CPU the state never moves (its host memory is its device
memory).

    python benchmarks/floor.py --models gpt2 resnet18 --target t4 --out DIR
    python benchmarks/floor.py --models gpt2 resnet18 --target cpu --out DIR
"""

from __future__ import annotations

import argparse
import sys
import time

import jaxmem
import jax

from jaxmem.graph._graph import build_graph
from jaxmem.graph._state import optimizer_state
from jaxmem.targets import xla_footprint

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import _results  # noqa: E402
from benchmarks._steps import compile_for, task  # noqa: E402

MIB = 2**20


def smallest(step, args, target: str, **options) -> tuple[int, int, float]:
  """The smallest footprint a fit of ``step`` reaches on ``target`` (a budget
  of one byte names it), its micro-batches (1: none) and the seconds the
  search took."""
  start = time.perf_counter()
  try:
    fit = jaxmem.transform(step, budget=1, target=target, reserve=0, **options).fit(*args)
    return fit.footprint, 1 if fit.micro is None else fit.micro.count, (
        time.perf_counter() - start)
  except jaxmem.BudgetError as err:
    return err.smallest, 0, time.perf_counter() - start


def row(name: str, config: dict, where: str) -> dict:
  """One model's smallest footprints on ``where`` (a GPU preset's name, or
  ``cpu``: this machine's XLA:CPU)."""
  target = None if where == "cpu" else where
  t = task(name, config)
  args = jax.eval_shape(t.init)
  compiled, _, _ = compile_for(t.step, args, target)
  unconstrained = xla_footprint(compiled)
  state = optimizer_state(build_graph(jax.make_jaxpr(t.step)(*args)))
  plans, _, plans_s = smallest(t.step, args, target, host_state=False, micro_batches=1)
  hosted, _, hosted_s = (smallest(t.step, args, target, micro_batches=1) if target
                         else (plans, 1, 0.0))
  micro, _, micro_s = smallest(t.step, args, target)
  return dict(model=name, target=where, unconstrained=unconstrained,
              state_bytes=sum(leaf.nbytes for leaf in state), state_leaves=len(state),
              smallest_plans=plans, smallest_hosted=hosted, smallest=micro,
              plans=plans / unconstrained, hosted=hosted / unconstrained,
              after=micro / unconstrained, seconds=(plans_s, hosted_s, micro_s))


def table(rows) -> str:
  lines = ["| model | target | step as written MiB | optimizer state MiB (leaves) | "
           "plans of residuals | + optimizer state in host memory | + micro-batches | "
           "search s (each) |",
           "|---|---|---|---|---|---|---|---|"]
  lines += [f"| {r['model']} | {r['target']} | {r['unconstrained'] / MIB:.2f} | "
            f"{r['state_bytes'] / MIB:.2f} ({r['state_leaves']}) | "
            f"{r['smallest_plans'] / MIB:.2f} MiB ({r['plans']:.0%}) | "
            f"{r['smallest_hosted'] / MIB:.2f} MiB ({r['hosted']:.0%}) | "
            f"{r['smallest'] / MIB:.2f} MiB ({r['after']:.0%}) | "
            f"{', '.join(f'{x:.0f}' for x in r['seconds'])} |" for r in rows]
  return "\n".join(lines)


def main(argv=None) -> None:
  from jaxmem._zoo import models
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["gpt2", "resnet18", "vit", "mobilenetv2"])
  parser.add_argument("--target", default="t4", help="a GPU preset, or cpu (XLA:CPU here)")
  parser.add_argument("--out", required=True)
  opts = parser.parse_args(argv)
  sizes = models().CPU_SIZES
  rows = []
  for name in opts.models:  # written after each model: a long run keeps what it has
    rows.append(row(name, sizes.get(name, {}), opts.target))
    print(table(rows[-1:]).splitlines()[-1], flush=True)
    _results.write(opts.out, "benchmarks/floor.py", sys.argv[1:] if argv is None else argv,
                   "The smallest footprint: plans of residuals, optimizer state in host "
                   "memory, micro-batches",
                   "XLA:CPU" if opts.target == "cpu" else
                   f"XLA:GPU for a {opts.target} target, compiled here", table(rows), rows)


if __name__ == "__main__":
  main()
