"""MobileNetV2: inverted residual blocks, BatchNorm and relu6.

Example:
  >>> import jaxmem_models as models
  >>> task = models.get("mobilenetv2", width=0.25, depth=0.3, size=16, batch=2)
  >>> state, batch = task.init()
  >>> state, loss = task.step(state, batch)
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn

from jaxmem_models._random import Dropout, lecun_normal
from jaxmem_models._remat import check_remat, remat_block, tag
from jaxmem_models._task import classify, image_batch

# (expansion t, channels c, repeats n, stride s) from the MobileNetV2 paper.
STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
          (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def make_divisible(value: float, divisor: int = 8) -> int:
  """Rounds channels to a multiple of ``divisor`` (not below 90% of ``value``).

  Example:
    >>> make_divisible(32 * 0.35)
    16
  """
  out = max(divisor, int(value + divisor / 2) // divisor * divisor)
  return out + divisor if out < 0.9 * value else out


def _bn(train: bool, name: str):
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-3,
                      name=name)


class InvertedResidual(nn.Module):
  """``1x1 expand -> 3x3 depthwise (stride) -> 1x1 linear project`` (+ skip).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> _ = InvertedResidual(8, 1, 6).init(jax.random.PRNGKey(0), jnp.ones((1, 4, 4, 8)), False)
  """
  features: int
  stride: int = 1
  expansion: int = 6

  @nn.compact
  def __call__(self, x, train: bool = True):
    hidden = x.shape[-1] * self.expansion
    y = x
    if self.expansion != 1:
      y = tag(nn.Conv(hidden, (1, 1), use_bias=False, kernel_init=lecun_normal(),
                    name="expand")(y), "conv_out")
      y = nn.relu6(_bn(train, "bn_expand")(y))
    y = tag(nn.Conv(hidden, (3, 3), (self.stride, self.stride), padding="SAME",
                    feature_group_count=hidden, use_bias=False, kernel_init=lecun_normal(),
                    name="depthwise")(y),
            "conv_out")
    y = nn.relu6(_bn(train, "bn_depthwise")(y))
    y = tag(nn.Conv(self.features, (1, 1), use_bias=False, kernel_init=lecun_normal(),
                name="project")(y), "conv_out")
    y = _bn(train, "bn_project")(y)
    if self.stride == 1 and x.shape[-1] == self.features:
      y = x + y
    return y


class MobileNetV2(nn.Module):
  """MobileNetV2 with a width multiplier and a depth multiplier.

  Attributes:
    classes: output classes.
    width: channel multiplier (the paper's alpha: 0.35 ... 1.4).
    depth: multiplier on each stage's block count (rounded up).
    stages: ``(t, c, n, s)`` rows; the paper's by default.
    dropout: dropout before the classifier (0.2 in the reference models).
    remat: ``None`` or a name from ``models.REMAT_POLICIES`` (per block).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> m = MobileNetV2(width=0.25, stages=((1, 8, 1, 1),))
    >>> m.init(jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 3)), train=False)["params"].keys()
    dict_keys(['stem', 'bn_stem', 'block0', 'last', 'bn_last', 'head'])
  """
  classes: int = 10
  width: float = 1.0
  depth: float = 1.0
  stages: Sequence[Sequence[int]] = STAGES
  dropout: float = 0.2
  remat: str | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(make_divisible(32 * self.width), (3, 3), (2, 2), use_bias=False,
                kernel_init=lecun_normal(), name="stem")(x)
    x = nn.relu6(_bn(train, "bn_stem")(x))
    block = remat_block(InvertedResidual, self.remat)
    k = 0
    for t, c, n, s in self.stages:
      for j in range(max(1, math.ceil(n * self.depth))):
        x = block(make_divisible(c * self.width), s if j == 0 else 1, t,
                  name=f"block{k}")(x, train)
        k += 1
    x = nn.Conv(make_divisible(1280 * max(1.0, self.width)), (1, 1), use_bias=False,
                kernel_init=lecun_normal(), name="last")(x)
    x = nn.relu6(_bn(train, "bn_last")(x)).mean(axis=(1, 2))
    x = Dropout(self.dropout)(x, not train)
    return nn.Dense(self.classes, name="head")(x)


def mobilenetv2(width=0.5, depth=1.0, size=96, batch=16, classes=10, dropout=0.2,
                stages=STAGES, remat=None):
  """Registry factory ``"mobilenetv2"``: MobileNetV2-0.5 on 96x96 images."""
  module = MobileNetV2(classes, width, depth, tuple(tuple(s) for s in stages), dropout,
                       check_remat(remat))
  return module, image_batch(batch, size, classes), classify
