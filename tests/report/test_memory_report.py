"""yax.memory_report against JAX's own saved_residuals on the same step:
the same total (arguments excluded), each residual in the row of the
module call that computes it (checked here by shapes that only that call
produces), exclusive of its submodules' rows."""

from __future__ import annotations

import contextlib
import io
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import yax


class Act(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(x)


class Net(nn.Module):
  """Widths 16 (only ``act`` computes values of that shape that the
  backward pass needs) and 8 (the output; the loss computes ``cos``)."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name='down')(Act(name='act')(nn.Dense(16, name='up')(x)))


X = jax.random.normal(jax.random.key(1), (4, 5))
NET = Net()
VARS = NET.init(jax.random.key(0), X)


def loss(p, x):
  return jnp.sum(jnp.sin(NET.apply(p, x)))


ITEMSIZE = {'f64': 8, 'f32': 4, 'bf16': 2, 'f16': 2, 'i32': 4, 'u32': 4,
            'i8': 1, 'u8': 1, 'bool': 1}


def jax_residuals(fn, params):
  """``(type, bytes, source)`` of what ``print_saved_residuals(fn,
  params)`` prints, but the arguments, constants and literals."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(fn, params)
  out = []
  for line in buf.getvalue().splitlines():
    kind, _, src = line.partition(' ')
    if not line or src.startswith(('from the argument', 'from a constant',
                                   'from a literal')):
      continue
    dtype, dims = re.fullmatch(r'(\w+)\[([\d,]*)\]', kind).groups()
    shape = [int(d) for d in dims.split(',') if d]
    out.append((kind, math.prod(shape) * ITEMSIZE[dtype], src))
  return out


def test_rows_total_and_training_memory_against_saved_residuals():
  report = yax.memory_report(loss, VARS, X)
  ref = jax_residuals(lambda p: loss(p, X), VARS)
  assert report.total == sum(b for _, b, _ in ref)
  assert sorted(report.unattributed_residuals + tuple(
      t for r in report.rows for t in r.residuals)) == sorted(
          t for t, _, _ in ref)
  by_path = report.by_path()
  assert list(by_path) == ['<Net>', 'up', 'act', 'down']
  # tanh and its derivative (JAX keeps both), computed by act: JAX names
  # Act.__call__ as their source.
  assert by_path['act'] == sum(b for t, b, _ in ref if t == 'f32[4,16]') == \
      sum(b for _, b, src in ref if src.endswith('(Act.__call__)')) > 0
  assert by_path['up'] == by_path['down'] == by_path['<Net>'] == 0
  # cos of the output, computed by the loss outside every module.
  assert report.unattributed == sum(b for t, b, _ in ref if t == 'f32[4,8]')
  params = sum(x.nbytes for x in jax.tree_util.tree_leaves(VARS))
  assert report.param_bytes == params
  assert report.training == 4 * params + report.total
  assert report.xla['temp'] >= 0 and report.xla['argument'] >= params
  text = str(report)
  assert 'act' in text and f'{report.total:,}' in text


class Outer(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(16, name='inner')(x))  # tanh in Outer's body
    return jnp.sum(nn.Dense(3, name='head')(h) ** 2)


def test_rows_are_exclusive_and_follow_rewrites():
  model = Outer()
  v = model.init(jax.random.key(0), X)
  report = yax.memory_report(model.apply, v, X)
  ref = jax_residuals(lambda p: model.apply(p, X), v)
  rows = report.by_path()
  assert report.total == sum(b for _, b, _ in ref)
  # Outer's own body computes tanh (two f32[4,16]) and 2 * y of the
  # square (f32[4,3]); its Dense calls compute nothing that is kept.
  assert rows['inner'] == rows['head'] == report.unattributed == 0
  assert rows['<Outer>'] == sum(
      b for t, b, _ in ref if t in ('f32[4,16]', 'f32[4,3]')) == report.total
  # After fewbit (the loss calls eval_mox: its tree's calls are the rows),
  # the FewBit call keeps the 3-bit codes of tanh's input (one packed
  # uint8 buffer) and its output (head's input), where Outer kept tanh's
  # output and derivative, two f32[4,16].
  mox = yax.make_mox(model.apply)(v, X)
  few = yax.fewbit(mox, bits=3)
  yax.check_mox(few)
  after = yax.memory_report(lambda p, x: yax.eval_mox(few, p, x), v, X,
                            xla=False)
  assert after.xla is None
  kept = after.by_path()
  codes = math.ceil(4 * 16 * 3 / 8)
  assert kept['tanh'] == codes + 4 * 16 * 4  # the FewBit call at path 'tanh'
  assert kept['<Outer>'] == 4 * 3 * 4  # 2 * y
  assert after.total == sum(
      b for _, b, _ in jax_residuals(
          lambda p: yax.eval_mox(few, p, X), v))


class NBlock(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(5, 16, rngs=rngs)
    self.out = nnx.Linear(16, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.gelu(self.fc(x)))


def test_nnx_state_as_params():
  graphdef, state = nnx.split(NBlock(nnx.Rngs(0)))

  def nloss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

  report = yax.memory_report(nloss, state, X, xla=False)
  ref = jax_residuals(lambda s: nloss(s, X), state)
  assert report.total == sum(b for _, b, _ in ref)
  # JAX names the function that computes each residual: fc's output
  # (GELU's input) in Linear.__call__, GELU's tensors in NBlock's body
  # (four on JAX 0.12, five on 0.8: jax.nn.gelu changed), 2 * y in the loss.
  def where(fn):
    return sum(b for _, b, src in ref if src.endswith(f'{fn})'))

  rows = report.by_path()
  assert rows['fc'] == where('Linear.__call__') == 4 * 16 * 4
  gelu = where('NBlock.__call__')
  assert gelu % (4 * 16 * 4) == 0 and gelu >= 4 * 4 * 16 * 4
  assert rows['<NBlock>'] == gelu
  assert rows['out'] == 0
  assert report.unattributed == where('nloss')


def test_refuses_without_arguments():
  with pytest.raises(yax.SignatureError, match='the params first'):
    yax.memory_report(loss)


def test_summary_shows_the_bytes_each_call_saves():
  mox = yax.make_mox(NET.apply)(VARS, X)
  report = yax.memory_report(lambda p, x: loss_of(yax.eval_mox(mox, p, x)),
                             VARS, X, xla=False)
  ref = jax_residuals(lambda p: loss_of(NET.apply(p, X)), VARS)
  rows = yax.summary(mox, memory=report)
  saved = {r.path: r.saved for r in rows}
  # Only act computes what the backward pass keeps (tanh and its
  # derivative, f32[4,16]), as JAX's own listing says.
  assert saved == {'': 0, 'up': 0, 'act': sum(
      b for t, b, _ in ref if t == 'f32[4,16]'), 'down': 0}
  assert saved['act'] > 0
  assert all(r.saved is None for r in yax.summary(mox))
  text = yax.format_summary(mox, memory=report)
  header = next(line for line in text.splitlines() if 'path' in line)
  assert 'saved' in header
  act = next(line for line in text.splitlines() if ' act ' in line)
  assert f'{saved["act"]:,}' in act
  assert f'Saved for the backward pass: {report.total:,} bytes' in text
  assert 'saved' not in yax.format_summary(mox)


def loss_of(y):
  return jnp.sum(jnp.sin(y))


# The recompute transient: while the backward pass of a checkpoint runs,
# its body is recomputed and keeps its residuals. Written by hand with
# print_saved_residuals on the same bodies, without and with the
# checkpoint.

def mlp(p, x):
  h = jnp.tanh(x @ p['w1'])
  return jnp.tanh(h @ p['w2'])


P_MLP = {'w1': jax.random.normal(jax.random.key(2), (5, 16)),
         'w2': jax.random.normal(jax.random.key(3), (16, 8))}


def kept_bytes(fn, params) -> int:
  return sum(b for _, b, _ in jax_residuals(fn, params))


@pytest.mark.parametrize('policy', [None, 'dots_saveable'])
def test_recompute_of_a_checkpoint_is_its_body_kept_without_minus_with(
    policy):
  policy = policy and jax.checkpoint_policies.dots_saveable
  ckpt = jax.checkpoint(mlp, policy=policy)

  def step(p, x):  # under jit too: the checkpoint is found in its body
    return jnp.sum(jnp.sin(jax.jit(ckpt)(p, x)))

  report = yax.memory_report(step, P_MLP, X, xla=False)
  without = kept_bytes(lambda p: mlp(p, X), P_MLP)
  with_ = kept_bytes(lambda p: ckpt(p, X), P_MLP)
  assert without > with_ >= 0
  assert report.recompute == without - with_
  assert report.total == kept_bytes(lambda p: step(p, X), P_MLP)
  assert report.peak == report.training + report.recompute
  text = str(report)
  assert f'{report.recompute:,}' in text and f'{report.peak:,}' in text


def test_no_checkpoint_no_recompute():
  report = yax.memory_report(loss, VARS, X, xla=False)
  assert report.recompute == 0 and report.peak == report.training


def test_recompute_of_nested_checkpoints_adds_the_inner_one():
  inner = jax.checkpoint(mlp)

  def body(p, x):  # the outer checkpoint's body, the inner one kept
    return mlp(p['b'], inner(p['a'], x) @ p['up'])

  def step(p, x):
    return jnp.sum(jax.checkpoint(body)(p, x))

  p = {'a': P_MLP, 'b': P_MLP, 'up': jax.random.normal(jax.random.key(4),
                                                       (8, 5))}
  report = yax.memory_report(step, p, X, xla=False)
  # The outer body's residuals (the inner checkpoint keeps its inputs
  # only), then the inner body's while its own backward pass runs.
  assert report.recompute == kept_bytes(lambda q: body(q, X), p) + \
      kept_bytes(lambda q: mlp(q, X), P_MLP)


W = jax.random.normal(jax.random.key(5), (3, 8, 8))
C = jax.random.normal(jax.random.key(6), (4, 8))


def layer(w, c):
  return jnp.tanh(jnp.tanh(c @ w) @ w)


def test_recompute_of_a_checkpoint_in_a_scan_is_one_iteration():
  def step(ws, c):
    y, _ = jax.lax.scan(lambda c, w: (jax.checkpoint(layer)(w, c), None), c,
                        ws)
    return jnp.sum(y ** 2)

  report = yax.memory_report(step, W, C, xla=False)
  # One layer, differentiated with respect to its weight and its carry
  # (which depends on the weights after the first iteration); not three.
  one = kept_bytes(lambda wc: layer(*wc), (W[0], C))
  assert one > 0 and report.recompute == one
  assert report.total == kept_bytes(lambda ws: step(ws, C), W)


def test_recompute_of_a_checkpointed_scan_counts_every_iteration():
  def scanned(ws, c):
    return jax.lax.scan(lambda c, w: (layer(w, c), None), c, ws)[0]

  def step(ws, c):
    return jnp.sum(jax.checkpoint(scanned)(ws, c) ** 2)

  report = yax.memory_report(step, W, C, xla=False)
  stacked = kept_bytes(lambda ws: scanned(ws, C), W)
  assert stacked > kept_bytes(lambda wc: layer(*wc), (W[0], C))
  assert report.recompute == stacked
