"""``yax.quantize``'s scale groups, layout by layout, against the SPEC's
rule computed here with plain ``jnp``.

The SPEC: symmetric absmax scales per output channel, or per ``tile``
elements of the contracted axes (flattened in kernel order). So a group is
one output channel (one index of every kernel axis the contraction does
not contract, and one slice of a stacked kernel), and all of the
contracted axes, or ``tile`` consecutive elements of them in kernel order.
Each test names the contracted axes of its kernel from the model's own
definition (not from YAX's kernel plan), computes every scale, code and
dequantized value from those axes alone, and checks the quantized tree's
params, ``.dequantize`` and forward pass against them exactly.

Formats (the SPEC's names and its symmetric absmax convention):

* ``int8``/``int4``: ``scale = absmax / qmax``, codes
  ``clip(round(w / scale), -qmax, qmax)`` (qmax 127, 7), rounding half
  to even, so ``q(-w) = -q(w)``;
* ``fp8``: ``w / scale`` cast to ``float8_e4m3fn``, ``scale = absmax /
  448``;
* ``nf4``: the nearest of the 16 NormalFloat levels to ``w / absmax``.

A group of zeros gets scale 1.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import yax
from yax._src.rewrite.quant_formats import NF4_LEVELS

# The 16 NormalFloat levels (QLoRA, appendix E): data of the format.
NF4 = jnp.asarray(NF4_LEVELS)
TOP = {'int8': 127.0, 'int4': 7.0, 'fp8': 448.0, 'nf4': 1.0}
STORAGE = {'int8': jnp.int8, 'int4': jnp.int4, 'fp8': jnp.float8_e4m3fn,
           'nf4': jnp.uint4}


def quantize_groups(w, fmt):
  """``(codes, scale)`` of ``w: [groups, group size]``, one absmax scale
  per row (``scale: [groups, 1]``)."""
  top = TOP[fmt]
  if fmt in ('int8', 'int4') and not isinstance(w, jax.core.Tracer):
    # Stored kernels, in NumPy: IEEE division, as the SPEC writes it
    # (XLA's CPU division is one ulp off on a few percent of values; a
    # QAT tree, traced, divides as XLA does, like the jnp below).
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(1, keepdims=True) / np.float32(top)
    scale = np.where(scale > 0, scale, np.float32(1))
    return (jnp.asarray(np.clip(np.round(w / scale), -top, top)),
            jnp.asarray(scale))
  w = jnp.asarray(w, jnp.float32)
  absmax = jnp.max(jnp.abs(w), axis=1, keepdims=True)
  scale = jnp.where(absmax > 0, absmax / top, jnp.float32(1))
  if fmt == 'nf4':
    return jnp.argmin(jnp.abs((w / scale)[..., None] - NF4), -1), scale
  if fmt == 'fp8':
    return (w / scale).astype(jnp.float8_e4m3fn), scale
  return jnp.clip(jnp.round(w / scale), -top, top), scale


def decode(codes, fmt):
  if fmt == 'nf4':
    return NF4[codes]
  return jnp.asarray(codes, jnp.float32)


def spec_quantize(w, fmt, contracted, tile=None, stack=0):
  """What the SPEC asks of kernel ``w``: ``(codes, scale, dequantized)``,
  codes and dequantized values in ``w``'s shape, ``scale`` in the stored
  layout: ``w``'s shape with the contracted axes of size 1, or, tiled,
  ``[tiles, 1, *output axes]``; a stacked kernel (``stack`` leading axes,
  not counted in ``contracted``) has one such set per slice."""
  w = jnp.asarray(w, jnp.float32)
  if stack:
    codes, scale, deq = zip(*(spec_quantize(s, fmt, contracted, tile,
                                            stack - 1) for s in w))
    return jnp.stack(codes), jnp.stack(scale), jnp.stack(deq)
  out_axes = [i for i in range(w.ndim) if i not in contracted]
  order = [*contracted, *out_axes]  # contracted axes first, kernel order
  moved = jnp.transpose(w, order)
  k = math.prod(w.shape[i] for i in contracted)
  outs = moved.shape[len(contracted):]
  size = tile or k  # elements per group
  # rows: (tile index, output channel); columns: the tile's elements
  groups = moved.reshape(k // size, size, -1).transpose(0, 2, 1)
  codes, scale = quantize_groups(groups.reshape(-1, size), fmt)
  codes = codes.reshape(k // size, -1, size).transpose(0, 2, 1)
  scale = scale.reshape(k // size, 1, -1)
  deq = decode(codes, fmt) * scale

  def back(a):
    return jnp.transpose(a.reshape(moved.shape), np.argsort(order))
  if tile is None:  # the contracted axes kept, of size 1
    stored = jnp.transpose(scale.reshape(1, *(1,) * (len(contracted) - 1),
                                         *outs), np.argsort(order))
  else:
    stored = scale.reshape(k // tile, 1, *outs)
  return back(codes), stored, back(deq)


def get(tree, keys):
  for k in keys:
    tree = tree[k]
  return tree


def put(tree, keys, value):
  tree = jax.tree_util.tree_map(lambda a: a, tree)
  get(tree, keys[:-1])[keys[-1]] = value
  return tree


def check_kernel(q, params, keys, fmt, contracted, tile=None, stack=0):
  """The quantized params at ``keys`` (a kernel's key path) hold the
  SPEC's codes and scales; ``.dequantize`` gives its dequantized kernel.
  Returns that kernel."""
  w = get(params, keys)
  codes, scale, deq = spec_quantize(w, fmt, contracted, tile, stack)
  stored = get(q.params, keys)
  assert stored.dtype == STORAGE[fmt]
  got_scale = get(q.params, (*keys[:-1], f'{keys[-1]}_scale'))
  assert got_scale.dtype == jnp.float32
  np.testing.assert_array_equal(got_scale, scale)
  if fmt == 'fp8':
    np.testing.assert_array_equal(stored.astype(jnp.float32),
                                  codes.astype(jnp.float32))
  else:
    np.testing.assert_array_equal(stored.astype(jnp.int32),
                                  codes.astype(jnp.int32))
  np.testing.assert_array_equal(get(q.dequantize(q.params), keys), deq)
  return deq


FORMATS = ['int8', 'int4', 'fp8', 'nf4']


class Mixed(nn.Module):
  """Dense, two-axis DenseGeneral, a Gemma-style Einsum contracting two
  axes of its kernel, and Conv in one model."""

  @nn.compact
  def __call__(self, x, img):
    h = jnp.tanh(nn.Dense(6, name='dense')(x))  # [2, 5, 6]
    h = nn.DenseGeneral((3, 4), axis=(-2, -1), name='general')(
        h.reshape(2, 5, 2, 3))  # [2, 5, 3, 4]
    h = nn.Einsum((2, 3, 4, 5), 'btnh,mnhd->btmd', name='einsum')(h)
    return h, nn.Conv(4, (3, 3), name='conv')(img)


# (key path, contracted axes, leading stacking axes) of each kernel of
# Mixed, read off the modules: Dense's kernel [in=4, out=6] contracts in;
# DenseGeneral's [2, 3, 3, 4] its first two axes (flattened in kernel order,
# a tile of 2 crosses the rows of the second); the Einsum's [m=2, n=3, h=4,
# d=5] n and h; the Conv's [3, 3, in=2, out=4] its window and input
# features.
MIXED_KERNELS = [(('params', 'dense', 'kernel'), (0,), 0),
                 (('params', 'general', 'kernel'), (0, 1), 0),
                 (('params', 'einsum', 'kernel'), (1, 2), 0),
                 (('params', 'conv', 'kernel'), (0, 1, 2), 0)]
MIXED_XPATH = ('//module_call[@type="Dense" or @type="DenseGeneral" or '
               '@type="Einsum" or @type="Conv"]')


def mixed():
  x = jax.random.normal(jax.random.key(0), (2, 5, 4))
  img = jax.random.normal(jax.random.key(1), (1, 5, 5, 2))
  return Mixed(), Mixed().init(jax.random.key(2), x, img), (x, img)


def check_ptq(fn, params, args, xpath, kernels, fmt, tile=None):
  """Quantizes the calls of ``fn`` selected by ``xpath``; ``kernels``:
  (key path in ``params``, contracted axes, leading stacking axes) per
  kernel.
  The quantized tree computes ``fn`` on the SPEC's dequantized kernels."""
  mox = yax.make_mox(fn)(params, *args)
  q = yax.quantize(mox, params, xpath, weight=fmt, tile=tile)
  yax.check_mox(q.mox)
  at = params
  for keys, contracted, stack in kernels:
    at = put(at, keys, check_kernel(q, params, keys, fmt, contracted, tile,
                                    stack))
  for g, w in zip(jax.tree_util.tree_leaves(yax.eval_mox(q.mox, q.params,
                                                         *args)),
                  jax.tree_util.tree_leaves(fn(at, *args)), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  return q


# ----------------------------------------------------------------- layouts

@pytest.mark.parametrize('fmt,tile', [*((f, None) for f in FORMATS),
                                      ('int8', 2), ('nf4', 2)])
def test_dense_densegeneral_einsum_conv(fmt, tile):
  model, variables, args = mixed()
  check_ptq(model.apply, variables, args, MIXED_XPATH, MIXED_KERNELS, fmt,
            tile)


def test_tiles_run_in_kernel_order():
  """tile=3 on DenseGeneral's [2, 3, 3, 4] kernel: the 6 contracted
  elements of a channel, flattened in kernel order, make two tiles, one per
  row of the second axis; tile=6 is one scale per channel, stored as one
  tile."""
  model, variables, args = mixed()
  for tile in (3, 6):
    q = check_ptq(model.apply, variables, args,
                  '//module_call[@type="DenseGeneral"]', MIXED_KERNELS[1:2],
                  'int4', tile)
  assert q.params['params']['general']['kernel_scale'].shape == (1, 1, 3, 4)


class Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    body = nn.scan(lambda m, c, _: (jnp.tanh(m(c)), None),
                   variable_axes={'params': 0},
                   split_rngs={'params': True}, length=3)
    return body(nn.Dense(8, name='d'), x, None)[0]


class Vmapped(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.vmap(nn.Dense, variable_axes={'params': 0},
                   split_rngs={'params': True}, in_axes=0)(6, name='d')(x)


def stacked(module):
  """(model, variables, x, kernels): nn.scan stacks the kernel [3, in=8,
  out=8] on axis 0 and each scan step reads its slice; nn.vmap stacks
  [2, in=8, out=6] on axis 0, a batch axis of its contraction. Either way
  each slice has its own scales."""
  x = jax.random.normal(jax.random.key(1), (2, 3, 8))
  if module is Scanned:
    x, kernels = x[0], [(('params', 'd', 'kernel'), (0,), 1)]
  else:
    kernels = [(('params', 'd', 'kernel'), (1,), 0)]
  return module(), module().init(jax.random.key(0), x), x, kernels


@pytest.mark.parametrize('module', [Scanned, Vmapped])
@pytest.mark.parametrize('fmt,tile', [('int8', None), ('nf4', 4)])
def test_stacked_kernels_per_slice(module, fmt, tile):
  model, variables, x, kernels = stacked(module)
  check_ptq(model.apply, variables, (x,), '//module_call[@type="Dense"]',
            kernels, fmt, tile)


class NNXModel(nnx.Module):
  """nnx.Linear and nnx.Einsum, the Linears in an nnx.List (their state
  key paths hold the int index of the list)."""

  def __init__(self, rngs):
    self.blocks = nnx.List([nnx.Linear(8, 12, rngs=rngs),
                            nnx.Linear(12, 12, rngs=rngs)])
    self.ein = nnx.Einsum('btd,ndh->btnh', (3, 12, 4), rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = jnp.tanh(block(x))
    return self.ein(x)


@pytest.mark.parametrize('fmt,tile', [('int8', None), ('int4', 4)])
def test_nnx_linear_and_einsum(fmt, tile):
  graphdef, state = nnx.split(NNXModel(nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  fn = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(fn)(state, x)
  q = yax.quantize(mox, state, '//module_call[@type="Linear" or '
                   '@type="Einsum"]', weight=fmt, tile=tile)
  ref = nnx.to_pure_dict(state)
  got = nnx.to_pure_dict(q.params)
  for keys, contracted in ((('blocks', 0, 'kernel'), (0,)),
                           (('blocks', 1, 'kernel'), (0,)),
                           (('ein', 'kernel'), (1,))):
    codes, scale, deq = spec_quantize(get(ref, keys), fmt, contracted, tile)
    np.testing.assert_array_equal(get(got, (*keys[:-1], 'kernel_scale')),
                                  scale)
    np.testing.assert_array_equal(get(got, keys).astype(jnp.int32),
                                  codes.astype(jnp.int32))
    ref = put(ref, keys, deq)
  want_state = jax.tree_util.tree_map(lambda a: a, state)
  nnx.replace_by_pure_dict(want_state, ref)
  np.testing.assert_allclose(yax.eval_mox(q.mox, q.params, x),
                             fn(want_state, x), rtol=1e-6, atol=1e-6)


class Tied(nn.Module):
  """A tied head: Embed.attend contracts the table [vocab=10, emb=6] over
  emb (axis 1), one scale per vocabulary row; the lookup reads the same
  (dequantized) table."""

  @nn.compact
  def __call__(self, ids):
    emb = nn.Embed(10, 6, name='embed')
    return emb.attend(jnp.tanh(emb(ids)))


TIED_KERNELS = [(('params', 'embed', 'embedding'), (1,), 0)]


@pytest.mark.parametrize('fmt,tile', [('int8', None), ('nf4', 3)])
def test_tied_embedding_table(fmt, tile):
  ids = jnp.array([[1, 2, 3, 9]])
  variables = Tied().init(jax.random.key(0), ids)
  check_ptq(Tied().apply, variables, (ids,), '//module_call[@method="attend"]',
            TIED_KERNELS, fmt, tile)


# (module path in the GPT-2 params, kernel [out, in])
GPT2_CONV1D = [('h', '0', 'attn', 'c_attn'), ('h', '0', 'attn', 'c_proj'),
               ('h', '0', 'mlp', 'c_fc'), ('h', '0', 'mlp', 'c_proj')]


def gpt2():
  from transformers import FlaxGPT2Model, GPT2Config
  config = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1,
                      n_head=2)
  model = FlaxGPT2Model(config, seed=0)
  fn = lambda p, ids: model(ids, params=p).last_hidden_state
  return fn, model.params, jnp.array([[1, 5, 7, 3, 9, 2]])


@pytest.mark.parametrize('fmt,tile', [('int8', None), ('int4', 8)])
def test_hf_gpt2_transposed_kernel(fmt, tile):
  """HF GPT-2's FlaxConv1D stores its kernel [out, in] and contracts the
  transpose: the contracted axis is the kernel's LAST one, one scale per
  row (output feature), tiles run along a row."""
  fn, params, ids = gpt2()
  q = check_ptq(fn, params, (ids,), '//module_call[@type="FlaxConv1D"]',
                [((*path, 'kernel'), (1,), 0) for path in GPT2_CONV1D], fmt,
                tile)
  assert sorted(q.paths) == sorted(GPT2_CONV1D)


@settings(max_examples=6, deadline=None)
@given(st.data())
def test_dense_general_any_contracted_axes(data):
  """DenseGeneral over random input shapes and contracted axes, tiled or
  not: the scales are the SPEC's."""
  ndim = data.draw(st.integers(2, 4), label='ndim')
  shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=ndim,
                                   max_size=ndim), label='shape'))
  axis = tuple(sorted(data.draw(st.sets(
      st.integers(1, ndim - 1), min_size=1, max_size=ndim - 1),
      label='axis')))
  features = tuple(data.draw(st.lists(st.integers(1, 3), min_size=1,
                                      max_size=2), label='features'))
  k = math.prod(shape[a] for a in axis)
  tile = data.draw(st.sampled_from(
      [None, *(t for t in range(1, k + 1) if k % t == 0)]), label='tile')
  fmt = data.draw(st.sampled_from(FORMATS), label='fmt')
  x = jax.random.normal(jax.random.key(1), shape)
  model = nn.DenseGeneral(features, axis=axis)
  check_ptq(model.apply, model.init(jax.random.key(0), x), (x,),
            '//module_call[@type="DenseGeneral"]',
            [(('params', 'kernel'), tuple(range(len(axis))), 0)], fmt, tile)


# -------------------------------------------------------------------- QAT
# mode='qat': the forward pass reads each kernel fake-quantized, fq(w) =
# the SPEC's dequantized kernel; the gradient is straight-through, d fq / d w
# = identity, so the gradient of every param is the float model's gradient
# at the fake-quantized kernels.

def loss_of(out):
  """A loss whose gradient depends on the kernels' values."""
  return lambda *a: sum(jnp.sum(jnp.sin(y)) for y in
                        jax.tree_util.tree_leaves(out(*a)))


def check_qat(fn, params, args, xpath, kernels, fmt, tile=None):
  """``kernels``: (key path in ``params``, contracted axes, stack)."""
  mox = yax.make_mox(fn)(params, *args)
  q = yax.quantize(mox, params, xpath, weight=fmt, tile=tile, mode='qat')
  assert q.params is params
  at = params
  for keys, contracted, stack in kernels:
    _, _, deq = spec_quantize(get(params, keys), fmt, contracted, tile,
                              stack)
    at = put(at, keys, deq)
  got_y = yax.eval_mox(q.mox, params, *args)
  for g, w in zip(jax.tree_util.tree_leaves(got_y),
                  jax.tree_util.tree_leaves(fn(at, *args)), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  got = jax.grad(loss_of(lambda p: yax.eval_mox(q.mox, p, *args)))(params)
  want = jax.grad(loss_of(lambda p: fn(p, *args)))(at)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize('fmt,tile', [('int8', None), ('nf4', None),
                                      ('int4', 2)])
def test_qat_gradient_is_straight_through(fmt, tile):
  model, variables, args = mixed()
  check_qat(model.apply, variables, args, MIXED_XPATH, MIXED_KERNELS, fmt,
            tile)


@pytest.mark.parametrize('module', [Scanned, Vmapped])
def test_qat_gradient_is_straight_through_per_slice(module):
  model, variables, x, kernels = stacked(module)
  check_qat(model.apply, variables, (x,), '//module_call[@type="Dense"]',
            kernels, 'int4')


def test_qat_gradient_is_straight_through_on_hf_gpt2():
  fn, params, ids = gpt2()
  check_qat(fn, params, (ids,), '//module_call[@type="FlaxConv1D"]',
            [((*path, 'kernel'), (1,), 0) for path in GPT2_CONV1D], 'fp8')


def test_qat_gradient_is_straight_through_on_a_tied_table():
  """The lookup and the head both read the fake-quantized table; its
  gradient sums both reads' at the fake-quantized table."""
  ids = jnp.array([[1, 2, 3, 9]])
  variables = Tied().init(jax.random.key(0), ids)
  check_qat(Tied().apply, variables, (ids,),
            '//module_call[@method="attend"]', TIED_KERNELS, 'int4', 2)


def test_qat_gradient_is_straight_through_on_nnx():
  graphdef, state = nnx.split(NNXModel(nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  fn = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(fn)(state, x)
  q = yax.quantize(mox, state, '//module_call[@type="Linear" or '
                   '@type="Einsum"]', weight='int4', mode='qat')
  at = jax.tree_util.tree_map(lambda a: a, state)
  for keys, contracted in ((('blocks', 0, 'kernel'), (0,)),
                           (('blocks', 1, 'kernel'), (0,)),
                           (('ein', 'kernel'), (1,))):
    variable = get(at, keys)
    variable.value = spec_quantize(variable[...], 'int4', contracted)[2]
  loss = lambda f: lambda s: jnp.sum(jnp.sin(f(s)))
  got = jax.grad(loss(lambda s: yax.eval_mox(q.mox, s, x)))(state)
  want = jax.grad(loss(lambda s: fn(s, x)))(at)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


def test_qat_with_act_is_straight_through_for_both_operands():
  """act='int8': the input is fake-quantized per row too; the gradients
  of the params AND of the input pass both roundings unchanged (compared
  with ``v + stop_gradient(fq(v) - v)`` written here)."""
  model = nn.Dense(6)
  x = jax.random.normal(jax.random.key(1), (4, 8))
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  q = yax.quantize(mox, variables, '//module_call[@type="Dense"]',
                   weight='int8', act='int8', mode='qat')

  def straight_through(v, contracted):
    return v + jax.lax.stop_gradient(
        spec_quantize(v, 'int8', contracted)[2] - v)

  def want(p, x):
    p = p['params']
    return jnp.sum(jnp.sin(straight_through(x, (1,)) @ straight_through(
        p['kernel'], (0,)) + p['bias']))

  got = lambda p, x: jnp.sum(jnp.sin(yax.eval_mox(q.mox, p, x)))
  np.testing.assert_allclose(got(variables, x), want(variables, x),
                             rtol=1e-6)
  for g, w in zip(jax.tree_util.tree_leaves(jax.grad(got, (0, 1))(
      variables, x)), jax.tree_util.tree_leaves(jax.grad(want, (0, 1))(
          variables, x)), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
