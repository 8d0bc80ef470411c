"""Hand-written remat baselines: per-block ``nn.remat`` with a named policy.

These are the baselines jaxmem's planner is compared with: every residual
block of a zoo model is wrapped in ``nn.remat(Block, policy=...,
static_argnums=(2,))`` (``self`` is argument 0, ``x`` 1 and the ``train``
flag 2, which must be static because it picks the Python control flow), the
way MaxText and similar trainers do it.

Policies (``REMAT_POLICIES``), all from ``jax.checkpoint_policies``:

* ``nothing_saveable``: recompute the whole block in the backward pass.
* ``dots_saveable``: keep matmul and convolution outputs, recompute the rest.
* ``dots_with_no_batch_dims_saveable``: keep matmuls without batch dimensions
  (projections, not attention scores; convolutions are recomputed).
* ``everything_saveable``: the remat boundary only (saves what plain AD saves).
* ``offload_dot_with_no_batch_dims``: like the previous-but-one, but the kept
  values are moved to ``pinned_host`` memory and back.
* ``save_and_offload_only_these_names``: keep the values tagged
  :data:`SAVED_NAMES`, offload those tagged :data:`OFFLOADED_NAMES` (MaxText's
  "qkv_proj_offloaded" style) and recompute everything else. The zoo's blocks
  tag their projections with ``jax.ad_checkpoint.checkpoint_name``; blocks
  with no tags (``mlp``/``cnn`` have no blocks, ``transformer`` uses Flax's
  attention) then recompute everything.

On CPU the offload policies compile, run and give the same numbers, but
offload nothing: the step's jaxpr has its ``device_put`` equations to
``MemorySpace.Host`` and back, yet JAX lowers them for XLA:CPU without any
memory-kind annotation, so the "offloaded" values stay in device memory and
the policies act like the matching save policies (the compiled footprint of
``offload_dot_with_no_batch_dims`` is that of
``dots_with_no_batch_dims_saveable``). The host transfers only happen on GPU
or TPU.

Example:
  >>> import flax.linen as nn
  >>> class Block(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x, train: bool = True):
  ...     return x + nn.Dense(x.shape[-1])(x)
  >>> RematBlock = remat_block(Block, "dots_saveable")
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

SAVED_NAMES = ("attn_out",)
OFFLOADED_NAMES = ("query_proj", "key_proj", "value_proj", "mlp_hidden", "conv_out")
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"

_POLICIES: dict[str, Callable[[], Callable]] = {
    "nothing_saveable": lambda: jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": lambda: jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable":
        lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": lambda: jax.checkpoint_policies.everything_saveable,
    "offload_dot_with_no_batch_dims":
        lambda: jax.checkpoint_policies.offload_dot_with_no_batch_dims(
            OFFLOAD_SRC, OFFLOAD_DST),
    "save_and_offload_only_these_names":
        lambda: jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(SAVED_NAMES),
            names_which_can_be_offloaded=list(OFFLOADED_NAMES),
            offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST),
}

REMAT_POLICIES: tuple[str, ...] = tuple(_POLICIES)


def check_remat(remat: str | None) -> str | None:
  """Returns ``remat`` if it is ``None`` or a name in :data:`REMAT_POLICIES`.

  Raises:
    ValueError: for any other value, naming the accepted ones.

  Example:
    >>> check_remat("dots_saveable")
    'dots_saveable'
  """
  if remat is not None and remat not in _POLICIES:
    raise ValueError(f"unknown remat policy {remat!r}; expected None or one of "
                     f"{list(REMAT_POLICIES)}")
  return remat


def policy(remat: str) -> Callable:
  """The ``jax.checkpoint`` policy function for a name in :data:`REMAT_POLICIES`.

  Example:
    >>> policy("nothing_saveable") is jax.checkpoint_policies.nothing_saveable
    True
  """
  return _POLICIES[check_remat(remat)]()


def remat_block(block: type[nn.Module], remat: str | None,
                static_argnums: tuple[int, ...] = (2,)) -> type[nn.Module]:
  """``block`` itself for ``remat=None``, else ``nn.remat(block, policy=...)``.

  Give the blocks explicit names when building them: ``nn.remat`` renames the
  class (``CheckpointBlock``), and with explicit names the parameter trees of
  the plain and the rematerialized model are the same.

  Args:
    block: a linen module class called as ``block(...)(x, train)``.
    remat: ``None`` or a name from :data:`REMAT_POLICIES`.
    static_argnums: positions of static ``__call__`` arguments, counting
      ``self`` as 0 (the ``train`` flag; pass it positionally).

  Example:
    >>> Block = remat_block(nn.Dense, None)
    >>> Block is nn.Dense
    True
  """
  if check_remat(remat) is None:
    return block
  return nn.remat(block, policy=policy(remat), static_argnums=static_argnums)


def tag(x: jax.Array, name: str) -> jax.Array:
  """Names ``x`` for the name-based policies (identity otherwise).

  Example:
    >>> import jax.numpy as jnp
    >>> tag(jnp.ones(2), "conv_out").shape
    (2,)
  """
  return checkpoint_name(x, name)
