"""Real third-party Linen model code: Google DeepMind's ``gemma`` 4.0.1
(``gemma.gm.nn.gemma4``), built from tiny configs written out here, with
random weights (nothing is downloaded; ``model.init`` takes about a minute,
so the variables are random values of ``jax.eval_shape``'s shapes).

What is checked, each against the model's own forward pass on the same
inputs: Gemma 4 text (per-layer inputs, KV-cache sharing between layers,
global layers with their own key size) and its MoE variant (``ragged_dot``
experts next to a dense MLP, keys equal to values on global layers): trace,
replay eagerly and under ``jax.jit``, LoRA on every ``Einsum`` (identity at
init, ``merge`` reproduces the adapted model), int8 ``quantize`` and
``cast`` to bfloat16; the ``nn.scan`` vision encoder (``ClippedEinsum``):
trace, replay, LoRA; the Conformer audio encoder (subsampling and Conformer
layers) and the audio tokenizer in front of it (mel filterbank computed with
NumPy in the module).

gemma 4.0.1 needs Python >= 3.12: ``bash tests/install_real_models.sh``
installs it there (CI: the Python 3.12 venv). Where it is not installed the
file is skipped, unless ``YAX_REQUIRE_GEMMA4=1`` (set by CI where it is
installed: a silent skip there is a defect), which makes it fail.
"""

import importlib
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from helpers import (assert_trees_close, assert_views_agree, import_required,
                     jit_call, modules, random_variables,
                     tensorflow_placeholder, trained_adapters)

TOL = dict(rtol=1e-4, atol=1e-4)
INSTALL = ('python3.12 -m venv .venv && .venv/bin/pip install -e ".[test]" '
           '&& bash tests/install_real_models.sh .venv/bin/python')


def import_gemma4():
  """The gemma 4 modules (``_config``, ``_modules``, ``_transformer``,
  ``vision._encoder``, ``audio._modules``, ``audio._model``), imported under
  the TensorFlow placeholder (``kauldron.typing`` names ``tf.Tensor``)."""
  names = ('_config', '_modules', '_transformer', 'vision._encoder',
           'audio._modules', 'audio._model')

  def load():
    # Importing gemma replaces flax.linen.Module.param, for good, by a
    # wrapper that needs a `shape` argument (gemma/gm/utils/_dtype_params.py):
    # Flax's own is put back, so that every other test sees Flax as it is.
    param = nn.Module.param
    try:
      with tensorflow_placeholder():
        return {n: importlib.import_module(f'gemma.gm.nn.gemma4.{n}')
                for n in names}
    finally:
      nn.Module.param = param

  found = import_required('gemma', 'gemma 4.0.1 (Python >= 3.12)',
                          'YAX_REQUIRE_GEMMA4', INSTALL, load)
  return types.SimpleNamespace(
      config=found['_config'], modules=found['_modules'],
      transformer=found['_transformer'], vision=found['vision._encoder'],
      audio=found['audio._modules'], audio_model=found['audio._model'])


g4 = import_gemma4()


# ----------------------------------------------------------------- helpers

def n_params(variables) -> int:
  return sum(int(np.size(x)) for x in jax.tree.leaves(variables['params']))


def jit_eval(mox, *args):
  return jit_call(lambda *a: yax.eval_mox(mox, *a), *args)


def check_replay(mox, expected, *args):
  """``eval_mox`` equals the model eagerly and under ``jax.jit``."""
  assert_trees_close(yax.eval_mox(mox, *args), expected, **TOL)
  assert_trees_close(jit_eval(mox, *args), expected, **TOL)


def top_row(mox):
  """The summary row of the model's own ``__call__`` (Python helper methods
  that ``setup`` calls, such as ``Transformer._get_hidden_dim``, get rows of
  their own next to it)."""
  (row,) = [r for r in yax.summary(mox) if r.depth == 0
            and r.method == '__call__']
  return row


def first_leaf(tree):
  return np.asarray(jax.tree.leaves(tree)[0])


def check_lora(mox, variables, selection, call, args, *, rank=2):
  """LoRA on ``selection``: identity at init; trained adapters change the
  output, and ``merge`` gives params for which the model itself computes
  what the adapted tree computes. Returns the number of adapted calls."""
  res = yax.lora(mox, variables, selection, rank=rank, alpha=4.0,
                 key=jax.random.key(1))
  assert res.paths
  expected = call(variables, *args)
  assert_trees_close(jit_eval(res.mox, res.params, *args), expected, **TOL)
  trained = trained_adapters(res.params, res.mask)
  adapted = jit_eval(res.mox, trained, *args)
  assert not np.allclose(first_leaf(adapted), first_leaf(expected), **TOL)
  merged = res.merge(trained)
  assert jax.tree.structure(merged) == jax.tree.structure(variables)
  assert_trees_close(call(merged, *args), adapted, **TOL)
  return len(res.paths)


def check_quantize(mox, variables, selection, call, args):
  """int8 weights: the quantized tree computes what the model computes on
  the dequantized kernels, and each dequantized kernel is within half a
  quantization step of the original (one absmax scale per channel)."""
  q = yax.quantize(mox, variables, selection, weight='int8')
  assert q.paths
  back = q.dequantize(q.params)
  assert jax.tree.structure(back) == jax.tree.structure(variables)
  assert_trees_close(jit_eval(q.mox, q.params, *args),
                     call(back, *args), **TOL)
  for w, d in zip(jax.tree.leaves(variables), jax.tree.leaves(back)):
    step = np.abs(np.asarray(w)).max() / 127.0
    assert np.abs(np.asarray(w) - np.asarray(d)).max() <= step
  before, after = q.nbytes
  assert after < before
  return q


def check_cast(mox, variables, selection, args, expected):
  """The selected calls compute in bfloat16: outputs keep the traced
  dtypes, differ from the float32 model (bfloat16 rounding), and stay
  within bfloat16 error of it."""
  low = yax.cast(mox, selection, 'bfloat16')
  got = jit_eval(low, variables, *args)
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    assert g.dtype == w.dtype
  g, w = first_leaf(got), first_leaf(expected)
  assert not np.array_equal(g, w)
  np.testing.assert_allclose(g, w, rtol=0.1, atol=0.1 * np.abs(w).max())


# ========================================================== Gemma 4 (text)

B, L = 2, 8


def text_config(*, moe: bool):
  A = g4.modules.AttentionType
  common = dict(
      num_embed=64, embed_dim=32, num_heads=4, head_dim=8, num_kv_heads=1,
      final_logit_softcap=30.0, use_post_attn_norm=True,
      use_post_ffw_norm=True, qk_norm_with_scale=True,
      # KV sharing: a shared global layer reads the cache of the last
      # unshared one, a shared local layer that of the one before.
      attention_types=(A.LOCAL_SLIDING, A.GLOBAL) * 2,
      sliding_window_size=4, global_key_size=16, global_rope_proportion=0.25,
      local_rope_proportion=1.0, local_base_frequency=10_000,
      global_base_frequency=1_000_000)
  if moe:
    # As Gemma4_26B_A4B, shrunk: a ragged_dot MoE next to a dense MLP in
    # every layer; global layers with their own KV heads, keys = values.
    return g4.config.TransformerConfig(
        hidden_dim=24, num_global_kv_heads=2, k_eq_v_global=True,
        enable_moe=True, num_experts=4, expert_dim=16, top_k_experts=2,
        moe_dense_hidden_dim=24, **common)
  # As Gemma4_E2B, shrunk: per-layer inputs; the last half of the layers
  # read the KV cache of earlier ones (and get a wider FFW).
  return g4.config.TransformerConfig(
      hidden_dim=48, per_layer_input_dim=8,
      kv_cache_sharing_config=g4.config.KVCacheSharingConfig(
          frac_shared_layers=0.5, share_global=True, share_local=True),
      override_kv_shared_ffw_hidden=96, **common)


def build_text(moe: bool):
  config = text_config(moe=moe)
  model = g4.transformer.Transformer(config=config, dtype=jnp.float32)
  tokens = (jnp.arange(B * L).reshape(B, L) * 7) % 63 + 1   # no padding (0)
  variables = random_variables(model, 0, tokens)
  call = lambda v, t: model.apply(v, t)
  mox = yax.make_mox(call)(variables, tokens)
  return types.SimpleNamespace(
      config=config, model=model, call=call, variables=variables,
      args=(tokens,), mox=mox, expected=jax.jit(call)(variables, tokens))


@pytest.fixture(scope='module')
def text():
  return build_text(moe=False)


@pytest.fixture(scope='module')
def moe():
  return build_text(moe=True)


def test_text_trace_and_replay(text):
  config, mox = text.config, text.mox
  assert text.expected.logits.shape == (B, L, config.num_embed)
  check_replay(mox, text.expected, text.variables, *text.args)
  blocks = yax.query('//module_call[@type="Block"][@method="__call__"]', mox)
  assert [b.path for b in blocks] == [
      (f'layer_{i}',) for i in range(config.num_layers)]
  # Per-layer inputs: the embedder computes them (its table and
  # projection), each block gates its slice in.
  assert len(yax.query('//module_call[@type="Embedder"]'
                       '[@method="encode_per_layer_input"]', mox)) == 1
  assert len(yax.query('//module_call[@type="Block"]'
                       '/module_call[@type="Einsum"]'
                       '[@name="per_layer_input_gate"]', mox)) == \
      config.num_layers
  # KV sharing: the last half of the layers attend to the keys/values of
  # earlier layers (their own kv_einsum still runs; its output is unused).
  # Replayed, the shared layer's own kv kernel changes nothing, while the
  # kernel of the layer it shares from does.
  sharing = g4.config.create_kv_cache_sharing_patterns(
      config.kv_cache_sharing_config, config.num_layers,
      config.attention_types)
  assert sharing == [0, 1, 0, 1]

  def with_kv_kernel(layer):
    """The variables with that layer's kv kernel perturbed (keys and
    values are RMS-normalised: a perturbation, not a scale)."""
    v = jax.tree.map(lambda a: a, text.variables)
    kv = v['params'][f'layer_{layer}']['attn']['kv_einsum']
    rng = np.random.default_rng(layer)
    kv['w'] = kv['w'] + jnp.asarray(rng.normal(0, 0.5, kv['w'].shape),
                                    kv['w'].dtype)
    return v

  base = text.expected.logits
  same = jit_eval(mox, with_kv_kernel(2), *text.args).logits
  np.testing.assert_allclose(same, base, **TOL)
  other = jit_eval(mox, with_kv_kernel(0), *text.args).logits
  assert not np.allclose(other, base, **TOL)
  np.testing.assert_allclose(
      other, text.call(with_kv_kernel(0), *text.args).logits, **TOL)
  assert top_row(mox).path == ''
  assert assert_views_agree(mox) == len(modules(mox))


@pytest.mark.parametrize('model', ['text', 'moe'])
def test_summary_counts_every_parameter_once(model, request):
  built = request.getfixturevalue(model)
  assert top_row(built.mox).params == n_params(built.variables)


# Every Einsum but the per-layer-input projection, whose kernel the
# Embedder scales before the contraction (refused: see below).
ADAPTED = ('//module_call[@type="Einsum"]'
           '[not(@name="per_layer_model_projection")]')
def test_text_lora_and_cast(text):
  assert check_lora(text.mox, text.variables, ADAPTED, text.call,
                    text.args) >= 4 * text.config.num_layers
  check_cast(text.mox, text.variables, '//module_call[@type="Einsum"]',
             text.args, text.expected)
  # A kernel multiplied before its contraction cannot carry an adapter
  # that merge could fold back: refused, naming the call.
  with pytest.raises(yax.SubstitutionError, match="Einsum at path "
                     "'embedder/per_layer_model_projection'"):
    yax.lora(text.mox, text.variables, '//module_call[@type="Einsum"]',
             rank=2)


def test_text_lean_norm_reads_gemma_rmsnorm(text):
  # Gemma's RMSNorm is its own Linen class (mean of squares, rsqrt, a scale
  # expanded to the input's rank, or none for the values): before,
  # lean_norm refused it by class; now it reads it from its body.
  norms = yax.query('//module_call[@type="RMSNorm"]', text.mox)
  new = yax.lean_norm(text.mox)
  yax.check_mox(new)
  lean = yax.query('//module_call[@lean="norm"]', new)
  assert norms and [n.path for n in lean] == [n.path for n in norms]
  # Outputs only (a gradient of the whole model would compile for a minute
  # on two cores): gradients of this norm's form (a scale expanded to the
  # input's rank) are checked in tests/tools/test_lean_norm.py.
  assert_trees_close(jit_eval(new, text.variables, *text.args),
                     text.expected, **TOL)


def test_text_quantize(text):
  check_quantize(text.mox, text.variables, ADAPTED, text.call, text.args)


def test_moe_trace_replay_and_ragged_dot(moe):
  check_replay(moe.mox, moe.expected, moe.variables, *moe.args)
  layers = moe.config.num_layers
  experts = yax.query('//module_call[@type="MoERagged"][@method="__call__"]',
                      moe.mox)
  assert [m.path for m in experts] == [
      (f'layer_{i}', 'mlp') for i in range(layers)]
  # Two ragged_dot contractions per MoE (gating, linear); JAX binds
  # jax.lax.ragged_dot as ragged_dot_general.
  assert yax.query('count(//ragged_dot_general | //ragged_dot)',
                   moe.mox) == 2 * layers
  assert assert_views_agree(moe.mox) == len(modules(moe.mox))


def test_moe_lora_of_the_einsums(moe):
  # The attention, router and dense-MLP Einsums (the experts' ragged_dot
  # weights are no Einsum module). Cast is checked on the text model.
  check_lora(moe.mox, moe.variables, ADAPTED, moe.call, moe.args)


def test_moe_quantize(moe):
  check_quantize(moe.mox, moe.variables, ADAPTED, moe.call, moe.args)
  # The experts are variables of _Weight submodules that return them; the
  # MoERagged call contracts them. Refused with that reason (before: "no
  # parameter of 2 or more axes that reaches a dot_general").
  with pytest.raises(yax.SubstitutionError) as refused:
    yax.quantize(moe.mox, moe.variables,
                 '//module_call[@type="MoERagged"][@path="layer_0/mlp"]')
  assert ('the kernels it contracts (params/gating_einsum/w, '
          'params/linear/w) are variables of its submodules'
          in str(refused.value)), str(refused.value)


# ======================================================== vision encoder

@pytest.fixture(scope='module', params=['E2B', '31B'])
def vision(request):
  # As the encoders of Gemma4_E2B (clipped linears) and Gemma4_31B (plain
  # Einsums, standardized embeddings), shrunk: an nn.scan over the layers,
  # 2x2 pooling of a 4x4 patch grid into 4 soft tokens per image.
  clipped = request.param == 'E2B'
  encoder = g4.vision.VisionEncoder(
      d_model=32, num_layers=2, num_heads=4, ffw_hidden=64, patch_size=2,
      output_length=4, pos_emb_shape_yx=(8, 2), pooling_kernel_size=2,
      use_clipped_linears=clipped, standardize_embeddings=not clipped)
  rng = np.random.default_rng(5)
  images = [jnp.asarray(rng.uniform(0, 1, (8, 8, 3)), jnp.float32),
            jnp.asarray(rng.uniform(0, 1, (8, 6, 3)), jnp.float32)]
  patches, positions, _ = g4.vision.patchify_and_pad(
      images, patch_size=2, max_patches=16, pooling_kernel_size=2)
  variables = random_variables(encoder, 6, patches, positions)
  call = lambda v, p, xy: encoder.apply(v, p, xy)
  mox = yax.make_mox(call)(variables, patches, positions)
  return types.SimpleNamespace(
      clipped=clipped, encoder=encoder, call=call, variables=variables,
      args=(patches, positions), mox=mox,
      expected=jax.jit(call)(variables, patches, positions))


def test_vision_encoder_trace_and_replay(vision):
  check_replay(vision.mox, vision.expected, vision.variables, *vision.args)
  # The layers run under nn.scan: one scanned body, its calls inside.
  assert yax.query('//scan', vision.mox)
  assert assert_views_agree(vision.mox) == len(modules(vision.mox))


def test_vision_encoder_summary_counts_every_parameter_once(vision):
  assert top_row(vision.mox).params == n_params(vision.variables)


def test_vision_encoder_lora(vision):
  if vision.clipped:
    # ClippedEinsum clips its input (and output) around the contraction:
    # the adapter sits at the contraction, in the module's body, and
    # reads the clipped input, as the kernel does.
    check_lora(vision.mox, vision.variables,
               '//module_call[@type="ClippedEinsum"]', vision.call,
               vision.args)
    return
  # The Einsums of the scanned layers: stacked kernels [layers, ...].
  check_lora(vision.mox, vision.variables, '//module_call[@type="Einsum"]',
             vision.call, vision.args)


# ========================================================= audio encoder

AUDIO = g4.audio.ConformerConfig(
    num_layers=2, model_dims=32, lm_model_dims=24, atten_num_heads=4,
    atten_left_context=5, conv_kernel_size=3)


class ConformerEncoder(nn.Module):
  """The audio tokenizer behind its mel filterbank, as it calls them:
  subsampling, then the Conformer layers."""
  config: object

  @nn.compact
  def __call__(self, x, mask):
    x, mask = g4.audio.SubSamplingBlock(
        output_proj_dim=self.config.model_dims, name='feature')(x, mask)
    valid = g4.audio_model.AudioTokenizer._compute_causal_valid_mask(
        self.config)
    for i in range(self.config.num_layers):
      x = g4.audio.ConformerLayer(config=self.config, layer_idx=i,
                                  name=f'layer_{i}')(x, mask, valid)
    return x, mask


def test_conformer_audio_encoder_trace_replay_lora():
  encoder = ConformerEncoder(AUDIO)
  rng = np.random.default_rng(7)
  feats = jnp.asarray(rng.normal(size=(2, 24, 128)), jnp.float32)
  mask = jnp.arange(24)[None, :] < jnp.array([[24], [17]])
  variables = random_variables(encoder, 8, feats, mask)
  call = lambda v, x, m: encoder.apply(v, x, m)
  mox = yax.make_mox(call)(variables, feats, mask)
  expected = jax.jit(call)(variables, feats, mask)
  check_replay(mox, expected, variables, feats, mask)
  assert len(yax.query('//module_call[@type="ConformerLayer"]', mox)) == 2
  assert assert_views_agree(mox) == len(modules(mox))
  assert top_row(mox).params == n_params(variables)
  # The subsampling's output projection (nn.DenseGeneral); the Conformer's
  # ClippedEinsums, adapted in place, are checked on the vision encoder.
  check_lora(mox, variables, '//module_call[@type="DenseGeneral"]'
             '[@name="input_proj"]', call, (feats, mask))


def test_audio_tokenizer_with_its_numpy_mel_filterbank():
  """The mel filterbank is NumPy (float64) computed in ``setup``: it stays
  NumPy inside module calls, as under plain Flax."""
  tokenizer = g4.audio_model.AudioTokenizer(config=AUDIO)
  rng = np.random.default_rng(9)
  audio = jnp.asarray(rng.normal(0, 0.1, (2, 1600)), jnp.float32)
  lengths = jnp.array([1600, 1200])
  variables = random_variables(tokenizer, 10, audio, lengths)
  call = lambda v, a, n: tokenizer.apply(v, a, n)
  mox = yax.make_mox(call)(variables, audio, lengths)
  check_replay(mox, jax.jit(call)(variables, audio, lengths), variables,
               audio, lengths)
