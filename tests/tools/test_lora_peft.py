"""The options of yax.lora that PEFT users reach for, each checked against
its definition written by hand in plain JAX on the same inputs."""

import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from yax._src.report.summary import format_summary

os.environ.setdefault('USE_TORCH', '0')

TOL = dict(rtol=1e-5, atol=1e-5)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(8, name='fc1')(x))
    h = nn.LayerNorm(name='norm')(h)
    return nn.Dense(3, name='head')(h)


@pytest.fixture(scope='module')
def mlp():
  model = MLP()
  x = jax.random.normal(jax.random.key(1), (4, 5))
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  return model, variables, x, mox


def forward(p, x, extra=None):
  """The MLP by hand; ``extra[name](x)``: what an adapter adds to the
  Dense ``name``'s output, from that Dense's input."""
  extra = extra or {}
  add = lambda name, h: extra[name](h) if name in extra else 0.0
  fc1, norm, head = p['fc1'], p['norm'], p['head']
  h = jax.nn.relu(x @ fc1['kernel'] + fc1['bias'] + add('fc1', x))
  mean = h.mean(-1, keepdims=True)
  var = ((h - mean) ** 2).mean(-1, keepdims=True)
  h = (h - mean) / jnp.sqrt(var + 1e-6) * norm['scale'] + norm['bias']
  return h @ head['kernel'] + head['bias'] + add('head', h)


def trained_like(params, mask, seed=3):
  """``params`` with every masked leaf replaced by random values (what
  training would do)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  flags = jax.tree_util.tree_leaves(mask)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree_util.tree_unflatten(treedef, [
      0.5 * jax.random.normal(k, np.shape(v)) if f else v
      for k, v, f in zip(keys, leaves, flags)])


def lora_path(p, name, scale):
  return lambda h: scale * (h @ p[name]['lora_a']) @ p[name]['lora_b']


def test_trainable_count_and_summary_column(mlp):
  _, variables, _, mox = mlp
  assert not any(r.trainable for r in yax.summary(mox))
  assert 'trainable' not in format_summary(mox)
  res = yax.lora(mox, variables, rank=2)
  yax.check_mox(res.mox)
  adapters = 5 * 2 + 2 * 8 + 8 * 2 + 2 * 3  # fc1 then head, A and B
  total = (5 * 8 + 8) + 2 * 8 + (8 * 3 + 3) + adapters
  count = res.trainable_count()
  assert (count.trainable, count.total) == (adapters, total)
  assert res.num_trainable == adapters
  assert count.fraction == pytest.approx(adapters / total)
  assert str(count) == (f'trainable params: {adapters} || all params: '
                        f'{total} || trainable%: {100 * adapters / total:.4f}')
  rows = yax.summary(res.mox)  # per call: the adapters it reads
  assert {r.path: r.trainable for r in rows if r.module == 'LoRA'} == {
      'fc1': 5 * 2 + 2 * 8, 'head': 8 * 2 + 2 * 3}
  assert [r.trainable for r in rows if r.module == 'Dense'] == [0, 0]
  text = format_summary(res.mox)
  assert 'trainable' in text
  assert f'Trainable params (LoRA adapters): {adapters} of {total}' in text


def test_config_records_what_made_the_adapters(mlp):
  _, variables, _, mox = mlp
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=2,
                 alpha=4.0, dropout=0.1)
  c = res.config
  assert (c['selection'], c['rank'], c['alpha'], c['scale'], c['variant'],
          c['init'], c['dropout'], c['adapter_name'], c['paths']) == (
              '//module_call[@type="Dense"]', 2, 4.0, 2.0, 'lora',
              'default', 0.1, None, ['fc1', 'head'])
  assert [(a['path'], a['names'], a['a_shape'], a['b_shape'])
          for a in c['adapters']] == [
              (['fc1'], ['lora_a', 'lora_b'], [5, 2], [2, 8]),
              (['head'], ['lora_a', 'lora_b'], [8, 2], [2, 3])]
  assert c['yax_version'] == yax.__version__


def test_rslora_scale_and_initializers(mlp):
  _, variables, x, mox = mlp
  res = yax.lora(mox, variables, rank=4, alpha=2.0, rslora=True)
  yax.check_mox(res.mox)
  p = trained_like(res.params, res.mask)['params']
  scale = 2.0 / np.sqrt(4)  # alpha / sqrt(rank), not alpha / rank
  want = forward(p, x, {n: lora_path(p, n, scale) for n in ('fc1', 'head')})
  np.testing.assert_allclose(yax.eval_mox(res.mox, {'params': p}, x), want,
                             **TOL)
  # A's spread: N(0, 1/fan_in) by default, N(0, 1/rank^2) for 'gaussian';
  # B zero for both.
  wide = nn.Dense(8)
  xw = jnp.ones((2, 256))
  vw = wide.init(jax.random.key(0), xw)
  moxw = yax.make_mox(wide.apply)(vw, xw)
  for init, std in (('default', 1 / 16), ('gaussian', 1 / 8)):
    got = yax.lora(moxw, vw, rank=8, init=init)
    a = np.asarray(got.params['params']['lora_a'])
    assert abs(a.std() / std - 1) < 0.1, (init, a.std(), std)
    assert not np.any(np.asarray(got.params['params']['lora_b']))


def test_svd_init_is_pissa(mlp):
  model, variables, x, mox = mlp
  res = yax.lora(mox, variables, rank=2, alpha=3.0, init='svd')
  yax.check_mox(res.mox)
  scale = 3.0 / 2
  for name in ('fc1', 'head'):
    w = np.asarray(variables['params'][name]['kernel'])
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    top = (u[:, :2] * s[:2]) @ vt[:2]
    got = res.params['params'][name]
    np.testing.assert_allclose(
        scale * np.asarray(got['lora_a']) @ np.asarray(got['lora_b']), top,
        rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got['kernel'], w - top, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             model.apply(variables, x), rtol=1e-4, atol=1e-5)
  back = res.merge(res.params)  # untrained: the kernels come back
  for name in ('fc1', 'head'):
    np.testing.assert_allclose(back['params'][name]['kernel'],
                               variables['params'][name]['kernel'],
                               rtol=1e-4, atol=1e-5)
  with pytest.raises(yax.SubstitutionError, match='rank <= the kernel'):
    yax.lora(mox, variables, rank=4, init='svd')  # head is [8, 3]


def test_dora_matches_hand_definition(mlp):
  model, variables, x, mox = mlp
  res = yax.lora(mox, variables, rank=2, alpha=2.0, dora=True)
  yax.check_mox(res.mox)
  for name in ('fc1', 'head'):
    np.testing.assert_allclose(
        res.params['params'][name]['lora_magnitude'],
        np.linalg.norm(variables['params'][name]['kernel'], axis=0), **TOL)
  p = trained_like(res.params, res.mask)['params']
  scale = 1.0

  def dora(name):
    def extra(h):
      w = p[name]['kernel']
      full = w + scale * p[name]['lora_a'] @ p[name]['lora_b']
      g = p[name]['lora_magnitude'] / jnp.linalg.norm(full, axis=0)
      return h @ (g * full) - h @ w
    return extra
  want = forward(p, x, {n: dora(n) for n in ('fc1', 'head')})
  got = yax.eval_mox(res.mox, {'params': p}, x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  merged = res.merge({'params': p})
  np.testing.assert_allclose(model.apply(merged, x), want, rtol=1e-4,
                             atol=1e-5)
  back = res.unmerge(merged, {'params': p})
  np.testing.assert_allclose(back['params']['fc1']['kernel'],
                             p['fc1']['kernel'], rtol=1e-4, atol=1e-5)


def test_dropout_on_adapter_input_only(mlp):
  _, variables, x, mox = mlp
  res = yax.lora(mox, variables, rank=2, alpha=2.0, dropout=0.25)
  yax.check_mox(res.mox)
  yax.check_mox(res.train_mox)
  p = trained_like(res.params, res.mask)['params']
  key = jax.random.PRNGKey(11)
  assert [a['path'] for a in res.config['adapters']] == [['fc1'], ['head']]

  def dropped(i, name):  # adapter i keeps x where bernoulli(fold_in(key, i))
    def extra(h):
      keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.75, h.shape)
      return lora_path(p, name, 1.0)(jnp.where(keep, h / 0.75, 0.0))
    return extra
  want = forward(p, x, {'fc1': dropped(0, 'fc1'), 'head': dropped(1, 'head')})
  got = yax.eval_mox(res.train_mox, {'params': p}, x, lora_dropout_key=key)
  np.testing.assert_allclose(got, want, **TOL)
  # .mox is deterministic: no dropout, no key.
  plain = forward(p, x, {n: lora_path(p, n, 1.0) for n in ('fc1', 'head')})
  np.testing.assert_allclose(yax.eval_mox(res.mox, {'params': p}, x), plain,
                             **TOL)
  grads = jax.grad(lambda q: yax.eval_mox(
      res.train_mox, q, x, lora_dropout_key=key).sum())({'params': p})
  assert np.any(np.asarray(grads['params']['fc1']['lora_b']))
  with pytest.raises(yax.SubstitutionError, match=r'dropout must be a rate'):
    yax.lora(mox, variables, dropout=1.0)


def test_train_selects_extra_trainable_params(mlp):
  model, variables, x, mox = mlp
  res = yax.lora(mox, variables, '//module_call[@name="fc1"]', rank=2,
                 train='//module_call[@type="LayerNorm"] | '
                       '//module_call[@name="head"]')
  want = {'fc1': {'bias': False, 'kernel': False, 'lora_a': True,
                  'lora_b': True},
          'norm': {'bias': True, 'scale': True},
          'head': {'bias': True, 'kernel': True}}
  assert res.mask == {'params': want}
  biases = yax.lora(mox, variables, '//module_call[@name="fc1"]', rank=2,
                    train='//module_call[@type="Dense"]',
                    train_names=('bias',))
  assert biases.mask == {'params': {
      'fc1': {'bias': True, 'kernel': False, 'lora_a': True, 'lora_b': True},
      'norm': {'bias': False, 'scale': False},
      'head': {'bias': True, 'kernel': False}}}
  t = trained_like(res.params, res.mask)
  merged = res.merge(t)
  p = t['params']
  np.testing.assert_allclose(
      model.apply(merged, x),
      forward(p, x, {'fc1': lora_path(p, 'fc1', 0.5)}), rtol=1e-4, atol=1e-5)
  with pytest.raises(yax.SubstitutionError, match="holds no params named"):
    yax.lora(mox, variables, rank=2, train='//module_call[@name="norm"]',
             train_names=('kernel',))


def test_unmerge_gives_back_the_lora_params(mlp):
  _, variables, _, mox = mlp
  res = yax.lora(mox, variables, rank=2, alpha=3.0)
  t = trained_like(res.params, res.mask)
  merged = res.merge(t)
  for name in ('fc1', 'head'):  # the merge by hand, then its inverse
    q = t['params'][name]
    np.testing.assert_allclose(
        merged['params'][name]['kernel'],
        q['kernel'] + 1.5 * q['lora_a'] @ q['lora_b'], **TOL)
  back = res.unmerge(merged, t)
  assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(t)
  for got, want in zip(jax.tree_util.tree_leaves(back),
                       jax.tree_util.tree_leaves(t)):
    np.testing.assert_allclose(got, want, **TOL)


def test_named_adapters_add_switch_combine(mlp):
  model, variables, x, mox = mlp
  ra = yax.lora(mox, variables, rank=2, alpha=2.0, adapter_name='a')
  rb = yax.lora(ra.mox, ra.params, rank=3, alpha=3.0, adapter_name='b',
                key=jax.random.key(5))
  yax.check_mox(rb.mox)
  assert rb.config['adapter_name'] == 'b'
  assert {k for k, v in rb.mask['params']['fc1'].items() if v} == {
      'b_lora_a', 'b_lora_b'}
  adapters = jax.tree_util.tree_map(lambda m: m, rb.mask)
  adapters['params'] = {n: {k: k.endswith(('lora_a', 'lora_b')) for k in d}
                        for n, d in rb.mask['params'].items()}
  t = trained_like(rb.params, adapters)
  p = t['params']

  def both(wa, wb):
    def extra(name):
      q = p[name]
      return lambda h: (wa * ((h @ q['a_lora_a']) @ q['a_lora_b']) +
                        wb * ((h @ q['b_lora_a']) @ q['b_lora_b']))
    return forward(p, x, {n: extra(n) for n in ('fc1', 'head')})
  np.testing.assert_allclose(yax.eval_mox(rb.mox, t, x), both(1.0, 1.0),
                             **TOL)
  np.testing.assert_allclose(yax.eval_mox(rb.mox, rb.switch(t, 'a'), x),
                             both(1.0, 0.0), **TOL)
  np.testing.assert_allclose(
      yax.eval_mox(rb.mox, rb.weighted(t, {'a': 0.25, 'b': 0.75}), x),
      both(0.25, 0.75), **TOL)
  merged = ra.merge(rb.merge(rb.weighted(t, {'a': 0.25, 'b': 0.75})))
  np.testing.assert_allclose(model.apply(merged, x), both(0.25, 0.75),
                             rtol=1e-4, atol=1e-5)
  with pytest.raises(yax.SubstitutionError, match='already carries'):
    yax.lora(rb.mox, rb.params, adapter_name='a')
  with pytest.raises(yax.SubstitutionError, match="no adapter named 'c'"):
    rb.switch(t, 'c')


def test_params_mismatch_names_the_first_differing_path(mlp):
  # Before: the message printed both PyTreeDefs and named no path.
  _, variables, _, mox = mlp
  extra = {'params': {**variables['params'], 'extra': jnp.ones(2)}}
  with pytest.raises(yax.SubstitutionError) as e:
    yax.lora(mox, extra)
  assert "args[0]['params']['extra'] is not in the traced" in str(e.value)
  assert 'PyTreeDef' not in str(e.value)
  fewer = {'params': {k: v for k, v in variables['params'].items()
                      if k != 'norm'}}
  with pytest.raises(yax.SubstitutionError,
                     match=re.escape("args[0]['params']['norm']['bias'] is "
                                     'missing (expected f32[8])')):
    yax.lora(mox, fewer)


@pytest.fixture(scope='module')
def gpt2():
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  model = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16,
                                         n_embd=16, n_layer=1, n_head=2),
                              seed=0)
  ids = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
  return model, ids, yax.make_mox(model)(ids, params=model.params)


def suggested_xpaths(message):
  return [line.strip() for line in message.splitlines()
          if line.startswith('  //') or line.startswith('  (')]


def test_default_selection_adapts_gpt2_linear_layers(gpt2):
  # Before: the default (Dense) adapted only the tied lm_head.
  model, ids, mox = gpt2
  res = yax.lora(mox, model.params, rank=2, dora=True)
  yax.check_mox(res.mox)
  assert res.paths == [('transformer', 'h', '0', block, name)
                       for block, name in (('attn', 'c_attn'),
                                           ('attn', 'c_proj'),
                                           ('mlp', 'c_fc'), ('mlp', 'c_proj'))]
  t = trained_like(res.params, res.mask)
  lora_out = yax.eval_mox(res.mox, ids, params=t).logits
  merged = res.merge(t)  # DoRA on Conv1D's transposed kernel, folded
  np.testing.assert_allclose(model(ids, params=merged).logits, lora_out,
                             rtol=1e-4, atol=1e-4)


def test_refusals_suggest_xpaths_that_select_something(gpt2):
  # Before: lora on LayerNorms only, and merge of a tied lm_head adapted
  # alone, suggested XPaths that select nothing.
  model, _, mox = gpt2
  norms = '//module_call[@type="LayerNorm"]'
  with pytest.raises(yax.SubstitutionError) as e:
    yax.lora(mox, model.params, norms)
  assert 'No selection is suggested' in str(e.value)
  res = yax.lora(mox, model.params, '//module_call[@type="Dense"]', rank=2)
  assert res.paths == [('lm_head',)]
  with pytest.raises(yax.SubstitutionError) as e:
    res.merge(res.params)
  assert 'No selection is suggested' in str(e.value)
  mixed = '//module_call[@type="FlaxConv1D" or @type="LayerNorm"]'
  with pytest.raises(yax.SubstitutionError) as e:
    yax.lora(mox, model.params, mixed)
  (fixed,) = suggested_xpaths(str(e.value))
  assert len(yax.query(fixed, mox)) == 4
  assert len(yax.lora(mox, model.params, fixed, rank=2).paths) == 4
