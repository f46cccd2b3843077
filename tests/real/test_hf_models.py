"""Real third-party Linen models: Flax models of transformers<5, from configs.

Random weights from a config only; nothing is downloaded.
"""

import os

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_FLAX', '1')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

import yax  # noqa: E402
from helpers import (  # noqa: E402
    assert_trees_close, assert_views_agree, jit_call, modules)

transformers = pytest.importorskip('transformers')

TOL = dict(rtol=1e-4, atol=1e-4)


def check_replay(model, args, kwargs, mox=None):
  """eval_mox == model eagerly and under jit; returns the tree."""
  mox = mox or yax.make_mox(model)(*args, **kwargs)
  expected = model(*args, **kwargs)
  assert_trees_close(yax.eval_mox(mox, *args, **kwargs), expected, **TOL)
  got = jit_call(lambda *a, **k: yax.eval_mox(mox, *a, **k), *args, **kwargs)
  assert_trees_close(got, expected, **TOL)
  assert type(got) is type(expected)
  return mox


# ----------------------------------------------------------------- BERT

@pytest.fixture(scope='module')
def bert():
  config = transformers.BertConfig(
      vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=37, max_position_embeddings=64)
  model = transformers.FlaxBertModel(config, seed=0)
  ids = (jnp.arange(16).reshape(2, 8) * 7) % 99
  mox = yax.make_mox(model)(ids, params=model.params)
  return model, ids, mox


def test_bert_tree(bert):
  model, ids, mox = bert
  assert mox.is_ephemeral
  assert mox.in_tree == jax.tree_util.tree_structure(
      ((ids,), {'params': model.params}))
  paths = [m.path for m in modules(mox, 'Dense')]
  assert ('encoder', 'layer', '0', 'attention', 'self', 'query') in paths
  assert ('encoder', 'layer', '1', 'output', 'dense') in paths
  assert ('pooler', 'dense') in paths
  (query,) = [m for m in modules(mox, 'Dense')
              if m.path == ('encoder', 'layer', '0', 'attention', 'self',
                            'query')]
  assert len(query.inputs) == 3
  kernel = model.params['encoder']['layer']['0']['attention']['self'][
      'query']['kernel']
  assert query.inputs[1].aval.shape == kernel.shape
  assert query.params['name'] == 'query' and query.params['features'] == 32
  # The query kernel symbol is the root input for that leaf.
  flat = jax.tree_util.tree_flatten_with_path(((ids,), {'params': model.params}))
  pos = [jax.tree_util.keystr(p) for p, _ in flat[0]].index(
      "[1]['params']['encoder']['layer']['0']['attention']['self']['query']"
      "['kernel']")
  assert query.inputs[1] is mox.inputs[pos]
  attention = modules(mox, 'FlaxBertSelfAttention')
  calls = [m for m in attention if m.entrypoint == '__call__']
  assert [m.path[:3] for m in calls] == [('encoder', 'layer', '0'),
                                         ('encoder', 'layer', '1')]
  # Helper methods the attention calls on itself are module calls too.
  helpers = {m.entrypoint for m in attention} - {'__call__'}
  assert '_split_heads' in helpers
  assert all(any(h in c.children for c in calls)
             for h in attention if h.entrypoint != '__call__')
  text = str(mox)
  assert 'type=FlaxBertSelfAttention' in text
  assert 'path=encoder/layer/0/attention/self/query' in text


def test_bert_replay(bert):
  model, ids, mox = bert
  check_replay(model, (ids,), {'params': model.params}, mox)
  assert assert_views_agree(mox) == len(modules(mox))


def test_bert_new_params_and_grad(bert):
  model, ids, mox = bert
  params = jax.tree_util.tree_map(lambda p: p * 0.5, model.params)
  assert_trees_close(yax.eval_mox(mox, ids, params=params),
                     model(ids, params=params), **TOL)
  loss = lambda f: lambda p: jnp.mean(f(ids, params=p).last_hidden_state ** 2)
  g_ref = jax.grad(loss(model))(model.params)
  g_mox = jax.grad(loss(lambda *a, **k: yax.eval_mox(mox, *a, **k)))(
      model.params)
  assert_trees_close(g_mox, g_ref, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------- ResNet

def static_args(node):
  return [s.value for s in node.arg_inputs
          if isinstance(s, yax.Literal) and s.is_static]


@pytest.fixture(scope='module')
def resnet():
  config = transformers.ResNetConfig(
      embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_channels=3)
  model = transformers.FlaxResNetModel(config, seed=0)
  images = jax.random.normal(jax.random.key(0), (1, 3, 32, 32))
  return model, images


def test_resnet_replay(resnet):
  model, images = resnet
  mox = check_replay(model, (images,), {'params': model.params})
  convs = modules(mox, 'Conv')
  assert convs and all(c.var_tree == jax.tree_util.tree_structure(
      {'params': {'kernel': 0}}) for c in convs)
  norms = modules(mox, 'BatchNorm')
  assert norms and all(static_args(n) == [True] for n in norms)
  assert all(n.num_vars == 4 for n in norms)
  assert assert_views_agree(mox) == len(modules(mox))


def test_resnet_train_mode_updates_batch_stats(resnet):
  model, images = resnet
  mox = check_replay(model, (images,), {'params': model.params, 'train': True})
  norms = modules(mox, 'BatchNorm')
  # HF passes `use_running_average=not train` at call time: a static input.
  assert norms and all(static_args(n) == [False] for n in norms)


# ------------------------------------------------------------------ GPT-2

def test_gpt2_replay():
  config = transformers.GPT2Config(vocab_size=99, n_positions=32, n_embd=32,
                                   n_layer=2, n_head=4)
  model = transformers.FlaxGPT2Model(config, seed=0)
  ids = (jnp.arange(12).reshape(2, 6) * 5) % 99
  mask = jnp.ones_like(ids).at[1, 4:].set(0)
  mox = check_replay(model, (ids,), {'params': model.params,
                                     'attention_mask': mask})
  paths = [m.path for m in modules(mox, 'FlaxConv1D')]
  assert ('h', '0', 'attn', 'c_attn') in paths
  assert assert_views_agree(mox) == len(modules(mox))


# ------------------------------------------------------------- lean_norm

def _lean_norm_check(model, mox, args, kwargs, norms, grads=True):
  """lean_norm on a Hugging Face model: outputs within float rounding,
  gradients equal to jax.grad of the plain model (``grads``: compiling
  both gradients is the slow part), fewer saved residuals."""
  from helpers import check_rewrite, saved_residuals
  new = check_rewrite(yax.lean_norm(mox))
  # Each norm keeps its call (type LayerNorm, path), marked lean="norm".
  lean_calls = modules(new, 'LayerNorm')
  assert [n.path for n in lean_calls] == [n.path for n in modules(
      mox, 'LayerNorm')]
  assert len(lean_calls) == norms
  assert all(n.params['lean'] == 'norm' for n in lean_calls)
  mine = lambda *a, **k: yax.eval_mox(new, *a, **k)
  assert_trees_close(jax.jit(mine)(*args, **kwargs), model(*args, **kwargs),
                     **TOL)

  def loss(f):
    return lambda p: jnp.sum(jnp.sin(f(*args, **{**kwargs, 'params': p})
                                     .last_hidden_state))

  # Scales and biases away from 1 and 0, so their gradients matter.
  leaves, tree = jax.tree_util.tree_flatten(kwargs['params'])
  keys = jax.random.split(jax.random.key(3), len(leaves))
  params = jax.tree_util.tree_unflatten(tree, [
      a + 0.1 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])
  if grads:
    assert_trees_close(jax.jit(jax.grad(loss(mine)))(params),
                       jax.jit(jax.grad(loss(model)))(params), rtol=1e-3,
                       atol=1e-5)
  lean = saved_residuals(loss(mine), params)
  plain = saved_residuals(loss(model), params)
  assert len(lean) < len(plain) - norms, (lean, plain)  # fewer per norm
  return len(lean), len(plain)


def test_bert_lean_norm(bert):
  model, ids, mox = bert
  # Embeddings' LayerNorm, then two per layer.
  _lean_norm_check(model, mox, (ids,), {'params': model.params}, 5)


def test_gpt2_lean_norm():
  config = transformers.GPT2Config(vocab_size=99, n_positions=32, n_embd=32,
                                   n_layer=2, n_head=4)
  model = transformers.FlaxGPT2Model(config, seed=0)
  ids = (jnp.arange(12).reshape(2, 6) * 5) % 99
  kwargs = {'params': model.params}
  mox = yax.make_mox(model)(ids, **kwargs)
  # ln_1, ln_2 per block and ln_f; the same nn.LayerNorm as BERT's, whose
  # gradients test_bert_lean_norm compares.
  _lean_norm_check(model, mox, (ids,), kwargs, 5, grads=False)
