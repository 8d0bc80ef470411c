"""How a compiler packs temporaries into one heap, and what that adds to
the live bytes.

XLA gives every temporary of a program an offset in one preallocated heap
(the footprint's ``temp_size_in_bytes``): buffers whose lifetimes overlap
must not overlap in the heap, and a buffer may take the place of one that
died. Its buffer assignment places them greedily, largest first, each in
the smallest free gap that holds it over its whole lifetime (a global
best fit over decreasing sizes); it tries two orders, by size and by
lifetime, and keeps the smaller heap. A heap packed so is at least the most
bytes live at once, and can be well above it: a large buffer that outlives
small ones keeps their gaps from fitting a larger one later.

:func:`packed` runs that placement over the memory model's buffers
(:func:`~jaxmem.cost._memory.buffer_spans`); the model's live peak plus
the gaps it leaves is the heap the compiler is expected to need.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

# XLA:GPU aligns each buffer it allocates to this many bytes.
ALIGNMENT = 128


def packed(spans: Iterable[tuple[int, int, int]], alignment: int = ALIGNMENT) -> int:
  """Bytes of the smaller heap of the two greedy placements (largest buffers
  first, then longest-lived first) of ``spans``, each ``(first op, last op,
  bytes)``, live from its first op to its last, both included.

  Example:
    >>> packed([(0, 1, 100), (1, 2, 100), (2, 3, 100)], alignment=1)
    200
    >>> spans = [(1, 2, 20), (2, 2, 20), (2, 3, 20), (3, 3, 30)]
    >>> packed(spans, alignment=1), live_peak(spans)  # the 30 fits no gap left
    (70, 60)
  """
  rounded = [(first, last, -(-size // alignment) * alignment)
             for first, last, size in spans if size > 0]
  by_size = sorted(rounded, key=lambda s: (-s[2], s[0] - s[1], s[0]))
  by_life = sorted(rounded, key=lambda s: (s[0] - s[1], -s[2], s[0]))
  return min(_best_fit(by_size), _best_fit(by_life))


def _best_fit(order: Sequence[tuple[int, int, int]]) -> int:
  """The heap's size after placing ``order``'s buffers in turn, each at the
  start of the smallest gap among the buffers placed before it that it
  overlaps in time (or on top of them where no gap holds it)."""
  count = len(order)
  firsts, lasts, offsets, sizes = (np.zeros(count, np.int64) for _ in range(4))
  top = 0
  for i, (first, last, size) in enumerate(order):
    overlaps = (firsts[:i] <= last) & (lasts[:i] >= first)
    offset = 0
    if overlaps.any():
      starts, ends = offsets[:i][overlaps], offsets[:i][overlaps] + sizes[:i][overlaps]
      ranked = np.argsort(starts, kind="stable")
      starts, reach = starts[ranked], np.maximum.accumulate(ends[ranked])
      gap_starts = np.concatenate(([0], reach[:-1]))
      gaps = starts - gap_starts
      fitting = gaps >= size
      offset = (int(gap_starts[np.argmin(np.where(fitting, gaps, np.iinfo(np.int64).max))])
                if fitting.any() else int(reach[-1]))
    firsts[i], lasts[i], offsets[i], sizes[i] = first, last, offset, size
    top = max(top, offset + size)
  return top


def live_peak(spans: Iterable[tuple[int, int, int]]) -> int:
  """The most bytes of ``spans`` live at one op: the least heap that holds
  them.

  Example:
    >>> live_peak([(0, 1, 100), (1, 2, 100), (2, 3, 100)])
    200
  """
  change: dict[int, int] = {}
  for first, last, size in spans:
    change[first] = change.get(first, 0) + size
    change[last + 1] = change.get(last + 1, 0) - size
  live = peak = 0
  for pos in sorted(change):
    live += change[pos]
    peak = max(peak, live)
  return peak
