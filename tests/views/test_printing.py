"""str(mox): Jaxpr syntax with module_call blocks (exact strings)."""

import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from helpers import modules
from yax._src.views.printing import module_attributes

KEY = jax.random.key(0)


class Scale(nn.Module):
  features: int = 3
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    w = self.param('w', nn.initializers.ones, x.shape)
    return x * w + 1.0


class Twice(nn.Module):
  @nn.compact
  def __call__(self, x):
    s = Scale(name='s', use_bias=False)
    return s(s(x)) - x


@pytest.fixture(scope='module')
def twice():
  model = Twice()
  x = jnp.ones((2, 3))
  variables = model.init(KEY, x)
  return yax.make_mox(model.apply)(variables, x)


def expect(text):
  return textwrap.dedent(text).strip('\n')


def test_module_calls_print_as_nested_blocks(twice):
  assert str(twice) == expect('''
      { lambda ; a:f32[2,3] b:f32[2,3]. let
          c:f32[2,3] = module_call[type=Twice method=__call__] { lambda ; a:f32[2,3] b:f32[2,3]. let
              d:f32[2,3] = module_call[
                type=Scale
                name=s
                path=s
                method=__call__
                features=3
                use_bias=False
              ] { lambda ; a:f32[2,3] b:f32[2,3]. let
                  e:f32[2,3] = mul b a
                  d:f32[2,3] = add e 1.0:f32[]
                in (d,) }
              f:f32[2,3] = module_call[
                type=Scale
                name=s
                path=s
                method=__call__
                features=3
                use_bias=False
              ] { lambda ; a:f32[2,3] d:f32[2,3]. let
                  g:f32[2,3] = mul d a
                  f:f32[2,3] = add g 1.0:f32[]
                in (f,) }
              c:f32[2,3] = sub f b
            in (c,) }
        in (c,) }''')


def test_one_module_call_prints_as_function_of_its_inputs(twice):
  first = modules(twice, 'Scale')[0]
  assert str(first) == expect('''
      { lambda ; a:f32[2,3] b:f32[2,3]. let
          c:f32[2,3] = module_call[
            type=Scale
            name=s
            path=s
            method=__call__
            features=3
            use_bias=False
          ] { lambda ; a:f32[2,3] b:f32[2,3]. let
              d:f32[2,3] = mul b a
              c:f32[2,3] = add d 1.0:f32[]
            in (c,) }
        in (c,) }''')


def test_one_equation_prints_alone(twice):
  add = modules(twice, 'Scale')[0].children[1]
  # The literal operand is not a binder.
  assert str(add) == '{ lambda ; a:f32[2,3]. let b:f32[2,3] = add a 1.0:f32[] in (b,) }'


def test_module_attributes(twice):
  first = modules(twice, 'Scale')[0]
  assert module_attributes(first) == [
      ('type', 'Scale'), ('name', 's'), ('path', 's'), ('method', '__call__'),
      ('features', '3'), ('use_bias', 'False')]
  top = twice.children[0]
  assert module_attributes(top) == [('type', 'Twice'), ('method', '__call__')]
  assert module_attributes(twice) == []


def test_nested_ephemeral_node_is_marked():
  inner = yax.make_mox(lambda x: jnp.sin(x) + 1)(jnp.ones(3))
  outer = yax.Mox(inner.inputs, inner.outputs, children=[inner])
  assert str(outer) == expect('''
      { lambda ; a:f32[3]. let
          b:f32[3] = module_call[ephemeral=True] { lambda ; a:f32[3]. let
              c:f32[3] = sin a
              b:f32[3] = add c 1.0:f32[]
            in (b,) }
        in (b,) }''')


def test_dense_fields_are_shown_and_none_omitted():
  model = nn.Dense(4, use_bias=True, name=None)
  x = jnp.ones((1, 2))
  variables = model.init(KEY, x)
  text = str(yax.make_mox(model.apply)(variables, x))
  for line in ('type=Dense', 'method=__call__', 'features=4', 'use_bias=True',
               'param_dtype=float32',
               "kernel_init=variance_scaling(1.0, 'fan_in', 'truncated_normal')"):
    assert '\n      ' + line + '\n' in text, line
  assert 'dtype=None' not in text and 'precision' not in text
  assert 'dot_general[' in text


@pytest.mark.parametrize('fn', [
    lambda x: jnp.tanh(x) @ x.T,
    lambda x: (x * np.float32(3), jnp.zeros(2)),
    lambda x: jax.jit(lambda y: y + 1, inline=False)(x).sum(),
    lambda x: nn.softmax(x, axis=-1),
    lambda x: jax.lax.associative_scan(jnp.add, x, axis=1),
], ids=['matmul', 'consts', 'jit', 'softmax', 'assoc_scan'])
def test_no_modules_prints_exactly_like_make_jaxpr(fn):
  x = jnp.arange(6.0).reshape(2, 3)
  assert str(yax.make_mox(fn)(x)) == str(jax.make_jaxpr(fn)(x))


def test_lifted_scan_body_prints_module_calls_and_inlines_like_jax():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, c, _):
      return Scale(name='s')(c), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.scan(Block, variable_axes={'params': 0},
                     split_rngs={'params': True}, length=2)(name='stack')(
                         x, None)[0]

  model = Stack()
  x = jnp.ones((2, 3))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  text = str(mox)
  assert 'scan[\n' in text
  assert 'jaxpr={ lambda ; ' in text
  assert text.count('module_call[') == 3  # Stack, then Block and Scale
  assert 'path=stack/s' in text
  # With module calls inlined, the text is JAX's own.
  assert str(yax.to_jaxpr(mox)) == str(jax.make_jaxpr(model.apply)(variables, x))


def test_static_arguments_are_not_binders():
  class Drop(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool):
      return nn.Dropout(0.5)(x, deterministic=deterministic)

  model = Drop()
  x = jnp.ones((2, 2))
  mox = yax.make_mox(model.apply)({}, x, True)
  # The bool is baked in: the printed function takes x only.
  assert str(mox).startswith('{ lambda ; a:f32[2,2]. let')
  assert 'type=Dropout' in str(mox)
