"""Columns moved between alike layers against every column priced: the
exact planner's table and plans on the memory model learned for a GPU.

For each zoo model (its CPU size, with ``--set`` options over it) on the
memory model learned from XLA:GPU's program for ``--target``, two exact
planners, each fresh: the default (columns of alike layers moved,
``jaxmem/planners/_alike.py``) and ``ILP(lazy=False)`` (every column
priced). Rows:

* ``table``: each one's table time, the choices and how many are moved;
  moved columns against priced ones (the largest difference at any
  equation, in KiB and as a share of the largest column) and their costs
  (the largest difference as a share of the step's predicted time), and
  the moved choices that free nothing priced (the priced table leaves them
  out, so they are not in those differences);
* ``plans``: at ``--budgets`` budgets spread from 95% to 30% of the model
  peak, in that order with each planner keeping its table, planning time
  (the first budget includes the table) and the plan's added cost (its
  predicted time over the step's) over the eager planner's.

    python benchmarks/alike.py --models gpt2 --set depth=12 --target t4 --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jaxmem  # noqa: F401  (sets the XLA:CPU remat flag first)
import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
from _steps import task, zoo_options  # noqa: E402

from jaxmem.cost._evaluate import paused_gc, unplanned_liveness  # noqa: E402
from jaxmem.fit._traced import modelled  # noqa: E402
from jaxmem.graph._graph import build_graph  # noqa: E402
from jaxmem.planners import ILP  # noqa: E402
from jaxmem.targets import resolve  # noqa: E402


def compare(name: str, config: dict, target: str, budgets: int) -> list[dict]:
  """The two planners' tables and plans for one model (see the module
  docstring)."""
  t = task(name, config)
  resolved = resolve(target, ())
  graph = modelled(build_graph(jax.make_jaxpr(t.step)(*jax.eval_shape(t.init))), resolved)
  moving, eager = ILP(target=resolved.profile), ILP(target=resolved.profile, lazy=False)
  with paused_gc():
    seconds = {}
    for label, planner in (("moving", moving), ("eager", eager)):
      began = time.perf_counter()
      planner.table(graph)
      seconds[label] = time.perf_counter() - began
  mine, all_priced = moving.table(graph), eager.table(graph)
  at = {c: i for i, c in enumerate(all_priced.choices)}
  # A moved choice the priced table leaves out frees nothing once priced.
  freeing = [i for i in np.flatnonzero(mine.moved) if mine.choices[i] in at]
  moved, unfreeing = np.array(freeing, dtype=int), int(mine.moved.sum()) - len(freeing)
  largest = max(np.abs(all_priced.delta).max(), 1.0)
  column = max((np.abs(mine.delta[:, i] - all_priced.delta[:, at[mine.choices[i]]]).max()
                for i in moved), default=0.0)
  cost = max((abs(mine.cost[i] - all_priced.cost[at[mine.choices[i]]]) for i in moved),
             default=0.0)
  rows = [dict(model=name, kind="table", config=config, moving_s=seconds["moving"],
               eager_s=seconds["eager"], choices=len(mine.choices), moved=int(mine.moved.sum()),
               unfreeing=unfreeing,
               column_kib=column / 1024, column_share=column / largest,
               cost_share=cost / all_priced.base_cost)]
  peak = unplanned_liveness(graph).peak
  base = all_priced.base_cost
  for fraction in np.linspace(0.95, 0.3, budgets):
    found = {}
    for label, planner in (("moving", moving), ("eager", eager)):
      began = time.perf_counter()
      plan = planner.plan(graph, int(peak * fraction))
      found[label] = (plan, time.perf_counter() - began)
    (got, got_s), (want, want_s) = found["moving"], found["eager"]
    ratio = ((moving.cost(got.schedule) - base) / max(eager.cost(want.schedule) - base, 1.0)
             if got.fits and want.fits else None)
    rows.append(dict(model=name, kind="plans", fraction=float(fraction), fits=got.fits,
                     eager_fits=want.fits, moving_s=got_s, eager_s=want_s,
                     added_cost_ratio=ratio, moved=got.details.moved))
  return rows


def table(rows: list) -> str:
  lines = ["| model | table s (moved / all priced) | choices | moved | of those, freeing nothing "
           "priced | moved column, largest difference | moved cost, largest difference (of "
           "the step's time) |", "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['model']} {_options(r['config'])} | {r['moving_s']:.1f} / {r['eager_s']:.1f} | "
            f"{r['choices']} | {r['moved']} | {r['unfreeing']} | {r['column_kib']:.1f} KiB "
            f"({r['column_share']:.2%}) | {r['cost_share']:.3%} |"
            for r in rows if r["kind"] == "table"]
  lines += ["", "| model | budget | fits (moved / all priced) | planning s (moved / all priced) | "
            "added cost, moved over all priced | columns left moved |", "|---|---|---|---|---|---|"]
  lines += [f"| {r['model']} | {r['fraction']:.0%} | {_yes(r['fits'])} / {_yes(r['eager_fits'])} | "
            f"{r['moving_s']:.2f} / {r['eager_s']:.2f} | "
            f"{'-' if r['added_cost_ratio'] is None else format(r['added_cost_ratio'], '.4f')} | "
            f"{r['moved']} |" for r in rows if r["kind"] == "plans"]
  return "\n".join(lines)


def _yes(fits: bool) -> str:
  return "yes" if fits else "no"


def _options(config: dict) -> str:
  return ", ".join(f"{k}={v}" for k, v in sorted(config.items()))


def main(argv=None) -> None:
  from jaxmem._zoo import models
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["gpt2"])
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="zoo options over the CPU sizes, such as depth=12")
  parser.add_argument("--target", default="t4", help="a name in jaxmem.PROFILES")
  parser.add_argument("--budgets", type=int, default=6)
  parser.add_argument("--out", required=True)
  opts = parser.parse_args(argv)
  rows = []
  for name in opts.models:
    config = {**models().CPU_SIZES.get(name, {}), **zoo_options(opts.set)}
    rows += compare(name, config, opts.target, opts.budgets)
    print(table(rows), flush=True)
  _results.write(opts.out, "benchmarks/alike.py", sys.argv[1:] if argv is None else argv,
                 "Columns moved between alike layers against every column priced",
                 f"XLA:GPU for a {opts.target} target, compiled here", table(rows), rows)


if __name__ == "__main__":
  main()
