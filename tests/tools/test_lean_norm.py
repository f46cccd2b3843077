"""yax.lean_norm against plain Flax: outputs within float rounding,
gradients (params and input) equal to jax.grad of the original model, and
JAX's saved residuals: each norm keeps its input and per-row statistics
([rows, 1]) where Flax's keeps several full-size tensors."""

from __future__ import annotations

import flax.linen as nn
from flax import nnx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from helpers import assert_trees_close, check_rewrite, saved_residuals


class Net(nn.Module):
  features: int = 16
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(epsilon=self.epsilon, name='ln')(
        nn.Dense(self.features)(x))
    return nn.Dense(4)(nn.RMSNorm(epsilon=self.epsilon, name='rms')(h))


def perturbed(v):
  """Scales and biases away from 1 and 0, so their gradients matter."""
  leaves, tree = jax.tree_util.tree_flatten(v)
  keys = jax.random.split(jax.random.key(9), len(leaves))
  return jax.tree_util.tree_unflatten(tree, [
      a + 0.3 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])


def loss(apply):
  return lambda v, x: jnp.sum(jnp.sin(apply(v, x)))


def assert_equals_plain(new, model, v, x, *, rtol=1e-5, atol=1e-5,
                        grad_rtol=2e-4, grad_atol=2e-5):
  """The rewritten tree's output and its gradients with respect to the
  params and the input equal the plain model's."""
  mine = lambda v, x: yax.eval_mox(new, v, x)
  np.testing.assert_allclose(mine(v, x), model.apply(v, x), rtol=rtol,
                             atol=atol)
  assert_trees_close(jax.grad(loss(mine), (0, 1))(v, x),
                     jax.grad(loss(model.apply), (0, 1))(v, x),
                     rtol=grad_rtol, atol=grad_atol)



@hypothesis.given(rows=st.integers(1, 7), features=st.integers(2, 24),
                  lead=st.integers(1, 3),
                  epsilon=st.sampled_from([1e-6, 1e-5, 0.1]))
@hypothesis.settings(max_examples=2, deadline=None)
def test_outputs_and_gradients_are_the_originals(rows, features, lead,
                                                 epsilon):
  model = Net(features, epsilon)
  x = 3.0 * jax.random.normal(jax.random.key(rows), (lead, rows, 5)) + 1.0
  v = perturbed(model.init(jax.random.key(0), x))
  mox = yax.make_mox(model.apply)(v, x)
  before = mox.to_json()
  new = check_rewrite(yax.lean_norm(mox))
  assert mox.to_json() == before
  # Each Linen call keeps its type, path, fields and variables, marked
  # lean="norm": queries written for the plain model still find it.
  kept = yax.query('//module_call[@type="LayerNorm" or @type="RMSNorm"]',
                   new)
  assert [(n.path, n.type_name, n.params.get('lean')) for n in kept] == [
      (('ln',), 'LayerNorm', 'norm'), (('rms',), 'RMSNorm', 'norm')]
  plain = yax.query('//module_call[@type="LayerNorm" or @type="RMSNorm"]',
                    mox)
  for a, b in zip(kept, plain, strict=True):
    assert a.var_tree == b.var_tree and a.entrypoint == b.entrypoint
    assert {k: v for k, v in a.params.items() if k != 'lean'} == b.params
  assert_equals_plain(new, model, v, x)


def test_each_norm_keeps_its_input_and_row_statistics():
  model = Net()
  x = jax.random.normal(jax.random.key(1), (6, 5))
  v = perturbed(model.init(jax.random.key(0), x))
  new = check_rewrite(yax.lean_norm(yax.make_mox(model.apply)(v, x)))
  lean = saved_residuals(loss(lambda v, x: yax.eval_mox(new, v, x)), v, x)
  # ln keeps its input (Dense's output), mean and rstd; rms its input
  # (ln's output) and rstd; the last Dense its input (rms's output); the
  # loss cos of the output.
  assert lean == sorted(['f32[6,16]'] * 3 + ['f32[6,1]'] * 3 + ['f32[6,4]'])
  flax = saved_residuals(loss(model.apply), v, x)
  assert flax.count('f32[6,16]') > 3 + 3  # several per norm in plain Flax
  report_before = yax.memory_report(loss(model.apply), v, x, xla=False)
  report_after = yax.memory_report(
      loss(lambda v, x: yax.eval_mox(new, v, x)), v, x, xla=False)
  # ln computes its mean, rstd and its output (rms's input).
  assert report_after.by_path()['ln'] == 2 * 6 * 4 + 6 * 16 * 4
  assert report_after.total < report_before.total


def test_refusals_and_input_unchanged():
  class Odd(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm(reduction_axes=(-2, -1), feature_axes=-1,
                       name='wide')(x)
      return nn.LayerNorm(name='ok')(h)

  x = jax.random.normal(jax.random.key(1), (2, 3, 4))
  v = Odd().init(jax.random.key(0), x)
  mox = yax.make_mox(Odd().apply)(v, x)
  before = mox.to_json()
  with pytest.raises(yax.SubstitutionError) as err:
    yax.lean_norm(mox)
  text = str(err.value)
  assert "module_call LayerNorm at path 'wide'" in text
  assert 'reduction_axes=(-2, -1)' in text and "'ok'" not in text
  fixed = text.splitlines()[-1].strip()
  assert fixed == ('//module_call[@type="LayerNorm" or @type="RMSNorm"]'
                   '[not(@path="wide")]')
  assert mox.to_json() == before
  new = check_rewrite(yax.lean_norm(mox, fixed))
  np.testing.assert_allclose(yax.eval_mox(new, v, x), Odd().apply(v, x),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(yax.SubstitutionError,
                     match=r'its variables have the shapes \[.*\(4, 3\).*\], '
                           r'expected \(4,\) each'):
    yax.lean_norm(yax.make_mox(nn.Dense(3).apply)(
        nn.Dense(3).init(jax.random.key(0), x), x),
        '//module_call[@type="Dense"]')


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.d = nnx.Linear(5, 16, rngs=rngs)
    self.ln = nnx.LayerNorm(16, rngs=rngs)
    self.rms = nnx.RMSNorm(16, epsilon=1e-5, rngs=rngs)
    self.o = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.o(self.rms(self.ln(self.d(x))))


def test_nnx_norms_keep_their_call_and_input_and_row_statistics():
  graphdef, state = nnx.split(NnxNet(nnx.Rngs(0)))
  state = perturbed(state)
  x = 2.0 * jax.random.normal(jax.random.key(1), (6, 5)) + 1.0
  plain = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(plain)(state, x)
  before = mox.to_json()
  new = check_rewrite(yax.lean_norm(mox))
  assert mox.to_json() == before
  # Each NNX call keeps its type, path and variables, marked lean="norm".
  assert yax.query('//module_call[@lean="norm"]/@type', new) == [
      'LayerNorm', 'RMSNorm']
  mine = lambda s, x: yax.eval_mox(new, s, x)
  np.testing.assert_allclose(mine(state, x), plain(state, x), rtol=1e-5,
                             atol=1e-5)
  assert_trees_close(jax.grad(loss(mine), (0, 1))(state, x),
                     jax.grad(loss(plain), (0, 1))(state, x),
                     rtol=2e-4, atol=2e-5)
  lean = saved_residuals(loss(mine), state, x)
  # ln keeps its input, mean and rstd; rms its input and rstd; the last
  # Linear its input (rms's output); the loss cos of the output.
  assert lean == sorted(['f32[6,16]'] * 3 + ['f32[6,1]'] * 3 + ['f32[6,4]'])
  assert saved_residuals(loss(plain), state, x).count('f32[6,16]') > 6
  # The module object form (the model itself traced) as well.
  model = nnx.merge(graphdef, state)
  direct = check_rewrite(yax.lean_norm(yax.make_mox(model)(x)))
  np.testing.assert_allclose(yax.eval_mox(direct, x), model(x), rtol=1e-5,
                             atol=1e-5)


class Mlp(nn.Module):
  """A norm, then a GELU (tanh form) in a block and a SiLU outside it."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name='ln')(x)
    h = Up(name='up')(h)
    return nn.Dense(4, name='down')(nn.silu(nn.Dense(16, name='mid')(h)))


class Up(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.gelu(nn.Dense(32)(x), approximate=True)


def test_activations_keep_their_input_only():
  model = Mlp()
  x = jax.random.normal(jax.random.key(1), (6, 8))
  v = perturbed(model.init(jax.random.key(0), x))
  mox = yax.make_mox(model.apply)(v, x)
  new = check_rewrite(yax.lean_norm(mox, activations=True))
  assert yax.query('//module_call[@type="LeanActivation"]/@name', new) == [
      'gelu_tanh', 'silu']
  # The norm rounds differently (fast variance); the activations not.
  assert_equals_plain(new, model, v, x, atol=1e-6)
  # A model with no norm: the activations alone; outputs bit for bit.
  up = Up()
  vu = perturbed(up.init(jax.random.key(2), x))
  acts = check_rewrite(yax.lean_norm(yax.make_mox(up.apply)(vu, x),
                                     activations=True))
  only = lambda v, x: yax.eval_mox(acts, v, x)
  np.testing.assert_array_equal(only(vu, x), up.apply(vu, x))
  assert_trees_close(jax.grad(loss(only), (0, 1))(vu, x),
                     jax.grad(loss(up.apply), (0, 1))(vu, x),
                     rtol=1e-6, atol=1e-7)

  lean = saved_residuals(loss(lambda v, x: yax.eval_mox(new, v, x)), v, x)
  # ln: mean, rstd (its input is the argument x); up's Dense its input
  # (ln's output); GELU its input only; mid its input (GELU's output);
  # SiLU its input only; down its input (SiLU's output); cos for the loss.
  assert lean == sorted(['f32[6,8]', 'f32[6,1]', 'f32[6,1]'] +
                        ['f32[6,32]'] * 2 + ['f32[6,16]'] * 2 + ['f32[6,4]'])
  plain = saved_residuals(loss(model.apply), v, x)
  assert plain.count('f32[6,32]') >= 4 and plain.count('f32[6,16]') >= 3
  # Only under the calls an XPath selects.
  up_only = check_rewrite(yax.lean_norm(mox, activations='//*[@name="up"]'))
  assert yax.query('//module_call[@type="LeanActivation"]/@path',
                   up_only) == ['up/gelu_tanh']


def test_activations_compose_with_fewbit():
  model = Mlp()
  x = jax.random.normal(jax.random.key(1), (6, 8))
  v = perturbed(model.init(jax.random.key(0), x))
  mox = yax.make_mox(model.apply)(v, x)
  few = yax.fewbit(mox, '//module_call[@name="up"]', bits=3)
  new = check_rewrite(yax.lean_norm(few, activations=True))
  # The GELU stays FewBit (its 3-bit codes: 6 * 32 * 3 / 8 = 72 bytes);
  # the SiLU keeps its input.
  assert yax.query('//module_call[@type="FewBit"]/@name', new) == [
      'gelu_tanh']
  assert yax.query('//module_call[@type="LeanActivation"]/@name', new) == [
      'silu']
  lean = saved_residuals(loss(lambda v, x: yax.eval_mox(new, v, x)), v, x)
  assert 'u8[72]' in lean and lean.count('f32[6,16]') == 2
  # Every activation FewBit already: the norms alone change.
  every = yax.fewbit(mox, bits=3)
  again = check_rewrite(yax.lean_norm(every, activations=True))
  assert len(yax.query('//module_call[@type="FewBit"]', again)) == 2
  assert not yax.query('//module_call[@type="LeanActivation"]', again)
  with pytest.raises(yax.SubstitutionError, match='no supported activation'):
    yax.lean_norm(yax.make_mox(nn.Dense(3).apply)(
        nn.Dense(3).init(jax.random.key(0), x), x), activations=True)


def test_cast_and_lean_norm_refuse_each_others_norms():
  # Before: cast rebuilt a lean Linen LayerNorm from its class, so the
  # call said lean="norm" while its body kept Flax's residuals again.
  model = Net()
  x = jax.random.normal(jax.random.key(1), (6, 5))
  v = perturbed(model.init(jax.random.key(0), x))
  mox = yax.make_mox(model.apply)(v, x)
  lean = check_rewrite(yax.lean_norm(mox))
  before = lean.to_json()
  with pytest.raises(yax.SubstitutionError) as err:
    yax.cast(lean, '//module_call[@type="LayerNorm"]', 'bfloat16')
  assert "module_call LayerNorm at path 'ln'" in str(err.value)
  assert "lean_norm call(s) at 'ln'" in str(err.value)
  assert lean.to_json() == before
  low = yax.cast(mox, '//module_call[@type="LayerNorm"]', 'bfloat16')
  with pytest.raises(yax.SubstitutionError,
                     match="at path 'ln': yax.cast made it compute in "
                           "bfloat16"):
    yax.lean_norm(low)
  # Norms left out of the cast: both apply, and ln keeps its input (the
  # first Dense's output, computed in bfloat16 and cast back) and its
  # per-row statistics.
  dense = check_rewrite(yax.lean_norm(
      yax.cast(mox, '//module_call[@type="Dense"]', 'bfloat16')))
  assert yax.query('//module_call[@lean="norm"]/@path', dense) == ['ln',
                                                                  'rms']
  kept = saved_residuals(loss(lambda v, x: yax.eval_mox(dense, v, x)), v, x)
  assert kept.count('f32[6,1]') == 3


def test_two_pass_variance_where_flax_uses_it():
  # Before: lean_norm ignored use_fast_variance=False and computed
  # E[x^2] - E[x]^2, which loses the variance of rows with a large mean
  # (here 1000 +- 1: float32 keeps about 0.06 of E[x^2] = 1e6 + 1).
  model = nn.LayerNorm(use_fast_variance=False)
  x = 1000.0 + jax.random.normal(jax.random.key(1), (4, 16))
  v = perturbed(model.init(jax.random.key(0), x))
  new = check_rewrite(yax.lean_norm(yax.make_mox(model.apply)(v, x)))
  assert_equals_plain(new, model, v, x, rtol=1e-4, atol=1e-4,
                      grad_rtol=1e-3, grad_atol=1e-4)


# Norms as other libraries write them, in plain JAX inside classes of their
# own names: lean_norm reads each from what its body computes.
class GemmaStyleRMSNorm(nn.Module):
  """Gemma / RecurrentGemma: scale applied as (1 + scale), expand_dims."""

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.initializers.zeros, (x.shape[-1],))
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed = x * jax.lax.rsqrt(var + 1e-6)
    return normed * (1 + jnp.expand_dims(scale, range(x.ndim - 1)))


class T5StyleNorm(nn.Module):
  """Hugging Face's FlaxT5LayerNorm: x / sqrt(mean(x**2) + eps) * weight."""

  @nn.compact
  def __call__(self, x):
    weight = self.param('weight', nn.initializers.ones, (x.shape[-1],))
    variance = jnp.power(x.astype(jnp.float32), 2).mean(-1, keepdims=True)
    return weight * (x / jnp.sqrt(variance + 1e-5))


class CentredNorm(nn.Module):
  """A LayerNorm written out: two-pass variance, scale and bias."""

  @nn.compact
  def __call__(self, x):
    g = self.param('g', nn.initializers.ones, (x.shape[-1],))
    b = self.param('b', nn.initializers.zeros, (x.shape[-1],))
    centred = x - x.mean(-1, keepdims=True)
    var = (centred * centred).mean(-1, keepdims=True)
    return centred * jax.lax.rsqrt(var + 1e-5) * g + b


class BareRMSNorm(nn.Module):
  """No variables: x * rsqrt(mean(x * x) + eps)."""

  @nn.compact
  def __call__(self, x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 0.1)


class Written(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    h = GemmaStyleRMSNorm(name='gemma')(h)
    h = T5StyleNorm(name='t5')(h)
    h = CentredNorm(name='centred')(h)
    h = BareRMSNorm(name='bare')(h)
    return nn.Dense(4)(h)


WRITTEN = ['gemma', 't5', 'centred', 'bare']


@hypothesis.given(rows=st.integers(1, 6), lead=st.integers(1, 2))
@hypothesis.settings(max_examples=1, deadline=None)
def test_norms_read_from_their_body(rows, lead):
  model = Written()
  x = 2.0 * jax.random.normal(jax.random.key(rows), (lead, rows, 5)) + 0.5
  v = perturbed(model.init(jax.random.key(0), x))
  mox = yax.make_mox(model.apply)(v, x)
  before = mox.to_json()
  new = check_rewrite(yax.lean_norm(mox))
  assert mox.to_json() == before
  # Found by data flow under their own class names; each keeps its type,
  # path and variables.
  kept = yax.query('//module_call[@lean="norm"]', new)
  assert [(n.path, n.type_name) for n in kept] == [
      (('gemma',), 'GemmaStyleRMSNorm'), (('t5',), 'T5StyleNorm'),
      (('centred',), 'CentredNorm'), (('bare',), 'BareRMSNorm')]
  for n in kept:
    (old,) = yax.query(f'//module_call[@path="{n.path[0]}"]', mox)
    assert n.var_tree == old.var_tree
  assert_equals_plain(new, model, v, x)


def test_norms_read_from_their_body_keep_input_and_row_statistics():
  model = Written()
  x = jax.random.normal(jax.random.key(1), (6, 5))
  v = perturbed(model.init(jax.random.key(0), x))
  new = check_rewrite(yax.lean_norm(yax.make_mox(model.apply)(v, x)))
  mine = loss(lambda v, x: yax.eval_mox(new, v, x))
  # Counted by hand: each of the four norms keeps its input [6, 16] and
  # rstd [6, 1], the centred one its mean too; the last Dense its input
  # (bare's output); the loss cos of the output.
  assert saved_residuals(mine, v, x) == sorted(
      ['f32[6,16]'] * 5 + ['f32[6,1]'] * 5 + ['f32[6,4]'])
  plain = saved_residuals(loss(model.apply), v, x)
  assert plain.count('f32[6,16]') >= 2 * 5  # twice as many in plain JAX
  report = yax.memory_report(mine, v, x, xla=False)
  by_path = report.by_path()
  # A residual belongs to the call that computes it: gemma computes t5's
  # input and its own rstd; centred its mean, rstd and bare's input.
  assert by_path['gemma'] == 6 * 16 * 4 + 6 * 4
  assert by_path['centred'] == 6 * 16 * 4 + 2 * 6 * 4
  assert report.total == (5 * 6 * 16 + 5 * 6 + 6 * 4) * 4


class SumNorm(nn.Module):
  """x * rsqrt(sum(x^2) + eps): a sum, not a mean, of squares."""

  @nn.compact
  def __call__(self, x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)


class RMSNorm(nn.Module):
  """Named as a norm, but normalises over the rows (axis 0)."""

  @nn.compact
  def __call__(self, x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, 0, keepdims=True) + 1e-6)


class Softish(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.exp(x) * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True))


class NotNorms(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = SumNorm(name='sum')(x)
    x = RMSNorm(name='rows')(x)
    x = Softish(name='soft')(x)
    return CentredNorm(name='ok')(x)


def test_bodies_that_are_not_norms_are_refused():
  model = NotNorms()
  x = jax.random.normal(jax.random.key(1), (3, 8))
  v = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(v, x)
  before = mox.to_json()
  # By default: the call named RMSNorm is refused with what it computes,
  # the untyped ones that are no norm are not selected.
  with pytest.raises(yax.SubstitutionError) as err:
    yax.lean_norm(mox)
  text = str(err.value)
  assert "module_call RMSNorm at path 'rows'" in text
  assert 'a sum over axis 0 of the input, not the last' in text
  assert "'sum'" not in text and "'soft'" not in text
  assert text.splitlines()[-1].strip() == (
      '//module_call[@type="LayerNorm" or @type="RMSNorm"][not(@path="rows")]')
  assert mox.to_json() == before
  # Selected by XPath: each refusal says what it found.
  with pytest.raises(yax.SubstitutionError) as err:
    yax.lean_norm(mox, '//module_call[@path="sum" or @path="soft" or '
                       '@path="ok"]')
  text = str(err.value)
  assert 'cannot rewrite 2 of the 3 calls' in text
  assert "SumNorm at path 'sum': its body does not compute a norm" in text
  assert 'found another function of its input' in text
  assert "Softish at path 'soft'" in text and 'the primitive exp' in text
  assert mox.to_json() == before
  new = check_rewrite(yax.lean_norm(mox, '//module_call[@path="ok"]'))
  np.testing.assert_allclose(yax.eval_mox(new, v, x), model.apply(v, x),
                             rtol=1e-5, atol=1e-5)


class UpcastRMSNorm(nn.Module):
  """MaxText's form with dtype=float32 on a bfloat16 input: the output is
  float32, the scale applied after the cast."""

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],))
    x = jnp.asarray(x, jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jax.lax.square(x), -1, keepdims=True)
                          + 1e-5)
    return jnp.einsum('...k,k->...k', y, scale)


def test_norm_read_from_its_body_keeps_its_output_dtype():
  model = UpcastRMSNorm()
  x = jax.random.normal(jax.random.key(1), (4, 8)).astype(jnp.bfloat16)
  v = perturbed(model.init(jax.random.key(0), x))
  new = check_rewrite(yax.lean_norm(yax.make_mox(model.apply)(v, x)))
  mine = lambda v, x: yax.eval_mox(new, v, x)
  assert yax.query('//module_call[@lean="norm"]/@type', new) == [
      'UpcastRMSNorm']
  assert mine(v, x).dtype == jnp.float32
  np.testing.assert_allclose(mine(v, x), model.apply(v, x), rtol=1e-5,
                             atol=1e-5)
  grads = jax.grad(loss(mine), (0, 1))(v, x)
  assert grads[1].dtype == jnp.bfloat16
  assert_trees_close(grads, jax.grad(loss(model.apply), (0, 1))(v, x),
                     rtol=1e-2, atol=1e-2)


class ReluThenNorm(nn.Module):
  """A ReLU (jnp.maximum) before the norm: no norm of the input."""

  @nn.compact
  def __call__(self, x):
    h = jnp.maximum(x, 0.0)
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)


def test_a_relu_before_the_norm_is_not_taken_for_a_clamp():
  x = jax.random.normal(jax.random.key(1), (3, 8))
  model = ReluThenNorm()
  mox = yax.make_mox(model.apply)(model.init(jax.random.key(0), x), x)
  with pytest.raises(yax.SubstitutionError,
                     match='a maximum other than max\\(variance, 0\\)'):
    yax.lean_norm(mox, '//module_call[@type="ReluThenNorm"]')
