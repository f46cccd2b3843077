"""yax.keep: a rewrite recorded once, the rewritten model called at any
shape and mode (batch, sequence length, train flags, a static cache
length), eagerly and under jit/grad/vmap. Every output is compared with the
same Flax model run on weights adapted by hand (``kernel + s * A @ B``)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import yax
from helpers import assert_trees_close, check_rewrite, trained_adapters

RANK, ALPHA = 2, 4.0
DENSE = '//module_call[@type="Dense"]'


class Block(nn.Module):
  """Dense layers over [batch, seq, features], dropout in train mode."""
  act: callable = nn.gelu

  @nn.compact
  def __call__(self, x, train: bool = False):
    h = self.act(nn.Dense(8, name='up')(x))
    h = nn.Dropout(0.5, deterministic=not train)(h)
    return nn.Dense(3, name='down')(h.mean(axis=1))


def _by_hand(params, scale=ALPHA / RANK):
  """The adapted weights written out: ``kernel + scale * A @ B`` in each
  module holding adapters, the adapters removed."""
  out = {}
  for name, leaves in params['params'].items():
    leaves = dict(leaves)
    if 'lora_a' in leaves:
      a, b = leaves.pop('lora_a'), leaves.pop('lora_b')
      leaves['kernel'] = leaves['kernel'] + scale * a @ b
    out[name] = leaves
  return {'params': out}


@pytest.fixture(scope='module')
def block():
  model = Block()
  x = jnp.ones((2, 5, 4))
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = yax.lora(mox, variables, DENSE, rank=RANK, alpha=ALPHA)
  trained = trained_adapters(res.params, res.mask)
  return model, variables, res, trained


def _x(batch, seq, seed=0):
  return jax.random.normal(jax.random.key(seed), (batch, seq, 4))


def test_any_batch_and_sequence_length(block):
  model, _, res, trained = block
  kept = yax.keep(model.apply, res.recipe)
  want_params = _by_hand(trained)
  for batch, seq in [(2, 5), (7, 3), (1, 11)]:
    x = _x(batch, seq)
    assert_trees_close(kept(trained, x), model.apply(want_params, x))
    check_rewrite(kept.mox(trained, x))
  assert kept.cache_size == 3
  kept(trained, _x(7, 3, seed=1))  # a known signature: no new trace
  assert kept.cache_size == 3


def test_train_mode_with_dropout_rngs(block):
  model, _, res, trained = block
  kept = yax.keep(model.apply, res.recipe)
  x, rng = _x(3, 4), jax.random.key(7)
  got = kept(trained, x, train=True, rngs={'dropout': rng})
  want = model.apply(_by_hand(trained), x, train=True,
                     rngs={'dropout': rng})
  assert_trees_close(got, want)
  # The same shapes in the other mode are another signature.
  assert_trees_close(kept(trained, x), model.apply(_by_hand(trained), x))
  assert kept.cache_size == 2


def test_jit_grad_vmap(block):
  model, _, res, trained = block
  kept = yax.keep(model.apply, res.recipe)
  x = _x(4, 6)
  want = model.apply(_by_hand(trained), x)
  assert_trees_close(jax.jit(kept)(trained, x), want)
  # vmap over examples: traced at the per-example shape [6, 4]... as a
  # batch of one row each.
  xs = _x(3, 6).reshape(3, 1, 6, 4)
  got = jax.vmap(kept, in_axes=(None, 0))(trained, xs)
  want_v = jax.vmap(lambda xi: model.apply(_by_hand(trained), xi))(xs)
  assert_trees_close(got, want_v)

  def loss(ab, apply):
    p = jax.tree.map(lambda v: v, trained)
    p['params']['up'] = {**p['params']['up'], 'lora_a': ab[0],
                         'lora_b': ab[1]}
    return jnp.sum(apply(p, x) ** 2)

  up = trained['params']['up']
  ab = (up['lora_a'], up['lora_b'])
  got = jax.jit(jax.grad(lambda ab: loss(ab, kept)))(ab)
  want = jax.grad(lambda ab: loss(
      ab, lambda p, x: model.apply(_by_hand(p), x)))(ab)
  assert_trees_close(got, want, rtol=1e-4, atol=1e-5)


@settings(max_examples=3, deadline=None)
@given(batch=st.integers(1, 6), seq=st.integers(1, 9))
def test_property_any_shape_equals_hand_merged(block, batch, seq):
  model, _, res, trained = block
  kept = yax.keep(model.apply, res.recipe)
  x = _x(batch, seq, seed=batch * 10 + seq)
  assert_trees_close(kept(trained, x), model.apply(_by_hand(trained), x))


def test_composed_recipe_sub_then_lora():
  """A user recipe (GELU -> SiLU by ``yax.sub``) composed with lora, at a
  new batch size: the Flax model built with SiLU, adapted by hand."""
  model = Block()
  x = jnp.ones((2, 5, 4))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  swap = yax.recipe(lambda m: yax.sub(yax.match(nn.gelu, m),
                                      yax.trace_like(jax.nn.silu), m))
  swapped = swap.apply(mox, variables)
  res = yax.lora(swapped.mox, swapped.params, DENSE, rank=RANK, alpha=ALPHA)
  trained = trained_adapters(res.params, res.mask)
  kept = yax.keep(model.apply, swapped.recipe + res.recipe)
  x9 = _x(9, 2)
  want = Block(act=jax.nn.silu).apply(_by_hand(trained), x9)
  assert not np.allclose(want, model.apply(_by_hand(trained), x9))
  assert_trees_close(kept(trained, x9), want)
  check_rewrite(kept.mox(trained, x9))


def test_quantize_then_lora_recipe_at_new_batch():
  """QLoRA kept: int8 kernels (quantized by hand here: symmetric absmax
  per output channel, as SPEC says) plus adapters, at a batch size the tree was not traced with."""
  model = Block()
  x = jnp.ones((2, 5, 4))
  variables = model.init(jax.random.key(2), x)
  mox = yax.make_mox(model.apply)(variables, x)
  q = yax.quantize(mox, variables, DENSE, weight='int8')
  res = yax.lora(q.mox, q.params, DENSE, rank=RANK, alpha=ALPHA)
  trained = trained_adapters(res.params, res.mask)
  kept = yax.keep(model.apply, q.recipe + res.recipe)
  x6 = _x(6, 3)
  floats = {}
  for name, leaves in trained['params'].items():
    w = np.asarray(variables['params'][name]['kernel'], np.float32)
    scale = np.abs(w).max(axis=0, keepdims=True) / 127  # symmetric absmax
    qw = np.clip(np.round(w / scale), -127, 127) * scale
    floats[name] = {'bias': leaves['bias'], 'kernel': jnp.asarray(qw),
                    'lora_a': leaves['lora_a'], 'lora_b': leaves['lora_b']}
  want = model.apply(_by_hand({'params': floats}), x6)
  assert_trees_close(kept(trained, x6), want, rtol=1e-4, atol=1e-4)
  check_rewrite(kept.mox(trained, x6))


class Cached(nn.Module):
  """Writes x into a zero cache of a static length, as a KV cache."""

  @nn.compact
  def __call__(self, x, length: int):
    cache = jnp.zeros((x.shape[0], length, x.shape[-1]), x.dtype)
    cache = jax.lax.dynamic_update_slice(cache, x, (0, 0, 0))
    return nn.Dense(2, name='proj')(cache)


def test_static_cache_length():
  model = Cached()
  x = jnp.ones((2, 3, 4))
  variables = model.init(jax.random.key(0), x, 5)
  mox = yax.make_mox(lambda v, x: model.apply(v, x, 5))(variables, x)
  res = yax.lora(mox, variables, DENSE, rank=RANK, alpha=ALPHA)
  trained = trained_adapters(res.params, res.mask)
  kept = yax.keep(model.apply, res.recipe, static_argnums=(2,))
  for length in (5, 9):
    got = kept(trained, _x(1, 3), length)
    want = model.apply(_by_hand(trained), _x(1, 3), length)
    assert got.shape == (1, length, 2)
    assert_trees_close(got, want)
  assert kept.cache_size == 2


class Optional(nn.Module):
  """A Dense layer called in train mode only."""

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Dense(4, name='always')(x)
    if train:
      x = nn.Dense(4, name='train_only')(x)
    return x


def test_replay_that_makes_other_variables_names_the_path():
  model = Optional()
  x = jnp.ones((2, 4))
  variables = model.init(jax.random.key(0), x, train=True)
  mox = yax.make_mox(lambda v, x: model.apply(v, x, train=True))(variables, x)
  res = yax.lora(mox, variables, DENSE, rank=RANK, alpha=ALPHA)
  kept = yax.keep(model.apply, res.recipe)
  assert_trees_close(kept(res.params, x, train=True),
                     model.apply(_by_hand(res.params), x, train=True))
  # Without train, the recipe adapts 'always' only: the adapters of
  # 'train_only' would have no place in the tree.
  with pytest.raises(yax.SignatureError,
                     match=r"\['train_only'\]\['lora_a'\] is unexpected"):
    kept(res.params, x)


def test_params_of_another_rank_are_refused(block):
  model, variables, res, _ = block
  other = yax.lora(yax.make_mox(model.apply)(variables, _x(2, 5)),
                   variables, DENSE, rank=RANK + 1)
  kept = yax.keep(model.apply, res.recipe)
  with pytest.raises(yax.SignatureError, match=(
      r"args\[0\]\['params'\]\['down'\]\['lora_a'\] differs\n"
      r"  expected: f32\[8,2\]\n  given:    f32\[8,3\]")):
    kept(other.params, _x(3, 5))


def test_recipe_of_a_function_needs_a_tree_result():
  model = Block()
  x = jnp.ones((2, 5, 4))
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  bad = yax.recipe(lambda m, p: 'not a tree')
  with pytest.raises(yax.SubstitutionError,
                     match='expected a Mox or a result with .mox'):
    bad.apply(mox, variables)


def test_eval_mox_on_a_symbolic_trace_points_to_keep():
  """Before: 'expected f32[b,4], given f32[7,4]' and nothing else."""
  model = nn.Dense(3)
  variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
  (b,) = jax.export.symbolic_shape('b')
  mox = yax.make_mox(model.apply)(
      variables, jax.ShapeDtypeStruct((b, 4), jnp.float32))
  with pytest.raises(yax.SignatureError, match=(
      r'(?s)expected: f32\[b,4\], a symbolic shape.*given:    f32\[7,4\].*'
      r'yax\.keep\(fn, res\.recipe\)')):
    yax.eval_mox(mox, variables, jnp.ones((7, 4)))


def test_a_recipe_that_reads_params_must_be_applied_first(block):
  model, variables, _, _ = block
  fresh = yax.recipe(lambda m, p: yax.lora(m, p, DENSE, rank=RANK))
  with pytest.raises(yax.SubstitutionError,
                     match=r'apply it to a traced tree first'):
    yax.keep(model.apply, fresh)
  mox = yax.make_mox(model.apply)(variables, _x(2, 5))
  applied = fresh.apply(mox, variables)
  kept = yax.keep(model.apply, applied.recipe)
  x = _x(3, 2)
  assert_trees_close(kept(applied.params, x),
                     model.apply(_by_hand(applied.params, 1.0 / RANK), x))


def test_nnx_split_form():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(4, 8, rngs=rngs)
      self.down = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x)))

  graphdef, state = nnx.split(Net(nnx.Rngs(0)))

  def apply(s, x):
    return nnx.merge(graphdef, s)(x)

  mox = yax.make_mox(apply)(state, jnp.ones((2, 4)))
  res = yax.lora(mox, state, '//module_call[@type="Linear"]', rank=RANK,
                 alpha=ALPHA)
  trained = trained_adapters(res.params, res.mask)
  kept = yax.keep(apply, res.recipe)
  reference = nnx.merge(graphdef, state)  # the plain model, weights by hand
  for name in ('up', 'down'):
    layer = trained[name]
    getattr(reference, name).kernel[...] = layer['kernel'][...] + (
        ALPHA / RANK * layer['lora_a'][...] @ layer['lora_b'][...])
  x = jax.random.normal(jax.random.key(3), (6, 4))
  want = reference(x)
  assert_trees_close(kept(trained, x), want)
