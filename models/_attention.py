"""Pre-LN transformer block shared by the ViT and GPT-2 models.

The projections are tagged (``query_proj``, ``key_proj``, ``value_proj``,
``attn_out``, ``mlp_hidden``) for the name-based remat policy.

Example:
  >>> import jax, jax.numpy as jnp
  >>> block = TransformerBlock(dim=16, heads=2, causal=True)
  >>> x = jnp.ones((2, 5, 16))
  >>> variables = block.init(jax.random.PRNGKey(0), x, False)
  >>> block.apply(variables, x, False).shape
  (2, 5, 16)
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxmem_models._random import Dropout, dropout, normal
from jaxmem_models._remat import tag


class SelfAttention(nn.Module):
  """Multi-head self-attention with tagged q/k/v projections.

  Attributes:
    dim: model width (a multiple of ``heads``).
    heads: attention heads.
    dropout: dropout rate on the attention probabilities.
    causal: mask future positions.
    out_init_std: std of the output projection's normal initializer.
    dtype: the computation's dtype (parameters stay float32).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> att = SelfAttention(dim=8, heads=2)
    >>> _ = att.init(jax.random.PRNGKey(0), jnp.ones((1, 3, 8)), False)
  """
  dim: int
  heads: int
  dropout: float = 0.0
  causal: bool = False
  out_init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    if self.dim % self.heads:
      raise ValueError(f"dim {self.dim} is not a multiple of heads {self.heads}")
    proj = lambda name: nn.DenseGeneral(  # noqa: E731
        (self.heads, self.dim // self.heads),
        kernel_init=normal(0.02), dtype=self.dtype, name=name)
    q = tag(proj("query")(x), "query_proj")
    k = tag(proj("key")(x), "key_proj")
    v = tag(proj("value")(x), "value_proj")
    mask = nn.make_causal_mask(x[..., 0]) if self.causal else None
    weights = nn.dot_product_attention_weights(q, k, mask=mask)
    if train and self.dropout:
      weights = dropout(weights, self.dropout, self.make_rng("dropout"))
    out = tag(jnp.einsum("...hqk,...khd->...qhd", weights, v), "attn_out")
    return nn.DenseGeneral(self.dim, axis=(-2, -1), name="out",
                           kernel_init=normal(self.out_init_std), dtype=self.dtype)(out)


class MLP(nn.Module):
  """``Dense(hidden) -> gelu -> Dense(dim)``, the hidden layer tagged.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> _ = MLP(dim=8, hidden=32).init(jax.random.PRNGKey(0), jnp.ones((1, 8)))
  """
  dim: int
  hidden: int
  out_init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    dense = lambda n, std, name: nn.Dense(  # noqa: E731
        n, kernel_init=normal(std), dtype=self.dtype, name=name)
    h = tag(dense(self.hidden, 0.02, "fc")(x), "mlp_hidden")
    return dense(self.dim, self.out_init_std, "proj")(nn.gelu(h))


class TransformerBlock(nn.Module):
  """Pre-LN block: ``x + drop(attn(LN(x)))``, then ``x + drop(mlp(LN(x)))``.

  Attributes:
    dim: model width.
    heads: attention heads.
    mlp_ratio: MLP hidden width over ``dim``.
    dropout: residual (and MLP) dropout rate.
    attn_dropout: dropout on attention probabilities.
    causal: causal self-attention.
    out_init_std: std of the two residual output projections (GPT-2 scales it
      by ``1 / sqrt(2 * depth)``).
    dtype: the computation's dtype (mixed precision with ``bfloat16``; the
      parameters stay float32).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> _ = TransformerBlock(8, 2).init(jax.random.PRNGKey(0), jnp.ones((1, 3, 8)), False)
  """
  dim: int
  heads: int
  mlp_ratio: float = 4.0
  dropout: float = 0.0
  attn_dropout: float = 0.0
  causal: bool = False
  out_init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    drop = lambda h: Dropout(self.dropout)(h, not train)  # noqa: E731
    norm = lambda name: nn.LayerNorm(dtype=self.dtype, name=name)  # noqa: E731
    h = SelfAttention(self.dim, self.heads, self.attn_dropout, self.causal,
                      self.out_init_std, self.dtype, name="attn")(norm("ln1")(x), train)
    x = x + drop(h)
    h = MLP(self.dim, int(self.mlp_ratio * self.dim), self.out_init_std, self.dtype,
            name="mlp")(norm("ln2")(x))
    return x + drop(h)


class _Layer(nn.Module):
  """One block as a scan body: ``(x, None) -> (block(x), None)``."""
  block: type
  args: tuple
  train: bool

  @nn.compact
  def __call__(self, x, _):
    return self.block(*self.args, name="block")(x, self.train), None


def run_blocks(x, block: type, args: tuple, depth: int, train: bool, scan: bool):
  """``depth`` blocks ``block(*args)`` applied to ``x`` inside a compact
  method: unrolled (modules ``block0``, ``block1``, ...) or, with ``scan``,
  as one ``nn.scan`` over stacked parameters (module ``blocks``; one body
  in the program whatever the depth, how production stacks are written).
  ``block`` may be ``nn.remat``-wrapped: scanned, that is
  ``nn.scan(nn.remat(Block))``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return run_blocks(x, TransformerBlock, (8, 2), 3, False, scan=True)
    >>> p = Net().init(jax.random.key(0), jnp.ones((1, 4, 8)))["params"]
    >>> p["blocks"]["block"]["ln1"]["scale"].shape
    (3, 8)
  """
  if not scan:
    for i in range(depth):
      x = block(*args, name=f"block{i}")(x, train)
    return x
  stack = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True,
                                                                   "dropout": True},
                  length=depth)
  x, _ = stack(block, args, train, name="blocks")(x, None)
  return x
