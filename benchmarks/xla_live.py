"""XLA's own live bytes over a compiled program, read from its dump.

The memory model is checked against XLA's footprint; where they differ,
this says where XLA's peak is and what is live there. Compile the step
with ``--xla_dump_to=DIR`` (or ``compiler_options={"xla_dump_to": DIR}``)
and point this at ``DIR``: it reads the ``*-live-range.txt`` (each value's
live range over the instruction sequence) and ``*-buffer-assignment.txt``
(each value's allocation, offset and size) of the largest module there,
and prints

* the bytes of the parameters' and outputs' allocations (held throughout);
* the most temporary bytes live at once, the instruction where, and the
  size of XLA's temporary allocations (the heap: what ``memory_analysis``
  calls ``temp_size_in_bytes``; the difference is packing);
* with ``--at T`` (an instruction's position, or ``peak``), the largest
  temporaries live there.

Values that share a heap slice while both are live (a scatter or a
dynamic-update-slice written in place into its operand) count once: the
``Live ranges at N (peak)`` section of the dump counts them twice.

  PYTHONPATH=. python benchmarks/xla_live.py /tmp/dump --at peak
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import typing

MIB = 2.0**20
_ALLOCATION = re.compile(r"allocation (\d+): size (\d+)(.*):")
_VALUE = re.compile(r" value: <\d+ (\S+) @0> \(size=(\d+),offset=(\d+)\)")
_SEQUENCE = re.compile(r"\s+(\d+):(\S+)")
_RANGE = re.compile(r"\s+(\S+):(\d+)-(\d+)$")


class Placed(typing.NamedTuple):
  """Where buffer assignment put a value."""
  allocation: int
  offset: int
  nbytes: int
  held: bool  # a parameter's or an output's allocation, live throughout


class Program(typing.NamedTuple):
  sequence: list  # instruction names in schedule order
  ranges: dict  # value -> (first, last) position
  placed: dict  # value -> Placed, of the device memory's allocations
  held: int  # bytes of the parameters' and outputs' allocations
  heap: int  # bytes of the temporaries' allocations


def _kind(attributes: str) -> str | None:
  """An allocation's part of the footprint from its header: "held"
  (parameters, outputs), "heap" (temporaries) or None (a kernel's
  thread-local scalars, constants)."""
  if "parameter" in attributes or "live-out" in attributes:
    return "held"
  return "heap" if "preallocated-temp" in attributes else None


def read(folder: str) -> Program:
  """The largest module's live ranges and buffer assignment in ``folder``."""
  found = glob.glob(os.path.join(folder, "*after_optimizations-live-range.txt"))
  if not found:
    raise SystemExit(f"no *after_optimizations-live-range.txt in {folder}: compile with "
                     "xla_dump_to set to it")
  live = max(found, key=os.path.getsize)
  placed, kind, sizes = {}, None, {"held": 0, "heap": 0}
  with open(live.replace("-live-range.txt", "-buffer-assignment.txt")) as f:
    for line in f:
      if m := _ALLOCATION.match(line):
        allocation, kind = int(m.group(1)), _kind(m.group(3))
        if kind is not None:
          sizes[kind] += int(m.group(2))
      elif (m := _VALUE.match(line)) and kind is not None:
        placed[m.group(1)] = Placed(allocation, int(m.group(3)), int(m.group(2)),
                                    kind == "held")
  sequence, ranges, section = [], {}, None
  with open(live) as f:
    for line in f:
      if line.startswith("  InstructionSequence"):
        section = sequence
      elif line.startswith("  BufferLiveRange"):
        section = ranges
      elif line.startswith("  Live ranges at"):
        break
      elif section is sequence and (m := _SEQUENCE.match(line)):
        sequence.append(m.group(2))
      elif section is ranges and (m := _RANGE.match(line)):
        # The live ranges name an array value ``x{}``, buffer assignment ``x``.
        ranges[m.group(1).removesuffix("{}")] = (int(m.group(2)), int(m.group(3)))
  return Program(sequence, ranges, placed, sizes["held"], sizes["heap"])


def spans(program: Program) -> list[tuple[int, int, int]]:
  """``(first, last, bytes)`` of each temporary buffer: the values of one
  heap slice whose live ranges overlap are one buffer."""
  slices = collections.defaultdict(list)
  for name, span in program.ranges.items():
    where = program.placed.get(name)
    if where is not None and not where.held:
      slices[where[:3]].append(span)
  found = []
  for (_, _, nbytes), ranges in slices.items():
    ranges.sort()
    first, last = ranges[0]
    for a, b in ranges[1:]:
      if a > last:
        found.append((first, last, nbytes))
        first = a
      last = max(last, b)
    found.append((first, last, nbytes))
  return found


def summary(program: Program) -> dict:
  """Held bytes, the temporaries' live peak and where, and the heap's size."""
  temporaries = spans(program)
  live = [0] * (len(program.sequence) + 1)
  for first, last, nbytes in temporaries:
    for t in range(first, last + 1):
      live[t] += nbytes
  at = max(range(len(live)), key=live.__getitem__)
  return {"held": program.held, "peak": live[at], "at": at,
          "instruction": program.sequence[at] if at < len(program.sequence) else "",
          "heap": program.heap}


def live_at(program: Program, t: int, top: int) -> list[tuple[int, str, tuple]]:
  """The ``top`` largest temporaries live at position ``t``."""
  rows = [(program.placed[n].nbytes, n, span) for n, span in program.ranges.items()
          if n in program.placed and not program.placed[n].held and span[0] <= t <= span[1]]
  return sorted(rows, reverse=True)[:top]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("folder")
  parser.add_argument("--at", default=None, help="an instruction's position, or peak")
  parser.add_argument("--top", type=int, default=20)
  args = parser.parse_args(argv)
  program = read(args.folder)
  s = summary(program)
  print(f"held (parameters, outputs) {s['held'] / MIB:.1f} MiB; temporaries' live peak "
        f"{s['peak'] / MIB:.1f} MiB at {s['at']} ({s['instruction']}); heap "
        f"{s['heap'] / MIB:.1f} MiB; together {(s['held'] + s['heap']) / MIB:.1f} MiB")
  if args.at is not None:
    t = s["at"] if args.at == "peak" else int(args.at)
    for nbytes, name, (first, last) in live_at(program, t, args.top):
      print(f"  {nbytes / MIB:9.2f} MiB  {name}  live {first}-{last}")


if __name__ == "__main__":
  main()
