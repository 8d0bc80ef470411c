"""A reader for the optimized HLO text a compiled step prints.

``compiled.as_text()`` is the program the compiler runs: computations of
instructions in their scheduled order, each with its shape, opcode,
operands and attributes. The learned memory model (``_xla_buffers``) reads
which buffers it writes; the clock (``_xla_clock``) reads what each kernel
moves and computes. Only what those need is parsed: an instruction keeps
its attribute text, and its readers pick from it.

Example:
  >>> program = parse('''
  ... ENTRY %main (p: f32[4]) -> f32[4] {
  ...   %p = f32[4]{0} parameter(0)
  ...   ROOT %n = f32[4]{0} negate(%p), metadata={op_name="jit(f)/neg"}
  ... }''')
  >>> [(i.name, i.opcode, i.operands(), i.op_name) for i in program.entry_instructions]
  [('p', 'parameter', [], ''), ('n', 'negate', ['p'], 'jit(f)/neg')]
  >>> program.entry_instructions[1].arrays()
  [Array(dtype='f32', dims=(4,), host=False)]
"""

from __future__ import annotations

import dataclasses
import re
import typing

import numpy as np

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_INDEX = re.compile(r"\bindex=(\d+)")
_CALLED = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_HOST_SPACE = "S(5)"  # the memory space XLA puts host buffers in
# Instructions that write no buffer of their own: they name, forward or
# alias what others wrote, or wait for what an earlier one started.
NO_BUFFER = frozenset({
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "opt-barrier",
    "after-all", "partition-id", "replica-id", "copy-done", "send-done", "recv-done"})
# Instructions that move data between devices (an async one where it starts).
COLLECTIVES = frozenset({
    "all-gather", "all-gather-start", "all-reduce", "all-reduce-start", "reduce-scatter",
    "all-to-all", "collective-permute", "collective-permute-start"})
# The second of an async collective's pair: it waits for what its start
# (its operand) began and names the results, whose buffers its start holds
# from then on (the start's shape lists its operands beside them).
COLLECTIVE_DONES = frozenset({
    "all-gather-done", "all-reduce-done", "reduce-scatter-done", "all-to-all-done",
    "collective-permute-done"})
# Every instruction of a collective, and those of them whose results are a
# value summed over the devices' parts of it (not a copy of what one device
# holds: an all-gather's operand).
EXCHANGES = COLLECTIVES | COLLECTIVE_DONES | {"reduce-scatter-start", "all-to-all-start"}
REDUCTIONS = frozenset({"all-reduce", "all-reduce-start", "all-reduce-done", "reduce-scatter",
                        "reduce-scatter-start", "reduce-scatter-done"})


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of an instruction's shape."""
  dtype: str
  dims: tuple[int, ...]
  host: bool  # in host memory (memory space ``S(5)``)

  @property
  def size(self) -> int:
    return int(np.prod(self.dims)) if self.dims else 1

  @property
  def nbytes(self) -> int:
    return self.size * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction: ``%name = shape opcode(operands), attributes``."""
  name: str
  shape: str
  opcode: str
  rest: str  # the operand list and the attributes after the opcode's "("
  root: bool

  @property
  def op_name(self) -> str:
    """The ``op_name`` of its metadata: the JAX name stack it came from."""
    found = _OP_NAME.search(self.rest)
    return found.group(1) if found else ""

  def arrays(self) -> list[Array]:
    """The arrays of its shape (a tuple's elements in order)."""
    return [Array(dtype, tuple(int(d) for d in dims.split(",") if d),
                  _HOST_SPACE in (layout or ""))
            for dtype, dims, layout in _ARRAY.findall(self.shape)]

  def results(self) -> list[Array]:
    """The arrays it writes: its shape's, but of a library call (cuBLAS,
    cuDNN) only the result, not the workspace beside it."""
    arrays = self.arrays()
    return arrays[:1] if self.opcode == "custom-call" and len(arrays) > 1 else arrays

  def call_target(self) -> str:
    """A custom call's ``custom_call_target`` (``__cublas$lt$matmul``,
    ``__cudnn$convForward``), else ``""``."""
    found = _CALL_TARGET.search(self.rest) if self.opcode == "custom-call" else None
    return found.group(1) if found else ""

  def crosses_memory(self) -> bool:
    """Whether it is a ``copy-start`` between device and host memory (its
    destination and source arrays in different memory spaces)."""
    arrays = self.arrays()
    return (self.opcode == "copy-start" and len(arrays) >= 2
            and arrays[0].host != arrays[1].host)

  def operands(self) -> list[str]:
    return re.findall(r"%([\w.\-]+)", self.rest[:closing(self.rest, depth=1)])

  def tuple_index(self) -> int | None:
    """The element a ``get-tuple-element`` takes of its operand, else None."""
    found = _INDEX.search(self.rest) if self.opcode == "get-tuple-element" else None
    return int(found.group(1)) if found else None

  def called(self) -> list[tuple[str, str]]:
    """(role, computation) of each computation it calls: ``calls`` (a
    fusion's body), ``body``/``condition`` (a loop), ``to_apply``, branches."""
    found = _CALLED.findall(self.rest)
    for group in _BRANCHES.findall(self.rest):
      found += [("branch", name) for name in re.findall(r"%([\w.\-]+)", group)]
    return found


@dataclasses.dataclass(frozen=True)
class Program:
  """A parsed HLO module: computation name -> instructions in order."""
  computations: dict[str, list[Instruction]]
  entry: str

  @property
  def entry_instructions(self) -> list[Instruction]:
    return self.computations[self.entry]

  def fused_body(self, inst: Instruction) -> list[Instruction]:
    """The instructions a fusion computes in its one kernel; [] for any
    other instruction."""
    called = [c for role, c in inst.called() if role == "calls"]
    if inst.opcode != "fusion" or not called:
      return []
    return self.computations.get(called[0], [])

  def scheduled(self) -> list[str]:
    """The computations that run as a schedule of kernels: the entry and
    what its loops, conditionals and calls run (not fusions' bodies, which
    are one kernel each)."""
    seen, todo = [], [self.entry]
    while todo:
      name = todo.pop()
      if name in seen or name not in self.computations:
        continue
      seen.append(name)
      for inst in self.computations[name]:
        todo += [c for role, c in inst.called() if _runs_as_schedule(inst.opcode, role)]
    return seen


# Instructions whose result XLA writes into their first operand's buffer.
IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})


def parameter_number(inst: Instruction) -> int:
  """The argument position of a ``parameter`` instruction (-1 if unread)."""
  found = re.match(r"\s*(\d+)", inst.rest)
  return int(found.group(1)) if found else -1


def in_place(inst: Instruction, program: Program) -> int | None:
  """The operand whose buffer ``inst``'s result is written into: a
  dynamic-update-slice's or a scatter's first, alone or at the root of a
  fusion that takes it as a parameter (through reshapes); else None. XLA
  updates it there when nothing reads the operand afterwards, and copies
  it first otherwise."""
  if inst.opcode in IN_PLACE:
    return 0
  body = program.fused_body(inst)
  root = next((i for i in body if i.root), None)
  if root is None or root.opcode not in IN_PLACE or not root.operands():
    return None
  by_name = {i.name: i for i in body}
  first = by_name.get(root.operands()[0])
  while first is not None and first.opcode == "bitcast" and first.operands():
    first = by_name.get(first.operands()[0])
  return parameter_number(first) if first is not None and first.opcode == "parameter" else None


class Exchange(typing.NamedTuple):
  """One array a collective writes: the instruction it runs as (an async
  pair's start, else itself), the array, whether it is summed over the
  devices (:data:`REDUCTIONS`), the instructions that read it (through
  tuple elements and bitcasts) and the one that made what it exchanges
  (through the same; None where unknown)."""
  start: Instruction
  array: Array
  reduces: bool
  readers: tuple
  source: Instruction | None


_VIEWS = ("get-tuple-element", "bitcast")


def users_of(instructions: list[Instruction]) -> dict[str, list[Instruction]]:
  """Instruction name -> the instructions that read its results, each once."""
  users: dict[str, list] = {}
  for inst in instructions:
    for operand in dict.fromkeys(inst.operands()):
      users.setdefault(operand, []).append(inst)
  return users


def exchanges(program: Program) -> list[Exchange]:
  """Every array the collectives of the scheduled computations write: the
  results of an async collective's done, which its start holds from then
  on (the start's own shape lists its operands beside them)."""
  found = []
  for name in program.scheduled():
    instructions = program.computations[name]
    by_name = {inst.name: inst for inst in instructions}
    users = users_of(instructions)

    def readers(inst, index=None) -> list:
      found = []
      for user in users.get(inst.name, ()):
        if user.opcode in _VIEWS:
          if user.opcode == "bitcast" or index is None or user.tuple_index() == index:
            found += readers(user)
        else:
          found.append(user)
      return found

    def made(inst):
      while inst is not None and inst.opcode in _VIEWS and inst.operands():
        inst = by_name.get(inst.operands()[0])
      return inst

    for inst in instructions:
      if inst.opcode not in EXCHANGES or inst.opcode.endswith("-start"):
        continue
      start = (by_name.get(next(iter(inst.operands()), ""), inst)
               if inst.opcode in COLLECTIVE_DONES else inst)
      arrays = inst.arrays()
      sources = [made(by_name.get(o)) for o in start.operands()]
      for i, array in enumerate(arrays):
        found.append(Exchange(start, array, inst.opcode in REDUCTIONS,
                              tuple(readers(inst, None if len(arrays) == 1 else i)),
                              sources[i] if len(sources) == len(arrays) else None))
  return found


def _runs_as_schedule(opcode: str, role: str) -> bool:
  """Whether the computation an instruction calls in ``role`` is a schedule
  of kernels (a loop's body, a branch, a call or an async wrapper), not one
  kernel's body (a fusion's) or a reduction's scalar function."""
  if role == "calls":
    return opcode != "fusion"
  return role != "to_apply" or opcode == "call"


def closing(text: str, depth: int = 0) -> int:
  """The index of the parenthesis that closes ``depth`` open ones (plus
  any opened in ``text``): the end of an operand list or a tuple shape."""
  for i, char in enumerate(text):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return i
  return len(text)


def itemsize(dtype: str) -> int:
  if dtype == "pred":
    return 1
  bits = re.search(r"\d+", dtype)
  return max(1, int(bits.group()) // 8) if bits else 4


def _split_shape(text: str) -> tuple[str, str]:
  """``"(f32[2]{0}, s8[4]{0}) custom-call(...)"`` -> shape, the rest."""
  if not text.startswith("("):
    shape, _, rest = text.partition(" ")
    return shape, rest
  end = closing(text)
  return text[:end + 1], text[end + 2:]


def parse(text: str) -> Program:
  """Optimized HLO text (``compiled.as_text()``) -> :class:`Program`."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = computations.setdefault(header.group(1), [])
      if line.startswith("ENTRY"):
        entry = header.group(1)
      continue
    found = _INSTRUCTION.match(line)
    if found and current is not None:
      shape, rest = _split_shape(found.group(3))
      opcode, _, rest = rest.partition("(")
      current.append(Instruction(found.group(2), shape, opcode.strip(), rest,
                                 bool(found.group(1))))
  return Program(computations, entry)
