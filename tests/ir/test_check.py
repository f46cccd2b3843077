"""check_mox on trees built any way: only InvariantError (or success).

The trees are real traces; each test corrupts one thing (a constant, a
field, a symbol) the way a buggy rewrite or a hand-built tree could, and
expects ``yax.InvariantError`` naming it, never a raw exception.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import yax
from yax._src.ir.nodes import iter_nodes
from yax._src.ir.variables import var_keys

TABLE = np.arange(4.0, dtype=np.float32)  # closed over: a constant of the tree


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(4)(x)) * TABLE


class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = Block()(x)
    x = nn.remat(nn.Dense)(4, name='remat')(x)
    return jax.lax.fori_loop(0, 2, lambda i, c: c * 0.5 + 1.0, x)


@functools.lru_cache(maxsize=None)
def traced():
  x = jnp.ones((2, 4))
  v = Model().init(jax.random.key(0), x)
  return yax.make_mox(Model().apply)(v, x)


def rebuilt(node):
  """A copy of the tree with new nodes and new containers (same symbols):
  corrupting it leaves the traced tree intact."""
  return node.replace(children=[rebuilt(c) for c in node.children])


def nodes_of(mox):
  return list(iter_nodes(mox))


def with_consts(mox, consts):
  return mox.replace(consts=consts)


def test_the_traced_tree_is_valid_and_has_a_constant():
  mox = traced()
  yax.check_mox(mox)
  assert len(mox.consts) == 1
  np.testing.assert_array_equal(np.asarray(mox.consts[0]), TABLE)


@pytest.mark.parametrize('value, message', [
    (np.arange(5.0, dtype=np.float32), r'has shape \(5,\)'),
    (np.arange(4, dtype=np.int32), 'has dtype int32'),
    (np.arange(4.0, dtype=np.float16).reshape(2, 2), r'has shape \(2, 2\)'),
    (jnp.zeros((), jnp.float32), r'has shape \(\)'),
    ('four', 'has shape|not an array'),
])
def test_a_constant_of_another_shape_or_dtype_is_rejected(value, message):
  mox = traced()
  broken = with_consts(mox, [value])
  with pytest.raises(yax.InvariantError, match=f'constant 0.*({message})'):
    yax.check_mox(broken)
  # The same constant lowered to JAX would not be what its Jaxpr says.
  assert np.shape(value) != TABLE.shape or np.asarray(value).dtype != TABLE.dtype


def test_a_literal_of_another_shape_is_rejected():
  mox = yax.make_mox(lambda x: x * 2.0)(jnp.ones(3))
  (mul,) = [n for n in iter_nodes(mox) if isinstance(n, yax.Equation)]
  lit = next(s for s in mul.inputs if isinstance(s, yax.Literal))
  bad = yax.Literal(np.ones((2,), np.float32), lit.aval)
  broken = mox.replace(children=[mul.replace(inputs=[mul.inputs[0], bad])])
  with pytest.raises(yax.InvariantError, match='literal'):
    yax.check_mox(broken)


def _corruptions():
  """(description, function from a rebuilt tree to a corrupted one)."""
  def first(mox, kind):
    return next(n for n in iter_nodes(mox) if isinstance(n, kind)
                and n is not mox)

  def set_field(kind, field, value):
    def corrupt(mox):
      node = first(mox, kind) if kind is not None else mox
      object.__setattr__(node, field, value) if False else setattr(
          node, field, value)
      return mox
    return corrupt

  def delete_field(kind, field):
    def corrupt(mox):
      node = first(mox, kind)
      delattr(node, field)
      return mox
    return corrupt

  def cycle(mox):
    node = first(mox, yax.Mox)
    node.children.append(node)
    return mox

  out = [
      ('inputs is None', set_field(yax.Equation, 'inputs', None)),
      ('inputs is a str', set_field(yax.Mox, 'inputs', 'abc')),
      ('outputs is a dict', set_field(yax.Equation, 'outputs', {'a': 1})),
      ('a symbol is an int', set_field(yax.Equation, 'inputs', [3])),
      ('a symbol is a str', set_field(yax.Mox, 'outputs', ['x'])),
      ('a bare Symbol', set_field(yax.Equation, 'outputs',
                                  [yax.Symbol(None)])),
      ('a Var without aval', set_field(yax.Equation, 'outputs',
                                       [yax.Var(None)])),
      ('a Var with a str aval', set_field(yax.Equation, 'outputs',
                                          [yax.Var('f32[3]')])),
      ('children is None', set_field(yax.Mox, 'children', None)),
      ('a child is an int', set_field(yax.Mox, 'children', [1])),
      ('params is a list', set_field(yax.Equation, 'params', [])),
      ('prim is a str', set_field(yax.Equation, 'prim', 'add')),
      ('path is an int', set_field(yax.Mox, 'path', 5)),
      ('path holds ints', set_field(yax.Mox, 'path', (1, 2))),
      ('var_tree is None', set_field(yax.Mox, 'var_tree', None)),
      ('in_tree is a list', set_field(yax.Mox, 'in_tree', [])),
      ('module_ty is a str', set_field(yax.Mox, 'module_ty', 'Dense')),
      ('entrypoint is an int', set_field(yax.Mox, 'entrypoint', 1)),
      ('constvars hold a literal', set_field(
          None, 'constvars', [yax.Literal(1.0)])),
      ('consts is None', set_field(None, 'consts', None)),
      ('body_keys is None', set_field(yax.Equation, 'body_keys', None)),
      ('effects is None', set_field(yax.Equation, 'effects', None)),
      ('no inputs slot', delete_field(yax.Equation, 'inputs')),
      ('no path slot', delete_field(yax.Mox, 'path')),
      ('a node holds itself', cycle),
  ]
  return out


@pytest.mark.parametrize('what, corrupt', _corruptions(),
                         ids=[w for w, _ in _corruptions()])
def test_odd_trees_raise_invariant_error(what, corrupt):
  broken = corrupt(rebuilt(traced()))
  with pytest.raises(yax.InvariantError):
    yax.check_mox(broken)
  yax.check_mox(traced())  # the traced tree is untouched


ODD_VALUES = [None, 0, -1, 2.5, True, 'x', b'x', (), [], {}, (1, 2), [None],
              ['x'], [0], {'k': None}, object(), frozenset(), np.float32(1),
              np.zeros((2, 3)), jnp.zeros(4), jax.ShapeDtypeStruct((4,), jnp.int8),
              jax.tree_util.tree_structure((1, 2)), jax.lax.add_p, len,
              yax.Var(jax.core.ShapedArray((9,), jnp.float32)),
              yax.Literal(np.float32(1)),
              yax.Literal(np.zeros(3, np.float32),
                          jax.core.ShapedArray((3,), jnp.float32))]


@st.composite
def corruption(draw):
  node_pos = draw(st.integers(0, 10_000))
  field_pos = draw(st.integers(0, 100))
  kind = draw(st.sampled_from(['replace', 'element', 'append', 'drop',
                               'swap', 'aval']))
  value = draw(st.sampled_from(range(len(ODD_VALUES))))
  other = draw(st.integers(0, 10_000))
  return node_pos, field_pos, kind, value, other


@given(corruption())
def test_check_mox_raises_only_invariant_error_on_corrupted_trees(change):
  node_pos, field_pos, kind, value_pos, other = change
  mox = rebuilt(traced())
  nodes = nodes_of(mox)
  node = nodes[node_pos % len(nodes)]
  fields = sorted(n for c in type(node).__mro__
                  for n in getattr(c, '__slots__', ()) if n != '__weakref__')
  field = fields[field_pos % len(fields)]
  value = ODD_VALUES[value_pos]
  current = getattr(node, field, None)
  if kind == 'replace' or not isinstance(current, list) or not current:
    if kind == 'aval' and isinstance(current, list):
      # A fresh symbol of another type in place of one of the node's.
      shapes = [(), (4,), (2, 4), (3,)]
      current.append(yax.Var(jax.core.ShapedArray(
          shapes[other % len(shapes)], [jnp.float32, jnp.int32][other % 2])))
    else:
      setattr(node, field, value)
  elif kind == 'element':
    current[other % len(current)] = value
  elif kind == 'append':
    current.append(value)
  elif kind == 'drop':
    del current[other % len(current)]
  elif kind == 'swap':
    # Another node's element: symbols of another scope, nodes elsewhere.
    donor = nodes[other % len(nodes)]
    donor_list = getattr(donor, field, None)
    if isinstance(donor_list, list) and donor_list:
      current[other % len(current)] = donor_list[(other // 7) % len(donor_list)]
    else:
      current.reverse()
  else:
    shapes = [(), (4,), (2, 4), (3,)]
    i = other % len(current)
    if isinstance(current[i], yax.Symbol):
      current[i] = yax.Var(jax.core.ShapedArray(
          shapes[other % len(shapes)], [jnp.float32, jnp.int32][other % 2]))
    else:
      current[i] = value
  try:
    yax.check_mox(mox)
  except yax.InvariantError:
    pass
  yax.check_mox(traced())  # the traced tree is untouched


# ------------------------------------- a call reads the variables it lists

class _Table(nn.Module):
  """A Linen variable whose value is a dict, next to a submodule."""

  @nn.compact
  def __call__(self, x):
    table = self.param('table', lambda key: {'a': jnp.ones((3,)),
                                             'b': jnp.full((3,), 2.0)})
    return nn.Dense(3, name='sub')(x) * table['a'] + table['b']


class _HoldsTable(nn.Module):

  @nn.compact
  def __call__(self, x):
    return _Table(name='t')(x) + 1.0


def _table_tree():
  model = _HoldsTable()
  x = jnp.arange(6.0).reshape(2, 3)
  variables = model.init(jax.random.key(0), x)
  return model, variables, x, yax.make_mox(model.apply)(variables, x)


def test_dict_valued_linen_variable_is_an_input_of_its_call():
  model, variables, x, mox = _table_tree()
  yax.check_mox(mox)
  table = yax.query('//module_call[@type="_Table"]', mox)[0]
  leaves = jax.tree_util.tree_leaves(variables['params']['t']['table'])
  args = jax.tree_util.tree_leaves((variables, x))
  by_value = {id(a): s for a, s in zip(args, mox.inputs, strict=True)}
  for leaf in leaves:
    assert by_value[id(leaf)] in table.var_inputs
  np.testing.assert_allclose(yax.eval_mox(mox, variables, x),
                             model.apply(variables, x))


def test_check_mox_refuses_a_call_reading_an_unlisted_variable():
  _, variables, _, mox = _table_tree()
  top = mox.children[0]
  table = next(c for c in top.children if isinstance(c, yax.Mox))
  # The call without its dict-valued variable among its inputs (as traced
  # before such variables were inputs): its body still reads it.
  leaves = jax.tree_util.tree_leaves(variables['params']['t']['table'])
  unlisted = set(mox.inputs[i] for i, leaf in enumerate(
      jax.tree_util.tree_leaves((variables, jnp.zeros(1))))
                 if any(leaf is x for x in leaves))
  kept = [s for s in table.var_inputs if s not in unlisted]
  tree = {'params': {'sub': {'bias': kept[0], 'kernel': kept[1]}}}
  leaner = table.replace(
      inputs=[*kept, *table.arg_inputs],
      var_tree=jax.tree_util.tree_structure(tree))
  broken = mox.replace(children=[top.replace(children=[
      leaner if c is table else c for c in top.children])])
  with pytest.raises(yax.InvariantError, match='does not list it'):
    yax.check_mox(broken, types=False)


def test_sub_of_a_module_with_a_dict_valued_variable():
  model, variables, x, mox = _table_tree()
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  fresh = yax.make_mox(_Table().apply)(
      {'params': jax.tree_util.tree_map(spec, variables['params']['t'])},
      spec(x))
  new = yax.sub('//module_call[@type="_Table"]', fresh, mox)
  yax.check_mox(new)
  np.testing.assert_allclose(yax.eval_mox(new, variables, x),
                             model.apply(variables, x))


# ------------------- one rule for a call's variables, lifted bodies included

class _DictParam(nn.Module):
  """A Linen param whose value is a dict, next to a plain one."""

  @nn.compact
  def __call__(self, x):
    p = self.param('p', lambda key: {'a': jnp.full((3, 3), 0.5),
                                     'b': jnp.arange(3.0)})
    w = self.param('w', lambda key: jnp.full((3,), 2.0))
    return x @ p['a'] + p['b'] * w


class _Lifted(nn.Module):
  lift: str

  @nn.compact
  def __call__(self, x):
    if self.lift == 'scan':
      scanned = nn.scan(lambda m, c, _: (m(c), None),
                        variable_broadcast='params',
                        split_rngs={'params': False}, length=2)
      y, _ = scanned(_DictParam(name='inner'), x, None)
      return y
    return getattr(nn, self.lift)(_DictParam)(name='inner')(x)


def _by_hand(variables, x, lift):
  """``_Lifted`` written out in plain JAX."""
  p = variables['params']['inner']
  step = lambda h: h @ p['p']['a'] + p['p']['b'] * p['w']
  return step(step(x)) if lift == 'scan' else step(x)


@pytest.mark.parametrize('lift', ['jit', 'remat', 'scan'])
def test_dict_valued_variable_is_an_input_under_a_lifted_transform(lift):
  # Failed before: no call listed the dict's leaves ("equation jit reads
  # input 0 ..., an argument of the traced function, inside module_call
  # _Lifted ... which does not list it").
  model = _Lifted(lift)
  x = jnp.arange(6.0).reshape(2, 3)
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  yax.check_mox(mox)
  args = jax.tree_util.tree_leaves((variables, x))
  by_value = {id(a): s for a, s in zip(args, mox.inputs, strict=True)}
  top = yax.query('//module_call[@type="_Lifted"]', mox)[0]
  for leaf in jax.tree_util.tree_leaves(variables['params']['inner']):
    assert by_value[id(leaf)] in top.var_inputs
  inner = yax.query('//module_call[@type="_DictParam"]', mox)[0]
  assert sorted(var_keys(inner)) == [('params', 'p', 'a'),
                                     ('params', 'p', 'b'), ('params', 'w')]
  np.testing.assert_allclose(yax.eval_mox(mox, variables, x),
                             _by_hand(variables, x, lift), rtol=1e-6)


@pytest.mark.parametrize('lift', ['jit', 'remat'])
def test_sub_of_a_dict_valued_module_under_a_lifted_transform(lift):
  # Failed before: under nn.remat "traced arguments hold no 'params'
  # collection"; under nn.jit the new tree failed check_mox.
  model = _Lifted(lift)
  x = jnp.arange(6.0).reshape(2, 3)
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  inner = variables['params']['inner']
  fresh = yax.make_mox(_DictParam().apply)(
      {'params': jax.tree_util.tree_map(spec, inner)}, spec(x))
  yax.check_mox(fresh)
  new = yax.sub('//module_call[@type="_DictParam"]', fresh, mox)
  yax.check_mox(new)
  np.testing.assert_allclose(yax.eval_mox(new, variables, x),
                             _by_hand(variables, x, lift), rtol=1e-6)


def test_check_mox_refuses_an_nnx_call_listing_none_of_its_variables():
  # Failed before: the read rule held for Linen calls only, so the edited
  # Linear passed.
  from flax import nnx

  class Two(nnx.Module):

    def __init__(self, rngs):
      self.first = nnx.Linear(3, 4, rngs=rngs)
      self.second = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
      return self.second(self.first(x))

  model = Two(nnx.Rngs(0))
  x = jnp.ones((2, 3))
  mox = yax.make_mox(lambda m, x: m(x))(model, x)
  yax.check_mox(mox)
  linear = yax.query('//module_call[@path="second"]', mox)[0]
  assert linear.num_vars == 2
  bare = linear.replace(inputs=list(linear.arg_inputs),
                        var_tree=jax.tree_util.tree_structure(
                            type(jax.tree_util.tree_unflatten(
                                linear.var_tree, [0, 0]))()))
  two = yax.query('//module_call[@type="Two"]', mox)[0]
  edited = two.replace(children=[bare if c is linear else c
                                 for c in two.children])
  broken = mox.replace(children=[edited if c is two else c
                                 for c in mox.children])
  with pytest.raises(yax.InvariantError, match='does not list it'):
    yax.check_mox(broken, types=False)
