"""The XML view of a tree and its XML/YSON/JSON exports.

Every document is parsed back (lxml, xmllint, ``yt.yson.loads``,
``json.loads``) and compared with the tree it came from.
"""

import gc
import io
import json
import shutil
import subprocess
import sys
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex
from lxml import etree

import yax
from helpers import equations, modules
from yax._src.ir import text as _text
from yax._src.ir.nodes import Literal, Symbol, iter_nodes
from yax._src.ir.text import format_value
from yax._src.views import serialize as _serialize

KEY = jax.random.key(0)


class Block(nn.Module):
  features: int = 3

  @nn.compact
  def __call__(self, x, train: bool = True):
    y = nn.Dense(self.features)(x)
    y = nn.relu(y)
    y = nn.LayerNorm()(y)
    y = nn.silu(y)
    return jnp.where(y > 0, y, 1.0) + x


@pytest.fixture(scope='module')
def block():
  x = jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(2, 3)
  model = Block()
  variables = model.init(KEY, x)
  return yax.make_mox(model.apply)(variables, x, True)


def dump(mox, **kwargs) -> str:
  buf = io.StringIO()
  yax.dump_xml(mox, buf, **kwargs)
  return buf.getvalue()


def parse(text: str):
  return etree.fromstring(text, etree.XMLParser(remove_blank_text=True))


def tree_shape(el) -> tuple:
  """Tag, attributes, text (symbols) and children, recursively."""
  text = el.text if el.tag in ('input', 'output') else None
  return (el.tag, tuple(el.attrib.items()), text,
          tuple(tree_shape(c) for c in el))


def letters(n: int) -> str:
  name = ''
  while True:
    name = chr(97 + n % 26) + name
    n //= 26
    if not n:
      return name


# ----------------------------------------------------------------- XML

def test_elements_and_attributes(block):
  root = parse(dump(block))
  assert root.tag == 'module_call'
  assert dict(root.attrib) == {'primitive': 'module_call', 'ephemeral': 'true'}
  for el in root.iter():
    if el.tag not in ('input', 'output'):
      assert el.get('primitive') == el.tag
  (dense,) = [e for e in root.iter('module_call') if e.get('type') == 'Dense']
  assert dict(dense.attrib) == {
      'primitive': 'module_call', 'type': 'Dense',
      'fqn': 'flax.linen.linear.Dense', 'name': 'Dense_0', 'path': 'Dense_0',
      'method': '__call__', 'features': '3', 'use_bias': 'true',
      'param_dtype': 'float32',
      'kernel_init': "variance_scaling(1.0, 'fan_in', 'truncated_normal')",
      'bias_init': 'jax.nn.initializers.zeros',
      'promote_dtype': 'flax.linen.dtypes.promote_dtype',
      'ephemeral': 'false'}
  # Children: inputs (variables first, with their path), body, outputs.
  kinds = [c.tag for c in dense]
  assert kinds == ['input'] * 3 + ['dot_general', 'reshape', 'add', 'output']
  assert [c.get('var') for c in dense[:3]] == [
      'params/bias', 'params/kernel', None]
  assert [c.get('type') for c in dense[:3]] == ['f32[3]', 'f32[3,3]', 'f32[2,3]']
  (dot,) = dense.iter('dot_general')
  assert dot.get('dimension_numbers') == '(((1,), (0,)), ((), ()))'
  # The dot reads the module's argument and kernel: same names.
  assert [c.text for c in dot[:2]] == [dense[2].text, dense[1].text]


def test_attributes_match_the_tree(block):
  root = parse(dump(block))
  elements = [e for e in root.iter() if e.tag not in ('input', 'output')]
  nodes = list(iter_nodes(block))
  assert len(elements) == len(nodes)
  for el, node in zip(elements, nodes):
    assert len([c for c in el if c.tag == 'input']) == len(node.inputs)
    assert len([c for c in el if c.tag == 'output']) == len(node.outputs)
    if isinstance(node, yax.Mox):
      assert el.tag == 'module_call'
      assert el.get('type') == node.type_name
      assert el.get('path', '') == '/'.join(node.path)
      assert el.get('ephemeral') == ('true' if node.is_ephemeral else 'false')
    else:
      assert el.tag == node.prim.name


def test_jit_and_custom_jvp_names(block):
  root = parse(dump(block))
  (relu,) = root.iter('custom_jvp_call')
  assert relu.get('name') == 'relu' and relu.get('jvp') == 'jvp'
  assert relu.get('call_jaxpr').startswith('{ lambda ; ')
  names = [e.get('name') for e in root.iter('jit')]
  assert names == ['silu', '_where']
  (silu,) = equations(block, prim='jit', name='silu')
  assert silu.params['name'] == 'silu'


def test_symbol_names_are_one_per_symbol_in_order(block):
  view = _serialize.xml_view(block)
  by_name: dict[str, Symbol] = {}
  order = []
  for el in view.root.iter('input', 'output'):
    sym = view.objects[el]
    if isinstance(sym, Literal):
      assert el.get('literal') == 'true'
      continue
    assert by_name.setdefault(el.text, sym) is sym, el.text
    if el.text not in order:
      order.append(el.text)
  assert len(set(map(id, by_name.values()))) == len(by_name)
  assert len(order) > 26  # names go on after z: ba, bb, ...
  assert order == [letters(i) for i in range(len(order))]
  assert view.names == {s: n for n, s in by_name.items()}


def test_literals(block):
  root = parse(dump(block))
  static = [e for e in root.iter('input') if e.get('static') == 'true']
  # The static `train=True` argument of the root and of the Block call.
  assert [(e.get('type'), e.get('literal'), e.text) for e in static] == [
      ('bool', 'true', 'True')] * 2
  (where,) = [e for e in root.iter('jit') if e.get('name') == '_where']
  lit = where.findall('input')[-1]
  assert dict(lit.attrib) == {'type': 'f32[]', 'literal': 'true'}
  assert lit.text == '1.0'


def test_array_and_string_literals():
  consts = np.arange(3, dtype=np.float32)

  class Tagged(nn.Module):
    @nn.compact
    def __call__(self, x, mode: str = 'fast'):
      return nn.Dense(2)(x)

  model = Tagged()
  x = jnp.ones((1, 3))
  v = model.init(KEY, x)
  mox = yax.make_mox(lambda v, x: model.apply(v, x * consts, 'a<b&"c"'))(v, x)
  root = parse(dump(mox))
  static = [e for e in root.iter('input') if e.get('static') == 'true']
  assert {e.text for e in static} == {repr('a<b&"c"')}
  assert {e.get('type') for e in static} == {'str'}


def test_awkward_fields_are_escaped_and_renamed():
  class Odd(nn.Module):
    note: str = 'a<b & "c"\n\td\x00e \u00e9\u4e2d'
    type: str = 'mine'
    path: tuple = ('x', 1, None, True)
    table: dict = None
    fn: object = jnp.tanh
    flag: bool = False

    @nn.compact
    def __call__(self, x):
      return x * 2

  odd = Odd(table={'k': [1, 2.5]})
  mox = yax.make_mox(odd.apply)({}, jnp.ones(2))
  text = dump(mox)
  text.encode('ascii')  # plain ASCII: other characters as references
  root = parse(text)
  (el,) = [e for e in root.iter('module_call') if e.get('type') == 'Odd']
  assert el.get('note') == 'a<b & "c"\n\td\\x00e \u00e9\u4e2d'
  assert el.get('_type') == 'mine' and el.get('type') == 'Odd'
  assert el.get('_path') == "('x', 1, None, true)"  # format_value's text
  (node,) = modules(mox, 'Odd')
  assert el.get('table') == format_value(node.params['table'])  # a FrozenDict
  assert el.get('flag') == 'false'
  assert el.get('fn') is not None


def test_primitive_names_are_sanitized():
  weird = jex.Primitive('my prim/1')
  weird.def_abstract_eval(lambda x: x)
  weird.def_impl(lambda x: x)
  clash = jex.Primitive('input')
  clash.def_abstract_eval(lambda x: x)
  clash.def_impl(lambda x: x)
  mox = yax.make_mox(lambda x: clash.bind(weird.bind(x)))(jnp.ones(2))
  root = parse(dump(mox))
  assert [e.tag for e in root if e.tag not in ('input', 'output')] == [
      'my_prim_1', '_input']
  assert [e.get('jax_primitive') for e in root[1:3]] == ['my prim/1', 'input']
  assert [e.get('primitive') for e in root[1:3]] == ['my_prim_1', '_input']
  assert [type(n) for n in yax.query('/*/*[@jax_primitive]', mox)] == [
      yax.Equation] * 2


def test_xml_name_and_text_helpers():
  assert _serialize.xml_name('dot_general') == 'dot_general'
  assert _serialize.xml_name('a b:c') == 'a_b_c'
  assert _serialize.xml_name('1x') == '_1x'
  assert _serialize.xml_name('') == '_'
  assert _text.escape_text('ok\n') == 'ok\n'
  assert _text.escape_text('a\x00\x1fb\ud800') == 'a\\x00\\x1fb\\ud800'


def test_nested_bodies_of_lifted_transforms():
  class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(x) + x

  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.remat(Inner)()(x)

  x = jnp.ones((1, 4))
  model = Outer()
  mox = yax.make_mox(model.apply)(model.init(KEY, x), x)
  root = parse(dump(mox))
  (eqn,) = [e for e in root.iter() if e.find('module_call') is not None
            and e.tag != 'module_call']
  (body,) = eqn.findall('module_call')
  assert body.get('ephemeral') == 'true' and body.get('param') == 'jaxpr'
  (dense,) = [e for e in body.iter('module_call') if e.get('type') == 'Dense']
  assert dense.get('path') == 'CheckpointInner_0/Dense_0'
  assert len(modules(mox, 'Dense')) == 1


@pytest.mark.parametrize('indent', [None, 0, 2, 4])
def test_dump_xml_indent_round_trips(block, indent):
  text = dump(block, indent=indent)
  expected = tree_shape(_serialize.xml_view(block).root)
  assert tree_shape(parse(text)) == expected
  lines = text.splitlines()
  if indent is None:
    assert len(lines) == 1
  else:
    assert len(lines) > 50
    assert lines[1].startswith(' ' * indent + '<input')


def test_dump_xml_to_path_and_xmllint(block, tmp_path):
  path = tmp_path / 'block.xml'
  yax.dump_xml(block, path)
  assert tree_shape(etree.parse(str(path), etree.XMLParser(
      remove_blank_text=True)).getroot()) == tree_shape(
          _serialize.xml_view(block).root)
  if shutil.which('xmllint') is None:
    pytest.skip('xmllint not installed (Debian: apt-get install libxml2-utils)')
  out = subprocess.run(['xmllint', '--noout', str(path)], capture_output=True,
                       text=True)
  assert out.returncode == 0, out.stderr


def test_view_is_cached_and_does_not_keep_the_tree_alive(block):
  assert _serialize.xml_view(block) is _serialize.xml_view(block)
  x = jnp.ones((2,))
  mox = yax.make_mox(lambda x: jnp.sin(x) * 2)(x)
  yax.query('//sin', mox)
  assert mox in _serialize._VIEWS
  alive = weakref.ref(mox)
  before = len(_serialize._VIEWS)
  del mox
  gc.collect()
  # The view held no strong reference: the tree is gone, and so is its
  # entry (trees of earlier tests may be collected here too: at least one).
  assert alive() is None
  assert len(_serialize._VIEWS) <= before - 1


def test_view_of_a_non_tree_raises():
  with pytest.raises(yax.YaxError, match='expected a Mox .* got list'):
    yax.dump_xml([1, 2], io.StringIO())


# ---------------------------------------------------------- JSON / YSON

def same_as_dict(el, node):
  assert node['tag'] == el.tag
  assert node['attrs'] == dict(el.attrib)
  if el.tag in ('input', 'output'):
    assert node['text'] == el.text and 'children' not in node
  else:
    assert len(node['children']) == len(el)
    for c, n in zip(el, node['children']):
      same_as_dict(c, n)


def test_to_dict_and_json_match_the_xml(block):
  root = parse(dump(block))
  same_as_dict(root, block.to_dict())
  same_as_dict(root, json.loads(block.to_json()))
  same_as_dict(root, json.loads(yax.to_json(block, indent=2)))
  assert block.to_json(indent=2).count('\n') > 100
  assert yax.to_dict(block) == block.to_dict()


def same_as_yson(el, node):
  if el.tag in ('input', 'output'):
    assert isinstance(node, str) and str(node) == el.text
    assert dict(node.attributes) == {'tag': el.tag, **el.attrib}
  else:
    assert dict(node.attributes) == dict(el.attrib)
    assert node.attributes['primitive'] == el.tag
    assert len(node) == len(el)
    for c, n in zip(el, node):
      same_as_yson(c, n)


@pytest.mark.parametrize('indent', [None, 2])
def test_dump_yson_round_trips(block, indent):
  yson = pytest.importorskip('yt.yson')
  buf = io.BytesIO()
  yax.dump_yson(block, buf, indent=indent)
  loaded = yson.loads(buf.getvalue())
  same_as_yson(parse(dump(block)), loaded)
  assert loaded.attributes['ephemeral'] == 'true'


def test_dump_yson_without_the_extra(block, monkeypatch):
  monkeypatch.setitem(sys.modules, 'yt', None)
  monkeypatch.setitem(sys.modules, 'yt.yson', None)
  with pytest.raises(yax.YaxError, match=r'pip install yax-mox\[yson\]'):
    yax.dump_yson(block, io.BytesIO())


# ------------------------------------------------- third-party models

@pytest.fixture
def bert(tiny_bert_mox):
  return tiny_bert_mox


@pytest.fixture
def resnet(tiny_resnet_mox):
  return tiny_resnet_mox


@pytest.mark.parametrize('name', ['bert', 'resnet'])
def test_third_party_models_export(name, request, tmp_path):
  mox = request.getfixturevalue(name)
  path = tmp_path / f'{name}.xml'
  yax.dump_xml(mox, path)
  root = etree.parse(str(path)).getroot()
  types = {}
  for el in root.iter('module_call'):
    if el.get('ephemeral') == 'false':
      types[el.get('type')] = types.get(el.get('type'), 0) + 1
  expected = {}
  for node in modules(mox):
    expected[node.type_name] = expected.get(node.type_name, 0) + 1
  assert types == expected
  assert sum(1 for _ in root.iter()) == sum(
      1 + len(n.inputs) + len(n.outputs) for n in iter_nodes(mox))
  same_as_dict(parse(path.read_text()), json.loads(mox.to_json()))
  if name == 'bert':
    assert types['Dense'] == 13  # q, k, v, 3 more per layer; pooler
  else:
    assert types['Conv'] == 8  # embedder; 3 + shortcut per stage
