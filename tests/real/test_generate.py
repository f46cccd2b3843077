"""Greedy decoding with a KV cache and LoRA adapters NOT merged
(``yax.keep``: the prompt and the one-token steps are two shapes, each
traced and rewritten once), token for token equal to the model run by its
own code on weights merged by hand (``kernel + s * A @ B`` in the kernel's
layout). On Hugging Face's Flax GPT-2 (its ``init_cache`` and
``past_key_values``) and Google DeepMind's gemma 3 Transformer (its
``init_cache``), tiny configs, random weights, adapters perturbed so that
they change the tokens."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from helpers import check_rewrite, random_variables, trained_adapters

os.environ.setdefault('USE_TORCH', '0')

RANK, ALPHA = 2, 4.0
NEW_TOKENS = 5


def _greedy(prefill, decode, prompt, new_tokens):
  """Greedy tokens: ``prefill(prompt) -> (logits, state)``, then
  ``decode(token, i, state) -> (logits, state)`` for the i-th new token."""
  logits, state = prefill(prompt)
  tokens = [jnp.argmax(logits[:, -1], axis=-1)]
  for i in range(new_tokens - 1):
    logits, state = decode(tokens[-1][:, None], i, state)
    tokens.append(jnp.argmax(logits[:, -1], axis=-1))
  return np.stack([np.asarray(t) for t in tokens], axis=1)


# ============================================================== GPT-2 (HF)

def _gpt2_merge(params, scale=ALPHA / RANK):
  """FlaxConv1D computes ``x @ kernel.T``: the kernel is [out, in], so the
  adapted kernel is ``kernel + s * (A @ B).T``."""
  if isinstance(params, dict) and 'lora_a' in params:
    out = {k: v for k, v in params.items() if k not in ('lora_a', 'lora_b')}
    out['kernel'] = params['kernel'] + scale * (
        params['lora_a'] @ params['lora_b']).T
    return out
  if isinstance(params, dict):
    return {k: _gpt2_merge(v, scale) for k, v in params.items()}
  return params


def _gpt2_tokens(step, params, prompt, max_len):
  batch, length = prompt.shape
  cache = _GPT2['model'].init_cache(batch, max_len)
  mask = jnp.ones((batch, max_len), jnp.int32)  # causal masking does the rest
  step = jax.jit(step)

  def prefill(ids):
    pos = jnp.broadcast_to(jnp.arange(length), (batch, length))
    out = step(params, ids, mask, pos, cache)
    return out.logits, out.past_key_values

  def decode(token, i, past):
    pos = jnp.full((batch, 1), length + i)
    out = step(params, token, mask, pos, past)
    return out.logits, out.past_key_values

  return _greedy(prefill, decode, prompt, NEW_TOKENS)


_GPT2 = {}


def test_gpt2_greedy_decoding_unmerged_equals_merged():
  transformers = pytest.importorskip('transformers')
  config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16,
                                   n_layer=2, n_head=2)
  model = _GPT2['model'] = transformers.FlaxGPT2LMHeadModel(config, seed=0)

  def step(params, ids, mask, pos, cache):
    return model(ids, attention_mask=mask, position_ids=pos, params=params,
                 past_key_values=cache)

  # Traced once, at a batch of 2 and a prompt of 4 in a cache of 8.
  prompt = (jnp.arange(8).reshape(2, 4) * 5) % 63 + 1
  cache = model.init_cache(2, 8)
  mox = yax.make_mox(step)(model.params, prompt, jnp.ones((2, 8), jnp.int32),
                           jnp.broadcast_to(jnp.arange(4), (2, 4)), cache)
  res = yax.lora(mox, model.params, '//module_call[@type="FlaxConv1D"]',
                 rank=RANK, alpha=ALPHA)
  trained = trained_adapters(res.params, res.mask)
  kept = yax.keep(step, res.recipe)
  merged = _gpt2_merge(trained)
  # Another batch, prompt and cache length than the trace's.
  prompt = (jnp.arange(18).reshape(3, 6) * 7) % 63 + 1
  want = _gpt2_tokens(step, merged, prompt, 12)
  got = _gpt2_tokens(kept, trained, prompt, 12)
  np.testing.assert_array_equal(got, want)
  # The adapters matter: the base model decodes other tokens.
  assert not np.array_equal(_gpt2_tokens(step, model.params, prompt, 12),
                            want)
  assert kept.cache_size == 2  # the prompt, then every one-token step
  check_rewrite(kept.mox(trained, prompt, jnp.ones((3, 12), jnp.int32),
                         jnp.zeros((3, 6), jnp.int32),
                         model.init_cache(3, 12)))
  assert kept.cache_size == 2  # the prompt's signature: no new trace


# ================================================================= gemma 3

def _gemma_merge(params, scale=ALPHA / RANK):
  """Each Einsum kernel plus ``s * A @ B`` with the axes of its equation
  (A: the contracted kernel axes then rank, B: rank then the others)."""
  merged = jax.tree.map(lambda v: v, params)
  for name, layer in params['params'].items():
    if not name.startswith('layer_'):
      continue
    attn, mlp = dict(layer['attn']), dict(layer['mlp'])
    for key, spec in [('q_einsum', 'dr,rnh->ndh'),
                      ('kv_einsum', 'dr,rckh->ckdh'),
                      ('attn_vec_einsum', 'nhr,rd->nhd')]:
      m = dict(attn[key])
      a, b = m.pop('lora_a'), m.pop('lora_b')
      m['w'] = m['w'] + scale * jnp.einsum(spec, a, b)
      attn[key] = m
    for key, spec in [('gating_einsum', 'dr,rgf->gfd'),
                      ('linear', 'fr,rd->fd')]:
      a, b = mlp.pop(f'{key}_lora_a'), mlp.pop(f'{key}_lora_b')
      mlp[key] = mlp[key] + scale * jnp.einsum(spec, a, b)
    merged['params'][name] = {**layer, 'attn': attn, 'mlp': mlp}
  return merged


def _gemma_tokens(step, config, params, prompt, cache_len):
  batch, length = prompt.shape
  cache = config.init_cache(batch_size=batch, dtype=jnp.float32,
                            cache_length=cache_len)
  step = jax.jit(step)
  slots = jnp.arange(cache_len)

  def prefill(tokens):
    pos = jnp.broadcast_to(jnp.arange(length), (batch, length))
    mask = jnp.broadcast_to(slots[None, :] <= jnp.arange(length)[:, None],
                            (batch, length, cache_len))
    out = step(params, tokens, pos, cache, mask)
    return out.logits, out.cache

  def decode(token, i, cache):
    pos = jnp.full((batch, 1), length + i)
    mask = jnp.broadcast_to(slots <= length + i, (batch, 1, cache_len))
    out = step(params, token, pos, cache, mask)
    return out.logits, out.cache

  return _greedy(prefill, decode, prompt, NEW_TOKENS)


def test_gemma3_greedy_decoding_unmerged_equals_merged():
  from test_real_models import import_gemma
  gm, _ = import_gemma()
  A = gm.nn.AttentionType
  config = gm.nn.config.TransformerConfig(
      num_embed=64, embed_dim=32, hidden_dim=48, num_heads=4, head_dim=8,
      num_kv_heads=2, final_logit_softcap=None, use_post_attn_norm=True,
      use_post_ffw_norm=True, use_qk_norm=True,
      attention_types=(A.LOCAL_SLIDING, A.GLOBAL),
      query_pre_attn_norm=(gm.nn.config.QueryPreAttentionNormalisation
                           .BY_ONE_OVER_SQRT_HEAD_DIM),
      attn_logits_soft_cap=None, sliding_window_size=4,
      transpose_gating_einsum=True, local_base_frequency=10_000,
      global_base_frequency=1_000_000, vision_encoder=None)
  model = gm.nn.Transformer(config=config, dtype=jnp.float32)

  def step(variables, tokens, positions, cache, mask):
    return model.apply(variables, tokens, positions=positions, cache=cache,
                       attention_mask=mask)

  prompt = (jnp.arange(8).reshape(2, 4) * 7) % 63 + 1
  variables = random_variables(model, 0, prompt)
  cache = config.init_cache(batch_size=2, dtype=jnp.float32, cache_length=8)
  mask = jnp.broadcast_to(jnp.arange(8)[None, :] <= jnp.arange(4)[:, None],
                          (2, 4, 8))
  pos = jnp.broadcast_to(jnp.arange(4), (2, 4))
  mox = yax.make_mox(step)(variables, prompt, pos, cache, mask)
  res = yax.lora(mox, variables, '//module_call[@type="Einsum"]', rank=RANK,
                 alpha=ALPHA)
  trained = trained_adapters(res.params, res.mask)
  kept = yax.keep(step, res.recipe)
  merged = _gemma_merge(trained)
  prompt = (jnp.arange(15).reshape(3, 5) * 5) % 63 + 1
  want = _gemma_tokens(step, config, merged, prompt, 12)
  got = _gemma_tokens(kept, config, trained, prompt, 12)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(
      _gemma_tokens(step, config, variables, prompt, 12), want)
  assert kept.cache_size == 2
  check_rewrite(kept.mox(
      trained, prompt, jnp.zeros((3, 5), jnp.int32),
      config.init_cache(batch_size=3, dtype=jnp.float32, cache_length=12),
      jnp.zeros((3, 5, 12), bool)))
  assert kept.cache_size == 2  # the prompt's signature: no new trace
