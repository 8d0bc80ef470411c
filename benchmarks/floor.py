"""The smallest footprint jaxmem reaches per zoo model: by plans of the
residuals alone (the optimizer state on the device, the step whole:
``host_state=False, micro_batches=1``), with the optimizer state allowed in
host memory between steps, and with micro-batches too (the defaults; where
BatchNorm keeps the batch whole, layers' features in chunks instead), on
the target's compiler (XLA:GPU for a GPU target compiled here, or XLA:CPU).

For each model (the zoo's CPU sizes): the step's own footprint on the
target, the smallest footprint a fit reaches each way (the ``BudgetError``
of a budget below it names it; the compiler's figure), as fractions of the
step's own, the optimizer state's bytes, and the micro-batches of the
smallest. On XLA:CPU the state never moves (its host memory is its device
memory).

With ``--budgets`` (``33% 25%``), each model is fitted at those budgets
instead, with the default options: whether it fits, its footprint, its
micro-batches and, on a GPU target, the step time the target's clock
predicts for the fitted step over the step as written.

    python benchmarks/floor.py --models gpt2 resnet18 --target t4 --out DIR
    python benchmarks/floor.py --models gpt2 resnet18 --target cpu --out DIR
    python benchmarks/floor.py --models gpt2 vit --target t4 --budgets 33% 25% --out DIR

``--set dtype=bfloat16`` changes a zoo option of every model (GPT-2 then
trains in mixed precision, its float32 master weights cast where read).
"""

from __future__ import annotations

import argparse
import sys
import time

import jaxmem
import jax

from jaxmem.graph._graph import build_graph
from jaxmem.graph._state import optimizer_state
from jaxmem.targets import placed, xla_footprint

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import _results  # noqa: E402
from benchmarks._steps import compile_for, task, zoo_options  # noqa: E402

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


def at_budgets(name: str, config: dict, where: str, budgets) -> list[dict]:
  """One model fitted at each of ``budgets`` on ``where``."""
  target = None if where == "cpu" else where
  t = task(name, config)
  args = jax.eval_shape(t.init)
  rows = []
  for budget in budgets:
    start = time.perf_counter()
    row = dict(model=name, target=where, budget=budget)
    try:
      fit = jaxmem.transform(t.step, budget=budget, target=target).fit(
          *(args if target is None else placed(args, target)))
      row.update(fits=True, footprint=fit.footprint, share=fit.footprint / fit.unconstrained,
                 micro=1 if fit.micro is None else fit.micro.count,
                 region=bool(fit.micro and fit.micro.region),
                 features=bool(fit.micro and fit.micro.features),
                 predicted=(None if fit.predicted is None or not fit.unconstrained_predicted
                            else fit.predicted / fit.unconstrained_predicted))
    except jaxmem.BudgetError as err:
      row.update(fits=False, smallest=err.smallest)
    row["seconds"] = time.perf_counter() - start
    rows.append(row)
  return rows


def budget_table(rows) -> str:
  lines = ["| model | target | budget | fits | footprint (share) | chunks | predicted time "
           "over the step as written | fit s |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if not r["fits"]:
      lines.append(f"| {r['model']} | {r['target']} | {r['budget']} | no (smallest "
                   f"{r['smallest'] / MIB:.2f} MiB) | - | - | - | {r['seconds']:.0f} |")
      continue
    kind = ("feature chunks" if r.get("features") else
            "region chunks" if r["region"] else "micro-batches")
    chunks = "-" if r["micro"] == 1 else f"{r['micro']} {kind}"

    predicted = "-" if r["predicted"] is None else f"{r['predicted']:.2f}x"
    lines.append(f"| {r['model']} | {r['target']} | {r['budget']} | yes | "
                 f"{r['footprint'] / MIB:.2f} MiB ({r['share']:.0%}) | {chunks} | {predicted} | "
                 f"{r['seconds']:.0f} |")
  return "\n".join(lines)


def table(rows) -> str:
  lines = ["| model | target | step as written MiB | optimizer state MiB (leaves) | "
           "plans of residuals | + optimizer state in host memory | + micro-batches (or, with "
           "BatchNorm, layers' features in chunks) | "
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
  parser.add_argument("--budgets", nargs="*", default=[],
                      help="fit these budgets instead of finding the smallest footprint")
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="zoo options over the CPU sizes, such as dtype=bfloat16")
  parser.add_argument("--out", required=True)
  opts = parser.parse_args(argv)
  changed = zoo_options(opts.set)
  sizes = {name: {**config, **changed} for name, config in models().CPU_SIZES.items()}
  rows = []
  where = ("XLA:CPU" if opts.target == "cpu"
           else f"XLA:GPU for a {opts.target} target, compiled here")
  for name in opts.models if opts.budgets else ():
    rows += at_budgets(name, sizes.get(name, changed), opts.target, opts.budgets)
    print(budget_table(rows), flush=True)
    _results.write(opts.out, "benchmarks/floor.py", sys.argv[1:] if argv is None else argv,
                   "Budgets below the step's old floor", where, budget_table(rows), rows)
  for name in () if opts.budgets else opts.models:  # written after each model
    rows.append(row(name, sizes.get(name, changed), opts.target))
    print(table(rows[-1:]).splitlines()[-1], flush=True)
    _results.write(opts.out, "benchmarks/floor.py", sys.argv[1:] if argv is None else argv,
                   "The smallest footprint: plans of residuals, optimizer state in host "
                   "memory, micro-batches", where, table(rows), rows)


if __name__ == "__main__":
  main()
