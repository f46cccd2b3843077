"""yax.lean_norm on Equinox's own norms (``eqx.nn.LayerNorm``,
``eqx.nn.RMSNorm``) against the plain Equinox model: each call keeps its
type, path and fields, outputs equal within float rounding, gradients
(params and input) equal to ``jax.grad`` of the plain model, and JAX's
saved residuals: each norm keeps its input and per-row statistics where
Equinox's keeps several full-size tensors.

NEWEST_ONLY in .ci/run: Equinox is installed in the newest venv only.
"""

from __future__ import annotations

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from helpers import assert_trees_close, check_rewrite, saved_residuals


class Net(eqx.Module):
  """Linear, LayerNorm, RMSNorm (with a bias, Equinox's default), Linear;
  the norms run per example under ``jax.vmap``, as Equinox writes them."""
  up: eqx.nn.Linear
  ln: eqx.nn.LayerNorm
  rms: eqx.nn.RMSNorm
  down: eqx.nn.Linear

  def __init__(self, features, eps, key):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    self.up = eqx.nn.Linear(5, features, key=k1)
    self.ln = eqx.nn.LayerNorm(features, eps=eps)
    self.rms = eqx.nn.RMSNorm(features, eps=eps)
    self.down = eqx.nn.Linear(features, 4, key=k2)
    # Scales and biases away from 1 and 0, so their gradients matter.
    moved = lambda k, a: a + 0.3 * jax.random.normal(k, a.shape)
    self.ln = eqx.tree_at(lambda n: (n.weight, n.bias), self.ln,
                          (moved(k3, self.ln.weight),
                           moved(k4, self.ln.bias)))
    self.rms = eqx.tree_at(lambda n: n.bias, self.rms,
                           moved(k5, self.rms.bias))

  def __call__(self, x):
    h = jax.vmap(self.up)(x)
    return jax.vmap(self.down)(jax.vmap(self.rms)(jax.vmap(self.ln)(h)))


def loss(run):
  """``loss(params, x)`` of a function of ``(model, x)``, differentiated
  with respect to the model's arrays."""
  def f(params, x, static):
    return jnp.sum(jnp.sin(run(eqx.combine(params, static), x)))
  return f


def split(model):
  return eqx.partition(model, eqx.is_inexact_array)


@hypothesis.given(rows=st.integers(1, 6), features=st.integers(2, 20),
                  eps=st.sampled_from([1e-5, 0.1]))
@hypothesis.settings(max_examples=2, deadline=None)
def test_outputs_and_gradients_are_equinoxs(rows, features, eps):
  model = Net(features, eps, jax.random.key(rows))
  # Large means, where a one-pass variance would lose digits.
  x = 3.0 * jax.random.normal(jax.random.key(1), (rows, 5)) + 20.0
  plain = lambda m, x: m(x)
  mox = yax.make_mox(plain)(model, x)
  before = mox.to_json()
  new = check_rewrite(yax.lean_norm(mox))
  assert mox.to_json() == before
  # Each call keeps its type, path and fields, marked lean="norm".
  kept = yax.query('//module_call[@type="LayerNorm" or @type="RMSNorm"]',
                   new)
  assert [(n.type_name, n.path, n.params.get('lean')) for n in kept] == [
      ('LayerNorm', ('ln',), 'norm'), ('RMSNorm', ('rms',), 'norm')]
  assert all(n.module_ty.__module__.startswith('equinox.') for n in kept)
  mine = lambda m, x: yax.eval_mox(new, m, x)
  np.testing.assert_allclose(mine(model, x), plain(model, x), rtol=1e-5,
                             atol=1e-5)
  params, static = split(model)
  got = jax.grad(loss(mine), (0, 1))(params, x, static)
  want = jax.grad(loss(plain), (0, 1))(params, x, static)
  assert_trees_close(got, want, rtol=2e-4, atol=2e-5)


def test_each_norm_keeps_its_input_and_row_statistics():
  model = Net(16, 1e-5, jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (6, 5))
  mox = yax.make_mox(lambda m, x: m(x))(model, x)
  new = check_rewrite(yax.lean_norm(mox))
  params, static = split(model)
  mine = loss(lambda m, x: yax.eval_mox(new, m, x))
  lean = saved_residuals(lambda p, x: mine(p, x, static), params, x)
  # ln keeps its input (up's output), mean and rstd; rms its input (ln's
  # output) and rstd; down its input (rms's output); the loss cos of the
  # output.
  assert lean == sorted(['f32[6,16]'] * 3 + ['f32[6,1]'] * 3 + ['f32[6,4]'])
  plain = saved_residuals(lambda p, x: loss(lambda m, x: m(x))(p, x, static),
                          params, x)
  assert plain.count('f32[6,16]') > 3 + 3  # several per norm in Equinox


def test_variance_as_equinox_computes_it():
  # Equinox's jnp.var is two-pass; E[x^2] - E[x]^2 would lose the variance
  # of rows with a large mean (1000 +- 1 here).
  model = Net(16, 1e-5, jax.random.key(0))
  model = eqx.tree_at(lambda m: m.up.bias, model, model.up.bias + 1000.0)
  x = jax.random.normal(jax.random.key(1), (4, 5))
  new = check_rewrite(yax.lean_norm(yax.make_mox(lambda m, x: m(x))(model,
                                                                    x)))
  np.testing.assert_allclose(yax.eval_mox(new, model, x), model(x),
                             rtol=1e-4, atol=1e-4)


def test_refuses_a_norm_over_several_axes():
  class Wide(eqx.Module):
    ln: eqx.nn.LayerNorm
    ok: eqx.nn.LayerNorm

    def __init__(self):
      self.ln = eqx.nn.LayerNorm((3, 4))
      self.ok = eqx.nn.LayerNorm(4)

    def __call__(self, x):
      return jax.vmap(self.ok)(self.ln(x))

  model, x = Wide(), jax.random.normal(jax.random.key(0), (3, 4))
  mox = yax.make_mox(lambda m, x: m(x))(model, x)
  before = mox.to_json()
  with pytest.raises(yax.SubstitutionError) as err:
    yax.lean_norm(mox)
  text = str(err.value)
  assert "module_call LayerNorm at path 'ln': it normalises over " \
         "shape=(3, 4)" in text and "'ok'" not in text
  assert mox.to_json() == before
  fixed = text.splitlines()[-1].strip()
  new = check_rewrite(yax.lean_norm(mox, fixed))
  assert yax.query('//module_call[@lean="norm"]/@path', new) == ['ok']
  np.testing.assert_allclose(yax.eval_mox(new, model, x), model(x),
                             rtol=1e-5, atol=1e-5)
