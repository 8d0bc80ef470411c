"""Chunks of one region against plans and micro-batches, on language models
whose vocabulary is large beside their width (the zoo's GPT-2 at its CPU
sizes with a larger vocabulary; Adam).

For each vocabulary: XLA:CPU's footprint and the measured step time of
- the step as written;
- the smallest plan of its residuals (``micro_batches=1``: the smallest
  footprint a ``BudgetError`` names, fitted at that budget);
- the region around its peak (the loss head: logits, softmax cross-entropy
  and their gradients) in 2, 4 and 8 chunks, the rest whole, as written;
- the whole step in the same numbers of micro-batches, as written.

Footprints are fractions of the step's own; times are the median ratio to
the step as written, each run timed right after one of it
(``paired_seconds``; CPU times: they say what the chunks' loop costs beside
recomputation here, not on a GPU).

    python benchmarks/chunks.py --vocab 4096 16384 --out DIR
"""

from __future__ import annotations

import argparse
import sys

import jax

import jaxmem
from jaxmem._benchmark import paired_seconds
from jaxmem.cost._evaluate import unplanned
from jaxmem.graph._batch_axes import split_batch, split_region
from jaxmem.graph._graph import build_graph
from jaxmem.schedule._microbatch import micro_batched
from jaxmem.targets import xla_footprint

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import _results  # noqa: E402
from benchmarks._steps import task  # noqa: E402

COUNTS = (2, 4, 8)
REPEATS = 7


def rows_for(vocab: int) -> list[dict]:
  """The rows of one vocabulary (see the module docstring)."""
  from jaxmem._zoo import models
  t = task("gpt2", dict(models().CPU_SIZES["gpt2"], vocab=vocab))
  state, batch = t.init()
  leaves, tree = jax.tree_util.tree_flatten((state, batch))
  n_state = len(jax.tree_util.tree_leaves(state))
  flat = lambda *xs: jax.tree_util.tree_leaves(t.step(*jax.tree_util.tree_unflatten(tree, xs)))
  graph = build_graph(jax.make_jaxpr(flat)(*leaves))
  groups = [tuple(range(n_state)), tuple(range(n_state, len(leaves)))]
  written = jax.jit(flat)
  own = xla_footprint(written.lower(*leaves).compile())
  rows = []

  def add(how: str, footprint: int, run, args):
    seconds, ratio = paired_seconds(written, leaves, run, args, REPEATS)
    rows.append(dict(vocab=vocab, how=how, footprint=footprint, fraction=footprint / own,
                     seconds=seconds, time=ratio))

  add("as written", own, written, leaves)
  try:
    jaxmem.transform(t.step, budget=1, micro_batches=1).fit(state, batch)
  except jaxmem.BudgetError as err:
    fitted = jaxmem.transform(t.step, budget=err.smallest, micro_batches=1)
    fit = fitted.fit(state, batch)
    add(f"smallest plan ({len(fit.plan)} decisions)", fit.footprint, fitted, (state, batch))
  near = [key[0] for key in unplanned(graph, 0).memory.live_at_peak]
  for name, split in (("region", split_region(graph, groups, near, ["state", "batch"])),
                      ("micro-batches", split_batch(graph, groups, ["state", "batch"]))):
    for k in COUNTS:
      run = jax.jit(micro_batched(split, k))
      label = (f"region of {len(split.region)} equations in {k} chunks" if name == "region"
               else f"{k} micro-batches")
      add(label, xla_footprint(run.lower(*leaves).compile()), run, leaves)
  return rows


def table(rows) -> str:
  lines = ["| vocabulary | how | footprint MiB | of the step's own | time / as written |",
           "|---|---|---|---|---|"]
  lines += [f"| {r['vocab']} | {r['how']} | {r['footprint'] / 2**20:.2f} | "
            f"{r['fraction']:.0%} | {r['time']:.2f}x |" for r in rows]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab", nargs="+", type=int, default=[4096, 16384])
  parser.add_argument("--out", required=True)
  opts = parser.parse_args(argv)
  rows = []
  for vocab in opts.vocab:  # written after each vocabulary: a long run keeps what it has
    rows += rows_for(vocab)
    print(table(rows), flush=True)
    _results.write(opts.out, "benchmarks/chunks.py", sys.argv[1:] if argv is None else argv,
                   "A region in chunks against plans and micro-batches: language models "
                   "with large vocabularies", "XLA:CPU, times measured on this machine",
                   table(rows), rows)


if __name__ == "__main__":
  main()
