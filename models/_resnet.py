"""ResNets with BatchNorm: ResNet-18/50 and an ultra-deep CIFAR-style ResNet.

Example:
  >>> import jaxmem_models as models
  >>> task = models.get("resnet18", width=8, stages=(1, 1), size=16, batch=2)
  >>> state, batch = task.init()
  >>> state, loss = task.step(state, batch)
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn

from jaxmem_models._random import variance_scaling
from jaxmem_models._remat import check_remat, remat_block, tag
from jaxmem_models._task import classify, image_batch


def _bn(train: bool, name: str):
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name)


def _conv(features: int, kernel: int, stride: int, name: str):
  return nn.Conv(features, (kernel, kernel), (stride, stride), padding="SAME",
                 use_bias=False, kernel_init=variance_scaling(2.0, "fan_out", "normal"),
                 name=name)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with BatchNorm and a (projected) shortcut.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> _ = BasicBlock(8, 2).init(jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 4)), False)
  """
  features: int
  stride: int = 1
  expansion = 1

  @nn.compact
  def __call__(self, x, train: bool = True):
    y = tag(_conv(self.features, 3, self.stride, "conv1")(x), "conv_out")
    y = nn.relu(_bn(train, "bn1")(y))
    y = tag(_conv(self.features, 3, 1, "conv2")(y), "conv_out")
    y = _bn(train, "bn2")(y)
    if x.shape[-1] != self.features or self.stride != 1:
      x = _bn(train, "bn_proj")(_conv(self.features, 1, self.stride, "proj")(x))
    return nn.relu(x + y)


class Bottleneck(nn.Module):
  """``1x1 -> 3x3 (stride) -> 1x1 (4x)`` convolutions with BatchNorm.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> v = Bottleneck(4).init(jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 4)), False)
    >>> v["params"]["conv3"]["kernel"].shape
    (1, 1, 4, 16)
  """
  features: int
  stride: int = 1
  expansion = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    out = self.features * self.expansion
    y = tag(_conv(self.features, 1, 1, "conv1")(x), "conv_out")
    y = nn.relu(_bn(train, "bn1")(y))
    y = tag(_conv(self.features, 3, self.stride, "conv2")(y), "conv_out")
    y = nn.relu(_bn(train, "bn2")(y))
    y = tag(_conv(out, 1, 1, "conv3")(y), "conv_out")
    y = _bn(train, "bn3")(y)
    if x.shape[-1] != out or self.stride != 1:
      x = _bn(train, "bn_proj")(_conv(out, 1, self.stride, "proj")(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """ResNet: stem, stages of residual blocks (width doubling), pooled head.

  Attributes:
    stages: blocks per stage; stage ``i`` has ``width * 2**i`` features and
      (after the first) halves the resolution.
    block: ``"basic"`` (ResNet-18/34) or ``"bottleneck"`` (ResNet-50+).
    width: features of the first stage (64 in the paper).
    classes: output classes.
    small_stem: a 3x3 stride-1 stem without pooling (CIFAR-style, for small
      images) instead of ImageNet's 7x7 stride-2 conv and 3x3 max-pool.
    remat: ``None`` or a name from ``models.REMAT_POLICIES`` (per block).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> m = ResNet(stages=(1, 1), width=4, small_stem=True)
    >>> m.init(jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 3)), train=False)["params"].keys()
    dict_keys(['stem', 'bn_stem', 'stage0_block0', 'stage1_block0', 'head'])
  """
  stages: Sequence[int] = (2, 2, 2, 2)
  block: str = "basic"
  width: int = 64
  classes: int = 10
  small_stem: bool = False
  remat: str | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    blocks = {"basic": BasicBlock, "bottleneck": Bottleneck}
    if self.block not in blocks:
      raise ValueError(f"block must be one of {sorted(blocks)}, not {self.block!r}")
    block = remat_block(blocks[self.block], self.remat)
    if self.small_stem:
      x = _conv(self.width, 3, 1, "stem")(x)
      x = nn.relu(_bn(train, "bn_stem")(x))
    else:
      x = _conv(self.width, 7, 2, "stem")(x)
      x = nn.relu(_bn(train, "bn_stem")(x))
      x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
    for i, n in enumerate(self.stages):
      for j in range(n):
        stride = 2 if i > 0 and j == 0 else 1
        x = block(self.width * 2 ** i, stride, name=f"stage{i}_block{j}")(x, train)
    return nn.Dense(self.classes, name="head")(x.mean(axis=(1, 2)))


def _resnet(stages, block, width, size, batch, classes, small_stem, remat):
  if small_stem is None:
    small_stem = size <= 64
  module = ResNet(tuple(stages), block, width, classes, small_stem, check_remat(remat))
  return module, image_batch(batch, size, classes), classify


def resnet18(width=64, stages=(2, 2, 2, 2), size=32, batch=32, classes=10,
             small_stem=None, remat=None):
  """Registry factory ``"resnet18"``: basic blocks, CIFAR-sized images.

  ``small_stem=None`` picks the 3x3 stem for ``size <= 64`` and ImageNet's
  7x7/max-pool stem above.
  """
  return _resnet(stages, "basic", width, size, batch, classes, small_stem, remat)


def resnet50(width=64, stages=(3, 4, 6, 3), size=128, batch=8, classes=10,
             small_stem=None, remat=None):
  """Registry factory ``"resnet50"``: bottleneck blocks, 128x128 images."""
  return _resnet(stages, "bottleneck", width, size, batch, classes, small_stem, remat)


def resnet_deep(depth=100, width=16, stages=3, size=32, batch=32, classes=10,
                block="basic", remat=None):
  """Registry factory ``"resnet_deep"``: ``depth`` residual blocks in total.

  He et al.'s CIFAR ResNets (ResNet-110 has 54 basic blocks, ResNet-1202 has
  600): ``stages`` stages of widths ``width * 2**i`` with the blocks spread
  evenly over them (earlier stages take the remainder). The default, 100
  basic blocks, is a 202-layer network.
  """
  if depth < stages:
    raise ValueError(f"resnet_deep: depth {depth} must be at least stages {stages}")
  per = [depth // stages + (i < depth % stages) for i in range(stages)]
  module = ResNet(tuple(per), block, width, classes, True, check_remat(remat))
  return module, image_batch(batch, size, classes), classify
