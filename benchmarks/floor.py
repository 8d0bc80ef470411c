"""The smallest footprint jaxmem reaches per zoo model, with the optimizer
state kept on the device (``host_state=False``) and allowed in host memory
between steps (the default), on XLA:GPU for a GPU target compiled here.

For each model (the zoo's CPU sizes): the step's own
footprint on the target, the smallest footprint a fit reaches each way
(the ``BudgetError`` of a budget below it names it; XLA:GPU's figure), both
as fractions of the step's own, and the optimizer state's bytes. On XLA:CPU
the state never moves (its host memory is its device memory), so the
target is a GPU.

    python benchmarks/floor.py --models gpt2 resnet18 --target t4 --out DIR
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


def smallest(step, args, target: str, host_state: bool) -> tuple[int, float]:
  """The smallest footprint a fit of ``step`` reaches on ``target`` (a budget
  of one byte names it), and the seconds the search took."""
  start = time.perf_counter()
  try:
    fit = jaxmem.transform(step, budget=1, target=target, reserve=0,
                           host_state=host_state).fit(*args)
    return fit.footprint, time.perf_counter() - start
  except jaxmem.BudgetError as err:
    return err.smallest, time.perf_counter() - start


def row(name: str, config: dict, target: str) -> dict:
  t = task(name, config)
  args = jax.eval_shape(t.init)
  compiled, _, _ = compile_for(t.step, args, target)
  unconstrained = xla_footprint(compiled)
  state = optimizer_state(build_graph(jax.make_jaxpr(t.step)(*args)))
  on_device, device_s = smallest(t.step, args, target, host_state=False)
  hosted, hosted_s = smallest(t.step, args, target, host_state=True)
  return dict(model=name, target=target, unconstrained=unconstrained,
              state_bytes=sum(leaf.nbytes for leaf in state), state_leaves=len(state),
              smallest_state_on_device=on_device, smallest=hosted,
              before=on_device / unconstrained, after=hosted / unconstrained,
              seconds_before=device_s, seconds_after=hosted_s)


def table(rows) -> str:
  lines = ["| model | target | step as written MiB | optimizer state MiB (leaves) | "
           "smallest, state on device | smallest, state may go to host | search s (before, after) |",
           "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['model']} | {r['target']} | {r['unconstrained'] / MIB:.2f} | "
            f"{r['state_bytes'] / MIB:.2f} ({r['state_leaves']}) | "
            f"{r['smallest_state_on_device'] / MIB:.2f} MiB ({r['before']:.0%}) | "
            f"{r['smallest'] / MIB:.2f} MiB ({r['after']:.0%}) | "
            f"{r['seconds_before']:.0f}, {r['seconds_after']:.0f} |" for r in rows]
  return "\n".join(lines)


def main(argv=None) -> None:
  from jaxmem._zoo import models
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["gpt2", "resnet18", "vit", "mobilenetv2"])
  parser.add_argument("--target", default="t4")
  parser.add_argument("--out", required=True)
  opts = parser.parse_args(argv)
  sizes = models().CPU_SIZES
  rows = []
  for name in opts.models:  # written after each model: a long run keeps what it has
    rows.append(row(name, sizes.get(name, {}), opts.target))
    print(table(rows[-1:]).splitlines()[-1], flush=True)
    _results.write(opts.out, "benchmarks/floor.py", sys.argv[1:] if argv is None else argv,
                   "The smallest footprint, optimizer state on the device or in host memory",
                   f"XLA:GPU for a {opts.target} target, compiled here", table(rows), rows)


if __name__ == "__main__":
  main()
