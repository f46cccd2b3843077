"""Readable attribute values for initializers, partials and other callables
(printing, XML and the viewer all use yax._src.ir.text.format_value)."""

from __future__ import annotations

import functools
import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import yax
from yax._src.ir.text import format_value


def make_act(power):
  def act(x):
    return x ** power
  return act


@pytest.mark.parametrize('value,text', [
    (nn.initializers.lecun_normal(),
     "variance_scaling(1.0, 'fan_in', 'truncated_normal')"),
    (jax.nn.initializers.he_uniform(), "variance_scaling(2.0, 'fan_in', 'uniform')"),
    (jax.nn.initializers.variance_scaling(0.5, 'fan_out', 'normal', in_axis=0),
     "variance_scaling(0.5, 'fan_out', 'normal', 0)"),
    (nn.initializers.xavier_normal(batch_axis=(0,)),
     "variance_scaling(1.0, 'fan_avg', 'truncated_normal', batch_axis=(0,))"),
    (jax.nn.initializers.normal(0.02), 'normal(0.02)'),
    (nn.initializers.constant(0.5), 'constant(0.5)'),
    (nn.initializers.zeros, 'jax.nn.initializers.zeros'),
    (nn.initializers.zeros_init(), 'jax.nn.initializers.zeros'),
    (jax.nn.gelu, 'jax.nn.gelu'),
    (functools.partial(jax.nn.gelu, approximate=False),
     'partial(jax.nn.gelu, approximate=False)'),
    (functools.partial(jnp.clip, 0.0), 'partial(jax.numpy.clip, 0.0)'),
    (make_act(3), 'make_act(3)'),  # a module-level factory of this file
    (nn.Dense, 'flax.linen.linear.Dense'),
])
def test_callables_read_well(value, text):
  assert format_value(value) == text


def test_unrecoverable_closures_fall_back_to_the_short_name():
  def outer(n):
    def inner(x):
      return x * n
    return inner
  # outer is local to this test, so it cannot be looked up by name.
  assert format_value(outer(2)) == \
      'test_unrecoverable_closures_fall_back_to_the_short_name.outer.inner'
  assert format_value(lambda x: x).endswith('<lambda>')
  assert '<locals>' not in format_value(lambda x: x)


def test_dense_attributes_in_print_xml_and_query():
  m = nn.Dense(3, kernel_init=nn.initializers.normal(0.02))
  x = jnp.ones((1, 2))
  mox = yax.make_mox(m.apply)(m.init(jax.random.key(0), x), x)
  assert 'kernel_init=normal(0.02)' in str(mox)
  buf = io.StringIO()
  yax.dump_xml(mox, buf)
  assert 'kernel_init="normal(0.02)"' in buf.getvalue()
  assert '&lt;locals&gt;' not in buf.getvalue()
  assert len(yax.query('//module_call[@kernel_init="normal(0.02)"]', mox)) == 1
  assert yax.query('string(//module_call/@bias_init)', mox) == \
      'jax.nn.initializers.zeros'
