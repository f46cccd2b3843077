"""Flax NNX models: traced, replayed and rewritten like Linen ones.

Every model here is built from ``flax.nnx``'s own layers. Each test compares
against calling the model itself: outputs, and the model's NNX state after
the call (RNG counts, batch statistics), eagerly, under ``jax.jit`` and
under ``nnx.jit``; and checks that tracing leaves the model bit-identical.
"""

import functools
import io
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as linen
from flax import nnx

import yax
from helpers import Picky

TOL = dict(rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------- helpers

def value(var):
  """A Variable's value on every supported Flax (``get_value`` is newer)."""
  return var.get_value() if hasattr(var, 'get_value') else var.value


def set_value(var, new):
  if hasattr(var, 'set_value'):
    var.set_value(new)
  else:  # Flax before get_value/set_value
    var.value = new


def _plain(x):
  """Arrays as NumPy (key arrays by their data), for exact comparison."""
  if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def snapshot(model):
  """Everything about a model: its graph and its state's values."""
  graphdef, state = nnx.split(model)
  leaves = [(jax.tree_util.keystr(p), _plain(v)) for p, v in
            jax.tree_util.tree_flatten_with_path(state)[0]]
  return graphdef, leaves


def assert_same_snapshot(a, b):
  assert a[0] == b[0]
  assert [k for k, _ in a[1]] == [k for k, _ in b[1]]
  for (k, x), (_, y) in zip(a[1], b[1]):
    assert x.dtype == y.dtype and x.shape == y.shape, k
    np.testing.assert_array_equal(x, y, err_msg=k)


def assert_close(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    np.testing.assert_allclose(_plain(x), _plain(y), **TOL)


def assert_same_state(m1, m2):
  """Same graph and state values (to float tolerance)."""
  g1, s1 = snapshot(m1)
  g2, s2 = snapshot(m2)
  assert g1 == g2
  assert [k for k, _ in s1] == [k for k, _ in s2]
  for (k, x), (_, y) in zip(s1, s2):
    np.testing.assert_allclose(x, y, err_msg=k, **TOL)


def module_calls(mox, type_name=None):
  pred = f'[@type="{type_name}"]' if type_name else '[@ephemeral="false"]'
  return yax.query(f'//module_call{pred}', mox)


def check_model(model, x, fn=lambda m, x: m(x), twice=True, pytree_jit=True):
  """Trace ``fn(model, x)``; replay it eagerly, under jax.jit and nnx.jit;
  compare outputs and model state with calling ``fn`` itself."""
  before = snapshot(model)
  mox = yax.make_mox(fn)(model, x)
  assert_same_snapshot(before, snapshot(model))  # tracing changed nothing
  yax.check_mox(mox)

  # Eagerly: outputs equal, and the same state updates applied.
  ref, ours = nnx.clone(model), nnx.clone(model)
  assert_close(yax.eval_mox(mox, ours, x), fn(ref, x))
  assert_same_state(ours, ref)
  if twice:  # a second call continues from the updated state (RNG counts)
    assert_close(yax.eval_mox(mox, ours, x), fn(ref, x))
    assert_same_state(ours, ref)

  # Under nnx.jit: updates propagate back to the model as for the call.
  ref, ours = nnx.clone(model), nnx.clone(model)
  got = nnx.jit(lambda m, x: yax.eval_mox(mox, m, x))(ours, x)
  assert_close(got, nnx.jit(fn)(ref, x))
  assert_same_state(ours, ref)

  # Under jax.jit (modules are pytrees): outputs equal.
  if not pytree_jit:
    return mox
  ref, ours = nnx.clone(model), nnx.clone(model)
  got = jax.jit(lambda m, x: yax.eval_mox(mox, m, x))(ours, x)
  assert_close(got, jax.jit(fn)(ref, x))
  assert_same_snapshot(before, snapshot(model))
  return mox


# -------------------------------------------------------------- models

class MLP(nnx.Module):
  def __init__(self, din, dhidden, dout, *, rngs):
    self.fc1 = nnx.Linear(din, dhidden, rngs=rngs)
    self.fc2 = nnx.Linear(dhidden, dout, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.relu(self.fc1(x)))


class ConvNet(nnx.Module):
  def __init__(self, *, rngs):
    self.conv = nnx.Conv(3, 8, kernel_size=(3, 3), rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    h = self.norm(nnx.gelu(self.conv(x)))
    return self.head(h.mean(axis=(1, 2)))


class Noisy(nnx.Module):
  """Dropout and BatchNorm in training mode: RNG counts and statistics."""

  def __init__(self, *, rngs):
    self.fc = nnx.Linear(4, 6, rngs=rngs)
    self.bn = nnx.BatchNorm(6, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.bn(self.fc(x)))


class Attention(nnx.Module):
  def __init__(self, *, rngs):
    self.attn = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)

  def __call__(self, x):
    return self.norm(x + self.attn(x, deterministic=True))


class Shared(nnx.Module):
  """One Linear reachable by two attribute paths and called twice."""

  def __init__(self, *, rngs):
    self.dense = nnx.Linear(4, 4, rngs=rngs)
    self.alias = self.dense
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(self.alias(nnx.tanh(self.dense(x))))


class Block(nnx.Module):
  def __init__(self, dim, *, rngs):
    self.linear = nnx.Linear(dim, dim, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(nnx.relu(self.linear(x)))


class ScanStack(nnx.Module):
  """Layers created with nnx.vmap, applied with nnx.scan."""

  def __init__(self, dim, depth, *, rngs):
    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return Block(dim, rngs=rngs)
    self.blocks = create(rngs)
    self.head = nnx.Linear(dim, 2, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)
    return self.head(forward(x, self.blocks))


class Lifted(nnx.Module):
  """nnx.remat and nnx.jit inside a model."""

  def __init__(self, *, rngs):
    self.a = nnx.Linear(4, 4, rngs=rngs)
    self.b = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    x = nnx.remat(lambda m, x: m(x))(self.a, x)
    return nnx.jit(lambda m, x: nnx.relu(m(x)))(self.b, x)


class Sower(nnx.Module):
  def __init__(self, *, rngs):
    self.fc1 = nnx.Linear(4, 5, rngs=rngs)
    self.fc2 = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x):
    h = self.fc1(x)
    self.sow(nnx.Intermediate, 'hidden', h)
    return self.fc2(h)


def rngs(seed=0):
  return nnx.Rngs(seed, dropout=seed + 1)


X4 = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


# --------------------------------------------------------------- tests

def test_mlp_tree_and_replay():
  model = MLP(4, 8, 3, rngs=rngs())
  mox = check_model(model, X4)
  (fc1,) = module_calls(mox, 'Linear')[:1]
  assert fc1.path == ('fc1',) and fc1.params['name'] == 'fc1'
  assert fc1.params['in_features'] == 4 and fc1.params['out_features'] == 8
  assert fc1.params['use_bias'] is True
  # Variables first, keyed as nnx.state shows them, then the argument.
  assert [s.aval.shape for s in fc1.inputs] == [(8,), (4, 8), (3, 4)]
  root_call = module_calls(mox, 'MLP')[0]
  # Every variable its body reads, both Linear layers' (one model of a
  # module call, Linen and NNX alike).
  assert root_call.path == () and root_call.num_vars == 4
  xml = io.StringIO()
  yax.dump_xml(mox, xml)
  assert '<input type="f32[4,8]" var="kernel" vartype="Param">' in xml.getvalue()
  assert yax.query('count(//module_call[@type="Linear"])', mox) == 2
  assert yax.query('//module_call[@path="fc2"]/@out_features', mox) == ['3']


def test_conv_layernorm():
  model = ConvNet(rngs=rngs())
  x = jnp.linspace(0, 1, 2 * 5 * 5 * 3).reshape(2, 5, 5, 3)
  mox = check_model(model, x)
  assert [m.type_name for m in module_calls(mox)] == [
      'ConvNet', 'Conv', 'LayerNorm', 'Linear']
  conv = module_calls(mox, 'Conv')[0]
  assert conv.params['kernel_size'] == (3, 3)


def test_dropout_and_batchnorm_state_updates():
  model = Noisy(rngs=rngs())
  mox = check_model(model, X4)
  kinds = yax.query('//module_call[@type="Dropout"]/input/@vartype', mox)
  assert kinds == ['RngCount', 'RngKey']
  assert yax.query('//module_call[@type="BatchNorm"]/input/@vartype', mox) == [
      'Param', 'BatchStat', 'Param', 'BatchStat']
  # The RNG count and the two statistics are outputs of the root.
  assert len(mox.outputs) == 1 + 3
  # Calling the replay twice draws different dropout masks, as the model does.
  m = nnx.clone(model)
  y1, y2 = yax.eval_mox(mox, m, X4), yax.eval_mox(mox, m, X4)
  assert not np.array_equal(y1, y2)


def test_eval_mode_is_static():
  model = Noisy(rngs=rngs())
  model.eval()
  mox = check_model(model, X4)
  assert len(mox.outputs) == 1  # nothing changes in eval mode
  model.train()
  with pytest.raises(yax.SignatureError):
    yax.eval_mox(mox, model, X4)


def test_multi_head_attention():
  model = Attention(rngs=rngs())
  x = jnp.linspace(-1, 1, 2 * 5 * 8).reshape(2, 5, 8)
  mox = check_model(model, x)
  types = [m.type_name for m in module_calls(mox)]
  assert types[:2] == ['Attention', 'MultiHeadAttention']
  assert types.count('LinearGeneral') == 4
  paths = [m.path for m in module_calls(mox, 'LinearGeneral')]
  assert paths == [('attn', 'query'), ('attn', 'key'), ('attn', 'value'),
                   ('attn', 'out')]


def test_shared_module_one_path_same_symbols():
  model = Shared(rngs=rngs())
  mox = check_model(model, X4, pytree_jit=False)
  # jax.jit flattens modules as pytrees, which duplicates the shared Linear:
  # the graph differs from the traced one, and eval_mox says so.
  with pytest.raises(yax.SignatureError):
    jax.jit(lambda m, x: yax.eval_mox(mox, m, x))(model, X4)
  dense = [m for m in module_calls(mox, 'Linear') if m.params['in_features'] == 4
           and m.params['out_features'] == 4]
  assert len(dense) == 2
  # One path, the one nnx.split keeps (attributes in sorted order: 'alias').
  state = nnx.state(model)
  assert 'alias' in state and 'dense' not in state
  assert dense[0].path == dense[1].path == ('alias',)
  assert dense[0].var_inputs == dense[1].var_inputs
  # Flattened as nnx.split does: the shared kernel is one root input.
  assert len(mox.inputs) == len(jax.tree_util.tree_leaves(nnx.split(model)[1])) + 1
  assert len(mox.inputs) < len(jax.tree_util.tree_leaves((model, X4)))


def test_scan_over_layers():
  model = ScanStack(4, 3, rngs=rngs())
  mox = check_model(model, X4)
  blocks = module_calls(mox, 'Block')
  assert blocks and all(b.path == ('blocks',) for b in blocks)
  inner = module_calls(mox, 'Linear')
  assert ('blocks', 'linear') in [m.path for m in inner]
  assert yax.query('//scan//module_call[@type="Dropout"]', mox)


def test_vmap_remat_jit_inside():
  model = Lifted(rngs=rngs())
  mox = check_model(model, X4)
  paths = [m.path for m in module_calls(mox, 'Linear')]
  assert ('a',) in paths and ('b',) in paths
  assert yax.query('//*[@primitive="checkpoint" or @primitive="remat2"]'
                   '//module_call[@path="a"]', mox)
  assert yax.query('//jit//module_call[@path="b"]', mox)


class DecoratedMethods(nnx.Module):
  """Methods decorated with NNX transforms (``nnx.jit`` makes an object,
  not a function; ``nnx.remat``/``nnx.vmap`` make functions)."""

  def __init__(self, *, rngs):
    self.a = nnx.Linear(4, 4, rngs=rngs)
    self.b = nnx.Linear(4, 4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  @nnx.jit
  def encode(self, x):
    return self.drop(nnx.relu(self.a(x)))

  @nnx.remat
  def decode(self, x):
    return self.b(x)

  @nnx.vmap(in_axes=(None, 0))
  def per_row(self, x):
    return jnp.tanh(x) * 2.0

  def __call__(self, x):
    return self.per_row(self.decode(self.encode(x)))


def test_transform_decorated_methods_are_module_calls():
  model = DecoratedMethods(rngs=rngs())
  mox = check_model(model, X4)
  for method in ('encode', 'decode', 'per_row'):
    calls = yax.query(
        f'//module_call[@type="DecoratedMethods" and @method="{method}"]', mox)
    assert len(calls) == 1, method
  # The modules the jitted method calls are inside its node.
  assert yax.query('//module_call[@method="encode"]//jit'
                   '//module_call[@path="a"]', mox)


def test_vmap_over_a_module():
  model = MLP(4, 4, 2, rngs=rngs())
  xs = jnp.stack([X4, 2 * X4])
  fn = lambda m, xs: nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, xs)
  mox = check_model(model, xs, fn)
  assert [m.path for m in module_calls(mox, 'Linear')] == [('fc1',), ('fc2',)]


@pytest.mark.skipif(not hasattr(nnx, 'capture'),
                    reason='nnx.capture is newer than this Flax')
def test_sow_with_capture():
  model = Sower(rngs=rngs())
  fn = nnx.capture(lambda m, x: m(x), nnx.Intermediate)
  mox = check_model(model, X4, fn)
  y, inter = yax.eval_mox(mox, nnx.clone(model), X4)
  ref_y, ref_inter = fn(nnx.clone(model), X4)
  assert_close((y, inter), (ref_y, ref_inter))


def test_legacy_sow_becomes_a_state_update():
  model = Sower(rngs=rngs())
  # The first call adds a variable, so the model no longer has the traced
  # structure afterwards (eval_mox then raises SignatureError): call once.
  mox = check_model(model, X4, twice=False)
  m = nnx.clone(model)
  yax.eval_mox(mox, m, X4)
  np.testing.assert_allclose(value(m.hidden)[0], model.fc1(X4), **TOL)


def test_split_form():
  model = Noisy(rngs=rngs())
  graphdef, state = nnx.split(model)
  fn = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(fn)(state, X4)
  yax.check_mox(mox)
  assert_close(yax.eval_mox(mox, state, X4), fn(state, X4))
  assert_close(jax.jit(lambda s, x: yax.eval_mox(mox, s, x))(state, X4),
               fn(state, X4))
  assert [m.path for m in module_calls(mox)] == [(), ('fc',), ('bn',),
                                                  ('drop',)]


def test_two_module_arguments_paths_and_updates():
  a, b = Noisy(rngs=rngs(0)), Noisy(rngs=rngs(1))
  fn = lambda a, b, x: a(x) + b(x)
  # Not X4: its rows are evenly spaced, so one of b's BatchNorm columns has a
  # batch variance of 3e-5 (near eps) and rounding differences get amplified
  # 100-fold (plain nnx.jit and eager calls of the model differ there too).
  x = jax.random.normal(jax.random.key(7), (3, 4))
  mox = yax.make_mox(fn)(a, b, x)
  assert {m.path for m in module_calls(mox, 'Linear')} == {('0', 'fc'),
                                                         ('1', 'fc')}
  ra, rb, oa, ob = nnx.clone(a), nnx.clone(b), nnx.clone(a), nnx.clone(b)
  assert_close(yax.eval_mox(mox, oa, ob, x), fn(ra, rb, x))
  assert_same_state(oa, ra)
  assert_same_state(ob, rb)


def test_tracing_restores_classes_and_other_threads_unaffected():
  originals = {cls: dict(vars(cls)) for cls in (nnx.Linear, MLP)}
  model = MLP(4, 8, 3, rngs=rngs())
  seen = []

  class Probe(nnx.Module):
    def __call__(self, x):
      # While the trace runs, another thread calls a model: eagerly, no
      # markers, its own result.
      out = {}
      t = threading.Thread(target=lambda: out.setdefault('y', model(X4)))
      t.start()
      t.join()
      seen.append(out['y'])
      return model(x)

  mox = yax.make_mox(lambda p, x: p(x))(Probe(), X4)
  assert isinstance(seen[0], jax.Array) and not isinstance(seen[0],
                                                           jax.core.Tracer)
  np.testing.assert_allclose(seen[0], model(X4))
  for cls, attrs in originals.items():
    assert dict(vars(cls)) == attrs
  assert 'yax_enter' not in str(jax.make_jaxpr(lambda x: model(x))(X4))
  assert len(module_calls(mox, 'Linear')) == 2


# ------------------------------------------------------------ rewrites

def _split_mox(model, x):
  graphdef, state = nnx.split(model)
  fn = lambda s, x: nnx.merge(graphdef, s)(x)
  return graphdef, state, fn, yax.make_mox(fn)(state, x)


def test_lora_on_the_split_form():
  model = MLP(4, 8, 3, rngs=rngs())
  graphdef, state, fn, mox = _split_mox(model, X4)
  res = yax.lora(mox, state, '//module_call[@type="Linear"]', rank=2,
                 alpha=4.0, key=jax.random.key(3))
  yax.check_mox(res.mox)
  assert isinstance(res.params, nnx.State) and isinstance(res.mask, nnx.State)
  assert res.params['fc1']['lora_a'].shape == (4, 2)
  assert res.params['fc2']['lora_b'].shape == (2, 3)
  assert value(res.mask['fc1']['lora_a']) is True
  assert value(res.mask['fc1']['kernel']) is False
  assert sorted(res.paths) == [('fc1',), ('fc2',)]
  # B = 0 at init: the adapted tree computes what the model does.
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, X4),
                             fn(state, X4), **TOL)
  # With trained adapters: y = x W + b + (alpha/rank) x A B, per layer.
  trained = jax.tree.map(lambda v: v, res.params)
  for name in ('fc1', 'fc2'):
    b = trained[name]['lora_b']
    set_value(b, jnp.full(b.shape, 0.1, b.dtype))
  got = yax.eval_mox(res.mox, trained, X4)

  def expected(x):
    for name, act in (('fc1', nnx.relu), ('fc2', lambda h: h)):
      p = trained[name]
      x = act(x @ value(p['kernel']) + value(p['bias']) + 2.0 * (
          (x @ value(p['lora_a'])) @ value(p['lora_b'])))
    return x
  np.testing.assert_allclose(got, expected(X4), **TOL)
  assert not np.allclose(got, fn(state, X4))
  # merge folds the adapters into the kernels, for the original tree.
  merged = res.merge(trained)
  assert 'lora_a' not in merged['fc1']
  np.testing.assert_allclose(yax.eval_mox(mox, merged, X4), got, **TOL)
  np.testing.assert_allclose(nnx.merge(graphdef, merged)(X4), got, **TOL)
  # Under jit, and the original tree is untouched.
  np.testing.assert_allclose(
      jax.jit(lambda p, x: yax.eval_mox(res.mox, p, x))(trained, X4), got,
      **TOL)
  assert len(module_calls(mox, 'LoRA')) == 0
  assert len(module_calls(res.mox, 'LoRA')) == 2


def test_lora_selection_and_module_form_errors():
  model = MLP(4, 8, 3, rngs=rngs())
  _, state, _, mox = _split_mox(model, X4)
  res = yax.lora(mox, state, '//module_call[@path="fc2"]', rank=1)
  assert res.paths == [('fc2',)]
  with pytest.raises(yax.SubstitutionError, match='matched no module call'):
    yax.lora(mox, state, '//module_call[@type="Conv"]')
  with pytest.raises(yax.SubstitutionError, match='a LoRA adapter already'):
    yax.lora(res.mox, res.params, '//module_call[@type="LoRA"]')
  with pytest.raises(yax.SubstitutionError, match='already carries an adapter'):
    yax.lora(res.mox, res.params, '//module_call[@type="Linear"]')
  module_mox = yax.make_mox(lambda m, x: m(x))(model, X4)
  with pytest.raises(yax.SubstitutionError, match='nnx.split'):
    yax.lora(module_mox, nnx.state(model), '//module_call[@type="Linear"]')


def test_sub_swaps_an_activation_and_a_module():
  model = ConvNet(rngs=rngs())
  x = jnp.linspace(0, 1, 2 * 5 * 5 * 3).reshape(2, 5, 5, 3)
  mox = yax.make_mox(lambda m, x: m(x))(model, x)
  conv = module_calls(mox, 'Conv')[0]
  h = jax.ShapeDtypeStruct(conv.outputs[0].aval.shape, jnp.float32)
  new = yax.sub('//module_call[@type="ConvNet"]/*[@primitive!="module_call"]'
                '[input = //module_call[@type="Conv"]/output]',
                yax.make_mox(jnp.tanh)(h), mox)
  yax.check_mox(new)

  class TanhNet(ConvNet):
    def __call__(self, x):
      h = self.norm(jnp.tanh(self.conv(x)))
      return self.head(h.mean(axis=(1, 2)))
  ref = TanhNet(rngs=rngs())
  np.testing.assert_allclose(yax.eval_mox(new, model, x), ref(x), **TOL)
  assert_same_snapshot(snapshot(model), snapshot(model))
  # A module traced on its own replaces one of the tree: it reads the
  # replaced module's variables (same names and shapes), not its own.
  head = module_calls(mox, 'Linear')[0]
  h_in = jax.ShapeDtypeStruct(head.arg_inputs[0].aval.shape, jnp.float32)
  other = nnx.Linear(8, 2, use_bias=True, rngs=rngs(5))
  repl = yax.make_mox(lambda m, h: m(h))(other, h_in)
  new = yax.sub([head], repl, mox)
  yax.check_mox(new)
  assert module_calls(new, 'Linear')[0] is not head
  np.testing.assert_allclose(yax.eval_mox(new, model, x), model(x), **TOL)
  assert not np.allclose(other(jnp.ones((2, 8))), model.head(jnp.ones((2, 8))))


def test_views_on_nnx_trees(tmp_path):
  from yax._src.report import html as _html
  from yax._src.report import summary as _summary
  model = Noisy(rngs=rngs())
  mox = yax.make_mox(lambda m, x: m(x))(model, X4)
  text = str(mox)
  assert 'module_call[' in text and 'type=BatchNorm' in text
  data = mox.to_dict()
  assert data['children'][-1]['tag'] == 'output'
  assert '"vartype": "RngCount"' in mox.to_json()
  pytest.importorskip('yt.yson')
  buf = io.BytesIO()
  yax.dump_yson(mox, buf)
  assert b'BatchStat' in buf.getvalue()
  by_path = {r.path: r for r in yax.summary(mox)}
  assert by_path['fc'].params == by_path['fc'].own_params == 4 * 6 + 6
  assert by_path['fc'].variables == ('bias: f32[6]', 'kernel: f32[4,6]')
  assert by_path['bn'].params == 12 and by_path['bn'].other_vars == {
      'batch_stats': 12}
  assert by_path['drop'].other_vars == {'RngCount': 1, 'RngKey': 1}
  assert _summary.total_params(mox)[0] == 4 * 6 + 6 + 12
  assert _html.write_html(mox, tmp_path / 'nnx.html', compress=False) > 0
  assert 'BatchNorm' in (tmp_path / 'nnx.html').read_text()


def test_cli_traces_an_nnx_factory(capsys):
  from yax._src.cli import main as _main
  assert _main.main(['query', '//module_call[@type="Linear"]/@path',
                    'yax._src.cli.bundled_nnx:factory']) == 0
  out = capsys.readouterr().out.split()
  assert out == ['blocks/0/mlp/fc1', 'blocks/0/mlp/fc2', 'blocks/1/mlp/fc1',
                 'blocks/1/mlp/fc2', 'head']
  assert _main.main(['summary', 'yax._src.cli.bundled_nnx:factory']) == 0
  assert 'MultiHeadAttention' in capsys.readouterr().out


def test_bundled_nnx_model_in_training_mode():
  from yax._src.cli import bundled_nnx as _bundled_nnx
  model, tokens = _bundled_nnx.make(train=True)
  mox = check_model(model, tokens)
  assert len(module_calls(mox, 'Dropout')) == 4


def test_tracing_does_not_depend_on_nnx_jit_caches():
  model = Lifted(rngs=rngs())
  step = nnx.jit(lambda m, x: m(x))
  expected = step(model, X4)  # warm every jit cache involved
  for fn in (lambda m, x: m(x), step):
    mox = yax.make_mox(fn)(model, X4)
    assert [n.path for n in module_calls(mox, 'Linear')] == [('a',), ('b',)]
    np.testing.assert_allclose(yax.eval_mox(mox, model, X4), expected, **TOL)
  # Nothing left behind: plain traces afterwards show no YAX primitive.
  assert 'yax_' not in str(jax.make_jaxpr(lambda m, x: m(x))(model, X4))
  assert 'yax_' not in str(jax.jit(lambda m, x: m(x)).trace(model, X4).jaxpr)


def test_nested_tracing_gives_the_same_tree():
  model = Noisy(rngs=rngs())
  alone = yax.make_mox(lambda m, x: m(x))(model, X4)
  inner = []

  def outer(x):
    inner.append(yax.make_mox(lambda m, x: m(x))(model, X4))
    return x * 2

  yax.make_mox(outer)(X4)
  assert str(inner[0]) == str(alone)


def test_gradients_match_nnx_grad():
  model = ConvNet(rngs=rngs())
  x = jnp.linspace(0, 1, 2 * 5 * 5 * 3).reshape(2, 5, 5, 3)
  mox = yax.make_mox(lambda m, x: m(x))(model, x)
  ours = nnx.grad(lambda m: (yax.eval_mox(mox, m, x) ** 2).sum())(model)
  ref = nnx.grad(lambda m: (m(x) ** 2).sum())(model)
  assert_close(nnx.state(ours), nnx.state(ref))
  # And through the split form with jax.grad.
  graphdef, state = nnx.split(model)
  smox = yax.make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
  g_ours = jax.grad(lambda s: (yax.eval_mox(smox, s, x) ** 2).sum())(state)
  g_ref = jax.grad(lambda s: (nnx.merge(graphdef, s)(x) ** 2).sum())(state)
  assert_close(g_ours, g_ref)


class ForwardHelper(nnx.Module):
  """EasyDeL's ColumnParallelLinear: ``__call__`` calls another method of
  the same module (``native_forward``), recorded as a nested call at the
  same path."""

  def __init__(self, din, dout, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (din, dout)))

  def native_forward(self, x):
    return x @ self.kernel[...]

  def __call__(self, x):
    return self.native_forward(x)


class HelperNet(nnx.Module):

  def __init__(self, rngs):
    self.a = ForwardHelper(4, 8, rngs)
    self.b = ForwardHelper(8, 3, rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def test_a_modules_nested_helper_method_call_belongs_to_its_call():
  model = HelperNet(rngs())
  graphdef, state, fn, mox = _split_mox(model, X4)
  selection = '//module_call[@type="ForwardHelper"]'
  assert [n.entrypoint for n in yax.query(selection, mox)] == [
      '__call__', 'native_forward', '__call__', 'native_forward']
  res = yax.lora(mox, state, selection, rank=2, alpha=2.0)
  assert res.paths == [('a',), ('b',)]
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, X4),
                             fn(state, X4), **TOL)
  trained = jax.tree.map(lambda v, m: v + 0.3 if m else v, res.params,
                         res.mask)
  a, b = trained['b']['lora_a'][...], trained['b']['lora_b'][...]
  reference = nnx.split(model)[1]
  reference['b']['kernel'].value = reference['b']['kernel'][...] + a @ b
  reference['a']['kernel'].value = reference['a']['kernel'][...] + (
      trained['a']['lora_a'][...] @ trained['a']['lora_b'][...])
  want = fn(reference, X4)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, X4), want,
                             rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(fn(res.merge(trained), X4), want, rtol=1e-4,
                             atol=1e-4)


class Odd(nnx.Module):
  """Children in every container NNX knows: a list with int keys, a dict,
  a tuple, a Variable shared with a submodule, Rngs, static attributes
  (a dtype, a function, a tuple of ints) and a data list of Variables."""

  def __init__(self, *, rngs):
    self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs) for _ in range(11)])
    self.table = nnx.Dict({'b': nnx.Linear(3, 2, rngs=rngs),
                           'a': nnx.LayerNorm(3, rngs=rngs)})
    self.pair = nnx.data((nnx.Linear(3, 3, rngs=rngs),
                          nnx.Param(jnp.ones(3))))
    self.tied = self.layers[0].kernel
    self.rngs = rngs
    self.count = nnx.BatchStat(jnp.zeros(()))
    self.dtype = jnp.float32
    self.act = jax.nn.relu
    self.shape = (1, 2)

  def __call__(self, x):
    return x


def test_graph_listing_matches_nnx_split():
  """YAX lists a module's children from its attributes (not with Flax's
  own listing): every Variable at the path and in the order of
  ``nnx.split``, each shared one once, on a model written here and on the
  bundled Transformer."""
  from yax._src.cli import bundled_nnx as _bundled_nnx
  from yax._src.trace.nnx_graph import VARIABLE, graph_nodes
  bundled, _ = _bundled_nnx.make()
  to_flat = getattr(nnx, 'to_flat_state', None) or (lambda s: s.flat_state())
  for model in (Odd(rngs=rngs()), bundled):
    _, state = nnx.split(model)
    expected = [(tuple(path), id(value(var))) for path, var in to_flat(state)]
    found = [(path, id(value(node))) for path, node, kind in graph_nodes(model)
             if kind == VARIABLE]
    assert len(found) > 20
    assert found == expected


class CachesATable(nnx.Module):
  """Caches a Variable the way EasyDeL caches its RoPE table: a
  ``functools.cached_property`` writes the instance dict directly, so the
  attribute is not one of the module's data attributes."""

  def __init__(self, *, rngs):
    self.linear = nnx.Linear(3, 3, rngs=rngs)

  @functools.cached_property
  def table(self):
    return nnx.Variable(jnp.arange(3.0))

  def __call__(self, x):
    return self.linear(x) + self.table[...]


def test_a_variable_cached_during_the_call_is_a_state_update():
  x = jnp.ones((2, 3))
  model = CachesATable(rngs=rngs())
  mox = yax.make_mox(lambda m, x: m(x))(model, x)
  assert 'table' not in vars(model)  # tracing leaves the model alone
  own, replayed = CachesATable(rngs=rngs()), CachesATable(rngs=rngs())
  want = own(x)
  np.testing.assert_allclose(yax.eval_mox(mox, replayed, x), want, **TOL)
  assert 'table' in vars(replayed)
  np.testing.assert_array_equal(vars(replayed)['table'][...],
                                vars(own)['table'][...])


class Stateful(nnx.Module):
  """State that every call changes (dropout's RNG count, batch statistics)
  and a RoPE-style table cached on the first call, as EasyDeL models have."""

  def __init__(self, *, rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  @functools.cached_property
  def table(self):
    return nnx.Variable(jnp.linspace(0.0, 1.0, 4))

  def __call__(self, x):
    return self.drop(self.norm(self.linear(x))) * self.table[...]


def _state_and_cache(model):
  """The model's state values and its cached table (None before the first
  call; read from the instance: reading the property would compute it)."""
  cache = vars(model).get('table')
  return (jax.tree.leaves(jax.tree.map(_plain, nnx.state(model))),
          None if cache is None else np.asarray(cache[...]))


def _assert_same_steps(a, b):
  (sa, ca), (sb, cb) = _state_and_cache(a), _state_and_cache(b)
  assert len(sa) == len(sb)
  for x, y in zip(sa, sb):
    np.testing.assert_allclose(x, y, **TOL)
  assert (ca is None) == (cb is None)
  if ca is not None:
    np.testing.assert_array_equal(ca, cb)


@pytest.mark.parametrize('traced_after_a_call', [False, True])
def test_replay_step_after_step(traced_after_a_call):
  """Three steps, as users run a model: each replay continues from the
  state the previous one left (RNG counts, batch statistics, the cached
  table the first call adds), eagerly and under nnx.jit, next to the
  model's own calls. A tree traced before the first call accepts the model
  after it, and one traced after it a model before it."""
  x = X4
  model = Stateful(rngs=rngs())
  traced = nnx.clone(model)
  if traced_after_a_call:
    traced(x)
    assert 'table' in vars(traced)
  mox = yax.make_mox(lambda m, x: m(x))(traced, x)
  own, eager, jitted = (nnx.clone(model) for _ in range(3))
  replay = nnx.jit(lambda m, x: yax.eval_mox(mox, m, x))
  for _ in range(3):
    want = own(x)
    assert_close(yax.eval_mox(mox, eager, x), want)
    _assert_same_steps(eager, own)
    assert_close(replay(jitted, x), want)
    jitted_state, _ = _state_and_cache(jitted)
    for got, expected in zip(jitted_state, _state_and_cache(own)[0]):
      np.testing.assert_allclose(got, expected, **TOL)


class SharedStateless(nnx.Module):
  """A module without variables reachable by two attribute paths."""

  def __init__(self, *, rngs):
    self.drop = nnx.Dropout(0.5, deterministic=True)  # no Rngs: no state
    self.again = self.drop
    self.fc = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return self.again(self.fc(self.drop(x)))


class Plain(Odd):
  """``Odd`` without its tied Variable: nothing in it is shared."""

  def __init__(self, *, rngs):
    super().__init__(rngs=rngs)
    del self.tied


def test_pytree_split_is_nnx_split():
  """Graph arguments are split with JAX's pytree flatten when nothing in
  them is shared: the state is nnx.split's, path for path, Variable type
  for Variable type, value for value, in the same order."""
  from yax._src.cli import bundled_nnx as _bundled_nnx
  from yax._src.trace.nnx_arguments import PytreeGraph, pytree_split
  to_flat = getattr(nnx, 'to_flat_state', None) or (lambda s: s.flat_state())
  bundled, _ = _bundled_nnx.make()
  models = [MLP(4, 8, 2, rngs=rngs()), Noisy(rngs=rngs()),
            Attention(rngs=rngs()), ScanStack(4, 3, rngs=rngs()),
            Plain(rngs=rngs()), bundled]
  for nodes in [(m,) for m in models] + [(models[0], models[1], rngs())]:
    found = pytree_split(nodes)
    assert found is not None, nodes
    graphdef, state = found
    assert isinstance(graphdef, PytreeGraph)
    expected = [(tuple(p), type(v), id(value(v)))
                for p, v in to_flat(nnx.split(nodes)[1])]
    got = [(tuple(p), type(v), id(value(v))) for p, v in to_flat(state)]
    assert len(got) >= 4 and got == expected


def test_shared_graphs_are_split_by_nnx():
  """A module, Variable or other graph node reached twice (within one
  argument or across two) is split by nnx.split: a pytree flatten would
  make two of it."""
  from yax._src.trace.nnx_arguments import pytree_split
  tied, shared = Odd(rngs=rngs()), Shared(rngs=rngs())
  stateless = SharedStateless(rngs=rngs())
  mlp = MLP(4, 8, 2, rngs=rngs())
  for nodes in [(tied,), (shared,), (stateless,), (mlp, mlp.fc1),
                (mlp, mlp)]:
    assert pytree_split(nodes) is None, nodes


def test_an_array_attribute_is_split_by_nnx():
  from yax._src.trace.nnx_arguments import pytree_split

  class WithArray(nnx.Module):
    def __init__(self):
      self.w = nnx.data(jnp.ones(3))  # data, but no Variable

    def __call__(self, x):
      return x * self.w

  model = WithArray()
  assert pytree_split((model,)) is None
  mox = check_model(model, jnp.ones((2, 3)))
  assert len(mox.inputs) == 2


def test_a_shared_module_without_variables_keeps_one_path():
  model = SharedStateless(rngs=rngs())
  mox = check_model(model, X4, pytree_jit=False)
  paths = [m.path for m in module_calls(mox, 'Dropout')]
  assert paths == [('again',), ('again',)]  # nnx.split's first path


class DropTwice(nnx.Module):
  """Dropout called twice: its second call reads the RNG count that the
  first one computed."""

  def __init__(self, *, rngs):
    self.fc = nnx.Linear(4, 4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.fc(self.drop(x)))


def test_root_inputs_are_named_not_carried(monkeypatch):
  """A call in the root trace names the variables that are inputs of the
  trace by position; only a value computed during the trace (the RNG count
  after the first dropout) rides through the call's enter marker. Either
  way each call reads the same symbols, and the replay is the model."""
  from yax._src.trace import make as _make
  from yax._src.trace import markers as _markers
  seen = []
  build = _make.build_root
  monkeypatch.setattr(_make, 'build_root', lambda builder, closed, *a: (
      seen.append(closed.jaxpr), build(builder, closed, *a))[1])
  model = DropTwice(rngs=rngs())
  mox = check_model(model, X4)
  carried = [(e.params['call_id'].record.path, e.params['num_vars'])
             for e in seen[0].eqns if e.primitive is _markers.enter_p]
  assert carried == [((), 0), (('drop',), 0), (('fc',), 0), (('drop',), 1)]
  drops = module_calls(mox, 'Dropout')
  root_inputs = set(mox.inputs)
  first, second = ([s for s in d.var_inputs if s not in root_inputs]
                   for d in drops)
  assert first == [] and len(second) == 1  # the count the first one drew
  assert all(s in root_inputs for s in module_calls(mox, 'Linear')[0]
             .var_inputs)


# ---------------------------------------------- NNX bridged into Linen

class _Bridged(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(4, 8, rngs=rngs)
    self.fc2 = nnx.Linear(8, 3, rngs=rngs)
    self.width = self.hidden()   # a method called while constructing

  def hidden(self):
    return self.fc1.out_features

  def __call__(self, x):
    return self.fc2(jax.nn.relu(self.fc1(x)))


class _LinenAroundNnx(linen.Module):
  @linen.compact
  def __call__(self, x):
    y = nnx.bridge.ToLinen(_Bridged, name='block')(x)
    return linen.Dense(2, name='head')(y)


def test_nnx_model_bridged_into_linen_has_its_param_paths():
  """Flax's ``nnx.bridge.ToLinen`` (MaxText's ``TransformerLinen`` is a copy
  of it) builds the NNX model inside its Linen call from the Linen
  variables: the NNX calls' paths are the paths of their params under the
  Linen module, the bridge call holds those variables (nested dicts are the
  NNX attributes, not submodule scopes), and calls made while the NNX model
  is constructed are not module calls of the traced model."""
  model, x = _LinenAroundNnx(), jnp.arange(8.0).reshape(2, 4) / 8
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  np.testing.assert_allclose(yax.eval_mox(mox, variables, x),
                             model.apply(variables, x), rtol=1e-6)
  linear = yax.query('//module_call[@type="Linear"]', mox)
  assert [n.path for n in linear] == [('block', 'fc1'), ('block', 'fc2')]
  for node in linear:  # the path is where its params are
    kernel = variables['params'][node.path[0]][node.path[1]]['kernel']
    assert [v.aval.shape for v in node.var_inputs] == [
        (node.params['out_features'],), kernel.shape]
  assert yax.query('//module_call[@method="hidden"]', mox) == []
  rows = {(r.path, r.module): r for r in yax.summary(mox)}
  total = sum(np.size(v) for v in jax.tree.leaves(variables))
  assert rows[('', '_LinenAroundNnx')].params == total
  assert rows[('block', 'ToLinen')].params == total - 3 * 2 - 2
  assert rows[('block', '_Bridged')].params == total - 3 * 2 - 2
  # LoRA on the NNX Linears inside the Linen call: identity at init, and
  # merged adapters give the Linen model what the adapted tree computes.
  res = yax.lora(mox, variables, '//module_call[@type="Linear"]', rank=2,
                 key=jax.random.key(1))
  assert res.paths == [('block', 'fc1'), ('block', 'fc2')]
  want = model.apply(variables, x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x), want,
                             rtol=1e-6)
  trained = jax.tree.map(lambda p, m: p + 0.3 if m else p, res.params,
                         res.mask)
  adapted = yax.eval_mox(res.mox, trained, x)
  assert not np.allclose(adapted, want)
  np.testing.assert_allclose(model.apply(res.merge(trained), x), adapted,
                             rtol=1e-5, atol=1e-6)


def test_lora_refuses_the_module_form_next_to_a_picky_argument():
  """lora needs the split form; its guard finds the NNX module among the
  traced arguments by walking their treedef. A pytree node of the user's
  whose unflatten refuses placeholders (Picky) used to make the guard
  answer "no module" and lora go on with the module form."""
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 3))
  mox = yax.make_mox(lambda m, p, x: m(x) * p.w)(model, Picky(jnp.ones(2)), x)
  np.testing.assert_allclose(yax.eval_mox(mox, model, Picky(jnp.ones(2)), x),
                             model(x), rtol=1e-6)
  with pytest.raises(yax.SubstitutionError, match='needs the split form'):
    yax.lora(mox, nnx.state(model), '//module_call[@type="Linear"]', rank=1)


class _JitMethodNet(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(4, 4, rngs=rngs)
    self.b = nnx.Linear(4, 3, rngs=rngs)

  @nnx.jit
  def first(self, x):
    return self.a(x)

  def __call__(self, x):
    return self.b(self.first(x))


def test_variables_passed_back_out_of_an_nnx_jit_method_stay_params():
  """An nnx.jit method gives back every Variable of its module; the later
  Linear's kernel is the parameter, not a value the jit computed. Failed
  before: the summary counted 50 params for a model of 35, and lora
  refused Linear 'b' (its kernel 'computed in the model')."""
  model = _JitMethodNet(nnx.Rngs(0))
  x = jnp.ones((2, 4))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  n = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == 35
  assert yax.summary(mox)[0].params == n
  np.testing.assert_allclose(yax.eval_mox(mox, state, x), model(x),
                             rtol=1e-6)
  res = yax.lora(mox, state, '//module_call[@type="Linear"]', rank=1)
  yax.check_mox(res.mox)
  assert len(res.paths) == 2
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x), model(x),
                             rtol=1e-6)
  # quantize: Linear 'a' (inside the jit) against the NNX model given the
  # same rounded kernel by hand (int8, symmetric absmax per output column).
  # Linear 'b''s kernel also passes through the jit of 'first', which
  # would go on reading it float: refused, naming that call. Before: a
  # tree that failed check_mox ("reads input ... before it is defined")
  # and eval_mox.
  q = yax.quantize(mox, state, '//module_call[@path="a"]')
  yax.check_mox(q.mox)
  rounded = _JitMethodNet(nnx.Rngs(0))
  w = np.asarray(rounded.a.kernel[...])
  scale = np.abs(w).max(0, keepdims=True) / 127
  rounded.a.kernel[...] = jnp.asarray(
      np.clip(np.round(w / scale), -127, 127) * scale)
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x), rounded(x),
                             rtol=1e-5, atol=1e-6)
  with pytest.raises(yax.SubstitutionError) as info:
    yax.quantize(mox, state, '//module_call[@type="Linear"]')
  assert ("Linear at path 'b' is also a variable input of module_call "
          "_JitMethodNet at path '<root>' (method first)") in str(info.value)
