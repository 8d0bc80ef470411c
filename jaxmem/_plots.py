"""Plots for ``jaxmem-bench`` (matplotlib, the ``bench`` extra).

Two figures: a plan's memory timeline (predicted device bytes after each op
of the rewritten step, with the budget, XLA's footprint and the recomputed
ops marked) and the step-time overhead of every method against the budget.
"""

from __future__ import annotations

import os

MIB = 2.0 ** 20


def _pyplot():
  try:
    import matplotlib
  except ImportError as err:
    raise ImportError(
        "jaxmem-bench --plot needs matplotlib; install it with "
        "`pip install 'jaxmem[bench]'` (or `pip install matplotlib`).") from err
  matplotlib.use("Agg")  # files only; no display needed
  import matplotlib.pyplot as plt
  return plt


def timeline(row, path: str, title: str) -> str:
  """Writes the memory timeline of a jaxmem row (one with a timeline)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(9, 3.6))
  ax.plot([t / MIB for t in row.timeline], lw=1, label="predicted live bytes")
  ax.axhline(row.budget_bytes / MIB, color="r", ls="--", lw=1,
             label=f"budget ({row.budget})")
  if row.xla_bytes is not None:
    ax.axhline(row.xla_bytes / MIB, color="k", ls=":", lw=1, label="XLA footprint")
  low = min(row.timeline) / MIB
  if row.recompute_ops:
    ax.plot(row.recompute_ops, [low] * len(row.recompute_ops), "|", color="g",
            ms=8, label="recomputed op")
  ax.set_xlabel("op of the rewritten step")
  ax.set_ylabel("MiB")
  ax.set_title(title)
  ax.legend(loc="upper right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def overhead(rows, unconstrained: int, path: str, title: str) -> str:
  """Writes step time / unconstrained step time against the budget (as a
  fraction of the unconstrained footprint), one line per method; budgets a
  method does not fit are left out."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for method in dict.fromkeys(r.method for r in rows):
    points = sorted((r.budget_bytes / unconstrained, r.time_ratio) for r in rows
                    if r.method == method and r.fits and r.time_ratio is not None)
    if points:
      ax.plot(*zip(*points), "o-", label=method)
  ax.axhline(1.0, color="k", lw=0.5)
  ax.invert_xaxis()
  ax.set_xlabel("budget / unconstrained footprint")
  ax.set_ylabel("step time / unconstrained step")
  ax.set_title(title)
  if ax.lines[1:]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def write_all(result: dict, rows, directory: str) -> list[str]:
  """Every plot for one bench run, into ``directory``; returns the paths."""
  os.makedirs(directory, exist_ok=True)
  model = result["model"]
  paths = [overhead(rows, result["unconstrained_bytes"],
                    os.path.join(directory, f"{model}-overhead.png"),
                    f"{model}: step-time overhead vs budget")]
  for row in rows:
    if row.timeline:
      name = f"{model}-{row.method.replace(':', '-')}-{row.budget.replace('%', 'pct')}"
      paths.append(timeline(row, os.path.join(directory, f"{name}-timeline.png"),
                            f"{model}, {row.method} at {row.budget}"))
  return paths
