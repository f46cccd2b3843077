"""yax.fewbit: few-bit activation gradients.

References are plain JAX: the activation itself for the forward pass, and
for the backward pass the incoming gradient times a step function this
file evaluates itself from the shipped table (``np.searchsorted``). The
table is checked against an independent solver written here (analytic
derivatives in float64, Lloyd-style alternation on a fine grid).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special

import yax
from helpers import assert_trees_close, run_on_host_devices, saved_residuals
from yax._src.tools import fewbit as _fewbit

ACTS = {
    'gelu': lambda x: jax.nn.gelu(x, approximate=False),
    'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'silu': jax.nn.silu,
    'sigmoid': jax.nn.sigmoid,
    'tanh': jnp.tanh,
    'softplus': jax.nn.softplus,
    'elu': jax.nn.elu,
    'mish': jax.nn.mish,
    'relu': jax.nn.relu,
    'leaky_relu': jax.nn.leaky_relu,
    'relu6': jax.nn.relu6,
    'hard_sigmoid': jax.nn.hard_sigmoid,
    'hard_tanh': jax.nn.hard_tanh,
    'hard_swish': jax.nn.hard_swish,
}


def step_reference(name, bits, x):
  """The documented step function: level ``i`` on ``[b_{i-1}, b_i)``."""
  borders, levels, _ = _fewbit.table(name, bits)
  x = np.asarray(x, np.float32)
  return np.asarray(levels, np.float32)[
      np.searchsorted(np.asarray(borders, np.float32), x, side='right')]


def stepped(name, bits):
  """Plain JAX reference: the activation with the step derivative."""
  fn = ACTS[name]

  @jax.custom_vjp
  def f(x):
    return fn(x)

  def fwd(x):
    return fn(x), x

  def bwd(x, g):
    borders, levels, _ = _fewbit.table(name, bits)
    code = jnp.sum(x.astype(jnp.float32)[..., None] >=
                   jnp.asarray(borders, jnp.float32), axis=-1)
    return ((g.astype(jnp.float32) *
             jnp.asarray(levels, jnp.float32)[code]).astype(g.dtype),)

  f.defvjp(fwd, bwd)
  return f


class MLP(nn.Module):
  act: object

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(self.act(nn.Dense(16)(x)))


def _inputs(shape, key=0, dtype=jnp.float32):
  return (2.5 * jax.random.normal(jax.random.key(key), shape)).astype(dtype)


# ---------------------------------------------------- each activation


@pytest.mark.parametrize('name', list(ACTS))
def test_forward_bitwise_and_gradient_is_upstream_times_step(name):
  fn = ACTS[name]
  x = _inputs((4, 33))
  mox = yax.make_mox(fn)(x)
  new = yax.fewbit(mox, bits=3)
  calls = yax.query('//module_call[@type="FewBit"]', new)
  assert [(c.params['name'], c.params['bits']) for c in calls] == [(name, 3)]
  yax.check_mox(new)
  got, vjp = jax.vjp(lambda x: yax.eval_mox(new, x), x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(fn(x)))
  np.testing.assert_array_equal(np.asarray(jax.jit(
      lambda x: yax.eval_mox(new, x))(x)), np.asarray(jax.jit(fn)(x)))
  g = _inputs((4, 33), key=1)
  (dx,) = vjp(g)
  np.testing.assert_allclose(dx, np.asarray(g) * step_reference(name, 3, x),
                             rtol=1e-6, atol=1e-7)
  # The only residual is the packed code: ceil(n * 3 / 8) bytes of uint8.
  (res,) = [r for r in jax.tree_util.tree_leaves(vjp)
            if hasattr(r, 'dtype')]
  assert res.dtype == jnp.uint8 and res.shape == (math.ceil(4 * 33 * 3 / 8),)


@pytest.mark.parametrize('bits', _fewbit.BITS)
def test_bits_and_dtypes(bits):
  for dtype in (jnp.float32, jnp.bfloat16):
    x = _inputs((5, 7), dtype=dtype)
    fn = ACTS['gelu']
    new = yax.fewbit(yax.make_mox(fn)(x), bits=bits)
    got, vjp = jax.vjp(lambda x: yax.eval_mox(new, x), x)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(fn(x), np.float32))
    assert got.dtype == dtype
    g = jnp.ones_like(x)
    (dx,) = vjp(g)
    _, ref_vjp = jax.vjp(stepped('gelu', bits), x)
    assert dx.dtype == dtype
    np.testing.assert_array_equal(np.asarray(dx, np.float32),
                                  np.asarray(ref_vjp(g)[0], np.float32))
    (res,) = [r for r in jax.tree_util.tree_leaves(vjp)
              if hasattr(r, 'dtype')]
    assert res.dtype == jnp.uint8
    assert res.shape == (math.ceil(35 * bits / 8),)


def test_saved_residuals_of_an_mlp_step():
  """JAX's own account of what the backward pass keeps: the activation's
  input (and SiLU's sigmoid) give way to the packed code; the second
  layer still keeps its input, the activation's output."""
  model = MLP(ACTS['silu'])
  x = _inputs((8, 5))
  v = model.init(jax.random.key(0), x)
  new = yax.fewbit(yax.make_mox(model.apply)(v, x), bits=2)
  loss = lambda v, x: yax.eval_mox(new, v, x).sum()
  ref = lambda v, x: model.apply(v, x).sum()
  assert saved_residuals(loss, v, x) == ['f32[8,16]', 'u8[32]']
  assert saved_residuals(ref, v, x).count('f32[8,16]') >= 2
  grads = jax.grad(loss)(v, x)
  ref_grads = jax.grad(lambda v: MLP(stepped('silu', 2)).apply(v, x).sum())(v)
  assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from(_fewbit.BITS), n=st.integers(1, 70),
       seed=st.integers(0, 2 ** 31 - 1))
def test_pack_round_trip_and_size(bits, n, seed):
  codes = np.random.default_rng(seed).integers(0, 2 ** bits, n,
                                               dtype=np.uint8)
  packed = _fewbit.pack(jnp.asarray(codes), bits)
  assert packed.dtype == jnp.uint8 and packed.shape == (math.ceil(n * bits
                                                                  / 8),)
  np.testing.assert_array_equal(_fewbit.unpack(packed, bits, (n,)), codes)


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(ACTS)), bits=st.sampled_from(_fewbit.BITS),
       slope=st.sampled_from([None, 0.1, -0.5]),
       dtype=st.sampled_from(['float32', 'bfloat16', 'float16']),
       drawn=st.lists(st.floats(width=32), max_size=40),
       seed=st.integers(0, 2 ** 31 - 1))
def test_codes_are_searchsorted_right_at_borders_and_specials(
    name, bits, slope, dtype, drawn, seed):
  """The code of ``x`` is ``np.searchsorted(borders, x, side='right')``:
  at each border and its float32 neighbours, at +-0, +-inf and NaN of
  either sign (after every border), in each input dtype. Subnormals
  compare as zero, as XLA computes them (so did ``jnp.searchsorted``)."""
  slope = slope if name == 'leaky_relu' else None
  borders = np.asarray(_fewbit.table(name, bits, slope)[0], np.float32)
  finite = borders[np.isfinite(borders)]
  nan = np.float32('nan')
  x = np.concatenate([
      finite, np.nextafter(finite, np.float32(np.inf)),
      np.nextafter(finite, np.float32(-np.inf)), -finite,
      np.array([0.0, -0.0, nan, -nan, np.inf, -np.inf, 3e38, -3e38],
               np.float32),
      np.asarray(drawn, np.float32),
      3 * np.random.default_rng(seed).standard_normal(50).astype(np.float32)])
  # One length for every example: eager ops compile once per dtype.
  x = np.pad(x, (0, 1200 - x.size))
  x = np.asarray(jnp.asarray(x).astype(dtype))
  # XLA flushes subnormal inputs to zero (of their sign) before comparing.
  flushed = x.astype(np.float32)
  flushed = np.where(np.abs(flushed) < np.finfo(np.float32).tiny,
                     np.copysign(np.float32(0), flushed), flushed)
  expected = np.searchsorted(borders, flushed, side='right')
  got = _fewbit.encode(name, bits, jnp.asarray(x), slope)
  assert got.dtype == jnp.uint8 and got.shape == x.shape
  np.testing.assert_array_equal(np.asarray(got), expected)


@settings(max_examples=8, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=3),
       name=st.sampled_from(sorted(ACTS)), bits=st.sampled_from(_fewbit.BITS))
def test_any_shape(shape, name, bits):
  x = _inputs(tuple(shape), key=3)
  new = yax.fewbit(yax.make_mox(ACTS[name])(x), bits=bits)
  got, vjp = jax.vjp(lambda x: yax.eval_mox(new, x), x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ACTS[name](x)))
  g = _inputs(tuple(shape), key=4)
  np.testing.assert_allclose(vjp(g)[0],
                             np.asarray(g) * step_reference(name, bits, x),
                             rtol=1e-6, atol=1e-7)


# -------------------------------------------------- the tables

SQRT2 = math.sqrt(2.0)


def _sigmoid(x):
  return special.expit(x)


def _softplus_d(x):
  return _sigmoid(x)


DERIVATIVES = {
    'gelu': lambda x: special.ndtr(x) + x * np.exp(-x * x / 2) / math.sqrt(
        2 * math.pi),
    'gelu_tanh': lambda x: _gelu_tanh_d(x),
    'silu': lambda x: _sigmoid(x) * (1 + x * (1 - _sigmoid(x))),
    'sigmoid': lambda x: _sigmoid(x) * (1 - _sigmoid(x)),
    'tanh': lambda x: 1 - np.tanh(x) ** 2,
    'softplus': _softplus_d,
    'elu': lambda x: np.where(x > 0, 1.0, np.exp(np.minimum(x, 0))),
    'mish': lambda x: _mish_d(x),
    'relu': lambda x: (x > 0).astype(float),
    'leaky_relu': lambda x: np.where(x >= 0, 1.0, 0.01),
    'relu6': lambda x: ((x > 0) & (x < 6)).astype(float),
    'hard_sigmoid': lambda x: ((x > -3) & (x < 3)) / 6.0,
    'hard_tanh': lambda x: ((x > -1) & (x < 1)).astype(float),
    'hard_swish': lambda x: np.where(x <= -3, 0.0, np.where(
        x >= 3, 1.0, (2 * x + 3) / 6)),
}


def _gelu_tanh_d(x):
  c = math.sqrt(2 / math.pi)
  u = c * (x + 0.044715 * x ** 3)
  t = np.tanh(u)
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


def _mish_d(x):
  sp = np.logaddexp(0, x)
  t = np.tanh(sp)
  return t + x * (1 - t * t) * _sigmoid(x)


def _grid(per_unit=256):
  edges = np.linspace(-8, 8, 16 * per_unit + 1)
  weights = np.diff(special.ndtr(edges))
  weights[0] += special.ndtr(-8)
  weights[-1] += special.ndtr(-8)
  return edges, (edges[:-1] + edges[1:]) / 2, weights


def weighted_error(name, borders, levels, grid):
  """E[(f'(x) - s(x))^2], x ~ N(0, 1), on the grid's midpoints."""
  _, mids, weights = grid
  s = np.asarray(levels)[np.searchsorted(np.asarray(borders), mids,
                                         side='right')]
  return float(np.sum(weights * (DERIVATIVES[name](mids) - s) ** 2))


def lloyd(name, bits, grid, starts=4, sweeps=60):
  """Independent solver: from several starting partitions, alternate
  levels = weighted means and each border = the grid point between its
  neighbours that best splits the two adjacent levels."""
  _, mids, weights = grid
  d = DERIVATIVES[name](mids)
  k = 2 ** bits
  best = math.inf
  rng = np.random.default_rng(0)
  inits = [special.ndtri(np.arange(1, k) / k),
           np.linspace(-3, 3, k + 1)[1:-1]]
  inits += [np.sort(rng.uniform(-4, 4, k - 1)) for _ in range(starts - 2)]
  for init in inits:
    cut = np.searchsorted(mids, init)
    cut = np.concatenate([[0], np.maximum.accumulate(cut), [len(mids)]])
    for _ in range(sweeps):
      lv = np.array([np.average(d[a:b], weights=weights[a:b])
                     if b > a and weights[a:b].sum() > 0 else 0.0
                     for a, b in zip(cut[:-1], cut[1:])])
      old = cut.copy()
      for i in range(1, k):
        a, b = cut[i - 1], cut[i + 1]
        if b <= a:
          continue
        gain = weights[a:b] * ((d[a:b] - lv[i - 1]) ** 2 -
                               (d[a:b] - lv[i]) ** 2)
        total = np.concatenate([[0.0], np.cumsum(gain)])
        cut[i] = a + int(np.argmin(total))
      if np.array_equal(old, cut):
        break
    lv = [np.average(d[a:b], weights=weights[a:b]) if b > a and
          weights[a:b].sum() > 0 else 0.0 for a, b in zip(cut[:-1], cut[1:])]
    edges = grid[0]
    best = min(best, weighted_error(name, edges[cut[1:-1]], lv, grid))
  return best


@pytest.mark.parametrize('name', list(ACTS))
def test_table_is_optimal_within_one_percent_of_an_independent_solver(name):
  grid = _grid()
  for bits in (1, 2, 3, 4):
    borders, levels, rmse = _fewbit.table(name, bits)
    assert len(borders) == 2 ** bits - 1 and len(levels) == 2 ** bits
    assert list(borders) == sorted(borders)
    ours = weighted_error(name, borders, levels, grid)
    theirs = lloyd(name, bits, grid)
    assert ours <= 1.01 * theirs + 1e-9, (bits, ours, theirs)
    # The documented error is the table's error.
    assert math.isclose(math.sqrt(ours), rmse, rel_tol=0.02, abs_tol=1e-5), (
        bits, math.sqrt(ours), rmse)


def test_eight_bit_tables_are_optimal_within_one_percent():
  grid = _grid(512)
  for name in ('gelu', 'silu', 'tanh'):
    borders, levels, rmse = _fewbit.table(name, 8)
    ours = weighted_error(name, borders, levels, grid)
    theirs = lloyd(name, 8, grid, starts=2, sweeps=200)
    assert ours <= 1.01 * theirs, (ours, theirs)


@pytest.mark.parametrize('name,bits', [
    ('relu', 1), ('leaky_relu', 1), ('relu6', 2), ('hard_sigmoid', 2),
    ('hard_tanh', 2)])
def test_piecewise_linear_activations_are_exact(name, bits):
  for b in [x for x in _fewbit.BITS if x >= bits]:
    borders, levels, rmse = _fewbit.table(name, b)
    assert rmse == 0.0
  # Off the kinks themselves, where f' is undefined (JAX picks a side per
  # function; the step function takes the piece on the right).
  x = jnp.concatenate([_inputs((500,), key=5), jnp.array(
      [-3.01, -2.99, -1.01, -0.99, -0.01, 0.01, 0.99, 1.01, 2.99, 3.01, 5.99,
       6.01])])
  kinks = np.array([-3.0, -1.0, 0.0, 1.0, 3.0, 6.0])
  x = x[np.abs(np.asarray(x)[:, None] - kinks).min(axis=1) > 1e-6]
  exact = jax.vmap(jax.grad(ACTS[name]))(x)
  new = yax.fewbit(yax.make_mox(ACTS[name])(x), bits=bits)
  got = jax.grad(lambda x: yax.eval_mox(new, x).sum())(x)
  np.testing.assert_array_equal(got, exact)


# --------------------------------------------------------- in models


def test_hf_bert_inlined_gelu_is_found_and_rewritten(monkeypatch):
  from transformers import BertConfig, FlaxBertModel
  from transformers import modeling_flax_utils
  sizes = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=37,
               max_position_embeddings=64)
  model = FlaxBertModel(BertConfig(hidden_act='gelu', **sizes), seed=0)
  ids = jax.random.randint(jax.random.key(1), (2, 8), 0, 99)
  run = lambda p, i: model(i, params=p).last_hidden_state
  mox = yax.make_mox(run)(model.params, ids)
  before = str(mox)
  new = yax.fewbit(mox)
  assert str(mox) == before
  yax.check_mox(new)
  calls = yax.query('//module_call[@type="FewBit"]', new)
  # The GELU of each layer, and the pooler's tanh.
  assert [c.path for c in calls] == [
      ('encoder', 'layer', str(i), 'intermediate', 'gelu') for i in range(2)
  ] + [('pooler', 'tanh')]
  assert yax.query('//module_call[@type="FewBit"]/@name', new) == [
      'gelu', 'gelu', 'tanh']
  assert yax.query('//module_call[@type="FewBit"]/@bits', new) == ['3'] * 3
  np.testing.assert_array_equal(yax.eval_mox(new, model.params, ids),
                                run(model.params, ids))
  # Gradients: the same BERT built with the stepped GELU of plain JAX.
  monkeypatch.setitem(modeling_flax_utils.ACT2FN, 'stepped_gelu',
                      stepped('gelu', 3))
  ref = FlaxBertModel(BertConfig(hidden_act='stepped_gelu', **sizes),
                      seed=0, _do_init=False)
  loss = lambda p: (yax.eval_mox(new, p, ids) ** 2).mean()
  ref_loss = lambda p: (ref(ids, params=p).last_hidden_state ** 2).mean()
  assert_trees_close(jax.jit(jax.grad(loss))(model.params),
                     jax.jit(jax.grad(ref_loss))(model.params),
                     rtol=1e-4, atol=1e-6)


def test_selection_and_refusals():
  class Odd(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jnp.exp(nn.Dense(8)(x)) * 0.5

  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.gelu(nn.Dense(8, name='a')(x))
      h = Odd(name='odd')(h)
      return nn.Dense(8, name='c')(jnp.tanh(h))

  x = _inputs((3, 4))
  v = Two().init(jax.random.key(0), x)
  mox = yax.make_mox(Two().apply)(v, x)
  before = str(mox)
  whole = yax.fewbit(mox, bits=1)
  assert yax.query('//module_call[@type="FewBit"]/@name', whole) == [
      'gelu_tanh', 'tanh']
  with pytest.raises(yax.SubstitutionError, match=r'bits.*found bits=5'):
    yax.fewbit(mox, bits=5)
  with pytest.raises(yax.SubstitutionError,
                     match=r'no supported activation in .*Odd.*found the '
                     r'element-wise operations exp, mul'):
    yax.fewbit(mox, '//module_call[@type="Odd"]')
  # Already rewritten activations are not found twice.
  with pytest.raises(yax.SubstitutionError, match='no supported activation'):
    yax.fewbit(whole)
  assert str(mox) == before


class ScanBlock(nn.Module):
  act: object

  @nn.compact
  def __call__(self, c, _):
    return self.act(nn.Dense(6)(c)), None


class Stack(nn.Module):
  act: object = nn.silu

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(ScanBlock, variable_axes={'params': 0},
                   split_rngs={'params': True}, length=3)
    return scan(self.act, name='scan')(x, None)[0]


def test_inside_scan_bodies_and_under_vmap():
  RefStack = lambda: Stack(stepped('silu', 4))
  x = _inputs((2, 6))
  v = Stack().init(jax.random.key(0), x)
  mox = yax.make_mox(Stack().apply)(v, x)
  new = yax.fewbit(mox, bits=4)
  assert len(yax.query('//module_call[@type="FewBit"]', new)) == 1
  yax.check_mox(new)
  np.testing.assert_array_equal(yax.eval_mox(new, v, x), Stack().apply(v, x))
  loss = lambda v, x: (yax.eval_mox(new, v, x) ** 2).sum()
  ref = lambda v, x: (RefStack().apply(v, x) ** 2).sum()
  assert_trees_close(jax.jit(jax.grad(loss))(v, x), jax.grad(ref)(v, x),
                     rtol=1e-5, atol=1e-6)
  xs = _inputs((5, 2, 6), key=2)
  per = jax.vmap(jax.grad(loss), in_axes=(None, 0))(v, xs)
  ref_per = jax.vmap(jax.grad(ref), in_axes=(None, 0))(v, xs)
  assert_trees_close(per, ref_per, rtol=1e-5, atol=1e-6)


def test_nnx_model():
  class Net(nnx.Module):
    def __init__(self, act, rngs):
      self.fc1 = nnx.Linear(5, 12, rngs=rngs)
      self.fc2 = nnx.Linear(12, 2, rngs=rngs)
      self.act = act

    def __call__(self, x):
      return self.fc2(self.act(self.fc1(x)))

  model = Net(nnx.gelu, nnx.Rngs(0))
  x = _inputs((4, 5))
  graphdef, state = nnx.split(model)
  run = lambda s, x: nnx.merge(graphdef, s)(x)
  mox = yax.make_mox(run)(state, x)
  new = yax.fewbit(mox, '//module_call[@type="Net"]', bits=2)
  yax.check_mox(new)
  np.testing.assert_array_equal(yax.eval_mox(new, state, x), run(state, x))
  ref_def, ref_state = nnx.split(Net(stepped('gelu_tanh', 2), nnx.Rngs(0)))
  ref = lambda s: (nnx.merge(ref_def, s)(x) ** 2).sum()
  got = jax.grad(lambda s: (yax.eval_mox(new, s, x) ** 2).sum())(state)
  assert_trees_close(got, jax.grad(ref)(ref_state), rtol=1e-5, atol=1e-6)


def test_composes_with_lora_and_quantize():
  model = MLP(nn.gelu)
  x = _inputs((4, 5))
  v = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(v, x)
  dense = '//module_call[@type="Dense"]'
  # fewbit after lora, and lora after fewbit: the same trained function.
  a = yax.lora(mox, v, dense, rank=2, key=jax.random.key(1))
  fa = yax.fewbit(a.mox)
  b_tree = yax.fewbit(mox)
  b = yax.lora(b_tree, v, dense, rank=2, key=jax.random.key(1))
  for tree, params in ((fa, a.params), (b.mox, b.params)):
    yax.check_mox(tree)
    np.testing.assert_array_equal(yax.eval_mox(tree, params, x),
                                  yax.eval_mox(a.mox, a.params, x))
  trained = jax.tree_util.tree_map(lambda t: t + 0.1, a.params)
  g1 = jax.grad(lambda p: (yax.eval_mox(fa, p, x) ** 2).sum())(trained)
  g2 = jax.grad(lambda p: (yax.eval_mox(b.mox, p, x) ** 2).sum())(trained)
  assert_trees_close(g1, g2, rtol=1e-5, atol=1e-6)
  ref = jax.grad(lambda p: (MLP(stepped('gelu_tanh', 3)).apply(
      a.merge(p), x) ** 2).sum())(trained)
  for g, r, m in zip(jax.tree_util.tree_leaves(g1),
                     jax.tree_util.tree_leaves(ref),
                     jax.tree_util.tree_leaves(a.mask)):
    if m:
      np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
  # QLoRA plus fewbit.
  q = yax.quantize(mox, v, dense, weight='int8')
  ql = yax.lora(q.mox, q.params, dense, rank=2, key=jax.random.key(1))
  qf = yax.fewbit(ql.mox, bits=2)
  yax.check_mox(qf)
  assert len(yax.query('//module_call[@type="FewBit"]', qf)) == 1
  np.testing.assert_array_equal(yax.eval_mox(qf, ql.params, x),
                                yax.eval_mox(ql.mox, ql.params, x))
  got = jax.grad(lambda p: (yax.eval_mox(qf, p, x) ** 2).sum(),
                 allow_int=True)(ql.params)
  ref_got = jax.grad(lambda p: (MLP(stepped('gelu_tanh', 2)).apply(
      ql.merge(p), x) ** 2).sum(), allow_int=True)(ql.params)
  lora_mask = ql.mask
  for g, r, m in zip(jax.tree_util.tree_leaves(got),
                     jax.tree_util.tree_leaves(ref_got),
                     jax.tree_util.tree_leaves(lora_mask)):
    if m:
      np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_composes_with_remat_and_randomized_linear():
  class Block(nn.Module):
    act: object

    @nn.compact
    def __call__(self, x):
      return nn.Dense(6)(self.act(nn.Dense(12)(x)))

  class Net(nn.Module):
    act: object

    @nn.compact
    def __call__(self, x):
      return Block(self.act, name='block')(x).sum(-1)

  x = _inputs((4, 6))
  v = Net(nn.silu).init(jax.random.key(0), x)
  mox = yax.make_mox(Net(nn.silu).apply)(v, x)
  ref = jax.grad(lambda v: (Net(stepped('silu', 2)).apply(v, x) ** 2).sum())(v)
  block = '//module_call[@type="Block"]'
  for tree in (yax.remat(yax.fewbit(mox, bits=2), block),
               yax.fewbit(yax.remat(mox, block), bits=2)):
    yax.check_mox(tree)
    assert len(yax.query('//module_call[@type="FewBit"]', tree)) == 1
    np.testing.assert_array_equal(yax.eval_mox(tree, v, x),
                                  Net(nn.silu).apply(v, x))
    got = jax.grad(lambda v: (yax.eval_mox(tree, v, x) ** 2).sum())(v)
    assert_trees_close(got, ref, rtol=1e-5, atol=1e-6)
  # With randomized linear layers: the input gradient stays exact, so the
  # gradient of the first layer's input equals the fewbit one.
  few = yax.fewbit(mox, bits=2)
  both = yax.randomized_linear(few, '//module_call[@type="Dense"]', ratio=0.5)
  key = jax.random.PRNGKey(3)
  np.testing.assert_array_equal(yax.eval_mox(both, v, x, sketch_key=key),
                                Net(nn.silu).apply(v, x))
  dx = jax.grad(lambda x: (yax.eval_mox(both, v, x, sketch_key=key) ** 2
                           ).sum())(x)
  ref_dx = jax.grad(lambda x: (Net(stepped('silu', 2)).apply(v, x) ** 2
                               ).sum())(x)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)


MESH_SCRIPT = '''
import math
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import yax
from helpers import assert_trees_close
from test_fewbit import MLP, stepped

assert len(jax.devices()) == 8
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ('data', 'model'))
model = MLP(nn.gelu)
x = jax.random.normal(jax.random.key(1), (8, 5)) * 2
v = model.init(jax.random.key(0), x)
sx = jax.device_put(x, NamedSharding(mesh, P('data', None)))
sv = jax.tree_util.tree_map(
    lambda a: jax.device_put(a, NamedSharding(
        mesh, P(None, 'model') if a.ndim == 2 and a.shape[1] == 16 else P())),
    v)
new = yax.fewbit(yax.make_mox(model.apply)(v, x), bits=4)
out = jax.jit(lambda v, x: yax.eval_mox(new, v, x))(sv, sx)
np.testing.assert_array_equal(out, jax.jit(model.apply)(sv, sx))
loss = lambda v, x: (yax.eval_mox(new, v, x) ** 2).sum()
ref = lambda v, x: (MLP(stepped('gelu_tanh', 4)).apply(v, x) ** 2).sum()
got = jax.jit(jax.grad(loss))(sv, sx)
assert_trees_close(got, jax.jit(jax.grad(ref))(sv, sx), rtol=1e-5, atol=1e-6)
k = got['params']['Dense_0']['kernel']
assert len(k.sharding.device_set) == 8
print('FEWBIT-MESH-OK')
'''


def test_on_a_2x4_host_mesh(tmp_path):
  run_on_host_devices(MESH_SCRIPT, tmp_path, 'FEWBIT-MESH-OK')


def test_pack_layout_is_the_little_endian_bit_stream():
  """Bit j of code i is bit i * bits + j of the byte stream, written out
  bit by bit here."""
  rng = np.random.default_rng(0)
  for bits in (1, 2, 3, 4):
    codes = rng.integers(0, 2 ** bits, 37, dtype=np.uint8)
    stream = [(int(c) >> j) & 1 for c in codes for j in range(bits)]
    stream += [0] * (-len(stream) % 8)
    expected = [sum(stream[8 * i + k] << k for k in range(8))
                for i in range(len(stream) // 8)]
    np.testing.assert_array_equal(_fewbit.pack(jnp.asarray(codes), bits),
                                  np.array(expected, np.uint8))


def test_inside_a_flax_remat_body():
  class Body(nn.Module):
    act: object

    @nn.compact
    def __call__(self, x):
      return nn.Dense(5)(self.act(nn.Dense(10)(x)))

  class Outer(nn.Module):
    act: object

    @nn.compact
    def __call__(self, x):
      return nn.remat(Body)(self.act, name='body')(x)

  x = _inputs((3, 5))
  v = Outer(nn.gelu).init(jax.random.key(0), x)
  mox = yax.make_mox(Outer(nn.gelu).apply)(v, x)
  new = yax.fewbit(mox, bits=3)
  yax.check_mox(new)
  assert len(yax.query('//module_call[@type="FewBit"]', new)) == 1
  np.testing.assert_array_equal(yax.eval_mox(new, v, x),
                                Outer(nn.gelu).apply(v, x))
  got = jax.grad(lambda v: (yax.eval_mox(new, v, x) ** 2).sum())(v)
  ref = jax.grad(lambda v: (Outer(stepped('gelu_tanh', 3)).apply(v, x) ** 2
                            ).sum())(v)
  assert_trees_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('bits', [1, 3])
def test_leaky_relu_at_any_slope_is_found_and_exact(bits):
  # Failed before: fewbit refused jax.nn.leaky_relu(x, 0.1) ("found no
  # supported activation ...; found the element-wise operations
  # leaky_relu"), and its tables held only the slope 0.01.
  slopes = (0.1, -0.5, 0.3)
  model = MLP(lambda h: sum(jax.nn.leaky_relu(h, s) for s in slopes)
              + jax.nn.leaky_relu(h))
  x = _inputs((8, 5))
  v = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(v, x)
  new = yax.fewbit(mox, bits=bits)
  yax.check_mox(new)
  calls = yax.query('//module_call[@type="FewBit"]', new)
  assert sorted((c.params['name'], c.params.get('slope') or 0.01) for c in calls
                ) == sorted(('leaky_relu', s) for s in (*slopes, 0.01))
  np.testing.assert_array_equal(yax.eval_mox(new, v, x), model.apply(v, x))
  # Exact: f' of leaky ReLU is the slope below 0 and 1 from 0 on, two
  # levels, at every bits. The reference is plain JAX's gradient.
  loss = lambda f: (lambda v, x: jnp.sum(jnp.sin(f(v, x))))
  assert_trees_close(jax.grad(loss(lambda v, x: yax.eval_mox(new, v, x)),
                              (0, 1))(v, x),
                     jax.grad(loss(model.apply), (0, 1))(v, x),
                     rtol=1e-6, atol=1e-6)
  for s in slopes:
    borders, levels, rmse = _fewbit.table('leaky_relu', bits, s)
    assert (borders[0], levels[0], levels[1], rmse) == (0.0, s, 1.0, 0.0)
    assert len(borders) == 2 ** bits - 1 and len(levels) == 2 ** bits
  # Each keeps its packed codes, not its input.
  codes = f'u8[{math.ceil(8 * 16 * bits / 8)}]'
  assert saved_residuals(loss(lambda v, x: yax.eval_mox(new, v, x)), v,
                         x).count(codes) == 4
