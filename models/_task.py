"""The :class:`Task` (a model with its train step), losses and synthetic batches.

Example:
  >>> from jaxmem_models._task import Task, classify, image_batch
  >>> import flax.linen as nn, optax
  >>> class Net(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x, train: bool = True):
  ...     return nn.Dense(10)(x.reshape(x.shape[0], -1))
  >>> task = Task("net", Net(), image_batch(2, 8), classify, optax.sgd(0.1), {})
  >>> state, batch = task.init()
  >>> state, loss = task.step(state, batch)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import optax


@dataclasses.dataclass
class Task:
  """A model with its train step: ``step(state, batch) -> (state, loss)``.

  Attributes:
    name: the registry name.
    module: the Flax linen module; called as ``module(x, train=...)``.
    make_batch: ``key -> {"x": inputs, "y": targets}``.
    loss: ``(model output, batch) -> scalar``.
    optimizer: the optax transformation the step applies.
    config: the options the model was built with (``remat`` included).

  Example:
    >>> import jaxmem_models as models
    >>> task = models.get("mlp", depth=2, width=16, batch=4)
    >>> state, batch = task.init()
    >>> state, loss = task.step(state, batch)
  """
  name: str
  module: nn.Module
  make_batch: Callable[[jax.Array], Any]
  loss: Callable
  optimizer: optax.GradientTransformation
  config: dict

  def init(self, seed: int = 0):
    """Returns ``(state, batch)``: params, batch stats, optimizer state, rng."""
    key = jax.random.PRNGKey(seed)
    batch = self.make_batch(key)
    variables = self.module.init({"params": key, "dropout": key}, batch["x"],
                                 train=False)
    params = variables["params"]
    state = {"params": params, "opt": self.optimizer.init(params),
             "rng": jax.random.PRNGKey(seed + 1)}
    if "batch_stats" in variables:
      state["batch_stats"] = variables["batch_stats"]
    return state, batch

  def step(self, state, batch):
    """One training step: forward, backward and optimizer update."""
    rng, dropout = jax.random.split(state["rng"])
    has_stats = "batch_stats" in state

    def loss_fn(params):
      variables = {"params": params}
      if has_stats:
        variables["batch_stats"] = state["batch_stats"]
      out, updates = self.module.apply(
          variables, batch["x"], train=True, rngs={"dropout": dropout},
          mutable=["batch_stats"] if has_stats else [])
      return self.loss(out, batch), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    upd, opt = self.optimizer.update(grads, state["opt"], state["params"])
    new = {"params": optax.apply_updates(state["params"], upd), "opt": opt, "rng": rng}
    if has_stats:
      new["batch_stats"] = updates["batch_stats"]
    return new, loss


def classify(out, batch):
  """Mean softmax cross-entropy of logits ``out`` against integer ``batch["y"]``.

  Works for any leading shape: per-image ``(B, C)`` logits, per-token
  ``(B, T, V)`` and per-pixel ``(B, H, W, C)`` logits alike.

  Example:
    >>> import jax.numpy as jnp
    >>> round(float(classify(jnp.zeros((2, 4)), {"y": jnp.array([0, 3])})), 4)  # log 4
    1.3863
  """
  return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()


def image_batch(batch: int, size: int, classes: int = 10, channels: int = 3,
                per_pixel: bool = False):
  """Synthetic NHWC images with class labels (or per-pixel labels).

  Args:
    batch: images per batch.
    size: height and width.
    classes: label range.
    channels: input channels.
    per_pixel: labels of shape ``(batch, size, size)`` for segmentation.

  Returns:
    ``make_batch(key) -> {"x": (batch, size, size, channels), "y": labels}``.

  Example:
    >>> import jax
    >>> image_batch(2, 8, per_pixel=True)(jax.random.PRNGKey(0))["y"].shape
    (2, 8, 8)
  """
  label_shape = (batch, size, size) if per_pixel else (batch,)

  def make_batch(key):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (batch, size, size, channels)),
            "y": jax.random.randint(ky, label_shape, 0, classes)}
  return make_batch


def token_batch(batch: int, seq: int, vocab: int):
  """Synthetic next-token batches: ``x`` tokens and ``y`` shifted by one.

  Example:
    >>> import jax
    >>> token_batch(2, 5, 11)(jax.random.PRNGKey(0))["x"].shape
    (2, 5)
  """
  def make_batch(key):
    tokens = jax.random.randint(key, (batch, seq + 1), 0, vocab)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  return make_batch


def param_count(task: Task) -> int:
  """Number of trainable parameters, from shapes only (nothing is computed).

  Example:
    >>> import jaxmem_models as models
    >>> param_count(models.get("mlp", depth=1, width=4, features=2))
    102
  """
  def init():
    return task.init()[0]["params"]
  shapes = jax.eval_shape(init)
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(shapes))
