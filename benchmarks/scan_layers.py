"""Planning and compile time of a scanned transformer as its depth grows.

For each depth L, the zoo's GPT-2 with ``scan=True`` (one ``nn.scan`` over
the blocks) is compiled by ``jax.jit`` as written and fitted by
``jaxmem.transform`` at a budget (planning, every compilation of the fit
loop and the final compile); the table gives both times, their ratio and
the footprints (XLA's, of the step as written and as fitted). A planner
that plans inside the loop, not over unrolled layers, keeps the ratio flat
as L grows (issue 17). Medians of ``--repeats`` runs, each in a fresh trace
and compile (JAX's caches cleared).

  python benchmarks/scan_layers.py --depths 8 32 128 --budget 60% \\
      --out benchmarks/results/scan-layers-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jaxmem  # noqa: F401  (sets the XLA:CPU remat flag first)
import jax

from jaxmem._budget import format_bytes
from jaxmem.targets import xla_footprint
from jaxmem._flags import compiler_options
from jaxmem._zoo import models as _models

from jaxmem._provenance import provenance

CONFIG = dict(dim=64, heads=2, seq=64, vocab=256, batch=8)


def _timed(fn) -> tuple[float, object]:
  jax.clear_caches()
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def measure(depth: int, budget: str, repeats: int) -> dict:
  """One depth: compile and fit times (medians) and footprints."""
  task = _models().get("gpt2", scan=True, depth=depth, **CONFIG)
  state, batch = jax.eval_shape(task.init)
  options = compiler_options(jax.default_backend()) or None
  compile_s, fit_s = [], []
  for _ in range(repeats):
    seconds, compiled = _timed(lambda: jax.jit(task.step, compiler_options=options)
                               .lower(state, batch).compile())
    compile_s.append(seconds)
    seconds, fit = _timed(lambda: jaxmem.transform(task.step, budget=budget)
                          .fit(state, batch))
    fit_s.append(seconds)
  jit_time, fit_time = statistics.median(compile_s), statistics.median(fit_s)
  return {"depth": depth, "jit_s": jit_time, "jaxmem_s": fit_time,
          "ratio": fit_time / jit_time, "footprint": xla_footprint(compiled),
          "fitted": fit.footprint, "budget": fit.budget,
          "scan_kept": "scan[" in str(jax.make_jaxpr(fit.nested)(state, batch))}


def markdown(result: dict) -> str:
  lines = [f"Scanned GPT-2 ({result['config']}) fitted at {result['budget']}; "
           f"`{result['provenance']['command']}` at {result['provenance']['commit']}"
           f"{' (dirty)' if result['provenance']['dirty'] else ''}.", "",
           "| L | jax.jit compile s | jaxmem fit s | ratio | XLA footprint | fitted | "
           "still a scan |", "|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    lines.append(f"| {r['depth']} | {r['jit_s']:.2f} | {r['jaxmem_s']:.2f} | "
                 f"{r['ratio']:.1f} | {format_bytes(r['footprint'])} | "
                 f"{format_bytes(r['fitted'])} | {r['scan_kept']} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--depths", type=int, nargs="+", default=[8, 32, 128])
  parser.add_argument("--budget", default="60%")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", help="folder for results.json and results.md")
  args = parser.parse_args(argv)
  rows = []
  for depth in args.depths:
    rows.append(measure(depth, args.budget, args.repeats))
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  result = {"provenance": provenance("benchmarks/scan_layers.py", argv),
            "config": CONFIG, "budget": args.budget, "rows": rows}
  text = markdown(result)
  print(text)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
      f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
