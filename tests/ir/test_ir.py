"""The data model: modified copies of nodes share no mutable field."""

import jax
import jax.numpy as jnp

import yax
from yax._src.ir.nodes import Equation, Mox, Var

F32 = jax.core.ShapedArray((2,), jnp.float32)


def _equation():
  a, b = Var(F32), Var(F32)
  body = Mox([Var(F32)], [Var(F32)])
  return Equation(jax.lax.sin_p, [a], [b], {'accuracy': None},
                  children=[body], body_keys=['jaxpr'], body_forms=['closed'])


def _module():
  eqn = _equation()
  return Mox(list(eqn.inputs), list(eqn.outputs), {'name': 'm'},
             children=[eqn], path=('m',), constvars=[Var(F32)],
             consts=[jnp.zeros(2)])


def _fields(node):
  names = ['inputs', 'outputs', 'params', 'children']
  names += (['body_keys', 'body_forms'] if isinstance(node, Equation)
            else ['constvars', 'consts'])
  return {n: getattr(node, n) for n in names}


def test_replace_copies_every_mutable_field_it_keeps():
  for node in (_equation(), _module()):
    before = {n: list(v) if isinstance(v, list) else dict(v)
              for n, v in _fields(node).items()}
    copy = node.replace(outputs=[Var(F32)])
    for name, value in _fields(copy).items():
      assert value is not getattr(node, name), name
      assert value == before[name] or name == 'outputs', name
    # Editing the copy in place leaves the original as it was.
    copy.inputs.append(Var(F32))
    copy.params['extra'] = 1
    copy.children.clear()
    for name in ('constvars', 'consts', 'body_keys', 'body_forms'):
      if hasattr(copy, name):
        getattr(copy, name).append(None)
    assert _fields(node) == before
    # And the reverse.
    node.inputs.clear()
    node.params.clear()
    assert copy.inputs and copy.params


def test_replace_does_not_keep_the_callers_containers():
  node = _module()
  inputs, params = [Var(F32)], {'name': 'n'}
  copy = node.replace(inputs=inputs, params=params)
  assert copy.inputs == inputs and copy.params == params
  inputs.append(Var(F32))
  params['name'] = 'changed'
  assert len(copy.inputs) == 1 and copy.params == {'name': 'n'}


def test_replace_shares_the_elements():
  # Symbols have identity and children are immutable: a copy holds the
  # same objects in new lists.
  node = _module()
  copy = node.replace(path=('other',))
  assert copy.path == ('other',) and node.path == ('m',)
  assert all(a is b for a, b in zip(copy.inputs, node.inputs, strict=True))
  assert copy.children[0] is node.children[0]
  assert copy.consts[0] is node.consts[0]


def test_replace_of_a_traced_tree_leaves_the_tree_unchanged():
  mox = yax.make_mox(lambda x: jnp.sin(x) + 1.0)(jnp.ones(2))
  text = str(mox)
  copy = mox.replace()
  copy.children.pop()
  copy.outputs.clear()
  copy.params['name'] = 'x'
  assert str(mox) == text and mox.outputs and not mox.params
  assert len(copy.children) == len(mox.children) - 1
