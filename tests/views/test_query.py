"""yax.query: XPath over the XML view, results mapped back to the tree.

Counts are checked against walking the tree (``helpers.modules``) or the
known architecture; a property test checks that yax.query agrees with lxml
and with ``xmllint --xpath`` evaluating the same expression on the
``dump_xml`` output of random Linen models.
"""

import functools
import io
import itertools
import math
import shutil
import subprocess

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree

import yax
from helpers import equations, modules
from yax._src.ir.nodes import Equation, Mox, Symbol, iter_nodes
from yax._src.views import query as _query
from yax._src.views import serialize as _serialize

KEY = jax.random.key(0)
DENSE = '//module_call[@type="Dense"]'


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.Dense(4, name='up')(x)
    y = nn.relu(y)
    y = nn.Dense(3, use_bias=False, name='down')(y)
    return nn.LayerNorm()(y + x)


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = Block(name='first')(x)
    x = nn.silu(x)
    x = Block(name='second')(x)
    return nn.Dense(2, name='head')(x)


@pytest.fixture(scope='module')
def net():
  x = jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(2, 3)
  model = Net()
  return yax.make_mox(model.apply)(model.init(KEY, x), x)


def paths(nodes):
  return ['/'.join(n.path) for n in nodes]


# -------------------------------------------------------------- basics

def test_counts_by_type(net):
  for ty, n in [('Dense', 5), ('LayerNorm', 2), ('Block', 2), ('Net', 1)]:
    found = yax.query(f'//module_call[@type="{ty}"]', net)
    assert found == modules(net, ty)
    assert len(found) == n
  assert yax.query('//module_call', net) == [
      n for n in iter_nodes(net) if isinstance(n, Mox)]
  assert yax.query('//*[@primitive != "module_call"]', net) == [
      n for n in iter_nodes(net) if isinstance(n, Equation)]


def test_results_are_the_tree_objects(net):
  (head,) = yax.query('//module_call[@name="head"]', net)
  assert head is net.children[0].children[-1]
  (dot,) = yax.query('//module_call[@name="head"]/dot_general', net)
  assert dot is head.children[0]
  assert yax.query('.', net) == [net] and yax.query('.', net)[0] is net
  assert yax.query('/module_call', net)[0] is net


def test_symbols(net):
  (head,) = modules(net, 'Dense')[-1:]
  kernel = yax.query(
      '//module_call[@name="head"]/input[@var="params/kernel"]', net)
  assert len(kernel) == 1 and kernel[0] is head.var_inputs[1]
  assert isinstance(kernel[0], Symbol)
  (out,) = yax.query('//module_call[@name="head"]/output', net)
  assert out is head.outputs[0]
  # Data flow: the equations that read the output of `first`.
  readers = yax.query(
      '//*[input = //module_call[@name="first"]/output][not(self::module_call)]',
      net)
  (first,) = [m for m in modules(net, 'Block') if m.name == 'first']
  assert readers and all(first.outputs[0] in r.inputs for r in readers)
  assert [r.name for r in readers] == ['silu']


def test_attribute_predicates_and_values(net):
  assert paths(yax.query('//module_call[@features=3]', net)) == [
      'first/down', 'second/down']
  assert paths(yax.query(
      '//module_call[@type="Dense" and @use_bias="false"]', net)) == [
          'first/down', 'second/down']
  assert yax.query(f'{DENSE}/@features', net) == ['4', '3', '4', '3', '2']
  assert yax.query(f'{DENSE}/@path', net) == paths(modules(net, 'Dense'))
  assert yax.query('//module_call[@name="head"]/output/text()', net) == [
      _serialize.xml_view(net).names[net.outputs[0]]]
  assert yax.query('string((//module_call[@type="LayerNorm"])[2]/@path)',
                   net) == 'second/LayerNorm_0'


def test_unions_are_in_document_order(net):
  found = yax.query(
      '//module_call[@type="LayerNorm"] | //module_call[@type="Dense"]', net)
  expected = [n for n in iter_nodes(net) if isinstance(n, Mox)
              and n.type_name in ('Dense', 'LayerNorm')]
  assert found == expected and len(found) == 7


def test_numbers_and_booleans(net):
  assert yax.query(f'count({DENSE})', net) == 5.0
  assert isinstance(yax.query('count(//*)', net), float)
  assert yax.query('sum(//module_call/@features)', net) == 16.0
  assert yax.query('boolean(//custom_jvp_call)', net) is True
  assert yax.query('boolean(//conv_general_dilated)', net) is False


def test_axes(net):
  dense_dots = yax.query(
      '//dot_general/ancestor::module_call[@type="Dense"]', net)
  assert dense_dots == modules(net, 'Dense')
  owners = yax.query('//*[@name="relu"]/ancestor::module_call[1]/@path', net)
  assert owners == ['first', 'second']
  after_up = yax.query(
      '//module_call[@name="up"]/following-sibling::module_call/@name', net)
  assert after_up == ['down', 'LayerNorm_0'] * 2
  before_head = yax.query(
      '//module_call[@name="head"]/preceding-sibling::*[1]', net)
  assert before_head == [modules(net, 'Block')[1]]
  assert yax.query('//module_call[@name="up"]/parent::*/@name', net) == [
      'first', 'second']
  assert yax.query('count(//module_call[@name="first"]/descendant::*)',
                   net) > 10
  assert yax.query('//module_call[count(module_call) = 3]/@name', net) == [
      'first', 'second']


def test_query_on_a_subtree(net):
  (first,) = yax.query('//module_call[@name="first"]', net)
  assert yax.query('//module_call[@type="Dense"]', first) == modules(
      first, 'Dense')
  (dot,) = yax.query('//module_call[@name="up"]/dot_general', first)
  assert yax.query('//input', dot) == dot.inputs
  assert yax.query('.', dot) == [dot]


class _Lifted(nn.Module):
  """Dense calls inside equation bodies (nn.jit, nn.remat, nn.scan) and
  outside them."""

  @nn.compact
  def __call__(self, x):
    x = nn.jit(nn.Dense)(3, name='jitted')(x)
    x = nn.remat(nn.Dense)(3, name='remat')(x)
    x, _ = nn.scan(lambda m, c, _: (m(c), None), variable_axes={'params': 0},
                   split_rngs={'params': True}, length=2)(
                       nn.Dense(3, name='scanned'), x, None)
    return nn.Dense(3, name='last')(x)


def test_by_type_agrees_with_the_xml_view(net, monkeypatch):
  """``//module_call[@type="T"]`` is answered without building the XML
  view; it selects what lxml selects on the view, bodies included."""
  x = jnp.ones((2, 3))
  lifted = yax.make_mox(_Lifted().apply)(_Lifted().init(KEY, x), x)
  (first,) = yax.query('//module_call[@name="first"]', net)
  cases = [(tree, ty) for tree in (net, first, first.children[0])
           for ty in ('Dense', 'Block', 'LayerNorm', 'Net', 'None', '')]
  cases += [(lifted, ty) for ty in ('Dense', '_Lifted')]
  want = {}
  for tree, ty in cases:
    view = _serialize.xml_view(tree)
    want[id(tree), ty] = [
        view.node(e, tree) for e in view.root.xpath(
            f'//module_call[@type="{ty}"]')]
  assert {n.path[-1] for n in want[id(lifted), 'Dense']} == {
      'jitted', 'remat', 'scanned', 'last'}
  monkeypatch.setattr(_serialize, 'build_view', None)  # never built again
  monkeypatch.setattr(_serialize, '_VIEWS', {})
  for (tree, ty), quote in itertools.product(cases, '"\''):
    found = yax.query(f'//module_call[@type={quote}{ty}{quote}]', tree)
    assert found == want[id(tree), ty]
    assert all(a is b for a, b in zip(found, want[id(tree), ty]))
  with pytest.raises(yax.YaxError, match='expected a Mox .* got dict'):
    yax.query('//module_call[@type="Dense"]', {'a': 1})
  with pytest.raises(yax.XPathError, match='variables'):
    yax.query('//module_call[@type="Dense"]', net, variables=[1])


def test_variables(net):
  assert yax.query('//module_call[@type=$t]', net,
                   variables={'t': 'LayerNorm'}) == modules(net, 'LayerNorm')
  assert yax.query('//module_call[matches(@type, $t)]', net,
                   variables={'t': '^Lay'}) == modules(net, 'LayerNorm')


# ------------------------------------------------------- XPath 2.0/3.1

def test_xpath2_matches(net):
  found = yax.query('//module_call[matches(@path, "^(first|second)/(up|down)$")]',
                    net)
  assert paths(found) == ['first/up', 'first/down', 'second/up', 'second/down']
  assert all(a is b for a, b in zip(found, modules(net, 'Dense')))


def test_xpath2_sequences_and_conditionals(net):
  assert yax.query('(1, 2, 3)', net) == [1, 2, 3]
  assert yax.query('if (count(//module_call) > 3) then "big" else "small"',
                   net) == 'big'
  assert yax.query('for $m in //module_call[@type="Block"] return '
                   'string($m/@name)', net) == ['first', 'second']
  assert yax.query('(//module_call[@type="Block"], //module_call[@name="head"])',
                   net) == modules(net, 'Block') + modules(net, 'Dense')[-1:]
  assert yax.query('//module_call[@type="Block"]/@name ! upper-case(.)',
                   net) == ['FIRST', 'SECOND']
  assert yax.query('data(//module_call[@name="head"]/@features)', net) == ['2']


def test_engine_is_chosen_once_per_expression(net):
  expr = '//module_call[ends-with(@path, "head")]'
  assert paths(yax.query(expr, net)) == ['head']
  compiled = _query.compile_xpath(expr)
  assert compiled.lxml is None and compiled.selector is not None
  assert _query.compile_xpath(DENSE).lxml is not None


# ----------------------------------------------------------- shorthand

def test_shorthand_step_without_node_test(net):
  relu = yax.query('//[@name="relu"]', net)
  assert relu == equations(net, prim='custom_jvp_call', name='relu')
  assert len(relu) == 2
  assert yax.query('//module_call[@name="first"]/[@name="up"]', net) == [
      modules(net, 'Dense')[0]]
  assert yax.query('//[@type="Dense"][@features=2]', net) == modules(
      net, 'Dense')[-1:]
  # Inside string literals nothing is rewritten.
  assert yax.query('count(//*[@name="//[x]"])', net) == 0.0
  assert _query.rewrite_shorthand('//[@a="/["] | a/ [1]') == (
      '//*[@a="/["] | a/ *[1]', [2, 17])


# -------------------------------------------------------------- errors

@pytest.mark.parametrize('expr, column', [
    ('//module_call[', 15),
    ('//module_call[@type=="Dense"]', 21),
    ('//module_call]', 14),
    ('1 +', 4),
])
def test_invalid_expressions(net, expr, column):
  with pytest.raises(yax.XPathError, match=f'column {column}') as info:
    yax.query(expr, net)
  message = str(info.value)
  assert expr in message
  lines = message.splitlines()
  caret = lines.index('  ' + expr) + 1
  assert lines[caret] == '  ' + ' ' * (column - 1) + '^'
  assert 'XPath 1.0 (lxml)' in message and 'XPath 3.1 (elementpath)' in message
  assert isinstance(info.value, ValueError)


def test_invalid_expression_positions_refer_to_the_users_text(net):
  # The `*` inserted for `//[` must not shift the reported column.
  with pytest.raises(yax.XPathError, match='column 12') as info:
    yax.query('//[@a="b"][', net)
  assert "evaluated as '//*[@a=\"b\"]['" in str(info.value)


LONG = 'a' * 100_000


@pytest.mark.parametrize('expr', [
    '//' + LONG, '//*[@' + LONG + ']', '//' + LONG + '/' + LONG,
    'ns:' + LONG, 'fn:' + LONG + '()', '//' + LONG + '[matches(@x, "y")]',
    'child::' + LONG, '//module_call[' + LONG + ' = 1]', LONG + '::x',
    '$' + LONG,
])
def test_a_name_test_100000_characters_long(net, expr):
  """The scan that picks the engine (which names are function calls) was
  quadratic in the length of a name: minutes for 100,000 characters (timed
  in benchmarks/query.py). Such queries answer, or raise XPathError."""
  mox = net
  try:
    got = yax.query(expr, mox)
  except yax.XPathError:
    got = None
  if got is not None and isinstance(got, list):
    # Where lxml evaluates it, the same answer as lxml on the XML view.
    try:
      want = etree.XPath(expr)(_serialize.xml_view(mox).root)
    except etree.XPathError:
      want = None
    if want is not None:
      assert len(got) == len(want) == 0


def test_unknown_function(net):
  with pytest.raises(yax.XPathError,
                     match=r"(?s)Unregistered function.*unknown function 'frob'"):
    yax.query('//module_call[frob(@name)]', net)


def test_dynamic_error_in_xpath2(net):
  with pytest.raises(yax.XPathError, match='XPTY0004|cannot compare'):
    yax.query('//module_call[matches(@type, "D")] = 1 + "a"', net)


def test_expression_must_be_a_string(net):
  with pytest.raises(yax.XPathError, match='expected an XPath expression .* '
                     'got int'):
    yax.query(42, net)


def test_tree_must_be_a_tree():
  with pytest.raises(yax.YaxError, match='expected a Mox .* got dict'):
    yax.query('//*', {'a': 1})


def test_view_is_built_once(net, monkeypatch):
  calls = []
  build = _serialize.build_view

  def counting(expr):
    calls.append(expr)
    return build(expr)

  monkeypatch.setattr(_serialize, 'build_view', counting)
  x = jnp.ones((3,))
  mox = yax.make_mox(lambda x: jnp.cos(x) + 1)(x)
  for _ in range(3):
    assert len(yax.query('//cos', mox)) == 1
    assert yax.query('//cos[matches(name(), "co")]', mox) == yax.query(
        '//cos', mox)
  assert calls == [mox]


# ------------------------------------------------- third-party models

@pytest.fixture
def bert(tiny_bert_mox):
  return tiny_bert_mox


@pytest.fixture
def resnet(tiny_resnet_mox):
  return tiny_resnet_mox


def test_bert(bert):
  dense = yax.query(DENSE, bert)
  assert dense == modules(bert, 'Dense') and len(dense) == 13
  assert len(yax.query('//module_call[@type="FlaxBertLayer"]', bert)) == 2
  names = yax.query('//module_call[@type="FlaxBertSelfAttention"]'
                    '[@method="__call__"]/module_call/@name', bert)
  assert names == ['query', 'key', 'value', 'self', 'self', 'self'] * 2
  # Other methods are module calls too: FlaxBertSelfAttention._split_heads.
  split = yax.query('//module_call[@method="_split_heads"]', bert)
  assert len(split) == 6
  assert all(m.type_name == 'FlaxBertSelfAttention' for m in split)
  after_query = yax.query('//module_call[@name="query"]'
                          '/following-sibling::module_call[1]/@name', bert)
  assert after_query == ['key', 'key']
  qkv = yax.query('//module_call[matches(@path, "attention/self/(query|value)$")]',
                  bert)
  assert [m.path[-1] for m in qkv] == ['query', 'value'] * 2
  assert all(isinstance(m, Mox) and m.type_name == 'Dense' for m in qkv)
  layer0 = yax.query('//module_call[@path="encoder/layer/0"]', bert)
  assert yax.query('count(//module_call[@path="encoder/layer/0"]//'
                   'module_call[@type="Dense"])', bert) == 6.0
  assert layer0[0].path == ('encoder', 'layer', '0')


def test_resnet(resnet):
  convs = yax.query('//module_call[@type="Conv"]', resnet)
  assert convs == modules(resnet, 'Conv') and len(convs) == 8
  norms = yax.query('//module_call[@type="BatchNorm"]', resnet)
  assert norms == modules(resnet, 'BatchNorm') and len(norms) == 8
  assert len(yax.query('//conv_general_dilated', resnet)) == 8
  assert yax.query('//conv_general_dilated/ancestor::module_call[1]',
                   resnet) == convs
  strided = yax.query('//module_call[@type="Conv"][@strides=2]/@path', resnet)
  assert strided == ['embedder/embedder/convolution',
                     'encoder/stages/1/layers/0/shortcut/convolution',
                     'encoder/stages/1/layers/0/layer/1/convolution']


# --------------------------------------------- property: vs lxml/xmllint

ACTIVATIONS = ('relu', 'gelu', 'silu', 'tanh')


class Seq(nn.Module):
  """A random architecture: ``spec`` is a tuple of layer descriptions."""
  spec: tuple

  @nn.compact
  def __call__(self, x):
    for layer in self.spec:
      kind = layer[0]
      if kind == 'dense':
        x = nn.Dense(x.shape[-1] if layer[2] else layer[1])(x)
      elif kind == 'conv':
        x = nn.Conv(layer[1], (layer[2], layer[2]), padding='SAME')(x)
      elif kind == 'norm':
        x = nn.LayerNorm()(x)
      elif kind == 'act':
        x = {'relu': nn.relu, 'gelu': nn.gelu, 'silu': nn.silu,
             'tanh': jnp.tanh}[layer[1]](x)
      elif kind == 'block':
        x = Seq(layer[1])(x)
      elif kind == 'residual':
        x = x + Seq(layer[1])(x)
    return x


def layers(depth):
  leaf = st.one_of(
      st.tuples(st.just('dense'), st.integers(1, 4), st.booleans()),
      st.tuples(st.just('conv'), st.integers(1, 3), st.sampled_from([1, 3])),
      st.tuples(st.just('norm')),
      st.tuples(st.just('act'), st.sampled_from(ACTIVATIONS)),
  )
  if depth == 0:
    return leaf
  # A residual block keeps the width: its body has no width-changing layers.
  keep = st.one_of(
      st.tuples(st.just('dense'), st.just(0), st.just(True)),
      st.tuples(st.just('norm')),
      st.tuples(st.just('act'), st.sampled_from(ACTIVATIONS)))
  return st.one_of(
      leaf,
      st.tuples(st.just('block'), st.lists(layers(depth - 1), min_size=1,
                                           max_size=3).map(tuple)),
      st.tuples(st.just('residual'), st.lists(keep, min_size=1,
                                              max_size=3).map(tuple)))


architectures = st.lists(layers(2), min_size=1, max_size=5).map(tuple)


@functools.lru_cache(maxsize=64)
def trace(spec):
  model = Seq(spec)
  x = jnp.ones((1, 4, 4, 3), jnp.float32)
  return yax.make_mox(model.apply)(model.init(KEY, x), x)


CORPUS = [
    '//module_call',
    '//module_call[@type="Dense"]',
    '//module_call[@type="Conv"] | //module_call[@type="LayerNorm"]',
    '//*[@primitive="dot_general"]',
    '//*[@primitive!="module_call"]',
    '//*[@name="relu"]',
    '//jit[@name="silu"]',
    '//input',
    '//output',
    '//input[@literal="true"]',
    '//module_call/input[@var]',
    '//module_call[@ephemeral="false"]',
    '//module_call[@type="Dense"]/@features',
    '//@type',
    '//module_call//dot_general',
    '//dot_general/ancestor::module_call',
    '//module_call[@type="Seq"]/following-sibling::*',
    '//*[preceding-sibling::module_call]',
    '//output/text()',
    '//*[input = //module_call[@type="Dense"]/output]',
    '//module_call[last()]',
    '(//module_call)[2]',
    '//module_call[count(module_call) > 1]',
    '//*[starts-with(name(), "custom")]',
    '//*[contains(@type, "f32[1,4")]',
    '//input/parent::*/@primitive',
    '//module_call/descendant-or-self::module_call',
    '//*[self::add or self::mul]',
    '//module_call[@type="Seq"]/module_call[1]/@path',
    '/module_call/module_call/*',
    '//module_call[not(module_call)][@type]',
    'count(//*)',
    'count(//module_call[@type="LayerNorm"])',
    'string(//module_call[2]/@type)',
    'sum(//module_call/@features)',
    'boolean(//tanh)',
    'name(//*[@primitive != "module_call"][1])',
    '//*[@path][string-length(@path) > 6]/@path',
    'module_call',  # relative: children of the root element
    './/module_call[@type="Dense"]/..',
]

AXES = ('child', 'descendant', 'parent', 'ancestor', 'following-sibling',
        'preceding-sibling', 'following', 'preceding', 'ancestor-or-self',
        'descendant-or-self', 'self')


@st.composite
def random_xpaths(draw, triples):
  """A random XPath 1.0 expression built from the (element, attribute,
  value) triples that occur in the document."""
  tags = sorted({t for t, _, _ in triples})
  tag, attr, value = draw(st.sampled_from(triples))
  step = draw(st.sampled_from([
      f'{tag}', f'{tag}[@{attr}]', f'{tag}[@{attr}="{value}"]',
      f'*[@{attr}="{value}"]', f'{tag}[@{attr}!="{value}"]',
      f'{tag}[{draw(st.integers(1, 3))}]', f'{tag}[last()]',
      f'*[not(@{attr})]']))
  expr = f'//{step}'
  for _ in range(draw(st.integers(0, 2))):
    axis = draw(st.sampled_from(AXES))
    expr += f'/{axis}::{draw(st.sampled_from(tags + ["*", "*", "*"]))}'
  form = draw(st.sampled_from(['nodes', 'attr', 'union', 'count']))
  if form == 'attr':
    expr += f'/@{draw(st.sampled_from(triples))[1]}'
  elif form == 'union':
    other, attr, value = draw(st.sampled_from(triples))
    expr = f'{expr} | //{other}[@{attr}="{value}"]'
  elif form == 'count':
    expr = f'count({expr})'
  return expr


def document_triples(root):
  """(element, attribute, value) triples of the document (short values)."""
  return sorted({(el.tag, k, v) for el in root.iter()
                 for k, v in el.attrib.items() if '"' not in v and len(v) < 40})


def same_result(ours, theirs, view, mox):
  if isinstance(theirs, list):
    assert isinstance(ours, list) and len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
      if isinstance(b, str):
        assert a == b
      elif b.tag in ('input', 'output'):
        assert isinstance(a, Symbol)
        assert b.text == view.names.get(a, b.text)
      elif b.tag == 'module_call':
        assert isinstance(a, Mox)
      else:
        assert isinstance(a, Equation)
        assert _serialize.xml_name(a.prim.name) == b.tag
  elif isinstance(theirs, float) and math.isnan(theirs):
    assert math.isnan(ours)
  elif isinstance(theirs, str):
    assert type(ours) is str and ours == theirs
  else:
    assert ours == theirs and type(ours) is type(theirs)


def xmllint_counts(path, exprs) -> list[float]:
  """``count(expr)`` of each expression, by one ``xmllint --xpath`` run."""
  parts = ', " ", '.join(f'count({e})' for e in exprs)
  out = subprocess.run(['xmllint', '--xpath', f'concat("", {parts})',
                        str(path)], capture_output=True, text=True, check=True)
  return [float(v) for v in out.stdout.split()]


@settings(max_examples=25, deadline=None)
@given(spec=architectures, data=st.data())
def test_query_agrees_with_lxml_and_xmllint(spec, data, tmp_path_factory):
  mox = trace(spec)
  assert len(yax.query(DENSE, mox)) == len(modules(mox, 'Dense'))
  assert len(yax.query('//module_call[@type="Conv"]', mox)) == len(
      modules(mox, 'Conv'))
  buf = io.StringIO()
  yax.dump_xml(mox, buf, indent=None)
  path = tmp_path_factory.mktemp('xml') / 'mox.xml'
  path.write_text(buf.getvalue())
  root = etree.parse(str(path)).getroot()
  view = _serialize.xml_view(mox)
  exprs = list(CORPUS) + data.draw(
      st.lists(random_xpaths(document_triples(root)), min_size=10,
               max_size=10),
      label='random expressions')
  counts = {}
  for expr in exprs:
    theirs = root.xpath(expr)
    ours = yax.query(expr, mox)
    same_result(ours, theirs, view, mox)
    if isinstance(theirs, list) and expr.startswith(('/', '(')):
      counts[expr] = len(ours)  # xmllint's context is the document node
  if shutil.which('xmllint') is not None:
    assert xmllint_counts(path, list(counts)) == list(counts.values())
