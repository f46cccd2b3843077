"""Kernels that ``lora``, ``quantize`` and ``init_params`` reach in less
common places (issue 32): an ``nn.vmap`` stack whose input the vmap does
not batch, ... Each checked against the same computation written here
with plain ``jnp`` per slice."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax

TOL = dict(rtol=1e-5, atol=1e-5)


def int8_per_slice(w):
  """``w: [slices, in, out]`` rounded to int8 per slice and output column
  (symmetric absmax over ``in``), dequantized."""
  w = np.asarray(w, np.float32)
  scale = np.abs(w).max(1, keepdims=True) / 127
  return np.clip(np.round(w / scale), -127, 127) * scale


class Unbatched(nn.Module):
  """Three Dense layers stacked by ``nn.vmap`` on one unbatched input."""

  @nn.compact
  def __call__(self, x):
    stack = nn.vmap(nn.Dense, variable_axes={'params': 0},
                    split_rngs={'params': True}, in_axes=None, out_axes=0,
                    axis_size=3)
    return stack(4, name='d')(x)


def unbatched():
  x = jax.random.normal(jax.random.key(0), (2, 5))
  model = Unbatched()
  return model, model.init(jax.random.key(1), x), x


def per_slice_lora(x, kernel, bias, a, b, scale):
  """What one LoRA pair per slice computes: ``[slices, batch, out]``."""
  return jnp.stack([x @ (kernel[s] + scale * a[s] @ b[s]) + bias[s]
                    for s in range(kernel.shape[0])])


def random_adapters(params):
  p = jax.tree.map(lambda v: v, params)
  d = p['params']['d']
  d['lora_a'] = jax.random.normal(jax.random.key(7), d['lora_a'].shape)
  d['lora_b'] = jax.random.normal(jax.random.key(8), d['lora_b'].shape)
  return p


def test_lora_on_a_vmap_stack_with_an_unbatched_input_has_a_pair_per_slice():
  # Before: one pair shared by the stack, lora_a (5, 2), lora_b (2, 3, 4).
  model, variables, x = unbatched()
  mox = yax.make_mox(model.apply)(variables, x)
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=2,
                 alpha=4.0)
  yax.check_mox(res.mox)
  d = res.params['params']['d']
  assert d['lora_a'].shape == (3, 5, 2) and d['lora_b'].shape == (3, 2, 4)
  p = random_adapters(res.params)
  k = variables['params']['d']
  want = per_slice_lora(x, k['kernel'], k['bias'], p['params']['d']['lora_a'],
                        p['params']['d']['lora_b'], 2.0)
  np.testing.assert_allclose(yax.eval_mox(res.mox, p, x), want, **TOL)
  merged = res.merge(p)['params']['d']
  np.testing.assert_allclose(model.apply({'params': {'d': merged}}, x), want,
                             **TOL)


def test_qlora_and_init_params_on_a_vmap_stack_with_an_unbatched_input():
  model, variables, x = unbatched()
  mox = yax.make_mox(model.apply)(variables, x)
  dense = '//module_call[@type="Dense"]'
  q = yax.quantize(mox, variables, dense, weight='int8')
  assert q.params['params']['d']['kernel_scale'].shape == (3, 1, 4)
  res = yax.lora(q.mox, q.params, dense, rank=2)
  yax.check_mox(res.mox)
  d = res.params['params']['d']
  assert d['lora_a'].shape == (3, 5, 2) and d['lora_b'].shape == (3, 2, 4)
  p = random_adapters(res.params)
  k = variables['params']['d']
  deq = int8_per_slice(k['kernel'])
  want = per_slice_lora(x, deq, k['bias'], p['params']['d']['lora_a'],
                        p['params']['d']['lora_b'], 0.5)
  np.testing.assert_allclose(yax.eval_mox(res.mox, p, x), want, **TOL)
  # init_params makes the same adapters (per slice) and scales from the
  # float params.
  full = yax.init_params(res.mox, variables, key=jax.random.key(2))
  f = full['params']['d']
  assert f['lora_a'].shape == (3, 5, 2) and f['lora_b'].shape == (3, 2, 4)
  np.testing.assert_array_equal(f['kernel_scale'], d['kernel_scale'])
  np.testing.assert_allclose(
      yax.eval_mox(res.mox, full, x),
      jnp.stack([x @ deq[s] + k['bias'][s] for s in range(3)]), **TOL)


class TwoKernels(nn.Module):
  """Two kernels contracted in the body (each at its own dot_general,
  through a ReLU, so adapted in place); ``w2`` is also contracted with
  itself, which no adapter fits."""

  @nn.compact
  def __call__(self, x):
    w1 = self.param('w1', nn.initializers.normal(1.0), (5, 4))
    w2 = self.param('w2', nn.initializers.normal(1.0), (4, 4))
    h = jax.nn.relu(x @ w1)
    return h @ w2 + (w2 @ w2).sum()


class WithHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name='head')(TwoKernels(name='body')(x))


def test_a_call_with_kernels_that_fit_and_one_that_does_not_is_refused():
  # Before: lora and quantize rewrote w1 and silently left w2 as it was.
  x = jnp.ones((2, 5))
  model = WithHead()
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  for tool in (yax.lora, yax.quantize):
    with pytest.raises(yax.SubstitutionError) as info:
      tool(mox, variables,
           '//module_call[@type="TwoKernels" or @type="Dense"]')
    message = str(info.value)
    assert 'params/w1' in message and 'params/w2' in message
    assert 'not others is refused' in message
    # The last line selects what the tool can do: the head.
    rest = yax.query(message.splitlines()[-1].strip(), mox)
    assert [n.path for n in rest] == [('head',)]


class Experts(nn.Module):
  """A MoE's experts, [experts, in, out], contracted by ragged_dot."""

  @nn.compact
  def __call__(self, x, sizes):
    w = self.param('experts', nn.initializers.normal(1.0), (3, 5, 4))
    return jax.lax.ragged_dot(x, w, sizes)


def test_init_params_keeps_the_scale_record_under_in_place_lora():
  # QLoRA adapts a ragged_dot's experts in place, in the call's body; the
  # call, given new variables, lost its class and init_params its record
  # of the scales: "params lacks ... experts_scale ... no module call of
  # the tree declares it".
  x = jax.random.normal(jax.random.key(0), (6, 5))
  sizes = jnp.array([2, 3, 1], jnp.int32)
  model = Experts()
  variables = model.init(jax.random.key(1), x, sizes)
  mox = yax.make_mox(model.apply)(variables, x, sizes)
  select = '//module_call[@type="Experts"]'
  q = yax.quantize(mox, variables, select, weight='int8')
  res = yax.lora(q.mox, q.params, select, rank=2)
  yax.check_mox(res.mox)
  full = yax.init_params(res.mox, variables, key=jax.random.key(2))
  got = full['params']
  np.testing.assert_array_equal(got['experts'], q.params['params']['experts'])
  np.testing.assert_array_equal(got['experts_scale'],
                                q.params['params']['experts_scale'])
  assert got['lora_a'].shape == (3, 5, 2) and got['lora_b'].shape == (3, 2, 4)
  deq = int8_per_slice(variables['params']['experts'])
  np.testing.assert_allclose(yax.eval_mox(res.mox, full, x, sizes),
                             jax.lax.ragged_dot(x, jnp.asarray(deq), sizes),
                             **TOL)


class Weight(nn.Module):
  """Returns its weight (gemma 4's ``_Weight``): its caller contracts it."""
  shape: tuple

  @nn.compact
  def __call__(self):
    return self.param('w', nn.initializers.normal(1.0), self.shape)


class WeightExperts(nn.Module):
  """As gemma 4's MoERagged: experts held by submodules, contracted here."""

  @nn.compact
  def __call__(self, x, sizes):
    return jax.lax.ragged_dot(x, Weight((3, 5, 4), name='linear')(), sizes)


class MoEAndHead(nn.Module):

  @nn.compact
  def __call__(self, x, sizes):
    return nn.Dense(4, name='head')(WeightExperts(name='moe')(x, sizes))


def test_kernels_of_submodules_contracted_by_the_parent_are_refused_by_name():
  # Before: "it has no parameter of 2 or more axes that reaches a
  # dot_general" for the parent, whose ragged_dot reads the experts.
  x = jax.random.normal(jax.random.key(0), (6, 5))
  sizes = jnp.array([2, 3, 1], jnp.int32)
  model = MoEAndHead()
  variables = model.init(jax.random.key(1), x, sizes)
  mox = yax.make_mox(model.apply)(variables, x, sizes)
  for tool in (yax.lora, yax.quantize):
    for select, why in (
        ('WeightExperts', 'the kernels it contracts (params/linear/w) are '
         'variables of its submodules'),
        ('Weight', 'it returns its kernel (the module that calls it '
         'contracts it')):
      with pytest.raises(yax.SubstitutionError) as info:
        tool(mox, variables,
             f'//module_call[@type="{select}" or @type="Dense"]')
      message = str(info.value)
      assert f'{select} at path' in message and why in message, message
      assert [n.path for n in yax.query(message.splitlines()[-1].strip(),
                                        mox)] == [('head',)]


# ------------------------------------------- experts inside a shard_map

def _one_device_shard_map(body, n_in: int):
  """``jax.shard_map`` of ``body`` over a 1-device mesh, every value
  replicated (EasyDeL Mixtral's grouped matmul, on one host)."""
  mesh = jax.make_mesh((1,), ('x',))
  spec = jax.sharding.PartitionSpec()
  return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n_in,
                       out_specs=spec)


class ShardedExperts(nn.Module):
  """Experts ``[experts, in, out]`` contracted inside a ``shard_map`` body
  that calls no module."""

  @nn.compact
  def __call__(self, x):
    w = self.param('kernel', nn.initializers.normal(1.0), (3, 4, 5))
    experts = _one_device_shard_map(
        lambda x, w: jnp.einsum('bi,eio->beo', x, w), 2)
    return experts(x, w)


class ShardedTop(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name='head')(ShardedExperts(name='moe')(x))


def test_quantize_and_lora_reach_experts_inside_a_shard_map_body():
  # Before: both refused, "its kernel is read by shard_map, not only by a
  # contraction": the kernel plan did not enter the shard_map body.
  x = jax.random.normal(jax.random.key(0), (2, 4))
  model = ShardedTop()
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  moe = '//module_call[@type="ShardedExperts"]'
  w = variables['params']['moe']['kernel']
  head = variables['params']['head']

  def by_hand(kernel, extra=0.0):
    h = jnp.einsum('bi,eio->beo', x, kernel) + extra
    return h @ head['kernel'] + head['bias']

  q = yax.quantize(mox, variables, moe, weight='int8')
  yax.check_mox(q.mox)
  stored = q.params['params']['moe']
  assert stored['kernel'].dtype == jnp.int8
  assert stored['kernel_scale'].shape == (3, 1, 5)
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x),
                             by_hand(jnp.asarray(int8_per_slice(w))), **TOL)
  res = yax.lora(mox, variables, moe, rank=2, alpha=4.0)
  yax.check_mox(res.mox)
  p = jax.tree.map(lambda v: v, res.params)
  m = p['params']['moe']
  assert m['lora_a'].shape == (4, 2) and m['lora_b'].shape == (2, 3, 5)
  m['lora_a'] = jax.random.normal(jax.random.key(7), (4, 2))
  m['lora_b'] = jax.random.normal(jax.random.key(8), (2, 3, 5))
  delta = 2.0 * jnp.einsum('bi,ir,reo->beo', x, m['lora_a'], m['lora_b'])
  np.testing.assert_allclose(yax.eval_mox(res.mox, p, x), by_hand(w, delta),
                             **TOL)


class Tabled(nn.Module):
  """Reads a table from a collection that its parent's variables hold: it
  cannot be initialized alone (``get_variable`` gives None)."""

  @nn.compact
  def __call__(self, x):
    k = self.param('kernel', nn.initializers.normal(1.0), (5, 4))
    return (jnp.tanh(x) @ k) * self.get_variable('consts', 'table')


class TabledStack(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.vmap(Tabled, variable_axes={'params': 0, 'consts': 0},
                   split_rngs={'params': True}, in_axes=None, out_axes=0,
                   axis_size=3)(name='d')(x)


def test_a_stack_whose_module_cannot_be_built_alone_is_refused_saying_so():
  # Which kernel axes nn.vmap stacked is read from the module built alone;
  # here that fails. Before: the refusal gave only the around-call reason
  # (its input computed by tanh) and hid the in-place one.
  x = jnp.ones((2, 5))
  variables = {
      'params': {'d': {'kernel': jax.random.normal(jax.random.key(0),
                                                   (3, 5, 4))}},
      'consts': {'d': {'table': jnp.arange(12.0).reshape(3, 4)}}}
  model = TabledStack()
  k, t = variables['params']['d']['kernel'], variables['consts']['d']['table']
  np.testing.assert_allclose(
      model.apply(variables, x),
      jnp.stack([(jnp.tanh(x) @ k[s]) * t[s] for s in range(3)]), **TOL)
  mox = yax.make_mox(model.apply)(variables, x)
  for tool in (yax.lora, yax.quantize):
    with pytest.raises(yax.SubstitutionError) as info:
      tool(mox, variables, '//module_call[@type="Tabled"]')
    message = str(info.value)
    assert 'cannot tell which axes of its kernel params/kernel a lifted ' \
        'nn.vmap stacked: Tabled built alone' in message, message


class NoisyDense(nn.Module):
  """A kernel contracted with dropout-masked inputs: ``bernoulli`` is a
  jit body held as a raw jaxpr, whose own calls take literals."""

  @nn.compact
  def __call__(self, x):
    k = self.param('kernel', nn.initializers.normal(1.0), (5, 4))
    keep = jax.random.bernoulli(self.make_rng('dropout'), 0.5, x.shape)
    return (x * keep) @ k


class NoisyStack(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.vmap(NoisyDense, variable_axes={'params': 0},
                   split_rngs={'params': True, 'dropout': True},
                   in_axes=None, out_axes=0, axis_size=3)(name='d')(x)


def test_kernels_next_to_a_raw_body_with_literal_inputs():
  # Before: lora and quantize raised a raw "TypeError: unhashable type:
  # 'Literal'" walking the raw jaxpr of bernoulli's jit body.
  x = jax.random.normal(jax.random.key(3), (2, 5))
  model = NoisyStack()
  variables = model.init(jax.random.key(0), x)
  apply = lambda v, x: model.apply(v, x, rngs={'dropout': jax.random.key(2)})
  mox = yax.make_mox(apply)(variables, x)
  noisy = '//module_call[@type="NoisyDense"]'
  kernel = variables['params']['d']['kernel']
  with_kernel = lambda k: apply({'params': {'d': {'kernel': k}}}, x)
  q = yax.quantize(mox, variables, noisy, weight='int8')
  yax.check_mox(q.mox)
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x),
                             with_kernel(jnp.asarray(int8_per_slice(kernel))),
                             **TOL)
  res = yax.lora(mox, variables, noisy, rank=2, alpha=4.0)
  yax.check_mox(res.mox)
  p = jax.tree.map(lambda v: v, res.params)
  d = p['params']['d']
  assert d['lora_a'].shape == (3, 5, 2) and d['lora_b'].shape == (3, 2, 4)
  d['lora_a'] = jax.random.normal(jax.random.key(7), (3, 5, 2))
  d['lora_b'] = jax.random.normal(jax.random.key(8), (3, 2, 4))
  np.testing.assert_allclose(
      yax.eval_mox(res.mox, p, x),
      with_kernel(kernel + 2.0 * d['lora_a'] @ d['lora_b']), **TOL)
