"""Equinox models: ``eqx.nn``'s own layers and eqx-zoo's Qwen 3 MoE causal LM
(a tiny config, random weights, nothing downloaded).

Each check compares YAX with the model's own forward pass (or JAX run on it
by hand) on the same inputs: module calls at pytree paths, exact replay,
Equinox transforms (``filter_jit``, ``filter_vmap``, ``filter_grad``,
``filter_checkpoint``, a ``lax.scan`` over a stack of layers), ``eqx.nn.State``
returned by ``eval_mox``, and the rewrites that work on Equinox today
(``lora`` with ``merge`` back to the model's own classes, int8 ``quantize``
against the model run on its dequantized kernels, ``cast``, ``remat``,
``fewbit``, the summary's parameter totals).

Install eqx-zoo with ``bash tests/install_real_models.sh`` (Python >= 3.12).
When it is missing the eqx-zoo tests fail if ``CI`` is set, and are skipped
with the reason otherwise.
"""

import functools
import importlib
import os
import re
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax

INSTALL = 'bash tests/install_real_models.sh'


def _in_ci() -> bool:
  return os.environ.get('CI', '').strip().lower() not in ('', '0', 'false', 'no')


def _calls(mox):
  return [(c.type_name, '/'.join(c.path))
          for c in yax.query('//module_call', mox) if c.type_name]


def _trace(fn, *args):
  mox = yax.make_mox(fn)(*args)
  yax.check_mox(mox)
  return mox


# ---------------------------------------------------------------- eqx.nn

def _mlp():
  return eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))


def test_every_module_call_at_its_pytree_path():
  model, x = _mlp(), jnp.arange(3.0)
  mox = _trace(lambda m, x: m(x), model, x)
  assert _calls(mox) == [('MLP', ''), ('Linear', 'layers/0'),
                         ('Linear', 'layers/1'), ('Linear', 'layers/2')]
  linear = yax.query('//module_call[@path="layers/1"]', mox)[0]
  assert linear.params['in_features'] == 8
  assert linear.params['use_bias'] is True
  # Its variables are its arrays, as the traced arguments hold them.
  args = jax.tree_util.tree_leaves((model, x))
  by_value = {id(a): s for a, s in zip(args, mox.inputs, strict=True)
              if isinstance(s, yax.Var)}
  assert set(linear.var_inputs) == {by_value[id(model.layers[1].weight)],
                                    by_value[id(model.layers[1].bias)]}
  np.testing.assert_array_equal(yax.eval_mox(mox, model, x), model(x))


@pytest.mark.parametrize('transform', ['filter_jit', 'filter_vmap',
                                       'filter_checkpoint'])
def test_module_calls_under_equinox_transforms(transform):
  model, x = _mlp(), jnp.arange(6.0).reshape(2, 3)
  if transform == 'filter_vmap':
    fn = lambda m, x: eqx.filter_vmap(m)(x)
  else:
    fn = getattr(eqx, transform)(lambda m, x: jax.vmap(m)(x))
  mox = _trace(fn, model, x)
  assert [p for _, p in _calls(mox)] == ['', 'layers/0', 'layers/1',
                                         'layers/2']
  np.testing.assert_array_equal(yax.eval_mox(mox, model, x),
                                jax.vmap(model)(x))


def test_filter_grad_of_a_loss():
  model, x = _mlp(), jnp.arange(3.0)
  loss = lambda m, x: jnp.sum(m(x) ** 2)
  mox = _trace(lambda m, x: eqx.filter_grad(loss)(m, x), model, x)
  assert [p for _, p in _calls(mox)][:2] == ['', 'layers/0']
  got = yax.eval_mox(mox, model, x)
  want = eqx.filter_grad(loss)(model, x)
  for a, b in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)


class _Block(eqx.Module):
  linear: eqx.nn.Linear

  def __init__(self, key):
    self.linear = eqx.nn.Linear(4, 4, key=key)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


class _Stack(eqx.Module):
  """Layers built by ``filter_vmap`` of a constructor, run by a scan."""
  layers: _Block

  def __init__(self, key):
    self.layers = eqx.filter_vmap(_Block)(jax.random.split(key, 3))

  def __call__(self, x):
    dynamic, static = eqx.partition(self.layers, eqx.is_array)

    def step(h, layer):
      return eqx.combine(layer, static)(h), None

    return jax.lax.scan(step, x, dynamic)[0]


def test_scan_over_stacked_modules():
  model, x = _Stack(jax.random.key(1)), jnp.arange(4.0)
  mox = _trace(lambda m, x: m(x), model, x)
  assert _calls(mox) == [('_Stack', ''), ('_Block', 'layers'),
                         ('Linear', 'layers/linear')]
  h = x  # by hand: each layer of the stack in turn
  w, b = model.layers.linear.weight, model.layers.linear.bias
  for i in range(3):
    h = jnp.tanh(w[i] @ h + b[i])
  np.testing.assert_allclose(yax.eval_mox(mox, model, x), h, rtol=1e-6)


def test_state_and_static_fields():
  # BatchNorm's running statistics flow back as an eqx.nn.State; Dropout's
  # p is a Python float in a module: static, an attribute of its call.
  model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, 'batch',
                                                        mode='batch')
  drop = eqx.nn.Dropout(0.5, inference=True)
  x = jnp.arange(8.0).reshape(2, 4)

  def fn(model, drop, state, x):
    y, state = jax.vmap(model, axis_name='batch', in_axes=(0, None),
                        out_axes=(0, None))(x, state)
    return drop(y), state

  mox = _trace(fn, model, drop, state, x)
  assert ('Dropout', '1') in _calls(mox)
  assert yax.query('//module_call[@type="Dropout"]', mox)[0].params['p'] == 0.5
  got, got_state = yax.eval_mox(mox, model, drop, state, x)
  want, want_state = fn(model, drop, state, x)
  assert isinstance(got_state, eqx.nn.State)
  np.testing.assert_array_equal(got, want)
  for a, b in zip(jax.tree_util.tree_leaves(got_state),
                  jax.tree_util.tree_leaves(want_state), strict=True):
    np.testing.assert_array_equal(a, b)


class _Scale(eqx.Module):
  """A module whose ``__init__`` takes a size that is no field."""
  w: jax.Array

  def __init__(self, size, *, key):
    self.w = jax.random.normal(key, (size,))

  def __call__(self, x):
    return self.w * x


def test_init_params_completes_an_equinox_model():
  # init_params makes what a rewrite added, as plain arrays in the model's
  # modules: LoRA adapters and an int8 kernel with its scale (the tools'
  # records), and a PReLU put in place of GELU by a pattern (its own
  # __init__). Before, LoRA's adapters came back as NNX Variables (eval_mox:
  # "given a container"), the quantized kernel's record could not read
  # the Linear's fields ("params lacks"), and the PReLU's variables could
  # not be placed in the MLP ("MLP has no field 'match'").
  model = eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.gelu,
                     key=jax.random.key(0))
  x = jnp.arange(3.0)
  mox = _trace(lambda m, x: m(x), model, x)
  sel = '//module_call[@type="Linear"]'
  res = yax.lora(mox, model, sel, rank=2, key=jax.random.key(1))
  full = yax.init_params(res.mox, model, key=jax.random.key(2))
  assert jax.tree_util.tree_structure(full) == \
      jax.tree_util.tree_structure(res.params)
  assert not jnp.any(full.layers[1].lora_b)  # B = 0: the model's output
  np.testing.assert_allclose(yax.eval_mox(res.mox, full, x), model(x),
                             rtol=1e-6)
  q = yax.quantize(mox, model, sel, weight='int8')
  full = yax.init_params(q.mox, model, key=jax.random.key(2))
  for layer, made in zip(model.layers, full.layers, strict=True):
    # Symmetric absmax per output row, by hand.
    scale = jnp.max(jnp.abs(layer.weight), axis=1, keepdims=True) / 127
    np.testing.assert_allclose(made.weight_scale, scale, rtol=1e-6)
    np.testing.assert_array_equal(made.weight,
                                  jnp.round(layer.weight / scale))
  np.testing.assert_allclose(
      yax.eval_mox(q.mox, full, x),
      _dequantized(types.SimpleNamespace(params=full), model)(x), rtol=1e-5,
      atol=1e-6)
  gelu = lambda x: jax.nn.gelu(x)
  matches = yax.match(gelu, mox)
  assert len(matches) == 2
  prelu = _trace(lambda p, x: p(x), eqx.nn.PReLU(), jnp.zeros(8))
  new = yax.sub(matches, prelu, mox)
  yax.check_mox(new)
  full = yax.init_params(new, model, key=jax.random.key(2))
  h = x  # by hand: PReLU's initial slope, 0.25
  for i, layer in enumerate(model.layers):
    h = layer(h)
    h = jnp.where(h >= 0, h, 0.25 * h) if i < 2 else h
  np.testing.assert_allclose(yax.eval_mox(new, full, x), h, rtol=1e-6)
  # A module whose __init__ needs what the trace did not record.
  scale = _trace(lambda s, x: s(x), _Scale(8, key=jax.random.key(0)),
                 jnp.zeros(8))
  with pytest.raises(yax.SubstitutionError, match=r"needs \['size'\]"):
    yax.init_params(yax.sub(matches, scale, mox), model,
                    key=jax.random.key(2))


FACTORY = """
import equinox as eqx
import jax
import jax.numpy as jnp


def factory():
  model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
  return (lambda m, x: jax.vmap(m)(x)), (model, jnp.ones((4, 3))), {}
"""


def test_cli_summary_of_an_equinox_factory(tmp_path, capsys):
  from yax._src.cli import main as cli
  (tmp_path / 'eqx_model.py').write_text(FACTORY)
  assert cli.main(['summary', f'{tmp_path / "eqx_model.py"}:factory']) == 0
  out = capsys.readouterr().out
  model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
  by_hand = sum(a.size for a in jax.tree_util.tree_leaves(model)
                if eqx.is_inexact_array(a))
  assert f'Total params: {by_hand} ' in out
  assert all(f'layers/{i}' in out for i in range(3))


# ---------------------------------------------------------------- eqx-zoo

@pytest.fixture(scope='module')
def qwen3_moe():
  try:
    import eqx_zoo
  except ImportError as e:
    msg = f'eqx-zoo is not installed ({e}); run: {INSTALL}'
    if _in_ci():
      pytest.fail(msg, pytrace=False)
    pytest.skip(msg)
  cfg = eqx_zoo.Config(
      architecture='Qwen3MoeForCausalLM', vocab_size=64, hidden_size=32,
      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
      tie_word_embeddings=False, attention_bias=False, qk_norm=True,
      rope_scaling=None, num_experts=4, num_experts_per_tok=2,
      moe_intermediate_size=16, moe_layers=(0, 1))
  model = eqx_zoo.CausalLM(cfg, key=jax.random.key(0))
  ids = jnp.arange(8) % 64
  fn = lambda m, ids: m(ids)[0]
  return model, ids, fn, _trace(fn, model, ids)


def test_qwen3_moe_traces_and_replays_exactly(qwen3_moe):
  model, ids, fn, mox = qwen3_moe
  calls = _calls(mox)
  assert calls[:3] == [('CausalLM', ''), ('DecoderModel', 'model'),
                       ('DecoderLayer', 'model/layers/0')]
  for i in range(2):  # per layer, from the config: 5 projections, 4 norms
    inside = [t for t, p in calls if p.startswith(f'model/layers/{i}/')]
    assert inside.count('Linear') == 5 and inside.count('RMSNorm') == 4
    assert inside.count('SparseMoE') == 1
  np.testing.assert_array_equal(yax.eval_mox(mox, model, ids), fn(model, ids))


def test_qwen3_moe_summary_counts_every_parameter(qwen3_moe):
  model, _, _, mox = qwen3_moe
  rows = yax.summary(mox)
  by_hand = sum(x.size for x in jax.tree_util.tree_leaves(model)
                if eqx.is_inexact_array(x))
  assert rows[0].path == '' and rows[0].params == by_hand


def test_qwen3_moe_rewrites(qwen3_moe):
  model, ids, fn, mox = qwen3_moe
  want = fn(model, ids)
  # remat: the same values, and the same gradient.
  remat = yax.remat(mox, '//module_call[@type="DecoderLayer"]')
  yax.check_mox(remat)
  np.testing.assert_array_equal(yax.eval_mox(remat, model, ids), want)
  loss = lambda f: lambda m: jnp.sum(f(m) ** 2)
  g = eqx.filter_grad(loss(lambda m: yax.eval_mox(remat, m, ids)))(model)
  g_want = eqx.filter_grad(loss(lambda m: fn(m, ids)))(model)
  for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(
      g_want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # randomized_linear: exact outputs, and exact gradients for every
  # parameter but the sketched kernels.
  sketched = yax.randomized_linear(mox, '//module_call[@type="Linear"]')
  yax.check_mox(sketched)
  run = lambda m: yax.eval_mox(sketched, m, ids, sketch_key=jax.random.key(5))
  np.testing.assert_allclose(run(model), want, rtol=1e-6)
  g = eqx.filter_grad(loss(run))(model)
  compared = 0
  for (kp, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0],
                        jax.tree_util.tree_leaves(g_want), strict=True):
    path = jax.tree_util.keystr(kp)
    if re.search(r'(_attn\.[qkvo]_proj|mlp\.gate|lm_head)\.weight', path):
      assert a.shape == b.shape  # sketched: unbiased, not equal
      continue
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=path)
    compared += 1
  assert compared == 1 + 2 * 7 + 1  # embedding; per layer; final norm
  # cast: the projections in bfloat16, within bfloat16 error.
  cast = yax.cast(mox, '//module_call[@type="Linear"]', 'bfloat16')
  yax.check_mox(cast)
  got = yax.eval_mox(cast, model, ids)
  assert got.dtype == want.dtype
  np.testing.assert_allclose(got, want, atol=0.05 * float(jnp.abs(want).max()))
  # fewbit: the model's SiLUs become FewBit calls, forward unchanged.
  few = yax.fewbit(mox)
  yax.check_mox(few)
  assert yax.query('//module_call[@type="FewBit"]', few)
  np.testing.assert_allclose(yax.eval_mox(few, model, ids), want, rtol=1e-5,
                             atol=1e-6)


def test_qwen3_moe_pattern(qwen3_moe, monkeypatch):
  model, ids, fn, mox = qwen3_moe
  # A pattern: the experts' SiLU becomes ReLU; the model's own code with
  # jax.nn.silu patched to ReLU is the reference.
  matches = yax.match(jax.nn.silu, mox)
  assert len(matches) == 2  # one per MoE layer
  relu = yax.sub(matches, yax.trace_like(jax.nn.relu), mox)
  yax.check_mox(relu)
  got = yax.eval_mox(relu, model, ids)
  with monkeypatch.context() as m:
    m.setattr(jax.nn, 'silu', jax.nn.relu)
    want = fn(model, ids)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert not np.allclose(got, fn(model, ids), atol=1e-3)


def _lora_and_merge(mox, model, run, selection):
  res = yax.lora(mox, model, selection, rank=2, key=jax.random.key(3))
  yax.check_mox(res.mox)
  # At init (B = 0) the adapted model computes what the model computes.
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, *run),
                             yax.eval_mox(mox, model, *run), atol=1e-6)
  # "Trained" adapters: B nonzero; merged, the model of the original
  # classes computes what the adapted tree does.
  trained = jax.tree_util.tree_map(
      lambda a: a + 0.01 if eqx.is_inexact_array(a) else a, res.params)
  merged = res.merge(trained)
  assert jax.tree_util.tree_structure(merged) == \
      jax.tree_util.tree_structure(model)
  return res, trained, merged


def _dequantized(res, model):
  """``model`` with each kernel that ``res`` quantized replaced, by hand,
  by its int8 values times their scales."""
  out = model
  for kp, leaf in jax.tree_util.tree_flatten_with_path(res.params)[0]:
    if getattr(leaf, 'dtype', None) != jnp.int8:
      continue
    holder = res.params
    for k in kp[:-1]:
      holder = holder[k.idx] if hasattr(k, 'idx') else getattr(holder, k.name)
    scale = getattr(holder, f'{kp[-1].name}_scale')
    where = lambda m, kp=kp: functools.reduce(
        lambda h, k: h[k.idx] if hasattr(k, 'idx') else getattr(h, k.name),
        kp, m)
    out = eqx.tree_at(where, out, leaf.astype(jnp.float32) * scale)
  return out


def test_lora_merge_and_quantize_on_eqx_nn():
  model, x = _mlp(), jnp.arange(3.0)
  mox = _trace(lambda m, x: m(x), model, x)
  res, trained, merged = _lora_and_merge(mox, model, (x,),
                                         '//module_call[@type="Linear"]')
  assert type(res.params.layers[0]).__name__ == 'LinearWithVariables'
  assert isinstance(res.params.layers[0], eqx.nn.Linear)
  assert type(merged.layers[0]) is eqx.nn.Linear
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), merged(x),
                             rtol=1e-5, atol=1e-6)
  q = yax.quantize(mox, model, '//module_call[@type="Linear"]', weight='int8')
  yax.check_mox(q.mox)
  assert q.params.layers[1].weight.dtype == jnp.int8
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x),
                             _dequantized(q, model)(x), rtol=1e-5, atol=1e-6)


def test_qwen3_moe_lora_merge_and_quantize(qwen3_moe):
  model, ids, fn, mox = qwen3_moe
  sel = '//module_call[@type="Linear"]'
  res, trained, merged = _lora_and_merge(mox, model, (ids,), sel)
  assert len(res.paths) == 2 * 5 + 1  # per layer q, k, v, o, router; head
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, ids),
                             fn(merged, ids), rtol=1e-4, atol=1e-5)
  q = yax.quantize(mox, model, sel, weight='int8')
  yax.check_mox(q.mox)
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, ids),
                             fn(_dequantized(q, model), ids), rtol=1e-4,
                             atol=1e-5)


# ----------------------------------- eqx-zoo Llama and BERT, equimo ViT

def _installed(module: str):
  try:
    return importlib.import_module(module)
  except ImportError as e:
    msg = f'{module} is not installed ({e}); run: {INSTALL}'
    if _in_ci():
      pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def _llama():
  # Tied head (as Llama 3.2 1B): the logits read the embedding table
  # directly, so the head is no Linear call.
  eqx_zoo = _installed('eqx_zoo')
  cfg = eqx_zoo.Config(
      architecture='LlamaForCausalLM', vocab_size=64, hidden_size=32,
      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
      tie_word_embeddings=True, attention_bias=False, qk_norm=False,
      rope_scaling=None)
  model = eqx_zoo.CausalLM(cfg, key=jax.random.key(0))
  assert model.lm_head is None
  # Per layer: q, k, v, o; gate, up, down. One SiLU per layer.
  return model, (jnp.arange(8),), lambda m, ids: m(ids)[0], 'DecoderLayer', 14


def _bert():
  eqx_zoo = _installed('eqx_zoo')
  cfg = eqx_zoo.EncoderConfig(
      architecture='BertModel', vocab_size=64, hidden_size=32,
      num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
      max_position_embeddings=16, type_vocab_size=2, layer_norm_eps=1e-12)
  model = eqx_zoo.Encoder(cfg, key=jax.random.key(0))
  # Per layer: query, key, value, attention output, intermediate, output.
  return model, (jnp.arange(2, 10),), lambda m, ids: m(ids), 'EncoderLayer', 12


def _vit():
  vit = _installed('equimo.vision.models.vit')
  model = vit.VisionTransformer(
      img_size=16, in_channels=3, dim=32, patch_size=8, num_heads=4,
      depths=[2], num_classes=10, key=jax.random.key(0))
  image = jax.random.normal(jax.random.key(1), (3, 16, 16))
  # Per block: qkv, proj, fc1, fc2; the head.
  return (model, (image,), lambda m, x: m(x, inference=True),
          'AttentionBlock', 9)


def _jitted_all(fns, models, args):
  """``[f(m, *args) for f, m in zip(fns, models)]``, under one ``jax.jit``
  (the models' non-array leaves static)."""
  dynamic, static = eqx.partition(list(models), eqx.is_array)
  return jax.jit(lambda d, a: [f(m, *a) for f, m in zip(
      fns, eqx.combine(d, static), strict=True)])(dynamic, args)


def _loss_and_grad(fn, model, args):
  """A loss that no final norm makes constant, and its gradient by
  ``jax.value_and_grad`` under ``jax.jit``."""
  dynamic, static = eqx.partition(model, eqx.is_array)

  def loss(d):
    y = fn(eqx.combine(d, static), *args)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape)))

  return jax.jit(jax.value_and_grad(loss))(dynamic)


@pytest.mark.parametrize('build', [_llama, _bert, _vit],
                         ids=['eqx_zoo_llama', 'eqx_zoo_bert', 'equimo_vit'])
def test_every_rewrite_against_the_library_forward(build):
  # One trace per model; the rewritten trees and the library's own forward
  # pass (on the model, the merged model and the dequantized model) each
  # run under one jit.
  model, args, fn, layer, n_linear = build()
  mox = _trace(fn, model, *args)
  types_ = [t for t, _ in _calls(mox)]
  assert types_.count(layer) == 2 and types_.count('Linear') == n_linear
  linears = '//module_call[@type="Linear"]'
  by_hand = sum(x.size for x in jax.tree_util.tree_leaves(model)
                if eqx.is_inexact_array(x))
  assert yax.summary(mox)[0].params == by_hand  # every parameter, once

  res = yax.lora(mox, model, linears, rank=2, key=jax.random.key(3))
  assert len(res.paths) == n_linear
  trained = jax.tree_util.tree_map(
      lambda a: a + 0.01 if eqx.is_inexact_array(a) else a, res.params)
  merged = res.merge(trained)
  assert jax.tree_util.tree_structure(merged) == \
      jax.tree_util.tree_structure(model)
  q = yax.quantize(mox, model, linears, weight='int8')
  assert sum(getattr(x, "dtype", None) == jnp.int8 for x in jax.tree_util.tree_leaves(
      q.params)) == n_linear
  cast = yax.cast(mox, linears, 'bfloat16')
  few = yax.fewbit(mox)
  assert len(yax.query('//module_call[@type="FewBit"]', few)) == 2
  remat = yax.remat(mox, f'//module_call[@type="{layer}"]')
  for tree in (res.mox, q.mox, cast, few, remat):
    yax.check_mox(tree)

  trees = [(mox, model), (res.mox, res.params), (res.mox, trained),
           (q.mox, q.params), (few, model), (cast, model)]
  replay, lora_init, lora_trained, quant, few_out, cast_out = _jitted_all(
      [functools.partial(yax.eval_mox, t) for t, _ in trees],
      [p for _, p in trees], args)
  want, want_merged, want_quant = _jitted_all(
      [fn] * 3, [model, merged, _dequantized(q, model)], args)
  np.testing.assert_array_equal(replay, want)  # exact replay
  np.testing.assert_allclose(lora_init, want, rtol=1e-5, atol=1e-5)  # B = 0
  np.testing.assert_allclose(lora_trained, want_merged, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(quant, want_quant, rtol=1e-4, atol=1e-5)
  assert cast_out.dtype == want.dtype and not np.array_equal(cast_out, want)
  np.testing.assert_allclose(cast_out, want,
                             atol=0.05 * float(jnp.abs(want).max()))
  np.testing.assert_allclose(few_out, want, rtol=1e-5, atol=1e-6)
  # remat: the same loss and gradient as the library's forward.
  (value, grad), (want_value, want_grad) = (
      _loss_and_grad(functools.partial(yax.eval_mox, remat), model, args),
      _loss_and_grad(fn, model, args))
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  for (kp, a), b in zip(jax.tree_util.tree_flatten_with_path(grad)[0],
                        jax.tree_util.tree_leaves(want_grad), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(kp))


class _LinearInBfloat16(eqx.Module):
  """An ``eqx.nn.Linear`` computing in bfloat16 as a user writes it: its
  weights and its input cast to bfloat16, its output cast back."""
  linear: eqx.nn.Linear

  def __call__(self, x):
    low = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a,
        self.linear)
    return low(x.astype(jnp.bfloat16)).astype(x.dtype)


def test_cast_llama_linears_to_bfloat16_under_filter_jit():
  # Cast replays an Equinox Linear's traced body: its dot_general, traced
  # in float32, recorded preferred_element_type=float32, which the replay
  # kept on bfloat16 operands. XLA:CPU (jaxlib 0.12) has no kernel for the
  # down projection's bfloat16 x bfloat16 -> float32 dot (its transposed
  # output folded in) and failed at run time ("Unsupported element type
  # for DotThunk::Execute"). The tree now accumulates in bfloat16, as
  # eqx.nn.Linear run on bfloat16 does: the same values as the library's
  # model with each Linear computing in bfloat16 by hand.
  model, args, fn, _, n_linear = _llama()
  mox = _trace(fn, model, *args)
  cast = yax.cast(mox, '//module_call[@type="Linear"]', 'bfloat16')
  yax.check_mox(cast)
  is_linear = lambda x: isinstance(x, eqx.nn.Linear)
  linears = lambda m: [x for x in jax.tree_util.tree_leaves(
      m, is_leaf=is_linear) if is_linear(x)]
  assert len(linears(model)) == n_linear
  by_hand = eqx.tree_at(linears, model, replace_fn=_LinearInBfloat16)
  got = eqx.filter_jit(functools.partial(yax.eval_mox, cast))(model, *args)
  want = eqx.filter_jit(fn)(by_hand, *args)
  full = eqx.filter_jit(fn)(model, *args)
  assert got.dtype == full.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert not np.array_equal(got, full)  # bfloat16 rounding, within its error
  np.testing.assert_allclose(got, full, atol=0.05 * float(jnp.abs(full).max()))


# ---------------------------------------------------------------- esm2quinox

def _jitted(fn, *args):
  return eqx.filter_jit(fn)(*args)


def test_esm2quinox_called_three_times():
  # ESM2 runs its layers in a lax.scan over a stack built by filter_vmap,
  # inside an eqx.filter_jit method; its embedding is an eqx.nn.Embedding
  # built in a property from the logit head's kernel (tied). The function
  # calls the model three times (three proteins, one at a time): each call
  # reaches the kernels through a filter_jit body of its own, so a new
  # variable (a scale, an adapter) is threaded out of three bodies. Before
  # the fix, quantize and lora gave each body's copy a symbol of its own
  # and the tree read two of them before they were defined (check_mox).
  # Evaluations run under filter_jit: eager, the three calls cost 20 s.
  try:
    import esm2quinox
  except ImportError as e:
    msg = f'esm2quinox is not installed ({e}); run: {INSTALL}'
    if _in_ci():
      pytest.fail(msg, pytrace=False)
    pytest.skip(msg)
  model = esm2quinox.ESM2(num_layers=2, embed_size=32, num_heads=4,
                          token_dropout=False, key=jax.random.key(0))
  tokens = esm2quinox.tokenise(['MKTAYIAK', 'MKV', 'QQAYI'])
  fn = lambda m, t: tuple(m(t[i]).logits for i in range(3))
  mox = _trace(fn, model, tokens)
  calls = _calls(mox)
  assert calls.count(('ESM2', '')) == 6  # __call__ and _call, three times
  assert ('TransformerLayer', 'layers') in calls
  assert ('Linear', 'layers/attn/query_proj') in calls
  assert ('Embedding', '<built>/Embedding') in calls
  np.testing.assert_array_equal(
      _jitted(lambda m, t: yax.eval_mox(mox, m, t), model, tokens),
      _jitted(fn, model, tokens))
  # The tied kernel is refused by quantize unless its readers go together.
  with pytest.raises(yax.SubstitutionError, match='also read by'):
    yax.quantize(mox, model, '//module_call[@type="Linear"]')
  sel = '//module_call[@type="Linear" and @path!="logit_head/linear2"]'
  q = yax.quantize(mox, model, sel, weight='int8')
  yax.check_mox(q.mox)
  np.testing.assert_allclose(
      _jitted(lambda p, t: yax.eval_mox(q.mox, p, t), q.params, tokens),
      _jitted(fn, _dequantized(q, model), tokens), rtol=1e-4, atol=1e-5)
  res = yax.lora(mox, model, '//module_call[@path="layers/linear1"]',
                 rank=2, key=jax.random.key(3))
  yax.check_mox(res.mox)
  trained = jax.tree_util.tree_map(
      lambda a: a + 0.01 if eqx.is_inexact_array(a) else a, res.params)
  np.testing.assert_allclose(
      _jitted(lambda p, t: yax.eval_mox(res.mox, p, t), trained, tokens),
      _jitted(fn, res.merge(trained), tokens), rtol=1e-4, atol=1e-5)
