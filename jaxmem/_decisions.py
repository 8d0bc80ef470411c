"""Decisions and plans: what happens to each residual.

A decision is a small frozen dataclass, in the manner of
``jax.ad_checkpoint``'s policies. Residuals a plan does not mention are kept
on the device; forward values that are not residuals are not kept unless
the plan saves them (:class:`Save`: a checkpoint at a block boundary, so
that recomputation starts there). A residual may also be split into chunks
with a decision each (:class:`Chunked`, the vTensor seed's vTensors).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Mapping


class Decision:
  """Base class of what happens to one residual between its uses."""
  kind = "decision"


@dataclasses.dataclass(frozen=True)
class Keep(Decision):
  """The residual stays in device memory from forward to backward."""
  kind = "keep"


@dataclasses.dataclass(frozen=True)
class Recompute(Decision):
  """The residual is freed after its last forward use and rebuilt, from kept
  values, right before its first backward use.

  Attributes:
    with_block: rebuilt instead together with every residual of its block
      so marked, when the block's backward pass first needs one of them,
      behind one barrier tied to the gradient entering the block: as
      per-block ``jax.checkpoint`` rebuilds a block. The block's
      recomputation then fuses as XLA fuses ``jax.checkpoint``'s, at the
      price of holding all of the block's rebuilt residuals at once.
  """
  kind = "recompute"
  with_block: bool = False


@dataclasses.dataclass(frozen=True)
class Offload(Decision):
  """The residual is copied to host memory (``pinned_host``) as soon as it is
  made; its device buffer is freed after its last forward use, and a copy
  comes back before the backward pass reads it.

  Attributes:
    at: the backward equation (graph node index) before which the copy back
      is issued, so it overlaps the compute in between; None issues it right
      before the first backward reader.
  """
  kind = "offload"
  at: int | None = None


@dataclasses.dataclass(frozen=True)
class Save(Decision):
  """A forward value the backward pass does not read is kept anyway, so that
  recomputation can start from it: a checkpoint, like the inputs that
  ``jax.checkpoint`` saves at a block's boundary."""
  kind = "save"


@dataclasses.dataclass(frozen=True)
class Host(Decision):
  """Not a residual's: a step input that only the optimizer update reads
  (Adam's moments) lives in host memory between steps. The step takes it
  there, copies it to the device right before its first reader, and
  returns its update there (``graph._state``).

  Attributes:
    at: the backward equation before which its copy to the device is
      issued; None issues it right before its first reader.
  """
  kind = "host"
  at: int | None = None


@dataclasses.dataclass(frozen=True)
class Chunked(Decision):
  """A residual virtualized into vTensors (the vTensor seed's ``split``):
  right after it is made it is cut along ``axis`` into chunks, each its own
  buffer (``salloc``), and each chunk gets its own decision, :class:`Keep`
  or :class:`Offload` with its own copy-back point; before the backward
  pass reads it the chunks are joined again (``merge``). Only as many
  chunks as the peak needs leave the device. A loop's stacked residual
  chunked along its layer axis (axis 0) is a plan per range of layers: its
  loop runs in segments (``_loop_segments``), and a chunk may also be
  :class:`Recompute` (rebuilt per iteration in its segment).

  Attributes:
    axis: the axis cut.
    bounds: ``(start, stop)`` of each chunk along ``axis``, covering it.
    chunks: one decision per chunk.

  Example:
    >>> c = Chunked(0, ((0, 2), (2, 4)), (KEEP, Offload()))
    >>> c.offloaded
    (1,)
  """
  kind = "chunked"
  axis: int
  bounds: tuple
  chunks: tuple

  def __post_init__(self):
    if len(self.bounds) != len(self.chunks) or not self.bounds:
      raise ValueError(f"Chunked: expected one decision per chunk, got {len(self.bounds)} "
                       f"bounds and {len(self.chunks)} decisions")
    for d in self.chunks:
      if not isinstance(d, (Keep, Offload)) and not (isinstance(d, Recompute)
                                                     and self.axis == 0):
        raise ValueError(f"Chunked: a chunk is kept or offloaded (or, along a loop's "
                         f"layer axis 0, recomputed), got {d!r} on axis {self.axis}")

  @property
  def offloaded(self) -> tuple:
    """Indices of the chunks that go to host memory."""
    return tuple(i for i, d in enumerate(self.chunks) if d.kind == "offload")

  def chunk_bytes(self, shape: tuple, nbytes: int) -> list[int]:
    """Bytes of each chunk of an array of ``shape`` and ``nbytes`` cut as
    this decision says; they add up to ``nbytes`` exactly.

    Example:
      >>> Chunked(0, ((0, 2), (2, 5)), (KEEP, KEEP)).chunk_bytes((5, 4), 80)
      [32, 48]
    """
    row = nbytes // max(shape[self.axis], 1)
    return [(stop - start) * row for start, stop in self.bounds]


HOST = Host()
KEEP = Keep()
SAVE = Save()
RECOMPUTE = Recompute()
OFFLOAD = Offload()


@dataclasses.dataclass(frozen=True)
class Plan:
  """An immutable map from value id to :class:`Decision`: a residual's
  (kept unless mentioned), or a forward value's :class:`Save` (a block
  boundary recomputation starts from).

  Example:
    >>> plan = Plan().with_decision(7, RECOMPUTE)
    >>> plan[7].kind, plan[3].kind
    ('recompute', 'keep')
  """
  items: tuple = ()

  @classmethod
  def of(cls, decisions: Mapping[int, Decision]) -> "Plan":
    return cls(tuple(sorted((k, v) for k, v in decisions.items()
                            if not isinstance(v, Keep))))

  def as_dict(self) -> dict[int, Decision]:
    return dict(self.items)

  @functools.cached_property
  def _lookup(self) -> dict[int, Decision]:
    return dict(self.items)

  def __getitem__(self, vid: int) -> Decision:
    return self._lookup.get(vid, KEEP)

  def __iter__(self) -> Iterator[tuple[int, Decision]]:
    return iter(self.items)

  def __len__(self) -> int:
    return len(self.items)

  def __repr__(self) -> str:
    """``Plan(12 decisions: 10 recompute, 2 save)``; ``as_dict()`` has them all."""
    kinds: dict[str, int] = {}
    for _, decision in self.items:
      kinds[decision.kind] = kinds.get(decision.kind, 0) + 1
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    noun = "decision" if len(self) == 1 else "decisions"
    return f"Plan({len(self)} {noun}: {counts})" if self.items else "Plan()"

  def with_decision(self, vid: int, decision: Decision) -> "Plan":
    decisions = self.as_dict()
    decisions[vid] = decision
    return Plan.of(decisions)

  def values_with(self, kind: str) -> frozenset[int]:
    """Value ids whose decision has ``kind`` (e.g. ``"recompute"``)."""
    return frozenset(vid for vid, d in self.items if d.kind == kind)

  @property
  def uses_host(self) -> bool:
    """Whether anything goes to host memory (an offload or a chunk's)."""
    return any(d.kind == "offload" or (d.kind == "chunked" and d.offloaded)
               for _, d in self.items)

  def with_kind(self, kind: str) -> dict[int, Decision]:
    """Residual id -> decision, for the decisions of ``kind``."""
    return {vid: d for vid, d in self.items if d.kind == kind}
