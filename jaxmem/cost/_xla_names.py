"""Which equation each buffer of a target's program is named by.

The step as written is emitted with every equation under a name scope of
its own (``jaxmem#<node>``, :data:`TAG`), so each instruction of the
compiled program carries, in its ``op_name`` metadata, the graph node it
was emitted for: what the learned memory model (``_xla_buffers``) and the
clock read off the program.
"""

from __future__ import annotations

import re

from jaxmem.cost import _hlo as hlo

TAG = "jaxmem#"
_TAG = re.compile(re.escape(TAG) + r"(\d+)")


def tag_of(inst: hlo.Instruction) -> int | None:
  """The graph node an instruction was emitted for (its ``jaxmem#<node>``
  name scope), or None."""
  found = _TAG.search(inst.op_name)
  return int(found.group(1)) if found else None


def producers(inst: hlo.Instruction, program: hlo.Program) -> list:
  """(tag, array) of each buffer ``inst`` writes: of each of its outputs,
  the first array (a variadic reduction's value beside its indices)."""
  return [(tag, arrays[0]) for tag, arrays in outputs(inst, program) if arrays]


def outputs(inst: hlo.Instruction, program: hlo.Program) -> list:
  """(tag, arrays) of each output ``inst`` writes: a fusion's named by the
  fused instruction that produces it, else by ``inst``; a constant
  broadcast that no equation names (zeros XLA made itself: a max-pool
  gradient's scatter base, merged into a forward kernel) is no equation's
  (tag None), whatever kernel writes it."""
  body = program.fused_body(inst)
  root = next((i for i in body if i.root), None)
  if root is None:
    return [(tag_of(inst), [a]) for a in inst.results()]
  by_name = {i.name: i for i in body}
  outs = ([by_name[o] for o in root.operands() if o in by_name]
          if root.opcode == "tuple" else [root])
  found = []
  for out in outs:
    while out.opcode == "bitcast" and out.operands() and out.operands()[0] in by_name:
      out = by_name[out.operands()[0]]  # a reshape names no computation
    tag = tag_of(out)
    if tag is None and not _splat(out, by_name):
      tag = tag_of(inst)
    found.append((tag, out.arrays()))
  return found


def _splat(inst: hlo.Instruction, by_name: dict) -> bool:
  """Whether ``inst`` broadcasts a constant."""
  operands = inst.operands()
  return (inst.opcode == "broadcast" and len(operands) == 1 and operands[0] in by_name
          and by_name[operands[0]].opcode == "constant")


def runs(inst: hlo.Instruction, program: hlo.Program) -> frozenset:
  """The tags of the equations the kernel ``inst`` runs."""
  return frozenset(t for t in map(tag_of, [inst, *program.fused_body(inst)]) if t is not None)


def reading(name: str, users: dict, index: int | None = None) -> list:
  """The instructions that read ``name``'s results (with ``index``, the
  tuple element of that index), through the views and tuple elements that
  write no buffer."""
  found = []
  for user in users.get(name, ()):
    if user.opcode == "get-tuple-element" and index is not None:
      found += reading(user.name, users) if user.tuple_index() == index else []
    elif user.opcode in ("get-tuple-element", "bitcast"):
      found += reading(user.name, users)
    else:
      found.append(user)
  return found
