"""A replacement that brings variables gets them per site, and
``yax.init_params`` fills them (SPEC: "New variables of a replacement").

ReLU -> PReLU at two sites gives two independent ``alpha``s (PReLU_0,
PReLU_1 under the enclosing module), compared with a Flax model written by
hand with PReLU modules at those paths; a module called twice gets one set
per site, read by both calls. Linen and NNX.
"""

from __future__ import annotations

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax

TOL = dict(rtol=1e-5, atol=1e-5)
X = jnp.linspace(-2.0, 2.0, 8).reshape(2, 4)


class PReLU(nn.Module):
  @nn.compact
  def __call__(self, x):
    alpha = self.param('alpha', nn.initializers.constant(0.25),
                       (x.shape[-1],))
    return jnp.where(x >= 0, x, alpha * x)


class MLP(nn.Module):
  act: object = nn.relu

  @nn.compact
  def __call__(self, x):
    h = self.act(nn.Dense(8)(x)) if self.act is nn.relu else PReLU(
        name='PReLU_0')(nn.Dense(8)(x))
    h = nn.relu(nn.Dense(8)(h)) if self.act is nn.relu else PReLU(
        name='PReLU_1')(nn.Dense(8)(h))
    return nn.Dense(3)(h)


def prelu_mox(width):
  module = PReLU()
  x = jnp.zeros((2, width))
  return yax.make_mox(module.apply)(module.init(jax.random.key(0), x), x)


def test_two_relus_to_prelu_give_two_independent_parameters():
  model = MLP()
  variables = model.init(jax.random.key(0), X)
  mox = yax.make_mox(model.apply)(variables, X)
  new = yax.sub('//*[@name="relu"]', prelu_mox(8), mox)
  yax.check_mox(new)
  full = yax.init_params(new, variables, key=jax.random.key(1))
  assert set(full['params']) == set(variables['params']) | {'PReLU_0',
                                                            'PReLU_1'}
  for name in ('PReLU_0', 'PReLU_1'):
    np.testing.assert_array_equal(full['params'][name]['alpha'],
                                  np.full((8,), 0.25, np.float32))
  # The originals are unchanged objects.
  assert full['params']['Dense_0']['kernel'] is \
      variables['params']['Dense_0']['kernel']
  # Independent: different alphas give what Flax computes with them.
  trained = jax.tree.map(lambda v: v, full)
  trained['params']['PReLU_0']['alpha'] = jnp.full((8,), 0.1)
  trained['params']['PReLU_1']['alpha'] = jnp.full((8,), -0.7)
  reference = MLP(act=PReLU)
  np.testing.assert_allclose(yax.eval_mox(new, trained, X),
                             reference.apply(trained, X), **TOL)
  np.testing.assert_allclose(yax.eval_mox(new, full, X),
                             reference.apply(full, X), **TOL)
  assert not np.allclose(reference.apply(trained, X),
                         reference.apply(full, X))


class Block(nn.Module):
  act_with_params: bool = False

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4)(x)
    return PReLU(name='PReLU_0')(h) if self.act_with_params else nn.relu(h)


class Twice(nn.Module):
  act_with_params: bool = False

  @nn.compact
  def __call__(self, x):
    block = Block(self.act_with_params, name='block')
    other = Block(self.act_with_params, name='other')
    return other(block(block(x)))


class Activations(nn.Module):
  """No parameters at all: ``init`` gives an empty variables dict."""
  act: object = nn.relu

  @nn.compact
  def __call__(self, x):
    if self.act is nn.relu:
      return nn.relu(x) * 2.0 - nn.relu(-x)
    return PReLU(name='PReLU_0')(x) * 2.0 - PReLU(name='PReLU_1')(-x)


def test_a_parameter_free_model_gets_its_first_params():
  """The original YAX's example: ReLU -> PReLU on a model without params;
  the rewrite creates the 'params' collection."""
  model = Activations()
  variables = model.init(jax.random.key(0), X)
  assert not variables
  mox = yax.make_mox(model.apply)(variables, X)
  new = yax.sub('//*[@name="relu"]', prelu_mox(4), mox)
  yax.check_mox(new)
  full = yax.init_params(new, variables, key=jax.random.key(1))
  assert set(full) == {'params'}
  assert set(full['params']) == {'PReLU_0', 'PReLU_1'}
  trained = {'params': {'PReLU_0': {'alpha': jnp.full((4,), 0.1)},
                        'PReLU_1': {'alpha': jnp.linspace(-1.0, 1.0, 4)}}}
  reference = Activations(act=PReLU)
  for params in (full, trained):
    np.testing.assert_allclose(yax.eval_mox(new, params, X),
                               reference.apply(params, X), **TOL)


def test_a_module_called_twice_has_one_set_per_site_read_by_both_calls():
  model = Twice()
  variables = model.init(jax.random.key(0), X)
  mox = yax.make_mox(model.apply)(variables, X)
  new = yax.sub('//*[@name="relu"]', prelu_mox(4), mox)
  yax.check_mox(new)
  full = yax.init_params(new, variables, key=jax.random.key(1))
  assert set(full['params']['block']) == {'Dense_0', 'PReLU_0'}
  assert set(full['params']['other']) == {'Dense_0', 'PReLU_0'}
  full['params']['block']['PReLU_0']['alpha'] = jnp.linspace(-1, 1, 4)
  full['params']['other']['PReLU_0']['alpha'] = jnp.full((4,), 0.5)
  np.testing.assert_allclose(yax.eval_mox(new, full, X),
                             Twice(True).apply(full, X), **TOL)


def test_init_params_restores_a_missing_module_and_refuses_what_it_cannot():
  model = MLP()
  variables = model.init(jax.random.key(0), X)
  mox = yax.make_mox(model.apply)(variables, X)
  partial = {'params': {k: v for k, v in variables['params'].items()
                        if k != 'Dense_1'}}
  full = yax.init_params(mox, partial, key=jax.random.key(5))
  assert full['params']['Dense_1']['kernel'].shape == (8, 8)
  assert full['params']['Dense_1']['bias'].shape == (8,)
  np.testing.assert_array_equal(full['params']['Dense_1']['bias'],
                                np.zeros(8, np.float32))
  # Two keys, two initialisations; the same key, the same values.
  again = yax.init_params(mox, partial, key=jax.random.key(5))
  other = yax.init_params(mox, partial, key=jax.random.key(6))
  np.testing.assert_array_equal(again['params']['Dense_1']['kernel'],
                                full['params']['Dense_1']['kernel'])
  assert not np.allclose(other['params']['Dense_1']['kernel'],
                         full['params']['Dense_1']['kernel'])
  with pytest.raises(yax.SubstitutionError, match='expects a Mox'):
    yax.init_params('//x', variables, key=jax.random.key(0))


def reference_int8(w):
  """Per-output-channel absmax int8 of a Dense kernel [in, out] (the
  absmax maps to 127, codes -127 .. 127), dequantized."""
  w = np.asarray(w, np.float32)
  absmax = np.abs(w).max(0, keepdims=True)
  scale = (absmax / 127.0).astype(np.float32)
  return np.clip(np.round(w / scale), -127, 127) * scale


def test_init_params_fills_lora_adapters_and_quantization_scales():
  model = MLP()
  variables = model.init(jax.random.key(0), X)
  mox = yax.make_mox(model.apply)(variables, X)
  dense = '//module_call[@type="Dense"]'
  res = yax.lora(mox, variables, dense, rank=2)
  full = yax.init_params(res.mox, variables, key=jax.random.key(1))
  for name in ('Dense_0', 'Dense_1', 'Dense_2'):
    layer, want = full['params'][name], res.params['params'][name]
    assert layer['kernel'] is variables['params'][name]['kernel']
    assert layer['lora_a'].shape == want['lora_a'].shape
    assert layer['lora_b'].shape == want['lora_b'].shape
    np.testing.assert_array_equal(layer['lora_b'], 0)  # B = 0, as lora
    assert np.all(layer['lora_a'] != 0)  # A random, as lora
  # A ~ N(0, 1 / fan_in) as lora draws it (fan_in: the 8 inputs).
  a = np.concatenate([full['params'][n]['lora_a'].ravel()
                      for n in ('Dense_1', 'Dense_2')])
  assert 0.5 < float(np.std(a) * np.sqrt(8)) < 1.5
  np.testing.assert_allclose(yax.eval_mox(res.mox, full, X),
                             model.apply(variables, X), **TOL)
  # QLoRA from the float params: the scales from the float kernels, which
  # are stored quantized with them.
  q = yax.quantize(mox, variables, dense)
  qres = yax.lora(q.mox, q.params, dense, rank=2)
  full = yax.init_params(qres.mox, variables, key=jax.random.key(1))
  ref = jax.tree.map(lambda a: a, variables)
  for name in ('Dense_0', 'Dense_1', 'Dense_2'):
    layer = full['params'][name]
    assert layer['kernel'].dtype == jnp.int8
    np.testing.assert_array_equal(layer['kernel'],
                                  q.params['params'][name]['kernel'])
    np.testing.assert_array_equal(layer['kernel_scale'],
                                  q.params['params'][name]['kernel_scale'])
    ref['params'][name]['kernel'] = reference_int8(
        variables['params'][name]['kernel'])
  np.testing.assert_allclose(yax.eval_mox(qres.mox, full, X),
                             model.apply(ref, X), **TOL)


class _ScanLayer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.tanh(nn.Dense(4, name='dense')(x)), None


class _Scanned(nn.Module):
  """Three layers under nn.scan, params stacked on ``axis``."""
  axis: int = 0

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(_ScanLayer, variable_axes={'params': self.axis},
                   split_rngs={'params': True}, length=3)
    return scan(name='layers')(x, None)[0]


@pytest.mark.parametrize('axis', [0, 1])
def test_init_params_fills_stacked_adapters_and_scales_from_the_records(axis):
  # Inside a scan body the adapters and scales are stacked: the records
  # the rewrites left on their calls make them at the stacked shapes, the
  # scales per layer (axis 1: the stack a transpose moves to the front).
  model = _Scanned(axis)
  variables = model.init(jax.random.key(0), X)
  mox = yax.make_mox(model.apply)(variables, X)
  dense = '//module_call[@type="Dense"]'
  q = yax.quantize(mox, variables, dense, weight='int8')
  qres = yax.lora(q.mox, q.params, dense, rank=2)
  full = yax.init_params(qres.mox, variables, key=jax.random.key(1))
  got, want = (t['params']['layers']['dense'] for t in (full, qres.params))
  assert sorted(got) == sorted(want)
  for name in ('kernel', 'kernel_scale', 'bias'):
    np.testing.assert_array_equal(got[name], want[name])
  assert got['lora_a'].shape == want['lora_a'].shape == (3, 4, 2)
  assert got['lora_b'].shape == (3, 2, 4)
  np.testing.assert_array_equal(got['lora_b'], 0)
  assert np.all(got['lora_a'] != 0)
  np.testing.assert_allclose(yax.eval_mox(qres.mox, full, X),
                             model.apply(q.dequantize(q.params), X), **TOL)


# ----------------------------------------------------------------- NNX

class NNXPReLU(nnx.Module):

  def __init__(self, features: int, rngs: nnx.Rngs):
    self.features = features
    self.alpha = nnx.Param(jnp.full((features,), 0.25))

  def __call__(self, x):
    return jnp.where(x >= 0, x, self.alpha[...] * x)


class NNXMLP(nnx.Module):

  def __init__(self, rngs, with_prelu=False):
    self.fc1 = nnx.Linear(4, 8, rngs=rngs)
    self.fc2 = nnx.Linear(8, 8, rngs=rngs)
    self.fc3 = nnx.Linear(8, 3, rngs=rngs)
    if with_prelu:
      self.NNXPReLU_0 = NNXPReLU(8, rngs)
      self.NNXPReLU_1 = NNXPReLU(8, rngs)
    self.with_prelu = with_prelu

  def __call__(self, x):
    if self.with_prelu:
      h = self.NNXPReLU_0(self.fc1(x))
      return self.fc3(self.NNXPReLU_1(self.fc2(h)))
    return self.fc3(nnx.relu(self.fc2(nnx.relu(self.fc1(x)))))


def test_nnx_two_relus_to_prelu():
  model = NNXMLP(nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  mox = yax.make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, X)
  prelu = NNXPReLU(8, nnx.Rngs(0))
  repl = yax.make_mox(lambda m, h: m(h))(prelu, jnp.zeros((2, 8)))
  new = yax.sub('//*[@name="relu"]', repl, mox)
  yax.check_mox(new)
  full = yax.init_params(new, state, key=jax.random.key(1))
  assert isinstance(full, nnx.State)
  assert isinstance(full['NNXPReLU_0']['alpha'], nnx.Param)
  np.testing.assert_array_equal(full['NNXPReLU_1']['alpha'][...],
                                np.full((8,), 0.25, np.float32))
  full['NNXPReLU_0']['alpha'].value = jnp.full((8,), 0.1)
  full['NNXPReLU_1']['alpha'].value = jnp.full((8,), -0.6)
  # The model written with PReLU modules at those paths, same weights.
  reference = NNXMLP(nnx.Rngs(0), with_prelu=True)
  ref_graph, ref_state = nnx.split(reference)
  for name in ('fc1', 'fc2', 'fc3'):
    for p in ('kernel', 'bias'):
      ref_state[name][p].value = state[name][p][...]
  for name, a in (('NNXPReLU_0', 0.1), ('NNXPReLU_1', -0.6)):
    ref_state[name]['alpha'].value = jnp.full((8,), a)
  want = nnx.merge(ref_graph, ref_state)(X)
  np.testing.assert_allclose(yax.eval_mox(new, full, X), want, **TOL)


class NNXActivations(nnx.Module):
  """No variables at all: ``nnx.split`` gives an empty state."""

  def __init__(self, with_prelu=False):
    if with_prelu:
      self.NNXPReLU_0 = NNXPReLU(4, nnx.Rngs(0))
      self.NNXPReLU_1 = NNXPReLU(4, nnx.Rngs(0))
    self.with_prelu = with_prelu

  def __call__(self, x):
    if self.with_prelu:
      return self.NNXPReLU_0(x) * 2.0 - self.NNXPReLU_1(-x)
    return nnx.relu(x) * 2.0 - nnx.relu(-x)


def test_a_parameter_free_nnx_model_gets_nnx_params_at_its_module_paths():
  # Before: the module merged from the empty state was called at
  # '<closure>/NNXActivations'; an NNX PReLU was refused ("no 'nnx'
  # collection") and a Linen one put a raw array at
  # state['params']['<closure>']['NNXActivations']['PReLU_0']['alpha'].
  graphdef, state = nnx.split(NNXActivations())
  assert not jax.tree.leaves(state)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, X)
  prelu = NNXPReLU(4, nnx.Rngs(0))
  repl = yax.make_mox(lambda m, h: m(h))(prelu, jnp.zeros((2, 4)))
  new = yax.sub('//*[@name="relu"]', repl, mox)
  yax.check_mox(new)
  full = yax.init_params(new, state, key=jax.random.key(1))
  # The state of the same model written by hand with two PReLU modules.
  ref_graph, ref_state = nnx.split(NNXActivations(with_prelu=True))
  assert isinstance(full, nnx.State)
  assert sorted(full) == sorted(ref_state) == ['NNXPReLU_0', 'NNXPReLU_1']
  for name in ('NNXPReLU_0', 'NNXPReLU_1'):
    assert type(full[name]['alpha']) is type(ref_state[name]['alpha'])
  full['NNXPReLU_0']['alpha'].value = jnp.full((4,), 0.1)
  full['NNXPReLU_1']['alpha'].value = jnp.linspace(-1.0, 1.0, 4)
  ref_state['NNXPReLU_0']['alpha'].value = jnp.full((4,), 0.1)
  ref_state['NNXPReLU_1']['alpha'].value = jnp.linspace(-1.0, 1.0, 4)
  np.testing.assert_allclose(yax.eval_mox(new, full, X),
                             nnx.merge(ref_graph, ref_state)(X), **TOL)
  # A Linen PReLU has no place in an nnx.State: refused, tree untouched.
  with pytest.raises(yax.SubstitutionError,
                     match=r"no 'params' collection.*NNX Variables only"):
    yax.sub('//*[@name="relu"]', prelu_mox(4), mox)


class _ShardedNNX(nnx.Module):
  """Two Linear layers whose kernels carry axis names."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    part = nnx.with_partitioning
    self.up = nnx.Linear(4, 8, kernel_init=part(init, ('embed', 'mlp')),
                         rngs=rngs)
    self.down = nnx.Linear(8, 4, kernel_init=part(init, ('mlp', 'embed')),
                           rngs=rngs)

  def __call__(self, x):
    return self.down(jnp.tanh(self.up(x)))


def test_init_params_keeps_the_sharding_metadata_of_nnx_adapters():
  # lora makes nnx.LoRAParam adapters with the kernels' axis names
  # (out_sharding); init_params made them without, and eval_mox on the
  # filled state raised SignatureError (the static structure differs).
  mesh = jax.make_mesh((1, 1), ('embed', 'mlp'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    model = _ShardedNNX(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 4))
    graphdef, state = nnx.split(model)
    run = lambda s, x: nnx.merge(graphdef, s)(x)
    mox = yax.make_mox(run)(state, x)
    res = yax.lora(mox, state, rank=2)
    full = yax.init_params(res.mox, state, key=jax.random.key(3))
    assert jax.tree.structure(full) == jax.tree.structure(res.params)
    for layer in ('up', 'down'):
      for name in ('lora_a', 'lora_b'):
        got, want = full[layer][name], res.params[layer][name]
        assert isinstance(got, nnx.LoRAParam)
        assert got.get_metadata() == want.get_metadata()
        assert got[...].shape == want[...].shape
    # B = 0: the filled tree computes the plain NNX model.
    np.testing.assert_allclose(yax.eval_mox(res.mox, full, x), run(state, x),
                               **TOL)
