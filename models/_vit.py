"""ViT-Tiny-style vision transformer (patch embedding, pre-LN blocks).

Example:
  >>> import jaxmem_models as models
  >>> task = models.get("vit", size=16, patch=4, dim=16, depth=1, heads=2, batch=2)
  >>> state, batch = task.init()
  >>> state, loss = task.step(state, batch)
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxmem_models._attention import TransformerBlock, run_blocks
from jaxmem_models._random import Dropout, lecun_normal
from jaxmem_models._remat import check_remat, remat_block
from jaxmem_models._task import classify, image_batch


class ViT(nn.Module):
  """Vision transformer: patches -> (cls token) + positions -> blocks -> head.

  Attributes:
    classes: output classes.
    dim: token width (ViT-Tiny: 192).
    depth: transformer blocks (ViT-Tiny: 12).
    heads: attention heads (ViT-Tiny: 3).
    patch: patch side in pixels.
    mlp_ratio: MLP hidden width over ``dim``.
    dropout: dropout after the embedding, in the MLPs and on the residuals.
    attn_dropout: dropout on attention probabilities.
    pool: ``"cls"`` (class token) or ``"mean"`` (mean over patches).
    remat: ``None`` or a name from ``models.REMAT_POLICIES`` (per block).
    scan: the blocks as one ``nn.scan`` over stacked parameters.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> vit = ViT(classes=3, dim=8, depth=1, heads=2, patch=4)
    >>> vit.init(jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 3)), train=False)["params"].keys()
    dict_keys(['embed', 'cls', 'pos', 'block0', 'ln', 'head'])
  """
  classes: int = 10
  dim: int = 192
  depth: int = 12
  heads: int = 3
  patch: int = 8
  mlp_ratio: float = 4.0
  dropout: float = 0.1
  attn_dropout: float = 0.0
  pool: str = "cls"
  remat: str | None = None
  scan: bool = False

  @nn.compact
  def __call__(self, x, train: bool = True):
    if self.pool not in ("cls", "mean"):
      raise ValueError(f"pool must be 'cls' or 'mean', not {self.pool!r}")
    p = self.patch
    x = nn.Conv(self.dim, (p, p), strides=(p, p), padding="VALID", kernel_init=lecun_normal(),
                name="embed")(x)
    b, h, w, d = x.shape
    x = x.reshape(b, h * w, d)
    if self.pool == "cls":
      cls = self.param("cls", nn.initializers.zeros, (1, 1, d))
      x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, d)), x], axis=1)
    x = x + self.param("pos", nn.initializers.normal(0.02), x.shape[1:])
    x = Dropout(self.dropout)(x, not train)
    block = remat_block(TransformerBlock, self.remat)
    x = run_blocks(x, block, (self.dim, self.heads, self.mlp_ratio, self.dropout,
                              self.attn_dropout, False), self.depth, train, self.scan)
    x = nn.LayerNorm(name="ln")(x)
    x = x[:, 0] if self.pool == "cls" else x.mean(axis=1)
    return nn.Dense(self.classes, name="head")(x)


def vit(dim=192, depth=12, heads=3, patch=8, size=64, batch=16, classes=10,
        mlp_ratio=4.0, dropout=0.1, attn_dropout=0.0, pool="cls", scan=False, remat=None):
  """Registry factory ``"vit"``: ViT-Tiny width/depth on 64x64 images.

  ``size`` must be a multiple of ``patch``; ``(size / patch) ** 2`` tokens
  (+1 class token) go through the blocks.
  """
  if size % patch:
    raise ValueError(f"vit: size {size} is not a multiple of patch {patch}")
  module = ViT(classes, dim, depth, heads, patch, mlp_ratio, dropout, attn_dropout,
               pool, check_remat(remat), scan)
  return module, image_batch(batch, size, classes), classify
