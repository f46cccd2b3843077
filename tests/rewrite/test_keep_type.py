"""Calls keep their type: a module call that a rewrite gives variables
(``lora``, ``quantize`` inside it) keeps its type, path and fields in every
view, so selections written for the traced tree keep working after any
number of rewrites. Values are checked against the plain Flax model with
the adapters merged by hand."""

from __future__ import annotations

import io

import flax.linen as nn
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import yax
from helpers import check_rewrite


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    return x + nn.Dense(8)(jnp.tanh(h))


class Stack(nn.Module):

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Block(name=f'block{i}')(x)
    return nn.Dense(3)(x)


MODEL = Stack()
X = jax.random.normal(jax.random.key(1), (4, 8))
VARS = MODEL.init(jax.random.key(0), X)
BLOCKS = '//module_call[@type="Block"]'
INNER_DENSE = '//module_call[@type="Block"]//module_call[@type="Dense"]'


@pytest.fixture(scope='module')
def stack_mox():
  return yax.make_mox(MODEL.apply)(VARS, X)


def xml(mox) -> str:
  buf = io.StringIO()
  yax.dump_xml(mox, buf)
  return buf.getvalue()


def paths(xpath, mox):
  return sorted('/'.join(n.path) for n in yax.query(xpath, mox))


def with_random_b(params, key):
  """The adapters' ``B`` (zero after lora) set to small random values, so
  the adapters change the output."""
  leaves, tree = jax.tree_util.tree_flatten_with_path(params)
  out = []
  for i, (keypath, leaf) in enumerate(leaves):
    if str(keypath[-1].key).endswith('lora_b'):
      leaf = 0.1 * jax.random.normal(jax.random.fold_in(key, i), leaf.shape,
                                     leaf.dtype)
    out.append(leaf)
  return jax.tree_util.tree_unflatten(tree, out)


def merged_by_hand(params, scale):
  """Plain Flax params: each ``kernel`` with its adapters folded in,
  ``kernel + scale * lora_a @ lora_b``, adapters dropped."""
  def fold(d):
    if not isinstance(d, dict):
      return d
    d = {k: fold(v) for k, v in d.items()}
    if 'lora_a' in d:
      d['kernel'] = d['kernel'] + scale * d.pop('lora_a') @ d.pop('lora_b')
    return d
  return fold(jax.tree_util.tree_map(lambda x: x, dict(params)))


def test_enclosing_calls_keep_type_after_lora(stack_mox):
  """Before, the Blocks that gained adapters turned ephemeral: the query
  by type found nothing and the views showed no type."""
  lo = yax.lora(stack_mox, VARS, INNER_DENSE, rank=2)
  new = check_rewrite(lo.mox)
  assert paths(BLOCKS, new) == ['block0', 'block1']
  blocks = yax.query(BLOCKS, new)
  assert all(b.rewritten and b.rebuild_ty is None for b in blocks)
  # Untouched calls are not marked.
  head, = yax.query('//module_call[@path="Dense_0"]', new)
  assert not head.rewritten
  text = xml(new)
  assert text.count('type="Block"') == 2
  assert text.count('type="Stack"') == 1
  assert text.count('rewritten="true"') == 3  # the Blocks and the Stack
  assert 'type=Block' in str(new)
  rows = {r.path: r for r in yax.summary(new)}
  assert rows['block0'].module == 'Block' and rows['block1'].module == 'Block'
  # Both adapters of block0 count among the Block's params now.
  assert rows['block0'].params == (8 * 16 + 16 + 16 * 8 + 8
                                   + 8 * 2 + 2 * 16 + 16 * 2 + 2 * 8)


def test_remat_by_type_after_lora_on_hugging_face_bert():
  """The issue's case: ``remat`` of ``FlaxBertLayer`` after ``lora`` said
  "matched no module call"; by path it worked but showed type="Remat"."""
  from transformers import BertConfig, FlaxBertModel
  config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=20,
                      max_position_embeddings=16)
  model = FlaxBertModel(config, seed=0)
  ids = (jnp.arange(8, dtype=jnp.int32).reshape(2, 4) * 7) % 50
  mox = yax.make_mox(lambda p, ids: model(ids, params=p).last_hidden_state)(
      model.params, ids)
  lo = yax.lora(mox, model.params,
                '//module_call[@type="FlaxBertSelfAttention"]/module_call'
                '[@name="query" or @name="value"]', rank=2, alpha=2.0)
  new = check_rewrite(yax.remat(lo.mox,
                                '//module_call[@type="FlaxBertLayer"]'))
  layers = yax.query('//module_call[@type="FlaxBertLayer"]', new)
  assert [n.path for n in layers] == [('encoder', 'layer', '0'),
                                      ('encoder', 'layer', '1')]
  assert all(n.params['remat'] == 'nothing_saveable' for n in layers)
  assert 'type="Remat"' not in xml(new)
  params = with_random_b(lo.params, jax.random.key(5))
  merged = merged_by_hand(params, scale=1.0)

  mine = jax.jit(lambda p: yax.eval_mox(new, p, ids))
  np.testing.assert_allclose(
      mine(params), model(ids, params=merged).last_hidden_state, rtol=1e-5,
      atol=1e-5)


# Each rewrite selects by the traced tree's types only.
def _apply(op, mox, params):
  if op == 'lora':
    res = yax.lora(mox, params, INNER_DENSE, rank=2, alpha=2.0)
    return res.mox, with_random_b(res.params, jax.random.key(7))
  if op == 'quantize':
    res = yax.quantize(mox, params, '//module_call[@type="Block"]/'
                       '/module_call[@type="Dense"][@name="Dense_1"]')
    return res.mox, res.params
  if op == 'cast':  # the head
    return yax.cast(mox, '//module_call[@type="Dense"][@path="Dense_0"]',
                    compute='bfloat16'), params
  assert op == 'remat'
  return yax.remat(mox, BLOCKS), params


@hypothesis.settings(max_examples=6)
@hypothesis.given(order=st.lists(st.sampled_from(
    ['lora', 'quantize', 'cast', 'remat']), unique=True, min_size=2))
def test_selections_of_the_traced_tree_work_after_rewrites_in_any_order(
    order):
  mox = yax.make_mox(MODEL.apply)(VARS, X)
  dense = paths('//module_call[@type="Dense"]', mox)
  params = VARS
  for op in order:
    mox, params = _apply(op, mox, params)
    check_rewrite(mox)
    assert paths(BLOCKS, mox) == ['block0', 'block1'], op
    assert paths('//module_call[@type="Dense"]', mox) == dense, op
    assert '"Remat"' not in xml(mox)
  if 'remat' in order:
    assert len(yax.query('//module_call[@type="Block"][@remat]', mox)) == 2
  # Against the plain model with the adapters merged by hand; int8 and
  # bfloat16 make it close, not equal.
  ref_params = merged_by_hand(_float_params(params['params']), scale=1.0)
  np.testing.assert_allclose(
      yax.eval_mox(mox, params, X), MODEL.apply({'params': ref_params}, X),
      rtol=0.05, atol=0.05)
  # init_params fills what the rewrites added, given the traced weights.
  full = yax.init_params(mox, VARS, key=jax.random.key(3))
  assert jax.tree_util.tree_structure(full) == \
      jax.tree_util.tree_structure(params)
  # Fresh adapters (B = 0): the plain model's output.
  np.testing.assert_allclose(yax.eval_mox(mox, full, X), MODEL.apply(VARS, X),
                             rtol=0.05, atol=0.05)


def _float_params(p):
  """The traced float kernels in place of quantized ones."""
  out = dict(p)
  for block in ('block0', 'block1'):
    dense = {k: v for k, v in p[block]['Dense_1'].items()
             if k not in ('kernel', 'kernel_scale')}
    out[block] = {**p[block], 'Dense_1': {
        **dense, 'kernel': VARS['params'][block]['Dense_1']['kernel']}}
  return out
