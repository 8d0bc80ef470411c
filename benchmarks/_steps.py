"""The zoo steps benchmark scripts measure, and their compilation for a
target: one place for what each script would otherwise spell out again."""

from __future__ import annotations

import time

import jax

from jaxmem._zoo import models
from jaxmem.targets import Target, placed, resolve


def task(name: str, config: dict, remat: str | None = None):
  """The zoo task of a configuration (``zoo`` in ``config`` names the zoo
  model where the configuration's name does not), with a per-block remat
  policy where given."""
  config = dict(config)
  return models().get(config.pop("zoo", name), remat=remat, **config)


def compile_for(step, shapes, target: str | None, measuring: bool = False,
                **options) -> tuple[object, Target, float]:
  """``step`` compiled with ``jax.jit`` for ``target`` (a preset name: its
  compile-only device; None: this machine's XLA:CPU) on abstract arguments
  ``shapes``, with the target's compiler options and ``options`` over them:
  the executable, the target and the seconds compiling took."""
  where = resolve(target, jax.tree_util.tree_leaves(shapes))
  args = shapes if target is None else placed(shapes, target)
  start = time.perf_counter()
  compiled = jax.jit(step, compiler_options={**where.options(measuring), **options} or None
                     ).lower(*args).compile()
  return compiled, where, time.perf_counter() - start
