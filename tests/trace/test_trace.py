"""make_mox: the tree it builds, checked against plain JAX/Flax.

Every test traces a function, checks the structure the spec promises, and
replays the tree with ``eval_mox`` against the function itself.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from helpers import assert_trees_close, equations, jit_eval, modules
from yax._src.ir.nodes import iter_nodes

KEY = jax.random.key(0)


# ------------------------------------------------------------ plain JAX

@jax.jit
def _double(x):
  return 2.0 * x


def _plain_functions():
  const = np.arange(3.0, dtype=np.float32)
  big_const = jnp.linspace(0.0, 1.0, 3)
  return {
      'elementwise': lambda x: jnp.sin(x) * 2.0 + 1,
      'jit_helper': lambda x: _double(x) + _double(x * 3),
      'numpy_const': lambda x: x * const,
      'jax_const': lambda x: x + big_const,
      'iota': lambda x: x + jnp.arange(3.0),
      'multi_out': lambda x: (x.sum(), {'a': x * 2, 'b': [x, -x]}),
      'reduce_dot': lambda x: jnp.dot(x, x) / x.shape[0],
      'scan': lambda x: jax.lax.scan(lambda c, y: (c + y, c * y), 0.0, x),
      'cond': lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x),
      'while': lambda x: jax.lax.fori_loop(0, 3, lambda i, c: c * 2 + i, x),
      'activations': lambda x: nn.relu(x) + nn.silu(x) + nn.gelu(x),
      'custom_jvp': lambda x: jax.nn.softplus(x) + jax.nn.relu(x),
  }


@pytest.mark.parametrize('name', sorted(_plain_functions()))
def test_plain_function_prints_like_make_jaxpr(name):
  fn = _plain_functions()[name]
  x = jnp.array([0.5, -1.0, 2.0], jnp.float32)
  mox = yax.make_mox(fn)(x)
  assert str(mox) == str(jax.make_jaxpr(fn)(x))
  assert modules(mox) == []
  assert_trees_close(yax.eval_mox(mox, x), fn(x))
  assert_trees_close(jit_eval(mox)(x), fn(x))


def test_root_of_plain_function_with_kwargs_and_pytrees():
  def fn(a, b, *, scale, tag='hi', flag=True):
    assert tag == 'hi' and flag is True
    return {'sum': a['x'] + b[0] * scale, 'prod': a['y'] * b[1]}, b[0]

  a = {'x': jnp.ones(2), 'y': jnp.full((2,), 3.0)}
  b = (jnp.arange(2.0), jnp.ones(2))
  args, kwargs = (a, b), {'scale': 2.0, 'tag': 'hi', 'flag': True}
  mox = yax.make_mox(fn)(*args, **kwargs)

  assert mox.is_ephemeral and mox.module_ty is None
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  assert mox.in_tree == tree
  assert len(mox.inputs) == len(leaves)
  # Arrays and Python numbers are dynamic; strings and bools are static.
  for sym, leaf in zip(mox.inputs, leaves):
    if isinstance(leaf, (str, bool)):
      assert isinstance(sym, yax.Literal) and sym.is_static
      assert sym.value == leaf
    else:
      assert isinstance(sym, yax.Var)
      assert sym.aval.shape == jnp.shape(leaf)
  expected = fn(*args, **kwargs)
  out_leaves, out_tree = jax.tree_util.tree_flatten(expected)
  assert mox.out_tree == out_tree
  assert len(mox.outputs) == len(out_leaves)
  assert [s.aval.shape for s in mox.outputs] == [x.shape for x in out_leaves]
  assert_trees_close(yax.eval_mox(mox, *args, **kwargs), expected)


def test_python_scalars_are_dynamic_inputs():
  fn = lambda x, n: x * n + 1
  mox = yax.make_mox(fn)(jnp.ones(3), 2.0)
  assert all(isinstance(s, yax.Var) for s in mox.inputs)
  assert_trees_close(yax.eval_mox(mox, jnp.ones(3), 5.0), fn(jnp.ones(3), 5.0))


def test_static_output_leaves_are_returned():
  fn = lambda x: (x + 1, 'label', None, 3)
  mox = yax.make_mox(fn)(jnp.ones(2))
  out = yax.eval_mox(mox, jnp.ones(2))
  assert out[1:3] == ('label', None)
  assert int(out[3]) == 3
  np.testing.assert_allclose(out[0], 2.0)


# ---------------------------------------------------------- Linen basics

class MLP(nn.Module):
  features: tuple = (8, 4)

  @nn.compact
  def __call__(self, x):
    for i, f in enumerate(self.features):
      x = nn.Dense(f, name=f'fc{i}')(x)
      if i + 1 < len(self.features):
        x = nn.relu(x)
    return x


def test_dense_node_inputs_params_and_var_tree():
  model = nn.Dense(5)
  x = jnp.ones((2, 3))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)

  (dense,) = modules(mox)
  assert mox.children == [dense]
  assert dense.type_name == 'Dense' and dense.module_ty is nn.Dense
  assert dense.entrypoint == '__call__'
  assert not dense.is_ephemeral
  assert dense.var_tree == jax.tree_util.tree_structure(
      {'params': {'bias': 0, 'kernel': 0}})
  assert dense.num_vars == 2
  assert len(dense.inputs) == 3
  bias, kernel, arg = dense.inputs
  assert (bias.aval.shape, kernel.aval.shape, arg.aval.shape) == (
      (5,), (3, 5), (2, 3))
  # The root's inputs are the leaves of (variables, x): bias, kernel, x.
  assert dense.inputs == mox.inputs
  assert dense.outputs == mox.outputs
  assert dense.in_tree == jax.tree_util.tree_structure(((x,), {}))
  assert dense.out_tree == jax.tree_util.tree_structure(x)
  # params: every dataclass field except `parent`, including `name`.
  assert 'parent' not in dense.params
  assert 'name' in dense.params
  assert dense.params['features'] == 5 and dense.params['use_bias'] is True
  assert set(dense.params) == {
      f.name for f in __import__('dataclasses').fields(nn.Dense)} - {'parent'}
  assert_trees_close(yax.eval_mox(mox, variables, x), model.apply(variables, x))


def test_compact_mlp_paths_names_and_nesting():
  model = MLP()
  x = jnp.ones((2, 3))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)

  (top,) = mox.children
  assert top.type_name == 'MLP' and top.path == ()
  assert top.params['features'] == (8, 4)
  assert top.var_tree == jax.tree_util.tree_structure(variables)
  assert top.inputs[:top.num_vars] == mox.inputs[:top.num_vars]
  dense = modules(mox, 'Dense')
  assert [d.path for d in dense] == [('fc0',), ('fc1',)]
  assert [d.name for d in dense] == ['fc0', 'fc1']
  assert all(d in top.children for d in dense)
  assert equations(top, name='relu')
  # fc1 reads what fc0 (through relu) wrote: symbols are shared.
  relu = equations(top, name='relu')[0]
  assert relu.inputs == dense[0].outputs
  assert dense[1].arg_inputs == relu.outputs
  assert_trees_close(yax.eval_mox(mox, variables, x), model.apply(variables, x))


class SetupModel(nn.Module):
  """setup() submodules, several methods, a method calling another one."""

  def setup(self):
    self.encoder = nn.Dense(6)
    self.decoder = nn.Dense(3)

  def encode(self, x):
    return nn.tanh(self.encoder(x))

  def decode(self, z):
    return self.decoder(z)

  def __call__(self, x):
    return self.decode(self.encode(x))


def test_setup_module_and_several_methods():
  model = SetupModel()
  x = jnp.ones((2, 3))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)

  (top,) = mox.children
  assert (top.type_name, top.entrypoint) == ('SetupModel', '__call__')
  # The module calls two other methods of itself: nested module_calls with
  # the same path, one per method.
  inner = [c for c in top.children if isinstance(c, yax.Mox)]
  assert [(m.type_name, m.entrypoint, m.path) for m in inner] == [
      ('SetupModel', 'encode', ()), ('SetupModel', 'decode', ())]
  assert modules(inner[0], 'Dense')[0].path == ('encoder',)
  assert modules(inner[1], 'Dense')[0].path == ('decoder',)
  assert inner[1].arg_inputs == inner[0].outputs
  assert_trees_close(yax.eval_mox(mox, variables, x), model.apply(variables, x))

  for method in ('encode', 'decode'):
    arg = x if method == 'encode' else jnp.ones((2, 6))
    expected = model.apply(variables, arg, method=method)
    mox = yax.make_mox(model.apply)(variables, arg, method=method)
    (top,) = mox.children
    assert (top.type_name, top.entrypoint) == ('SetupModel', method)
    assert len(modules(mox, 'Dense')) == 1
    assert_trees_close(yax.eval_mox(mox, variables, arg, method=method),
                       expected)
    # The method is a static argument, baked into the trace.
    with pytest.raises(yax.SignatureError, match='method'):
      yax.eval_mox(mox, variables, arg, method='__call__')


def test_init_is_traced_too():
  model = MLP()
  x = jnp.ones((1, 3))
  mox = yax.make_mox(model.init)(KEY, x)
  assert [d.path for d in modules(mox, 'Dense')] == [('fc0',), ('fc1',)]
  # During init the variables are created inside the call.
  assert_trees_close(yax.eval_mox(mox, KEY, x), model.init(KEY, x))
  other = jax.random.key(7)
  assert_trees_close(yax.eval_mox(mox, other, x), model.init(other, x))


class Shared(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(3, name='shared')
    return dense(nn.relu(dense(x)))


def test_shared_module_called_twice_reads_same_variables():
  model = Shared()
  x = jnp.ones((2, 3))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  first, second = modules(mox, 'Dense')
  assert first is not second
  assert first.path == second.path == ('shared',)
  assert first.var_inputs == second.var_inputs
  assert all(a is b for a, b in zip(first.var_inputs, second.var_inputs))
  assert first.arg_inputs != second.arg_inputs
  assert_trees_close(yax.eval_mox(mox, variables, x), model.apply(variables, x))


class Nested(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = MLP((4, 4), name='inner')(x)
    return x + MLP((4,), name='head')(x)


def test_nested_modules_paths():
  model = Nested()
  x = jnp.ones((1, 4))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  assert [m.path for m in modules(mox)] == [
      (), ('inner',), ('inner', 'fc0'), ('inner', 'fc1'), ('head',),
      ('head', 'fc0')]
  head = modules(mox, 'MLP')[1]
  assert head.var_tree == jax.tree_util.tree_structure(
      {'params': variables['params']['head']})
  assert_trees_close(yax.eval_mox(mox, variables, x), model.apply(variables, x))


# ------------------------------------------------- rngs, mutable state

class Noisy(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(8)(x)
    x = nn.Dropout(0.5, deterministic=not train)(x)
    return x + jax.random.normal(self.make_rng('noise'), x.shape)


def test_rngs_dropout_and_make_rng():
  model = Noisy()
  x = jnp.ones((4, 3))
  variables = model.init({'params': KEY, 'noise': KEY}, x, False)
  rngs = {'dropout': jax.random.key(1), 'noise': jax.random.key(2)}
  mox = yax.make_mox(model.apply)(variables, x, True, rngs=rngs)
  (drop,) = modules(mox, 'Dropout')
  assert drop.params['deterministic'] is False
  assert drop.params['rate'] == 0.5
  expected = model.apply(variables, x, True, rngs=rngs)
  assert_trees_close(yax.eval_mox(mox, variables, x, True, rngs=rngs), expected)
  assert_trees_close(jit_eval(mox)(variables, x, True, rngs=rngs), expected)
  # New keys give new randomness, exactly as in Flax.
  rngs2 = {'dropout': jax.random.key(3), 'noise': jax.random.key(4)}
  assert_trees_close(yax.eval_mox(mox, variables, x, True, rngs=rngs2),
                     model.apply(variables, x, True, rngs=rngs2))
  # `train` is a static bool.
  with pytest.raises(yax.SignatureError, match=r'args\[2\]'):
    yax.eval_mox(mox, variables, x, False, rngs=rngs)


class WithBatchNorm(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(4)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    return nn.relu(x)


def test_batchnorm_mutable_batch_stats():
  model = WithBatchNorm()
  x = jax.random.normal(KEY, (8, 3))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x, mutable=['batch_stats'])
  (bn,) = modules(mox, 'BatchNorm')
  assert bn.var_tree == jax.tree_util.tree_structure(
      {'batch_stats': {'mean': 0, 'var': 0}, 'params': {'bias': 0, 'scale': 0}})
  expected = model.apply(variables, x, mutable=['batch_stats'])
  got = yax.eval_mox(mox, variables, x, mutable=['batch_stats'])
  assert isinstance(got, tuple) and len(got) == 2
  assert_trees_close(got, expected)
  assert_trees_close(jit_eval(mox)(variables, x, mutable=['batch_stats']),
                     expected)
  # Inference mode: no mutable collections, running averages used.
  mox = yax.make_mox(model.apply)(variables, x, train=False)
  assert_trees_close(yax.eval_mox(mox, variables, x, train=False),
                     model.apply(variables, x, train=False))


# ---------------------------------------- jit helpers, custom derivatives

def test_silu_is_a_jit_equation_gelu_is_inlined_relu_is_custom_jvp():
  class Acts(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(4)(x)
      return nn.silu(x) * nn.gelu(x) + nn.relu(x)

  model = Acts()
  x = jnp.linspace(-2, 2, 12).reshape(3, 4)
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)

  (silu,) = equations(mox, name='silu')
  assert silu.prim.name == 'jit' and silu.params['name'] == 'silu'
  assert equations(mox, name='gelu') == []
  assert equations(mox, prim='tanh')  # gelu's approximate form, inlined
  (relu,) = equations(mox, name='relu')
  assert relu.prim.name == 'custom_jvp_call'
  assert_trees_close(yax.eval_mox(mox, variables, x), model.apply(variables, x))

  # Gradients go through relu's custom rule exactly as through the model.
  loss = lambda fn: lambda v: jnp.sum(fn(v, x) ** 2)
  g_ref = jax.grad(loss(model.apply))(variables)
  g_mox = jax.grad(loss(lambda v, x: yax.eval_mox(mox, v, x)))(variables)
  assert_trees_close(g_mox, g_ref)


def test_relu_custom_jvp_rule_is_kept_at_zero():
  # relu's custom JVP gives gradient 0 at 0; a plain max() would give 0.5.
  mox = yax.make_mox(nn.relu)(jnp.zeros(3))
  (eqn,) = mox.children
  assert eqn.prim.name == 'custom_jvp_call' and eqn.name == 'relu'
  g = jax.grad(lambda x: yax.eval_mox(mox, x).sum())(jnp.zeros(3))
  np.testing.assert_array_equal(g, jax.grad(lambda x: nn.relu(x).sum())(
      jnp.zeros(3)))


def test_constants_and_literals_inside_modules():
  table = np.arange(12, dtype=np.float32).reshape(3, 4)

  class Consts(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(4)(x) * 0.5 + 1
      return x + table + jnp.asarray(table) * 2

  model = Consts()
  x = jnp.ones((3, 2))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  literals = [s for n in iter_nodes(mox) for s in n.inputs
              if isinstance(s, yax.Literal) and not s.is_static]
  assert any(float(np.asarray(s.value)) == 0.5 for s in literals
             if np.ndim(s.value) == 0)
  expected = model.apply(variables, x)
  assert_trees_close(yax.eval_mox(mox, variables, x), expected)
  assert_trees_close(jit_eval(mox)(variables, x), expected)


class HostSide(nn.Module):
  """Computes on the host as audio front ends do: a filterbank built from
  NumPy in ``setup`` (``np.asarray`` of a tracer fails) and a float64 NumPy
  helper method whose result is rounded to float32 only at the end."""
  n: int = 8

  def filterbank(self, freqs):
    return np.asarray(np.outer(freqs, np.sqrt(freqs)), dtype=np.float32)

  def setup(self):
    self.dense = nn.Dense(self.n)
    self.fb = self.filterbank(np.linspace(0.0, 1.0, self.n))

  def window(self, t):
    assert t.dtype == np.float64, t.dtype  # plain Flax keeps it float64
    return np.exp(t * 1.1) / 3.0 + np.float64(1e-7) * t

  def __call__(self, x):
    w = self.window(np.arange(self.n, dtype=np.float64) / 7.0)
    return self.dense(x) @ self.fb + jnp.asarray(w, jnp.float32)


def test_numpy_arguments_of_module_methods_stay_numpy():
  model = HostSide()
  x = jnp.linspace(0.0, 1.0, 16).reshape(2, 8)
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  expected = model.apply(variables, x)
  # Exactly the plain result: the float64 helper ran in float64.
  np.testing.assert_array_equal(yax.eval_mox(mox, variables, x), expected)
  np.testing.assert_array_equal(jit_eval(mox)(variables, x), expected)
  window = yax.query('//module_call[@method="window"]', mox)
  assert len(window) == 1 and window[0].inputs[0].is_static


# ------------------------------------------------------ lifted transforms

class Block(nn.Module):
  @nn.compact
  def __call__(self, carry, _):
    return nn.tanh(nn.Dense(4)(carry)), None


class Lifted(nn.Module):
  @nn.compact
  def __call__(self, x):
    stack = nn.scan(Block, variable_axes={'params': 0},
                    split_rngs={'params': True}, length=3)
    x, _ = stack(name='stack')(x, None)
    ens = nn.vmap(nn.Dense, variable_axes={'params': 0},
                  split_rngs={'params': True}, in_axes=None, out_axes=0,
                  axis_size=2)
    x = ens(4, name='ensemble')(x).mean(0)
    x = nn.remat(nn.Dense)(4, name='remat')(x)
    x = nn.jit(nn.Dense)(4, name='jitted')(x)
    return x


def test_lifted_transforms_keep_inner_module_calls():
  model = Lifted()
  x = jnp.ones((2, 4))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)

  dense_paths = [d.path for d in modules(mox, 'Dense')]
  assert ('stack', 'Dense_0') in dense_paths
  assert ('ensemble',) in dense_paths
  assert ('remat',) in dense_paths
  assert ('jitted',) in dense_paths
  assert [b.path for b in modules(mox, 'Block')] == [('stack',)]
  # Bodies of scan / remat / jit are Equation.children.
  for prim in ('scan', 'jit'):
    holders = [e for e in equations(mox, prim=prim) if e.children]
    assert holders, prim
    for eqn in holders:
      assert len(eqn.children) == len(eqn.body_keys)
      assert all(isinstance(b, yax.Mox) and b.is_ephemeral
                 for b in eqn.children)
  (scan,) = equations(mox, prim='scan')
  assert modules(scan.children[0], 'Dense')
  expected = model.apply(variables, x)
  assert_trees_close(yax.eval_mox(mox, variables, x), expected)
  assert_trees_close(jit_eval(mox)(variables, x), expected)
  g = lambda f: jax.grad(lambda v: jnp.sum(f(v, x) ** 2))(variables)
  assert_trees_close(g(lambda v, x: yax.eval_mox(mox, v, x)), g(model.apply))


# ----------------------------------------------------- HF-style wrapper

class Wrapper:
  """Calls like a Hugging Face Flax model: ``model(ids, params=params)``."""

  def __init__(self, module, params):
    self.module = module
    self.params = params

  def __call__(self, ids, params=None, train: bool = False):
    params = self.params if params is None else params
    return {'logits': self.module.apply({'params': params}, ids)}


def test_hf_style_wrapper():
  module = MLP((5, 2))
  x = jnp.ones((3, 4))
  params = module.init(KEY, x)['params']
  model = Wrapper(module, params)
  mox = yax.make_mox(model)(x, params=params)
  assert mox.in_tree == jax.tree_util.tree_structure(((x,), {'params': params}))
  assert [d.path for d in modules(mox, 'Dense')] == [('fc0',), ('fc1',)]
  new = jax.tree_util.tree_map(lambda p: p + 1.0, params)
  assert_trees_close(yax.eval_mox(mox, x, params=new), model(x, params=new))


def test_make_mox_rejects_non_callables():
  with pytest.raises(yax.TraceError, match='expects a callable, found int'):
    yax.make_mox(3)


# ------------------------------------- control flow lifts, inner transforms

class Branchy(nn.Module):
  """nn.cond / nn.switch / nn.while_loop over submodules."""

  def setup(self):
    self.a = nn.Dense(3)
    self.b = nn.Dense(3)
    self.loop = nn.Dense(3)

  def __call__(self, x, p, i):
    if self.is_initializing():  # every branch creates its variables
      self.a(x), self.b(x), self.loop(x)
    y = nn.cond(p > 0, lambda m, x: m.a(x), lambda m, x: m.b(x), self, x)
    y = nn.switch(i, [lambda m, x: m.a(x), lambda m, x: m.b(x)], self, y)
    return nn.while_loop(lambda m, c: c[0] < 2,
                         lambda m, c: (c[0] + 1, m.loop(c[1])), self, (0, y))[1]


def test_cond_switch_while_loop_bodies_hold_module_calls():
  model = Branchy()
  x = jnp.ones((2, 3))
  variables = model.init(KEY, x, 1.0, 0)
  mox = yax.make_mox(model.apply)(variables, x, 1.0, 0)
  conds = [e for e in equations(mox, prim='cond') if e.children]
  assert len(conds) == 2
  assert all(k[0] == 'branches' for e in conds for k in e.body_keys)
  (loop,) = [e for e in equations(mox, prim='while') if e.children]
  assert 'body_jaxpr' in loop.body_keys
  assert sorted(d.path for d in modules(mox, 'Dense')) == [
      ('a',), ('a',), ('b',), ('b',), ('loop',)]
  # The predicate and index are dynamic: other branches run at eval time.
  for p, i in [(1.0, 0), (-1.0, 0), (1.0, 1), (-2.0, 1)]:
    expected = model.apply(variables, x, p, i)
    assert_trees_close(yax.eval_mox(mox, variables, x, p, i), expected)
    assert_trees_close(jit_eval(mox)(variables, x, jnp.float32(p),
                                     jnp.int32(i)), expected)


@pytest.mark.parametrize('name', ['grad', 'value_and_grad', 'vmap',
                                  'checkpoint', 'jit', 'jvp'])
def test_jax_transforms_inside_the_traced_function(name):
  model = MLP((4, 3))
  x = jnp.linspace(-1, 1, 6).reshape(2, 3)
  variables = model.init(KEY, x)
  loss = lambda v, x: jnp.sum(model.apply(v, x) ** 2)
  fn = {
      'grad': lambda v, x: jax.grad(loss)(v, x),
      'value_and_grad': lambda v, x: jax.value_and_grad(loss, argnums=1)(v, x),
      'vmap': lambda v, x: jax.vmap(model.apply, in_axes=(None, 0))(
          v, x[:, None]),
      'checkpoint': lambda v, x: jax.checkpoint(model.apply)(v, x),
      'jit': lambda v, x: jax.jit(model.apply)(v, x),
      'jvp': lambda v, x: jax.jvp(lambda x: model.apply(v, x), (x,),
                                  (jnp.ones_like(x),)),
  }[name]
  mox = yax.make_mox(fn)(variables, x)
  assert {d.path for d in modules(mox, 'Dense')} == {('fc0',), ('fc1',)}
  expected = fn(variables, x)
  assert_trees_close(yax.eval_mox(mox, variables, x), expected)
  assert_trees_close(jit_eval(mox)(variables, x), expected)


def test_sow_debug_print_and_embed_attend():
  class Misc(nn.Module):
    @nn.compact
    def __call__(self, ids):
      embed = nn.Embed(10, 4)
      h = embed(ids)
      jax.debug.callback(lambda s: None, h.sum())
      self.sow('intermediates', 'h', h)
      return embed.attend(nn.Dense(4)(h))

  model = Misc()
  ids = jnp.array([[1, 2, 3]])
  variables = model.init(KEY, ids)
  mox = yax.make_mox(model.apply)(variables, ids, mutable=['intermediates'])
  embeds = modules(mox, 'Embed')
  assert [e.entrypoint for e in embeds] == ['__call__', 'attend']
  assert embeds[0].var_inputs == embeds[1].var_inputs
  assert equations(mox, prim='debug_callback')
  expected = model.apply(variables, ids, mutable=['intermediates'])
  assert_trees_close(
      yax.eval_mox(mox, variables, ids, mutable=['intermediates']), expected)


class _ScanStep(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    h = jnp.tanh(nn.Dense(6, name='dense')(c))
    return h + nn.Dense(6, use_bias=False, name='other')(c), None


class _ScanOnAxis(nn.Module):
  """Three layers stacked by nn.scan on ``axis`` of every param (on axis
  1 Flax moves the stack axis to the front with a transpose before the
  scan slices it, as MaxText's param_scan_axis=1 does)."""
  axis: int

  @nn.compact
  def __call__(self, x):
    body = nn.scan(_ScanStep, variable_axes={'params': self.axis},
                   split_rngs={'params': True}, length=3)
    return body(name='layers')(x, None)[0]


@pytest.mark.parametrize('axis', [0, 1])
def test_scan_with_params_stacked_on_axis_1_traces_checks_and_takes_lora(
    axis):
  model = _ScanOnAxis(axis)
  x = jax.random.normal(jax.random.key(0), (2, 6))
  variables = model.init(jax.random.key(1), x)
  kernel = variables['params']['layers']['dense']['kernel']
  assert kernel.shape == ((3, 6, 6) if axis == 0 else (6, 3, 6))
  mox = yax.make_mox(model.apply)(variables, x)
  # The call around the scan lists the stacked params its body reads
  # (through the transposes), as stored.
  yax.check_mox(mox)
  np.testing.assert_allclose(yax.eval_mox(mox, variables, x),
                             model.apply(variables, x), rtol=1e-6, atol=1e-6)
  (top,) = [r for r in yax.summary(mox) if r.depth == 0]
  assert top.params == sum(np.size(v) for v in jax.tree.leaves(variables))
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=2,
                 alpha=2.0, key=jax.random.key(2))
  yax.check_mox(res.mox)
  assert res.paths == [('layers', 'dense'), ('layers', 'other')]
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             model.apply(variables, x), rtol=1e-6, atol=1e-6)
  rng = np.random.default_rng(3)
  trained = jax.tree.map(
      lambda v, m: v + rng.normal(0, 0.5, np.shape(v)).astype(v.dtype)
      if m else v, res.params, res.mask)
  want = {'params': {'layers': {}}}
  for name, module in trained['params']['layers'].items():
    a, b = module['lora_a'], module['lora_b']  # [layers, in, r], [layers, r, out]
    assert a.shape == (3, 6, 2) and b.shape == (3, 2, 6)
    delta = np.einsum('lir,lro->lio', a, b)
    if axis == 1:
      delta = delta.transpose(1, 0, 2)
    want['params']['layers'][name] = {
        k: v + (2.0 / 2) * delta if k == 'kernel' else v
        for k, v in module.items() if not k.startswith('lora')}
  expected = model.apply(want, x)
  assert not np.allclose(expected, model.apply(variables, x), atol=1e-4)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), expected,
                             rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(model.apply(res.merge(trained), x), expected,
                             rtol=2e-5, atol=2e-5)


class _DropBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dropout(0.5, deterministic=False)(nn.Dense(4)(x))


class _DropNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(_DropBlock(name='b1')(_DropBlock(name='b0')(x)))


@pytest.mark.parametrize('make_key', [jax.random.key, jax.random.PRNGKey])
def test_a_dropout_key_given_as_rngs_is_an_input_of_the_calls_drawing_it(
    make_key):
  """apply(..., rngs={'dropout': key}): each Dropout call draws from the
  key, so the key is an input of the Dropout calls and of the calls
  around them (collection 'rngs'); the Dense calls do not read it.
  Failed before: check_mox 'reads input 0 Var(key<fry>[]), an argument of
  the traced function, inside module_call Dropout ... which does not list
  it'."""
  x = jnp.arange(12.0).reshape(3, 4)
  v = _DropNet().init(jax.random.key(0), x)
  f = lambda v, x, k: _DropNet().apply(v, x, rngs={'dropout': k})
  k = make_key(1)
  mox = yax.make_mox(f)(v, x, k)
  yax.check_mox(mox)
  np.testing.assert_array_equal(yax.eval_mox(mox, v, x, k), f(v, x, k))
  key_sym, = mox.inputs[-1:]
  readers = {m.path for m in modules(mox) if key_sym in m.inputs}
  assert readers == {(), ('b0',), ('b0', 'Dropout_0'), ('b1',),
                     ('b1', 'Dropout_0')}
  (drop,) = [m for m in modules(mox) if m.path == ('b0', 'Dropout_0')]
  assert drop.var_tree == jax.tree_util.tree_structure(
      {'rngs': {'dropout': 0}})
