"""A small Flax NNX example model bundled with YAX (``yax._src.cli.bundled_nnx``).

The NNX counterpart of ``yax._src.cli.bundled``: a two-layer pre-LayerNorm
Transformer encoder written with ``flax.nnx`` layers (``Embed``,
``LayerNorm``, ``MultiHeadAttention``, ``Linear``, ``Dropout``) that
classifies token sequences. Trace it from the command line with::

    yax summary yax._src.cli.bundled_nnx:factory

A factory for the command line may return the NNX model itself as ``fn``
(``(model, (tokens,), {})``): the model is then traced as an argument,
``make_mox(lambda m, *a: m(*a))(model, *args)``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(dim, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, dim, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.gelu(self.fc1(x)))


class Block(nnx.Module):
  """A pre-LayerNorm Transformer encoder block."""

  def __init__(self, dim: int, num_heads: int, hidden: int, dropout: float,
               *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=num_heads, in_features=dim, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp = MLP(dim, hidden, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x):
    x = x + self.dropout(self.attention(self.ln1(x)))
    return x + self.dropout(self.mlp(self.ln2(x)))


class Transformer(nnx.Module):
  """A tiny Transformer encoder that classifies token sequences."""

  def __init__(self, vocab_size: int = 100, max_length: int = 16,
               dim: int = 32, num_heads: int = 4, hidden: int = 64,
               num_layers: int = 2, num_classes: int = 3,
               dropout: float = 0.1, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab_size, dim, rngs=rngs)
    self.pos_embed = nnx.Embed(max_length, dim, rngs=rngs)
    self.blocks = nnx.List([Block(dim, num_heads, hidden, dropout, rngs=rngs)
                            for _ in range(num_layers)])
    self.ln_final = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, num_classes, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_final(x).mean(axis=1))


def make(batch: int = 2, length: int = 8, train: bool = False, **config):
  """``(model, tokens)`` for the bundled NNX model (evaluation mode unless
  ``train``: then Dropout draws from the ``dropout`` RNG stream)."""
  model = Transformer(**config, rngs=nnx.Rngs(0, dropout=1))
  if not train:
    model.eval()
  vocab = model.embed.num_embeddings
  tokens = jnp.arange(batch * length, dtype=jnp.int32).reshape(batch, length)
  return model, tokens % vocab


def factory(batch: int = 2, length: int = 8):
  """Returns ``(model, (tokens,), {})``: the NNX model is ``fn`` itself."""
  model, tokens = make(batch, length)
  return model, (tokens,), {}
