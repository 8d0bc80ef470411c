"""What each primitive is to jaxmem: one table, read by every model.

A primitive has a *class* (view, matmul, convolution, elementwise,
reduction, rng, collective, call, control flow, other), a few flags the
XLA:CPU fusion emulation and the performance model need, and a FLOP rule.
The graph, the memory model, the performance model and the planners ask
this table instead of keeping name lists of their own.

FLOP rules follow ``jax``'s own convention for per-primitive rules: a
function of the equation's input and output avals and params. Primitives
without a rule cost one operation per output element (elementwise), which
is right for the bulk of a training step.

Example:
  >>> classify("dot_general"), classify("reshape"), classify("no_such_op")
  ('matmul', 'view', 'other')
  >>> is_free("broadcast_in_dim"), fuses_elementwise("broadcast_in_dim")
  (True, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

VIEW, MATMUL, CONV, ELEMENTWISE, REDUCTION = (
    "view", "matmul", "conv", "elementwise", "reduction")
RNG, COLLECTIVE, CALL, CONTROL, OTHER = "rng", "collective", "call", "control", "other"


@dataclasses.dataclass(frozen=True)
class Primitive:
  """One row of the table.

  Attributes:
    kind: the primitive's class (``VIEW``, ``MATMUL``, ...).
    expensive: an elementwise op XLA will not duplicate into several fusions.
    free: costs nothing on the compute stream (views, and broadcasts, which
      XLA computes inside their readers).
    body: for a call-like primitive, the param holding the body that the
      graph inlines.
    flops: the FLOP rule, or None for one operation per output element.
  """
  kind: str
  expensive: bool = False
  free: bool = False
  body: str | None = None
  flops: Callable | None = None


def _size(aval) -> int:
  return int(math.prod(getattr(aval, "shape", ())))


def _dot_general(in_avals, out_avals, params) -> float:
  (lhs_contract, _), _ = params["dimension_numbers"]
  k = math.prod(in_avals[0].shape[d] for d in lhs_contract)
  return 2.0 * _size(out_avals[0]) * k


def _conv(in_avals, out_avals, params) -> float:
  rhs = in_avals[1]
  dn = params["dimension_numbers"]
  out_feature_dim = dn.rhs_spec[0] if dn is not None else 0
  macs_per_output = math.prod(rhs.shape) / max(rhs.shape[out_feature_dim], 1)
  return 2.0 * _size(out_avals[0]) * macs_per_output


def _reduce(in_avals, out_avals, params) -> float:
  return float(sum(_size(a) for a in in_avals))


def _zero(in_avals, out_avals, params) -> float:
  return 0.0


def _inner(params) -> list:
  from jax.extend import core as jex
  found = []
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jex.ClosedJaxpr):
        found.append(item.jaxpr)
      elif isinstance(item, jex.Jaxpr):
        found.append(item)
  return found


def jaxpr_flops(jaxpr) -> float:
  """FLOPs of an open jaxpr, summed over its equations."""
  return sum(eqn_flops(e.primitive.name, [v.aval for v in e.invars],
                       [v.aval for v in e.outvars], e.params)
             for e in jaxpr.eqns)


def _scan(in_avals, out_avals, params) -> float:
  return params["length"] * sum(jaxpr_flops(j) for j in _inner(params))


def _branches(in_avals, out_avals, params) -> float:
  return max((jaxpr_flops(j) for j in _inner(params)), default=0.0)


def _calls(in_avals, out_avals, params) -> float:
  return sum(jaxpr_flops(j) for j in _inner(params))


def _rows(names: str, **fields) -> dict[str, Primitive]:
  return {name: Primitive(**fields) for name in names.split()}


_CHEAP = """add add_any sub mul neg max min square integer_pow abs sign select_n
    clamp convert_element_type eq ne lt le gt ge and or not xor sin cos floor ceil
    round is_finite iota nextafter shift_left shift_right_logical
    shift_right_arithmetic reduce_precision copy real imag"""
_EXPENSIVE = """div exp exp2 log log1p expm1 tanh logistic sqrt rsqrt cbrt pow erf
    erfc erf_inv atan2 rem"""

TABLE: dict[str, Primitive] = {
    **_rows(_CHEAP, kind=ELEMENTWISE),
    **_rows(_EXPENSIVE, kind=ELEMENTWISE, expensive=True),
    "broadcast_in_dim": Primitive(ELEMENTWISE, free=True),
    "stop_gradient": Primitive(ELEMENTWISE, flops=_zero),
    **_rows("reshape squeeze expand_dims optimization_barrier", kind=VIEW, free=True,
            flops=_zero),
    "name": Primitive(VIEW, free=True),  # checkpoint_name: a view, elementwise FLOPs
    "dot_general": Primitive(MATMUL, flops=_dot_general),
    "conv_general_dilated": Primitive(CONV, flops=_conv),
    **_rows("reduce_sum reduce_max reduce_min reduce_prod argmax argmin reduce_and "
            "reduce_or", kind=REDUCTION, flops=_reduce),
    "cumsum": Primitive(OTHER, flops=_reduce),
    **_rows("random_bits random_seed random_wrap random_unwrap random_fold_in "
            "random_split threefry2x32", kind=RNG),
    # pvary / psum_invariant (pbroadcast / psum2 in older JAX): what
    # shard_map's varying-axes typing inserts between replicated and
    # per-device values.
    **_rows("psum pmax pmin ppermute all_gather all_gather_invariant all_to_all "
            "reduce_scatter psum_scatter pvary psum_invariant pbroadcast psum2",
            kind=COLLECTIVE),
    "jit": Primitive(CALL, body="jaxpr", flops=_calls),
    "pjit": Primitive(CALL, body="jaxpr", flops=_calls),
    "closed_call": Primitive(CALL, body="call_jaxpr", flops=_calls),
    "core_call": Primitive(CALL, body="call_jaxpr"),
    "custom_jvp_call": Primitive(CALL, body="call_jaxpr", flops=_calls),
    "custom_vjp_call": Primitive(CALL, body="call_jaxpr", flops=_calls),
    "custom_vjp_call_jaxpr": Primitive(CALL, body="fun_jaxpr"),
    "scan": Primitive(CONTROL, flops=_scan),
    "cond": Primitive(CONTROL, flops=_branches),
    "while": Primitive(CONTROL, flops=_calls),
    "checkpoint": Primitive(CONTROL, flops=_calls),
    "remat": Primitive(CONTROL, flops=_calls),
}
_UNKNOWN = Primitive(OTHER)


def info(name: str) -> Primitive:
  """The table's row for primitive ``name`` (an ``OTHER`` row if absent)."""
  return TABLE.get(name, _UNKNOWN)


def classify(name: str) -> str:
  """The class of primitive ``name``."""
  return info(name).kind


def is_view(name: str) -> bool:
  """Whether the primitive's output shares its input's buffer."""
  return info(name).kind == VIEW


def is_free(name: str) -> bool:
  """Whether the primitive costs nothing on the compute stream."""
  return info(name).free


def communicates(name: str) -> bool:
  """Whether the primitive may move data between devices (the varying-axes
  casts ``pvary`` / ``pbroadcast`` move nothing; a ``shard_map`` planned as
  one equation may run collectives inside)."""
  return name == "shard_map" or (classify(name) == COLLECTIVE
                                 and name not in ("pvary", "pbroadcast"))


# Collectives whose value a plan may make again: an all-gather makes the
# whole of a value each device holds a shard of (FSDP's weights), and
# gathering it again costs the interconnect's time, as keeping it costs
# memory. Every other collective's value is kept: running it again would
# change what it sums, or repeat what the step does once.
GATHERS = frozenset({"all_gather", "all_gather_invariant"})


def rebuildable(name: str) -> bool:
  """Whether a value the primitive makes may be rebuilt by running it again
  (with no effects of its own): it moves no data between devices, or it is
  a gather (:data:`GATHERS`)."""
  return not communicates(name) or name in GATHERS


def is_matmul(name: str) -> bool:
  """Matrix products and convolutions: what ``dots_saveable`` keeps."""
  return info(name).kind in (MATMUL, CONV)


def fuses_elementwise(name: str) -> bool:
  """Whether XLA's instruction fusion treats it as elementwise."""
  return info(name).kind == ELEMENTWISE


def is_expensive(name: str) -> bool:
  """An elementwise op XLA fuses only into a sole reader."""
  return info(name).expensive


def is_reduction(name: str) -> bool:
  return info(name).kind == REDUCTION


def inlined_body(name: str) -> str | None:
  """The param holding a call-like primitive's body, which the graph
  inlines; None for every other primitive."""
  return info(name).body


def eqn_flops(prim_name: str, in_avals, out_avals, params) -> float:
  """FLOPs of one equation (the table's rule, elementwise by default).

  Example:
    >>> import jax.numpy as jnp, jax
    >>> eqn = jax.make_jaxpr(jnp.dot)(jnp.ones((4, 8)), jnp.ones((8, 2))).eqns[0]
    >>> eqn_flops("dot_general", [v.aval for v in eqn.invars],
    ...           [v.aval for v in eqn.outvars], eqn.params)
    128.0
  """
  rule = info(prim_name).flops
  if rule is not None:
    return float(rule(in_avals, out_avals, params))
  return float(sum(_size(a) for a in out_avals))


def aval_bytes(aval) -> int:
  """Bytes an array of this abstract value occupies (0 for tokens)."""
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  try:
    itemsize = np.dtype(dtype).itemsize
  except TypeError:  # extended dtypes such as PRNG keys
    impl = getattr(dtype, "_impl", None)
    key_shape = getattr(impl, "key_shape", (2,))
    itemsize = 4 * int(math.prod(key_shape))
  return int(math.prod(shape)) * itemsize
