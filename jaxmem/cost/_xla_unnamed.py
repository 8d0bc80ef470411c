"""The buffers a target's program writes that no equation is named by.

Most buffers of the program :func:`~jaxmem.cost._xla_buffers.learn` reads
carry the tag of the equation that made them. A few are XLA's own: a
max-pool's argmax indices, which XLA:GPU finds with a variadic
reduce-window beside the forward pool and keeps for the gradient; the
zeros the gradient's scatter starts from, which XLA:GPU makes in the pooled
activation's forward kernel (:func:`~jaxmem.cost._xla_names.outputs`) and
copies for the scatter to write into; weights relaid for cuDNN.
Their fusions carry no name, but their place in the schedule and their
readers do: :func:`unnamed` reads them, :func:`unnamed_spans` holds them
as :attr:`~jaxmem.cost._xla_buffers.Buffers.spans`.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxmem.cost import _hlo as hlo
from jaxmem.cost._xla_names import outputs, reading, runs, tag_of
from jaxmem.graph._graph import Graph


class Unnamed(NamedTuple):
  """A buffer the entry computation writes that no equation names: the
  span it is held for (the four fields of
  :attr:`~jaxmem.cost._xla_buffers.Buffers.spans`), whether its kernel
  reads only the step's arguments (a weight relaid for cuDNN), and the tags
  its last reader runs."""
  first: int
  last: int
  nbytes: int
  source: int | None
  relaid: bool
  last_runs: frozenset


def unnamed(program: hlo.Program) -> list[Unnamed]:
  """The buffers the entry computation writes that no equation names,
  read by instructions that do: a max-pool's argmax indices, which XLA:GPU
  finds in the forward pass beside the pool for its gradient; a copy of
  an activation that a max-pool's gradient scatters into; weights relaid
  for cuDNN. Each is held from the last equation named before it in the
  schedule (where XLA runs it) to its last reader; ``source`` is the last
  equation its kernel runs or reads the value of (a plan that rebuilds it
  moves the span). An array nothing reads (a variadic reduction's value
  beside the indices it is written for) is not held, nor one whose only
  reader writes its result into it (:func:`_updated_in_place`): it is that
  reader's value's buffer."""
  instructions = program.entry_instructions
  users = hlo.users_of(instructions)
  by_name = {inst.name: inst for inst in instructions}
  found, before = [], 0
  for inst in instructions:
    if inst.opcode in hlo.NO_BUFFER or inst.opcode in hlo.EXCHANGES:
      continue
    arrays = [(tag, a) for tag, out in outputs(inst, program) for a in out]
    reads = [_written_by(o, by_name) for o in inst.operands()]
    made = [t for t in map(tag_of, [*program.fused_body(inst), *filter(None, reads)])
            if t is not None]
    source = max(made) if made else None
    for index, (tag, array) in enumerate(arrays):
      every = reading(inst.name, users, index if len(arrays) > 1 else None)
      readers = _named_readers(every, users)
      if tag is None and readers and not _updated_in_place(inst, index, every, program,
                                                           by_name):
        last, reader = max(readers, key=lambda tr: tr[0])
        found.append(Unnamed(min(before, *(t for t, _ in readers)), last, array.nbytes,
                             source, source is None, runs(reader, program)))
    named = [t for t, _ in arrays if t is not None]
    before = max(named) if named else before
  return found


def unnamed_spans(graph: Graph, found: list[Unnamed]) -> tuple:
  """The :attr:`Buffers.spans` of the unnamed buffers ``found`` in
  ``graph``'s program. A relaid argument whose last reader writes a step
  output of its size (an optimizer's update of a relaid weight) takes no
  bytes of its own: XLA writes the output in its place, and output buffers
  are counted from the start."""
  spans = []
  for u in found:
    if u.last >= len(graph.nodes):
      continue
    if u.relaid and any(graph.values[v].nbytes == u.nbytes and v in graph.output_ids
                        for t in u.last_runs if t < len(graph.nodes)
                        for v in graph.nodes[t].outs):
      continue
    spans.append((u.first, u.last, u.nbytes, u.source))
  return tuple(spans)


def _named_readers(readers: list, users: dict) -> list:
  """(tag, instruction) of each of ``readers`` an equation names, and of
  those that read a copy no equation names in their place (the copy of
  zeros a max-pool gradient's scatter writes into)."""
  found = []
  for r in readers:
    tag = tag_of(r)
    if tag is not None:
      found.append((tag, r))
    elif r.opcode == "copy":
      found += _named_readers(reading(r.name, users), users)
  return found


def _updated_in_place(inst: hlo.Instruction, index: int, readers: list,
                      program: hlo.Program, by_name: dict) -> bool:
  """Whether ``inst``'s array ``index`` has one reader, which writes its
  result into it (``hlo.in_place``: a max-pool gradient's scatter into a
  copy of the activation, or into zeros). The buffer is then that
  reader's value's, counted as the value from the reader on."""
  if len(readers) != 1:
    return False
  reader = readers[0]
  at = hlo.in_place(reader, program)
  if at is None or at >= len(reader.operands()):
    return False
  name = reader.operands()[at]
  while name in by_name and by_name[name].opcode == "bitcast":
    name = by_name[name].operands()[0]
  view = by_name.get(name)
  if view is not None and view.opcode == "get-tuple-element":
    return view.operands()[:1] == [inst.name] and view.tuple_index() == index
  return name == inst.name


def _written_by(name: str, by_name: dict) -> hlo.Instruction | None:
  """The instruction that wrote what ``name`` names, through views and
  tuple elements (None for an argument or a constant)."""
  inst = by_name.get(name)
  while inst is not None and inst.opcode in ("get-tuple-element", "bitcast"):
    inst = by_name.get(inst.operands()[0]) if inst.operands() else None
  return None if inst is None or inst.opcode in ("parameter", "constant") else inst
