"""U-Net for per-pixel segmentation: conv + norm encoder/decoder with skips.

Example:
  >>> import jaxmem_models as models
  >>> task = models.get("unet", width=8, depth=2, size=16, batch=2)
  >>> state, batch = task.init()
  >>> batch["y"].shape
  (2, 16, 16)
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from jaxmem_models._random import Dropout, lecun_normal
from jaxmem_models._remat import check_remat, remat_block, tag
from jaxmem_models._task import classify, image_batch


def _norm(kind: str, features: int, train: bool, name: str):
  if kind == "group":
    return nn.GroupNorm(num_groups=math.gcd(8, features), name=name)
  if kind == "batch":
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, name=name)
  raise ValueError(f"norm must be 'group' or 'batch', not {kind!r}")


class ConvBlock(nn.Module):
  """Two ``3x3 conv -> norm -> relu`` layers, optional dropout at the end.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> _ = ConvBlock(8).init(jax.random.PRNGKey(0), jnp.ones((1, 4, 4, 3)), False)
  """
  features: int
  norm: str = "group"
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool = True):
    for i in range(2):
      x = tag(nn.Conv(self.features, (3, 3), use_bias=False,
                      kernel_init=lecun_normal(), name=f"conv{i}")(x),
              "conv_out")
      x = nn.relu(_norm(self.norm, self.features, train, f"norm{i}")(x))
    if self.dropout:
      x = Dropout(self.dropout)(x, not train)
    return x


class UpBlock(nn.Module):
  """``2x2 transposed conv (stride 2)``, concatenate the skip, :class:`ConvBlock`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> up = UpBlock(4)
    >>> v = up.init(jax.random.PRNGKey(0), jnp.ones((1, 2, 2, 8)), jnp.ones((1, 4, 4, 4)), False)
    >>> up.apply(v, jnp.ones((1, 2, 2, 8)), jnp.ones((1, 4, 4, 4)), False).shape
    (1, 4, 4, 4)
  """
  features: int
  norm: str = "group"

  @nn.compact
  def __call__(self, x, skip, train: bool = True):
    x = nn.ConvTranspose(self.features, (2, 2), (2, 2), kernel_init=lecun_normal(),
                         name="up")(x)
    x = jnp.concatenate([skip, x], axis=-1)
    return ConvBlock(self.features, self.norm, name="conv")(x, train)


class UNet(nn.Module):
  """U-Net with ``depth`` down/up levels; features double per level.

  Attributes:
    classes: segmentation classes (per-pixel logits).
    width: features at full resolution (64 in the paper).
    depth: down-sampling levels (4 in the paper); the input side must be a
      multiple of ``2**depth``.
    norm: ``"group"`` (GroupNorm, up to 8 groups) or ``"batch"`` (BatchNorm).
    dropout: dropout at the end of the contracting path (the paper's
      bottleneck dropout).
    remat: ``None`` or a name from ``models.REMAT_POLICIES``; applied to every
      encoder, bottleneck and decoder block.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> m = UNet(classes=3, width=4, depth=1)
    >>> m.apply(m.init(jax.random.PRNGKey(0), jnp.ones((1, 4, 4, 3)), train=False),
    ...         jnp.ones((1, 4, 4, 3)), train=False).shape
    (1, 4, 4, 3)
  """
  classes: int = 4
  width: int = 32
  depth: int = 4
  norm: str = "group"
  dropout: float = 0.1
  remat: str | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    down = remat_block(ConvBlock, self.remat)
    up = remat_block(UpBlock, self.remat, static_argnums=(3,))
    skips = []
    for i in range(self.depth):
      x = down(self.width * 2 ** i, self.norm, name=f"down{i}")(x, train)
      skips.append(x)
      x = nn.max_pool(x, (2, 2), (2, 2))
    x = down(self.width * 2 ** self.depth, self.norm, self.dropout,
             name="bottleneck")(x, train)
    for i in reversed(range(self.depth)):
      x = up(self.width * 2 ** i, self.norm, name=f"up{i}")(x, skips[i], train)
    return nn.Conv(self.classes, (1, 1), kernel_init=lecun_normal(), name="head")(x)


def unet(width=32, depth=4, size=128, batch=4, classes=4, norm="group", dropout=0.1,
         channels=3, remat=None):
  """Registry factory ``"unet"``: 4-level, 32-wide U-Net on 128x128 images.

  The loss is the mean per-pixel cross-entropy against random labels.
  """
  if size % 2 ** depth:
    raise ValueError(f"unet: size {size} must be a multiple of 2**depth = {2 ** depth}")
  if norm not in ("group", "batch"):
    raise ValueError(f"unet: norm must be 'group' or 'batch', not {norm!r}")
  module = UNet(classes, width, depth, norm, dropout, check_remat(remat))
  return module, image_batch(batch, size, classes, channels, per_pixel=True), classify
