"""One command that checks jaxmem's plans on a real GPU.

For the zoo's edge-size configurations x budgets (70%, 50%, 33% of the
unmodified step's compiled footprint on this device) x methods (the
unmodified step; per-block ``nn.remat`` policies, the ``offload_*`` ones
included; jaxmem's default planner ``auto`` and its ``ilp``, ``recompute``,
``hybrid`` and ``lgm`` planners; XLA's own rematerialization given the same
limit), it records:

* the compiled footprint and host bytes (``memory_analysis()``) and how many
  buffers the HLO puts in host memory (``S(5)``);
* the allocator's measured peak (``memory_stats()["peak_bytes_in_use"]``,
  no preallocation, each configuration in a process of its own) against the
  budget: a larger peak is a reported violation, an out-of-memory error a
  reported failure, neither stops the run;
* the median step time, as a ratio to the unmodified step, beside the
  performance model's prediction on a profile calibrated on this device
  (``jaxmem.calibrate()``, run first) and on the nearest preset (``h100``);
* (full run) the largest batch two models reach under a fixed budget.

The budget emulates an edge card's memory on a large GPU: the process may
use more, and the measured peak says whether it did.

It runs from the source tree as it is, installing nothing, on the JAX that
is there (``PYTHONPATH=. python benchmarks/gpu.py``). ``--dry-run`` walks
the same configurations through lowering and planning only, on any backend
(CI runs ``--dry-run --quick`` on CPU), so the script is known to work before
it meets a GPU.

Results: ``results.json`` and ``results.md`` under ``--out`` (default
``benchmarks/results/gpu-check-<device>/``), with the command, the date, the commit and
whether the tree was dirty (``JAXMEM_COMMIT`` / ``JAXMEM_DIRTY`` name them
where the tree has no ``.git``).

Examples:
  PYTHONPATH=. python benchmarks/gpu.py --quick          # <= 5 minutes on one GPU
  PYTHONPATH=. python benchmarks/gpu.py                  # <= 20 minutes
  python benchmarks/gpu.py --dry-run --quick --out /tmp/gpu-dry
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import tempfile
import time

from jaxmem._provenance import provenance
from jaxmem.targets import PROFILES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "gpu_worker.py")
MEM_FRACTION = 0.9  # the allocator's limit as a share of device memory
AUTOTUNE_CACHE = os.path.join(tempfile.gettempdir(), "jaxmem-gpu-check-autotune")

# Edge-size configurations: the unmodified step takes about 4-7 GiB
# (an 8 GiB card); activations dominate it.
CONFIGS = {
    "gpt2": dict(dim=512, depth=6, heads=8, seq=512, vocab=8192, batch=16),
    "vit": dict(dim=384, depth=6, heads=6, patch=8, size=128, batch=64),
    "resnet18": dict(width=64, size=224, batch=64),
    "mobilenetv2": dict(width=1.0, size=224, batch=64),
    "unet": dict(width=32, depth=4, size=256, batch=16),
    # The same GPT-2 with its blocks in one nn.scan: jaxmem plans inside the
    # loop (rebuilt or hosted per iteration; per-layer plans), the remat
    # policies are nn.scan(nn.remat(Block, policy)).
    "gpt2-scan": dict(zoo="gpt2", dim=512, depth=6, heads=8, seq=512, vocab=8192, batch=16,
                      scan=True),
}
# Same numbers: each run's update figures (per float leaf of the state, the
# update's norm and its product with a fixed random probe; then the loss)
# against the unmodified step's. On CPU each figure is within NUMBERS_RTOL of
# its own (judged against the largest where a leaf's own is rounding noise).
# On a GPU two programs of the same step round differently (fusion reorders
# sums, autotuning picks other convolution algorithms, f32 matmuls run in
# TF32), and Adam's normalized update turns a near-zero gradient's rounding
# into a full step of the other sign: leaves' norms hold, their probes' products
# move. There the figures' differences together, over the updates' whole norm,
# are within NUMBERS_GPU_RTOL: exact rewrites measured 3e-5 to 0.1 on an H100
# (XLA's own remat of ResNet-18: 0.097); one layer's update permuted or
# doubled moves it by about the square root of that layer's share of the norm.
NUMBERS_RTOL = 1e-3
NUMBERS_GPU_RTOL = 0.15
CLOCK_RTOL = 0.15  # the clock's predicted step time against the measured one
# The clock's slowdown of a method (its time over the unmodified step's)
# against the measured slowdown: what ranks one model's plans.
SLOWDOWN_RTOL = 0.05
BUDGETS = ("70%", "50%", "33%")
REMAT = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
         "offload_dot_with_no_batch_dims", "save_and_offload_only_these_names")
PLANNERS = ("auto", "ilp", "recompute", "hybrid", "lgm")
MAX_BATCH = ("gpt2", "resnet18")  # models whose max batch the full run finds
# compared at the unmodified footprint: jaxmem's fastest planner beside the
# per-block remat that reaches least memory
MAX_BATCH_METHODS = ("unconstrained", "remat:nothing_saveable", "jaxmem:recompute")



def configs(cpu_sizes: bool) -> dict:
  """Each model's configuration: the edge sizes above, or (``--cpu-sizes``)
  the zoo's CPU sizes, which plan and compile in seconds: a dry run of the
  script itself."""
  if not cpu_sizes:
    return CONFIGS
  from jaxmem._zoo import models
  sizes = models().CPU_SIZES
  return {name: dict(sizes[config.get("zoo", name)], **{
      k: v for k, v in config.items() if k in ("zoo", "scan")}) for name, config in CONFIGS.items()}


QUICK = dict(models=("gpt2", "resnet18"), budgets=("50%",),
             remat=("dots_saveable", "offload_dot_with_no_batch_dims"),
             planners=("auto", "lgm"), max_batch=())


class Runner:
  """Launches worker processes (see ``gpu_worker.py``)."""

  def __init__(self, dry_run: bool, repeats: int, timeout: float, lock: str | None,
               log=print, target: str | None = None, autotune_cache: str | None = None):
    self.dry_run, self.repeats, self.timeout, self.lock = dry_run, repeats, timeout, lock
    self.target = target
    self.log = log
    self.partial = None  # a JSON-lines file each record is appended to as it comes
    self.env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                    XLA_PYTHON_CLIENT_MEM_FRACTION=str(MEM_FRACTION),
                    PYTHONPATH=os.pathsep.join(
                        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    flags = self.env.get("XLA_FLAGS", "")
    if autotune_cache and "autotune_cache_dir" not in flags:
      # XLA:GPU autotunes every compilation on the device; the workers share
      # its results through this folder (one H200 run: 2.4-3.8x faster
      # compiles of the same step on a folder a run before left).
      os.makedirs(autotune_cache, exist_ok=True)
      self.env["XLA_FLAGS"] = (
          f"{flags} --xla_gpu_per_fusion_autotune_cache_dir={autotune_cache}").strip()

  def save(self, row: dict) -> None:
    """Appends ``row`` to the run's JSON-lines file (once it has one)."""
    if self.partial:
      with open(self.partial, "a") as handle:
        handle.write(json.dumps(row, default=str) + "\n")

  def __call__(self, job: dict) -> dict:
    job = dict(job, dry_run=self.dry_run, repeats=self.repeats, lock=self.lock,
               target=self.target)
    label = " ".join(str(job[k]) for k in ("model", "method", "budget") if k in job)
    start = time.perf_counter()
    try:
      done = subprocess.run([sys.executable, WORKER], input=json.dumps(job), text=True,
                            capture_output=True, timeout=self.timeout, env=self.env)
      marker = done.stdout.rfind("@@RESULT@@")
      if marker < 0:
        record = {"status": "crashed", "error": (done.stderr or "")[-2000:],
                  "returncode": done.returncode}
      else:
        record = json.loads(done.stdout[marker + len("@@RESULT@@"):])
    except subprocess.TimeoutExpired:
      record = {"status": "timeout", "error": f"over {self.timeout:.0f} s"}
    record["wall_s"] = time.perf_counter() - start
    row = {**{k: v for k, v in job.items() if k not in ("profile", "lock")}, **record}
    self.save(row)
    self.log(f"  {label or job['kind']}: {record['status']} ({record['wall_s']:.0f} s)"
             + (f" {record.get('error', '')[:160]}" if record["status"] not in ("ok", "no-fit")
                else ""))
    return row


def _budget_bytes(label: str, unconstrained: int) -> int:
  return int(unconstrained * float(label.rstrip("%")) / 100)


def _slop(budget: int, device_memory: int | None) -> int:
  """XLA:GPU's memory-limit percentage nearest under ``budget``: its limit
  is about 80% of device memory times the percentage."""
  if not device_memory:
    return 1
  return max(1, math.floor(budget / (0.8 * device_memory) * 100))


def plan_jobs(plan: dict, baselines: dict, device_memory: int | None, profile) -> list:
  """Every measurement after the unmodified steps, longest first."""
  jobs = []
  for model in plan["models"]:
    base = baselines[model]
    common = dict(kind="measure", model=model, config=plan["configs"][model], profile=profile)
    if not base.get("footprint"):
      continue
    for policy in plan["remat"]:
      jobs.append(dict(common, method=f"remat:{policy}", budget="-", budget_bytes=None))
    for label in plan["budgets"]:
      budget = _budget_bytes(label, base["footprint"])
      at = dict(common, budget=label, budget_bytes=budget)
      jobs += [dict(at, method=f"jaxmem:{p}") for p in plan["planners"]]
      jobs.append(dict(at, method="xla:remat", slop=_slop(budget, device_memory)))
  for model in plan["max_batch"]:
    base = baselines.get(model, {})
    if not base.get("footprint"):
      continue
    batch = plan["configs"][model]["batch"]
    for method in MAX_BATCH_METHODS:
      jobs.insert(0, dict(kind="maxbatch", model=model, config=plan["configs"][model],
                          method=method, budget="100%", budget_bytes=base["footprint"],
                          step=max(batch // 2, 1), limit=3 * batch, profile=profile))
  return jobs


def run(plan: dict, runner: Runner, workers: int, out: str | None,
        provenance: dict) -> tuple[list[dict], str]:
  """Environment, calibration, unmodified steps, then everything else: every
  record, in the order it came, and the results folder. Each record is also
  appended to ``rows.jsonl`` there as it comes (a run cut short keeps what it
  measured; ``--render`` makes the tables from it)."""
  env = runner({"kind": "env"})
  out = out or _default_out(env)
  os.makedirs(out, exist_ok=True)
  runner.partial = os.path.join(out, "rows.jsonl")
  rows = [dict(provenance, kind="provenance", status="ok", plan=plan), env]
  for row in rows:
    runner.save(row)
  profile = None
  if not runner.dry_run and env.get("backend") not in (None, "cpu"):
    rows.append(runner({"kind": "calibrate"}))
    profile = rows[-1].get("profile")
  device_memory = (env.get("bytes_limit") or 0) / MEM_FRACTION or None
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    first = [dict(kind="measure", model=m, config=plan["configs"][m], method="unconstrained",
                  budget="-", budget_bytes=None, profile=profile)
             for m in dict.fromkeys(plan["models"] + plan["max_batch"])]
    baselines = {r["model"]: r for r in pool.map(runner, first)}
    rows += list(baselines.values())
    rows += list(pool.map(runner, plan_jobs(plan, baselines, device_memory, profile)))
  return rows, out


def assemble(rows: list[dict]) -> dict:
  """The results document from a run's records: provenance, environment,
  calibrated profile, and the measurements with step-time ratios to each
  model's unmodified step."""
  first = lambda kind: next((r for r in rows if r["kind"] == kind), {})
  measured = [dict(r) for r in rows if r["kind"] in ("measure", "maxbatch")]
  base = {r["model"]: r for r in measured if r.get("method") == "unconstrained"
          and r["kind"] == "measure"}
  backend = first("env").get("backend")
  for row in measured:
    unmodified = base.get(row["model"], {})
    if row.get("step_ms") and unmodified.get("step_ms"):
      row["time_ratio"] = row["step_ms"] / unmodified["step_ms"]
    if row.get("step_ms") and row.get("clock_ms_calibrated"):
      row["clock_ratio"] = row["clock_ms_calibrated"] / row["step_ms"]
    if row.get("time_ratio") and row.get("clock_ms_calibrated") and \
        unmodified.get("clock_ms_calibrated"):
      row["clock_slowdown"] = row["clock_ms_calibrated"] / unmodified["clock_ms_calibrated"]
    if row["kind"] == "measure" and row.get("update_norms") and unmodified.get("update_norms"):
      row["numbers_error"] = numbers_error(row["update_norms"], unmodified["update_norms"],
                                           backend)
      row["same_numbers"] = row["numbers_error"] <= _numbers_rtol(backend)
  provenance = {k: first("provenance").get(k) for k in ("command", "commit", "dirty", "date")}
  return {"provenance": provenance, "plan": first("provenance").get("plan"),
          "environment": first("env"), "profile": first("calibrate").get("profile"),
          "rows": measured}


def numbers_error(got: list, want: list, backend: str | None = "cpu") -> float:
  """Relative difference of two runs' update figures, to hold against
  ``NUMBERS_RTOL`` on CPU and ``NUMBERS_GPU_RTOL`` elsewhere (see there; the
  last figure is the loss, always compared with itself); infinite where they
  do not line up."""
  if len(got) != len(want):
    return math.inf
  loss = abs(got[-1] - want[-1]) / max(abs(want[-1]), 1e-30)
  if backend != "cpu":
    moved = sum((g - w) ** 2 for g, w in zip(got[:-1], want[:-1]))
    whole = sum(w * w for w in want[:-1:2])
    return max(math.sqrt(moved / max(whole, 1e-60)), loss)
  floor = 1e-3 * max((abs(w) for w in want[:-1]), default=0.0)
  return max([abs(g - w) / max(abs(w), floor, 1e-30) for g, w in zip(got[:-1], want[:-1])]
             + [loss])


def _numbers_rtol(backend: str | None) -> float:
  return NUMBERS_RTOL if backend == "cpu" else NUMBERS_GPU_RTOL


def write(result: dict, out: str) -> str:
  """``results.json`` and ``results.md`` in ``out``; returns the markdown."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "results.json"), "w") as handle:
    json.dump(result, handle, indent=1, default=str)
  text = markdown(result)
  with open(os.path.join(out, "results.md"), "w") as handle:
    handle.write(text)
  return text


def _default_out(env: dict) -> str:
  device = str(env.get("device_kind") or "unknown").lower().replace(" ", "-")
  return os.path.join(HERE, "results", f"gpu-check-{device}")


def _gib(value) -> str:
  return "-" if value is None else f"{value / 2**30:.2f}"


def _cells(r: dict) -> list[str]:
  """One measurement's cells of the main table."""
  number = lambda key, fmt: "-" if r.get(key) is None else format(r[key], fmt)
  budget = r.get("budget_bytes")
  within = r.get("fits_measured", r.get("fits_compiled"))
  return [r["model"], r["method"], f"{r['budget']} ({_gib(budget)})" if budget else "-",
          r["status"], _gib(r.get("footprint") or r.get("smallest")), _gib(r.get("peak_bytes")),
          "-" if within is None or not budget else ("yes" if within else "**no**"),
          _gib(r.get("host_bytes")), number("hlo_host_annotations", "d"),
          f"{number('step_ms', '.1f')} / {number('call_ms', '.1f')}",
          number("time_ratio", ".2f"),
          f"{number('clock_ms_calibrated', '.1f')} / {number('clock_ms_preset', '.1f')}",
          number("clock_ratio", ".2f"),
          number("planning_s", ".0f"),
          "-" if r.get("same_numbers") is None else ("yes" if r["same_numbers"] else
                                                      f"**no** ({r['numbers_error']:.1e})")]


def markdown(result: dict) -> str:
  """Tables: every measurement, max batches, and the problems found."""
  env, prov = result["environment"], result["provenance"]
  header = ["model", "method", "budget (GiB)", "status", "compiled (GiB)",
            "measured peak (GiB)", "within budget", "host (GiB)", "S(5)", "step ms (queued / waited)",
            "x unmodified", "clock ms (calibrated / h100)", "clock / measured", "planning s",
            "same numbers"]
  lines = [f"# jaxmem on {env.get('device_kind')} ({env.get('backend')})", "",
           f"Command: `{prov['command']}`; commit {prov['commit']} "
           f"(dirty: {prov['dirty']}); {prov['date']}; JAX {env.get('jax')}.", "",
           "Compiled: XLA's footprint (temp + arguments + outputs - aliases; for a "
           "budget jaxmem cannot meet, the smallest it reaches). Measured peak: "
           "`peak_bytes_in_use` of a fresh process running the serialized step. "
           "Step ms: the median step with steps queued as a training loop runs them "
           "(ratios and the clock are judged by it) / with each step waited for.", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(_cells(r)) + " |" for r in result["rows"]
            if r["kind"] == "measure"]
  batches = [r for r in result["rows"] if r["kind"] == "maxbatch"]
  if batches:
    lines += ["", "Max batch under the unmodified step's footprint at the configured batch:",
              "", "| model | method | budget (GiB) | max batch | measured peak (GiB) | status |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['method']} | {_gib(r['budget_bytes'])} "
              f"| {r.get('max_batch', '-')} | {_gib(r.get('peak_bytes'))} | {r['status']} |"
              for r in batches]
  lines += ["", "Checks:", ""] + checks(result)
  lines += ["", "Problems:", ""] + (problems(result) or ["none"])
  return "\n".join(lines) + "\n"


def checks(result: dict) -> list[str]:
  """The claims a GPU run confirms: jaxmem's plans within their budgets by
  the allocator's measured peak (the runtime reserve kept beside XLA's
  footprint), the clock within ``CLOCK_RTOL`` of the measured times, and
  its slowdowns (what orders one model's plans) within ``SLOWDOWN_RTOL`` of
  the measured ones."""
  plans = [r for r in result["rows"] if r["kind"] == "measure"
           and r.get("method", "").startswith("jaxmem") and r.get("fits_measured") is not None]
  timed = [r for r in result["rows"] if r.get("clock_ratio")]
  close = [r for r in timed if abs(r["clock_ratio"] - 1) <= CLOCK_RTOL]
  ratios = sorted(r["clock_ratio"] for r in timed)
  slowed = [r for r in result["rows"] if r.get("clock_slowdown")
            and r.get("method") != "unconstrained"]
  spread = sorted(r["clock_slowdown"] / r["time_ratio"] for r in slowed)
  agree = [x for x in spread if abs(x - 1) <= SLOWDOWN_RTOL]
  return [f"- jaxmem plans within their budget by the measured peak: "
          f"{sum(r['fits_measured'] for r in plans)} of {len(plans)}",
          f"- steps the clock times within {CLOCK_RTOL:.0%} of the measured time "
          f"(calibrated profile): {len(close)} of {len(timed)}"
          + (f"; clock / measured from {ratios[0]:.2f} to {ratios[-1]:.2f}, "
             f"median {ratios[len(ratios) // 2]:.2f}" if ratios else ""),
          f"- slowdowns (x unmodified) the clock gives within {SLOWDOWN_RTOL:.0%} of the "
          f"measured ones: {len(agree)} of {len(slowed)}"
          + (f"; clock / measured from {spread[0]:.2f} to {spread[-1]:.2f}" if spread else "")]


def problems(result: dict) -> list[str]:
  """Budget violations, offload plans without host buffers, failures."""
  found = []
  for r in result["rows"]:
    name = f"{r.get('model', '')} {r.get('method', r['kind'])} {r.get('budget', '')}".strip()
    if r["status"] not in ("ok", "no-fit"):
      found.append(f"- {name}: {r['status']}: {r.get('error', '')[:300]}")
    if r.get("fits_measured") is False and r.get("method", "").startswith("jaxmem"):
      found.append(f"- {name}: measured peak {_gib(r['peak_bytes'])} GiB over the "
                   f"budget {_gib(r['budget_bytes'])} GiB")
    if r.get("same_numbers") is False:
      found.append(f"- {name}: its update norms differ from the unmodified step's by "
                   f"{r['numbers_error']:.1e} (relative): wrong numbers")
    # A remat offload policy may name no residual of a model (a conv net has
    # no dot without batch dimensions); only a jaxmem plan's offload is owed.
    if r["status"] == "ok" and r.get("plan_offloads") and r.get("hlo_host_annotations") == 0 \
        and result["environment"].get("backend") != "cpu":
      found.append(f"- {name}: an offload plan with no S(5) buffer in its HLO")
  return found


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="two models, one budget, fewer methods (<= 5 minutes on a GPU)")
  parser.add_argument("--dry-run", action="store_true",
                      help="lower and plan only; nothing runs (works on CPU)")
  parser.add_argument("--target", choices=sorted(n for n, p in PROFILES.items() if p.description),
                      help="with --dry-run: compile every method for this GPU on this "
                           "machine (XLA:GPU's footprints, no GPU needed; needs JAX's CUDA "
                           "plugin). On a GPU, the GPU present is the target.")
  parser.add_argument("--cpu-sizes", action="store_true",
                      help="the zoo's CPU sizes instead of the edge sizes (with --dry-run: "
                           "the script checked in seconds)")
  parser.add_argument("--models", nargs="*", choices=sorted(CONFIGS))
  parser.add_argument("--budgets", nargs="+")
  parser.add_argument("--max-batch", nargs="*", choices=sorted(CONFIGS),
                      help="models whose max batch is found (default: "
                           f"those of {' '.join(MAX_BATCH)} the run covers, none with "
                           "--quick)")
  parser.add_argument("--planners", nargs="*", choices=PLANNERS, help="jaxmem planners")
  parser.add_argument("--remat", nargs="*", choices=REMAT, help="per-block remat policies")
  parser.add_argument("--out", help="results folder")
  parser.add_argument("--render", nargs="+", metavar="ROWS",
                      help="make results.json and results.md from the rows.jsonl files of "
                           "runs (one cut short included) instead of running")
  parser.add_argument("--workers", type=int,
                      help="processes planning and compiling at once (default: cores / 4, "
                           "at most 4: compiling autotunes on the GPU, and ten at once "
                           "ran an H200 out of memory)")
  parser.add_argument("--repeats", type=int, default=10, help="timed steps (median)")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
  parser.add_argument("--autotune-cache", default=AUTOTUNE_CACHE, metavar="DIR",
                      help="folder the workers share XLA:GPU's autotuning results through, "
                           "kept between runs (default: %(default)s; 'none': each "
                           "compilation autotunes anew)")
  return parser.parse_args(argv)


def run_plan(args) -> dict:
  """The models, budgets, methods and max-batch models a run covers."""
  plan = dict(QUICK) if args.quick else dict(
      models=tuple(CONFIGS), budgets=BUDGETS, remat=REMAT, planners=PLANNERS,
      max_batch=MAX_BATCH)
  if args.models is not None:
    plan["models"] = tuple(args.models)
    # Max batch defaults to the named models only.
    plan["max_batch"] = tuple(m for m in plan["max_batch"] if m in plan["models"])
  if args.max_batch is not None:
    plan["max_batch"] = tuple(args.max_batch)
  for option in ("planners", "remat"):
    if getattr(args, option) is not None:
      plan[option] = tuple(getattr(args, option))
  if args.budgets:
    plan["budgets"] = tuple(args.budgets)
  plan["configs"] = configs(args.cpu_sizes)
  return plan


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse(argv)
  if args.target and not args.dry_run:
    raise SystemExit("gpu.py: --target plans for a GPU that is not here, so it needs "
                     "--dry-run; on a GPU, the GPU present is the target.")
  plan = run_plan(args)
  if args.render:
    rows = [json.loads(line) for path in args.render for line in open(path) if line.strip()]
    print(write(assemble(rows), args.out or os.path.dirname(os.path.abspath(args.render[0]))))
    return 0
  workers = args.workers or min(4, max(1, (os.cpu_count() or 2) // 4))
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as scratch:
    runner = Runner(args.dry_run, args.repeats, args.timeout,
                    None if args.dry_run else os.path.join(scratch, "gpu.lock"),
                    target=args.target,
                    autotune_cache=None if args.dry_run or args.autotune_cache == "none"
                    else args.autotune_cache)
    rows, out = run(plan, runner, workers, args.out, provenance("benchmarks/gpu.py", argv))
  result = assemble(rows)
  result["seconds"] = time.perf_counter() - start
  print(write(result, out))
  print(f"{len(result['rows'])} configurations in {result['seconds']:.0f} s; "
        f"results in {out}")
  failed = [r for r in rows if r["status"] not in ("ok", "no-fit")]
  # A dry run checks the script itself: any failure is one. On a device,
  # failures are results (reported above), not a failed run.
  return 1 if args.dry_run and failed else 0


if __name__ == "__main__":
  sys.exit(main())
