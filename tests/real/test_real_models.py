"""Real third-party Linen model code: Google DeepMind's `gemma` (Gemma 3
Transformer) and `recurrentgemma` (Griffin), built from tiny configs written
out here, with random weights (nothing is downloaded).

Every check compares YAX with the model's own forward pass on the same
inputs: trace, replay (eagerly and under ``jax.jit``), queries counted from
the config, an activation swap against the model patched by hand, LoRA
(identity at init, ``merge`` reproduces the adapted model) and the summary's
parameter total; int8 ``quantize`` (against the model run on the dequantized
weights) and ``cast`` to bfloat16 (within bfloat16 error of the float model).

Install the libraries with ``bash tests/install_real_models.sh``. When one is
missing the test fails if ``CI`` is set (a silent skip in CI is a defect),
and is skipped with the reason otherwise.
"""

import importlib
import importlib.util
import os
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from helpers import (assert_trees_close, assert_views_agree, jit_call,
                     modules, random_variables, tensorflow_placeholder)

TOL = dict(rtol=1e-4, atol=1e-4)
INSTALL = 'bash tests/install_real_models.sh'


def _in_ci() -> bool:
  return os.environ.get('CI', '').strip().lower() not in ('', '0', 'false', 'no')


def _missing(what: str, err: BaseException):
  msg = f'{what} is not installed ({type(err).__name__}: {err}); run: {INSTALL}'
  if _in_ci():
    pytest.fail(msg, pytrace=False)
  pytest.skip(msg)


# ----------------------------------------------------------------- imports

def import_gemma():
  """``gemma.gm`` (its ``nn`` namespace loads lazily: touched here, under
  the placeholder, so that every module the model needs is imported)."""
  # Importing gemma replaces flax.linen.Module.param, for good, by a wrapper
  # that needs a `shape` argument (gemma/gm/utils/_dtype_params.py): Flax's
  # own is put back, so that every other test sees Flax as it is.
  param = nn.Module.param
  try:
    with tensorflow_placeholder():
      from gemma import gm
      from gemma.gm.nn import _modules  # the FeedForward's GELU lives here
      gm.nn.Transformer, gm.nn.config.TransformerConfig, gm.nn.AttentionType
  except ImportError as e:
    _missing('gemma 3.3.0 (with kauldron 1.4.2)', e)
  finally:
    nn.Module.param = param
  return gm, _modules


def import_recurrentgemma():
  """``recurrentgemma.jax``. Its ``array_typing.typed`` decorates the model
  methods with ``jaxtyping.jaxtyped(fn, typechecker=typeguard.typechecked)``
  at import time, written for typeguard 2 (recurrentgemma pins
  ``typeguard<3``). The environment has typeguard 4 (kauldron, hence gemma,
  needs ``typeguard>=4.4.1``), whose ``typechecked`` re-parses the source and
  fails on jaxtyping's shape strings (``SyntaxError: *b t f``). While
  recurrentgemma is imported, ``typeguard.typechecked`` is the identity: the
  methods keep jaxtyping's wrapper and lose only the runtime annotation
  checks, which compute nothing."""
  try:
    import typeguard
  except ImportError as e:
    _missing('typeguard', e)
  if 'recurrentgemma.jax' not in sys.modules:
    original = typeguard.typechecked
    typeguard.typechecked = lambda fn=None, **kwargs: fn
    try:
      importlib.import_module('recurrentgemma.jax')
    except ImportError as e:
      _missing('recurrentgemma 1.0.1', e)
    finally:
      typeguard.typechecked = original
  return sys.modules['recurrentgemma.jax']


# ----------------------------------------------------------------- helpers

def n_params(variables) -> int:
  return sum(int(np.size(x)) for x in jax.tree.leaves(variables['params']))


def check_replay(mox, expected, *args):
  """``eval_mox`` equals the model eagerly and under ``jax.jit``."""
  assert_trees_close(yax.eval_mox(mox, *args), expected, **TOL)
  got = jit_call(lambda *a: yax.eval_mox(mox, *a), *args)
  assert_trees_close(got, expected, **TOL)
  assert type(got) is type(expected)


def jit_eval(mox, *args):
  return jit_call(lambda *a: yax.eval_mox(mox, *a), *args)


def trained_adapters(res, seed):
  """``res.params`` with every adapter weight perturbed (``lora_b`` is zero at
  init); the other weights are unchanged."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda v, is_adapter: v + jnp.asarray(
          rng.normal(0.0, 0.3, np.shape(v)), v.dtype) if is_adapter else v,
      res.params, res.mask)


def adapter_paths(res):
  """The key paths of the adapter weights, from ``res.mask``."""
  flat, _ = jax.tree_util.tree_flatten_with_path(res.mask)
  return [tuple(str(getattr(k, 'key', k)) for k in path)
          for path, flag in flat if flag]


def check_lora(mox, variables, selection, expected_modules, call, args, *,
               rank=2):
  """LoRA on the modules ``selection`` picks: identity at init, and ``merge``
  of trained adapters gives the params for which the model itself computes
  what the adapted tree computes. ``call(variables, *args)`` runs the model."""
  res = yax.lora(mox, variables, selection, rank=rank, alpha=4.0,
                 key=jax.random.key(1))
  adapters = adapter_paths(res)
  assert len(adapters) == 2 * expected_modules
  assert all(p[-1].endswith(('lora_a', 'lora_b')) for p in adapters)
  # One path per scope holding adapters (two kernels may share a scope).
  assert len(res.paths) == len({p[:-1] for p in adapters})
  assert jax.tree.structure(res.mask) == jax.tree.structure(res.params)
  # B = 0 at init: the adapted tree computes what the model does.
  original = call(variables, *args)
  assert_trees_close(jit_eval(res.mox, res.params, *args), original, **TOL)
  # Trained adapters change the output; merged into the kernels, the model
  # itself computes the same.
  trained = trained_adapters(res, seed=2)
  adapted = jit_eval(res.mox, trained, *args)
  assert not np.allclose(jax.tree.leaves(adapted)[0],
                         jax.tree.leaves(original)[0], **TOL)
  merged = res.merge(trained)
  assert jax.tree.structure(merged) == jax.tree.structure(variables)
  assert_trees_close(call(merged, *args), adapted, **TOL)
  assert_trees_close(jit_eval(mox, merged, *args), adapted, **TOL)
  return res


def _check_close_to_bfloat16(got, expected, logits):
  """``got`` (a cast tree's output) has ``expected``'s structure and dtypes,
  its logits (``logits(output)``) differ from the float ones, and every leaf
  is within bfloat16 error of ``expected``'s."""
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    assert g.dtype == e.dtype and g.shape == e.shape
  assert not np.array_equal(logits(got), logits(expected))
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    e = np.asarray(e)
    np.testing.assert_allclose(
        g, e, rtol=0.1, atol=0.1 * float(np.abs(e).max(initial=0)))


# ======================================================= Gemma 3 (gemma 3.3.0)

B, L, CACHE = 2, 8, 12


@pytest.fixture(scope='module')
def gemma():
  gm, _modules = import_gemma()
  A = gm.nn.AttentionType
  # A Gemma-3-style config (as gm.nn.Gemma3_1B's, shrunk): GQA, QK norm,
  # post-attention/FFW norms, local sliding + global layers with their own
  # RoPE bases, transposed gating einsum.
  config = gm.nn.config.TransformerConfig(
      num_embed=64,
      embed_dim=32,
      hidden_dim=48,
      num_heads=4,
      head_dim=8,
      num_kv_heads=2,
      final_logit_softcap=None,
      use_post_attn_norm=True,
      use_post_ffw_norm=True,
      use_qk_norm=True,
      attention_types=(A.LOCAL_SLIDING, A.GLOBAL),
      query_pre_attn_norm=(gm.nn.config.QueryPreAttentionNormalisation
                           .BY_ONE_OVER_SQRT_HEAD_DIM),
      attn_logits_soft_cap=None,
      sliding_window_size=4,
      transpose_gating_einsum=True,
      local_base_frequency=10_000,
      global_base_frequency=1_000_000,
      vision_encoder=None,
  )
  model = gm.nn.Transformer(config=config, dtype=jnp.float32)
  tokens = (jnp.arange(B * L).reshape(B, L) * 7) % 63 + 1   # no padding (0)
  variables = random_variables(model, 0, tokens)
  # Prefill into a KV cache longer than the prompt, as gemma's sampler does:
  # the causal mask spans the cache.
  cache = config.init_cache(batch_size=B, dtype=jnp.float32,
                            cache_length=CACHE)
  mask = jnp.broadcast_to(
      jnp.arange(CACHE)[None, :] <= jnp.arange(L)[:, None], (B, L, CACHE))

  def call(v, tokens, cache, mask):
    return model.apply(v, tokens, cache=cache, attention_mask=mask)

  args = (tokens, cache, mask)
  mox = yax.make_mox(call)(variables, *args)
  return types.SimpleNamespace(
      gm=gm, modules=_modules, config=config, model=model, call=call,
      variables=variables, args=args, mox=mox,
      expected=call(variables, *args))


def test_gemma_trace_and_replay(gemma):
  mox = gemma.mox
  assert mox.is_ephemeral
  assert mox.out_tree == jax.tree.structure(gemma.expected)
  # The output holds the logits and the updated KV cache of every layer.
  assert set(gemma.expected.cache) == {
      f'layer_{i}' for i in range(gemma.config.num_layers)}
  check_replay(mox, gemma.expected, gemma.variables, *gemma.args)
  # Transformer.__getattr__ is a Python protocol method, never a module call.
  assert yax.query('//module_call[@method="__getattr__"]', mox) == []
  (top,) = yax.query('//module_call[@type="Transformer"]'
                     '[@method="__call__"]', mox)
  assert top.path == ()
  assert assert_views_agree(mox) == len(modules(mox))


def test_gemma_queries_count_from_config(gemma):
  config, mox = gemma.config, gemma.mox
  layers = config.num_layers
  assert len(yax.query('//module_call[@type="Block"]', mox)) == layers
  attention = yax.query('//module_call[@type="Attention"]', mox)
  assert len(attention) == layers
  assert [a.path for a in attention] == [
      (f'layer_{i}', 'attn') for i in range(layers)]
  assert len(yax.query('//module_call[@type="FeedForward"]', mox)) == layers
  # GQA (num_kv_heads != num_heads): q_einsum, kv_einsum, attn_vec_einsum
  # per attention; gating and linear per feed-forward.
  assert config.num_kv_heads != config.num_heads
  assert len(yax.query('//module_call[@type="Attention"]'
                       '/module_call[@type="Einsum"]', mox)) == 3 * layers
  assert len(yax.query('//module_call[@type="FeedForward"]'
                       '/module_call[@type="Einsum"]', mox)) == 2 * layers
  # RMSNorms: 4 per block (pre/post attention and FFW), 2 QK norms per
  # attention, the final norm.
  assert len(yax.query('//module_call[@type="RMSNorm"]', mox)) == \
      4 * layers + 2 * layers + 1


def test_gemma_gelu_swap_matches_the_patched_model(gemma, monkeypatch):
  mox = gemma.mox
  # FeedForward computes nn.gelu(gate) (tanh approximation); JAX inlines it,
  # so it is found by data flow, one per layer.
  matches = yax.match(nn.gelu, mox)
  assert len(matches) == gemma.config.num_layers
  assert all(m.path[-1] == 'mlp' for m in matches)
  new = yax.sub(matches, yax.trace_like(jax.nn.silu), mox)
  got = jit_eval(new, gemma.variables, *gemma.args)
  # The same model with its GELU replaced by hand. Transformer.__call__ runs
  # under nn.jit, which caches its trace by the module's fields: a model
  # equal to `gemma.model` would replay the trace made with GELU, so the
  # patched model sets `return_last_only=False` (what None means).
  monkeypatch.setattr(gemma.modules.nn, 'gelu', jax.nn.silu)
  patched = gemma.gm.nn.Transformer(config=gemma.config, dtype=jnp.float32,
                                    return_last_only=False)
  tokens, cache, mask = gemma.args
  want = patched.apply(gemma.variables, tokens, cache=cache,
                       attention_mask=mask)
  assert not np.allclose(want.logits, gemma.expected.logits, **TOL)
  assert_trees_close(got, want, **TOL)


def test_gemma_lora_identity_and_merge(gemma):
  layers = gemma.config.num_layers
  # Every Einsum: attention q/kv/out projections (BTD,NDH->BTNH;
  # BSD,CKDH->CBSKH; BTNH,NHD->BTD) and the FFW gating/linear kernels.
  res = check_lora(gemma.mox, gemma.variables, '//module_call[@type="Einsum"]',
                   5 * layers, gemma.call, gemma.args)
  attn = res.params['params']['layer_0']['attn']
  # A: [*contracted kernel axes, rank]; B: [rank, *other kernel axes].
  assert attn['q_einsum']['lora_a'].shape == (32, 2)          # NDH: D
  assert attn['q_einsum']['lora_b'].shape == (2, 4, 8)        # N, H
  assert attn['attn_vec_einsum']['lora_a'].shape == (4, 8, 2)  # NHD: N, H
  assert attn['attn_vec_einsum']['lora_b'].shape == (2, 32)    # D
  # The FFW's two Einsums share the scope 'mlp' (nn.share_scope): each
  # adapter pair is named after its kernel.
  mlp = res.params['params']['layer_0']['mlp']
  hidden = gemma.config.hidden_dim
  assert set(mlp) == {'gating_einsum', 'linear', 'gating_einsum_lora_a',
                      'gating_einsum_lora_b', 'linear_lora_a', 'linear_lora_b'}
  assert mlp['linear_lora_a'].shape == (hidden, 2)
  assert mlp['linear_lora_b'].shape == (2, 32)


def _int8_reference(w, contracted):
  """``w`` rounded to int8 with one absmax scale per output channel (over
  the ``contracted`` axes), written here independently of yax."""
  w = np.asarray(w, np.float32)
  absmax = np.abs(w).max(axis=contracted, keepdims=True)
  scale = np.where(absmax > 0, absmax / 127.0, 1.0)
  return np.clip(np.round(w / scale), -127, 127) * scale


def test_gemma_quantize_matches_the_dequantized_model(gemma):
  # gemma's Transformer.__call__ runs under nn.jit: every Einsum sits in a
  # lifted body.
  q = yax.quantize(gemma.mox, gemma.variables,
                   '//module_call[@type="Einsum"]', weight='int8')
  layers = gemma.config.num_layers
  assert len(q.paths) == 4 * layers  # q, kv, out; the FFW's shared scope
  # The reference: every Einsum kernel rounded here, the model run by
  # gemma itself. Contracted axes: q NDH: D; kv CKDH: D; out NHD: N, H;
  # the FFW's (transposed) gating 2FD: D and linear FD: F.
  contracted = {'q_einsum': (1,), 'kv_einsum': (2,), 'attn_vec_einsum': (0, 1),
                'gating_einsum': (2,), 'linear': (0,)}
  reference = jax.tree.map(lambda x: x, gemma.variables)
  for i in range(layers):
    layer = reference['params'][f'layer_{i}']
    for name in ('q_einsum', 'kv_einsum', 'attn_vec_einsum'):
      layer['attn'][name]['w'] = jnp.asarray(_int8_reference(
          layer['attn'][name]['w'], contracted[name]))
    for name in ('gating_einsum', 'linear'):
      layer['mlp'][name] = jnp.asarray(_int8_reference(
          layer['mlp'][name], contracted[name]))
    stored = q.params['params'][f'layer_{i}']
    assert stored['attn']['q_einsum']['w'].dtype == jnp.int8
    assert stored['mlp']['linear'].dtype == jnp.int8
  want = gemma.call(reference, *gemma.args)
  got = yax.eval_mox(q.mox, q.params, *gemma.args)
  assert_trees_close(got, want, **TOL)
  assert_trees_close(q.dequantize(q.params), reference, **TOL)
  before, after = q.nbytes
  assert after < before


def test_gemma_cast_einsums_to_bfloat16(gemma):
  """Every Einsum (under Transformer.__call__'s nn.jit) computes in
  bfloat16: the output keeps its dtypes and stays within bfloat16 error of
  gemma's float32 forward; the RMSNorms, softmax and GELU stay float32."""
  selection = '//module_call[@type="Einsum"]'
  low = yax.cast(gemma.mox, selection, 'bfloat16')
  yax.check_mox(low)
  got = jit_eval(low, gemma.variables, *gemma.args)
  _check_close_to_bfloat16(got, gemma.expected, lambda out: out.logits)
  nodes = yax.query(selection, low)
  assert len(nodes) == 5 * gemma.config.num_layers
  for node in nodes:
    assert node.params['compute_dtype'] == 'bfloat16'
  for node in yax.query('//module_call[@type="RMSNorm"]', low):
    assert node.params.get('compute_dtype', 'float32') == 'float32'


def test_gemma_summary_counts_every_parameter(gemma):
  rows = yax.summary(gemma.mox)
  top = rows[0]
  assert top.module == 'Transformer' and top.path == ''
  assert top.params == n_params(gemma.variables)


# ===================================================== Griffin (recurrentgemma)

@pytest.fixture(scope='module')
def griffin():
  rg = import_recurrentgemma()
  block = rg.TemporalBlockType
  config = rg.GriffinConfig(
      vocab_size=64,
      width=32,
      mlp_expanded_width=48,
      num_heads=4,
      block_types=(block.RECURRENT, block.ATTENTION),
      embeddings_scale_by_sqrt_dim=True,
      attention_window_size=6,
      logits_soft_cap=30.0,
  )
  # gradient_checkpointing (the default) wraps every residual block in
  # nn.remat; the RG-LRU runs a lax.scan; the call returns the cache
  # (RG-LRU state, conv state, attention keys/values).
  model = rg.Griffin(config)
  tokens = (jnp.arange(B * L).reshape(B, L) * 5) % 63 + 1
  positions = jnp.broadcast_to(jnp.arange(L), (B, L))
  variables = random_variables(model, 3, tokens, positions)
  mox = yax.make_mox(model.apply)(variables, tokens, positions)
  return types.SimpleNamespace(
      rg=rg, config=config, model=model, variables=variables,
      args=(tokens, positions), mox=mox,
      # The model's own forward, compiled (eagerly, its scan runs op by op).
      expected=jax.jit(lambda v, t, p: model.apply(v, t, p))(
          variables, tokens, positions))


def test_griffin_trace_and_replay(griffin):
  logits, cache = griffin.expected
  assert logits.shape == (B, L, griffin.config.vocab_size)
  assert set(cache) == {'blocks.0', 'blocks.1'}
  check_replay(griffin.mox, griffin.expected, griffin.variables, *griffin.args)
  assert assert_views_agree(griffin.mox) == len(modules(griffin.mox))


def test_griffin_decode_step_with_cache(griffin):
  """One decoding step from the prefill cache: the cache is an input and an
  output."""
  _, cache = griffin.expected
  token = jnp.array([[7], [11]])
  position = jnp.full((B, 1), L)
  call = lambda v, t, p, c: griffin.model.apply(v, t, p, c)
  args = (griffin.variables, token, position, cache)
  mox = yax.make_mox(call)(*args)
  check_replay(mox, jax.jit(call)(*args), *args)


def test_griffin_queries_count_from_config(griffin):
  config, mox = griffin.config, griffin.mox
  types_ = config.block_types
  n_rec = sum(t == griffin.rg.TemporalBlockType.RECURRENT for t in types_)
  n_att = sum(t == griffin.rg.TemporalBlockType.ATTENTION for t in types_)
  assert len(yax.query('//module_call[@type="ResidualBlock"]', mox)) == \
      config.num_layers
  assert len(yax.query('//module_call[@type="LocalAttentionBlock"]',
                       mox)) == n_att
  assert len(yax.query('//module_call[@type="RecurrentBlock"]', mox)) == n_rec
  assert len(yax.query('//module_call[@type="RGLRU"][@method="__call__"]',
                       mox)) == n_rec
  assert len(yax.query('//module_call[@type="MLPBlock"]', mox)) == \
      config.num_layers
  # Dense: q/k/v/final per attention block; linear_x/y/out per recurrent
  # block; ffw_down per MLP.
  assert len(yax.query('//module_call[@type="Dense"]', mox)) == \
      4 * n_att + 3 * n_rec + config.num_layers


def test_griffin_mlp_gelu_swap_matches_the_patched_model(griffin,
                                                         monkeypatch):
  mox, rg = griffin.mox, griffin.rg
  n_rec = sum(t == rg.TemporalBlockType.RECURRENT
              for t in griffin.config.block_types)
  # GELU in every MLP block (nn.gelu) and every recurrent block's gate branch
  # (jax.nn.gelu).
  assert len(yax.match(nn.gelu, mox)) == griffin.config.num_layers + n_rec
  matches = yax.match(nn.gelu, mox, within='//module_call[@type="MLPBlock"]')
  assert len(matches) == griffin.config.num_layers
  new = yax.sub(matches, yax.trace_like(jax.nn.silu), mox)
  got = jit_eval(new, griffin.variables, *griffin.args)
  # By hand: MLPBlock calls `nn.gelu` of flax.linen (the recurrent block
  # calls jax.nn.gelu, left alone). A fresh function for jax.jit: a jitted
  # model.apply would share its trace cache with other jitted model.apply.
  monkeypatch.setattr(rg.modules.nn, 'gelu', jax.nn.silu)
  want = jax.jit(lambda v, t, p: griffin.model.apply(v, t, p))(
      griffin.variables, *griffin.args)
  assert not np.allclose(want[0], griffin.expected[0], **TOL)
  assert_trees_close(got, want, **TOL)


def test_griffin_lora_identity_and_merge(griffin):
  config = griffin.config
  n_rec = sum(t == griffin.rg.TemporalBlockType.RECURRENT
              for t in config.block_types)
  n_att = config.num_layers - n_rec
  # Every Dense, inside the nn.remat'ed residual blocks.
  res = check_lora(griffin.mox, griffin.variables, '//module_call[@type="Dense"]',
                   4 * n_att + 3 * n_rec + config.num_layers,
                   griffin.model.apply, griffin.args)
  q = res.params['params']['blocks.1']['attention_block']['proj_q']
  assert q['lora_a'].shape == (32, 2) and q['lora_b'].shape == (2, 32)


def test_griffin_summary_counts_every_parameter(griffin):
  top = yax.summary(griffin.mox)[0]
  assert top.module == 'Griffin' and top.path == ''
  assert top.params == n_params(griffin.variables)


def _griffin_dense(griffin):
  config = griffin.config
  n_rec = sum(t == griffin.rg.TemporalBlockType.RECURRENT
              for t in config.block_types)
  n_att = config.num_layers - n_rec
  return ('//module_call[@type="Dense"]',
          4 * n_att + 3 * n_rec + config.num_layers)


def test_griffin_quantize_matches_the_dequantized_model(griffin):
  """int8 kernels on every Dense, inside the nn.remat'ed residual blocks:
  the quantized tree computes what recurrentgemma's Griffin computes with
  the dequantized weights."""
  selection, n_modules = _griffin_dense(griffin)
  q = yax.quantize(griffin.mox, griffin.variables, selection, weight='int8')
  yax.check_mox(q.mox)
  assert len(q.paths) == n_modules
  back = q.dequantize(q.params)
  assert jax.tree.structure(back) == jax.tree.structure(griffin.variables)
  # A fresh function for jax.jit (see the GELU swap above).
  want = jax.jit(lambda v, t, p: griffin.model.apply(v, t, p))(
      back, *griffin.args)
  # Rounding the kernels changes the output beyond the tolerance.
  assert not np.allclose(want[0], griffin.expected[0], **TOL)
  assert_trees_close(jit_eval(q.mox, q.params, *griffin.args), want, **TOL)
  for path in (('blocks.1', 'attention_block', 'proj_q'),
               ('blocks.0', 'recurrent_block', 'linear_x'),
               ('blocks.0', 'mlp_block', 'ffw_down')):
    node = q.params['params']
    for k in path:
      node = node[k]
    original = griffin.variables['params']
    for k in path:
      original = original[k]
    assert node['kernel'].dtype == jnp.int8
    assert node['kernel'].shape == original['kernel'].shape
    assert node['kernel_scale'].shape == (1, original['kernel'].shape[1])
    # Biases (where there are: not on the attention's q) stay float.
    assert set(node) == {'kernel_scale', *original}
    if 'bias' in node:
      assert node['bias'].dtype == jnp.float32
    # Dequantized, each kernel is within one int8 step of the float one.
    dequantized = back['params']
    for k in path:
      dequantized = dequantized[k]
    kernel = np.asarray(original['kernel'])
    np.testing.assert_allclose(dequantized['kernel'], kernel,
                               atol=float(np.abs(kernel).max()) / 127)
    assert not np.array_equal(dequantized['kernel'], kernel)
  for node in yax.query(selection, q.mox):
    assert node.params['quant'] == 'int8'
  before, after = q.nbytes
  assert after < before


def test_griffin_cast_dense_to_bfloat16(griffin):
  """Every Dense computes in bfloat16 (inside nn.remat); the RG-LRU scan,
  the norms and the rest stay float32: the output keeps its dtypes and stays
  within bfloat16 error of Griffin's float32 forward."""
  selection, n_modules = _griffin_dense(griffin)
  low = yax.cast(griffin.mox, selection, 'bfloat16')
  yax.check_mox(low)
  got = jit_eval(low, griffin.variables, *griffin.args)
  _check_close_to_bfloat16(got, griffin.expected, lambda out: out[0])
  nodes = yax.query(selection, low)
  assert len(nodes) == n_modules
  for node in nodes:
    assert node.params['compute_dtype'] == 'bfloat16'
  assert all(x.dtype == jnp.float32
             for x in jax.tree.leaves(griffin.variables['params']))
