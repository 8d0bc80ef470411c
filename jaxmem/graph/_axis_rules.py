"""How each primitive treats a batch's example axis: one rule per primitive.

A rule takes an equation and the example axis of each input (None where an
input holds no examples) and says where its outputs carry the examples,
whether it reduces over them (and how chunks' partial results combine), and
which inputs without examples must still be taken per chunk (``demand``).
It raises :class:`Refuse` where the examples cannot be split there (a window
spanning examples, an index along them). :func:`chunk_params` gives an
equation's params for one chunk (its shape params cut).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem.graph._graph import build_graph
  >>> g = build_graph(jax.make_jaxpr(lambda x, w: x @ w)(jnp.ones((8, 4)), jnp.ones((4, 2))))
  >>> node = g.nodes[0]
  >>> RULES["dot_general"](node, [0, None], [(8, 4), (4, 2)], [(8, 2)])
  Rule(outs=(0,), combine=None, demand=(), combines=(), threads=(), body=None, own=())
  >>> RULES["dot_general"](node, [1, 0], [(8, 4), (4, 2)], [(8, 2)]).combine
  'add'
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

ADD, MAX, MIN, OR, AND, SCATTER_ADD = "add", "max", "min", "or", "and", "scatter-add"

ELEMENTWISE = frozenset("""abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt
    ceil clamp conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc
    exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max
    min mul ne neg nextafter not or population_count pow real reduce_precision rem round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
    stop_gradient sub tan tanh xor sharding_constraint name
    bitcast_convert_type""".split())




class Refuse(Exception):
  """The examples cannot be split at this equation; the message says why."""


@dataclasses.dataclass(frozen=True)
class Rule:
  """What one equation does with the example axis.

  Attributes:
    outs: each output's example axis (None: the output has none).
    combine: where the equation reduces over the examples, how chunks'
      results combine (``ADD``, ``MAX``, ...); its outputs have no axis.
    demand: ``(input position, axis)`` for inputs without an example axis
      that must be taken per chunk along ``axis``.
    combines: for an equation of several outputs (a loop), each output's
      ``combine`` (None where it is not combined); empty where ``combine``
      names the first output's.
    threads: ``(output position, input position)`` for combined outputs
      whose chunks run from the running total, passed in place of that
      input (a ``scatter-add`` into its operand, a loop's accumulating
      carry); the chunk's result is the new total.
    body: for a loop, its body's split (``graph._scan_axes.ScanBody``).
    own: ``(input position, column)`` of index vectors whose column holds
      each example's own position (``graph._positions``); each chunk puts
      its own positions there.
  """
  outs: tuple = ()
  combine: str | None = None
  demand: tuple = ()
  combines: tuple = ()
  threads: tuple = ()
  body: object = None
  own: tuple = ()

  def output_combines(self) -> tuple:
    """Each output's combine, None where it is not combined."""
    return self.combines or (self.combine,) + (None,) * (len(self.outs) - 1)


def _agree(node, axes: Sequence, shapes: Sequence) -> Rule:
  """Operands of one shape carry examples on one axis; those without examples
  are demanded along it, except scalars and size-1 axes (broadcast as they
  are)."""
  found = {a for a in axes if a is not None}
  if len(found) > 1:
    raise Refuse("its operands hold examples along different axes")
  axis, = found
  demand = tuple((i, axis) for i, (a, s) in enumerate(zip(axes, shapes))
                 if a is None and len(s) > axis and s[axis] != 1)
  return Rule(outs=(axis,) * len(node.outs), demand=demand)


def _elementwise(node, axes, shapes, out_shapes) -> Rule:
  return _agree(node, axes, shapes)


def _each(node, axes, shapes, out_shapes) -> Rule:
  """Each output is its own operand (``optimization_barrier``)."""
  return Rule(outs=tuple(axes))


def _broadcast(node, axes, shapes, out_shapes) -> Rule:
  return Rule(outs=(node.params["broadcast_dimensions"][axes[0]],))


def _reshape(node, axes, shapes, out_shapes) -> Rule:
  if node.params.get("dimensions") is not None:
    raise Refuse("it transposes while it reshapes")
  axis, shape, new = axes[0], shapes[0], out_shapes[0]
  outer = math.prod(shape[:axis])
  for d in range(len(new)):
    if math.prod(new[:d]) == outer and new[d] != 1:
      if shape[axis] % new[d] and new[d] % shape[axis]:
        break
      return Rule(outs=(d,))
  raise Refuse("it moves the example axis inside another")


def _transpose(node, axes, shapes, out_shapes) -> Rule:
  return Rule(outs=(tuple(node.params["permutation"]).index(axes[0]),))


def _reduce(combine: str | None) -> Callable:
  def rule(node, axes, shapes, out_shapes) -> Rule:
    reduced = tuple(node.params["axes"])
    if axes[0] in reduced:
      if combine is None:
        raise Refuse("it picks among the examples")
      return Rule(outs=(None,), combine=combine)
    return Rule(outs=(axes[0] - sum(r < axes[0] for r in reduced),))
  return rule


def _along(param: str) -> Callable:
  """Equations working along one axis (cumulative sums, sorts, splits): the
  examples must lie on another."""
  def rule(node, axes, shapes, out_shapes) -> Rule:
    along = node.params[param]
    along = tuple(along) if isinstance(along, (tuple, list)) else (along,)
    found = _agree(node, axes, shapes)
    if found.outs[0] in along:
      raise Refuse("it works along the example axis")
    return found
  return rule


def _whole(node, axes, shapes, out_shapes) -> Rule:
  """Pads, slices and updates that leave the example axis whole."""
  found = _agree(node, axes, shapes)
  axis, shape, p = found.outs[0], shapes[0], node.params
  kept = {"pad": lambda: tuple(p["padding_config"][axis]) == (0, 0, 0),
          "slice": lambda: (p["start_indices"][axis], p["limit_indices"][axis],
                            (p["strides"] or (1,) * len(shape))[axis]) == (0, shape[axis], 1),
          "dynamic_slice": lambda: p["slice_sizes"][axis] == shape[axis],
          "dynamic_update_slice": lambda: shapes[1][axis] == shape[axis]}
  if not kept[node.prim.name]():
    raise Refuse("it takes part of the example axis")
  return found


def _squeeze(node, axes, shapes, out_shapes) -> Rule:
  return Rule(outs=(axes[0] - sum(d < axes[0] for d in node.params["dimensions"]),))


def _top_k(node, axes, shapes, out_shapes) -> Rule:
  if axes[0] == len(shapes[0]) - 1:
    raise Refuse("it ranks across examples")
  return Rule(outs=(axes[0],) * len(node.outs))


def _window(node, axes, shapes, out_shapes) -> Rule:
  found = _agree(node, axes, shapes)
  axis = found.outs[0]
  p = node.params
  if (p["window_dimensions"][axis], p["window_strides"][axis],
      tuple(p["padding"][axis])) != (1, 1, (0, 0)):
    raise Refuse("its window spans examples")
  return found


def _concatenate(node, axes, shapes, out_shapes) -> Rule:
  found = _agree(node, axes, shapes)
  if node.params["dimension"] == found.outs[0]:
    raise Refuse("it concatenates along the example axis")
  return found


def _dot_general(node, axes, shapes, out_shapes) -> Rule:
  (lc, rc), (lb, rb) = node.params["dimension_numbers"]
  la, ra = axes
  lfree = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
  rfree = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
  for mine, other, (mc, oc), (mb, ob), offset, free in (
      (la, ra, (lc, rc), (lb, rb), len(lb), lfree),
      (ra, la, (rc, lc), (rb, lb), len(lb) + len(lfree), rfree)):
    if mine is None:
      continue
    side = 0 if mine is la else 1
    if mine in mc or mine in mb:
      dims, odims = (mc, oc) if mine in mc else (mb, ob)
      partner = odims[list(dims).index(mine)]
      if other not in (None, partner):
        raise Refuse("it pairs the examples of one operand with another axis")
      demand = ((1 - side, partner),) if other is None else ()
      if mine in mc:
        return Rule(outs=(None,), combine=ADD, demand=demand)
      return Rule(outs=(list(mb).index(mine),), demand=demand)
    if other is not None:
      raise Refuse("it multiplies examples by examples")
    return Rule(outs=(offset + free.index(mine),))
  raise Refuse("no operand holds examples")  # pragma: no cover - not called so


def _conv(node, axes, shapes, out_shapes) -> Rule:
  lhs_spec, rhs_spec, out_spec = node.params["dimension_numbers"]
  groups = (node.params["feature_group_count"], node.params["batch_group_count"])
  la, ra = axes
  if ra is None and la == lhs_spec[0] and groups[1] == 1:
    return Rule(outs=(out_spec[0],))
  if la == lhs_spec[1] and ra == rhs_spec[1] and groups[0] == 1:
    # A kernel gradient (a depthwise one groups its batch): summed over examples.
    return Rule(outs=(None,), combine=ADD)
  # Features split (``graph._feature_axes``):
  if la is None and ra == rhs_spec[0] and groups == (1, 1):
    # output features: each chunk of the kernel's makes its chunk of them;
    return Rule(outs=(out_spec[1],))
  if la == lhs_spec[1] and ra is None and groups == (1, 1):
    # input features contracted: each chunk's part of the kernel adds its part;
    return Rule(outs=(None,), combine=ADD, demand=((1, rhs_spec[1]),))
  if (la == lhs_spec[1] and ra in (None, rhs_spec[0]) and groups[1] == 1
      and groups[0] == shapes[0][la]):
    # a depthwise convolution (a group per feature), and its input gradient:
    # a chunk of the groups;
    return Rule(outs=(out_spec[1],), demand=((1, rhs_spec[0]),) if ra is None else ())
  if la == lhs_spec[0] and ra == rhs_spec[0] and groups[1] == shapes[0][la] > 1:
    # its kernel gradient, which groups the features as its batch.
    return Rule(outs=(out_spec[1],))
  raise Refuse("it convolves across the example axis")


def _gather(node, axes, shapes, out_shapes, own: tuple = ()) -> Rule:
  """``own``: the index vectors' columns that hold each example's position
  (``graph._positions.own_columns``)."""
  dn = node.params["dimension_numbers"]
  oa, ia = axes
  out_rank = len(out_shapes[0])
  positions = [d for d in range(out_rank) if d not in dn.offset_dims]
  obatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)
  if ia is not None:
    if ia == len(shapes[1]) - 1:
      raise Refuse("its index vectors run along the example axis")
    if ia in ibatch:
      partner = obatch[ibatch.index(ia)]
      if oa not in (None, partner):
        raise Refuse("its operand holds examples along another axis")
      return Rule(outs=(positions[ia],), demand=((0, partner),) if oa is None else ())
    if oa is not None:
      column = _own_column(dn.start_index_map, dn.collapsed_slice_dims, oa, own)
      if column is None or shapes[0][oa] != shapes[1][ia]:
        raise Refuse("it gathers examples by examples (where it picks each example's own "
                     "entry, write jnp.take_along_axis(x, labels[:, None], axis=1), which "
                     "splits)")
      return Rule(outs=(positions[ia],), own=((1, column),))
    return Rule(outs=(positions[ia],))
  if oa in obatch:
    partner = ibatch[obatch.index(oa)]
    return Rule(outs=(positions[partner],), demand=((1, partner),))
  offsets = [d for d in range(len(shapes[0]))
             if d not in dn.collapsed_slice_dims and d not in obatch]
  if oa in dn.start_index_map or oa not in offsets or (
      node.params["slice_sizes"][oa] != shapes[0][oa]):
    raise Refuse("it indexes along the example axis")
  return Rule(outs=(dn.offset_dims[offsets.index(oa)],))


def _scatter_window(dn, shapes, oa, ua, obatch) -> Rule | None:
  """A scatter whose example axis is a whole window axis, of its operand
  and its updates alike (each example's update lands in that example's
  slice; the indices point along other axes): chunked as they are."""
  window = [d for d in range(len(shapes[0]))
            if d not in dn.inserted_window_dims and d not in obatch]
  for u, o in zip(dn.update_window_dims, window):
    if (ua in (None, u) and oa in (None, o) and (ua, oa) != (None, None)
        and o not in dn.scatter_dims_to_operand_dims and shapes[2][u] == shapes[0][o]):
      return Rule(outs=(o,), demand=tuple(d for d in ((0, o) if oa is None else None,
                                                      (2, u) if ua is None else None) if d))
  return None


def _own_column(index_map, collapsed, axis: int, own: tuple) -> int | None:
  """The index column among ``own`` that points along operand ``axis`` (one
  example's row, collapsed), None where there is none."""
  column = tuple(index_map).index(axis) if axis in index_map else None
  return column if column in own and axis in collapsed else None


def _scatter_own(dn, axes, shapes, positions, own: tuple) -> Rule | None:
  """A scatter whose index picks each example's own row of its operand (the
  gradient of ``x[jnp.arange(n), labels]``, the operand's rows as many as
  the examples): per example, None where it is not one."""
  oa, ia, ua = axes
  for axis in (oa,) if oa is not None else dn.scatter_dims_to_operand_dims:
    column = _own_column(dn.scatter_dims_to_operand_dims, dn.inserted_window_dims, axis, own)
    if (column is not None and ua in (None, positions[ia])
        and shapes[0][axis] == shapes[1][ia] == shapes[2][positions[ia]]):
      return Rule(outs=(axis,), own=((1, column),), demand=tuple(
          d for d in ((0, axis) if oa is None else None,
                      (2, positions[ia]) if ua is None else None) if d))
  return None


def _scatter_add(node, axes, shapes, out_shapes, own: tuple = ()) -> Rule:
  """``own`` as :func:`_gather` takes it."""
  dn = node.params["dimension_numbers"]
  oa, ia, ua = axes
  positions = [d for d in range(len(shapes[2])) if d not in dn.update_window_dims]
  obatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.scatter_indices_batching_dims)
  if ia is not None and ia not in ibatch and ia != len(shapes[1]) - 1:
    mine = _scatter_own(dn, axes, shapes, positions, own)
    if mine is not None:
      return mine
  windowed = None if ia is not None else _scatter_window(dn, shapes, oa, ua, obatch)
  if windowed is not None:
    return windowed
  index = ia if ia is not None else (positions.index(ua) if ua in positions else None)
  if index is None or index == len(shapes[1]) - 1:
    raise Refuse("it scatters along the example axis")
  demand = tuple(d for d in ((1, index) if ia is None else None,
                             (2, positions[index]) if ua is None else None) if d)
  if ua not in (None, positions[index]):
    raise Refuse("its updates hold examples along another axis")
  if index in ibatch:
    partner = obatch[ibatch.index(index)]
    if oa not in (None, partner):
      raise Refuse("its operand holds examples along another axis")
    return Rule(outs=(partner,), demand=demand + (((0, partner),) if oa is None else ()))
  if oa is not None:
    raise Refuse("it scatters examples into examples")
  if node.prim.name != "scatter-add":
    raise Refuse("it overwrites where examples land")
  return Rule(outs=(None,), combine=SCATTER_ADD, demand=demand, threads=((0, 0),))


RULES: dict[str, Callable] = {
    **{name: _elementwise for name in ELEMENTWISE},
    "optimization_barrier": _each,
    # Collectives over mesh axes inside a ``shard_map`` (and the casts of
    # its varying-axes typing) combine devices elementwise: a chunk of the
    # examples on each device makes that chunk of the result.
    **{name: _each for name in ("pvary", "pbroadcast", "psum", "psum_invariant", "psum2",
                                "pmax", "pmin", "ppermute")},
    "broadcast_in_dim": _broadcast,
    "reshape": _reshape,
    "transpose": _transpose,
    "reduce_sum": _reduce(ADD), "reduce_max": _reduce(MAX), "reduce_min": _reduce(MIN),
    "reduce_or": _reduce(OR), "reduce_and": _reduce(AND),
    "argmax": _reduce(None), "argmin": _reduce(None),
    "cumsum": _along("axis"), "cumprod": _along("axis"), "cummax": _along("axis"),
    "cummin": _along("axis"), "cumlogsumexp": _along("axis"), "sort": _along("dimension"),
    "rev": _along("dimensions"), "split": _along("axis"), "top_k": _top_k,
    "pad": _whole, "slice": _whole, "dynamic_slice": _whole, "dynamic_update_slice": _whole,
    "squeeze": _squeeze,
    "reduce_window_sum": _window, "reduce_window_max": _window, "reduce_window_min": _window,
    "select_and_scatter_add": _window, "select_and_gather_add": _window,
    "concatenate": _concatenate,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "gather": _gather,
    "scatter-add": _scatter_add, "scatter_add": _scatter_add, "scatter": _scatter_add,
}

# The rules that take ``own`` (the index columns holding examples' positions).
INDEXED = frozenset({"gather", "scatter-add", "scatter_add", "scatter"})


def chunked(shape: Sequence[int], axis: int, k: int) -> tuple[int, ...]:
  """``shape`` with ``axis`` cut into ``k``."""
  return tuple(n // k if d == axis else n for d, n in enumerate(shape))


def chunk_params(node, in_axes: Sequence, in_shapes: Sequence, out_axis: int | None,
                 out_shape: Sequence[int], k: int) -> dict:
  """``node``'s params for one of ``k`` chunks, where its inputs (of
  ``in_shapes``) carry examples on ``in_axes`` and its first output (of
  ``out_shape``) on ``out_axis``."""
  params = dict(node.params)
  name = node.prim.name
  if out_axis is not None and name in ("broadcast_in_dim", "iota", "reshape"):
    shape = chunked(out_shape, out_axis, k)
    params["new_sizes" if name == "reshape" else "shape"] = shape
  elif name == "slice":
    params["limit_indices"] = chunked(params["limit_indices"], in_axes[0], k)
  elif name == "dynamic_slice":
    params["slice_sizes"] = chunked(params["slice_sizes"], in_axes[0], k)
  elif name == "conv_general_dilated" and in_axes[0] is not None:
    lhs_spec = params["dimension_numbers"].lhs_spec
    for group, side in (("feature_group_count", 1), ("batch_group_count", 0)):
      if params[group] > 1 and in_axes[0] == lhs_spec[side]:
        params[group] //= k  # the groups of a depthwise convolution, cut
  elif (name == "gather" and in_axes[0] is not None
        and params["slice_sizes"][in_axes[0]] == in_shapes[0][in_axes[0]]):
    params["slice_sizes"] = chunked(params["slice_sizes"], in_axes[0], k)
  return params
