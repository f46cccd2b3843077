"""``yax.cast``: selected module calls compute in another dtype.

Compared with the same Flax model built with ``dtype=`` (the result must be
identical), and on Hugging Face BERT with HF's own ``dtype=bfloat16``,
which casts everything, LayerNorm included.
"""

from __future__ import annotations

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax


class MLP(nn.Module):
  dtype: object = None
  head_dtype: object = None  # the last Dense's, where it differs

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(8, dtype=self.dtype)(x))
    h = nn.LayerNorm()(h)
    return nn.Dense(3, dtype=self.head_dtype or self.dtype)(h)


def test_cast_equals_the_module_built_with_that_dtype():
  model = MLP()
  x = jax.random.normal(jax.random.key(0), (2, 4))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  low = yax.cast(mox, '//module_call[@type="Dense"]', 'bfloat16')
  yax.check_mox(low)
  got = yax.eval_mox(low, variables, x)
  want = MLP(dtype=jnp.bfloat16).apply(variables, x)
  assert got.dtype == jnp.float32  # outputs cast back to the traced dtype
  np.testing.assert_array_equal(got, want.astype(jnp.float32))
  assert not np.allclose(got, model.apply(variables, x), rtol=1e-6,
                         atol=1e-6)
  # Same types and paths: the float tree's selections still work.
  dense = yax.query('//module_call[@type="Dense"]', low)
  assert [d.path for d in dense] == [('Dense_0',), ('Dense_1',)]
  assert all(d.params['compute_dtype'] == 'bfloat16' for d in dense)
  norm = yax.query('//module_call[@type="LayerNorm"]', low)[0]
  assert norm.outputs[0].aval.dtype == jnp.float32
  same = yax.cast(mox, '//module_call[@path="Dense_1"]', 'bfloat16',
                  output='float32')
  assert yax.eval_mox(same, variables, x).dtype == jnp.float32
  # Under jit and grad, like any tree.
  grads = jax.jit(jax.grad(lambda v: jnp.sum(yax.eval_mox(low, v, x))))(
      variables)
  assert grads['params']['Dense_0']['kernel'].dtype == jnp.float32


def test_cast_output_of_the_last_module():
  model = MLP()
  x = jax.random.normal(jax.random.key(0), (2, 4))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  # The model's own output: nothing reads it, so it may change dtype, as
  # the module built with dtype=bfloat16 returns bfloat16.
  low = yax.cast(mox, '//module_call[@path="Dense_1"]', 'bfloat16',
                 output='bfloat16')
  yax.check_mox(low)
  got = yax.eval_mox(low, variables, x)
  want = MLP(head_dtype=jnp.bfloat16).apply(variables, x)
  assert got.dtype == want.dtype == jnp.bfloat16
  np.testing.assert_array_equal(got, want)
  assert jax.jit(lambda v: yax.eval_mox(low, v, x))(variables).dtype == \
      jnp.bfloat16
  # Dense_0's output is read by the rest of the tree (traced in float32):
  # refused, with one XPath for the others on the last line.
  with pytest.raises(yax.SubstitutionError) as info:
    yax.cast(mox, '//module_call[@type="Dense"]', 'bfloat16',
             output='bfloat16')
  message = str(info.value)
  assert "Dense at path 'Dense_0'" in message and 'read further on' in message
  others = yax.cast(mox, message.splitlines()[-1].strip(), 'bfloat16',
                    output='bfloat16')
  np.testing.assert_array_equal(yax.eval_mox(others, variables, x), want)


class VmapHead(nn.Module):
  """The model's output from a Dense stacked by nn.vmap."""

  @nn.compact
  def __call__(self, x, dtype=None):
    stack = nn.vmap(nn.Dense, variable_axes={'params': 0},
                    split_rngs={'params': True}, in_axes=0, out_axes=0)
    return stack(4, dtype=dtype, name='d')(jnp.tanh(x))


class JitInner(nn.Module):
  dtype: object = None

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, dtype=self.dtype, name='d')(jnp.tanh(x))


class JitHead(nn.Module):
  """The model's output from a Dense inside an nn.jit body."""
  dtype: object = None

  @nn.compact
  def __call__(self, x):
    return nn.jit(JitInner)(self.dtype, name='inner')(x)


class NNXJitHead(nnx.Module):
  def __init__(self, rngs, dtype=None):
    self.lin = nnx.Linear(5, 4, dtype=dtype, rngs=rngs)

  @nnx.jit
  def __call__(self, x):
    return self.lin(jnp.tanh(x))


def test_cast_output_under_vmap_and_inside_jit_bodies():
  # Before: under nn.vmap the output came back float32 (output= ignored);
  # inside an nn.jit / nnx.jit body the call was refused as "read further
  # on" though its output is the model's own.
  x = jax.random.normal(jax.random.key(0), (3, 2, 5))
  for model, low_model, xpath in [
      (VmapHead(), None, '//module_call[@type="Dense"]'),
      (JitHead(), JitHead(jnp.bfloat16), '//module_call[@type="Dense"]')]:
    variables = model.init(jax.random.key(1), x)
    mox = yax.make_mox(model.apply)(variables, x)
    low = yax.cast(mox, xpath, 'bfloat16', output='bfloat16')
    yax.check_mox(low)
    got = yax.eval_mox(low, variables, x)
    if low_model is None:  # the same vmap, of the Dense built in bfloat16
      want = model.apply(variables, x, jnp.bfloat16)
    else:
      want = low_model.apply(variables, x)
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, want)
    # The stacked Dense cannot be traced again alone (its variables are
    # stacked): its body was replayed, and the call says why.
    (dense,) = yax.query(xpath, low)
    replayed = dense.params.get('cast_replayed', '')
    assert ('tracing it again at bfloat16 raised' in replayed) == (
        low_model is None), replayed
  model = NNXJitHead(nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  low = yax.cast(mox, '//module_call[@type="Linear"]', 'bfloat16',
                 output='bfloat16')
  yax.check_mox(low)
  got = yax.eval_mox(low, state, x)
  want = NNXJitHead(nnx.Rngs(0), dtype=jnp.bfloat16)(x)
  assert got.dtype == want.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32),
                             np.asarray(want, np.float32), rtol=1e-2,
                             atol=1e-2)


def test_cast_of_bert_dense_layers_beats_hf_bfloat16():
  from transformers import BertConfig, FlaxBertModel
  config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=37)
  model = FlaxBertModel(config, seed=0)
  ids = jnp.array([[5, 17, 42, 3, 8, 21, 60, 2]])
  want = model(ids, params=model.params).last_hidden_state
  mox = yax.make_mox(lambda p, ids: model(ids, params=p).last_hidden_state)(
      model.params, ids)
  low = yax.cast(mox, '//module_call[@type="Dense"]', 'bfloat16')
  yax.check_mox(low)
  got = yax.eval_mox(low, model.params, ids)
  hf_bf16 = FlaxBertModel(config, seed=0, dtype=jnp.bfloat16)
  theirs = hf_bf16(ids, params=model.params).last_hidden_state
  rel = lambda y: float(jnp.linalg.norm(y.astype(jnp.float32) - want)
                        / jnp.linalg.norm(want))
  assert 0 < rel(got) < rel(theirs), (rel(got), rel(theirs))
  # LayerNorm and the attention softmax stayed float32.
  for norm in yax.query('//module_call[@type="LayerNorm"]', low):
    assert norm.outputs[0].aval.dtype == jnp.float32
  assert yax.query('//module_call[@type="Dense"][@compute_dtype="bfloat16"]',
                   low)


class NNXNet(nnx.Module):

  def __init__(self, rngs, dtype=None):
    self.lin = nnx.Linear(4, 8, dtype=dtype, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.out = nnx.Linear(8, 3, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.out(self.norm(jax.nn.relu(self.lin(x))))


def test_nnx_cast_equals_the_modules_built_with_that_dtype():
  """NNX calls cannot be rebuilt from recorded fields: their traced body
  runs again on inputs and variables cast at the boundary."""
  model = NNXNet(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 4))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  low = yax.cast(mox, '//module_call[@type="Linear"]', 'bfloat16')
  yax.check_mox(low)
  got = yax.eval_mox(low, state, x)
  reference = NNXNet(nnx.Rngs(0), dtype=jnp.bfloat16)
  nnx.update(reference, state)
  np.testing.assert_array_equal(got, reference(x).astype(jnp.float32))
  assert {r.path: r.dtype for r in yax.summary(low)} == {
      '': 'float32', 'lin': 'bfloat16', 'norm': 'float32', 'out': 'bfloat16'}


class Capped(nnx.Module):
  """Constants in the body: traced as float32 literals next to values
  that a cast makes bfloat16."""

  def __init__(self, rngs, dtype=None):
    self.lin = nnx.Linear(4, 8, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return jnp.maximum(self.lin(x), -0.25) * 3.0


def test_nnx_cast_of_a_body_with_constants_promotes_them_as_jnp_does():
  # Failed before: 'lax.max requires arguments to have the same dtypes'
  # (MaxText's RoutedMoE.get_topk, replayed at bfloat16).
  model = Capped(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 4))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  low = yax.cast(mox, '//module_call[@type="Capped"]', 'bfloat16')
  yax.check_mox(low)
  got = yax.eval_mox(low, state, x)
  reference = Capped(nnx.Rngs(0), dtype=jnp.bfloat16)
  nnx.update(reference, state)
  want = reference(x)
  assert want.dtype == jnp.bfloat16
  np.testing.assert_array_equal(got, want.astype(jnp.float32))
  assert got.dtype == jnp.float32


class SiluFirst(nnx.Module):
  """A body whose first equation is a ``jit`` (``jax.nn.silu``) reading
  the call's input alone."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    return self.lin(jax.nn.silu(x))


def test_nnx_cast_runs_a_jit_body_at_its_traced_dtype():
  # Failed before: the silu jit, traced for float32, was handed the
  # bfloat16 input (check_mox: 'equation jit does not type-check'; eval:
  # XLA's RuntimeProgramInputMismatch). It takes it as float32 now and
  # computes as traced; the Linear then takes jnp's promotion of its
  # float32 input and bfloat16 kernel.
  model = SiluFirst(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 4))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  low = yax.cast(mox, '//module_call[@type="SiluFirst"]', 'bfloat16')
  yax.check_mox(low)
  got = yax.eval_mox(low, state, x)
  rounded = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
  h = x.astype(jnp.bfloat16).astype(jnp.float32)
  h = h * (1 / (1 + np.exp(-np.asarray(h))))
  want = h @ rounded(model.lin.kernel[...]) + rounded(model.lin.bias[...])
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert not np.allclose(got, model(x), rtol=1e-6, atol=1e-6)


def test_cast_checks_its_arguments():
  x = jnp.ones((2, 4))
  linen = MLP()
  variables = linen.init(jax.random.key(0), x)
  lmox = yax.make_mox(linen.apply)(variables, x)
  with pytest.raises(yax.SubstitutionError, match='must be a floating'):
    yax.cast(lmox, '//module_call[@type="Dense"]', 'int8')
  with pytest.raises(yax.SubstitutionError, match='selects module calls'):
    yax.cast(lmox, '//dot_general')


def test_summary_shows_each_calls_compute_dtype():
  from yax._src.report import summary as _summary
  model = MLP()
  x = jax.random.normal(jax.random.key(0), (2, 4))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  assert {r.path: r.dtype for r in yax.summary(mox)} == {
      '': 'float32', 'Dense_0': 'float32', 'LayerNorm_0': 'float32',
      'Dense_1': 'float32'}
  assert not any('dtype' in line and 'path' in line
                 for line in _summary.format_summary(mox).splitlines())
  low = yax.cast(mox, '//module_call[@type="Dense"]', 'bfloat16')
  rows = {r.path: r.dtype for r in yax.summary(low)}
  assert rows['Dense_0'] == rows['Dense_1'] == 'bfloat16'
  assert rows['LayerNorm_0'] == 'float32'
  table = _summary.format_summary(low)
  assert any('dtype' in line and 'path' in line for line in table.splitlines())
  q = yax.quantize(mox, variables, '//module_call[@path="Dense_1"]')
  assert {r.path: r.dtype for r in yax.summary(q.mox)}['Dense_1'] == \
      'float32 (int8)'


# ------------------------------------------------- state and host values

class BNBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.BatchNorm(use_running_average=False, name='bn')(
        nn.Dense(8, name='fc')(x))


def test_cast_of_a_call_that_updates_batch_stats():
  """The new statistics are read by the root (mutable=['batch_stats']),
  not outputs of the call. Failed before: check_mox 'reads output 1 ...
  before it is defined', eval_mox a raw KeyError."""
  x = jax.random.normal(jax.random.key(2), (4, 8))
  model = BNBlock()
  v = model.init(jax.random.key(0), x)
  apply = lambda v, x: model.apply(v, x, mutable=['batch_stats'])
  mox = yax.make_mox(apply)(v, x)
  low = yax.cast(mox, '//module_call[@type="BNBlock"]', 'bfloat16')
  yax.check_mox(low)
  (y, stats), (want_y, want_stats) = yax.eval_mox(low, v, x), apply(v, x)
  # Computed in bfloat16, given back in the traced dtypes.
  assert y.dtype == jnp.float32
  assert jax.tree.map(lambda a: a.dtype, stats) == jax.tree.map(
      lambda a: a.dtype, want_stats)
  np.testing.assert_allclose(y, want_y, rtol=0.05, atol=0.05)
  for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(want_stats)):
    np.testing.assert_allclose(a, b, rtol=0.02, atol=0.02)
  assert not np.array_equal(y, want_y)  # it did compute in bfloat16


class Scaled(nn.Module):
  dtype: object = None

  @nn.compact
  def __call__(self, x, scale, shift):
    return nn.Dense(4, dtype=self.dtype)(x) * scale + shift


class HostArgs(nn.Module):
  dtype: object = None

  @nn.compact
  def __call__(self, x):
    x = Scaled(self.dtype, name='a')(x, 0.5, np.float32(0.25))
    return Scaled(self.dtype, name='b')(x, np.full(4, 2.0, np.float32), 1.0)


def test_cast_of_calls_given_python_and_numpy_values():
  """A Python float, a NumPy scalar and a NumPy array given to a module
  call stay the values they are (as under plain Flax). Failed before:
  the cast tree took one more root argument per value."""
  x = jax.random.normal(jax.random.key(2), (2, 4))
  v = HostArgs().init(jax.random.key(0), x)
  mox = yax.make_mox(HostArgs().apply)(v, x)
  low = yax.cast(mox, '//module_call[@type="Scaled"]', 'bfloat16')
  yax.check_mox(low)
  assert len(low.inputs) == len(mox.inputs)
  got = yax.eval_mox(low, v, x)
  # Each Scaled built with dtype=bfloat16, its output cast back.
  a = Scaled(jnp.bfloat16).apply({'params': v['params']['a']}, x, 0.5,
                                 np.float32(0.25)).astype(jnp.float32)
  want = Scaled(jnp.bfloat16).apply({'params': v['params']['b']}, a,
                                    np.full(4, 2.0, np.float32), 1.0)
  np.testing.assert_array_equal(got, want.astype(jnp.float32))


class Asserting(nn.Module):
  @nn.compact
  def __call__(self, x):
    assert x.dtype == jnp.float32  # a bare assert: no message
    return nn.Dense(4)(x)


def test_cast_refusal_names_an_exception_without_a_message(monkeypatch):
  """The module's bare assert fails when it is traced again at bfloat16;
  its traced body, run again instead, fails the same way here (the
  interpreter made to raise a bare AssertionError). Failed before: the
  message took the first line of the caught exception's text, and an
  empty text raised a raw IndexError."""
  from yax._src.tools import cast as _cast
  x = jnp.ones((2, 4))
  v = Asserting().init(jax.random.key(0), x)
  mox = yax.make_mox(Asserting().apply)(v, x)

  def fails(*_):
    raise AssertionError

  monkeypatch.setattr(_cast._Promoting, 'run', fails)
  with pytest.raises(yax.SubstitutionError,
                     match='tracing it again at bfloat16 raised '
                     'AssertionError'):
    yax.cast(mox, '//module_call[@type="Asserting"]', 'bfloat16')


class NNXStateBlock(nnx.Module):
  """Updates state: BatchNorm statistics and the Dropout RNG count."""

  def __init__(self, rngs):
    self.fc = nnx.Linear(8, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(self.bn(self.fc(x)))


def test_cast_of_an_nnx_call_that_updates_state():
  """NNX BatchNorm statistics and the Dropout RNG count, in the split
  form: the cast tree gives the state plain NNX gives (statistics within
  bfloat16's error, the same RNG count) and its output computed in
  bfloat16. Checked before only for Linen (issue 32: check_mox 'reads
  output ... before it is defined', eval_mox a raw KeyError)."""
  x = jax.random.normal(jax.random.key(2), (4, 8))
  model = NNXStateBlock(nnx.Rngs(0, dropout=1))
  graphdef, state = nnx.split(model)

  def run(state, x):
    m = nnx.merge(graphdef, state)
    return m(x), nnx.state(m)

  mox = yax.make_mox(run)(state, x)
  low = yax.cast(mox, '//module_call[@type="NNXStateBlock"]', 'bfloat16')
  yax.check_mox(low)
  (y, new), (want_y, want) = yax.eval_mox(low, state, x), run(state, x)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, want_y, rtol=0.05, atol=0.05)
  assert not np.array_equal(y, want_y)  # it did compute in bfloat16
  leaves = lambda s: jax.tree.leaves(jax.tree.map(
      lambda a: jax.random.key_data(a)
      if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a, s))
  for a, b in zip(leaves(new), leaves(want), strict=True):
    assert a.dtype == b.dtype
    if jnp.issubdtype(a.dtype, jnp.floating):
      np.testing.assert_allclose(a, b, rtol=0.02, atol=0.02)
    else:  # the RNG count and key
      np.testing.assert_array_equal(a, b)
