"""Small GPT-2-style causal decoder for next-token prediction.

Example:
  >>> import jaxmem_models as models
  >>> task = models.get("gpt2", dim=16, depth=1, heads=2, seq=8, vocab=32, batch=2)
  >>> state, batch = task.init()
  >>> state, loss = task.step(state, batch)
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from jaxmem_models._attention import TransformerBlock, run_blocks
from jaxmem_models._random import Dropout
from jaxmem_models._remat import check_remat, remat_block
from jaxmem_models._task import classify, token_batch


class GPT2(nn.Module):
  """Token + learned position embeddings, pre-LN causal blocks, final LN.

  Attributes:
    vocab: vocabulary size.
    max_len: number of learned positions (the longest sequence).
    dim: model width.
    depth: blocks.
    heads: attention heads.
    dropout: embedding, residual and attention dropout (GPT-2: 0.1 each).
    tied: output head is the token embedding's transpose (GPT-2) or a
      separate ``Dense(vocab)``.
    remat: ``None`` or a name from ``models.REMAT_POLICIES`` (per block).
    scan: the blocks as one ``nn.scan`` over stacked parameters.
    dtype: the computation's dtype; ``bfloat16`` trains in mixed precision
      (float32 parameters, each cast where it is read; float32 logits).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> m = GPT2(vocab=16, max_len=4, dim=8, depth=1, heads=2, tied=False)
    >>> m.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), int), train=False)["params"].keys()
    dict_keys(['wte', 'wpe', 'block0', 'ln_f', 'head'])
  """
  vocab: int = 8192
  max_len: int = 256
  dim: int = 256
  depth: int = 6
  heads: int = 4
  dropout: float = 0.1
  tied: bool = True
  remat: str | None = None
  scan: bool = False
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    if tokens.shape[1] > self.max_len:
      raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds max_len {self.max_len}")
    wte = nn.Embed(self.vocab, self.dim, embedding_init=nn.initializers.normal(0.02),
                   dtype=self.dtype, name="wte")
    wpe = nn.Embed(self.max_len, self.dim, embedding_init=nn.initializers.normal(0.01),
                   dtype=self.dtype, name="wpe")
    x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]
    x = Dropout(self.dropout)(x, not train)
    block = remat_block(TransformerBlock, self.remat)
    out_std = 0.02 / math.sqrt(2 * max(self.depth, 1))
    x = run_blocks(x, block, (self.dim, self.heads, 4.0, self.dropout, self.dropout, True,
                              out_std, self.dtype), self.depth, train, self.scan)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    if self.tied:
      logits = wte.attend(x)
    else:
      logits = nn.Dense(self.vocab, use_bias=False, kernel_init=nn.initializers.normal(0.02),
                        dtype=self.dtype, name="head")(x)
    return logits if logits.dtype == jnp.float32 else logits.astype(jnp.float32)


def gpt2(dim=256, depth=6, heads=4, seq=256, vocab=8192, batch=8, dropout=0.1,
         tied=True, scan=False, remat=None, dtype="float32"):
  """Registry factory ``"gpt2"``: a 6-layer, 256-wide GPT-2 on 256 tokens;
  ``scan=True`` runs its blocks as one ``nn.scan``; ``dtype="bfloat16"``
  trains it in mixed precision."""
  module = GPT2(vocab, seq, dim, depth, heads, dropout, tied, check_remat(remat), scan,
                jnp.dtype(dtype))
  return module, token_batch(batch, seq, vocab), classify
