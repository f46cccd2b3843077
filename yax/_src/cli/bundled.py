"""A small example model bundled with YAX, for the command line and docs.

``yax summary`` (or any other subcommand) without a model argument traces
:func:`factory`: a two-layer Transformer encoder written with plain
``flax.linen`` (token and position embeddings, pre-LayerNorm blocks with
multi-head self-attention and a GELU MLP, a classification head). It needs
nothing beyond Flax and builds in well under a second on a CPU.

Any model can be given to the command line the same way: a function that
returns ``(fn, args, kwargs)`` such that ``fn(*args, **kwargs)`` runs the
model, e.g. ``(model.apply, (variables, tokens), {})``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class SelfAttention(nn.Module):
  """Multi-head self-attention with separate query/key/value projections."""
  num_heads: int

  @nn.compact
  def __call__(self, x):
    batch, length, dim = x.shape
    head_dim = dim // self.num_heads

    def heads(y):
      return y.reshape(batch, length, self.num_heads, head_dim)

    q = heads(nn.Dense(dim, name='query')(x))
    k = heads(nn.Dense(dim, name='key')(x))
    v = heads(nn.Dense(dim, name='value')(x))
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(head_dim)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum('bhqk,bkhd->bqhd', weights, v).reshape(batch, length, dim)
    return nn.Dense(dim, name='out')(out)


class MLP(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(self.hidden, name='fc1')(x)
    y = nn.gelu(y)
    return nn.Dense(x.shape[-1], name='fc2')(y)


class Block(nn.Module):
  """A pre-LayerNorm Transformer encoder block."""
  num_heads: int
  mlp_hidden: int

  @nn.compact
  def __call__(self, x):
    x = x + SelfAttention(self.num_heads, name='attention')(
        nn.LayerNorm(name='ln1')(x))
    x = x + MLP(self.mlp_hidden, name='mlp')(nn.LayerNorm(name='ln2')(x))
    return x


class Transformer(nn.Module):
  """A tiny Transformer encoder that classifies token sequences."""
  vocab_size: int = 100
  max_length: int = 16
  dim: int = 32
  num_heads: int = 4
  mlp_hidden: int = 64
  num_layers: int = 2
  num_classes: int = 3

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab_size, self.dim, name='embed')(tokens)
    positions = jnp.arange(tokens.shape[-1])
    x = x + nn.Embed(self.max_length, self.dim, name='pos_embed')(positions)
    for i in range(self.num_layers):
      x = Block(self.num_heads, self.mlp_hidden, name=f'block_{i}')(x)
    x = nn.LayerNorm(name='ln_final')(x)
    return nn.Dense(self.num_classes, name='head')(x.mean(axis=1))


def factory(batch: int = 2, length: int = 8):
  """Returns ``(model.apply, (variables, tokens), {})`` for the bundled model."""
  model = Transformer()
  tokens = jnp.arange(batch * length, dtype=jnp.int32).reshape(batch, length)
  tokens = tokens % model.vocab_size
  variables = model.init(jax.random.key(0), tokens)
  return model.apply, (variables, tokens), {}
