"""``jaxmem-bench``: fit a model's train step into budgets and compare methods.

Run ``jaxmem-bench --help`` (or ``python -m jaxmem.bench``). For one model
it measures the unconstrained step, then every method at every budget:
whether it fits (XLA's compiled footprint, and jaxmem's prediction), the
step time as a ratio to the unconstrained step of the same run, FLOPs from
XLA's cost analysis as a ratio, planning time and, with ``--max-batch``, the
largest batch that fits the first budget. Methods: ``unconstrained``,
``remat:<policy>`` (per-block ``nn.remat``, for models with blocks) and
``jaxmem:<planner>``. Progress goes to stderr; the table to stdout;
``--json`` and ``--plot`` write the figures and plots.

The default run (a residual MLP at 70% and 50%) takes about a minute on two
CPU cores. On CPU the step times are CPU times, which say little of a GPU's;
each is timed in pairs with the unconstrained step, so the ratios hold on a
CPU whose speed drifts.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import dataclasses
import importlib.util
import json
import platform
import sys
import time

import jaxmem  # sets the XLA:CPU remat flag before JAX starts

import jax

from jaxmem._benchmark import SERIES, Bench, Method, Row, default_methods
from jaxmem import _zoo
from jaxmem._budget import Budget, format_bytes
from jaxmem._provenance import provenance
from jaxmem.targets import PROFILES
from jaxmem.planners import DEFAULT_TARGET

# Where the main job writes its plots unless told otherwise.
_PLOTS = "jaxmem-bench-plots"


def _parse_config(items) -> dict:
  config = {}
  for item in items or ():
    key, sep, value = item.partition("=")
    if not sep:
      raise SystemExit(f"jaxmem-bench: --config takes KEY=JSON items, got {item!r} "
                       "(e.g. depth=24 batch=512 widths=[8,16])")
    try:
      config[key] = json.loads(value)
    except json.JSONDecodeError:
      config[key] = value  # a bare string such as norm=group
  return config


def _cell(value, fmt) -> str:
  return "-" if value is None else fmt(value)


def _ratio(value) -> str:
  return f"{value:.2f}"


# (header, width, cell of a row), in the table's order.
_COLUMNS = (
    ("fits", 5, lambda r: "yes" if r.fits else "NO"),
    # An offload plan on a backend that ignores host memory has no XLA
    # figure to show: its fit is judged on the model's (``Row``).
    ("XLA", 11, lambda r: "n/a*" if r.footprint_modelled else _cell(r.xla_bytes, format_bytes)),
    ("model", 10, lambda r: _cell(r.model_bytes, format_bytes)),
    ("time x", 7, lambda r: _cell(r.time_ratio, _ratio)),
    ("pred x", 7, lambda r: _cell(r.predicted_ratio, _ratio)),
    ("FLOPs x", 8, lambda r: _cell(r.flops_ratio, _ratio)),
    ("plan s", 7, lambda r: _cell(r.planning_s, "{:.1f}".format)),
    ("max batch", 9, lambda r: _cell(r.max_batch, str)),
)


def table(rows: list[Row]) -> str:
  """The readable table of a run's rows; a column with no figure in any
  row (``pred x`` without a target, ``max batch`` without the search) is
  left out."""
  width = max([7] + [len(r.budget) for r in rows])
  columns = [(name, w, cell) for name, w, cell in _COLUMNS
             if any(cell(r) != "-" for r in rows)]
  header = f"{'method':<40} {'budget':>{width}} " + " ".join(
      f"{name:>{w}}" for name, w, _ in columns)
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(f"{r.method:<40} {r.budget:>{width}} " + " ".join(
        f"{cell(r):>{w}}" for _, w, cell in columns))
  return "\n".join(lines)


def _parser(models) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxmem-bench",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="mlp", choices=sorted(models.REGISTRY))
  parser.add_argument("--config", nargs="*", metavar="KEY=JSON",
                      help="model options, e.g. depth=24 batch=512")
  parser.add_argument("--budgets", nargs="+", default=["70%", "50%"],
                      help="fractions of the unconstrained footprint or sizes (3GiB)")
  parser.add_argument("--methods", nargs="+", metavar="METHOD",
                      help="default: unconstrained, the model's remat baselines, "
                           "every jaxmem planner")
  parser.add_argument("--repeats", type=int, default=5, help="timed runs per step")
  parser.add_argument("--max-batch", action="store_true",
                      help="search each method's largest batch at the first budget")
  parser.add_argument("--target", metavar="PROFILE",
                      help="plan for this target's profile (" + ", ".join(sorted(PROFILES))
                           + ", or 'calibrate' to measure this machine's) and report "
                           "the step time it predicts beside the measured one; the "
                           "hybrid, offload and lgm planners use "
                           f"{DEFAULT_TARGET} without it")
  parser.add_argument("--at-baselines", action="store_true",
                      help="also run every jaxmem planner at each remat baseline's own "
                           "footprint (step times compared at equal memory)")
  parser.add_argument("--json", metavar="PATH", help="write the results here")
  parser.add_argument("--plot", metavar="DIR", default=_PLOTS,
                      help="write plots here: each plan's memory timeline and step time "
                           f"against footprint (default {_PLOTS}/ where matplotlib is "
                           "installed; --plot '' writes none)")
  parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
  return parser


def run(opts) -> dict:
  """Measures what ``opts`` asks for; returns the JSON-ready result. Unless
  ``--quiet``, progress goes to stderr (:func:`jaxmem.progress`): the run's
  steps and each plan and compilation of every fit."""
  if opts.quiet:
    return _run(opts, lambda line: None)
  with jaxmem.progress() as shown:
    return _run(opts, shown.say)


def _run(opts, progress) -> dict:
  source = provenance("-m jaxmem.bench", sys.argv[1:])  # the code as the run starts
  models = _zoo.models()
  config = _parse_config(opts.config)
  methods = ([Method.parse(m) for m in opts.methods] if opts.methods
             else default_methods(opts.model))
  budgets = [(text, Budget.parse(text)) for text in opts.budgets]
  started = time.time()
  progress(f"{opts.model}: compiling and timing the unconstrained step")
  target = opts.target
  if target == "calibrate":
    progress("calibrating this device")
    target = jaxmem.calibrate()
  elif target is not None and target not in PROFILES:
    raise SystemExit(f"jaxmem-bench: unknown --target {target!r}; expected one of "
                     f"{sorted(PROFILES)} or 'calibrate'")
  bench = Bench(opts.model, config, opts.repeats, progress, target)
  rows = []
  for method in methods:
    for text, budget in budgets:
      rows.append(bench.measure(method, text, budget.resolve(bench.unconstrained)))
    if opts.max_batch:
      budget_bytes = budgets[0][1].resolve(bench.unconstrained)
      best = bench.max_batch(method, budget_bytes)
      for row in rows:
        if row.method == method.name and row.budget == budgets[0][0]:
          row.max_batch = best
  if opts.at_baselines:
    for baseline in (m for m in methods if m.kind == "remat"):
      footprint = bench.footprint(baseline)
      for method in (m for m in methods if m.kind == "jaxmem"):
        rows.append(bench.measure(method, baseline.name, footprint))
  return {
      "model": opts.model, "config": {**models.options(opts.model), **config},
      "unconstrained_bytes": bench.unconstrained,
      "unconstrained_step_ms": bench.base_seconds * 1e3,
      "unconstrained_flops": bench.base_flops,
      "rows": rows, "seconds": time.time() - started,
      "target_profile": None if bench.target is None else dataclasses.asdict(bench.target),
      "command": " ".join(["jaxmem-bench"] + sys.argv[1:]),
      "provenance": source,
      "date": time.strftime("%Y-%m-%d %H:%M:%S"),
      "machine": {"backend": jax.default_backend(),
                  "devices": [d.device_kind for d in jax.devices()],
                  "platform": platform.platform(), "python": platform.python_version()},
      "versions": {name: importlib.metadata.version(name)
                   for name in ("jax", "jaxlib", "flax", "optax", "jaxmem")},
  }


def save(result: dict, opts) -> None:
  """Writes ``--plot`` plots and the ``--json`` file of a run, if asked."""
  rows = result["rows"]
  if opts.plot and importlib.util.find_spec("matplotlib") is not None:
    from jaxmem import _plots
    for path in _plots.write_all(result, rows, opts.plot):
      print(f"plot: {path}")
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump({**result, "rows": [
          {k: v for k, v in dataclasses.asdict(r).items() if k not in SERIES}
          for r in rows]}, f, indent=2)
    print(f"json: {opts.json}")


def main(argv=None) -> int:
  models = _zoo.models()
  opts = _parser(models).parse_args(argv)
  result = run(opts)
  rows = result["rows"]
  print(f"jaxmem-bench: {result['model']} {result['config']}")
  print(f"backend {result['machine']['backend']}, jax {result['versions']['jax']}; "
        f"unconstrained step {format_bytes(result['unconstrained_bytes'])}, "
        f"{result['unconstrained_step_ms']:.1f} ms\n")
  print(table(rows))
  cpu = result["machine"]["backend"] == "cpu"
  print("\nXLA = compiled footprint (temp + args + outputs - aliases); for a method "
        "that does not fit, the smallest it reaches"
        + ("; n/a* = an offload plan on a backend that ignores host memory, where "
           "XLA's figure would count the host copies on the device: its fit is judged "
           "on the model's figure" if any(r.footprint_modelled for r in rows) else "")
        + ". model = jaxmem's prediction. time x = the median over runs of the step's "
        "time over the unconstrained step's, timed in pairs"
        + (" (CPU time: what this CPU measured, which says little of a GPU's)"
           if cpu else "")
        + "; FLOPs x = XLA's count over the unconstrained step's"
        + ("; pred x = the step time the target's profile predicts, over its prediction "
           "for the unconstrained step" if any(r.predicted_ratio is not None for r in rows)
           else "") + ".")
  if result["target_profile"] is None:
    print(f"No --target given: jaxmem planners that time copies (hybrid, offload, lgm) "
          f"plan for the {DEFAULT_TARGET} profile; pass --target PROFILE "
          f"({', '.join(sorted(PROFILES))}) or --target calibrate.")
  save(result, opts)
  return 0


if __name__ == "__main__":
  sys.exit(main())
