"""The original three test models: residual MLP, small CNN, small transformer.

Their parameter names, defaults and numbers are relied on by jaxmem's tests
and benchmark; only ``Transformer`` gained an optional per-block ``remat``.

Example:
  >>> import jaxmem_models as models
  >>> task = models.get("transformer", depth=1, dim=16, heads=2, seq=8, batch=2)
  >>> state, batch = task.init()
"""

from __future__ import annotations

import flax.linen as nn
import jax

from jaxmem_models._remat import remat_block
from jaxmem_models._task import classify, image_batch, token_batch


class ResidualMLP(nn.Module):
  """``depth`` residual ``Dense -> gelu -> Dense`` layers on flat features.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> model = ResidualMLP(depth=2, width=8)
    >>> sorted(model.init(jax.random.PRNGKey(0), jnp.ones((1, 4)))["params"])
    ['Dense_0', 'Dense_1', 'Dense_2', 'Dense_3', 'Dense_4', 'Dense_5']
  """
  depth: int = 16
  width: int = 256
  classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(self.width)(x)
    for _ in range(self.depth):
      x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(self.width)(x)))
    return nn.Dense(self.classes)(x)


class SmallCNN(nn.Module):
  """Pre-activation residual CNN with BatchNorm: ``blocks`` blocks per width.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> v = SmallCNN((4,)).init(jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 3)), train=False)
    >>> sorted(v)
    ['batch_stats', 'params']
  """
  widths: tuple = (16, 32, 64)
  classes: int = 10
  blocks: int = 2

  @nn.compact
  def __call__(self, x, train: bool = True):
    for i, w in enumerate(self.widths):
      x = nn.Conv(w, (3, 3), strides=(1, 1) if i == 0 else (2, 2))(x)
      for _ in range(self.blocks):
        y = nn.Conv(w, (3, 3))(nn.relu(nn.BatchNorm(use_running_average=not train)(x)))
        x = x + y
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
    return nn.Dense(self.classes)(x.mean((1, 2)))


class Block(nn.Module):
  """Pre-LN causal transformer block (Flax attention, dropout).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> _ = Block(8, 2, 0.1).init(jax.random.PRNGKey(0), jnp.ones((1, 4, 8)), False)
  """
  dim: int
  heads: int
  dropout: float

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=nn.make_causal_mask(x[..., 0]))
    x = x + nn.Dropout(self.dropout, deterministic=not train)(h)
    h = nn.Dense(4 * self.dim)(nn.LayerNorm()(x))
    h = nn.Dense(self.dim)(nn.gelu(h))
    return x + nn.Dropout(self.dropout, deterministic=not train)(h)


class Transformer(nn.Module):
  """Small causal language model of :class:`Block` s.

  ``remat`` (a name from ``models.REMAT_POLICIES``) wraps each block in
  ``nn.remat``; the blocks keep their names ``Block_0``, ``Block_1``, ... so
  the parameters are the same either way.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> m = Transformer(depth=1, dim=8, heads=2, vocab=16)
    >>> params = m.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), int), train=False)["params"]
    >>> sorted(params)
    ['Block_0', 'Dense_0', 'Embed_0', 'LayerNorm_0', 'pos']
  """
  depth: int = 4
  dim: int = 64
  heads: int = 4
  vocab: int = 128
  dropout: float = 0.1
  remat: str | None = None

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    x = nn.Embed(self.vocab, self.dim)(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
    block = remat_block(Block, self.remat)
    for i in range(self.depth):
      x = block(self.dim, self.heads, self.dropout, name=f"Block_{i}")(x, train)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def mlp(depth=16, width=128, batch=2048, features=64):
  """Registry factory ``"mlp"``: :class:`ResidualMLP` on Gaussian features."""
  def make_batch(key):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (batch, features)),
            "y": jax.random.randint(ky, (batch,), 0, 10)}
  return ResidualMLP(depth, width), make_batch, classify


def cnn(widths=(16, 32, 64), batch=16, size=32, blocks=2):
  """Registry factory ``"cnn"``: :class:`SmallCNN` on ``size`` x ``size`` images."""
  return SmallCNN(tuple(widths), blocks=blocks), image_batch(batch, size), classify


def transformer(depth=4, dim=64, heads=4, seq=64, batch=8, vocab=128, dropout=0.1,
                remat=None):
  """Registry factory ``"transformer"``: :class:`Transformer`, next-token loss."""
  return (Transformer(depth, dim, heads, vocab, dropout, remat),
          token_batch(batch, seq, vocab), classify)
