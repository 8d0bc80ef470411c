"""Arguments that live in host memory between steps (optimizer state).

A fit that keeps optimizer state in host memory (``graph._state``) takes
those leaves, and returns their updates, in ``pinned_host``. On a device
present, that is the arrays' own memory kind: :func:`to_host` puts the
leaves there before a call (``jax.jit`` refuses a device array where it
compiled for a host one). A compile-only GPU has no memories, so a sharding
on it drops any memory kind; :func:`compile_with_host_args` then marks the
arguments host memory in the lowered module (``mhlo.memory_kind``, the
attribute JAX writes for a ``pinned_host`` sharding) and checks that XLA's
``memory_analysis()`` shows them there.
"""

from __future__ import annotations

from typing import Sequence

import jax

HOST = "pinned_host"


def on_host(leaf) -> bool:
  """Whether an array (or abstract array) is placed in host memory."""
  sharding = getattr(leaf, "sharding", None)
  return getattr(sharding, "memory_kind", None) == HOST


def to_host(leaves: Sequence, positions, donated=frozenset(), abstract: bool = False) -> list:
  """``leaves`` with those at ``positions`` in host memory and the rest
  committed to the device, so that ``jax.jit`` knows every argument's
  memory kind (it pairs a donated argument with an output of its own kind
  only then).

  Arrays at ``positions`` are copied there once (a donated one, at a
  position in ``donated``, is deleted after the copy, as ``jax.jit``
  deletes what it is donated); with ``abstract``, every leaf is described
  (``jax.ShapeDtypeStruct``) in its memory instead, to compile.
  """
  device = device_of(leaves)
  out = list(leaves)
  for i, leaf in enumerate(out):
    kind = HOST if i in positions else "device"
    sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(device)
    if abstract or isinstance(leaf, jax.ShapeDtypeStruct):
      aval = jax.typeof(leaf)
      out[i] = jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type,
                                    sharding=sharding.with_memory_kind(kind))
    elif kind == HOST and not on_host(leaf):
      out[i] = jax.device_put(leaf, sharding.with_memory_kind(HOST))
      if i in donated:
        leaf.delete()
    elif not getattr(leaf, "committed", False):
      out[i] = jax.device_put(leaf, sharding)
  return out


def device_of(leaves):
  """The device the step's array arguments are on."""
  for leaf in leaves:
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      return next(iter(sharding.device_set))
  return jax.devices()[0]


def devices_of(leaves) -> int:
  """The number of devices the step's argument ``leaves`` lie on (1 for
  abstract or unplaced leaves)."""
  found = set()
  for leaf in leaves:
    found.update(getattr(getattr(leaf, "sharding", None), "device_set", ()))
  return max(len(found), 1)


def sharding_texts(leaves) -> tuple[str, ...]:
  """The shardings of the step's argument ``leaves`` as text ("None" for a
  leaf without one): part of what decides a compiled footprint."""
  return tuple(str(getattr(leaf, "sharding", None)) for leaf in leaves)


def as_device(leaf):
  """A stand-in in device memory for tracing a host-memory leaf (the step
  as written computes on its arguments where they are); other leaves as
  they are."""
  if not on_host(leaf):
    return leaf
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                              sharding=leaf.sharding.with_memory_kind("device"),
                              weak_type=jax.typeof(leaf).weak_type)


def compile_with_host_args(lowered, positions: Sequence[int], nbytes: int,
                           compiler_options=None):
  """Compiles ``lowered`` (``jax.jit(...).lower(...)`` on a compile-only
  device) with its flat arguments at ``positions`` in host memory.

  Args:
    lowered: the lowering, whose arguments were placed on the device.
    positions: flat argument positions to mark host memory.
    nbytes: their bytes, which XLA's analysis must show in host memory.
    compiler_options: passed to ``compile``.

  Raises:
    NotImplementedError: where this JAX's lowering does not take the marks
      (XLA's analysis does not show the bytes on the host).
  """
  mark_host_args(lowered, positions)
  compiled = lowered.compile(compiler_options)
  stats = compiled.memory_analysis()
  if stats is None or stats.host_argument_size_in_bytes < nbytes:
    raise NotImplementedError(
        "jaxmem: could not place the optimizer state's arguments in host memory "
        f"on a compile-only device with jax {jax.__version__} (XLA's analysis shows "
        f"{0 if stats is None else stats.host_argument_size_in_bytes} host argument "
        f"bytes, expected {nbytes})")
  return compiled


def mark_host_args(lowered, positions: Sequence[int]):
  """Marks ``lowered``'s flat arguments at ``positions`` as host memory
  (``mhlo.memory_kind``), in place, for a compile-only device whose
  shardings carry no memory kind; returns ``lowered``."""
  from jax._src.lib.mlir import ir
  module = lowered.compiler_ir("stablehlo")
  kept = sorted(lowered._lowering.compile_args.get("kept_var_idx", ()))
  with module.context:
    main = next(op for op in module.body.operations
                if "sym_name" in op.attributes
                and ir.StringAttr(op.attributes["sym_name"]).value == "main")
    attrs = list(main.attributes["arg_attrs"])
    results = [_entries(attr) for attr in main.attributes["res_attrs"]]
    host_results = {i for i, entries in enumerate(results)
                    if "mhlo.memory_kind" in entries
                    and ir.StringAttr(entries["mhlo.memory_kind"]).value == HOST}
    if len(attrs) == len(kept):
      marked = []
      for position, attr in zip(kept, attrs):
        entries = _entries(attr)
        if position in positions:
          entries["mhlo.memory_kind"] = ir.StringAttr.get(HOST)
        # JAX pairs donated arguments with outputs by shape alone where it
        # knows no argument's memory kind: an alias across memories is
        # dropped (the argument is then only read).
        alias = entries.get("tf.aliasing_output")
        if alias is not None and ((position in positions)
                                  != (ir.IntegerAttr(alias).value in host_results)):
          del entries["tf.aliasing_output"]
        marked.append(ir.DictAttr.get(entries))
      main.attributes["arg_attrs"] = ir.ArrayAttr.get(marked)
  return lowered


def _entries(attr) -> dict:
  from jax._src.lib.mlir import ir
  return {named.name: named.attr for named in ir.DictAttr(attr)}


def device_aval(leaf):
  """``leaf``'s abstract value as the step sees it, in device memory
  wherever the leaf is: a step fitted once is called again with the state
  it returned in host memory."""
  aval = jax.typeof(leaf)
  return aval.update(memory_space=jax.memory.Space.Device) if on_host(leaf) else aval
