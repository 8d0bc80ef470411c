"""Plots for ``jaxmem-bench`` (matplotlib, the ``bench`` extra).

Figures: a plan's memory timeline (predicted device bytes after each op of
the rewritten step, with the budget, XLA's footprint, the recomputed ops,
the copies to the host and back, vTensor splits and merges, and the host
bytes), step time against footprint for every method, and for
an LGM plan the deficit of each peak beside the bytes swapped to cover it.
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
  fig, ax = plt.subplots(figsize=(11, 3.8))
  if row.stacked:  # what holds the bytes, stacked: they add up to the timeline
    ax.stackplot(range(len(row.timeline)), *[[b / MIB for b in v] for v in row.stacked.values()],
                 labels=list(row.stacked), alpha=0.6, lw=0)
  if row.written:
    ax.plot([t / MIB for t in row.written], lw=0.8, color="0.5",
            label="step as written (model)")
  ax.plot([t / MIB for t in row.timeline], lw=1, color="k", label="planned step (model)")
  ax.axhline(row.budget_bytes / MIB, color="r", ls="--", lw=1,
             label=f"budget ({row.budget})")
  if row.xla_bytes is not None:
    ax.axhline(row.xla_bytes / MIB, color="k", ls=":", lw=1, label="XLA footprint (plan)")
  low = min(row.timeline) / MIB
  if row.recompute_ops:
    ax.plot(row.recompute_ops, [low] * len(row.recompute_ops), "|", color="g",
            ms=8, label="recomputed op")
  marks = {"offload": ("v", "tab:purple", "copy to host"),
           "prefetch": ("^", "tab:purple", "copy back"),
           "split": ("<", "tab:orange", "vTensor split"),
           "merge": (">", "tab:orange", "vTensor merge")}
  for kind, positions in (row.copy_ops or {}).items():
    if positions:
      shape, color, label = marks[kind]
      ax.plot(positions, [row.timeline[p] / MIB for p in positions], shape, color=color,
              ms=4, ls="none", label=label)
  if row.host_timeline and max(row.host_timeline):
    ax.plot([t / MIB for t in row.host_timeline], lw=1, color="tab:purple", ls="-.",
            label="host bytes")
  ax.set_xlabel("op of the rewritten step")
  ax.set_ylabel("MiB")
  ax.set_title(title)
  ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def time_vs_footprint(rows, unconstrained: int, path: str, title: str) -> str:
  """Writes step time against footprint, both over the unconstrained
  step's, one line per method: a jaxmem planner's plans that fit their
  budgets, a per-block policy's one program."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for method in dict.fromkeys(r.method for r in rows):
    points = sorted({(r.xla_bytes / unconstrained, r.time_ratio) for r in rows
                     if r.method == method and r.time_ratio is not None
                     and r.xla_bytes is not None
                     and (r.fits or not method.startswith("jaxmem"))})
    if points:
      ax.plot(*zip(*points), "o-", label=method)
  ax.axhline(1.0, color="k", lw=0.5)
  ax.invert_xaxis()
  ax.set_xlabel("footprint / unconstrained footprint (XLA)")
  ax.set_ylabel("step time / unconstrained step")
  ax.set_title(title)
  if ax.lines[1:]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def swaps(row, path: str, title: str) -> str:
  """Writes, for an LGM plan, each covered peak's deficit beside the bytes
  its vTensors moved to the host, labelled with the layer, the tensors
  swapped and how many of them were split."""
  plt = _pyplot()
  peaks: dict = {}
  for record in row.vtensors:
    entry = peaks.setdefault(record["peak"], dict(layer=record["layer"],
                                                  deficit=record["deficit"], moved=0,
                                                  tensors=0, split=0))
    entry["moved"] += record["swapped_bytes"]
    entry["tensors"] += 1
    entry["split"] += record["chunks"] > 1
  order = sorted(peaks)
  fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(order) + 2), 4))
  xs = range(len(order))
  ax.bar([x - 0.2 for x in xs], [peaks[p]["deficit"] / MIB for p in order], 0.4,
         label="deficit at the peak")
  ax.bar([x + 0.2 for x in xs], [peaks[p]["moved"] / MIB for p in order], 0.4,
         label="bytes freed for it (swapped, or copies back moved after it)")
  ax.set_xticks(list(xs))
  ax.set_xticklabels([f"{peaks[p]['layer'][-18:]}\n{peaks[p]['tensors']} tensors, "
                      f"{peaks[p]['split']} split" for p in order], fontsize=7, rotation=30,
                     ha="right")
  ax.set_ylabel("MiB")
  ax.set_title(title)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def write_all(result: dict, rows, directory: str) -> list[str]:
  """Every plot for one bench run, into ``directory``; returns the paths."""
  os.makedirs(directory, exist_ok=True)
  model = result["model"]
  paths = [time_vs_footprint(rows, result["unconstrained_bytes"],
                             os.path.join(directory, f"{model}-time-vs-footprint.png"),
                             f"{model}: step time against footprint")]
  for row in rows:
    name = f"{model}-{row.method.replace(':', '-')}-{row.budget.replace('%', 'pct')}"
    if row.timeline:
      paths.append(timeline(row, os.path.join(directory, f"{name}-timeline.png"),
                            f"{model}, {row.method} at {row.budget}"))
    if row.vtensors:
      paths.append(swaps(row, os.path.join(directory, f"{name}-vtensors.png"),
                         f"{model}, {row.method} at {row.budget}: deficits and swaps"))
  return paths
