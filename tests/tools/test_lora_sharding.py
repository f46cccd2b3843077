"""LoRA on sharded models: boxed Linen params (``nn.with_partitioning``,
``nn.with_logical_partitioning``) and NNX sharding metadata are accepted and
kept, and each adapter gets the axis names of the kernel axes it spans:
``A`` the contracted axes' names then None, ``B`` None then the others'."""

from __future__ import annotations

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import yax

TOL = dict(rtol=2e-5, atol=2e-5)
init = nn.initializers.lecun_normal()


class Einsum(nn.Module):
  """Gemma's Einsum, with logical axis names on its weight."""

  @nn.compact
  def __call__(self, x):
    w = self.param('w', nn.with_logical_partitioning(
        init, ('heads', 'embed', 'kv')), (2, 6, 3))
    return jnp.einsum('BTD,NDH->BTNH', x, w)


class Attention(nn.Module):

  @nn.compact
  def __call__(self, x):
    q = Einsum(name='q')(x)
    return nn.Dense(6, kernel_init=nn.with_partitioning(init, (None, 'model')),
                    name='out')(q.reshape(*q.shape[:2], 6))


class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = Attention(name='attn')(x)
    up = nn.Dense(8, kernel_init=nn.with_logical_partitioning(
        init, ('embed', 'mlp')), name='up')
    return up(jnp.tanh(h))


def names(tree):
  return jax.tree.map(lambda b: tuple(b.names), tree,
                      is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def test_linen_boxed_params_keep_their_boxes_and_adapters_get_axis_names():
  model = Model()
  x = jax.random.normal(jax.random.key(0), (2, 5, 6))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = yax.lora(mox, variables, '//module_call[@type="Einsum" or '
                 '@type="Dense"]', rank=2, alpha=2.0)
  yax.check_mox(res.mox)
  p = res.params['params']
  assert isinstance(p['attn']['q']['lora_a'], nn.LogicallyPartitioned)
  assert names(p['attn']['q']['lora_a']) == ('embed', None)       # D
  assert names(p['attn']['q']['lora_b']) == (None, 'heads', 'kv')  # N, H
  assert isinstance(p['attn']['out']['lora_a'], nn.Partitioned)
  assert names(p['attn']['out']['lora_a']) == (None, None)
  assert names(p['attn']['out']['lora_b']) == (None, 'model')
  assert names(p['up']['lora_a']) == ('embed', None)
  assert names(p['up']['lora_b']) == (None, 'mlp')
  # The mask has the params' structure, boxes included.
  assert jax.tree.structure(res.mask) == jax.tree.structure(res.params)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             model.apply(variables, x), **TOL)
  trained = jax.tree.map(lambda v, m: v + 0.3 if m else v, res.params,
                         res.mask)
  merged = res.merge(trained)
  assert jax.tree.structure(merged) == jax.tree.structure(variables)
  assert names(merged['params']['attn']['q']['w']) == ('heads', 'embed', 'kv')
  got = yax.eval_mox(res.mox, trained, x)
  np.testing.assert_allclose(model.apply(merged, x), got, **TOL)
  assert not np.allclose(got, model.apply(variables, x), **TOL)
  # The logical names resolve to a sharding like any Flax param's.
  rules = (('embed', None), ('mlp', None), ('heads', None), ('kv', None))
  specs = nn.logical_to_mesh(nn.get_partition_spec(res.params), rules)
  assert specs['params']['up']['lora_b'] == jax.sharding.PartitionSpec(None,
                                                                       None)


def test_linen_stacked_kernels_lead_with_the_stack_axis_name():
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      dense = nn.Dense(6, kernel_init=nn.with_logical_partitioning(
          init, ('embed', 'mlp')), name='dense')
      return jnp.tanh(dense(x)), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(Layer, variable_axes={'params': 0},
                     split_rngs={'params': True}, length=3,
                     metadata_params={nn.PARTITION_NAME: 'layers'})
      return scan(name='layers')(x, None)[0]

  model = Stack()
  x = jax.random.normal(jax.random.key(0), (2, 6))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=2)
  yax.check_mox(res.mox)
  dense = res.params['params']['layers']['dense']
  assert dense['lora_a'].value.shape == (3, 6, 2)
  assert names(dense['lora_a']) == ('layers', 'embed', None)
  assert names(dense['lora_b']) == ('layers', None, 'mlp')
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             model.apply(variables, x), **TOL)
  trained = jax.tree.map(lambda v, m: v + 0.2 if m else v, res.params,
                         res.mask)
  np.testing.assert_allclose(model.apply(res.merge(trained), x),
                             yax.eval_mox(res.mox, trained, x), **TOL)


class NNXModel(nnx.Module):

  def __init__(self, rngs):
    part = nnx.with_partitioning
    self.up = nnx.Linear(4, 8, kernel_init=part(init, ('embed', 'mlp')),
                         rngs=rngs)
    self.down = nnx.Linear(8, 4, kernel_init=part(init, ('mlp', 'embed')),
                           rngs=rngs)

  def __call__(self, x):
    return self.down(jnp.tanh(self.up(x)))


def test_nnx_adapters_are_lora_params_with_the_kernels_axis_names():
  mesh = jax.make_mesh((1, 1), ('embed', 'mlp'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    model = NNXModel(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 4))
    graphdef, state = nnx.split(model)
    run = lambda s, x: nnx.merge(graphdef, s)(x)
    mox = yax.make_mox(run)(state, x)
    res = yax.lora(mox, state, rank=2)
    yax.check_mox(res.mox)
    kernel = state['up']['kernel']
    key = next(k for k in ('out_sharding', 'sharding_names', 'sharding')
               if k in kernel.get_metadata())
    a, b = res.params['up']['lora_a'], res.params['up']['lora_b']
    assert isinstance(a, nnx.LoRAParam) and isinstance(b, nnx.LoRAParam)
    assert tuple(a.get_metadata()[key]) == ('embed', None)
    assert tuple(b.get_metadata()[key]) == (None, 'mlp')
    if 'eager_sharding' in kernel.get_metadata():  # Flax >= 0.12.1
      assert a.get_metadata()['eager_sharding'] == \
          kernel.get_metadata()['eager_sharding']
    assert tuple(res.params['down']['lora_b'].get_metadata()[key]) == (
        None, 'embed')
    np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                               run(state, x), **TOL)
    trained = jax.tree.map(lambda v, m: v + 0.3 if m else v, res.params,
                           res.mask)
    merged = res.merge(trained)
    assert tuple(merged['up']['kernel'].get_metadata()[key]) == ('embed',
                                                                 'mlp')
    np.testing.assert_allclose(run(merged, x),
                               yax.eval_mox(res.mox, trained, x), **TOL)
    # nnx.LoRAParam filters select exactly the adapters.
    lora_state = nnx.filter_state(trained, nnx.LoRAParam)
    assert len(jax.tree.leaves(lora_state)) == 4
    assert jax.tree.leaves(lora_state) == [
        v for v, m in zip(jax.tree.leaves(trained), jax.tree.leaves(res.mask),
                          strict=True) if m]


def stacked_linears(rngs, axis):
  """Three Linear(4, 4) layers, their Params stacked along ``axis``."""
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=(0,), out_axes=axis)
  def make(rngs):
    return nnx.Linear(4, 4, rngs=rngs)
  return make(rngs)


class NNXLayers(nnx.Module):
  """Three Linear layers stacked along axis 0 by nnx.vmap, run by
  nnx.scan (kernels [3, 4, 4])."""

  def __init__(self, rngs):
    self.layers = stacked_linears(rngs, 0)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, x):
      return jnp.tanh(layer(x))
    return body(self.layers, x)


def with_both_sharding_keys(var, names):
  """``var`` carrying its axis names under ``out_sharding`` and under its
  deprecated alias ``sharding_names`` (as MaxText's Params do; Flax's
  constructor would fold the alias into ``out_sharding``)."""
  meta = {**var.get_metadata(), 'out_sharding': names,
          'sharding_names': names}
  return type(var).from_metadata(var[...], meta)


def test_adapters_on_a_stack_get_their_own_names_under_both_keys():
  model = NNXLayers(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 4))
  graphdef, state = nnx.split(model)
  layer = state['layers']
  layer['kernel'] = with_both_sharding_keys(layer['kernel'],
                                            ('layers', 'embed', 'mlp'))
  layer['bias'] = with_both_sharding_keys(layer['bias'], ('layers', 'mlp'))
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  res = yax.lora(mox, state, rank=2)
  yax.check_mox(res.mox)
  a, b = res.params['layers']['lora_a'], res.params['layers']['lora_b']
  assert a.shape == (3, 4, 2) and b.shape == (3, 2, 4)
  for var, names in ((a, ('layers', 'embed', None)),
                     (b, ('layers', None, 'mlp'))):
    meta = var.get_metadata()
    assert tuple(meta['out_sharding']) == names
    assert tuple(meta.get('sharding_names', names)) == names
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             run(state, x), **TOL)


MESH = jax.make_mesh((1,), ('expert',),
                     axis_types=(jax.sharding.AxisType.Auto,))


class Experts(nn.Module):
  """MaxText's RoutedMoE dense path: expert kernels [experts, in, out]
  contracted with inputs (and giving outputs) under sharding constraints."""

  @nn.compact
  def __call__(self, x):  # [experts, tokens, in]
    where = jax.sharding.NamedSharding(
        MESH, jax.sharding.PartitionSpec('expert', None, None))
    wi = self.param('wi', nn.with_logical_partitioning(
        init, ('exp', 'embed', 'mlp')), (3, 6, 5))
    x = jax.lax.with_sharding_constraint(x, where)
    y = jnp.einsum('etd,edh->eth', x, wi)
    return jax.lax.with_sharding_constraint(y, where)


def test_moe_expert_kernels_behind_sharding_constraints():
  model = Experts()
  x = jax.random.normal(jax.random.key(0), (3, 4, 6))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = yax.lora(mox, variables, '//module_call[@type="Experts"]', rank=2,
                 alpha=4.0)
  yax.check_mox(res.mox)
  # The expert axis is a kernel axis of a batched contraction: in B.
  a, b = res.params['params']['lora_a'], res.params['params']['lora_b']
  assert a.value.shape == (6, 2) and b.value.shape == (2, 3, 5)
  assert tuple(a.names) == ('embed', None)
  assert tuple(b.names) == (None, 'exp', 'mlp')
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             model.apply(variables, x), **TOL)
  trained = jax.tree.map(lambda v, m: v + 0.3 if m else v, res.params,
                         res.mask)
  ta, tb = (trained['params'][k].value for k in ('lora_a', 'lora_b'))
  kernel = nn.meta.unbox(variables)['params']['wi']
  want = model.apply({'params': {'wi': kernel + 2.0 * np.einsum(
      'dr,reh->edh', ta, tb)}}, x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), want, **TOL)
  np.testing.assert_allclose(model.apply(res.merge(trained), x), want, **TOL)


class ScannedDecoder(nnx.Module):
  """MaxText's scanned layers: params stacked on axis 1
  (``param_scan_axis=1``), moved to the front, sliced by ``jax.lax.scan``
  and merged into the layer inside the (rematerialized) body."""

  def __init__(self, rngs):
    self.layers = stacked_linears(rngs, 1)

  def __call__(self, x):
    graphdef, state = nnx.split(self.layers)
    state = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), state)

    def body(x, layer_state):
      layer = nnx.merge(graphdef, layer_state)
      return jax.checkpoint(lambda x: jnp.tanh(layer(x)))(x), None
    return jax.lax.scan(body, x, state)[0]


def test_scanned_layers_sliced_from_a_stack_on_axis_1():
  model = ScannedDecoder(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 4))
  graphdef, state = nnx.split(model)
  layers = state['layers']
  layers['kernel'] = with_both_sharding_keys(layers['kernel'],
                                             ('embed', 'layers', 'mlp'))
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  res = yax.lora(mox, state, rank=2, alpha=4.0)
  yax.check_mox(res.mox)
  assert res.paths == [('layers',)]
  a, b = res.params['layers']['lora_a'], res.params['layers']['lora_b']
  # One pair per layer, stacked on axis 0 (the axis the scan slices).
  assert a.shape == (3, 4, 2) and b.shape == (3, 2, 4)
  assert tuple(a.get_metadata()['out_sharding']) == ('layers', 'embed', None)
  assert tuple(b.get_metadata()['out_sharding']) == ('layers', None, 'mlp')
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             run(state, x), **TOL)
  trained = jax.tree.map(lambda v, m: v + 0.3 if m else v, res.params,
                         res.mask)
  ta, tb = (trained['layers'][k][...] for k in ('lora_a', 'lora_b'))
  reference = nnx.split(model)[1]
  kernel = reference['layers']['kernel']  # [in, layers, out]
  kernel.value = kernel[...] + 2.0 * np.einsum('lir,lro->ilo', ta, tb)
  want = run(reference, x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), want, **TOL)
  merged = res.merge(trained)
  assert tuple(merged['layers']['kernel'].get_metadata()['out_sharding']) \
      == ('embed', 'layers', 'mlp')
  np.testing.assert_allclose(run(merged, x), want, **TOL)
