"""``yax.quantize``: weight-only int8/int4/fp8/nf4 with per-channel absmax
scales, checked against a reference quantizer written here (NumPy absmax
per output channel, the 16 NF4 levels, ``float8_e4m3fn``): the quantized
tree computes exactly what the Flax model computes on the reference's
dequantized kernels."""

from __future__ import annotations

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import yax

TOL = dict(rtol=1e-5, atol=1e-5)
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367,
                -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)


def reference(w, fmt, contracted):
  """The dequantized kernel of a per-output-channel absmax quantizer."""
  w = np.asarray(w, np.float32)
  absmax = np.abs(w).max(axis=contracted, keepdims=True)
  if fmt == 'nf4':
    scale = np.where(absmax > 0, absmax, 1.0)
    codes = np.abs((w / scale)[..., None] - NF4).argmin(-1)
    return NF4[codes] * scale
  # int8: symmetric absmax, the absmax maps to 127 and codes span
  # -127 .. 127 (int4: 7, -7 .. 7).
  top = {'int8': 127.0, 'int4': 7.0, 'fp8': 448.0}[fmt]
  scale = np.where(absmax > 0, absmax / top, 1.0).astype(np.float32)
  if fmt == 'fp8':
    q = (w / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  else:
    q = np.clip(np.round(w / scale), -top, top)
  return q * scale


class Einsum(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param('w', nn.initializers.normal(1.0), (2, 8, 4))
    return jnp.einsum('BTD,NDH->BTNH', x, w)


class Model(nn.Module):
  @nn.compact
  def __call__(self, x, img):
    h = nn.relu(nn.Dense(8, name='dense')(x))
    e = Einsum(name='einsum')(h).reshape(*h.shape[:2], 8)
    c = nn.Conv(3, (3, 3), name='conv')(img)
    return e, c


# (path, kernel name, contracted axes)
KERNELS = [('dense', 'kernel', (0,)), ('einsum', 'w', (1,)),
           ('conv', 'kernel', (0, 1, 2))]


@pytest.mark.parametrize('fmt', ['int8', 'int4', 'fp8', 'nf4'])
def test_linen_formats_match_the_reference_quantizer(fmt):
  model = Model()
  x = jax.random.normal(jax.random.key(0), (2, 5, 6))
  img = jax.random.normal(jax.random.key(1), (1, 6, 6, 2))
  variables = model.init(jax.random.key(2), x, img)
  mox = yax.make_mox(model.apply)(variables, x, img)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense" or '
                   '@type="Einsum" or @type="Conv"]', weight=fmt)
  yax.check_mox(q.mox)
  assert q.paths == [('conv',), ('dense',), ('einsum',)]
  storage = {'int8': 'int8', 'int4': 'int4', 'fp8': 'float8_e4m3fn',
             'nf4': 'uint4'}[fmt]
  ref = jax.tree.map(lambda a: a, variables)
  for path, name, contracted in KERNELS:
    stored = q.params['params'][path]
    assert str(stored[name].dtype) == storage
    assert stored[f'{name}_scale'].dtype == jnp.float32
    ref['params'][path][name] = reference(variables['params'][path][name],
                                          fmt, contracted)
    # The node keeps its type and path and says its format.
  node = yax.query('//module_call[@path="dense"]', q.mox)[0]
  assert node.type_name == 'Dense' and node.params['quant'] == fmt
  got = yax.eval_mox(q.mox, q.params, x, img)
  want = model.apply(ref, x, img)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, **TOL)
  # dequantize gives float params for the original tree.
  back = q.dequantize(q.params)
  assert jax.tree.structure(back) == jax.tree.structure(variables)
  for g, w in zip(model.apply(back, x, img), want, strict=True):
    np.testing.assert_allclose(g, w, **TOL)
  before, after = q.nbytes
  bits = 4 if fmt in ('int4', 'nf4') else 8
  kernels = sum(variables['params'][p][n].size for p, n, _ in KERNELS)
  scales = sum(q.params['params'][p][f'{n}_scale'].size for p, n, _ in KERNELS)
  assert before - after == kernels * 4 - kernels * bits // 8 - scales * 4


@pytest.mark.parametrize('fmt,tile', [('int8', None), ('int4', None),
                                      ('int8', 8), ('int4', 8)])
def test_integer_codes_are_symmetric_and_unbiased(fmt, tile):
  """The SPEC's symmetric absmax: ``q(-w) = -q(w)`` (before: the absmax
  element of a negative sign went to -128 / -8 while +absmax went to
  127 / 7) and the rounding error has no bias (before: sum(err) /
  sum(|err|) = -0.22 on a Dense at tile=8)."""
  w = jax.random.normal(jax.random.key(3), (64, 32))
  variables = {'params': {'kernel': w, 'bias': jnp.zeros(32)}}
  neg = {'params': {'kernel': -w, 'bias': jnp.zeros(32)}}
  x = jax.random.normal(jax.random.key(4), (3, 64))
  dense = nn.Dense(32)
  mox = yax.make_mox(dense.apply)(variables, x)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense"]',
                   weight=fmt, tile=tile)
  q_neg = yax.quantize(mox, neg, '//module_call[@type="Dense"]',
                       weight=fmt, tile=tile)
  yax.check_mox(q.mox)
  codes = np.asarray(q.params['params']['kernel'], np.int32)
  codes_neg = np.asarray(q_neg.params['params']['kernel'], np.int32)
  qmax = {'int8': 127, 'int4': 7}[fmt]
  np.testing.assert_array_equal(codes_neg, -codes)
  assert codes.min() == -qmax and codes.max() == qmax
  # Against a quantizer written here (tiles of the input axis, or all of it).
  rows = tile or 64
  groups = np.asarray(w).reshape(64 // rows, rows, 32)
  scale = np.abs(groups).max(1, keepdims=True) / qmax
  want = np.clip(np.round(groups / scale), -qmax, qmax)
  np.testing.assert_array_equal(codes, want.reshape(64, 32))
  back = np.asarray(q.dequantize(q.params)['params']['kernel'])
  np.testing.assert_allclose(back, (want * scale).reshape(64, 32), **TOL)
  err = back - np.asarray(w)
  assert abs(err.sum()) / np.abs(err).sum() < 0.05
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x),
                             dense.apply({'params': {
                                 'kernel': back, 'bias': jnp.zeros(32)}}, x),
                             **TOL)


def test_nnx_int8_on_the_split_form():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(6, 8, rngs=rngs)
      self.einsum = nnx.Einsum('btd,dnh->btnh', (8, 2, 3), (2, 3), rngs=rngs)

    def __call__(self, x):
      return self.einsum(jnp.tanh(self.lin(x)))

  model = Net(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 5, 6))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  q = yax.quantize(mox, state, '//module_call[@type="Linear" or '
                   '@type="Einsum"]', weight='int8')
  yax.check_mox(q.mox)
  assert isinstance(q.params, nnx.State)
  assert q.params['lin']['kernel'][...].dtype == jnp.int8
  ref = nnx.split(model)[1]
  ref['lin']['kernel'].value = reference(state['lin']['kernel'][...], 'int8',
                                         (0,))
  ref['einsum']['kernel'].value = reference(state['einsum']['kernel'][...],
                                            'int8', (0,))
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x), run(ref, x),
                             **TOL)
  np.testing.assert_allclose(run(q.dequantize(q.params), x), run(ref, x),
                             **TOL)


def test_nnx_state_with_an_rng_stream_counts_its_key_bytes():
  """A state holding an RNG stream (nnx.Dropout's ``rngs``, as MaxText's
  unrematerialized decoders keep one) has key leaves (``key<fry>``, an
  extended dtype NumPy cannot interpret): ``nbytes`` counts each key as the
  bytes of its key data and the quantized kernel's saving is exact."""
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(6, 8, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.lin(x), deterministic=True)

  model = Net(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 6))
  graphdef, state = nnx.split(model)
  keys = [k for k in jax.tree.leaves(state)
          if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)]
  assert keys  # the stream's key is in the state
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  q = yax.quantize(mox, state, '//module_call[@type="Linear"]', weight='int8')
  ref = nnx.split(model)[1]
  ref['lin']['kernel'].value = reference(state['lin']['kernel'][...], 'int8',
                                         (0,))
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x), run(ref, x),
                             **TOL)
  before, after = q.nbytes
  arrays = sum(np.asarray(v).nbytes for v in jax.tree.leaves(state)
               if not jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key))
  key_bytes = sum(jax.random.key_data(k).nbytes for k in keys)
  assert before == arrays + key_bytes
  # The 6x8 float32 kernel becomes int8 plus 8 float32 scales.
  assert before - after == 6 * 8 * 4 - 6 * 8 - 8 * 4


def test_hf_gpt2_and_bert_int8():
  from transformers import (BertConfig, FlaxBertModel, FlaxGPT2LMHeadModel,
                            GPT2Config)
  gpt2 = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16,
                                        n_embd=16, n_layer=2, n_head=2),
                             seed=0)
  ids = jnp.array([[1, 5, 7, 3, 9]])
  mox = yax.make_mox(gpt2)(ids, params=gpt2.params)
  q = yax.quantize(mox, gpt2.params, '//module_call[@type="FlaxConv1D"]')
  assert len(q.paths) == 8
  ref = jax.tree.map(lambda a: a, gpt2.params)
  for path in q.paths:
    node = ref
    for k in path:
      node = node[k]
    node['kernel'] = reference(node['kernel'], 'int8', (1,))  # [out, in]
  np.testing.assert_allclose(
      yax.eval_mox(q.mox, ids, params=q.params).logits,
      gpt2(ids, params=ref).logits, rtol=1e-4, atol=1e-4)
  bert = FlaxBertModel(BertConfig(vocab_size=99, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37), seed=0)
  ids = jnp.array([[5, 17, 42, 3, 8, 21, 60, 2]])
  fn = lambda p, ids: bert(ids, params=p).last_hidden_state
  mox = yax.make_mox(fn)(bert.params, ids)
  q = yax.quantize(mox, bert.params, '//module_call[@type="Dense"]')
  want = fn(bert.params, ids)
  got = yax.eval_mox(q.mox, q.params, ids)
  rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  assert 0 < rel < 1e-3
  before, after = q.nbytes
  assert after < before


def test_qat_trains_through_the_fake_quantized_kernel():
  class Tiny(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(jnp.tanh(nn.Dense(16)(x)))

  model = Tiny()
  x = jax.random.normal(jax.random.key(0), (64, 4))
  y = jnp.sin(x.sum(-1, keepdims=True))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense"]',
                   weight='int4', mode='qat')
  assert q.params is variables  # float params, unchanged
  loss = lambda p: jnp.mean((yax.eval_mox(q.mox, p, x) - y) ** 2)
  # The forward pass sees the int4 kernels.
  ref = jax.tree.map(lambda a: a, variables)
  for name in ('Dense_0', 'Dense_1'):
    ref['params'][name]['kernel'] = reference(
        variables['params'][name]['kernel'], 'int4', (0,))
  np.testing.assert_allclose(yax.eval_mox(q.mox, variables, x),
                             model.apply(ref, x), **TOL)
  step = jax.jit(lambda p: jax.tree.map(lambda a, g: a - 0.1 * g, p,
                                        jax.grad(loss)(p)))
  params, first = variables, float(loss(variables))
  for _ in range(30):
    params = step(params)
  assert float(loss(params)) < 0.7 * first


def test_quantize_refusals():
  class Shared(nn.Module):
    @nn.compact
    def __call__(self, ids):
      emb = nn.Embed(10, 4, name='embed')
      return emb.attend(emb(ids))

  model = Shared()
  ids = jnp.array([[1, 2, 3]])
  variables = model.init(jax.random.key(0), ids)
  mox = yax.make_mox(model.apply)(variables, ids)
  # Embed.attend: the table it shares is quantized, and the lookup reads
  # the same (dequantized) table.
  q = yax.quantize(mox, variables, '//module_call[@method="attend"]')
  yax.check_mox(q.mox)
  assert q.params['params']['embed']['embedding'].dtype == jnp.int8
  table = reference(variables['params']['embed']['embedding'], 'int8', (1,))
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, ids),
                             table[ids] @ table.T, **TOL)
  np.testing.assert_allclose(
      model.apply(q.dequantize(q.params), ids), table[ids] @ table.T, **TOL)
  dense = nn.Dense(3)
  x = jnp.ones((2, 4))
  v = dense.init(jax.random.key(0), x)
  dmox = yax.make_mox(dense.apply)(v, x)
  with pytest.raises(yax.SubstitutionError, match='weight must be one of'):
    yax.quantize(dmox, v, '//module_call', weight='int3')
  with pytest.raises(yax.SubstitutionError, match='tile must be'):
    yax.quantize(dmox, v, '//module_call', tile=0)
  with pytest.raises(yax.SubstitutionError, match='act must be'):
    yax.quantize(dmox, v, '//module_call', act='int4')


def test_qlora_on_bert_starts_near_float_and_merges_to_float_params():
  from transformers import BertConfig, FlaxBertModel
  bert = FlaxBertModel(BertConfig(vocab_size=99, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37), seed=0)
  ids = jnp.array([[5, 17, 42, 3, 8, 21, 60, 2]])
  fn = lambda p, ids: bert(ids, params=p).last_hidden_state
  mox = yax.make_mox(fn)(bert.params, ids)
  q = yax.quantize(mox, bert.params, '//module_call[@type="Dense"]')
  res = yax.lora(q.mox, q.params, '//module_call[@type="Dense"]', rank=4,
                 alpha=8.0)
  yax.check_mox(res.mox)
  layer = res.params['encoder']['layer']['0']['attention']['self']['query']
  assert layer['kernel'].dtype == jnp.int8
  assert layer['lora_a'].dtype == jnp.float32
  want = fn(bert.params, ids)
  start = yax.eval_mox(res.mox, res.params, ids)
  np.testing.assert_allclose(start, yax.eval_mox(q.mox, q.params, ids),
                             rtol=1e-6, atol=1e-6)
  assert float(jnp.linalg.norm(start - want) / jnp.linalg.norm(want)) < 1e-3
  # Train the float adapters only (the int8 base is frozen).
  flat, tree = jax.tree.flatten(res.params)
  flags = jax.tree.leaves(res.mask)
  adapters = [x for x, m in zip(flat, flags, strict=True) if m]

  def loss(adapters):
    it = iter(adapters)
    params = tree.unflatten([next(it) if m else x
                             for x, m in zip(flat, flags, strict=True)])
    return jnp.sum(jnp.sin(yax.eval_mox(res.mox, params, ids)))

  trained_adapters = [a + 0.02 for a in adapters]  # B != 0: A learns too
  grads = jax.jit(jax.grad(loss))(trained_adapters)
  # Every adapter but the pooler's (last_hidden_state does not use it).
  assert sum(float(jnp.abs(g).sum()) > 0 for g in grads) == len(grads) - 2
  it = iter(trained_adapters)
  trained = tree.unflatten([next(it) if m else x
                            for x, m in zip(flat, flags, strict=True)])
  merged = res.merge(trained)
  # Float params for the tree quantize started from: no scales, no int8.
  assert jax.tree.structure(merged) == jax.tree.structure(bert.params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(merged))
  np.testing.assert_allclose(fn(merged, ids),
                             yax.eval_mox(res.mox, trained, ids), rtol=1e-4,
                             atol=1e-4)


def reference_rows(x, fmt, contracted):
  """Dynamic activation quantization: absmax per row over ``contracted``."""
  return reference(x, fmt, contracted)


def test_act_int8_quantizes_the_input_per_row_and_attention_scores():
  class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
      q = nn.Dense(8, name='q')(x)
      k = nn.Dense(8, name='k')(x)
      scores = jnp.einsum('btd,bsd->bts', q, k)
      return jax.nn.softmax(scores, -1)

  model = Attention()
  x = jax.random.normal(jax.random.key(0), (2, 5, 6))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense"]',
                   weight='int8', act='int8')
  yax.check_mox(q.mox)
  # By hand: each Dense sees x quantized per row (over its last axis) and
  # its int8 kernel.
  p = variables['params']
  xq = reference_rows(x, 'int8', (2,))
  qq = xq @ reference(p['q']['kernel'], 'int8', (0,)) + p['q']['bias']
  kk = xq @ reference(p['k']['kernel'], 'int8', (0,)) + p['k']['bias']
  want = jax.nn.softmax(jnp.einsum('btd,bsd->bts', qq, kk), -1)
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x), want,
                             rtol=1e-5, atol=1e-5)
  # The weight-free scores einsum, selected as an equation, on int8 inputs.
  scores = '//module_call[@type="Attention"]/dot_general'
  with pytest.raises(yax.SubstitutionError, match='pass act='):
    yax.quantize(mox, variables, scores)
  both = yax.quantize(mox, variables, scores, act='int8')
  assert both.paths == []
  qf = x @ p['q']['kernel'] + p['q']['bias']
  kf = x @ p['k']['kernel'] + p['k']['bias']
  want = jax.nn.softmax(jnp.einsum(
      'btd,bsd->bts', reference_rows(qf, 'int8', (2,)),
      reference_rows(kf, 'int8', (2,))), -1)
  np.testing.assert_allclose(yax.eval_mox(both.mox, both.params, x), want,
                             rtol=1e-5, atol=1e-5)


def reference_tiled(w, fmt, contracted, tile):
  """Tiled absmax: the contracted axes (kernel order) flattened and cut
  into tiles of ``tile`` elements, one scale per tile and output channel."""
  w = np.asarray(w, np.float32)
  other = [i for i in range(w.ndim) if i not in contracted]
  moved = np.transpose(w, [*contracted, *other])
  rows = moved.reshape(-1, tile, *moved.shape[len(contracted):])
  deq = reference(rows, fmt, (1,))
  return np.transpose(deq.reshape(moved.shape),
                      np.argsort([*contracted, *other]))


@pytest.mark.parametrize('fmt', ['int8', 'nf4'])
def test_tiled_scales(fmt):
  model = Model()
  x = jax.random.normal(jax.random.key(0), (2, 5, 6))
  img = jax.random.normal(jax.random.key(1), (1, 6, 6, 2))
  variables = model.init(jax.random.key(2), x, img)
  mox = yax.make_mox(model.apply)(variables, x, img)
  q = yax.quantize(mox, variables, '//module_call[@path="einsum" or '
                   '@path="conv"]', weight=fmt, tile=2)
  yax.check_mox(q.mox)
  # conv: [3, 3, 2, 3], 18 contracted elements -> 9 tiles per channel.
  assert q.params['params']['conv']['kernel_scale'].shape == (9, 1, 3)
  assert q.params['params']['einsum']['w_scale'].shape == (4, 1, 2, 4)
  ref = jax.tree.map(lambda a: a, variables)
  for path, name, contracted in KERNELS[1:]:
    ref['params'][path][name] = reference_tiled(
        variables['params'][path][name], fmt, contracted, 2)
  for g, w in zip(yax.eval_mox(q.mox, q.params, x, img),
                  model.apply(ref, x, img), strict=True):
    np.testing.assert_allclose(g, w, **TOL)
  for g, w in zip(model.apply(q.dequantize(q.params), x, img),
                  model.apply(ref, x, img), strict=True):
    np.testing.assert_allclose(g, w, **TOL)
  with pytest.raises(yax.SubstitutionError, match='does not divide'):
    yax.quantize(mox, variables, '//module_call[@path="conv"]', tile=4)


@pytest.mark.parametrize('fmt,tile', [('int8', None), ('int4', 2),
                                      ('nf4', None)])
def test_qlora_on_every_storage_format_merges_to_float_params(fmt, tile):
  """QLoRA in its own format: the adapted quantized tree computes the Flax
  model on ``dequantized kernel + (alpha / rank) * A @ B`` (reference
  quantizer above), and merge gives those float kernels for the float
  tree."""
  model = Model()
  x = jax.random.normal(jax.random.key(0), (2, 5, 6))
  img = jax.random.normal(jax.random.key(1), (1, 6, 6, 2))
  variables = model.init(jax.random.key(2), x, img)
  mox = yax.make_mox(model.apply)(variables, x, img)
  selection = '//module_call[@type="Dense" or @type="Einsum" or @type="Conv"]'
  q = yax.quantize(mox, variables, selection, weight=fmt, tile=tile)
  res = yax.lora(q.mox, q.params, selection, rank=2, alpha=3.0)
  yax.check_mox(res.mox)
  assert res.paths == [('conv',), ('dense',), ('einsum',)]
  # At init the adapters change nothing.
  for g, w in zip(yax.eval_mox(res.mox, res.params, x, img),
                  yax.eval_mox(q.mox, q.params, x, img), strict=True):
    np.testing.assert_array_equal(g, w)
  rng = np.random.default_rng(0)
  trained = jax.tree.map(
      lambda v, m: v + rng.normal(0, 0.3, np.shape(v)).astype(np.float32)
      if m else v, res.params, res.mask)
  ref = jax.tree.map(lambda a: a, variables)
  deltas = {'dense': 'ir,ro->io', 'einsum': 'dr,rnh->ndh',
            'conv': 'hwir,ro->hwio'}
  for path, name, contracted in KERNELS:
    w = variables['params'][path][name]
    w = (reference(w, fmt, contracted) if tile is None else
         reference_tiled(w, fmt, contracted, tile))
    t = trained['params'][path]
    ref['params'][path][name] = w + 1.5 * np.einsum(
        deltas[path], t['lora_a'], t['lora_b'])
  want = model.apply(ref, x, img)
  for g, w in zip(yax.eval_mox(res.mox, trained, x, img), want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
  merged = res.merge(trained)
  assert jax.tree.structure(merged) == jax.tree.structure(variables)
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(merged))
  for g, w in zip(model.apply(merged, x, img), want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('fmt, tile', [('int8', None), ('int8', 2),
                                       ('int4', None), ('int4', 2)])
def test_stored_values_are_those_of_the_spec_in_numpy(fmt, tile):
  """The stored codes and scales are bit for bit those of the SPEC's
  quantizer written here in NumPy (IEEE division: XLA's CPU division is
  one ulp off on a few percent of values, so the kernels, on the host,
  are quantized in NumPy), a column's absmax twice and a column of zeros
  included."""
  model = Model()
  x = jax.random.normal(jax.random.key(0), (2, 5, 6))
  img = jax.random.normal(jax.random.key(1), (1, 6, 6, 2))
  variables = model.init(jax.random.key(3), x, img)
  # Ties and zeros: a column's absmax twice, a column of zeros.
  kernel = variables['params']['dense']['kernel']
  kernel = kernel.at[1, 0].set(-kernel[0, 0]).at[:, 1].set(0.0)
  variables['params']['dense']['kernel'] = kernel
  mox = yax.make_mox(model.apply)(variables, x, img)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense" or '
                   '@type="Einsum" or @type="Conv"]', weight=fmt, tile=tile)
  qmax = np.float32({'int8': 127, 'int4': 7}[fmt])
  for path, name, contracted in KERNELS:
    w = np.asarray(variables['params'][path][name], np.float32)
    other = [i for i in range(w.ndim) if i not in contracted]
    moved = np.transpose(w, [*contracted, *other])
    k = int(np.prod([w.shape[i] for i in contracted]))
    groups = moved.reshape(k // (tile or k), tile or k, -1)
    absmax = np.abs(groups).max(1, keepdims=True)
    want_scale = np.where(absmax > 0, absmax / qmax, np.float32(1))
    codes = np.clip(np.round(groups / want_scale), -qmax, qmax)
    want_q = np.transpose(codes.reshape(moved.shape),
                          np.argsort([*contracted, *other]))
    if tile is None:  # the stored layout: contracted axes of size 1
      want_scale = np.transpose(
          want_scale.reshape(*(1,) * len(contracted),
                             *(w.shape[i] for i in other)),
          np.argsort([*contracted, *other]))
    else:
      want_scale = want_scale.reshape(k // tile, 1,
                                      *(w.shape[i] for i in other))
    stored = q.params['params'][path]
    np.testing.assert_array_equal(np.asarray(stored[name], np.int32),
                                  np.asarray(want_q, np.int32))
    np.testing.assert_array_equal(stored[f'{name}_scale'], want_scale)



class _Layer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.gelu(nn.Dense(6, name='dense')(x)), None


class _Stacked(nn.Module):
  """Three layers scanned with their params stacked on ``axis``; on axis 1
  (MaxText's ``param_scan_axis=1``) a transpose moves the stack to the
  front before the scan slices it."""
  axis: int

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(_Layer, variable_axes={'params': self.axis},
                   split_rngs={'params': True}, length=3)
    return scan(name='layers')(x, None)[0]


@pytest.mark.parametrize('fmt', ['int8', 'int4', 'nf4'])
def test_stack_moved_before_the_scan_is_stored_quantized_in_its_layout(fmt):
  model = _Stacked(1)
  x = jax.random.normal(jax.random.key(0), (2, 6))
  variables = model.init(jax.random.key(1), x)
  kernel = variables['params']['layers']['dense']['kernel']
  assert kernel.shape == (6, 3, 6)  # [in, layers, out]
  mox = yax.make_mox(model.apply)(variables, x)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense"]',
                   weight=fmt)
  yax.check_mox(q.mox)
  stored = q.params['params']['layers']['dense']
  assert stored['kernel'].shape == (6, 3, 6)
  assert stored['kernel'].dtype == {'int8': jnp.int8, 'int4': jnp.int4,
                                    'nf4': jnp.uint4}.get(fmt)
  assert stored['kernel_scale'].shape == (3, 1, 6)  # per layer, stacked first
  # Each layer's slice as the reference quantizer stores an unscanned one.
  want = np.stack([reference(kernel[:, i, :], fmt, (0,)) for i in range(3)],
                  axis=1)
  back = q.dequantize(q.params)
  np.testing.assert_allclose(back['params']['layers']['dense']['kernel'],
                             want, rtol=1e-6, atol=1e-6)
  # The quantized tree computes the model on those kernels.
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x),
                             model.apply(back, x), **TOL)
  np.testing.assert_allclose(
      jax.jit(lambda p, x: yax.eval_mox(q.mox, p, x))(q.params, x),
      model.apply(back, x), **TOL)
  # The traced tree is left as it was.
  assert yax.eval_mox(mox, variables, x).shape == (2, 6)
  assert yax.query('//module_call[@type="Dense"]', mox)[0].params.get(
      'quant') is None


class _Experts(nn.Module):
  """Two expert kernels contracted inside the call, an activation between
  them (MaxText's RoutedMoE, ``[experts, in, out]``): no one kernel of the
  call reaches its output, each is rewritten at its contraction."""

  @nn.compact
  def __call__(self, x):  # x: [experts, tokens, features]
    init = nn.initializers.normal(0.5)
    wi = self.param('wi', init, (3, 4, 6))
    # A gate of the same shape: its dequantization is the same traced
    # function, spliced in twice.
    wg = self.param('wg', init, (3, 4, 6))
    wo = self.param('wo', init, (3, 6, 4))
    h = nn.gelu(jnp.einsum('etd,edh->eth', x, wg)) * jnp.einsum(
        'etd,edh->eth', x, wi)
    return jnp.einsum('eth,ehd->etd', h, wo)


@pytest.mark.parametrize('fmt', ['int8', 'nf4'])
def test_expert_kernels_contracted_in_the_body_get_scales_per_expert(fmt):
  model = _Experts()
  x = jax.random.normal(jax.random.key(0), (3, 5, 4))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  q = yax.quantize(mox, variables, '//module_call[@type="_Experts"]',
                   weight=fmt)
  yax.check_mox(q.mox)
  stored = q.params['params']
  assert sorted(stored) == ['wg', 'wg_scale', 'wi', 'wi_scale', 'wo',
                            'wo_scale']
  assert stored['wi_scale'].shape == (3, 1, 6)  # per expert, per output
  assert stored['wo_scale'].shape == (3, 1, 4)
  back = q.dequantize(q.params)
  for name in ('wg', 'wi', 'wo'):
    w = variables['params'][name]
    want = np.stack([reference(w[e], fmt, (0,)) for e in range(3)])
    np.testing.assert_allclose(back['params'][name], want, rtol=1e-6,
                               atol=1e-6)
  np.testing.assert_allclose(
      jax.jit(lambda p, x: yax.eval_mox(q.mox, p, x))(q.params, x),
      model.apply(back, x), **TOL)
  # QLoRA: adapters per expert at each contraction, on the stored kernels
  # (every kernel: two of them dequantized by one spliced function, whose
  # values are each its own); identity at init, merged into float kernels.
  res = yax.lora(q.mox, q.params, '//module_call[@type="_Experts"]', rank=2)
  assert sorted(k for k in res.params['params'] if 'lora' in k) == [
      f'{w}_lora_{ab}' for w in ('wg', 'wi', 'wo') for ab in 'ab']
  assert res.params['params']['wi_lora_a'].shape == (3, 4, 2)
  assert res.params['params']['wi_lora_b'].shape == (3, 2, 6)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             model.apply(back, x), **TOL)
  trained = jax.tree.map(lambda a: a, res.params)
  for name in ('wg_lora_b', 'wi_lora_b', 'wo_lora_b'):
    b = trained['params'][name]
    trained['params'][name] = jax.random.normal(jax.random.key(2), b.shape)
  merged = res.merge(trained)
  assert sorted(merged['params']) == ['wg', 'wi', 'wo']
  np.testing.assert_allclose(model.apply(merged, x),
                             yax.eval_mox(res.mox, trained, x),
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('axis', [0, 1])
def test_qlora_on_scanned_stacks_merges_to_float_kernels(axis):
  # merge dequantizes each layer's slice with its own scales (stack on
  # axis 1: moved back from the order the scan slices); failed before.
  model = _Stacked(axis)
  x = jax.random.normal(jax.random.key(0), (2, 6))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  dense = '//module_call[@type="Dense"]'
  q = yax.quantize(mox, variables, dense, weight='int8')
  res = yax.lora(q.mox, q.params, dense, rank=2)
  trained = jax.tree.map(lambda a: a, res.params)
  layer = trained['params']['layers']['dense']
  layer['lora_b'] = jax.random.normal(jax.random.key(2), layer['lora_b'].shape)
  merged = res.merge(trained)
  kernel = merged['params']['layers']['dense']['kernel']
  assert kernel.dtype == jnp.float32
  assert kernel.shape == variables['params']['layers']['dense']['kernel'].shape
  np.testing.assert_allclose(model.apply(merged, x),
                             yax.eval_mox(res.mox, trained, x), **TOL)


# ------------------------------------------- host quantizer, in blocks

@settings(max_examples=25, deadline=None)
@given(st.data())
def test_host_codes_in_blocks_are_the_spec_rule(data):
  """``quantize_kernel`` on a host kernel works in blocks of leading rows
  (``_BLOCK`` elements, drawn small here so that every kernel spans many
  blocks): its codes and scales are bit for bit the SPEC's rule in plain
  NumPy on the whole kernel, stacked and permuted layouts, tiles, zero
  columns, ties and subnormal columns (codes clipped) included."""
  from yax._src.rewrite import quant_formats
  fmt = data.draw(st.sampled_from(['int8', 'int4']), label='fmt')
  stack = data.draw(st.integers(0, 1), label='stack')
  ndim = data.draw(st.integers(1, 3), label='ndim')
  shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=ndim,
                                   max_size=ndim), label='shape'))
  contracted = tuple(sorted(data.draw(st.sets(
      st.integers(0, ndim - 1), min_size=1), label='contracted')))
  k = int(np.prod([shape[i] for i in contracted]))
  tile = data.draw(st.sampled_from(
      [None, *(t for t in range(1, k + 1) if k % t == 0)]), label='tile')
  n = data.draw(st.integers(1, 4), label='stacked') if stack else None
  sliced = (n, *shape) if stack else shape
  # The kernel as stored: the stack axis anywhere (perm brings it first).
  where = data.draw(st.integers(0, ndim), label='stack at') if stack else 0
  perm = None
  if stack and where:
    perm = (where, *(i for i in range(ndim + 1) if i != where))
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1),
                                        label='seed'))
  w = rng.standard_normal(sliced).astype(np.float32)
  kind = data.draw(st.sampled_from(['normal', 'ties', 'tiny', 'zeros']),
                   label='values')
  if kind == 'ties':  # halves, a column's absmax 127: scale 1, ties
    w = np.round(w * 8) / 2
    w.reshape(-1)[0] = 127.0
  elif kind == 'tiny':  # subnormal: absmax / qmax rounds to 0
    w = (np.sign(w) * np.float32(1.4e-45)).astype(np.float32)
  elif kind == 'zeros':
    w[..., 0] = 0.0
  stored = w if perm is None else np.transpose(w, np.argsort(perm))
  block = data.draw(st.integers(1, 40), label='block')
  on = data.draw(st.sampled_from([np.asarray, jnp.asarray]), label='on')
  top = np.float32({'int8': 127, 'int4': 7}[fmt])

  def spec(s):  # one slice, as the SPEC (and test_stored_values_...)
    other = [i for i in range(s.ndim) if i not in contracted]
    moved = np.transpose(s, [*contracted, *other])
    groups = moved.reshape(k // (tile or k), tile or k, -1)
    absmax = np.abs(groups).max(1, keepdims=True)
    scale = np.where(absmax > 0, absmax / top, np.float32(1))
    codes = np.clip(np.round(groups / scale), -top, top)
    codes = np.transpose(codes.reshape(moved.shape),
                         np.argsort([*contracted, *other]))
    if tile is None:
      scale = np.transpose(scale.reshape(*(1,) * len(contracted),
                                         *(s.shape[i] for i in other)),
                           np.argsort([*contracted, *other]))
    else:
      scale = scale.reshape(k // tile, 1, *(s.shape[i] for i in other))
    return codes, scale

  with pytest.MonkeyPatch.context() as patch, np.errstate(divide='ignore'):
    if stack:
      want_q, want_scale = (np.stack(a) for a in zip(*map(spec, w)))
      if perm is not None:
        want_q = np.transpose(want_q, np.argsort(perm))
    else:
      want_q, want_scale = spec(w)
    patch.setattr(quant_formats, '_BLOCK', block)
    q, scale = quant_formats.quantize_kernel(on(stored), fmt, contracted,
                                             tile, stack, perm)
  assert isinstance(q, jax.Array) and q.dtype == jnp.dtype(
      {'int8': jnp.int8, 'int4': jnp.int4}[fmt])
  np.testing.assert_array_equal(np.asarray(q, np.int32),
                                want_q.astype(np.int32))
  np.testing.assert_array_equal(np.asarray(scale), want_scale)
