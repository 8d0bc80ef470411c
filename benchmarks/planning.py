"""What planning costs, per zoo model: planners' time per budget and over a
sweep of budgets (compiles excluded), and what a transform compiles.

For each model (the zoo's CPU sizes, XLA:CPU):
* ``jit s``: ``jax.jit``'s compile of the step as written (tracing
  included; the median of three processes);
* for each budget: the transform's wall time (tracing, planning and
  compiles, or the time it takes to fail where the budget cannot be met)
  over that compile, and the backend compilations it made
  (``jax.monitoring``), with the default planner; each of these in a
  fresh process, as a user's run starts;
* for each planner: planning time at each of ``--sweep`` budgets spread
  from 95% to 30% of the model peak (planning only: one planner per model,
  as a fit keeps one), its first budget (pricing included) apart, the
  cost of its plans against the exact planner's, and each fitting plan's
  gap to the exact planner's bound at its own peak (``ILP.gap``: negative
  where the plan reaches outside the exact planner's choices; on the
  planner's own target, the hybrid's predicted time); the slowest budget
  is named, and the JSON rows hold each budget's time.

    python benchmarks/planning.py --models mlp gpt2 resnet18 --out DIR

``--set KEY=VALUE ...`` changes zoo options of every model (over its CPU
size); ``--jit-runs N`` times ``jax.jit``'s compile in N processes.
``--target t4`` (a name in ``jaxmem.PROFILES``) plans for that GPU, as
``transform(..., target=)`` does: compiles are XLA:GPU's for it, compiled
here, and the sweep plans on the memory model learned from its program of
the step as written, the plans costed by predicted time on it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jaxmem  # noqa: F401  (sets the XLA:CPU remat flag first)
import jax
import numpy as np

from jaxmem.cost._evaluate import unplanned_liveness
from jaxmem.graph._graph import build_graph
from jaxmem.fit._traced import modelled
from jaxmem.planners import ILP, get_planner
from jaxmem.targets import placed, resolve

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import _results  # noqa: E402
from benchmarks._steps import compilations, task, zoo_options  # noqa: E402

def _timed(fn):
  began, before = time.perf_counter(), compilations()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - began, compilations() - before


def transforms(name: str, budgets, sets=(), jit_runs: int = 3,
               target: str | None = None) -> list[dict]:
  """``jax.jit``'s compile (the median of ``jit_runs``) and the transform
  at each of ``budgets``, each in a fresh process (as a user's run starts:
  nothing traced or compiled), the zoo options ``sets`` (``KEY=VALUE``)
  over the model's CPU size; for ``target``'s compiler where given."""
  # A compile's time varies by a tenth or more from process to process.
  jit_s = float(np.median([_fresh(name, None, sets, target)["seconds"]
                           for _ in range(jit_runs)]))
  rows = []
  for budget in budgets:
    got = _fresh(name, budget, sets, target)
    rows.append(dict(model=name, kind="transform", budget=budget, jit_s=jit_s,
                     ratio=got["seconds"] / jit_s, **got))
  return rows


def _fresh(name: str, budget: str | None, sets=(), target: str | None = None) -> dict:
  """:func:`_measured` in a process of its own."""
  command = ([sys.executable, __file__, "--fresh", name] + ([budget] if budget else [])
             + (["--set", *sets] if sets else []) + (["--target", target] if target else []))
  done = subprocess.run(command, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def _measured(name: str, budget: str | None = None, sets=(), target: str | None = None) -> dict:
  """The zoo model ``name`` (CPU size, ``sets`` over it) compiled by
  ``jax.jit`` (``budget`` None), else transformed at ``budget`` and fitted:
  seconds and backend compilations, from its arguments made on (placed on
  ``target``'s topology, compile-only, where given)."""
  from jaxmem._zoo import models
  t = task(name, {**models().CPU_SIZES.get(name, {}), **zoo_options(sets)})
  args = (jax.block_until_ready(t.init()) if target is None
          else placed(jax.eval_shape(t.init), target))
  if budget is None:
    _, seconds, compiles = _timed(lambda: jax.jit(t.step).lower(*args).compile())
    return dict(seconds=seconds, compiles=compiles)
  fitted = jaxmem.transform(t.step, budget=budget, target=target)
  began, before = time.perf_counter(), compilations()
  try:
    _, seconds, compiles = _timed(lambda: fitted.fit(*args).footprint)
    fits = True
  except jaxmem.BudgetError:  # the time it takes to fail
    fits, seconds, compiles = False, time.perf_counter() - began, compilations() - before
  return dict(fits=fits, seconds=seconds, compiles=compiles)


def sweep(name: str, config: dict, planners, count: int, target: str | None = None) -> list[dict]:
  """Each of ``planners`` (set up for ``target`` where given, planning on
  the memory model learned from its compiler's program) over ``count``
  budgets: times, fits, and costs against the exact planner's."""
  t = task(name, config)
  graph = build_graph(jax.make_jaxpr(t.step)(*jax.eval_shape(t.init)))
  profile = None
  if target is not None:
    resolved = resolve(target, ())
    graph, profile = modelled(graph, resolved), resolved.profile
  base = unplanned_liveness(graph).peak
  fractions = np.linspace(0.95, 0.3, count)
  costs: dict = {}
  exact: dict = {}  # one exact planner per target, to cost plans against (untimed)
  rows = []
  for planner_name in planners:
    planner = get_planner(planner_name, profile)
    judge = exact.setdefault(planner.target, ILP(target=planner.target))
    times, gaps = [], []
    for fraction in fractions:
      began = time.perf_counter()
      found = planner.plan(graph, int(base * fraction))
      times.append(time.perf_counter() - began)
      costs[planner_name, fraction] = (found.fits, found.schedule)
      gap = judge.gap(graph, found).gap if found.fits else None
      if gap is not None:
        gaps.append(gap)
    fitting = [f for f in fractions if costs[planner_name, f][0]]
    slowest = int(np.argmax(times))
    rows.append(dict(model=name, kind="sweep", planner=planner_name, budgets=count,
                     first_s=times[0], rest_median_s=float(np.median(times[1:])),
                     total_s=float(sum(times)), fits=len(fitting),
                     slowest_s=times[slowest], slowest_at=float(fractions[slowest]),
                     per_budget=[dict(fraction=float(f), seconds=s,
                                      fits=bool(costs[planner_name, f][0]))
                                 for f, s in zip(fractions, times)],
                     gap_median=float(np.median(gaps)) if gaps else float("nan"),
                     gap_max=float(max(gaps)) if gaps else float("nan"),
                     gap_known=len(gaps)))
  # Every planner's plans in the exact planner's units (its target's time,
  # or recomputed FLOPs), whatever target a planner assumes.
  cost = get_planner("ilp", profile).cost
  for row in rows:
    both = [f for f in fractions if costs[row["planner"], f][0] and costs["ilp", f][0]]
    over = [cost(costs[row["planner"], f][1]) / max(cost(costs["ilp", f][1]), 1.0)
            for f in both]
    row["cost_over_ilp_median"] = float(np.median(over)) if over else float("nan")
    row["cost_over_ilp_min"] = float(min(over)) if over else float("nan")
  return rows


def table(rows) -> str:
  lines = ["| model | budget | fits | jit s | transform s | transform / jit | compilations |",
           "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['model']} | {r['budget']} | {'yes' if r['fits'] else 'NO'} | "
            f"{r['jit_s']:.2f} | {r['seconds']:.2f} | {r['ratio']:.2f} | {r['compiles']} |"
            for r in rows if r["kind"] == "transform"]
  if not any(r["kind"] == "sweep" for r in rows):
    return "\n".join(lines)
  lines += ["", "| model | planner | budgets fitted | first budget s | median s after | "
            "slowest s (at) | sweep total s | cost / ILP's (median, min) | gap to ILP bound "
            "(median, max; known) |", "|---|---|---|---|---|---|---|---|---|"]
  lines += [f"| {r['model']} | {r['planner']} | {r['fits']}/{r['budgets']} | "
            f"{r['first_s']:.2f} | {r['rest_median_s']:.2f} | "
            f"{r['slowest_s']:.2f} ({r['slowest_at']:.0%}) | {r['total_s']:.1f} | "
            f"{r['cost_over_ilp_median']:.2f}, {r['cost_over_ilp_min']:.2f} | "
            f"{r['gap_median']:+.1%}, {r['gap_max']:+.1%}; {r['gap_known']} |"
            for r in rows if r["kind"] == "sweep"]
  return "\n".join(lines)


def main(argv=None) -> None:
  from jaxmem._zoo import models
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["gpt2", "resnet18"])
  parser.add_argument("--budgets", nargs="+", default=["100%", "70%"])
  parser.add_argument("--planners", nargs="+", default=["ilp", "recompute"])
  parser.add_argument("--sweep", type=int, default=20,
                      help="budgets each planner plans (0: none, the transforms only)")
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="zoo options over the CPU sizes, such as depth=4")
  parser.add_argument("--jit-runs", type=int, default=3,
                      help="processes jax.jit's compile is timed in (the median)")
  parser.add_argument("--target", help="a GPU to plan for (a name in jaxmem.PROFILES)")
  parser.add_argument("--out")
  parser.add_argument("--fresh", nargs="+", metavar=("MODEL", "BUDGET"),
                      help=argparse.SUPPRESS)  # one measurement, for _fresh
  opts = parser.parse_args(argv)
  if opts.fresh:
    print(json.dumps(_measured(*opts.fresh, sets=opts.set, target=opts.target)))
    return
  if not opts.out:
    parser.error("--out is required")
  if "ilp" not in opts.planners:
    parser.error("--planners must include ilp (plans are costed against it)")
  rows = []
  for name in opts.models:
    config = {**models().CPU_SIZES.get(name, {}), **zoo_options(opts.set)}
    rows += transforms(name, opts.budgets, opts.set, opts.jit_runs, opts.target)
    if opts.sweep:  # 0: the transforms' rows only
      rows += sweep(name, config, opts.planners, opts.sweep, opts.target)
    print(table(rows), flush=True)
  _results.write(opts.out, "benchmarks/planning.py", sys.argv[1:] if argv is None else argv,
                 "What planning costs",
                 "XLA:CPU on this machine" if opts.target is None
                 else f"XLA:GPU for a {opts.target} target, compiled here", table(rows), rows)


if __name__ == "__main__":
  main()
