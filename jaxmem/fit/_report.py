"""Readable reports: residual tables and plan summaries."""

from __future__ import annotations

from jaxmem._budget import format_bytes
from jaxmem.graph._graph import Graph
from jaxmem.graph._loops import stacked_residuals


def _table(header: list[str], rows: list[list[str]]) -> str:
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
  return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def decision_label(decision) -> str:
  """A decision as the residual table shows it; a chunked one lists each
  chunk's kind and bounds (along a loop's layer axis, the layers).

  Example:
    >>> from jaxmem._decisions import KEEP, RECOMPUTE, Chunked
    >>> decision_label(Chunked(0, ((0, 4), (4, 16)), (RECOMPUTE, KEEP)))
    'recompute[0:4] keep[4:16]'
  """
  if decision.kind != "chunked":
    return decision.kind
  return " ".join(f"{c.kind}[{a}:{b}]" for (a, b), c in zip(decision.bounds, decision.chunks))


def residual_table(graph: Graph, top: int | None = 30, decisions=None) -> str:
  """Residuals sorted by size, like ``jax.ad_checkpoint.print_saved_residuals``
  but with bytes, lifetimes (forward position -> backward uses) and layers.
  A residual a scan stacks over its iterations reads ``per layer x L``."""
  stacked = stacked_residuals(graph)
  residuals = sorted(graph.residuals, key=lambda r: -r.nbytes)
  total = sum(r.nbytes for r in residuals)
  shown = residuals if top is None else residuals[:top]
  rows = []
  for r in shown:
    size, name = format_bytes(r.nbytes), r.name
    if r.value in stacked:
      s = stacked[r.value]
      size = f"{format_bytes(s.per_iteration)} x {s.length}"
      name = name.replace(" scan", f" scan[{s.slice_of}]", 1)
    row = [size, f"{r.dtype}{list(r.shape)}",
           f"{r.produced_at}->{r.first_backward_use}..{r.last_backward_use}",
           f"{r.recompute_flops:.3g}", name]
    if decisions is not None:
      row.insert(0, decisions.get(r.value, "keep"))
    rows.append(row)
  header = ["bytes", "array", "made->used", "flops", "name"]
  if decisions is not None:
    header.insert(0, "decision")
  more = (f"\n... and {len(residuals) - len(shown)} smaller (report(top=None) lists all)"
          if len(shown) < len(residuals) else "")
  return (f"{len(residuals)} residuals, {format_bytes(total)} in all\n"
          + _table(header, rows) + more + "\n"
          + _legend(decisions is not None, any(r.value in stacked for r in shown)))


def _legend(decided: bool, looped: bool) -> str:
  """The residual table's columns in words, under it."""
  return ("(made->used: the equation that makes it -> the first..last backward "
          "equations that read it, by index in the step; flops: its own equation's"
          + (", the whole loop's for a scan's stacked one" if looped else "")
          + ("; decision: keep, recompute, offload (to host memory and back), save "
             "(a boundary kept to rebuild from) or per chunk)" if decided else ")"))
