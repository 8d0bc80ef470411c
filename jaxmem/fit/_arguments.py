"""Static and donated arguments, resolved as ``jax.jit`` resolves them.

``jax.jit`` reads ``static_argnums`` / ``static_argnames`` and
``donate_argnums`` / ``donate_argnames`` against the function's signature:
a name given for a positional parameter makes its index static too (and an
index its name), so a static argument may be passed either way; a negative
index counts from the end of the positional arguments of the call. jaxmem
traces and caches the step per static values before ``jax.jit`` sees it, so
it resolves them the same way here, and hands ``jax.jit`` the user's own
specification over a function with the user's signature (``Arguments.jit``).

A step already wrapped in ``jax.jit`` with donated arguments keeps them:
the inner jit is inlined into jaxmem's, so its donation is read from its
trace (``inherited_donations``) and given to the outer jit.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax

from jaxmem.targets._host_args import device_aval


def _as_tuple(value) -> tuple:
  if value is None:
    return ()
  return (value,) if isinstance(value, (int, str)) else tuple(value)


def _signature(fun) -> inspect.Signature | None:
  try:
    return inspect.signature(fun)
  except (TypeError, ValueError):
    return None


def _infer(signature, nums: tuple, names: tuple) -> tuple[tuple, tuple]:
  """Indices and names of the same parameters, each inferred from the other
  where only one is given (``jax.jit``'s rule)."""
  if signature is None or (nums and names):
    return nums, names
  params = [(i, name) for i, (name, p) in enumerate(signature.parameters.items())
            if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
  if names:
    return tuple(i for i, name in params if name in names), names
  return nums, tuple(name for i, name in params if i in nums)


@dataclasses.dataclass(frozen=True)
class Arguments:
  """A step's static and donated arguments (see the module docstring)."""
  fun_name: str
  static_argnums: tuple[int, ...] = ()
  static_argnames: tuple[str, ...] = ()
  donate_argnums: tuple[int, ...] = ()
  donate_argnames: tuple[str, ...] = ()

  @classmethod
  def resolve(cls, fun: Callable, static_argnums=(), static_argnames=(),
              donate_argnums=(), donate_argnames=()) -> "Arguments":
    signature = _signature(fun)
    static = _infer(signature, _as_tuple(static_argnums), _as_tuple(static_argnames))
    donate = _infer(signature, _as_tuple(donate_argnums), _as_tuple(donate_argnames))
    # A step already wrapped in jax.jit keeps the arguments it makes static
    # (jax.jit's own record of them, resolved against the signature).
    jitted = getattr(fun, "_jit_info", None)
    static = tuple(tuple(dict.fromkeys((*mine, *getattr(jitted, field, ()))))
                   for mine, field in zip(static, ("static_argnums", "static_argnames")))
    return cls(getattr(fun, "__name__", repr(fun)), *static, *donate)

  def static_positions(self, count: int) -> frozenset[int]:
    """Static positions among ``count`` positional arguments."""
    return frozenset(i % count if i < 0 and count else i for i in self.static_argnums)

  def split(self, args: tuple, kwargs: dict):
    """``(statics, dynamic args, dynamic kwargs)``; ``statics`` is hashable
    (the cache key's part), or a ValueError says which argument is not."""
    static = self.static_positions(len(args))
    statics = (tuple((i, args[i]) for i in sorted(static) if i < len(args)),
               tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)))
    try:
      hash(statics)
    except TypeError as err:
      bad = next(f"{k!r}" if isinstance(k, str) else f"positional argument {k}"
                 for k, v in statics[0] + statics[1] if not _hashable(v))
      raise ValueError(
          f"jaxmem: static argument {bad} of {self.fun_name} is not hashable ({err}); "
          "static arguments are compared and cached like jax.jit's and must be "
          "hashable: pass a tuple instead of a list, or make the argument dynamic "
          "(leave it out of static_argnums / static_argnames).") from None
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
    return statics, dyn_args, dyn_kwargs

  def signature(self, args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """A call's cache key (static values, tree and avals of the dynamic
    arguments, as ``jax.jit`` keys its cache) and the dynamic leaves."""
    statics, dyn_args, dyn_kwargs = self.split(args, kwargs)
    leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
    return (statics, tree, tuple(device_aval(x) for x in leaves)), leaves

  def merge(self, statics, dyn_args: tuple, dyn_kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` again from what :meth:`split` gave."""
    positional, named = statics
    args = list(dyn_args)
    for i, value in positional:  # ascending, so earlier inserts hold
      args.insert(i, value)
    return tuple(args), {**dyn_kwargs, **dict(named)}

  @property
  def donates(self) -> bool:
    """Whether any argument is donated."""
    return bool(self.donate_argnums or self.donate_argnames)

  def donated_leaves(self, args: tuple, kwargs: dict) -> frozenset[int]:
    """Positions, among the dynamic arguments' flat leaves, of the leaves
    of donated arguments."""
    static = self.static_positions(len(args))
    donated = {i % len(args) if i < 0 else i for i in self.donate_argnums}
    flags = (tuple(jax.tree_util.tree_map(lambda _, d=i in donated: d, a)
                   for i, a in enumerate(args) if i not in static),
             {k: jax.tree_util.tree_map(lambda _, d=k in self.donate_argnames: d, v)
              for k, v in kwargs.items() if k not in self.static_argnames})
    return frozenset(i for i, d in enumerate(jax.tree_util.tree_leaves(flags)) if d)

  def with_donations(self, nums: tuple, names: tuple) -> "Arguments":
    return dataclasses.replace(
        self, donate_argnums=tuple(sorted(set(self.donate_argnums) | set(nums))),
        donate_argnames=tuple(sorted(set(self.donate_argnames) | set(names))))

  def tracing(self, fun: Callable):
    """``jax.jit`` of the user's ``fun`` with these arguments static, for
    tracing it (donation does not matter there)."""
    return jax.jit(fun, static_argnums=self.static_argnums or None,
                   static_argnames=self.static_argnames or None)

  def jit(self, fun: Callable, user: Callable, **kwargs):
    """``jax.jit`` of ``fun(*args, **kwargs)`` with these arguments static
    and donated, resolved against ``user``'s signature (``fun`` is given it,
    with its name, but holds no reference to ``user``: compilations kept per
    step function, weakly keyed on it, must not keep it alive)."""
    wrapped = functools.wraps(user)(fun)
    del wrapped.__wrapped__
    wrapped.__signature__ = _signature(user)
    return jax.jit(wrapped, static_argnums=self.static_argnums or None,
                   static_argnames=self.static_argnames or None,
                   donate_argnums=self.donate_argnums or None,
                   donate_argnames=self.donate_argnames or None, **kwargs)


def _hashable(value: Any) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True


def inherited_donations(fun: Callable, args: tuple, kwargs: dict,
                        arguments: Arguments) -> tuple[tuple, tuple]:
  """The arguments a step already wrapped in ``jax.jit`` donates: positions
  and keyword names whose leaves its trace marks donated (none for any
  other callable)."""
  trace = getattr(fun, "trace", None)
  if not callable(trace) or not callable(getattr(fun, "lower", None)):
    return (), ()
  info_args, info_kwargs = trace(*args, **kwargs).args_info
  static = arguments.static_positions(len(args))
  dynamic = [i for i in range(len(args)) if i not in static]
  donated = lambda info: bool(jax.tree_util.tree_leaves(info)) and all(
      leaf.donated for leaf in jax.tree_util.tree_leaves(info))
  nums = tuple(i for i, info in zip(dynamic, info_args) if donated(info))
  names = tuple(k for k, info in info_kwargs.items() if donated(info))
  return nums, names


class _Each:
  """One sharding for each of ``count`` leaves (a prefix's node, kept whole
  by ``tree_leaves``)."""

  def __init__(self, sharding, count: int):
    self.sharding, self.count = sharding, count


def as_sharded(arguments: Arguments, in_shardings, args, kwargs, leaves: list):
  """``(args, kwargs, leaves)`` of a call as ``jax.jit`` places them under
  the user's ``in_shardings`` (one sharding, or a tree prefix of the dynamic
  positional arguments, as ``jax.jit`` takes it; None: as given): a leaf on
  one device that its sharding spreads over several becomes abstract with
  that sharding, so a fit models each device's share; the others stay as
  given (as they do where the prefix does not match: ``jax.jit`` then says
  why)."""
  if in_shardings is None:
    return args, kwargs, leaves
  statics, dyn_args, dyn_kwargs = arguments.split(args, kwargs)
  if isinstance(in_shardings, jax.sharding.Sharding):
    per_leaf = [in_shardings] * len(leaves)
  else:
    try:
      groups = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
          lambda s, sub: _Each(s, len(jax.tree_util.tree_leaves(sub))), in_shardings,
          tuple(dyn_args), is_leaf=lambda s: s is None or isinstance(s, jax.sharding.Sharding)))
    except (ValueError, TypeError):
      return args, kwargs, leaves
    per_leaf = [g.sharding for g in groups for _ in range(g.count)]
  if len(per_leaf) != len(leaves):
    return args, kwargs, leaves
  spreads = lambda s: isinstance(s, jax.sharding.Sharding) and len(s.device_set) > 1
  on_one = lambda x: len(getattr(getattr(x, "sharding", None), "device_set", ())) < 2
  abstract = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s,
                                               weak_type=a.weak_type)
  leaves = [abstract(jax.typeof(x), s) if spreads(s) and on_one(x) else x
            for x, s in zip(leaves, per_leaf)]
  tree = jax.tree_util.tree_structure((dyn_args, dyn_kwargs))
  return (*arguments.merge(statics, *tree.unflatten(leaves)), leaves)
