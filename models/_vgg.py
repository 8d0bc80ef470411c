"""VGG: plain stacks of 3x3 convolutions (Simonyan & Zisserman, 2015).

No shortcuts and no normalization: every convolution's output is a
residual of the backward pass, and at 224x224 the first stages' activations
dwarf the parameters. The plain stack Checkmate (Jain et al., 2020) plans
its recomputation on.

Example:
  >>> import jaxmem_models as models
  >>> task = models.get("vgg", depth=11, width=4, size=32, batch=2, hidden=16)
  >>> state, batch = task.init()
  >>> state, loss = task.step(state, batch)
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn

from jaxmem_models._remat import check_remat, remat_block, tag
from jaxmem_models._task import classify, image_batch

# Convolutions per stage (5 stages, each ending in a 2x2 max-pool), per depth.
DEPTHS: dict[int, tuple[int, ...]] = {
    11: (1, 1, 2, 2, 2), 13: (2, 2, 2, 2, 2), 16: (2, 2, 3, 3, 3), 19: (2, 2, 4, 4, 4)}


class ConvReLU(nn.Module):
  """One 3x3 convolution and its ReLU: the unit per-layer remat wraps.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> v = ConvReLU(8).init(jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 3)), True)
    >>> v["params"]["conv"]["kernel"].shape
    (3, 3, 3, 8)
  """
  features: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    return nn.relu(tag(nn.Conv(self.features, (3, 3), padding="SAME", name="conv")(x),
                       "conv_out"))


class VGG(nn.Module):
  """VGG: five stages of 3x3 convolutions (widths ``width * (1, 2, 4, 8,
  8)``), each followed by a 2x2 max-pool, then a classifier of two hidden
  Dense layers.

  Attributes:
    stages: convolutions per stage (:data:`DEPTHS`).
    width: features of the first stage (64 in the paper).
    hidden: features of the classifier's hidden layers (4096 in the paper).
    classes: output classes.
    remat: ``None`` or a name from ``models.REMAT_POLICIES`` (per
      convolution).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> m = VGG(stages=(1, 1, 1, 1, 1), width=2, hidden=8)
    >>> v = m.init(jax.random.PRNGKey(0), jnp.ones((1, 32, 32, 3)), train=False)
    >>> list(v["params"])[:3]
    ['conv0_0', 'conv1_0', 'conv2_0']
  """
  stages: Sequence[int] = DEPTHS[19]
  width: int = 64
  hidden: int = 4096
  classes: int = 10
  remat: str | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    layer = remat_block(ConvReLU, self.remat)
    for i, n in enumerate(self.stages):
      for j in range(n):
        x = layer(self.width * min(2 ** i, 8), name=f"conv{i}_{j}")(x, train)
      x = nn.max_pool(x, (2, 2), (2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.hidden, name="fc1")(x))
    x = nn.relu(nn.Dense(self.hidden, name="fc2")(x))
    return nn.Dense(self.classes, name="head")(x)


def vgg(depth=19, width=64, size=224, batch=8, hidden=4096, classes=10, remat=None):
  """Registry factory ``"vgg"``: VGG-11/13/16/19 on ``size`` x ``size`` images
  (a multiple of 32)."""
  if depth not in DEPTHS:
    raise ValueError(f"vgg: depth must be one of {sorted(DEPTHS)}, got {depth}")
  if size % 32:
    raise ValueError(f"vgg: size must be a multiple of 32 (five 2x2 pools), got {size}")
  module = VGG(DEPTHS[depth], width, hidden, classes, check_remat(remat))
  return module, image_batch(batch, size, classes), classify
