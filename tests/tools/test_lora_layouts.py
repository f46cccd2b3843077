"""LoRA on every kernel layout, decided by the contraction, not the class.

Each case compares the adapted tree with the plain Flax model run on the
kernel ``W + (alpha / rank) * delta``, where ``delta`` is written here by
hand for the layout (an ``np.einsum`` of the adapters, ``A: [*contracted
kernel axes, rank]``, ``B: [rank, *other kernel axes]``; a convolution's
``A`` holds the window and input features). The same reference checks
``merge``; every adapter gets a nonzero gradient under ``jax.jit``.
"""

from __future__ import annotations

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax

RANK, ALPHA = 2, 3.0
TOL = dict(rtol=2e-5, atol=2e-5)


def get(tree, keys):
  for k in keys:
    tree = tree[k]
  return tree


def put(tree, keys, value):
  """A copy of nested dicts ``tree`` with ``value`` at ``keys``."""
  if not keys:
    return value
  out = dict(tree)
  out[keys[0]] = put(tree[keys[0]], keys[1:], value)
  return out


def perturbed(res, seed=3):
  """The adapters moved away from their init, as if trained."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda v, m: v + jnp.asarray(rng.normal(0, 0.5, np.shape(v)), v.dtype)
      if m else v, res.params, res.mask)


def check_adapter_gradients(res, params, *args):
  loss = lambda p: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(
      yax.eval_mox(res.mox, p, *args)))
  grads = jax.jit(jax.grad(loss))(params)
  norms = [float(jnp.abs(g).sum()) for g, m in zip(
      jax.tree.leaves(grads), jax.tree.leaves(res.mask), strict=True) if m]
  assert norms and all(n > 0 for n in norms), norms


class Gemma(nn.Module):
  """Gemma's Einsum: ``jnp.einsum(eqn, x, w)``, the kernel on the left."""
  shape: tuple
  eqn: str

  @nn.compact
  def __call__(self, x):
    w = self.param('w', nn.initializers.normal(), self.shape)
    return jnp.einsum(self.eqn, x, w)


class Conv1D(nn.Module):
  """Hugging Face GPT-2's FlaxConv1D: kernel [out, in], contracted on its
  last axis."""
  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', nn.initializers.normal(),
                        (self.features, x.shape[-1]))
    bias = self.param('bias', nn.initializers.zeros, (self.features,))
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())))
    return y + bias


class DotT(nn.Module):
  """A kernel [out, in] used as ``x @ kernel.T``."""
  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', nn.initializers.normal(),
                        (self.features, x.shape[-1]))
    return x @ kernel.T


class Wrap(nn.Module):
  """One layer under test, followed by a nonlinearity."""
  make: object

  @nn.compact
  def __call__(self, x):
    return jnp.tanh(self.make()(x))


class Scanned(nn.Module):
  """Three Dense layers stacked by nn.scan (kernels [3, 6, 6]; on axis 1,
  [6, 3, 6], Flax moves the stack axis to the front before the scan
  slices it, as MaxText's param_scan_axis=1 does)."""
  axis: int = 0

  @nn.compact
  def __call__(self, x):
    body = nn.scan(lambda mdl, c, _: (jnp.tanh(mdl(c)), None),
                   variable_axes={'params': self.axis},
                   split_rngs={'params': True}, length=3)
    return body(nn.Dense(6, name='layer'), x, None)[0]


# (id, layer, input shape, params path of the kernel, selection, A, B,
#  einsum giving the kernel change from A and B)
LINEN_CASES = [
    ('dense', lambda: nn.Dense(5, name='layer'), (3, 4), ('layer', 'kernel'),
     'Dense', (4, RANK), (RANK, 5), 'ir,ro->io'),
    ('einsum', lambda: nn.Einsum((4, 2, 5), '...i,ijk->...jk', name='layer'),
     (3, 4), ('layer', 'kernel'), 'Einsum', (4, RANK), (RANK, 2, 5),
     'ir,rjk->ijk'),
    ('gemma-q', lambda: Gemma((2, 4, 3), 'BTD,NDH->BTNH', name='layer'),
     (2, 5, 4), ('layer', 'w'), 'Gemma', (4, RANK), (RANK, 2, 3),
     'dr,rnh->ndh'),
    ('gemma-kv', lambda: Gemma((2, 3, 4, 5), 'BSD,CKDH->CBSKH', name='layer'),
     (2, 6, 4), ('layer', 'w'), 'Gemma', (4, RANK), (RANK, 2, 3, 5),
     'dr,rckh->ckdh'),
    ('gemma-out', lambda: Gemma((2, 3, 4), 'BTNH,NHD->BTD', name='layer'),
     (2, 5, 2, 3), ('layer', 'w'), 'Gemma', (2, 3, RANK), (RANK, 4),
     'nhr,rd->nhd'),
    ('dense-general-leading-axis',
     lambda: nn.DenseGeneral(4, axis=0, name='layer'), (3, 6),
     ('layer', 'kernel'), 'DenseGeneral', (3, RANK), (RANK, 4), 'ar,ro->ao'),
    ('dense-general-two-axes',
     lambda: nn.DenseGeneral((2, 3), axis=(-2, -1), name='layer'), (4, 2, 5),
     ('layer', 'kernel'), 'DenseGeneral', (2, 5, RANK), (RANK, 2, 3),
     'abr,rcd->abcd'),
    ('dense-general-batch-dims',
     lambda: nn.DenseGeneral(4, axis=-1, batch_dims=0, name='layer'),
     (2, 3, 5), ('layer', 'kernel'), 'DenseGeneral', (5, RANK), (RANK, 2, 4),
     'ir,rbo->bio'),
    ('gpt2-conv1d', lambda: Conv1D(5, name='layer'), (2, 3, 4),
     ('layer', 'kernel'), 'Conv1D', (4, RANK), (RANK, 5), 'ir,ro->oi'),
    ('transposed', lambda: DotT(5, name='layer'), (3, 4), ('layer', 'kernel'),
     'DotT', (4, RANK), (RANK, 5), 'ir,ro->oi'),
    ('conv2d', lambda: nn.Conv(4, (3, 3), strides=2, name='layer'),
     (1, 7, 7, 2), ('layer', 'kernel'), 'Conv', (3, 3, 2, RANK), (RANK, 4),
     'hwir,ro->hwio'),
    ('conv1d-dilated', lambda: nn.Conv(3, (2,), kernel_dilation=2,
                                       padding='VALID', name='layer'),
     (2, 9, 4), ('layer', 'kernel'), 'Conv', (2, 4, RANK), (RANK, 3),
     'wir,ro->wio'),
]


@pytest.mark.parametrize('case', LINEN_CASES, ids=[c[0] for c in LINEN_CASES])
def test_linen_layout(case):
  _, make, x_shape, kernel_path, module, a_shape, b_shape, subscripts = case
  model = Wrap(make)
  x = jax.random.normal(jax.random.key(0), x_shape)
  variables = model.init(jax.random.key(1), x)
  variables = {'params': dict(variables['params'])}
  mox = yax.make_mox(model.apply)(variables, x)
  res = yax.lora(mox, variables, f'//module_call[@type="{module}"]',
                 rank=RANK, alpha=ALPHA, key=jax.random.key(2))
  yax.check_mox(res.mox)
  inner = get(res.params['params'], kernel_path[:-1])
  assert inner['lora_a'].shape == a_shape
  assert inner['lora_b'].shape == b_shape
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             model.apply(variables, x), **TOL)
  trained = perturbed(res)
  module_params = get(trained['params'], kernel_path[:-1])
  a, b = np.asarray(module_params['lora_a']), np.asarray(module_params['lora_b'])
  kernel = get(variables['params'], kernel_path)
  new_kernel = kernel + ALPHA / RANK * np.einsum(subscripts, a, b)
  reference = put(variables, ('params', *kernel_path), new_kernel)
  want = model.apply(reference, x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), want, **TOL)
  np.testing.assert_allclose(model.apply(res.merge(trained), x), want, **TOL)
  assert not np.allclose(want, model.apply(variables, x), **TOL)
  check_adapter_gradients(res, trained, x)


@pytest.mark.parametrize('axis,subscripts', [(0, 'lir,lro->lio'),
                                             (1, 'lir,lro->ilo')])
def test_kernels_stacked_by_scan_get_one_adapter_pair_per_slice(axis,
                                                                subscripts):
  model = Scanned(axis)
  x = jax.random.normal(jax.random.key(0), (2, 6))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=RANK,
                 alpha=ALPHA)
  yax.check_mox(res.mox)
  layer = res.params['params']['layer']
  # Stacked on axis 0, the axis the scan slices.
  assert layer['lora_a'].shape == (3, 6, RANK)
  assert layer['lora_b'].shape == (3, RANK, 6)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             model.apply(variables, x), **TOL)
  trained = perturbed(res)
  t = trained['params']['layer']
  kernel = variables['params']['layer']['kernel']
  new = kernel + ALPHA / RANK * np.einsum(subscripts, t['lora_a'],
                                          t['lora_b'])
  want = model.apply(put(variables, ('params', 'layer', 'kernel'), new), x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), want, **TOL)
  np.testing.assert_allclose(model.apply(res.merge(trained), x), want, **TOL)
  check_adapter_gradients(res, trained, x)


class Vmapped(nn.Module):
  """Three Dense layers side by side by nn.vmap (kernels [3, 5, 4]), next
  to a DenseGeneral whose batch axis is its own."""

  @nn.compact
  def __call__(self, x):
    body = nn.vmap(lambda mdl, c: mdl(c), variable_axes={'params': 0},
                   split_rngs={'params': True}, in_axes=0)
    h = body(nn.Dense(4, name='layer'), x)
    return nn.DenseGeneral(2, batch_dims=0, name='general')(jnp.tanh(h))


def test_kernels_stacked_by_vmap_get_one_adapter_pair_per_slice():
  model = Vmapped()
  x = jax.random.normal(jax.random.key(0), (3, 2, 5))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = yax.lora(mox, variables, '//module_call[@type="Dense" or '
                 '@type="DenseGeneral"]', rank=RANK, alpha=ALPHA)
  yax.check_mox(res.mox)
  layer, general = res.params['params']['layer'], res.params['params'][
      'general']
  assert layer['lora_a'].shape == (3, 5, RANK)
  assert layer['lora_b'].shape == (3, RANK, 4)
  # DenseGeneral's own batch axis is a kernel axis: B carries it.
  assert general['lora_a'].shape == (4, RANK)
  assert general['lora_b'].shape == (RANK, 3, 2)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             model.apply(variables, x), **TOL)
  trained = perturbed(res)
  t, g = trained['params']['layer'], trained['params']['general']
  p = variables['params']
  new = put(variables, ('params', 'layer', 'kernel'), p['layer']['kernel'] +
            ALPHA / RANK * np.einsum('lir,lro->lio', t['lora_a'],
                                     t['lora_b']))
  new = put(new, ('params', 'general', 'kernel'), p['general']['kernel'] +
            ALPHA / RANK * np.einsum('ir,rbo->bio', g['lora_a'], g['lora_b']))
  want = model.apply(new, x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), want, **TOL)
  np.testing.assert_allclose(model.apply(res.merge(trained), x), want, **TOL)
  check_adapter_gradients(res, trained, x)


def test_refusals_come_in_one_round_with_one_xpath_for_the_others():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, img):
      a = nn.Einsum((4, 2, 5), '...i,ijk->...jk', name='einsum')(x)
      b = nn.LayerNorm(name='norm')(x)
      c = nn.Conv(4, (3, 3), name='conv')(img)
      d = nn.Conv(4, (3, 3), feature_group_count=2, name='grouped')(img)
      return a, b, c, d

  model = Model()
  x, img = jnp.ones((3, 4)), jnp.ones((1, 5, 5, 2))
  variables = model.init(jax.random.key(0), x, img)
  mox = yax.make_mox(model.apply)(variables, x, img)
  selection = '//module_call[@path!=""]'
  with pytest.raises(yax.SubstitutionError) as info:
    yax.lora(mox, variables, selection)
  message = str(info.value)
  assert 'cannot adapt 2 of the 4 module calls' in message
  assert "LayerNorm at path 'norm'" in message
  assert "Conv at path 'grouped'" in message and 'feature_group_count=2' in \
      message
  # nn.Einsum's nested helper call belongs to its __call__: one module.
  assert "path 'einsum'" not in message
  hint = message.splitlines()[-1].strip()
  res = yax.lora(mox, variables, hint)
  assert res.paths == [('conv',), ('einsum',)]


# ----------------------------------------------------------------- NNX

class NNXModel(nnx.Module):

  def __init__(self, rngs):
    self.general = nnx.LinearGeneral((2, 4), (3, 5), axis=(-2, -1), rngs=rngs)
    self.einsum = nnx.Einsum('btd,dnh->btnh', (15, 2, 3), (2, 3), rngs=rngs)
    self.conv = nnx.Conv(2, 3, (3,), rngs=rngs)

  def __call__(self, x):
    h = self.general(x)  # [b, t, 3, 5]
    h = self.einsum(jnp.tanh(h).reshape(*h.shape[:2], 15))
    return self.conv(jnp.tanh(h).reshape(*h.shape[:2], 6)[..., :2])


@pytest.mark.parametrize('name,a_shape,b_shape,subscripts', [
    ('general', (2, 4, RANK), (RANK, 3, 5), 'abr,rcd->abcd'),
    ('einsum', (15, RANK), (RANK, 2, 3), 'dr,rnh->dnh'),
    ('conv', (3, 2, RANK), (RANK, 3), 'wir,ro->wio'),
])
def test_nnx_layout(name, a_shape, b_shape, subscripts):
  model = NNXModel(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 6, 2, 4))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  res = yax.lora(mox, state, f'//module_call[@path="{name}"]', rank=RANK,
                 alpha=ALPHA, key=jax.random.key(2))
  yax.check_mox(res.mox)
  adapted = res.params[name]
  assert isinstance(adapted['lora_a'], nnx.LoRAParam)
  assert adapted['lora_a'].shape == a_shape
  assert adapted['lora_b'].shape == b_shape
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             run(state, x), **TOL)
  trained = perturbed(res)
  kernel_name = 'kernel'
  a, b = trained[name]['lora_a'][...], trained[name]['lora_b'][...]
  reference = nnx.split(model)[1]
  kernel = reference[name][kernel_name]
  kernel.value = kernel[...] + ALPHA / RANK * np.einsum(subscripts, a, b)
  want = run(reference, x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), want, **TOL)
  np.testing.assert_allclose(run(res.merge(trained), x), want, **TOL)
  check_adapter_gradients(res, trained, x)


def test_hf_gpt2_every_adapter_gets_a_gradient():
  """Hugging Face GPT-2: FlaxConv1D kernels [in, out] contracted by
  dot_general on their first axis (c_attn, c_proj, c_fc) and the head tied
  to the embedding (a call-site adapter): every adapter is on the data path
  and gets a nonzero gradient under jax.jit(jax.grad(...))."""
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2,
                      n_head=2)
  model = FlaxGPT2LMHeadModel(config, seed=0)
  ids = jnp.array([[1, 5, 7, 3, 9]])
  mox = yax.make_mox(model)(ids, params=model.params)
  res = yax.lora(mox, model.params, '//module_call[@type="FlaxConv1D" or '
                 '@type="Dense"]', rank=2, alpha=4.0)
  yax.check_mox(res.mox)
  # c_attn, c_proj (attention), c_fc, c_proj (MLP) per block, and the head.
  assert len(res.paths) == 4 * 2 + 1 and ('lm_head',) in res.paths
  np.testing.assert_allclose(
      yax.eval_mox(res.mox, ids, params=res.params).logits,
      model(ids, params=model.params).logits, **TOL)
  trained = perturbed(res)
  loss = lambda p: jnp.sum(jnp.sin(
      yax.eval_mox(res.mox, ids, params=p).logits))
  grads = jax.jit(jax.grad(loss))(trained)
  norms = {jax.tree_util.keystr(k): float(jnp.abs(g).sum())
           for (k, g), m in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                jax.tree.leaves(res.mask), strict=True) if m}
  assert len(norms) == 2 * 9
  assert all(n > 0 for n in norms.values()), norms
  # The block's adapters merge exactly (the tied head's is refused).
  blocks = yax.lora(mox, model.params, '//module_call[@type="FlaxConv1D"]',
                    rank=2, alpha=4.0)
  trained = perturbed(blocks)
  np.testing.assert_allclose(
      model(ids, params=blocks.merge(trained)).logits,
      yax.eval_mox(blocks.mox, ids, params=trained).logits, rtol=1e-4,
      atol=1e-4)


class NNXBlock(nnx.Module):

  def __init__(self, rngs):
    self.lin = nnx.Linear(6, 6, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.lin(x))


class NNXStack(nnx.Module):
  """Three blocks created by nnx.vmap and run by nnx.scan (kernels
  [3, 6, 6])."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NNXBlock(rngs)
    self.blocks = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, x):
      return block(x)
    return body(self.blocks, x)


def test_nnx_kernels_stacked_by_vmap_and_scan():
  model = NNXStack(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 6))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  res = yax.lora(mox, state, rank=RANK, alpha=ALPHA)
  yax.check_mox(res.mox)
  assert res.paths == [('blocks', 'lin')]
  lin = res.params['blocks']['lin']
  assert lin['lora_a'].shape == (3, 6, RANK)
  assert lin['lora_b'].shape == (3, RANK, 6)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             run(state, x), **TOL)
  trained = perturbed(res)
  a, b = trained['blocks']['lin']['lora_a'][...], trained['blocks']['lin'][
      'lora_b'][...]
  reference = nnx.split(model)[1]
  kernel = reference['blocks']['lin']['kernel']
  kernel.value = kernel[...] + ALPHA / RANK * np.einsum('lir,lro->lio', a, b)
  want = run(reference, x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), want, **TOL)
  np.testing.assert_allclose(run(res.merge(trained), x), want, **TOL)
  check_adapter_gradients(res, trained, x)


class TiedLM(nn.Module):
  """A head run by a nested apply on the transposed embedding (Hugging
  Face's tied heads): its call has no path."""

  def setup(self):
    self.embed = nn.Embed(11, 6)
    self.mid = nn.Dense(6)
    self.lm_head = nn.Dense(11, use_bias=False)

  def __call__(self, ids):
    h = jnp.tanh(self.mid(self.embed(ids)))
    table = self.embed.variables['params']['embedding']
    return self.lm_head.apply({'params': {'kernel': table.T}}, h)


def test_merge_and_quantize_refusals_end_with_one_xpath_for_the_others():
  model = TiedLM()
  ids = jnp.array([[1, 2, 3, 9]])
  variables = model.init(jax.random.key(0), ids)
  mox = yax.make_mox(model.apply)(variables, ids)
  selection = '//module_call[@type="Dense"]'
  res = yax.lora(mox, variables, selection, rank=RANK, alpha=ALPHA)
  assert res.paths == [('lm_head',), ('mid',)]
  with pytest.raises(yax.SubstitutionError) as info:
    res.merge(perturbed(res))
  others = str(info.value).splitlines()[-1].strip()
  # The XPath leaves out the nested-apply head and keeps the others.
  assert [n.path for n in yax.query(others, mox)] == [('mid',)]
  res = yax.lora(mox, variables, others, rank=RANK, alpha=ALPHA)
  trained = perturbed(res)
  t = trained['params']['mid']
  want = model.apply(put(variables, ('params', 'mid', 'kernel'),
                         variables['params']['mid']['kernel'] + ALPHA / RANK *
                         np.einsum('ir,ro->io', t['lora_a'], t['lora_b'])),
                     ids)
  np.testing.assert_allclose(model.apply(res.merge(trained), ids), want,
                             **TOL)
  with pytest.raises(yax.SubstitutionError) as info:
    yax.quantize(mox, variables, selection)
  others = str(info.value).splitlines()[-1].strip()
  assert yax.quantize(mox, variables, others).paths == [('mid',)]


# ------------------------------------------------- kernels adapted in place

class NNXExperts(nnx.Module):
  """MaxText's RoutedMoE dense path, shrunk: three expert kernels
  [experts, in, out] in one call, between the routing weights and an
  activation, so no adapter fits around the call."""

  def __init__(self, rngs, experts=3, d=4, h=5):
    init = lambda *s: nnx.Param(jax.random.normal(rngs.params(), s) * 0.3)
    self.wi_0, self.wi_1, self.wo = init(experts, d, h), init(
        experts, d, h), init(experts, h, d)
    self.gate = nnx.Linear(d, experts, rngs=rngs)

  def __call__(self, x):  # [b, s, d]
    weights = jax.nn.softmax(self.gate(x))  # [b, s, e]
    a = jnp.einsum('bsd,edh->bseh', x, self.wi_0[...])
    b = jnp.einsum('bsd,edh->bseh', x, self.wi_1[...])
    y = jnp.einsum('bseh,ehd->bsed', jax.nn.silu(a) * b, self.wo[...])
    return jnp.einsum('bsed,bse->bsd', y, weights)


def test_every_kernel_of_a_call_is_adapted_in_place_one_pair_per_expert():
  model = NNXExperts(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 3, 4))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  res = yax.lora(mox, state, '//module_call[@type="NNXExperts"]', rank=RANK,
                 alpha=ALPHA, key=jax.random.key(2))
  yax.check_mox(res.mox)
  assert res.paths == [()]
  base = run(state, x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x), base,
                             **TOL)
  trained = perturbed(res)
  reference = nnx.split(model)[1]
  for name in ('wi_0', 'wi_1', 'wo'):
    a, b = trained[f'{name}_lora_a'], trained[f'{name}_lora_b']
    assert isinstance(a, nnx.LoRAParam) and isinstance(b, nnx.LoRAParam)
    experts, n_in, n_out = state[name][...].shape
    assert a.shape == (experts, n_in, RANK)
    assert b.shape == (experts, RANK, n_out)
    reference[name].value = reference[name][...] + ALPHA / RANK * np.einsum(
        'eir,ero->eio', a[...], b[...])
  want = run(reference, x)
  assert not np.allclose(want, base, **TOL)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), want, **TOL)
  np.testing.assert_allclose(run(res.merge(trained), x), want, **TOL)
  check_adapter_gradients(res, trained, x)


class GatedMLP(nn.Module):
  """Two kernels and an activation in one Linen call."""

  @nn.compact
  def __call__(self, x):
    up = self.param('up', nn.initializers.normal(0.5), (x.shape[-1], 6))
    down = self.param('down', nn.initializers.normal(0.5), (6, x.shape[-1]))
    return jnp.tanh(jnp.tanh(x @ up) @ down)


def test_linen_kernels_behind_an_activation_are_adapted_in_place():
  model = GatedMLP()
  x = jax.random.normal(jax.random.key(0), (3, 4))
  variables = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(variables, x)
  res = yax.lora(mox, variables, '//module_call[@type="GatedMLP"]',
                 rank=RANK, alpha=ALPHA, key=jax.random.key(2))
  yax.check_mox(res.mox)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x),
                             model.apply(variables, x), **TOL)
  trained = perturbed(res)
  p = trained['params']
  assert p['up_lora_a'].shape == (4, RANK) and p['up_lora_b'].shape == (
      RANK, 6)
  want = model.apply({'params': {
      'up': p['up'] + ALPHA / RANK * p['up_lora_a'] @ p['up_lora_b'],
      'down': p['down'] + ALPHA / RANK * p['down_lora_a'] @ p['down_lora_b'],
  }}, x)
  np.testing.assert_allclose(yax.eval_mox(res.mox, trained, x), want, **TOL)
  np.testing.assert_allclose(model.apply(res.merge(trained), x), want, **TOL)
  check_adapter_gradients(res, trained, x)


class RaggedExperts(nnx.Module):
  """Experts behind ``jax.lax.ragged_dot`` (Gemma 4's MoE): the rows come
  sorted by expert, ``group_sizes`` rows each, every group times its own
  slice of the kernels [experts, in, out]."""

  def __init__(self, rngs, experts=3, d=4, h=5):
    init = lambda *s: nnx.Param(jax.random.normal(rngs.params(), s) * 0.3)
    self.gating = init(experts, d, h)
    self.linear = init(experts, h, d)

  def __call__(self, x, group_sizes):  # x: [tokens, d], sorted by expert
    h = jax.nn.gelu(jax.lax.ragged_dot(x, self.gating[...], group_sizes))
    return jax.lax.ragged_dot(h, self.linear[...], group_sizes)


def test_ragged_dot_experts_are_adapted_in_place_one_pair_per_group():
  model = RaggedExperts(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (7, 4))
  group_sizes = jnp.array([3, 0, 4], jnp.int32)
  graphdef, state = nnx.split(model)
  run = lambda s, x, g: nnx.merge(graphdef, s)(x, g)
  mox = yax.make_mox(run)(state, x, group_sizes)
  res = yax.lora(mox, state, '//module_call[@type="RaggedExperts"]',
                 rank=RANK, alpha=ALPHA, key=jax.random.key(2))
  yax.check_mox(res.mox)
  base = run(state, x, group_sizes)
  np.testing.assert_allclose(yax.eval_mox(res.mox, res.params, x,
                                          group_sizes), base, **TOL)
  trained = perturbed(res)
  reference = nnx.split(model)[1]
  for name in ('gating', 'linear'):
    a, b = trained[f'{name}_lora_a'][...], trained[f'{name}_lora_b'][...]
    experts, n_in, n_out = state[name][...].shape
    assert a.shape == (experts, n_in, RANK) and b.shape == (
        experts, RANK, n_out)
    reference[name].value = reference[name][...] + ALPHA / RANK * np.einsum(
        'gir,gro->gio', a, b)
  want = run(reference, x, group_sizes)
  assert not np.allclose(want, base, **TOL)
  np.testing.assert_allclose(
      yax.eval_mox(res.mox, trained, x, group_sizes), want, **TOL)
  np.testing.assert_allclose(run(res.merge(trained), x, group_sizes), want,
                             **TOL)
  check_adapter_gradients(res, trained, x, group_sizes)
