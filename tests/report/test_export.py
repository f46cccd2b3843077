"""yax.export: a rewritten tree as a jax.export.Exported that serializes,
reloads and runs in a process that cannot import YAX, equal to the plain
Flax model on the weights the rewrite stores; each op's location carries
its module path, which Model Explorer's own MLIR adapter nests by."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from helpers import check_rewrite


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(8)(jnp.tanh(nn.Dense(16)(x)))


class Stack(nn.Module):

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Block(name=f'block{i}')(x)
    return nn.Dense(3)(x)


MODEL = Stack()
VARS = MODEL.init(jax.random.key(0), jnp.zeros((1, 8)))
DENSE_PATHS = {'block0/Dense_0', 'block0/Dense_1', 'block1/Dense_0',
               'block1/Dense_1', 'Dense_0'}

# Runs exported programs where YAX cannot be imported: each job is a
# serialized Exported and its flat inputs (npz, in its in_tree's order).
_RUNNER = r'''
import importlib.abc, sys
class NoYax(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name == 'yax' or name.startswith('yax.'):
      raise ImportError('this process must not import yax')
sys.meta_path.insert(0, NoYax())
import jax, numpy as np
from jax import export
for job in sys.argv[1:]:
  exp = export.deserialize(bytearray(open(job + '.bin', 'rb').read()))
  data = np.load(job + '.in.npz')
  leaves = [data[f'x{i}'] for i in range(len(data.files))]
  args, kwargs = jax.tree_util.tree_unflatten(exp.in_tree, leaves)
  out = jax.tree_util.tree_leaves(exp.call(*args, **kwargs))
  np.savez(job + '.out.npz', **{f'y{i}': np.asarray(y) for i, y in enumerate(out)})
assert not any(m == 'yax' or m.startswith('yax.') for m in sys.modules)
'''


def run_without_yax(tmp_path: pathlib.Path, jobs) -> list:
  """Serializes each ``(exported, args)``, runs them all in one fresh
  Python process that blocks ``import yax``, returns each output list."""
  names = []
  for k, (exp, args) in enumerate(jobs):
    name = str(tmp_path / f'job{k}')
    blob = exp.serialize()
    assert isinstance(blob, (bytes, bytearray))
    pathlib.Path(name + '.bin').write_bytes(bytes(blob))
    leaves = jax.tree_util.tree_leaves(args)
    np.savez(name + '.in.npz', **{f'x{i}': np.asarray(x)
                                  for i, x in enumerate(leaves)})
    names.append(name)
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  env['JAX_PLATFORMS'] = 'cpu'
  done = subprocess.run([sys.executable, '-c', _RUNNER, *names], env=env,
                        cwd=tmp_path, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  outs = []
  for name in names:
    data = np.load(name + '.out.npz')
    outs.append([data[f'y{i}'] for i in range(len(data.files))])
  return outs


@pytest.fixture(scope='module')
def symbolic_mox():
  """The model traced with a symbolic batch ``b``."""
  b, = jax.export.symbolic_shape('b')
  return yax.make_mox(MODEL.apply)(VARS, jax.ShapeDtypeStruct((b, 8),
                                                              jnp.float32))


def dequantized(params):
  """Plain Flax params from int8 kernels and their scales, by hand:
  ``kernel * kernel_scale``."""
  def walk(d):
    if not isinstance(d, dict):
      return d
    d = {k: walk(v) for k, v in d.items()}
    if 'kernel_scale' in d:
      d['kernel'] = d['kernel'].astype(jnp.float32) * d.pop('kernel_scale')
    return d
  return walk(params)


def test_quantized_and_merged_trees_run_without_yax(symbolic_mox, tmp_path):
  q = yax.quantize(symbolic_mox, VARS, '//module_call[@type="Dense"]')
  check_rewrite(q.mox)
  assert q.params['params']['Dense_0']['kernel'].dtype == jnp.int8
  q_exp = yax.export(q.mox)  # the shapes of the trace: batch b
  assert str(q_exp.in_avals[-1]) == 'float32[b,8]'
  lo = yax.lora(symbolic_mox, VARS, '//module_call[@type="Dense"]', rank=2)
  check_rewrite(lo.mox)
  trained = jax.tree_util.tree_map_with_path(
      lambda kp, x: (0.1 * jnp.ones_like(x) if str(kp[-1].key) == 'lora_b'
                     else x), lo.params)
  merged = lo.merge(trained)
  m_exp = yax.export(symbolic_mox)
  x5 = jax.random.normal(jax.random.key(1), (5, 8))
  x7 = jax.random.normal(jax.random.key(2), (7, 8))
  outs = run_without_yax(tmp_path, [(q_exp, ((q.params, x5), {})),
                                    (q_exp, ((q.params, x7), {})),
                                    (m_exp, ((merged, x7), {}))])
  plain_q = {'params': dequantized(q.params['params'])}
  for (y,), x in zip(outs[:2], (x5, x7)):
    np.testing.assert_allclose(y, MODEL.apply(plain_q, x), rtol=1e-5,
                               atol=1e-5)
  np.testing.assert_allclose(outs[2][0], MODEL.apply(merged, x7), rtol=1e-5,
                             atol=1e-5)
  # The merge changed the output: the adapters were not zero.
  assert not np.allclose(outs[2][0], MODEL.apply(VARS, x7), atol=1e-3)


def test_export_equals_eval_mox_at_the_traced_shapes(tmp_path):
  x = jax.random.normal(jax.random.key(3), (4, 8))
  mox = yax.make_mox(MODEL.apply)(VARS, x)
  q = yax.quantize(mox, VARS, '//module_call[@type="Dense"]', weight='int4')
  exp = yax.export(q.mox, q.params, x)
  np.testing.assert_array_equal(exp.call(q.params, x),
                                yax.eval_mox(q.mox, q.params, x))
  with pytest.raises(yax.SignatureError, match='f32'):
    yax.export(q.mox, q.params, jnp.zeros((4, 9)))


def _namespaces(graphs) -> list[tuple[str, str]]:
  out = []
  for collection in graphs['graphCollections']:
    for graph in collection.graphs:
      out += [(n['label'], n['namespace']) for n in graph['nodes']]
  return out


def test_locations_carry_module_paths_that_model_explorer_nests(
    symbolic_mox, tmp_path):
  from model_explorer.builtin_mlir_adapter import BuiltinMlirAdapter
  q = yax.quantize(symbolic_mox, VARS, '//module_call[@type="Dense"]')
  exp = yax.export(q.mox)
  text = exp.mlir_module()
  for path in DENSE_PATHS:
    assert f'loc("jit(model)/{path}/dot_general"' in text
  # Flax's own scopes (Stack/block0/...) are not repeated.
  assert 'Stack/' not in text
  mlirbc = tmp_path / 'model.mlirbc'
  mlirbc.write_bytes(bytes(exp.mlir_module_serialized))
  nodes = _namespaces(BuiltinMlirAdapter().convert(str(mlirbc), {}))
  dots = {ns for label, ns in nodes if label == 'stablehlo.dot_general'}
  assert dots == {f'jit(model)/{p}/dot_general' for p in DENSE_PATHS}
  # The dequantization quantize added sits in its Dense.
  muls = {ns.rsplit('/', 1)[0] for label, ns in nodes
          if label == 'stablehlo.multiply'}
  assert {f'jit(model)/{p}' for p in DENSE_PATHS} <= muls
