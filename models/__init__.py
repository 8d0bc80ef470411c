"""Small Flax models with ready train steps, built by name.

Example:
  >>> import models
  >>> task = models.get("mlp", depth=4, width=32, batch=8)
  >>> state, batch = task.init()
  >>> new_state, loss = task.step(state, batch)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass
class Task:
  """A model with its train step: ``step(state, batch) -> (state, loss)``."""
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


def _classify(out, batch):
  return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()


class ResidualMLP(nn.Module):
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
  widths: tuple = (16, 32, 64)
  classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    for i, w in enumerate(self.widths):
      x = nn.Conv(w, (3, 3), strides=(1, 1) if i == 0 else (2, 2))(x)
      for _ in range(2):
        y = nn.Conv(w, (3, 3))(nn.relu(nn.BatchNorm(use_running_average=not train)(x)))
        x = x + y
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
    return nn.Dense(self.classes)(x.mean((1, 2)))


class Block(nn.Module):
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
  depth: int = 4
  dim: int = 64
  heads: int = 4
  vocab: int = 128
  dropout: float = 0.1

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    x = nn.Embed(self.vocab, self.dim)(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
    for _ in range(self.depth):
      x = Block(self.dim, self.heads, self.dropout)(x, train)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def _mlp(depth=16, width=128, batch=2048, features=64):
  def make_batch(key):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (batch, features)),
            "y": jax.random.randint(ky, (batch,), 0, 10)}
  return ResidualMLP(depth, width), make_batch, _classify


def _cnn(widths=(16, 32, 64), batch=16, size=32):
  def make_batch(key):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (batch, size, size, 3)),
            "y": jax.random.randint(ky, (batch,), 0, 10)}
  return SmallCNN(tuple(widths)), make_batch, _classify


def _transformer(depth=4, dim=64, heads=4, seq=64, batch=8, vocab=128, dropout=0.1):
  def make_batch(key):
    tokens = jax.random.randint(key, (batch, seq + 1), 0, vocab)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}

  def loss(out, batch):
    return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()
  return Transformer(depth, dim, heads, vocab, dropout), make_batch, loss


REGISTRY: dict[str, Callable] = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer}


def get(name: str, *, optimizer: optax.GradientTransformation | None = None,
        **config) -> Task:
  """Builds a registered model's :class:`Task` (see :data:`REGISTRY`)."""
  if name not in REGISTRY:
    raise KeyError(f"unknown model {name!r}; expected one of {sorted(REGISTRY)}")
  module, make_batch, loss = REGISTRY[name](**config)
  return Task(name, module, make_batch, loss, optimizer or optax.adam(1e-3), config)
