"""SPEC guarantee "One model of a module call, for every framework": an NNX
call's inputs are every variable its body reads; kinds and relative paths;
paths from where modules sit in the arguments; one rewrite engine (LoRA on
NNX through the same code as Linen). Each test fails without its fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import yax
from yax._src.rewrite import engine as _engine
from helpers import modules

X = jnp.linspace(-1, 1, 2 * 4).reshape(2, 4)


class Block(nnx.Module):

  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return jax.nn.relu(self.lin(x))


class Net(nnx.Module):

  def __init__(self, rngs):
    self.layers = nnx.List([Block(rngs), Block(rngs)]) if hasattr(
        nnx, 'List') else [Block(rngs), Block(rngs)]
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.head(x)


def _param_count(model) -> int:
  return sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_nnx_call_inputs_are_every_variable_its_body_reads():
  model = Net(nnx.Rngs(0))
  mox = yax.make_mox(lambda m, x: m(x))(model, X)
  top = modules(mox, 'Net')[0]
  assert top.num_vars == 6  # both blocks' and the head's kernel and bias
  assert sorted(k[1:] for k in _engine.var_keys(top)) == sorted(
      [('head', 'bias'), ('head', 'kernel'), ('layers', '0', 'lin', 'bias'),
       ('layers', '0', 'lin', 'kernel'), ('layers', '1', 'lin', 'bias'),
       ('layers', '1', 'lin', 'kernel')])
  assert all(_engine.var_kind(top, i) == ('Param', True) for i in range(6))
  yax.check_mox(mox)
  rows = yax.summary(mox)
  assert rows[0].params == _param_count(model)


class Direct(nnx.Module):
  """Reads a submodule's kernel without calling it (Mixtral's experts)."""

  def __init__(self, rngs):
    self.expert = nnx.Linear(4, 4, rngs=rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(x @ self.expert.kernel[...])


def test_variable_read_from_an_uncalled_submodule_belongs_to_the_reader():
  model = Direct(nnx.Rngs(0))
  mox = yax.make_mox(lambda m, x: m(x))(model, X)
  top = modules(mox, 'Direct')[0]
  assert ('nnx', 'expert', 'kernel') in _engine.var_keys(top)
  yax.check_mox(mox)
  # Every parameter sits in one row: the expert's bias, which nothing
  # reads, is counted as unread in the root row.
  top_row = yax.summary(mox)[0]
  assert top_row.params == _param_count(model)
  assert top_row.unread_params == 4


class MyParam(nnx.Param):
  pass


class Scaled(nnx.Module):

  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 4, rngs=rngs)
    self.scale = MyParam(jnp.full((4,), 2.0))

  def __call__(self, x):
    return self.lin(x) * self.scale[...]


def test_subclasses_of_param_are_parameters():
  model = Scaled(nnx.Rngs(0))
  mox = yax.make_mox(lambda m, x: m(x))(model, X)
  top = modules(mox, 'Scaled')[0]
  kinds = {k[1:]: _engine.var_kind(top, i)
           for i, k in enumerate(_engine.var_keys(top))}
  assert kinds[('scale',)] == ('MyParam', True)
  assert yax.summary(mox)[0].params == 4 * 4 + 4 + 4


class Tied(nnx.Module):

  def __init__(self, rngs):
    self.a = nnx.Linear(4, 4, rngs=rngs)
    self.b = nnx.Linear(4, 4, rngs=rngs)
    self.b.kernel = self.a.kernel  # one Param held by two modules

  def __call__(self, x):
    return self.b(self.a(x))


def test_tied_param_is_an_input_of_both_calls_and_its_adapter_never_merges():
  model = Tied(nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  fn = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(fn)(state, X)
  a, b = modules(mox, 'Linear')
  assert a.path == ('a',) and b.path == ('b',)
  kernel_a = a.var_inputs[_engine.var_keys(a).index(('nnx', 'kernel'))]
  kernel_b = b.var_inputs[_engine.var_keys(b).index(('nnx', 'kernel'))]
  assert kernel_a is kernel_b
  assert yax.summary(mox)[0].params == _param_count(model)
  # The adapter sits at the call site (a's path) and trains without
  # touching the shared kernel; merging it would change b too: refused.
  res = yax.lora(mox, state, '//module_call[@type="Linear"][@path="a"]',
                 rank=2)
  assert res.paths == [('a',)] and 'lora_a' not in res.params['b']
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, X),
                             fn(state, X), rtol=1e-5, atol=1e-5)
  trained = jax.tree.map(lambda v, m: v + 0.3 if m else v, res.params,
                         res.mask)
  a_, b_ = trained['a']['lora_a'][...], trained['a']['lora_b'][...]
  k = state['a']['kernel'][...]
  h = X @ (k + 0.5 * a_ @ b_) + state['a']['bias'][...]
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, X),
                             h @ k + state['b']['bias'][...], rtol=1e-5,
                             atol=1e-5)
  with pytest.raises(yax.SubstitutionError,
                     match=r"(?s)also read by module_call Linear at path 'b'"
                           '.*could no longer be tied'):
    res.merge(trained)


def test_split_form_paths_come_from_the_state():
  model = Net(nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  mox = yax.make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, X)
  assert [n.path for n in modules(mox, 'Linear')] == [
      ('layers', '0', 'lin'), ('layers', '1', 'lin'), ('head',)]
  # Two models in two arguments: paths start with the argument position.
  two = yax.make_mox(lambda s, t, x: nnx.merge(graphdef, s)(x) +
                     nnx.merge(graphdef, t)(x))(state, state, X)
  heads = [n.path for n in modules(two) if n.path[-1:] == ('head',)]
  assert heads == [('0', 'head'), ('1', 'head')]
  np.testing.assert_allclose(yax.eval_mox(two, state, state, X),
                             2 * model(X), rtol=1e-5)
  # lora takes one params argument: refused with a clear error, never an
  # adapter shared by both models.
  with pytest.raises(yax.SubstitutionError, match='several arguments'):
    yax.lora(two, state, '//module_call[@type="Linear"]')


def test_closure_module_gets_a_closure_path_and_lora_refuses_it():
  model = Net(nnx.Rngs(0))
  outside = nnx.Linear(4, 4, rngs=nnx.Rngs(5))
  graphdef, state = nnx.split(model)
  fn = lambda s, x: nnx.merge(graphdef, s)(outside(x))
  mox = yax.make_mox(fn)(state, X)
  paths = [n.path for n in modules(mox, 'Linear')]
  assert paths[0] == ('<closure>', 'Linear')
  assert len(set(paths)) == len(paths)  # never another module's path
  np.testing.assert_allclose(yax.eval_mox(mox, state, X), model(outside(X)),
                             rtol=1e-5)
  with pytest.raises(yax.SubstitutionError,
                     match=r"<closure>/Linear.*constant captured"):
    yax.lora(mox, state, '//module_call[@type="Linear"]')


def test_nnx_lora_goes_through_the_linen_engine_and_merges():
  model = Net(nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  mox = yax.make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, X)
  res = yax.lora(mox, state, '//module_call[@type="Linear"]', rank=2)
  yax.check_mox(res.mox)
  assert res.paths == [('head',), ('layers', '0', 'lin'), ('layers', '1', 'lin')]
  lin0 = res.params['layers'][0]['lin']
  assert type(lin0['lora_a']) is nnx.LoRAParam
  assert lin0['lora_a'][...].shape == (4, 2)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, X), model(X),
                             rtol=1e-5)
  # Train: perturb the adapters, then merge reproduces the LoRA model.
  trained = jax.tree.map(
      lambda p, m: p + 0.1 if m else p, res.params, res.mask)
  want = yax.eval_mox(res.mox, trained, X)
  merged = res.merge(trained)
  assert jax.tree.structure(merged) == jax.tree.structure(state)
  np.testing.assert_allclose(yax.eval_mox(mox, merged, X), want, rtol=1e-5,
                             atol=1e-6)
  # The mask marks exactly the six adapters, the nnx.LoRAParam s.
  assert sum(jax.tree.leaves(res.mask)) == 6
  lora_vars = [v for v in jax.tree.leaves(
      res.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
                if isinstance(v, nnx.LoRAParam)]
  assert len(lora_vars) == 6


def test_merge_keeps_sharding_metadata():
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(),
                               ('embed', 'mlp'))
  mesh = jax.make_mesh((1, 1), ('embed', 'mlp'))
  with jax.set_mesh(mesh):
    model = nnx.Linear(4, 4, kernel_init=init, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    mox = yax.make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, X)
    res = yax.lora(mox, state, '//module_call[@type="Linear"]', rank=2)
    merged = res.merge(res.params)
  assert jax.tree.structure(merged) == jax.tree.structure(state)
  assert merged['kernel'].get_metadata() == state['kernel'].get_metadata()
  meta = merged['kernel'].get_metadata()  # the key depends on Flax's version
  assert meta.get('out_sharding', meta.get('sharding_names')) == ('embed',
                                                                  'mlp')
