"""yax.sub: every replacement kind, root style, sharing pattern and error."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from yax._src.ir.nodes import iter_nodes

os.environ.setdefault('USE_TORCH', '0')


def modules(mox, type_name):
  return [n for n in iter_nodes(mox)
          if isinstance(n, yax.Mox) and n.type_name == type_name]


def equations(mox, name):
  return [n for n in iter_nodes(mox)
          if isinstance(n, yax.Equation) and n.name == name]


def close(a, b, tol=1e-5):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def fingerprint(mox):
  """Everything a rewrite could change, as plain values."""
  return (str(mox), [(type(n).__name__, id(n), tuple(map(id, n.inputs)),
                      tuple(map(id, n.outputs)),
                      tuple(map(id, getattr(n, 'children', ()))))
                     for n in iter_nodes(mox)],
          mox.in_tree, [id(s) for s in mox.inputs])


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(8)(x))
    h = nn.relu(nn.Dense(8)(h))
    return nn.Dense(3)(h)


@pytest.fixture(scope='module')
def mlp():
  model = MLP()
  x = jax.random.normal(jax.random.key(1), (2, 5))
  variables = model.init(jax.random.key(0), x)
  return model, variables, x, yax.make_mox(model.apply)(variables, x)


def reference_mlp(variables, x, act):
  p = variables['params']
  dense = lambda name, h: h @ p[name]['kernel'] + p[name]['bias']
  h = act(dense('Dense_0', x))
  h = act(dense('Dense_1', h))
  return dense('Dense_2', h)


# ------------------------------------------------------------ repl kinds

def test_ephemeral_function_root_relu_to_gelu(mlp):
  model, variables, x, mox = mlp
  gelu = yax.make_mox(jax.nn.gelu)(jnp.zeros((2, 8)))
  before = fingerprint(mox), fingerprint(gelu)
  new = yax.sub('//*[@name="relu"]', gelu, mox)
  assert (fingerprint(mox), fingerprint(gelu)) == before
  assert len(equations(new, 'relu')) == 0 and len(equations(mox, 'relu')) == 2
  close(yax.eval_mox(new, variables, x), reference_mlp(variables, x, jax.nn.gelu))
  close(jax.jit(lambda v, x: yax.eval_mox(new, v, x))(variables, x),
        reference_mlp(variables, x, jax.nn.gelu))


def test_equation_replacement(mlp):
  model, variables, x, mox = mlp
  tanh_eqn = yax.make_mox(jnp.tanh)(jnp.zeros((2, 8))).children[0]
  assert isinstance(tanh_eqn, yax.Equation)
  new = yax.sub(equations(mox, 'relu'), tanh_eqn, mox)
  close(yax.eval_mox(new, variables, x), reference_mlp(variables, x, jnp.tanh))


def test_module_replacement_fresh_trace_reuses_weights(mlp):
  model, variables, x, mox = mlp
  dense = modules(mox, 'Dense')[1]
  fresh = yax.make_mox(nn.Dense(8).apply)(
      {'params': variables['params']['Dense_1']}, jnp.zeros((2, 8)))
  new = yax.sub([dense], fresh, mox)
  assert new.in_tree == mox.in_tree
  replaced = modules(new, 'Dense')[1]
  assert replaced.path == ('Dense_1',) and replaced.name == 'Dense_1'
  assert replaced.var_inputs == dense.var_inputs  # the same weight symbols
  close(yax.eval_mox(new, variables, x), model.apply(variables, x))


def test_module_replacement_with_new_variables_grows_params(mlp):
  model, variables, x, mox = mlp

  class Scaled(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
      scale = self.param('scale', nn.initializers.ones, (self.features,))
      return nn.Dense(self.features, name='inner')(x) * scale

  scaled = Scaled(8)
  scaled_vars = scaled.init(jax.random.key(3), jnp.zeros((2, 8)))
  repl = yax.make_mox(scaled.apply)(scaled_vars, jnp.zeros((2, 8)))
  new = yax.sub([modules(mox, 'Dense')[1]], repl, mox)
  # The root now expects the new variables under Dense_1.
  params = jax.tree_util.tree_map(lambda a: a, variables)
  params = {'params': dict(params['params'])}
  # Variables of the replaced call stay in the tree (they are simply unread).
  params['params']['Dense_1'] = {**variables['params']['Dense_1'],
                                 **scaled_vars['params']}
  with pytest.raises(yax.SignatureError, match='argument tree'):
    yax.eval_mox(new, variables, x)
  out = yax.eval_mox(new, params, x)
  p = variables['params']
  h = jax.nn.relu(x @ p['Dense_0']['kernel'] + p['Dense_0']['bias'])
  h = jax.nn.relu(scaled.apply(scaled_vars, h))
  close(out, h @ p['Dense_2']['kernel'] + p['Dense_2']['bias'])
  # The enclosing MLP call keeps its type; it is marked rewritten, since
  # its class no longer declares the variables it reads.
  top = new.children[0]
  assert top.type_name == 'MLP' and top.rewritten and top.path == ()
  assert top.rebuild_ty is None
  assert top.num_vars == len(jax.tree_util.tree_leaves(params))


def test_callable_replacement_and_keep(mlp):
  model, variables, x, mox = mlp
  seen = []

  def keep(path, node):
    seen.append(path)
    return node

  same = yax.sub('//module_call[@type="Dense"]', keep, mox)
  assert seen == [('Dense_0',), ('Dense_1',), ('Dense_2',)]
  assert str(same) == str(mox)
  close(yax.eval_mox(same, variables, x), model.apply(variables, x))

  def to_sigmoid(path, node):
    return yax.make_mox(jax.nn.sigmoid)(jnp.zeros(node.inputs[0].aval.shape))

  new = yax.sub('//*[@name="relu"]', to_sigmoid, mox)
  close(yax.eval_mox(new, variables, x),
        reference_mlp(variables, x, jax.nn.sigmoid))


def test_replacement_used_twice_gets_fresh_symbols(mlp):
  _, variables, x, mox = mlp
  gelu = yax.make_mox(jax.nn.gelu)(jnp.zeros((2, 8)))
  new = yax.sub('//*[@name="relu"]', gelu, mox)
  defined = [s for n in iter_nodes(new) if isinstance(n, yax.Equation)
             for s in n.outputs]
  assert len(defined) == len(set(map(id, defined)))


# ----------------------------------------------------------- root styles

def small_bert():
  from transformers import BertConfig, FlaxBertModel
  config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=24,
                      max_position_embeddings=32, hidden_act='relu')
  return FlaxBertModel(config, seed=0)


def test_hf_style_root_params_kwarg():
  model = small_bert()
  ids = jnp.array([[1, 5, 7, 9, 2, 0]], jnp.int32)
  mox = yax.make_mox(model)(ids, params=model.params)
  gelu = lambda path, node: yax.make_mox(jax.nn.gelu)(
      jnp.zeros(node.inputs[0].aval.shape, node.inputs[0].aval.dtype))
  new = yax.sub('//*[@name="relu"]', gelu, mox)
  assert len(equations(mox, 'relu')) == 2 and not equations(new, 'relu')
  from transformers import BertConfig, FlaxBertModel
  config = model.config.to_dict()
  config['hidden_act'] = 'gelu_new'  # tanh approximation == jax.nn.gelu
  ref_model = FlaxBertModel(BertConfig(**config), seed=0)
  ref = ref_model(ids, params=model.params)
  out = yax.eval_mox(new, ids, params=model.params)
  close(out.last_hidden_state, ref.last_hidden_state, tol=1e-4)


# ------------------------------------------------- sharing and methods

class Shared(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(5, name='shared')
    return dense(jnp.tanh(dense(x)))


def test_shared_module_every_call_site_consistent():
  model = Shared()
  x = jax.random.normal(jax.random.key(0), (3, 5))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  sites = modules(mox, 'Dense')
  assert len(sites) == 2 and sites[0].var_inputs == sites[1].var_inputs
  res = yax.lora(mox, variables, '//module_call[@name="shared"]', rank=2)
  # one adapter for the one module, read by both call sites
  assert set(res.params['params']['shared']) == {'bias', 'kernel', 'lora_a',
                                                 'lora_b'}
  loras = [n for n in iter_nodes(res.mox) if isinstance(n, yax.Mox)
           and n.type_name == 'LoRA']
  assert len(loras) == 2 and loras[0].var_inputs == loras[1].var_inputs
  trained = jax.tree_util.tree_map(
      lambda p, m: p + 0.3 if m else p, res.params, res.mask)
  p = trained['params']['shared']
  w = p['kernel'] + 0.5 * p['lora_a'] @ p['lora_b']
  ref = jnp.tanh(x @ w + p['bias']) @ w + p['bias']
  close(yax.eval_mox(res.mox, trained, x), ref)
  close(yax.eval_mox(mox, res.merge(trained), x), ref)


class AutoEncoder(nn.Module):
  def setup(self):
    self.enc = nn.Dense(2)
    self.dec = nn.Dense(4)

  def encode(self, x):
    return nn.relu(self.enc(x))

  def decode(self, z):
    return self.dec(z)

  def __call__(self, x):
    return self.decode(self.encode(x))


def test_multi_method_module():
  model = AutoEncoder()
  x = jax.random.normal(jax.random.key(0), (3, 4))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  methods = [n.entrypoint for n in iter_nodes(mox) if isinstance(n, yax.Mox)
             and n.type_name == 'AutoEncoder']
  assert methods == ['__call__', 'encode', 'decode']
  tanh = yax.make_mox(jnp.tanh)(jnp.zeros((3, 2)))
  new = yax.sub('//module_call[@method="encode"]//*[@name="relu"]', tanh, mox)
  p = variables['params']
  ref = jnp.tanh(x @ p['enc']['kernel'] + p['enc']['bias']) @ p['dec'][
      'kernel'] + p['dec']['bias']
  close(yax.eval_mox(new, variables, x), ref)
  res = yax.lora(mox, variables, '//module_call[@method="decode"]//'
                 'module_call[@type="Dense"]', rank=1)
  assert 'lora_a' in res.params['params']['dec']
  assert 'lora_a' not in res.params['params']['enc']
  close(yax.eval_mox(res.mox, res.params, x), model.apply(variables, x))


class Block(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return jnp.tanh(nn.Dense(4)(c)), None


class Stack(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(Block, variable_axes={'params': 0},
                   split_rngs={'params': True}, length=3)
    c, _ = scan()(x, None)
    return c


def test_module_inside_scan():
  model = Stack()
  x = jax.random.normal(jax.random.key(0), (2, 4))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  inner = modules(mox, 'Dense')
  assert len(inner) == 1  # inside the scan body
  sin = yax.make_mox(jnp.sin)(jnp.zeros((2, 4)))
  new = yax.sub('//scan//tanh', sin, mox)
  kernels = variables['params']['ScanBlock_0']['Dense_0']
  c = x
  for i in range(3):
    c = jnp.sin(c @ kernels['kernel'][i] + kernels['bias'][i])
  close(yax.eval_mox(new, variables, x), c)
  close(jax.jit(lambda v, x: yax.eval_mox(new, v, x))(variables, x), c)
  # a fresh trace of the scanned Dense reads the same (sliced) weights
  fresh = yax.make_mox(nn.Dense(4).apply)(
      {'params': jax.tree_util.tree_map(lambda a: a[0], kernels)},
      jnp.zeros((2, 4)))
  same = yax.sub(inner, fresh, mox)
  close(yax.eval_mox(same, variables, x), model.apply(variables, x))


# --------------------------------------------------------------- errors

def test_output_shape_mismatch_names_path_and_types(mlp):
  _, variables, x, mox = mlp
  before = fingerprint(mox)
  wrong = yax.make_mox(lambda h: h[:, :7])(jnp.zeros((2, 8)))
  with pytest.raises(yax.SubstitutionError,
                     match=r"Dense at path 'Dense_1'.*output 0.*f32\[2,8\].*"
                           r"f32\[2,7\]"):
    yax.sub([modules(mox, 'Dense')[1]], wrong, mox)
  assert fingerprint(mox) == before
  clash = yax.make_mox(nn.Dense(7).apply)(
      nn.Dense(7).init(jax.random.key(0), jnp.zeros((2, 8))), jnp.zeros((2, 8)))
  with pytest.raises(yax.SubstitutionError,
                     match=r"'params/Dense_1/bias' exists with type f32\[8\]"):
    yax.sub([modules(mox, 'Dense')[1]], clash, mox)
  assert fingerprint(mox) == before


def test_input_type_mismatch(mlp):
  _, _, _, mox = mlp
  gelu = yax.make_mox(jax.nn.gelu)(jnp.zeros((2, 9)))
  with pytest.raises(yax.SubstitutionError,
                     match=r'input 0 .*f32\[2,9\].*f32\[2,8\]'):
    yax.sub('//*[@name="relu"]', gelu, mox)


def test_output_count_mismatch(mlp):
  _, _, _, mox = mlp
  two = yax.make_mox(lambda h: (h, h))(jnp.zeros((2, 8)))
  with pytest.raises(yax.SubstitutionError, match='1 outputs.*has 2'):
    yax.sub('//*[@name="relu"]', two, mox)


def test_variable_clash(mlp):
  _, _, _, mox = mlp

  class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
      k = self.param('kernel', nn.initializers.ones, (8, 3))
      return (x @ k)[:, :1] * jnp.ones((1, 8))

  wide = Wide()
  repl = yax.make_mox(wide.apply)(wide.init(jax.random.key(0), jnp.zeros((2, 8))),
                                  jnp.zeros((2, 8)))
  with pytest.raises(yax.SubstitutionError,
                     match=r"variable 'params/Dense_1/kernel' exists with type "
                           r"f32\[8,8\].*f32\[8,3\]"):
    yax.sub([modules(mox, 'Dense')[1]], repl, mox)


def test_bad_replacement_kinds(mlp):
  _, _, _, mox = mlp
  with pytest.raises(yax.SubstitutionError, match='found int'):
    yax.sub('//*[@name="relu"]', lambda path, node: 3, mox)
  with pytest.raises(yax.SubstitutionError, match='matched a str'):
    yax.sub('//module_call/@name', yax.make_mox(jnp.tanh)(jnp.zeros(8)), mox)
  with pytest.raises(yax.SubstitutionError, match='root of a tree'):
    yax.sub([mox], yax.make_mox(jnp.tanh)(jnp.zeros(8)), mox)
  with pytest.raises(yax.SubstitutionError, match='expects a Mox'):
    yax.sub('//*', mox, 'not a tree')


def test_closure_over_other_trace_is_rejected(mlp):
  _, _, _, mox = mlp
  other = yax.make_mox(lambda a, b: jnp.tanh(a) + b)(jnp.zeros((2, 8)),
                                                     jnp.zeros((2, 8)))
  eqn = other.children[-1]  # add: reads tanh(a), defined in `other` only
  with pytest.raises(yax.SubstitutionError, match='neither computes nor takes'):
    yax.sub('//*[@name="relu"]', yax.Mox(eqn.inputs[1:], eqn.outputs,
                                         children=[eqn]), mox)


def test_lora_inside_scan_threads_stacked_adapters():
  model = Stack()
  x = jax.random.normal(jax.random.key(0), (2, 4))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  before = fingerprint(mox)
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=2)
  assert fingerprint(mox) == before
  p = res.params['params']['ScanBlock_0']['Dense_0']
  assert p['lora_a'].shape == (3, 4, 2) and p['lora_b'].shape == (3, 2, 4)
  close(yax.eval_mox(res.mox, res.params, x), model.apply(variables, x))
  trained = jax.tree_util.tree_map(
      lambda q, m: q + 0.2 if m else q, res.params, res.mask)
  q = trained['params']['ScanBlock_0']['Dense_0']
  c = x
  for i in range(3):
    w = q['kernel'][i] + 0.5 * q['lora_a'][i] @ q['lora_b'][i]
    c = jnp.tanh(c @ w + q['bias'][i])
  close(jax.jit(lambda v, x: yax.eval_mox(res.mox, v, x))(trained, x), c)
  close(yax.eval_mox(mox, res.merge(trained), x), c)


def test_extra_inputs_become_new_root_arguments(mlp):
  _, variables, x, mox = mlp
  shift = yax.make_mox(lambda h, b: jax.nn.relu(h) + b)(
      jnp.zeros((2, 8)), jnp.zeros((2, 8)))
  new = yax.sub(equations(mox, 'relu')[:1], shift, mox)
  b = jnp.full((2, 8), 0.25)
  p = variables['params']
  h = jax.nn.relu(x @ p['Dense_0']['kernel'] + p['Dense_0']['bias']) + b
  h = jax.nn.relu(h @ p['Dense_1']['kernel'] + p['Dense_1']['bias'])
  ref = h @ p['Dense_2']['kernel'] + p['Dense_2']['bias']
  close(yax.eval_mox(new, variables, x, b), ref)
  with pytest.raises(yax.SignatureError):
    yax.eval_mox(new, variables, x)


def test_equation_errors_and_callables_see_the_enclosing_module_path():
  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(8, name='a')(x))
      return nn.relu(nn.Dense(16, name='b')(x))

  model = Two()
  x = jnp.ones((4, 3))
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  paths = []
  yax.sub('//*[@name="relu"]', lambda path, node: paths.append(path) or node,
          mox)
  assert paths == [(), ()]  # both ReLUs sit in the top-level module call
  gelu = yax.make_mox(jax.nn.gelu)(jnp.zeros((4, 8)))
  with pytest.raises(yax.SubstitutionError,
                     match=r"equation 'custom_jvp_call' \(relu\) in the module "
                           r"call at path '<root>': input 0 .*f32\[4,8\].*"
                           r"f32\[4,16\]"):
    yax.sub('//*[@name="relu"]', gelu, mox)


def test_identity_replacement_of_a_module_calls_last_equation():
  """The replacement has no equations: the module call loses a child and
  returns its Dense's output; the result is the plain Flax model without
  its ReLU."""
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.relu(nn.Dense(3)(x))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Block()(x) + 1

  m = Model()
  x = jnp.linspace(-1, 1, 6).reshape(2, 3)
  v = m.init(jax.random.key(0), x)
  mox = yax.make_mox(m.apply)(v, x)
  ident = yax.make_mox(lambda x: x)(jnp.zeros((2, 3)))
  new = yax.sub('//module_call[@type="Block"]/*[@name="relu"]', ident, mox)
  block = yax.query('//module_call[@type="Block"]', new)[0]
  old_block = yax.query('//module_call[@type="Block"]', mox)[0]
  assert len(block.children) == len(old_block.children) - 1
  dense = {'params': v['params']['Block_0']['Dense_0']}
  expected = nn.Dense(3).apply(dense, x) + 1
  np.testing.assert_allclose(yax.eval_mox(new, v, x), expected, rtol=1e-6)
  assert not np.allclose(yax.eval_mox(mox, v, x), expected)
