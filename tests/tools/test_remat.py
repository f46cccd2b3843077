"""yax.remat against the same models written with nn.remat / nnx.remat and
Hugging Face's gradient_checkpointing=True: outputs, gradients, the
residuals JAX saves for the backward pass, and XLA's memory analysis."""

from __future__ import annotations

import io

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import yax
from helpers import (assert_trees_close, check_rewrite, equations, modules,
                     saved_residuals)


def xla_memory(fn, *args) -> tuple:
  """XLA's memory analysis of the compiled gradient of ``fn``."""
  m = jax.jit(jax.grad(fn)).lower(*args).compile().memory_analysis()
  return (m.argument_size_in_bytes, m.output_size_in_bytes,
          m.temp_size_in_bytes, m.alias_size_in_bytes)


def xml(mox) -> str:
  buf = io.StringIO()
  yax.dump_xml(mox, buf)
  return buf.getvalue()


class Block(nn.Module):
  save: bool = False  # the reference for save=: names the Dense outputs

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    if self.save:
      h = jax.ad_checkpoint.checkpoint_name(h, 'h')
    y = nn.Dense(8)(jnp.tanh(jax.nn.gelu(h)))
    if self.save:
      y = jax.ad_checkpoint.checkpoint_name(y, 'y')
    return x + jnp.sin(y)


class Stack(nn.Module):
  remat: bool = False
  policy: object = None
  save: bool = False

  @nn.compact
  def __call__(self, x):
    block = nn.remat(Block, policy=self.policy) if self.remat else Block
    for i in range(2):
      x = block(save=self.save, name=f'block{i}')(x)
    return nn.Dense(3)(x)


X = jax.random.normal(jax.random.key(1), (4, 6, 8))
STACK = Stack()
VARS = STACK.init(jax.random.key(0), X)


def loss_of(apply):
  return lambda v, x: jnp.sum(jnp.cos(apply(v, x)))


def assert_same_training(new, ref_apply, v=VARS, x=X):
  """``new`` gives ``ref_apply``'s outputs, gradients and saved residuals;
  returns both losses of ``(v, x)``."""
  mine = loss_of(lambda v, x: yax.eval_mox(new, v, x))
  theirs = loss_of(ref_apply)
  assert_trees_close(yax.eval_mox(new, v, x), ref_apply(v, x))
  assert_trees_close(jax.grad(mine)(v, x), jax.grad(theirs)(v, x),
                     rtol=1e-5, atol=1e-6)
  assert saved_residuals(mine, v, x) == saved_residuals(theirs, v, x)
  return mine, theirs


@pytest.fixture(scope='module')
def stack_mox():
  return yax.make_mox(STACK.apply)(VARS, X)


@pytest.mark.parametrize('policy', [
    None, 'dots_saveable', jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'everything_saveable'])
def test_remat_equals_nn_remat(stack_mox, policy):
  before = xml(stack_mox)
  new = check_rewrite(yax.remat(stack_mox, '//module_call[@type="Block"]',
                               policy=policy))
  assert xml(stack_mox) == before  # mox unchanged
  fn = policy if not isinstance(policy, str) else getattr(
      jax.checkpoint_policies, policy)
  mine, theirs = assert_same_training(new, Stack(remat=True, policy=fn).apply)
  assert xla_memory(mine, VARS, X) == xla_memory(theirs, VARS, X)
  # Remat changes what is kept: without a policy only the inputs are.
  if policy is None:
    plain = loss_of(STACK.apply)
    assert len(saved_residuals(mine, VARS, X)) < len(
        saved_residuals(plain, VARS, X))


def test_remat_shows_its_policy_in_xml(stack_mox):
  new = yax.remat(stack_mox, '//module_call[@type="Block"]',
                  policy='dots_saveable')
  assert xml(new).count('remat="dots_saveable"') == 2
  assert len(yax.query('//module_call[@remat="dots_saveable"]', new)) == 2
  new = yax.remat(stack_mox, '//module_call[@type="Block"]')
  assert xml(new).count('remat="nothing_saveable"') == 2
  # The calls keep their type, path and variables.
  assert [m.path for m in modules(new, 'Block')] == [('block0',), ('block1',)]


def test_save_keeps_the_selected_outputs(stack_mox):
  new = check_rewrite(yax.remat(stack_mox, '//module_call[@type="Block"]',
                                save='//module_call[@type="Dense"]'))
  ref = Stack(remat=True, save=True,
              policy=jax.checkpoint_policies.save_only_these_names('h', 'y'))
  mine = loss_of(lambda v, x: yax.eval_mox(new, v, x))
  theirs = loss_of(ref.apply)
  assert_trees_close(jax.grad(mine)(VARS, X), jax.grad(theirs)(VARS, X),
                     rtol=1e-5, atol=1e-6)
  got = saved_residuals(mine, VARS, X)
  assert got == saved_residuals(theirs, VARS, X)
  assert got.count('f32[4,6,16]') == 2 and got.count('f32[4,6,8]') >= 2
  assert xla_memory(mine, VARS, X) == xla_memory(theirs, VARS, X)
  assert len(equations(new, prim='name')) == 4


class NamedTanhBlock(nn.Module):
  """Block naming its last tanh: the reference for save= on an equation."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    t = jax.ad_checkpoint.checkpoint_name(jnp.tanh(jax.nn.gelu(h)), 't')
    return x + jnp.sin(nn.Dense(8)(t))


class NamedTanhStack(nn.Module):

  @nn.compact
  def __call__(self, x):
    policy = jax.checkpoint_policies.save_only_these_names('t')
    for i in range(2):
      x = nn.remat(NamedTanhBlock, policy=policy)(name=f'block{i}')(x)
    return nn.Dense(3)(x)


def test_save_keeps_an_equation_output(stack_mox):
  new = check_rewrite(yax.remat(
      stack_mox, '//module_call[@type="Block"]',
      save='//module_call[@type="Block"]/tanh[last()]'))
  mine = loss_of(lambda v, x: yax.eval_mox(new, v, x))
  theirs = loss_of(NamedTanhStack().apply)
  assert_trees_close(jax.grad(mine)(VARS, X), jax.grad(theirs)(VARS, X),
                     rtol=1e-5, atol=1e-6)
  assert saved_residuals(mine, VARS, X) == saved_residuals(theirs, VARS, X)
  assert xla_memory(mine, VARS, X) == xla_memory(theirs, VARS, X)


def test_refusals(stack_mox):
  with pytest.raises(yax.SubstitutionError, match='unknown policy'):
    yax.remat(stack_mox, '//module_call[@type="Block"]', policy='dots')
  with pytest.raises(yax.SubstitutionError, match='remat applies to module'):
    yax.remat(stack_mox, '//tanh')
  with pytest.raises(yax.SubstitutionError, match='selects no node inside'):
    yax.remat(stack_mox, '//module_call[@name="block0"]',
              save='//module_call[@path="block1/Dense_0"]')
  with pytest.raises(yax.SubstitutionError, match='matched no'):
    yax.remat(stack_mox, '//module_call[@type="Conv"]')


def test_remat_under_jit_vmap_and_grad(stack_mox):
  new = yax.remat(stack_mox, '//module_call[@type="Block"]')
  ref = Stack(remat=True)
  xs = jnp.stack([X, 2 * X])
  got = jax.jit(jax.vmap(lambda x: yax.eval_mox(new, VARS, x)))(xs)
  assert_trees_close(got, jax.vmap(lambda x: ref.apply(VARS, x))(xs),
                     rtol=1e-5, atol=1e-6)
  g = jax.jit(jax.vmap(jax.grad(loss_of(lambda v, x: yax.eval_mox(new, v, x))),
                       (None, 0)))(VARS, xs)
  r = jax.jit(jax.vmap(jax.grad(loss_of(ref.apply)), (None, 0)))(VARS, xs)
  # Both sides compiled; XLA may still order float32 sums differently.
  assert_trees_close(g, r, rtol=1e-4, atol=1e-5)


class Scanned(nn.Module):
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    block = nn.remat(Block) if self.remat else Block
    body = nn.scan(lambda m, c, _: (m(c), None), variable_axes={'params': 0},
                   split_rngs={'params': True}, length=3)
    x, _ = body(block(name='layers'), x, None)
    return x


def test_remat_inside_an_nn_scan_body():
  model = Scanned()
  v = model.init(jax.random.key(0), X)
  mox = yax.make_mox(model.apply)(v, X)
  new = check_rewrite(yax.remat(mox, '//module_call[@type="Block"]'))
  ref = Scanned(remat=True)
  mine = loss_of(lambda v, x: yax.eval_mox(new, v, x))
  theirs = loss_of(ref.apply)
  assert_trees_close(jax.grad(mine)(v, X), jax.grad(theirs)(v, X),
                     rtol=1e-5, atol=1e-6)
  assert saved_residuals(mine, v, X) == saved_residuals(theirs, v, X)
  assert xla_memory(mine, v, X) == xla_memory(theirs, v, X)


class DenseRematBlock(nn.Module):
  """Block with its first Dense under nn.remat: the reference for yax.remat
  of a call inside an nn.remat body."""

  @nn.compact
  def __call__(self, x):
    h = nn.remat(nn.Dense)(16, name='Dense_0')(x)
    y = nn.Dense(8, name='Dense_1')(jnp.tanh(jax.nn.gelu(h)))
    return x + jnp.sin(y)


class RematStack(nn.Module):
  inner: bool = False  # the reference: nn.remat inside nn.remat

  @nn.compact
  def __call__(self, x):
    block = nn.remat(DenseRematBlock if self.inner else Block)
    for i in range(2):
      x = block(name=f'block{i}')(x)
    return nn.Dense(3)(x)


def test_remat_inside_an_nn_remat_body():
  model = RematStack()
  mox = yax.make_mox(model.apply)(VARS, X)
  new = check_rewrite(yax.remat(
      mox, '//module_call[@type="Dense" and @name="Dense_0" and '
      'ancestor::module_call[@type="Block"]]'))
  assert xml(new).count('remat="nothing_saveable"') == 2
  assert_same_training(new, RematStack(inner=True).apply)


class NBlock(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(8, 16, rngs=rngs)
    self.fc2 = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    return x + jnp.sin(self.fc2(jnp.tanh(jax.nn.gelu(self.fc1(x)))))


class NStack(nnx.Module):
  def __init__(self, rngs, remat=False):
    self.blocks = nnx.List([NBlock(rngs) for _ in range(2)])
    self.remat = remat

  def __call__(self, x):
    for block in self.blocks:
      if self.remat:
        x = nnx.remat(lambda b, x: b(x))(block, x)
      else:
        x = block(x)
    return x


def test_remat_equals_nnx_remat():
  model = NStack(nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  ref_def, _ = nnx.split(NStack(nnx.Rngs(0), remat=True))

  def plain(state, x):
    return nnx.merge(graphdef, state)(x)

  def reference(state, x):
    return nnx.merge(ref_def, state)(x)

  mox = yax.make_mox(plain)(state, X)
  new = check_rewrite(yax.remat(mox, '//module_call[@type="NBlock"]'))
  mine, theirs = assert_same_training(new, reference, state)
  assert xla_memory(mine, state, X) == xla_memory(theirs, state, X)


def test_remat_equals_hugging_face_gradient_checkpointing():
  from transformers import BertConfig, FlaxBertModel
  config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=37,
                      max_position_embeddings=64)
  model = FlaxBertModel(config, seed=0)
  ref = FlaxBertModel(config, seed=0, gradient_checkpointing=True)
  ids = (jnp.arange(16, dtype=jnp.int32).reshape(2, 8) * 7) % 99

  def plain(p, ids):
    return model(ids, params=p).last_hidden_state

  mox = yax.make_mox(plain)(model.params, ids)
  new = check_rewrite(yax.remat(mox, '//module_call[@type="FlaxBertLayer"]'))
  mine = lambda p, ids: jnp.sum(jnp.cos(yax.eval_mox(new, p, ids)))
  theirs = lambda p, ids: jnp.sum(jnp.cos(
      ref(ids, params=p).last_hidden_state))
  assert_trees_close(jax.grad(mine)(model.params, ids),
                     jax.grad(theirs)(model.params, ids), rtol=1e-4, atol=1e-5)
  assert saved_residuals(mine, model.params, ids) == saved_residuals(
      theirs, model.params, ids)
  assert xla_memory(mine, model.params, ids) == xla_memory(
      theirs, model.params, ids)


def test_remat_after_lora_quantize_and_fewbit(stack_mox):
  """lora and quantize add variables, which leaves the enclosing calls
  without a Flax class (ephemeral): remat selects them by path. QLoRA +
  few-bit + remat is the memory-lean fine-tune."""
  lo = yax.lora(stack_mox, VARS, '//module_call[@type="Dense"]', rank=2)
  blocks = '//module_call[@path="block0" or @path="block1"]'
  new = check_rewrite(yax.remat(lo.mox, blocks))
  assert len(yax.query('//module_call[@remat="nothing_saveable"]', new)) == 2
  mine = loss_of(lambda p, x: yax.eval_mox(new, p, x))
  plain = loss_of(lambda p, x: yax.eval_mox(lo.mox, p, x))
  assert_trees_close(jax.grad(mine)(lo.params, X), jax.grad(plain)(lo.params, X),
                     rtol=1e-5, atol=1e-6)
  assert len(saved_residuals(mine, lo.params, X)) < len(
      saved_residuals(plain, lo.params, X))
  q = yax.quantize(stack_mox, VARS, '//module_call[@type="Dense"]')
  qlora = yax.lora(q.mox, q.params, '//module_call[@type="Dense"]', rank=2)
  lean = check_rewrite(yax.remat(yax.fewbit(qlora.mox), blocks))
  ref = yax.fewbit(qlora.mox)
  np.testing.assert_array_equal(yax.eval_mox(lean, qlora.params, X),
                                yax.eval_mox(ref, qlora.params, X))
  f_lean = lambda x: jnp.sum(jnp.cos(yax.eval_mox(lean, qlora.params, x)))
  f_ref = lambda x: jnp.sum(jnp.cos(yax.eval_mox(ref, qlora.params, x)))
  assert_trees_close(jax.grad(f_lean)(X), jax.grad(f_ref)(X), rtol=1e-5,
                     atol=1e-6)
  # Activations (the [4, 6, ...] values) kept: the two block inputs only.
  acts = lambda f: [t for t in saved_residuals(f, X) if t.startswith('f32[4,6,')]
  assert len(acts(f_lean)) < len(acts(f_ref))


# ------------------------------------------------- state and host values

class BNBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.BatchNorm(use_running_average=False, name='bn')(
        nn.Dense(8, name='fc')(x))
    return x + jnp.tanh(h)


class BNNet(nn.Module):
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    block = nn.remat(BNBlock) if self.remat else BNBlock
    return nn.Dense(3)(block(name='block')(x))


def test_remat_of_a_call_that_updates_batch_stats_equals_nn_remat():
  """A BatchNorm's new statistics are computed in the call's body and
  read by the root (mutable=['batch_stats']) without being outputs of the
  call. Failed before: check_mox 'reads output 1 ... before it is
  defined', and eval_mox raised a raw KeyError."""
  x = jax.random.normal(jax.random.key(2), (4, 8))
  v = BNNet().init(jax.random.key(0), x)
  apply = lambda remat: lambda v, x: BNNet(remat=remat).apply(
      v, x, mutable=['batch_stats'])
  mox = yax.make_mox(apply(False))(v, x)
  new = check_rewrite(yax.remat(mox, '//module_call[@type="BNBlock"]'))
  assert_trees_close(yax.eval_mox(new, v, x), apply(True)(v, x))
  loss = lambda f: lambda p: jnp.sum(jnp.cos(f({**v, 'params': p}, x)[0]))
  mine = loss(lambda *a: yax.eval_mox(new, *a))
  theirs = loss(apply(True))
  assert_trees_close(jax.grad(mine)(v['params']),
                     jax.grad(theirs)(v['params']), rtol=1e-5, atol=1e-6)
  assert saved_residuals(mine, v['params']) == saved_residuals(
      theirs, v['params'])


class NStateBlock(nnx.Module):
  """Updates state: BatchNorm statistics and the Dropout RNG count."""

  def __init__(self, rngs):
    self.fc = nnx.Linear(8, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(self.bn(self.fc(x)))


class NStateNet(nnx.Module):
  def __init__(self, rngs, remat=False):
    self.block = NStateBlock(rngs)
    self.remat = remat

  def __call__(self, x):
    if self.remat:
      return nnx.remat(lambda b, x: b(x))(self.block, x)
    return self.block(x)


def _key_data(tree):
  """Typed PRNG keys as their data (assert_trees_close compares arrays)."""
  return jax.tree.map(
      lambda a: jax.random.key_data(a)
      if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a, tree)


@pytest.mark.parametrize('form', ['module', 'split'])
def test_remat_of_an_nnx_call_that_updates_state_equals_nnx_remat(form):
  """NNX BatchNorm statistics and Dropout RNG counts, in the module and
  the split form. Failed before as with Linen (check_mox, raw KeyError)."""
  x = jax.random.normal(jax.random.key(2), (4, 8))
  model = NStateNet(nnx.Rngs(0, dropout=1))
  ref = NStateNet(nnx.Rngs(0, dropout=1), remat=True)
  if form == 'module':
    mox = yax.make_mox(lambda m, x: m(x))(nnx.clone(model), x)
    new = check_rewrite(yax.remat(mox, '//module_call[@type="NStateBlock"]'))
    got_model = nnx.clone(model)
    got = yax.eval_mox(new, got_model, x)
    want = ref(x)
    assert_trees_close(got, want)
    assert_trees_close(_key_data(nnx.state(got_model)),
                       _key_data(nnx.state(ref)))
    return
  graphdef, state = nnx.split(model)
  ref_def, _ = nnx.split(ref)

  def run(graphdef):
    def fn(state, x):
      m = nnx.merge(graphdef, state)
      return m(x), nnx.state(m)
    return fn

  mox = yax.make_mox(run(graphdef))(state, x)
  new = check_rewrite(yax.remat(mox, '//module_call[@type="NStateBlock"]'))
  assert_trees_close(_key_data(yax.eval_mox(new, state, x)),
                     _key_data(run(ref_def)(state, x)))
  loss = lambda f: lambda s: jnp.sum(jnp.cos(f(s, x)[0]))
  floats = lambda g: [a for a in jax.tree.leaves(g)
                      if a.dtype != jax.dtypes.float0]
  grad = lambda f: floats(jax.grad(loss(f), allow_int=True)(state))
  got, want = grad(lambda *a: yax.eval_mox(new, *a)), grad(run(ref_def))
  assert len(got) == len(want) == 6  # fc, bn scale/bias, bn mean/var
  assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


class HostBlock(nn.Module):
  """Reads a NumPy constant it builds and host values it is given."""

  @nn.compact
  def __call__(self, x, scale, shift):
    c = np.linspace(0.5, 1.5, 8, dtype=np.float32)
    return jnp.tanh(nn.Dense(8)(x) * c * scale + shift)


class HostNet(nn.Module):
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    block = nn.remat(HostBlock) if self.remat else HostBlock
    x = block(name='b0')(x, 0.5, np.float32(0.25))
    return block(name='b1')(x, np.full(8, 2.0, np.float32), 1.0)


def test_remat_of_a_call_reading_numpy_and_host_values_equals_nn_remat():
  """Failed before: 'reads a value of type f32[8] that is neither an input
  of the call nor computed in it'; nn.remat runs the same module."""
  x = jax.random.normal(jax.random.key(2), (4, 8))
  v = HostNet().init(jax.random.key(0), x)
  mox = yax.make_mox(HostNet().apply)(v, x)
  new = check_rewrite(yax.remat(mox, '//module_call[@type="HostBlock"]'))
  assert len(mox.inputs) == len(new.inputs)
  assert_same_training(new, HostNet(remat=True).apply, v, x)


@pytest.mark.parametrize('factory', [
    'save_only_these_names', 'save_any_names_but_these',
    'save_from_both_policies',
    jax.checkpoint_policies.save_only_these_names])
def test_policy_factories_are_refused_up_front(stack_mox, factory):
  """A factory makes a policy from arguments. Failed before: accepted,
  then evaluation raised a wrapped TypeError."""
  with pytest.raises(yax.SubstitutionError, match='makes a policy from its'):
    yax.remat(stack_mox, '//module_call[@type="Block"]', policy=factory)
  # Called, it is a policy (as nn.remat takes it).
  policy = jax.checkpoint_policies.save_only_these_names('h')
  new = check_rewrite(yax.remat(stack_mox, '//module_call[@type="Block"]',
                                policy=policy))
  assert_trees_close(yax.eval_mox(new, VARS, X), STACK.apply(VARS, X))


def test_a_policy_object_shows_the_spec_name(stack_mox):
  """JAX keeps checkpoint_dots as an alias of dots_saveable; XML showed
  the alias for the object before."""
  for policy in (jax.checkpoint_policies.dots_saveable,
                 jax.checkpoint_policies.dots_with_no_batch_dims_saveable):
    new = yax.remat(stack_mox, '//module_call[@type="Block"]', policy=policy)
    assert xml(new).count(f'remat="{policy.__name__}"') == 2
  assert jax.checkpoint_policies.dots_saveable.__name__ == 'dots_saveable'


class DropBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x))


class DropNet(nn.Module):
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    block = nn.remat(DropBlock) if self.remat else DropBlock
    return nn.Dense(3)(block(name='block')(x))


def test_remat_of_a_block_drawing_a_dropout_key_equals_nn_remat():
  """rngs={'dropout': key}. Failed before: 'reads a value of type
  key<fry>[] that is neither an input of the call nor computed in it'."""
  x = jax.random.normal(jax.random.key(2), (4, 8))
  v = DropNet().init(jax.random.key(0), x)
  k = jax.random.key(5)
  apply = lambda remat: lambda v, x: DropNet(remat=remat).apply(
      v, x, rngs={'dropout': k})
  mox = yax.make_mox(lambda v, x, k: DropNet().apply(
      v, x, rngs={'dropout': k}))(v, x, k)
  new = check_rewrite(yax.remat(mox, '//module_call[@type="DropBlock"]'))
  mine = loss_of(lambda v, x: yax.eval_mox(new, v, x, k))
  theirs = loss_of(apply(True))
  assert_trees_close(yax.eval_mox(new, v, x, k), apply(True)(v, x))
  assert_trees_close(jax.grad(mine)(v, x), jax.grad(theirs)(v, x),
                     rtol=1e-5, atol=1e-6)
  assert saved_residuals(mine, v, x) == saved_residuals(theirs, v, x)
