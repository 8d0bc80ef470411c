"""Per-equation compute cost (FLOPs), one rule per primitive.

The rule table follows ``jax``'s own convention for per-primitive rules: a dict
from primitive name to a function of the equation's input and output avals and
params. Primitives without a rule cost one operation per output element
(elementwise), which is right for the bulk of a training step.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np


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


def _free(in_avals, out_avals, params) -> float:
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
  return sum(eqn_flops(e.primitive.name, [_aval(v) for v in e.invars],
                       [v.aval for v in e.outvars], e.params)
             for e in jaxpr.eqns)


def _aval(atom):
  return atom.aval


def _scan(in_avals, out_avals, params) -> float:
  return params["length"] * sum(jaxpr_flops(j) for j in _inner(params))


def _branches(in_avals, out_avals, params) -> float:
  return max((jaxpr_flops(j) for j in _inner(params)), default=0.0)


def _calls(in_avals, out_avals, params) -> float:
  return sum(jaxpr_flops(j) for j in _inner(params))


RULES: dict[str, Callable] = {
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "reduce_sum": _reduce, "reduce_max": _reduce, "reduce_min": _reduce,
    "reduce_prod": _reduce, "argmax": _reduce, "argmin": _reduce,
    "reduce_and": _reduce, "reduce_or": _reduce, "cumsum": _reduce,
    "reshape": _free, "squeeze": _free, "expand_dims": _free,
    "optimization_barrier": _free, "stop_gradient": _free,
    "scan": _scan, "cond": _branches,
    "while": _calls, "checkpoint": _calls, "remat": _calls,
    "custom_jvp_call": _calls, "custom_vjp_call": _calls, "jit": _calls,
    "pjit": _calls, "closed_call": _calls,
}


def eqn_flops(prim_name: str, in_avals, out_avals, params) -> float:
  """FLOPs of one equation (rule table, elementwise by default).

  Example:
    >>> import jax.numpy as jnp, jax
    >>> eqn = jax.make_jaxpr(jnp.dot)(jnp.ones((4, 8)), jnp.ones((8, 2))).eqns[0]
    >>> eqn_flops("dot_general", [v.aval for v in eqn.invars],
    ...           [v.aval for v in eqn.outvars], eqn.params)
    128.0
  """
  rule = RULES.get(prim_name)
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
