"""yax.lora on hand-made and Hugging Face Flax models."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import yax

os.environ.setdefault('USE_TORCH', '0')

SELF_ATTENTION = ('//module_call[@type="FlaxBertSelfAttention"]'
                  '/module_call[@type="Dense"]')


def close(a, b, tol=1e-5):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.fixture(scope='module')
def bert():
  from transformers import BertConfig, FlaxBertModel
  config = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=24,
                      max_position_embeddings=32)
  model = FlaxBertModel(config, seed=0)
  ids = jax.random.randint(jax.random.key(0), (2, 7), 0, 60)
  mox = yax.make_mox(model)(ids, params=model.params)
  return model, ids, mox


def test_bert_lora_identity_at_init_and_merge(bert):
  model, ids, mox = bert
  before = str(mox)
  res = yax.lora(mox, model.params, SELF_ATTENTION, rank=4, alpha=8.0,
                 key=jax.random.key(7))
  assert str(mox) == before
  assert len(res.paths) == 2 * 3  # query, key, value in 2 layers
  attn = res.params['encoder']['layer']['0']['attention']['self']
  assert attn['query']['lora_a'].shape == (16, 4)
  assert attn['query']['lora_b'].shape == (4, 16)
  assert not np.any(np.asarray(attn['query']['lora_b']))
  # mask: True exactly on adapters
  flat = jax.tree_util.tree_flatten_with_path(res.mask)[0]
  adapters = [jax.tree_util.keystr(k) for k, v in flat if v]
  assert len(adapters) == 12 and all('lora_' in a for a in adapters)
  assert jax.tree_util.tree_structure(res.mask) == jax.tree_util.tree_structure(
      res.params)
  ref = model(ids, params=model.params)
  out = yax.eval_mox(res.mox, ids, params=res.params)
  close(out.last_hidden_state, ref.last_hidden_state)
  # train the adapters a bit (by hand), then merge into plain BERT params
  trained = jax.tree_util.tree_map(
      lambda p, m: p + 0.05 * jnp.ones_like(p) if m else p, res.params, res.mask)
  lora_out = yax.eval_mox(res.mox, ids, params=trained)
  assert not np.allclose(lora_out.last_hidden_state, ref.last_hidden_state)
  merged = res.merge(trained)
  assert jax.tree_util.tree_structure(merged) == jax.tree_util.tree_structure(
      model.params)
  close(model(ids, params=merged).last_hidden_state,
        lora_out.last_hidden_state, tol=1e-4)


def test_bert_lora_optax_training_only_moves_adapters(bert):
  model, ids, mox = bert
  res = yax.lora(mox, model.params, SELF_ATTENTION, rank=2)
  target = jax.random.normal(jax.random.key(3), (2, 7, 16))

  def loss_fn(params):
    out = yax.eval_mox(res.mox, ids, params=params)
    return jnp.mean((out.last_hidden_state - target) ** 2)

  labels = jax.tree_util.tree_map(lambda m: 'train' if m else 'freeze',
                                  res.mask)
  tx = optax.multi_transform({'train': optax.adam(1e-2),
                              'freeze': optax.set_to_zero()}, labels)
  params = res.params
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(30):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  # LayerNorm bounds how far the output can move; the loss must still fall.
  assert losses[-1] < losses[0] - 0.01, losses
  frozen_before = jax.tree_util.tree_leaves(
      jax.tree_util.tree_map(lambda p, m: None if m else p, res.params,
                             res.mask))
  frozen_after = jax.tree_util.tree_leaves(
      jax.tree_util.tree_map(lambda p, m: None if m else p, params, res.mask))
  assert len(frozen_before) == len(frozen_after) > 0
  for a, b in zip(frozen_before, frozen_after):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  merged_out = model(ids, params=res.merge(params)).last_hidden_state
  close(merged_out, yax.eval_mox(res.mox, ids, params=params).last_hidden_state,
        tol=1e-4)


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm()(nn.Dense(6)(x))
    return nn.Dense(2)(nn.gelu(x))


@pytest.fixture(scope='module')
def net():
  model = Net()
  x = jax.random.normal(jax.random.key(0), (3, 4))
  variables = model.init(jax.random.key(1), x)
  return model, variables, x, yax.make_mox(model.apply)(variables, x)


def test_apply_style_all_dense(net):
  model, variables, x, mox = net
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=3,
                 alpha=3.0)
  assert set(res.params) == {'params'}
  assert set(res.params['params']['Dense_1']) == {'bias', 'kernel', 'lora_a',
                                                  'lora_b'}
  close(yax.eval_mox(res.mox, res.params, x), model.apply(variables, x))
  trained = jax.tree_util.tree_map(lambda p, m: p - 0.1 if m else p,
                                   res.params, res.mask)
  close(model.apply(res.merge(trained), x),
        yax.eval_mox(res.mox, trained, x))
  # the rewritten tree is still queryable: adapters wrap the Dense calls
  assert len(yax.query('//module_call[@type="LoRA"]/module_call[@type="Dense"]',
                       res.mox)) == 2


def test_lora_errors(net):
  _, variables, _, mox = net
  with pytest.raises(yax.SubstitutionError,
                     match=r"LayerNorm at path 'LayerNorm_0'.*no parameter of 2 or "
                           r"more axes that reaches a dot_general.*params/scale"):
    yax.lora(mox, variables, '//module_call[@type="LayerNorm"]')
  with pytest.raises(yax.SubstitutionError, match='matched no module call'):
    yax.lora(mox, variables, '//module_call[@type="Conv"]')
  with pytest.raises(yax.SubstitutionError, match='rank must be a positive'):
    yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=0)
  with pytest.raises(yax.SubstitutionError, match='structure of the traced'):
    yax.lora(mox, variables['params'], '//module_call[@type="Dense"]')
  with pytest.raises(yax.SubstitutionError, match='selects module calls'):
    yax.lora(mox, variables, '//dot_general')


def test_lora_without_params_argument():
  dense = nn.Dense(2)
  variables = dense.init(jax.random.key(0), jnp.ones((1, 4)))
  mox = yax.make_mox(lambda x: dense.apply(variables, x))(jnp.ones((1, 4)))
  with pytest.raises(yax.SubstitutionError, match="no 'params' collection"):
    yax.lora(mox, variables, '//module_call[@type="Dense"]')
