"""LoRA adapters as files: ``LoraResult.save`` and ``yax.load_lora``.

Adapters are trained (perturbed), saved, and loaded onto a base model traced
again (in this process, and in another one); the loaded model is compared
with the same model written by hand in plain JAX, and with the saving
model. A file that does not fit (another model, a missing, extra or
misshapen adapter) is refused with the params path named.
"""

from __future__ import annotations

import copy
import json
import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import yax

TOL = dict(rtol=2e-5, atol=2e-5)
RANK, ALPHA = 2, 4.0


class MLP(nn.Module):
  width: int = 5
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.width, name='up', dtype=self.dtype,
                 param_dtype=self.dtype)(x)
    return nn.Dense(3, name='out', dtype=self.dtype,
                    param_dtype=self.dtype)(jnp.tanh(h))


def plain_mlp(params, x, scale=ALPHA / RANK):
  """The adapted MLP written by hand: ``x W + b + scale (x A) B``."""
  def dense(p, h):
    y = h @ p['kernel'] + p['bias']
    if 'lora_a' in p:
      y = y + scale * ((h @ p['lora_a']) @ p['lora_b'])
    return y
  p = params['params']
  return dense(p['out'], jnp.tanh(dense(p['up'], x)))


def trained(res, seed=1):
  """``res.params`` with every adapter moved away from its initial value."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda v, m: (v + jnp.asarray(rng.normal(0, 0.3, v.shape), v.dtype)
                    if m else v), res.params, res.mask)


@pytest.fixture(scope='module')
def mlp():
  model = MLP()
  x = jax.random.normal(jax.random.key(0), (4, 6))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=RANK,
                 alpha=ALPHA)
  return model, x, variables, res, trained(res)


def fresh(model, variables, x):
  """The base model traced again (a new module object, a new trace)."""
  return yax.make_mox(type(model)(**{
      f: getattr(model, f) for f in ('width', 'dtype')}).apply)(variables, x)


def test_safetensors_file_holds_the_masked_leaves_and_what_made_them(
    mlp, tmp_path):
  model, x, variables, res, params = mlp
  path = tmp_path / 'adapters.safetensors'
  res.save(path, params)
  tensors = load_file(path)
  assert sorted(tensors) == ['params/out/lora_a', 'params/out/lora_b',
                             'params/up/lora_a', 'params/up/lora_b']
  np.testing.assert_array_equal(tensors['params/up/lora_b'],
                                params['params']['up']['lora_b'])
  with safe_open(path, framework='np') as f:
    meta = f.metadata()
  assert meta['format'] == 'yax.lora' and meta['yax_version'] == \
      yax.__version__
  made = json.loads(meta['lora'])
  assert (made['selection'], made['rank'], made['alpha']) == (
      '//module_call[@type="Dense"]', RANK, ALPHA)
  assert json.loads(meta['paths']) == ['out', 'up']
  assert meta['dtype'] == 'float32'
  assert json.loads(meta['adapters'])['params/up/lora_a'] == 'float32[6,2]'
  assert json.loads(meta['model'])['params/up/kernel'] == 'float32[6,5]'


def test_loaded_adapters_run_as_the_hand_written_model(mlp, tmp_path):
  model, x, variables, res, params = mlp
  path = tmp_path / 'adapters.safetensors'
  res.save(path, params)
  loaded = yax.load_lora(fresh(model, variables, x), variables, path)
  yax.check_mox(loaded.mox)
  assert jax.tree.structure(loaded.params) == jax.tree.structure(params)
  for got, want in zip(jax.tree.leaves(loaded.params),
                       jax.tree.leaves(params)):
    np.testing.assert_array_equal(got, want)
  got = yax.eval_mox(loaded.mox, loaded.params, x)
  np.testing.assert_allclose(got, plain_mlp(params, x), **TOL)
  np.testing.assert_array_equal(got, yax.eval_mox(res.mox, params, x))
  assert not np.allclose(got, model.apply(variables, x), **TOL)
  # What load_lora returns merges, trains and saves like lora's result.
  np.testing.assert_allclose(model.apply(loaded.merge(loaded.params), x),
                             plain_mlp(params, x), **TOL)
  assert loaded.paths == res.paths and loaded.config == res.config


def test_orbax_directory_round_trip(mlp, tmp_path):
  model, x, variables, res, params = mlp
  res.save(tmp_path / 'ckpt', params, format='orbax')
  loaded = yax.load_lora(fresh(model, variables, x), variables,
                         tmp_path / 'ckpt')
  np.testing.assert_allclose(yax.eval_mox(loaded.mox, loaded.params, x),
                             plain_mlp(params, x), **TOL)
  with pytest.raises(yax.AdapterFileError, match='exists'):
    res.save(tmp_path / 'ckpt', params, format='orbax')


def rewrite_file(path, edit):
  """Rewrites a saved file with ``edit(tensors, record)`` applied (the
  record: the file's metadata with its JSON values decoded)."""
  tensors = load_file(path)
  with safe_open(path, framework='np') as f:
    meta = f.metadata()
  record = {k: json.loads(v) if k in ('lora', 'paths', 'adapters', 'model')
            else v for k, v in meta.items()}
  edit(tensors, record)
  save_file(tensors, path, metadata={
      k: json.dumps(v) if not isinstance(v, str) else v
      for k, v in record.items()})


def drop_up_b(tensors, record):
  del tensors['params/up/lora_b']
  del record['adapters']['params/up/lora_b']


def add_extra(tensors, record):
  tensors['params/up/extra_lora_a'] = np.zeros((6, 2), np.float32)
  record['adapters']['params/up/extra_lora_a'] = 'float32[6,2]'


def reshape_a(tensors, record):
  tensors['params/out/lora_a'] = np.zeros((5, 3), np.float32)
  record['adapters']['params/out/lora_a'] = 'float32[5,3]'


def tensor_unlike_record(tensors, record):
  tensors['params/out/lora_a'] = np.zeros((5, 3), np.float32)


def no_record(tensors, record):
  record.clear()


@pytest.mark.parametrize('edit, match', [
    (drop_up_b, r"adapter params\['params/up/lora_b'\] \(float32\[2,5\]\) "
     'is missing from'),
    (add_extra, r"holds an adapter params\['params/up/extra_lora_a'\] "
     r'\(float32\[6,2\]\) that lora'),
    (reshape_a, r"adapter params\['params/out/lora_a'\] is float32\[5,3\] "
     r'in .* but lora made it float32\[5,2\]'),
    (tensor_unlike_record, r"tensor 'params/out/lora_a' is float32\[5,3\] "
     r'but its record says float32\[5,2\]'),
    (no_record, 'is not a file of YAX LoRA adapters'),
])
def test_a_file_that_does_not_fit_names_the_adapter(mlp, tmp_path, edit,
                                                    match):
  model, x, variables, res, params = mlp
  path = tmp_path / 'adapters.safetensors'
  res.save(path, params)
  rewrite_file(path, edit)
  with pytest.raises(yax.AdapterFileError, match=match):
    yax.load_lora(fresh(model, variables, x), variables, path)


def test_a_file_made_for_another_model_says_so(mlp, tmp_path):
  model, x, variables, res, params = mlp
  path = tmp_path / 'adapters.safetensors'
  res.save(path, params)
  wide = MLP(width=7)
  wide_vars = wide.init(jax.random.key(1), x)
  with pytest.raises(yax.AdapterFileError,
                     match=r"made for another model: params\['params/up/"
                     r"kernel'\] is float32\[6,7\] here and float32\[6,5\] "
                     'in that model'):
    yax.load_lora(yax.make_mox(wide.apply)(wide_vars, x), wide_vars, path)
  with pytest.raises(yax.AdapterFileError, match='no file or directory'):
    yax.load_lora(fresh(model, variables, x), variables, tmp_path / 'nope')
  (tmp_path / 'junk.safetensors').write_text('hello')
  with pytest.raises(yax.AdapterFileError, match='is not a safetensors file'):
    yax.load_lora(fresh(model, variables, x), variables,
                  tmp_path / 'junk.safetensors')
  (tmp_path / 'empty').mkdir()
  with pytest.raises(yax.AdapterFileError, match='is not an orbax checkpoint'):
    yax.load_lora(fresh(model, variables, x), variables, tmp_path / 'empty')


def test_save_refuses_what_a_file_cannot_record(mlp, tmp_path):
  model, x, variables, res, params = mlp
  base = fresh(model, variables, x)
  by_nodes = yax.lora(base, variables,
                      yax.query('//module_call[@type="Dense"]', base))
  with pytest.raises(yax.AdapterFileError, match='selection=.*cannot '
                     'record.*as an XPath string'):
    by_nodes.save(tmp_path / 'a.safetensors')
  with pytest.raises(yax.AdapterFileError, match="format must be one of"):
    res.save(tmp_path / 'a.bin', params, format='npz')
  with pytest.raises(yax.AdapterFileError,
                     match=r"save: the params do not have the lora result's "
                     r".*params\['params/out/lora_a'\] is missing"):
    res.save(tmp_path / 'a.safetensors', variables)
  assert not (tmp_path / 'a.safetensors').exists()


def test_qlora_adapters_load_onto_a_base_quantized_again(tmp_path):
  model = MLP(width=8)
  x = jax.random.normal(jax.random.key(0), (4, 6))
  variables = model.init(jax.random.key(1), x)
  dense = '//module_call[@type="Dense"]'
  q = yax.quantize(yax.make_mox(model.apply)(variables, x), variables, dense,
                   weight='int8')
  res = yax.lora(q.mox, q.params, dense, rank=RANK, alpha=ALPHA)
  params = trained(res)
  res.save(tmp_path / 'qlora.safetensors', params)
  mox = yax.make_mox(model.apply)(variables, x)
  q2 = yax.quantize(mox, variables, dense, weight='int8')
  loaded = yax.load_lora(q2.mox, q2.params, tmp_path / 'qlora.safetensors')
  yax.check_mox(loaded.mox)
  np.testing.assert_array_equal(yax.eval_mox(loaded.mox, loaded.params, x),
                                yax.eval_mox(res.mox, params, x))
  # By hand: the int8 kernel times its per-channel scale, plus the adapter.
  p = params['params']
  deq = {n: {**p[n], 'kernel': p[n]['kernel'].astype(jnp.float32) *
             p[n]['kernel_scale']} for n in ('up', 'out')}
  np.testing.assert_allclose(yax.eval_mox(loaded.mox, loaded.params, x),
                             plain_mlp({'params': deq}, x), **TOL)
  # Onto the float base, the file says what to do first.
  with pytest.raises(yax.AdapterFileError,
                     match=r'quantized before lora .*yax.quantize'):
    yax.load_lora(mox, variables, tmp_path / 'qlora.safetensors')


def test_bfloat16_adapters_keep_their_dtype(tmp_path):
  model = MLP(dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(0), (4, 6), jnp.bfloat16)
  variables = model.init(jax.random.key(1), x)
  res = yax.lora(yax.make_mox(model.apply)(variables, x), variables,
                 rank=RANK, alpha=ALPHA)
  params = trained(res)
  res.save(tmp_path / 'bf16.safetensors', params)
  loaded = yax.load_lora(yax.make_mox(model.apply)(variables, x), variables,
                         tmp_path / 'bf16.safetensors')
  a = loaded.params['params']['up']['lora_a']
  assert a.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(
      params['params']['up']['lora_a'], np.float32))


class NNXMLP(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(6, 5, rngs=rngs)
    self.out = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.up(x)))


def test_nnx_state_adapters_round_trip(tmp_path):
  graphdef, state = nnx.split(NNXMLP(nnx.Rngs(0)))
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  x = jax.random.normal(jax.random.key(1), (4, 6))
  res = yax.lora(yax.make_mox(run)(state, x), state, rank=RANK, alpha=ALPHA)
  params = trained(res)
  res.save(tmp_path / 'nnx.safetensors', params)
  assert sorted(load_file(tmp_path / 'nnx.safetensors')) == [
      'out/lora_a', 'out/lora_b', 'up/lora_a', 'up/lora_b']
  graphdef2, state2 = nnx.split(NNXMLP(nnx.Rngs(0)))
  loaded = yax.load_lora(
      yax.make_mox(lambda s, x: nnx.merge(graphdef2, s)(x))(state2, x),
      state2, tmp_path / 'nnx.safetensors')
  assert isinstance(loaded.params['up']['lora_a'], nnx.LoRAParam)
  value = lambda v: jax.tree.leaves(v)[0]  # the array in an nnx.Variable
  by_hand = {'params': {n: {k: value(params[n][k]) for k in params[n]}
                        for n in ('up', 'out')}}
  np.testing.assert_allclose(yax.eval_mox(loaded.mox, loaded.params, x),
                             plain_mlp(by_hand, x), **TOL)


def test_a_tree_cannot_be_pickled_and_says_what_to_keep(mlp):
  model, x, variables, res, params = mlp
  for dump in (pickle.dumps, copy.deepcopy):
    with pytest.raises(yax.YaxError, match='cannot be pickled.*load_lora'):
      dump(res.mox)
  shallow = copy.copy(res.mox)
  np.testing.assert_array_equal(yax.eval_mox(shallow, params, x),
                                yax.eval_mox(res.mox, params, x))


# Logical axis -> mesh axis, for the sharded model below on a 4 x 2 mesh.
RULES = (('embed', 'fsdp'), ('mlp', 'tp'))


class LogicalMLP(nn.Module):
  """Dense layers whose kernels carry logical axis names (MaxText-style)."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    dense = lambda n, names, name: nn.Dense(
        n, kernel_init=nn.with_logical_partitioning(init, names), name=name)
    h = dense(4, ('embed', 'mlp'), 'up')(x)
    return dense(8, ('mlp', 'embed'), 'out')(jnp.tanh(h))


def logical_setup():
  model = LogicalMLP()
  x = jax.random.normal(jax.random.key(0), (8, 8))
  variables = model.init(jax.random.key(1), x)
  return model, x, variables


SHARDED_SCRIPT = '''
import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, sys
import yax
from jax.sharding import NamedSharding, PartitionSpec as P
from test_lora_files import RULES, logical_setup, TOL

mesh = jax.make_mesh((4, 2), ('fsdp', 'tp'),
                     axis_types=(jax.sharding.AxisType.Auto,) * 2)

def on_mesh(tree):
  specs = nn.logical_to_mesh(nn.get_partition_spec(tree), RULES)
  return jax.device_put(tree, jax.tree.map(
      lambda s: NamedSharding(mesh, s), specs,
      is_leaf=lambda s: isinstance(s, P)))

model, x, variables = logical_setup()
want = np.load(DIR_PATH + '/want.npy')
base = on_mesh(variables)
# The file the test process saved, loaded here, on the mesh.
loaded = yax.load_lora(yax.make_mox(model.apply)(base, x), base,
                       DIR_PATH + '/one.safetensors')
yax.check_mox(loaded.mox)
p = loaded.params['params']
assert p['up']['lora_a'].value.sharding.spec == P('fsdp', None), \\
    p['up']['lora_a'].value.sharding
assert p['up']['lora_b'].value.sharding.spec == P(None, 'tp')
assert p['out']['lora_a'].value.sharding.spec == P('tp', None)
np.testing.assert_allclose(yax.eval_mox(loaded.mox, loaded.params, x), want,
                           **TOL)
# Sharded adapters to orbax and back, shard by shard.
loaded.save(DIR_PATH + '/ckpt', format='orbax')
again = yax.load_lora(yax.make_mox(model.apply)(base, x), base,
                      DIR_PATH + '/ckpt')
b = again.params['params']['out']['lora_b'].value
assert b.sharding.spec == P(None, 'fsdp') and len(b.sharding.device_set) == 8
assert {s.data.shape for s in b.addressable_shards} == {(2, 2)}
np.testing.assert_allclose(yax.eval_mox(again.mox, again.params, x), want,
                           **TOL)
print('SHARDED-ADAPTERS-OK')
'''


def test_sharded_adapters_load_on_a_mesh_in_another_process(tmp_path):
  from helpers import run_on_host_devices
  model, x, variables = logical_setup()
  res = yax.lora(yax.make_mox(model.apply)(variables, x), variables,
                 rank=RANK, alpha=ALPHA)
  params = trained(res)
  res.save(tmp_path / 'one.safetensors', params)
  unboxed = nn.unbox(params)
  want = plain_mlp(unboxed, x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, params, x), want, **TOL)
  np.save(tmp_path / 'want.npy', np.asarray(want))
  run_on_host_devices(
      f'DIR_PATH = {str(tmp_path)!r}\n' + SHARDED_SCRIPT, tmp_path,
      'SHARDED-ADAPTERS-OK')


@pytest.mark.parametrize('options', [
    dict(dora=True),
    dict(init='svd'),
    dict(rslora=True, dropout=0.25, init='gaussian'),
    dict(train='//module_call[@path="out"]', train_names=('bias',)),
], ids=['dora', 'svd', 'rslora-dropout', 'train-bias'])
def test_lora_options_are_recorded_and_made_again(mlp, tmp_path, options):
  model, x, variables, _, _ = mlp
  res = yax.lora(fresh(model, variables, x), variables,
                 '//module_call[@type="Dense"]', rank=RANK, alpha=ALPHA,
                 **options)
  params = trained(res)
  res.save(tmp_path / 'a.safetensors', params)
  saved = load_file(tmp_path / 'a.safetensors')
  marked = [p for p, m in zip(
      jax.tree_util.tree_flatten_with_path(res.mask)[0], jax.tree.leaves(
          res.mask)) if m]
  assert len(saved) == len(marked)
  loaded = yax.load_lora(fresh(model, variables, x), variables,
                         tmp_path / 'a.safetensors')
  yax.check_mox(loaded.mox)
  assert loaded.config == res.config
  for got, want in zip(jax.tree.leaves(loaded.params),
                       jax.tree.leaves(params)):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(yax.eval_mox(loaded.mox, loaded.params, x),
                                yax.eval_mox(res.mox, params, x))


def test_named_adapters_load_one_after_the_other(mlp, tmp_path):
  model, x, variables, _, _ = mlp
  dense = '//module_call[@type="Dense"]'
  res_a = yax.lora(fresh(model, variables, x), variables, dense, rank=RANK,
                   adapter_name='a')
  pa = trained(res_a, seed=2)
  res_b = yax.lora(res_a.mox, pa, dense, rank=RANK, adapter_name='b')
  pb = trained(res_b, seed=3)
  res_a.save(tmp_path / 'a.safetensors', pa)
  res_b.save(tmp_path / 'b.safetensors', pb)
  la = yax.load_lora(fresh(model, variables, x), variables,
                     tmp_path / 'a.safetensors')
  lb = yax.load_lora(la.mox, la.params, tmp_path / 'b.safetensors')
  yax.check_mox(lb.mox)
  np.testing.assert_array_equal(yax.eval_mox(lb.mox, lb.params, x),
                                yax.eval_mox(res_b.mox, pb, x))
