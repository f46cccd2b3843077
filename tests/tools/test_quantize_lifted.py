"""``yax.quantize`` and ``yax.cast`` inside the bodies of lifted transforms
(``nn.jit``, ``nn.remat``, ``nn.scan``, ``nn.vmap``, ``nnx.scan``,
``nnx.remat``, ``nnx.jit``), against plain Flax on the same values.

The reference quantizer here is written independently of ``yax``: absmax
scales per output channel (or per ``tile`` contracted elements), computed
per slice of a stacked kernel, then the model is run by Flax itself on the
reference-dequantized kernels.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import yax
from test_lora_layouts import NNXBlock, NNXStack
from yax._src.rewrite.quant_formats import NF4_LEVELS

FORMATS = ('int8', 'int4', 'fp8', 'nf4')
# The 16 NormalFloat levels of QLoRA (Dettmers et al. 2023, appendix E):
# data of the format, not a computation under test.
NF4 = NF4_LEVELS
TOP = {'int8': 127.0, 'int4': 7.0, 'fp8': 448.0, 'nf4': 1.0}
TOL = dict(rtol=1e-5, atol=1e-5)


def fake_quant_2d(w, fmt, tile=None):
  """A [in, out] kernel quantized and dequantized: scales over ``in`` (or
  each ``tile`` rows of it), per output column."""
  w = np.asarray(w, np.float32)
  n_in, n_out = w.shape
  groups = w.reshape(n_in // (tile or n_in), tile or n_in, n_out)
  absmax = np.abs(groups).max(axis=1, keepdims=True)
  scale = np.where(absmax > 0, absmax / TOP[fmt], 1.0).astype(np.float32)
  x = groups / scale
  if fmt == 'nf4':
    codes = NF4[np.abs(x[..., None] - NF4).argmin(-1)]
  elif fmt == 'fp8':
    codes = np.asarray(jnp.asarray(x).astype(jnp.float8_e4m3fn), np.float32)
  else:
    top = TOP[fmt]  # symmetric absmax: codes -top .. top
    codes = np.clip(np.round(x), -top, top)
  return (codes * scale).reshape(n_in, n_out)


def fake_quant(w, fmt, tile=None):
  """``fake_quant_2d`` on each [in, out] slice of a stacked kernel."""
  w = np.asarray(w)
  if w.ndim == 2:
    return fake_quant_2d(w, fmt, tile)
  return np.stack([fake_quant(s, fmt, tile) for s in w])


def act_quant(x):
  """int8 activations, one absmax scale per row (the last axis)."""
  x = np.asarray(x, np.float32)
  absmax = np.abs(x).max(-1, keepdims=True)
  scale = np.where(absmax > 0, absmax / 127.0, 1.0)
  return np.clip(np.round(x / scale), -127, 127) * scale


# ------------------------------------------------------------------ Linen

class Inner(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(8, name='d')(x))


class Lifted(nn.Module):
  """One Dense inside a lifted transform of ``kind``."""
  kind: str

  @nn.compact
  def __call__(self, x):
    if self.kind == 'jit':
      return nn.jit(Inner)(name='b')(x)
    if self.kind == 'remat':
      return nn.remat(Inner)(name='b')(x)
    if self.kind == 'scan':
      body = nn.scan(lambda m, c, _: (m(c), None),
                     variable_axes={'params': 0},
                     split_rngs={'params': True}, length=3)
      return body(Inner(name='b'), x, None)[0]
    assert self.kind == 'vmap'
    return nn.vmap(Inner, variable_axes={'params': 0},
                   split_rngs={'params': True}, in_axes=0)(name='b')(x)


def _linen(kind):
  model = Lifted(kind)
  shape = (2, 4, 8) if kind == 'vmap' else (4, 8)
  x = jax.random.normal(jax.random.key(1), shape)
  variables = model.init(jax.random.key(0), x)
  return model, variables, x


def _with_kernel(variables, kernel):
  params = jax.tree_util.tree_map(lambda v: v, variables)
  params['params']['b']['d']['kernel'] = jnp.asarray(kernel)
  return params


@pytest.mark.parametrize('kind', ['jit', 'remat', 'scan', 'vmap'])
@pytest.mark.parametrize('weight', FORMATS)
def test_linen_lifted_quantize(kind, weight):
  model, variables, x = _linen(kind)
  mox = yax.make_mox(model.apply)(variables, x)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense"]',
                   weight=weight)
  kernel = variables['params']['b']['d']['kernel']
  reference = _with_kernel(variables, fake_quant(kernel, weight))
  want = model.apply(reference, x)
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x), want, **TOL)
  stored = q.params['params']['b']['d']
  assert stored['kernel'].shape == kernel.shape
  assert stored['kernel'].dtype != kernel.dtype
  # One scale per output channel of each slice of a stacked kernel.
  assert stored['kernel_scale'].shape == (*kernel.shape[:-2], 1, 8)
  np.testing.assert_allclose(
      q.dequantize(q.params)['params']['b']['d']['kernel'],
      reference['params']['b']['d']['kernel'], **TOL)
  yax.check_mox(q.mox)


@pytest.mark.parametrize('kind', ['jit', 'scan'])
def test_linen_lifted_quantize_tiles(kind):
  model, variables, x = _linen(kind)
  mox = yax.make_mox(model.apply)(variables, x)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense"]',
                   weight='int4', tile=4)
  kernel = variables['params']['b']['d']['kernel']
  want = model.apply(_with_kernel(variables, fake_quant(kernel, 'int4', 4)),
                     x)
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x), want, **TOL)


@pytest.mark.parametrize('kind', ['jit', 'remat', 'scan'])
def test_linen_lifted_quantize_activations(kind):
  model, variables, x = _linen(kind)
  mox = yax.make_mox(model.apply)(variables, x)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense"]',
                   weight='int8', act='int8')
  params = variables['params']['b']['d']
  kernels = fake_quant(params['kernel'], 'int8')
  h = np.asarray(x)
  for i in range(3 if kind == 'scan' else 1):
    k = kernels[i] if kind == 'scan' else kernels
    b = params['bias'][i] if kind == 'scan' else params['bias']
    h = np.tanh(act_quant(h) @ k + b)
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x), h,
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('kind', ['jit', 'remat', 'scan'])
def test_linen_lifted_qat_gradient_is_straight_through(kind):
  model, variables, x = _linen(kind)
  mox = yax.make_mox(model.apply)(variables, x)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense"]',
                   weight='int8', mode='qat')
  kernel = variables['params']['b']['d']['kernel']
  reference = _with_kernel(variables, fake_quant(kernel, 'int8'))
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x),
                             model.apply(reference, x), **TOL)
  got = jax.grad(lambda p: yax.eval_mox(q.mox, p, x).sum())(variables)
  # Straight-through: the gradient of the float model at the quantized
  # kernel.
  want = jax.grad(lambda p: model.apply(p, x).sum())(reference)
  np.testing.assert_allclose(got['params']['b']['d']['kernel'],
                             want['params']['b']['d']['kernel'],
                             rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('kind', ['jit', 'remat', 'scan', 'vmap'])
def test_linen_lifted_cast(kind):
  model, variables, x = _linen(kind)
  mox = yax.make_mox(model.apply)(variables, x)
  low = yax.cast(mox, '//module_call[@type="Dense"]', 'bfloat16')
  yax.check_mox(low)
  got = yax.eval_mox(low, variables, x)
  params = variables['params']['b']['d']
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  h = x
  for i in range(3 if kind == 'scan' else 1):
    k = params['kernel'][i] if kind == 'scan' else params['kernel']
    b = params['bias'][i] if kind == 'scan' else params['bias']
    if kind == 'vmap':
      y = jnp.einsum('bni,bio->bno', bf(h), bf(k)) + bf(b)[:, None]
    else:
      y = bf(h) @ bf(k) + bf(b)
    h = jnp.tanh(y.astype(jnp.float32))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, h, rtol=1e-6, atol=1e-6)


# -------------------------------------------------------------------- NNX

class RematJit(nnx.Module):
  """One Linear under nnx.remat, one under nnx.jit."""

  def __init__(self, rngs):
    self.a = NNXBlock(rngs)
    self.b = NNXBlock(rngs)

  def __call__(self, x):
    x = nnx.remat(lambda m, x: m(x))(self.a, x)
    return nnx.jit(lambda m, x: m(x))(self.b, x)


def _nnx_kernels(state):
  """Key paths (in the state) and values of every Linear kernel."""
  flat = nnx.to_flat_state(state)
  return {path: var for path, var in flat if path[-1] == 'kernel'}


@pytest.mark.parametrize('make', [NNXStack, RematJit])
@pytest.mark.parametrize('weight', FORMATS)
def test_nnx_lifted_quantize(make, weight):
  model = make(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 6))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  q = yax.quantize(mox, state, '//module_call[@type="Linear"]',
                   weight=weight)
  reference = nnx.split(make(nnx.Rngs(0)))[1]
  for path, var in _nnx_kernels(reference).items():
    var.value = jnp.asarray(fake_quant(var[...], weight))
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x),
                             run(reference, x), **TOL)
  for path, var in _nnx_kernels(q.params).items():
    assert var[...].dtype != jnp.float32
  back = q.dequantize(q.params)
  for (path, var), (_, want) in zip(_nnx_kernels(back).items(),
                                    _nnx_kernels(reference).items(),
                                    strict=True):
    np.testing.assert_allclose(var[...], want[...], **TOL)


@pytest.mark.parametrize('make', [NNXStack, RematJit])
def test_nnx_lifted_cast(make):
  model = make(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 6))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  low = yax.cast(mox, '//module_call[@type="Linear"]', 'bfloat16')
  got = yax.eval_mox(low, state, x)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  h = x
  blocks = ([jax.tree_util.tree_map(lambda v, i=i: v[i], model.blocks)
             for i in range(3)] if make is NNXStack else [model.a, model.b])
  for block in blocks:
    y = bf(h) @ bf(block.lin.kernel[...]) + bf(block.lin.bias[...])
    h = jnp.tanh(y.astype(jnp.float32))
  np.testing.assert_allclose(got, h, rtol=1e-6, atol=1e-6)
