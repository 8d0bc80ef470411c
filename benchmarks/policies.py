"""jaxmem against the one-line Flax remat policies, on a GPU target.

For each zoo model with blocks and each GPU target, everything is compiled
here for the target (a compile-only device; no GPU needed) and judged by
XLA:GPU's footprint and the clock's predicted time (``_xla_clock``) on the
target's profile:

* the step as written;
* each per-block ``nn.remat`` policy (the ``offload_*`` ones included);
* jaxmem's fit at 70/50/33% of the step's footprint, and at each policy's
  own footprint (in bytes, no runtime reserve, so both sides meet the same
  number; policies of one footprint share one fit).

It then checks what jaxmem should give: it fits wherever a policy fits; its
predicted time is no slower than the fastest policy that fits the same
budget; its smallest footprint is no larger than ``nothing_saveable``'s.
Results: ``results.md`` (the table and the checks), ``results.json`` and a
plot of footprint against predicted time (policies as points, jaxmem as a
curve over budgets) per model and target.

  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/policies.py --targets t4 h100 \\
      --out benchmarks/results/policies

``--gather FOLDER...`` measures nothing: it checks earlier runs' rows
together and draws them in one figure (``all.png``), every axis a ratio to
the step as written, each panel naming the folder and commit it comes from.
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
from jaxmem.cost._xla_clock import program_time  # noqa: E402
from jaxmem._zoo import models  # noqa: E402
from jaxmem.targets import get_profile, placed, xla_footprint  # noqa: E402

from benchmarks._results import write  # noqa: E402
from benchmarks._steps import compile_for, task as zoo_task  # noqa: E402
from benchmarks.gpu import BUDGETS, CONFIGS, REMAT  # noqa: E402

BLOCK_MODELS = ("gpt2", "vit", "resnet18", "mobilenetv2", "unet")
MIB = 2.0**20


def _compiled_row(task, target: str, method: str) -> dict:
  """The footprint and predicted time of ``task``'s step as jax.jit compiles
  it for ``target``."""
  compiled, _, seconds = compile_for(task.step, jax.eval_shape(task.init), target)
  return {"method": method, "footprint": xla_footprint(compiled),
          "ms": program_time(compiled.as_text(), get_profile(target)).seconds * 1e3,
          "seconds": seconds}


def _fit_row(task, target: str, budget: int, label: str) -> dict:
  """jaxmem's fit of ``task`` at ``budget`` bytes on ``target``."""
  shapes = placed(jax.eval_shape(task.init), target)
  start = time.perf_counter()
  row = {"method": "jaxmem", "budget": label, "budget_bytes": budget}
  try:
    fit = jaxmem.transform(task.step, budget=budget, target=target, reserve=0).fit(*shapes)
  except jaxmem.BudgetError as err:
    return {**row, "smallest": err.smallest, "seconds": time.perf_counter() - start}
  return {**row, "footprint": fit.footprint,
          "ms": fit.predicted * 1e3, "plan_size": len(fit.plan),
          "offloads": fit.plan.uses_host, "seconds": time.perf_counter() - start}


def _show(row: dict) -> dict:
  size = (f"{row['footprint'] / MIB:9.1f} MiB" if "footprint" in row
          else f"no fit, smallest {row['smallest'] / MIB:.1f} MiB")
  print(f"{row['model']:12s} {row['target']:5s} {row['method']:45s} "
        f"{str(row.get('budget', '')):45s} {size} "
        f"{row.get('ms', float('nan')):8.2f} ms "
        + (f"as at {row['same_as']}" if "same_as" in row else f"{row['seconds']:6.1f} s"),
        flush=True)
  return row


def measure(name: str, config: dict, target: str, policies, budgets) -> list[dict]:
  """The step as written, the policies and jaxmem's fits of one model on
  one target, each row printed as it is made."""
  base = dict(model=name, target=target)
  rows = [_show(dict(base, **_compiled_row(zoo_task(name, config), target, "unmodified")))]
  for policy in policies:
    rows.append(_show(dict(base, **_compiled_row(zoo_task(name, config, policy), target,
                                                 f"remat:{policy}"))))
  task = zoo_task(name, config)
  # Fractions of the step's footprint on the target, in bytes, so that every
  # row (a fit that fails included) says which budget it was held to.
  unmodified = rows[0]["footprint"]
  at = ([(int(float(b.rstrip("%")) / 100 * unmodified), b) for b in budgets]
        + [(r["footprint"], r["method"]) for r in rows[1:]])
  fitted: dict[int, dict] = {}  # budget in bytes -> its fit's row
  for budget, label in at:
    if budget in fitted:  # policies of one footprint: one fit serves them all
      rows.append(_show(dict(fitted[budget], budget=label, same_as=fitted[budget]["budget"])))
      continue
    fitted[budget] = dict(base, **_fit_row(task, target, budget, label))
    rows.append(_show(fitted[budget]))
  return rows


def checks(rows: list[dict]) -> list[str]:
  """The three claims, one line each per model and target (see the module
  docstring)."""
  lines = []
  for key in sorted({(r["model"], r["target"]) for r in rows}):
    group = [r for r in rows if (r["model"], r["target"]) == key]
    policies = [r for r in group if r["method"].startswith("remat:")]
    fits = [r for r in group if r["method"] == "jaxmem"]
    missed, slower = [], []
    for fit in fits:
      fitting = [p for p in policies if p["footprint"] <= fit["budget_bytes"]]
      if fitting and "ms" not in fit:
        missed.append(fit["budget"])
      elif fitting and fit["ms"] > min(p["ms"] for p in fitting) * 1.0001:
        slower.append(f"{fit['budget']} ({fit['ms']:.2f} vs "
                      f"{min(p['ms'] for p in fitting):.2f} ms)")
    smallest = min([f["footprint"] for f in fits if "footprint" in f]
                   + [f["smallest"] for f in fits if "smallest" in f], default=None)
    nothing = next((p["footprint"] for p in policies
                    if p["method"] == "remat:nothing_saveable"), None)
    lines.append(
        f"- {key[0]} on {key[1]}: fits wherever a policy fits: "
        f"{'yes' if not missed else 'no, not at ' + ', '.join(missed)}; no slower than the "
        f"fastest fitting policy: {'yes' if not slower else 'no: ' + '; '.join(slower)}; "
        f"smallest footprint {smallest / MIB:.1f} MiB against nothing_saveable's "
        f"{nothing / MIB:.1f} MiB: {'yes' if smallest <= nothing else 'no'}"
        if smallest is not None and nothing is not None else f"- {key}: incomplete")
  return lines


def render(rows: list[dict]) -> str:
  lines = ["| model | target | step | budget | footprint (MiB) | predicted ms | x unmodified |",
           "|---|---|---|---|---|---|---|"]
  for row in rows:
    base = next(r for r in rows if (r["model"], r["target"], r["method"])
                == (row["model"], row["target"], "unmodified"))
    budget = row.get("budget", "-")
    if row.get("budget_bytes"):
      budget = f"{budget} ({row['budget_bytes'] / MIB:.1f})"
    if "ms" in row:
      cells = (f"{row['footprint'] / MIB:.1f} | {row['ms']:.2f} | "
               f"{row['ms'] / base['ms']:.2f}")
    else:
      cells = f"smallest {row['smallest'] / MIB:.1f} | - | -"
    lines.append(f"| {row['model']} | {row['target']} | {row['method']} | {budget} | {cells} |")
  return "\n".join(lines + [""] + checks(rows))


def _panel(ax, group: list[dict], title: str, relative: bool) -> None:
  """One model on one target: each policy a point, jaxmem a curve over the
  budgets it fits; in MiB and ms, or over the step as written's."""
  base = next(r for r in group if r["method"] == "unmodified")
  xs, ys = (base["footprint"], base["ms"]) if relative else (MIB, 1.0)
  points: dict = {}  # policies that compile alike share a point and a label
  for r in group:
    if r["method"] != "jaxmem" and "ms" in r:
      points.setdefault((r["footprint"] / xs, r["ms"] / ys), []).append(
          r["method"].replace("remat:", ""))
  for (x, y), names in points.items():
    ax.plot(x, y, "o")
    ax.annotate("\n".join(names), (x, y), fontsize=6 if relative else 7, xytext=(3, 3),
                textcoords="offset points")
  curve = sorted((r["footprint"] / xs, r["ms"] / ys) for r in group
                 if r["method"] == "jaxmem" and "ms" in r)
  if curve:
    ax.plot(*zip(*curve), "k.-", label="jaxmem over budgets")
    ax.legend(fontsize=7 if relative else 8)
  if relative:
    ax.set_xlabel("XLA:GPU footprint over the step as written", fontsize=8)
    ax.set_ylabel("predicted time over the step as written", fontsize=8)
  else:
    ax.set_xlabel("XLA:GPU footprint (MiB)")
    ax.set_ylabel(f"predicted step time on {base['target']} (ms)")
  ax.set_title(title, **({"fontsize": 9} if relative else {}))


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot(rows: list[dict], out: str) -> list[str]:
  """One figure per model and target, in MiB and ms."""
  plt = _pyplot()
  paths = []
  for key in sorted({(r["model"], r["target"]) for r in rows}):
    fig, ax = plt.subplots(figsize=(6.5, 4))
    _panel(ax, [r for r in rows if (r["model"], r["target"]) == key],
           f"{key[0]} on {key[1]}", relative=False)
    fig.tight_layout()
    path = os.path.join(out, f"{key[0]}-{key[1]}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


def gather(folders: list[str]) -> tuple[list[dict], dict]:
  """The rows of earlier runs' ``results.json``, each tagged with its
  folder; where two folders hold the same model and target, the later one
  on the command line wins. Returns the rows and each (model, target)'s
  folder and commit."""
  rows, source = [], {}
  for folder in folders:
    with open(os.path.join(folder, "results.json")) as f:
      data = json.load(f)
    for key in {(r["model"], r["target"]) for r in data["rows"]}:
      rows = [r for r in rows if (r["model"], r["target"]) != key]
      source[key] = (os.path.basename(os.path.normpath(folder)),
                     data["header"].get("commit") or "unknown")
    rows += data["rows"]
  return rows, source


def plot_all(rows: list[dict], source: dict, path: str) -> str:
  """Every model and target in one figure, a row per model and a column
  per target, each axis over the step as written's footprint and time."""
  plt = _pyplot()
  names = sorted({r["model"] for r in rows})
  targets = sorted({r["target"] for r in rows})
  fig, axes = plt.subplots(len(names), len(targets), squeeze=False,
                           figsize=(5.2 * len(targets), 3.6 * len(names)))
  for i, name in enumerate(names):
    for j, target in enumerate(targets):
      group = [r for r in rows if (r["model"], r["target"]) == (name, target)]
      if not group:
        axes[i][j].axis("off")
        continue
      _panel(axes[i][j], group, f"{name} on {target} ({source[(name, target)][1][:7]})",
             relative=True)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def _gathered(folders: list[str], out: str | None, argv) -> None:
  """``--gather``: the checks and one figure over earlier runs' folders."""
  rows, source = gather(folders)
  lines = ["| model | target | folder | commit |", "|---|---|---|---|"]
  lines += [f"| {m} | {t} | `{f}` | {c[:7]} |" for (m, t), (f, c) in sorted(source.items())]
  table = "\n".join(lines + [""] + checks(rows))
  print(table)
  if out:
    write(out, "benchmarks/policies.py", sys.argv[1:] if argv is None else argv,
          "jaxmem against per-block remat policies, every model and target",
          "gathered from the folders named, each compiled on a 2-core CPU-only machine "
          "for compile-only targets", table, rows)
    plot_all(rows, source, os.path.join(out, "all.png"))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", nargs="*", default=["t4", "h100"])
  parser.add_argument("--models", nargs="*", default=list(BLOCK_MODELS))
  parser.add_argument("--policies", nargs="*", default=list(REMAT))
  parser.add_argument("--budgets", nargs="*", default=list(BUDGETS))
  parser.add_argument("--cpu-sizes", action="store_true",
                      help="the zoo's CPU sizes instead of the GPU check's edge sizes")
  parser.add_argument("--gather", nargs="+", metavar="FOLDER",
                      help="measure nothing: check and plot earlier runs' results together "
                           "(a later folder's model and target replace an earlier one's)")
  parser.add_argument("--out", default=None, help="folder for the results and plots")
  opts = parser.parse_args(argv)
  if opts.gather:
    return _gathered(opts.gather, opts.out, argv)
  configs = models().CPU_SIZES if opts.cpu_sizes else CONFIGS
  rows = [row for name in opts.models for target in opts.targets
          for row in measure(name, configs[name], target, opts.policies, opts.budgets)]
  table = render(rows)
  print(table)
  if opts.out:
    sizes = "the zoo's CPU sizes" if opts.cpu_sizes else "the GPU check's edge sizes"
    write(opts.out, "benchmarks/policies.py", sys.argv[1:] if argv is None else argv,
          "jaxmem against per-block remat policies, on GPU targets",
          f"compiled on a 2-core CPU-only machine for compile-only targets, {sizes}",
          table, rows)
    plot(rows, opts.out)


if __name__ == "__main__":
  main()
