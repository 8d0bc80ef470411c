"""The zoo steps benchmark scripts measure, and their compilation for a
target: one place for what each script would otherwise spell out again."""

from __future__ import annotations

import ast
import time

import jax
from jax import monitoring

from jaxmem._zoo import models
from jaxmem.targets import Target, resolve


_COMPILES = [0]
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: _COMPILES.__setitem__(0, _COMPILES[0] + ("backend_compile" in name)))


def compilations() -> int:
  """The backend compilations this process has made so far (what a call
  makes is the difference around it)."""
  return _COMPILES[0]


def task(name: str, config: dict, remat: str | None = None):
  """The zoo task of a configuration (``zoo`` in ``config`` names the zoo
  model where the configuration's name does not), with a per-block remat
  policy where given."""
  config = dict(config)
  return models().get(config.pop("zoo", name), remat=remat, **config)


def zoo_options(items) -> dict:
  """``KEY=VALUE`` items (a script's ``--set``) as zoo options: each value
  a Python literal where it reads as one (``batch=16``), else the string
  (``dtype=bfloat16``)."""
  options = {}
  for item in items:
    key, value = item.split("=", 1)
    try:
      options[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      options[key] = value
  return options


def compile_for(step, shapes, target: str | None, measuring: bool = False,
                **options) -> tuple[object, Target, float]:
  """``step`` compiled with ``jax.jit`` for ``target`` (a preset name: its
  compile-only device, with the meshes the step names moved onto as many of
  its GPUs; None: this machine's XLA:CPU) on arguments ``shapes`` (abstract
  or not), with the target's compiler options and ``options`` over them:
  the executable, the target and the seconds compiling took."""
  leaves, tree = jax.tree_util.tree_flatten(shapes)
  where = resolve(target, leaves)

  def flat(*args):
    return jax.tree_util.tree_leaves(step(*tree.unflatten(args)))

  start = time.perf_counter()
  compiled = jax.jit(where.compiles(flat, leaves),
                     compiler_options={**where.options(measuring), **options} or None
                     ).lower(*where.place(leaves)).compile()
  return compiled, where, time.perf_counter() - start
