"""yax.randomized_linear against plain Flax: the forward pass and the input
gradient are exact, the kernel gradient is unbiased (its mean over many
sketches is the exact gradient, within standard error), and the residual
kept for the kernel gradient is the sketch, [k, d]. Composed with remat,
lora, quantize and fewbit, inside nn.scan and nn.remat bodies, on NNX,
under jit/vmap and on a 2x4 mesh of host devices."""

from __future__ import annotations

import math
import textwrap

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import yax
from yax._src.tools import randomized
from helpers import (assert_trees_close, check_rewrite, run_on_host_devices,
                     saved_residuals)

KEY = jax.random.PRNGKey(7)


class KernelFirst(nn.Module):
  """A linear layer whose kernel is the lhs of its dot_general."""

  @nn.compact
  def __call__(self, x):
    w = self.param('kernel', nn.initializers.lecun_normal(), (x.shape[-1], 6))
    y = jax.lax.dot_general(w, x, (((0,), (2,)), ((), ())))  # [c, b, t]
    return jnp.transpose(y, (1, 2, 0))


class Block(nn.Module):
  """Every dot_general layout of a linear layer: Dense on a 3-d input,
  DenseGeneral to two axes, Einsum, and a kernel as the lhs."""

  @nn.compact
  def __call__(self, x):
    h = nn.DenseGeneral((2, 4))(x)
    h = nn.Einsum((2, 4, 8), 'btij,ijk->btk')(jnp.tanh(h))
    h = KernelFirst()(jnp.sin(h))
    return x + nn.Dense(8)(jnp.cos(h))


LINEAR = ('//module_call[@type="Dense" or @type="DenseGeneral" or '
          '@type="Einsum" or @type="KernelFirst"]')
X = jax.random.normal(jax.random.key(1), (3, 5, 8))
BLOCK = Block()
VARS = BLOCK.init(jax.random.key(0), X)


def loss(apply):
  return lambda v, x, *key: jnp.sum(jnp.sin(apply(v, x, *key)))


def assert_exact(new, apply, v, x=X):
  """``new``'s forward pass is ``apply``'s bit for bit and its input
  gradient is exact; returns ``new``'s loss of ``(v, x, key)``."""
  np.testing.assert_array_equal(yax.eval_mox(new, v, x, sketch_key=KEY),
                                apply(v, x))
  mine = loss(lambda v, x, k: yax.eval_mox(new, v, x, sketch_key=k))
  assert_trees_close(jax.grad(mine, 1)(v, x, KEY),
                     jax.grad(loss(apply), 1)(v, x), rtol=1e-5, atol=1e-6)
  return mine


@pytest.fixture(scope='module')
def block_mox():
  return yax.make_mox(BLOCK.apply)(VARS, X)


def kernels(grads):
  return {k: v['kernel'] for k, v in grads['params'].items()}


def test_forward_and_input_gradient_are_exact(block_mox):
  new = check_rewrite(yax.randomized_linear(block_mox, LINEAR, ratio=0.3))
  got = yax.eval_mox(new, VARS, X, sketch_key=KEY)
  np.testing.assert_array_equal(got, BLOCK.apply(VARS, X))
  mine = loss(lambda v, x, k: yax.eval_mox(new, v, x, sketch_key=k))
  exact = loss(BLOCK.apply)
  assert_trees_close(jax.grad(mine, 1)(VARS, X, KEY),
                     jax.grad(exact, 1)(VARS, X), rtol=1e-5, atol=1e-6)
  # Biases do not read the input: exact too.
  got, ref = jax.grad(mine)(VARS, X, KEY), jax.grad(exact)(VARS, X)
  for name in ('Dense_0', 'DenseGeneral_0'):
    np.testing.assert_allclose(got['params'][name]['bias'],
                               ref['params'][name]['bias'], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize('kind', ['count', 'gaussian', 'rademacher'])
def test_kernel_gradient_is_unbiased(block_mox, kind):
  new = yax.randomized_linear(block_mox, LINEAR, ratio=0.3, kind=kind)
  mine = loss(lambda v, x, k: yax.eval_mox(new, v, x, sketch_key=k))
  n = 1000
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  sampled = jax.jit(jax.vmap(lambda k: kernels(jax.grad(mine)(VARS, X, k))))(
      keys)
  exact = kernels(jax.grad(loss(BLOCK.apply))(VARS, X))
  assert set(sampled) == {'DenseGeneral_0', 'Einsum_0', 'KernelFirst_0', 'Dense_0'}
  for name, g in sampled.items():
    assert_unbiased(g, exact[name], n)


def assert_unbiased(samples, exact, n):
  """Each element's mean over ``n`` sketches is within 5 standard errors
  of the exact gradient (the elements share the sketches, so their
  z-scores are correlated: each is checked, not their spread), and the
  samples do vary (a sketch, not the exact gradient)."""
  g, e = np.asarray(samples, np.float64), np.asarray(exact, np.float64)
  se = g.std(0) / math.sqrt(n)
  assert (se > 0).all()
  z = (g.mean(0) - e) / se
  assert float(np.abs(z).max()) < 5.0, np.abs(z).max()


def test_a_fresh_sketch_per_key_and_the_same_per_key(block_mox):
  new = yax.randomized_linear(block_mox, LINEAR)
  mine = jax.jit(jax.grad(loss(
      lambda v, x, k: yax.eval_mox(new, v, x, sketch_key=k))))
  a, b = mine(VARS, X, KEY), mine(VARS, X, jax.random.PRNGKey(8))
  assert not np.allclose(kernels(a)['Dense_0'], kernels(b)['Dense_0'])
  assert_trees_close(a, mine(VARS, X, KEY), rtol=0, atol=0)


class Scaled(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(6)(2.0 * x)  # 2 * x is what the Dense keeps


@hypothesis.given(b=st.integers(1, 4), t=st.integers(2, 6),
                  d=st.integers(2, 5), ratio=st.floats(0.05, 1.0),
                  kind=st.sampled_from(randomized.KINDS))
@hypothesis.settings(max_examples=4, deadline=None)
def test_the_residual_is_the_sketch(b, t, d, ratio, kind):
  model = Scaled()
  x = jax.random.normal(jax.random.key(b * 31 + t), (b, t, d))
  v = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(v, x)
  k = math.ceil(ratio * b * t)
  if k == b * t:  # the sketch and its key would keep more than the input
    with pytest.raises(yax.SubstitutionError, match=(
        f'its sketch would keep {k * d * 4 + 8} bytes .{k} of {k} rows.*'
        f'more than its input f32.{b},{t},{d}. .{b * t * d * 4} bytes')):
      yax.randomized_linear(mox, '//module_call[@type="Dense"]', ratio=ratio,
                            kind=kind)
    return
  new = check_rewrite(yax.randomized_linear(
      mox, '//module_call[@type="Dense"]', ratio=ratio, kind=kind))
  mine = loss(lambda v, x, k: yax.eval_mox(new, v, x, sketch_key=k))
  assert saved_residuals(loss(model.apply), v, x) == sorted(
      [f'f32[{b},{t},{d}]', f'f32[{b},{t},6]'])  # sin's input, and 2 * x
  assert saved_residuals(mine, v, x, KEY) == sorted(
      [f'f32[{k},{d}]', 'key<fry>[]', f'f32[{b},{t},6]'])
  np.testing.assert_array_equal(yax.eval_mox(new, v, x, sketch_key=KEY),
                                model.apply(v, x))
  assert_trees_close(jax.grad(mine, 1)(v, x, KEY),
                     jax.grad(loss(model.apply), 1)(v, x), rtol=1e-5,
                     atol=1e-6)


def test_the_sketch_is_drawn_and_applied_in_blocks(monkeypatch):
  # 15 rows, k = 6, blocks of 4 rows: three blocks and a remainder of 3.
  monkeypatch.setattr(randomized, 'BLOCK_ENTRIES', 25)
  model = nn.Dense(6)
  x = jax.random.normal(jax.random.key(3), (3, 5, 4))
  v = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(v, x)
  new = check_rewrite(yax.randomized_linear(
      mox, '//module_call[@type="Dense"]', ratio=0.4, kind='gaussian'))
  mine = loss(lambda v, x, k: yax.eval_mox(new, v, x, sketch_key=k))
  got = jax.jit(jax.grad(mine))(v, x, KEY)['params']['kernel']
  # S, row block b from fold_in(site key, b), N(0, 1/k) entries.
  site = jax.random.fold_in(KEY, 0)
  s = jnp.concatenate([
      jax.random.normal(jax.random.fold_in(site, b), (rows, 6)) / math.sqrt(6)
      for b, rows in enumerate((4, 4, 4, 3))])
  np.testing.assert_array_equal(
      randomized.sketch_matrix(site, 15, 6, 'gaussian'), s)
  xf = np.asarray(x, np.float64).reshape(15, 4)
  g = np.cos(xf @ np.asarray(v['params']['kernel'], np.float64) +
             np.asarray(v['params']['bias'], np.float64))  # d sum(sin(y))/dy
  s = np.asarray(s, np.float64)
  np.testing.assert_allclose(got, (s.T @ xf).T @ (s.T @ g), rtol=1e-4,
                             atol=1e-5)
  assert saved_residuals(mine, v, x, KEY) == sorted(
      ['f32[6,4]', 'key<fry>[]', 'f32[3,5,6]'])
  # Still unbiased over the blocks.
  n = 1000
  keys = jax.random.split(jax.random.PRNGKey(4), n)
  sampled = jax.jit(jax.vmap(
      lambda k: jax.grad(mine)(v, x, k)['params']['kernel']))(keys)
  assert_unbiased(sampled, jax.grad(loss(model.apply))(v, x)['params'][
      'kernel'], n)


def test_missing_sketch_key_and_refusals(block_mox):
  new = yax.randomized_linear(block_mox, LINEAR)
  with pytest.raises(yax.SignatureError, match="kwargs\\['sketch_key'\\]"):
    yax.eval_mox(new, VARS, X)
  with pytest.raises(yax.SubstitutionError, match='ratio must be'):
    yax.randomized_linear(block_mox, LINEAR, ratio=0.0)
  with pytest.raises(yax.SubstitutionError, match='kind must be'):
    yax.randomized_linear(block_mox, LINEAR, kind='uniform')
  with pytest.raises(yax.SubstitutionError, match='cannot sketch 1 of the 1'):
    yax.randomized_linear(block_mox, '//module_call[@type="Block"]')


def test_mox_unchanged_and_one_key_for_every_site(block_mox):
  before = block_mox.to_json()
  new = yax.randomized_linear(block_mox, LINEAR)
  assert block_mox.to_json() == before
  # One root keyword argument, however many sites read it.
  args, kwargs = jax.tree_util.tree_unflatten(new.in_tree, new.inputs)
  assert list(kwargs) == ['sketch_key']
  assert len(new.inputs) == len(block_mox.inputs) + 1


class Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    body = nn.scan(lambda m, c, _: (m(c), None), variable_axes={'params': 0},
                   split_rngs={'params': True}, length=2)
    x, _ = body(Block(name='layers'), x, None)
    return x


def test_composed_with_remat_lora_and_quantize(block_mox):
  exact = loss(BLOCK.apply)
  # remat, then randomized: the recomputed forward draws the same sketch.
  rl = yax.randomized_linear(block_mox, LINEAR)
  both = check_rewrite(yax.randomized_linear(
      yax.remat(block_mox, '//module_call[@type="Block"]'), LINEAR))
  g_rl = jax.grad(loss(lambda v, x, k: yax.eval_mox(rl, v, x, sketch_key=k)))
  g_both = jax.grad(loss(
      lambda v, x, k: yax.eval_mox(both, v, x, sketch_key=k)))
  assert_trees_close(g_both(VARS, X, KEY), g_rl(VARS, X, KEY), rtol=1e-5,
                     atol=1e-6)
  # LoRA: the adapted Dense keeps a sketch; the adapters' gradients are
  # exact (they do not go through the sketched kernel).
  lo = yax.lora(block_mox, VARS, '//module_call[@type="Dense"]', rank=2)
  lo_rl = check_rewrite(yax.randomized_linear(
      lo.mox, '//module_call[@type="Dense"]'))
  np.testing.assert_array_equal(
      yax.eval_mox(lo_rl, lo.params, X, sketch_key=KEY),
      yax.eval_mox(lo.mox, lo.params, X))
  ga = jax.grad(loss(lambda p, x, k: yax.eval_mox(lo_rl, p, x, sketch_key=k)))(
      lo.params, X, KEY)
  gb = jax.grad(loss(lambda p, x: yax.eval_mox(lo.mox, p, x)))(lo.params, X)
  for name in ('lora_a', 'lora_b'):
    np.testing.assert_allclose(ga['params']['Dense_0'][name],
                               gb['params']['Dense_0'][name], rtol=1e-5,
                               atol=1e-6)
  # int8 kernels: same forward; the input gradient stays exact.
  q = yax.quantize(block_mox, VARS, '//module_call[@type="Dense"]')
  q_rl = check_rewrite(yax.randomized_linear(
      q.mox, '//module_call[@type="Dense"]'))
  np.testing.assert_array_equal(
      yax.eval_mox(q_rl, q.params, X, sketch_key=KEY),
      yax.eval_mox(q.mox, q.params, X))
  assert_trees_close(
      jax.grad(loss(lambda p, x: yax.eval_mox(q_rl, p, x, sketch_key=KEY)),
               1)(q.params, X),
      jax.grad(loss(lambda p, x: yax.eval_mox(q.mox, p, x)), 1)(q.params, X),
      rtol=1e-5, atol=1e-6)
  # fewbit: both rewrites keep the forward pass bit for bit.
  fb = yax.fewbit(block_mox)
  fb_rl = check_rewrite(yax.randomized_linear(fb, LINEAR))
  np.testing.assert_array_equal(
      yax.eval_mox(fb_rl, VARS, X, sketch_key=KEY), BLOCK.apply(VARS, X))
  assert_trees_close(
      jax.grad(loss(lambda v, x: yax.eval_mox(fb_rl, v, x, sketch_key=KEY)),
               1)(VARS, X),
      jax.grad(loss(lambda v, x: yax.eval_mox(fb, v, x)), 1)(VARS, X),
      rtol=1e-5, atol=1e-6)
  del exact


def test_inside_an_nn_scan_body_under_jit_and_vmap():
  model = Scanned()
  v = model.init(jax.random.key(0), X)
  mox = yax.make_mox(model.apply)(v, X)
  new = check_rewrite(yax.randomized_linear(mox, LINEAR))
  mine = assert_exact(new, model.apply, v)
  xs = jnp.stack([X, -X])
  got = jax.jit(jax.vmap(lambda x: yax.eval_mox(new, v, x, sketch_key=KEY)))(
      xs)
  assert_trees_close(got, jax.vmap(lambda x: model.apply(v, x))(xs),
                     rtol=1e-6, atol=1e-6)
  # Unbiased inside the scan too (fewer samples: a coarse check).
  n = 600
  keys = jax.random.split(jax.random.PRNGKey(1), n)
  g = jax.jit(jax.vmap(lambda k: jax.grad(mine)(v, X, k)))(keys)
  e = jax.grad(loss(model.apply))(v, X)
  assert_unbiased(g['params']['layers']['Dense_0']['kernel'],
                  e['params']['layers']['Dense_0']['kernel'], n)
  # The key is a loop constant of the scan: one input, not one per layer.
  assert len(new.inputs) == len(mox.inputs) + 1


class RematBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.remat(Block)(name='b')(x)


def test_inside_an_nn_remat_body(block_mox):
  model = RematBlock()
  v = {'params': {'b': VARS['params']}}
  mox = yax.make_mox(model.apply)(v, X)
  new = check_rewrite(yax.randomized_linear(mox, LINEAR))
  mine = assert_exact(new, model.apply, v)
  # The recomputed forward draws the same sketches as the same layers
  # outside nn.remat.
  flat = yax.randomized_linear(block_mox, LINEAR)
  ref = jax.grad(loss(lambda v, x, k: yax.eval_mox(flat, v, x, sketch_key=k)))(
      VARS, X, KEY)
  assert_trees_close(jax.grad(mine)(v, X, KEY)['params']['b'], ref['params'],
                     rtol=1e-5, atol=1e-6)


class NMLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(8, 16, rngs=rngs)
    self.fc2 = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    return x + self.fc2(jnp.tanh(self.fc1(x)))


def test_on_nnx():
  model = NMLP(nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def apply(state, x):
    return nnx.merge(graphdef, state)(x)

  mox = yax.make_mox(apply)(state, X)
  new = check_rewrite(yax.randomized_linear(
      mox, '//module_call[@type="Linear"]', ratio=0.5))
  mine = assert_exact(new, apply, state)
  n = 800
  keys = jax.random.split(jax.random.PRNGKey(2), n)
  g = jax.jit(jax.vmap(lambda k: jax.grad(mine)(state, X, k)))(keys)
  e = jax.grad(loss(apply))(state, X)
  assert_unbiased(g['fc1']['kernel'].get_value(),
                  e['fc1']['kernel'].get_value(), n)


MESH_SCRIPT = textwrap.dedent('''
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import yax
    from helpers import assert_trees_close

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ('data', 'model'))

    class Block(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + nn.Dense(8)(jnp.tanh(nn.Dense(16)(x)))

    class MLP(nn.Module):
      remat: bool = False
      @nn.compact
      def __call__(self, x):
        block = nn.remat(Block) if self.remat else Block
        return nn.Dense(4)(block(name='b1')(block(name='b0')(x)))

    model = MLP()
    x = jax.random.normal(jax.random.key(1), (8, 8))
    v = model.init(jax.random.key(0), x)

    def shard(path, leaf):
      if path[-1].key == 'kernel' and leaf.shape[-1] == 16:
        spec = P(None, 'model')
      elif path[-1].key == 'kernel' and leaf.shape[0] == 16:
        spec = P('model', None)
      else:
        spec = P()
      return jax.device_put(leaf, NamedSharding(mesh, spec))

    sv = jax.tree_util.tree_map_with_path(shard, v)
    sx = jax.device_put(x, NamedSharding(mesh, P('data', None)))
    mox = yax.make_mox(model.apply)(v, x)
    loss = lambda f: (lambda v, x, *k: jnp.sum(jnp.sin(f(v, x, *k))))

    # remat on the mesh: the gradients of nn.remat, sharded alike.
    new = yax.remat(mox, '//module_call[@type="Block"]')
    got = jax.jit(jax.grad(loss(lambda v, x: yax.eval_mox(new, v, x))))(sv, sx)
    ref = jax.jit(jax.grad(loss(MLP(remat=True).apply)))(sv, sx)
    assert_trees_close(got, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree_util.tree_leaves(got),
                    jax.tree_util.tree_leaves(ref)):
      assert g.sharding.is_equivalent_to(r.sharding, g.ndim)

    # randomized_linear on the mesh: exact forward and input gradient; the
    # kernel gradient is the one of the unsharded run with the same key.
    rl = yax.randomized_linear(new, '//module_call[@type="Dense"]')
    key = jax.random.PRNGKey(3)
    f = loss(lambda v, x, k: yax.eval_mox(rl, v, x, sketch_key=k))
    out = jax.jit(lambda v, x, k: yax.eval_mox(rl, v, x, sketch_key=k))(
        sv, sx, key)
    assert_trees_close(out, model.apply(v, x), rtol=1e-5, atol=1e-6)
    assert len(out.sharding.device_set) == 8
    gx = jax.jit(jax.grad(f, 1))(sv, sx, key)
    assert_trees_close(gx, jax.grad(loss(model.apply), 1)(v, x), rtol=1e-5,
                       atol=1e-6)
    gv = jax.jit(jax.grad(f))(sv, sx, key)
    assert_trees_close(gv, jax.grad(f)(v, x, key), rtol=1e-4, atol=1e-5)
    print('MEMORY-MESH-OK')
''')


def test_remat_and_randomized_linear_on_a_2x4_mesh(tmp_path):
  run_on_host_devices(MESH_SCRIPT, tmp_path, 'MEMORY-MESH-OK')


def test_any_jax_key_is_a_sketch_key(block_mox):
  # A typed key (what JAX recommends) and a raw PRNGKey with the same data
  # draw the same sketches (failed before: "expected u32[2], given
  # key<fry>[]").
  new = yax.randomized_linear(block_mox, LINEAR)
  typed = jax.random.wrap_key_data(KEY)
  grad = jax.jit(jax.grad(loss(
      lambda v, x, k: yax.eval_mox(new, v, x, sketch_key=k))))
  assert_trees_close(grad(VARS, X, typed), grad(VARS, X, KEY), rtol=0, atol=0)
  np.testing.assert_array_equal(yax.eval_mox(new, VARS, X, sketch_key=typed),
                                BLOCK.apply(VARS, X))
  with pytest.raises(yax.SignatureError, match=r"kwargs\['sketch_key'\]"):
    yax.eval_mox(new, VARS, X, sketch_key=jnp.zeros((3,), jnp.uint32))


def _largest_value(jaxpr) -> int:
  """Elements of the largest value any equation of ``jaxpr`` (bodies
  included) computes."""
  most = 0
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      most = max(most, math.prod(getattr(v.aval, 'shape', ())))
    for sub in jax.core.jaxprs_in_params(eqn.params) if hasattr(
        jax.core, 'jaxprs_in_params') else ():
      most = max(most, _largest_value(sub))
    for p in eqn.params.values():
      inner = getattr(p, 'jaxpr', p)
      if hasattr(inner, 'eqns'):
        most = max(most, _largest_value(inner))
  return most


@pytest.mark.parametrize('kind', randomized.KINDS)
def test_the_count_sketch_builds_no_n_by_k_matrix(kind):
  # n = 512 rows of 4, k = 128: S would have 65,536 entries, the input
  # 2,048. The count sketch (the default) computes nothing of S's size in
  # the forward or the backward pass; the dense kinds do.
  model = nn.Dense(3)
  x = jax.random.normal(jax.random.key(2), (8, 64, 4))
  v = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(v, x)
  new = yax.randomized_linear(mox, '//module_call[@type="Dense"]',
                              ratio=0.25, kind=kind)
  mine = loss(lambda v, x, k: yax.eval_mox(new, v, x, sketch_key=k))
  most = _largest_value(jax.make_jaxpr(jax.grad(mine))(v, x, KEY).jaxpr)
  if kind == 'count':
    assert most < 512 * 128 // 8, most
  else:
    assert most >= 512 * 128, most


def test_count_sketch_is_signed_buckets():
  # S^T X of the count sketch against S written out by hand from the same
  # buckets and signs: one +-1 per row, in the row's bucket.
  key = jax.random.key(5)
  flat = jax.random.normal(jax.random.key(6), (40, 3))
  got = randomized.count_sketch(key, flat, 7)
  kb, ks = jax.random.split(key)
  buckets = np.asarray(jax.random.randint(kb, (40,), 0, 7))
  signs = np.asarray(jax.random.rademacher(ks, (40,), jnp.float32))
  s = np.zeros((40, 7))
  s[np.arange(40), buckets] = signs
  np.testing.assert_allclose(got, s.T @ np.asarray(flat, np.float64),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(randomized.sketch_matrix(key, 40, 7, 'count'),
                                s.astype(np.float32))


def test_refusals_give_the_figures_and_the_xpath_of_the_others():
  # One Dense reads 2 rows (a ratio of 0.6 keeps both: more than its input
  # with the key); the other 30 rows.
  class Two(nn.Module):
    @nn.compact
    def __call__(self, x, y):
      return nn.Dense(3, name='small')(x).sum() + nn.Dense(3, name='big')(y).sum()

  x, y = jnp.ones((2, 4)), jnp.ones((30, 4))
  v = Two().init(jax.random.key(0), x, y)
  mox = yax.make_mox(Two().apply)(v, x, y)
  with pytest.raises(yax.SubstitutionError) as err:
    yax.randomized_linear(mox, '//module_call[@type="Dense"]', ratio=0.6)
  text = str(err.value)
  assert "module_call Dense at path 'small'" in text
  assert ('its sketch would keep 40 bytes (2 of 2 rows at ratio 0.6, and the '
          '8-byte key), more than its input f32[2,4] (32 bytes)') in text
  assert "'big'" not in text
  fixed = text.splitlines()[-1].strip()
  assert fixed == '//module_call[@type="Dense"][not(@path="small")]'
  new = check_rewrite(yax.randomized_linear(mox, fixed, ratio=0.6))
  f = lambda v, k: yax.eval_mox(new, v, x, y, sketch_key=k)
  g = jax.grad(f)(v, KEY)['params']
  ref = jax.grad(lambda v: Two().apply(v, x, y))(v)['params']
  # 'small' is exact, 'big' sketched (y is all ones: the sketch differs).
  np.testing.assert_allclose(g['small']['kernel'], ref['small']['kernel'],
                             rtol=1e-6)
  assert not np.allclose(g['big']['kernel'], ref['big']['kernel'])


class TwoKernelMLP(nn.Module):
  """Two kernels contracted in one call, an activation between them (lora
  adapts each in place)."""

  @nn.compact
  def __call__(self, x):
    w1 = self.param('w1', nn.initializers.lecun_normal(), (x.shape[-1], 6))
    w2 = self.param('w2', nn.initializers.lecun_normal(), (6, 3))
    return jnp.tanh(x @ w1) @ w2


class Experts(nn.Module):
  """A MoE's experts, [experts, in, out], contracted by ragged_dot."""

  @nn.compact
  def __call__(self, x, sizes):
    w = self.param('experts', nn.initializers.normal(1.0), (3, 4, 3))
    return jax.lax.ragged_dot(x, w, sizes)


class MLPAndExperts(nn.Module):

  @nn.compact
  def __call__(self, x, sizes):
    return TwoKernelMLP(name='mlp')(x) + Experts(name='moe')(x, sizes)


def test_several_kernels_in_one_call_and_ragged_dot_experts():
  # Before: the MLP was refused ("it contracts several kernels"), and the
  # experts with the kernel plan's reason, without the XPath of the others.
  x = jax.random.normal(jax.random.key(2), (12, 4))
  sizes = jnp.array([5, 4, 3], jnp.int32)
  model = MLPAndExperts()
  v = model.init(jax.random.key(0), x, sizes)
  mox = yax.make_mox(model.apply)(v, x, sizes)
  with pytest.raises(yax.SubstitutionError) as err:
    yax.randomized_linear(mox, '//module_call[@type="TwoKernelMLP" or '
                          '@type="Experts"]')
  text = str(err.value)
  assert "Experts at path 'moe'" in text and "'mlp'" not in text
  assert 'params/experts is contracted by ragged_dot' in text
  fixed = text.splitlines()[-1].strip()
  assert yax.query(fixed, mox)[0].path == ('mlp',)
  new = check_rewrite(yax.randomized_linear(mox, fixed, ratio=0.5))

  def by_hand(p, x):  # the same model in plain JAX
    mlp, moe = p['params']['mlp'], p['params']['moe']
    return (jnp.tanh(x @ mlp['w1']) @ mlp['w2'] +
            jax.lax.ragged_dot(x, moe['experts'], sizes))

  f = lambda p, x, k: jnp.sum(jnp.sin(yax.eval_mox(new, p, x, sizes,
                                                   sketch_key=k)))
  ref = lambda p, x: jnp.sum(jnp.sin(by_hand(p, x)))
  np.testing.assert_allclose(yax.eval_mox(new, v, x, sizes, sketch_key=KEY),
                             by_hand(v, x), rtol=1e-6, atol=1e-6)
  assert_trees_close(jax.grad(f, 1)(v, x, KEY), jax.grad(ref, 1)(v, x),
                     rtol=1e-5, atol=1e-6)
  exact = jax.grad(ref)(v, x)['params']
  n = 400
  keys = jax.random.split(jax.random.PRNGKey(3), n)
  # lax.map, not vmap: JAX batches ragged_dot over axis 0 only.
  sampled = jax.jit(lambda ks: jax.lax.map(
      lambda k: jax.grad(f)(v, x, k)['params'], ks))(keys)
  for name in ('w1', 'w2'):  # both kernels sketched: unbiased, not exact
    assert_unbiased(sampled['mlp'][name], exact['mlp'][name], n)
  np.testing.assert_allclose(sampled['moe']['experts'][0],
                             exact['moe']['experts'], rtol=1e-5, atol=1e-6)
