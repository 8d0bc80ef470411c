"""Small Flax models with ready train steps, built by name: the edge model zoo.

Every registry entry builds a :class:`Task` on synthetic data made from a
PRNG key (nothing is downloaded). ``remat=`` wraps each residual block in
``nn.remat`` with a policy from :data:`REMAT_POLICIES`: the hand-written
baselines jaxmem is compared with.

=============== ===========================================================
name            model (key options)
=============== ===========================================================
``mlp``         residual MLP (depth, width, batch, features)
``cnn``         small residual CNN with BatchNorm (widths, batch, size, blocks)
``transformer`` small causal LM (depth, dim, heads, seq, batch, vocab)
``mobilenetv2`` MobileNetV2 (width multiplier, depth multiplier, size)
``resnet18``    ResNet-18, basic blocks (width, stages, size)
``resnet50``    ResNet-50, bottleneck blocks (width, stages, size)
``resnet_deep`` CIFAR-style ResNet with ``depth`` blocks (hundreds allowed)
``vit``         ViT-Tiny-style (dim, depth, heads, patch, size, pool)
``gpt2``        GPT-2-style decoder (dim, depth, heads, seq, vocab, tied)
``unet``        U-Net segmentation (width, depth levels, size, norm)
``vgg``         VGG-11/13/16/19, plain conv stacks (depth, width, hidden, size)
=============== ===========================================================

Example:
  >>> import jaxmem_models as models
  >>> task = models.get("mlp", depth=4, width=32, batch=8)
  >>> state, batch = task.init()
  >>> new_state, loss = task.step(state, batch)
  >>> task = models.get("resnet18", width=8, stages=(1, 1), size=16, batch=2,
  ...                   remat="dots_saveable")
  >>> task.config["remat"]
  'dots_saveable'
"""

from __future__ import annotations

import inspect
from typing import Callable

import optax

from jaxmem_models import _gpt2, _legacy, _mobilenet, _resnet, _unet, _vgg, _vit
from jaxmem_models._attention import MLP, SelfAttention, TransformerBlock
from jaxmem_models._gpt2 import GPT2
from jaxmem_models._legacy import Block, ResidualMLP, SmallCNN, Transformer
from jaxmem_models._mobilenet import InvertedResidual, MobileNetV2
from jaxmem_models._remat import REMAT_POLICIES, check_remat, policy, remat_block
from jaxmem_models._resnet import BasicBlock, Bottleneck, ResNet
from jaxmem_models._task import Task, classify, image_batch, param_count, token_batch
from jaxmem_models._unet import ConvBlock, UNet, UpBlock
from jaxmem_models._vgg import VGG, ConvReLU
from jaxmem_models._vit import ViT

# Factories: ``(**config) -> (module, make_batch, loss)``.
REGISTRY: dict[str, Callable] = {
    "mlp": _legacy.mlp, "cnn": _legacy.cnn, "transformer": _legacy.transformer,
    "mobilenetv2": _mobilenet.mobilenetv2, "resnet18": _resnet.resnet18,
    "resnet50": _resnet.resnet50, "resnet_deep": _resnet.resnet_deep,
    "vit": _vit.vit, "gpt2": _gpt2.gpt2, "unet": _unet.unet, "vgg": _vgg.vgg,
}

_classify = classify  # the name the original module used

# Small, activation-dominated configurations (activations are 75-92% of the
# unconstrained footprint; the rest is parameters, gradients and Adam's
# moments): graphs of 1,500-6,500 equations that plan in about a minute on
# CPU. The benchmark suite's CPU runs and the memory model's accuracy test
# use them.
CPU_SIZES: dict[str, dict] = {
    "resnet18": dict(width=8, stages=[1, 1, 1, 1], size=32, batch=32),
    "mobilenetv2": dict(width=0.25, size=32, batch=32),
    "vit": dict(dim=64, depth=4, heads=2, patch=4, size=32, batch=16),
    "gpt2": dict(dim=64, depth=4, heads=2, seq=128, vocab=256, batch=8),
    "unet": dict(width=8, depth=2, size=64, batch=4),
    "resnet_deep": dict(depth=12, width=8, size=32, batch=16),
    "vgg": dict(depth=11, width=8, size=32, batch=32, hidden=64),
}


def options(name: str) -> dict:
  """A registered model's options and their defaults.

  Example:
    >>> import jaxmem_models as models
    >>> models.options("mlp")["batch"]
    2048
  """
  if name not in REGISTRY:
    raise KeyError(f"unknown model {name!r}; expected one of {sorted(REGISTRY)}")
  return {k: p.default for k, p in inspect.signature(REGISTRY[name]).parameters.items()
          if k != "remat"}


def supports_remat(name: str) -> bool:
  """Whether the model has block modules that ``remat=`` can wrap."""
  return "remat" in inspect.signature(REGISTRY[name]).parameters


def get(name: str, *, optimizer: optax.GradientTransformation | None = None,
        remat: str | None = None, **config) -> Task:
  """Builds a registered model's :class:`Task` (see :data:`REGISTRY`).

  Args:
    name: a key of :data:`REGISTRY`.
    optimizer: the step's optimizer; ``optax.adam(1e-3)`` by default.
    remat: ``None`` or a name from :data:`REMAT_POLICIES`: ``nn.remat`` with
      that policy around every block (not for ``mlp`` and ``cnn``, which have
      no block modules).
    **config: the factory's options (its keyword arguments).

  Returns:
    The :class:`Task`; ``task.config`` is ``config`` plus ``remat``.

  Raises:
    KeyError: for an unknown model name.
    ValueError: for an unknown remat policy or remat on a model without blocks.
    TypeError: for an option the factory does not take.

  Example:
    >>> import jaxmem_models as models
    >>> task = models.get("gpt2", dim=16, depth=1, heads=2, seq=8, vocab=32, batch=2)
    >>> sorted(task.config)
    ['batch', 'depth', 'dim', 'heads', 'remat', 'seq', 'vocab']
  """
  known = options(name)
  check_remat(remat)
  unknown = sorted(set(config) - set(known))
  if unknown:
    raise TypeError(f"model {name!r} takes no option(s) {unknown}; its options are "
                    f"{list(known)} (and remat=)")
  if remat is not None and not supports_remat(name):
    with_blocks = sorted(n for n in REGISTRY if supports_remat(n))
    raise ValueError(f"model {name!r} has no block modules, so remat={remat!r} cannot "
                     f"be applied; models with per-block remat: {with_blocks}")
  extra = {} if remat is None else {"remat": remat}
  module, make_batch, loss = REGISTRY[name](**config, **extra)
  return Task(name, module, make_batch, loss, optimizer or optax.adam(1e-3),
              dict(config, remat=remat))


__all__ = [
    "REGISTRY", "REMAT_POLICIES", "Task", "get", "options", "supports_remat", "param_count", "policy", "remat_block",
    "check_remat", "classify", "image_batch", "token_batch",
    "ResidualMLP", "SmallCNN", "Block", "Transformer",
    "MobileNetV2", "InvertedResidual", "ResNet", "BasicBlock", "Bottleneck",
    "ViT", "GPT2", "TransformerBlock", "SelfAttention", "MLP",
    "UNet", "ConvBlock", "UpBlock", "VGG", "ConvReLU",
]
