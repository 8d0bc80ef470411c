"""Where data flows in an emitted step: checks of host offload and vTensors
read from the program itself, not from annotation counts.

XLA:CPU ignores host memory, so on CPU the program's
jaxpr is the referee: which values are copied to ``pinned_host``, which
copies come back, and which equations read what. Optimization barriers
pass values through (output ``i`` is input ``i``), so values are followed
through them.
"""

import jax
from jax.extend import core as jex

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def copies_to(eqn, space) -> bool:
  """Whether ``eqn`` copies its operand to memory ``space``."""
  return eqn.primitive.name == "device_put" and tuple(eqn.params["devices"]) == (space,)


def on_host(var) -> bool:
  return getattr(getattr(var, "aval", None), "memory_space", None) == HOST


def is_backward(eqn) -> bool:
  """An equation of the backward pass (its name stack holds a transpose)."""
  return "transpose(" in str(eqn.source_info.name_stack)


class Flow:
  """One top-level jaxpr with each value's *source*: the value itself, or
  for a barrier's output the source of its input; and each host copy's
  device source."""

  def __init__(self, jaxpr):
    self.eqns = jaxpr.eqns
    self.source = {}
    self.producer = {}
    for pos, eqn in enumerate(self.eqns):
      for i, out in enumerate(eqn.outvars):
        self.producer[out] = pos
        if eqn.primitive.name == "optimization_barrier":
          self.source[out] = self.of(eqn.invars[i])

  def of(self, var):
    """The value ``var`` passes on unchanged (through barriers)."""
    if isinstance(var, jex.Literal):
      return None
    return self.source.get(var, var)

  def reads(self, pos: int) -> set:
    return {self.of(v) for v in self.eqns[pos].invars} - {None}

  def made_by(self, var):
    """The equation that makes the value ``var`` passes on."""
    pos = self.producer.get(self.of(var))
    return None if pos is None else self.eqns[pos]

  def round_trips(self) -> list[tuple]:
    """``(device value, position of its copy out, positions of its copies
    back)`` for every value copied to host memory."""
    trips = []
    for pos, eqn in enumerate(self.eqns):
      if copies_to(eqn, HOST):
        host = eqn.outvars[0]
        back = [p for p, e in enumerate(self.eqns)
                if copies_to(e, DEVICE) and self.of(e.invars[0]) is host]
        trips.append((self.of(eqn.invars[0]), pos, back))
    return trips


def assert_offloads_flow(jaxpr) -> int:
  """Every value copied to host memory comes back, and once it is back
  (and anywhere in the backward pass) nothing reads the device original:
  its readers there read the copy brought back. Returns the number of
  values copied out."""
  flow = Flow(jaxpr)
  trips = flow.round_trips()
  for value, out, back in trips:
    assert back, f"{value} goes to the host and never comes back"
    first_back = min(back)
    assert out < first_back
    for pos, eqn in enumerate(flow.eqns):
      if value in flow.reads(pos) and not copies_to(eqn, HOST):
        assert pos < first_back and not is_backward(eqn), (
            f"{eqn.primitive} at {pos} reads the device original {value}, "
            f"which was copied out at {out} and back at {first_back}")
    fetched = [flow.eqns[p].outvars[0] for p in back]
    assert any(flow.of(v) in {flow.of(f) for f in fetched}
               for e in flow.eqns for v in e.invars if not isinstance(v, jex.Literal)), (
        f"nothing reads the copy of {value} brought back")
  return len(trips)


def chunk_merges(jaxpr) -> list[tuple]:
  """The vTensors of an emitted step, one per ``concatenate`` of slices of
  one value: ``(shape of the value, axis, ((start, stop, via_host), ...))``
  in the order the merge reads them, ``via_host`` saying whether the chunk
  went to host memory and came back on its way to the merge."""
  flow = Flow(jaxpr)
  found = []
  for eqn in flow.eqns:
    if eqn.primitive.name != "concatenate":
      continue
    axis, chunks, sources = eqn.params["dimension"], [], set()
    for var in eqn.invars:
      via_host, made = False, flow.made_by(var)
      while made is not None and copies_to(made, DEVICE):
        host = flow.made_by(made.invars[0])
        assert host is not None and copies_to(host, HOST), made
        via_host, made = True, flow.made_by(host.invars[0])
      if made is None or made.primitive.name != "slice":
        break
      sources.add(flow.of(made.invars[0]))
      chunks.append((made.params["start_indices"][axis], made.params["limit_indices"][axis],
                     via_host))
    else:
      if len(sources) == 1:
        found.append((tuple(sources.pop().aval.shape), axis, tuple(chunks)))
  return found


def assert_hosted_loops_flow(jaxpr) -> list:
  """Every host value at the top level is a forward scan's stacked output,
  made in its body by a copy to the host, and read only by backward scans,
  each passing it once, whose bodies copy each slice back once before
  anything else reads it; nothing is copied whole. Returns the shapes of
  the stacks made on the host."""
  made, read = [], set()
  for eqn in jaxpr.eqns:
    assert eqn.primitive.name != "device_put", "a whole stack copied between memories"
    if eqn.primitive.name != "scan":
      assert not any(on_host(v) for v in eqn.invars), eqn
      continue
    body = eqn.params["jaxpr"].jaxpr
    producers = {v: e for e in body.eqns for v in e.outvars}
    for out, inner in zip(eqn.outvars, body.outvars):
      if on_host(out):
        assert not eqn.params["reverse"], "only a forward scan stacks on the host"
        assert copies_to(producers[inner], HOST), producers.get(inner)
        made.append(out.aval.shape)
    outer = [v for v in eqn.invars if on_host(v)]
    assert len(set(outer)) == len(outer), "a host stack passed twice: copied back twice"
    read |= set(outer)
    for var in body.invars:
      if on_host(var):
        readers = [e for e in body.eqns if var in e.invars]
        assert len(readers) == 1 and copies_to(readers[0], DEVICE), readers
  stacks = {v for e in jaxpr.eqns for v in e.outvars if on_host(v)}
  assert stacks <= read, "a stack made on the host that no backward scan reads"
  return made
