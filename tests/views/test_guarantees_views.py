"""The guarantees of queries, views and eval_mox (SPEC.md, "Guarantees").

Each test fails without the guarantee it is named after: queries only ever
evaluate or raise XPathError and never depend on earlier failures; views
never crash on odd field values; eval_mox names the first differing argument
path; YAX's own calls into JAX/Flax raise no DeprecationWarning.
"""

import collections.abc
import io
import json
import os
import re
import traceback
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import FrozenDict
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree

import yax
from yax._src.ir import text as _text
from yax._src.views import query as _query
from yax._src.views import serialize as _serialize
from helpers import Picky

YAX_DIR = os.path.dirname(yax.__file__)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(4, name='hidden')(x))
    return nn.Dense(2, name='head')(x)


@pytest.fixture(scope='module')
def mlp():
  model, x = MLP(), jnp.ones((1, 3))
  variables = model.init(jax.random.key(0), x)
  return model, variables, x, yax.make_mox(model.apply)(variables, x)


def raises_only_xpath_error(expr, mox, **kw):
  """Evaluates ``expr``; returns the result or the XPathError it raised."""
  try:
    return yax.query(expr, mox, **kw)
  except yax.XPathError as e:
    return e


# ================================================================ queries

@pytest.mark.parametrize('expr', [
    '\x00', 'a\x1fb', '//*[@name="\x07"]', '\ud800', '//*[@name="\udfff"]',
    '\ufffe', '//module_call\x0b'])
def test_characters_xml_cannot_hold_raise_xpath_error(mlp, expr):
  with pytest.raises(yax.XPathError, match=r'U\+[0-9A-F]{4}.* at column \d+'):
    yax.query(expr, mlp[3])


# Every character, lone surrogates and control characters included.
_ANY_CHAR = st.characters(exclude_categories=())
_FRAGMENTS = st.sampled_from([
    '/', '//', '*', '@', '[', ']', '(', ')', '1', '"a"', "'", ' to ', ',',
    '|', 'module_call', 'input', '..', '.', '::', 'ancestor', '$x', 'count(',
    'matches(', 'for $i in ', ' return ', 'let $a := ', 'if (', ') then ',
    ' else ', 'map{', '}', '!', '=', '<', '-', ' div ', 'xs:integer(',
    'string-join(', 'concat(', 'parse-xml(', 'function($a){', '[1]', '?',
    'root()', 'text()', '\x00', '\ud800', '\x1f', '\n'])


@given(st.one_of(st.text(_ANY_CHAR, max_size=30),
                 st.lists(_FRAGMENTS, max_size=12).map(''.join)))
def test_any_string_evaluates_or_raises_xpath_error(expr):
  mox = _small_mox()
  result = raises_only_xpath_error(expr, mox)
  if isinstance(result, list):
    for item in result:  # elements map back to the tree, never raw lxml
      assert not isinstance(item, (etree._Element, etree._ElementTree))


@pytest.mark.parametrize('expr', [
    '(' * 5000 + '1' + ')' * 5000,
    '1' + ' + 1' * 20000,
    '/a' * 20000,
    '[' * 3000,
    'count(' * 3000 + '.' + ')' * 3000,
])
def test_deeply_nested_expressions_raise_xpath_error(mlp, expr):
  with pytest.raises(yax.XPathError, match='too deep|nested too deeply|'
                     'invalid XPath'):
    yax.query(expr, mlp[3])
  assert len(yax.query('//module_call', mlp[3])) == 4  # still works


def test_huge_ranges_raise_xpath_error(mlp):
  for expr in ('1 to 10000000000',
               'string-join((1 to 100000000000) ! string(.), ",")',
               'count(xs:integer("1" || "0000000000") to 5 * 10000000000)'):
    with pytest.raises(yax.XPathError, match=r'range .* items; at most'):
      yax.query(expr, mlp[3])


def test_expressions_that_exhaust_memory_raise_xpath_error(mlp, monkeypatch):
  # A string that doubles 100 times (2**100 characters). The budget is made
  # small so the test stays cheap; the mechanism is the same at 2 GiB.
  monkeypatch.setattr(_query, 'MEMORY_BUDGET', 64 << 20)
  expr = ('string-length(fold-left(1 to 100, "xxxxxxxx", '
          'function($a, $b) { $a || $a }))')
  with pytest.raises(yax.XPathError, match=r'grew the process by more than '
                     r'64 MiB'):
    yax.query(expr, mlp[3])
  # Under the budget, the same kind of expression evaluates.
  small = expr.replace('1 to 100', '1 to 3')
  assert yax.query(small, mlp[3]) == 64


def test_memory_error_inside_elementpath_is_an_xpath_error(mlp, monkeypatch):
  expr = 'string-join(("a", "b"), "-")'
  selector = _query.compile_xpath(expr).elementpath_selector()

  def boom(*args, **kwargs):
    raise MemoryError()
  monkeypatch.setattr(selector, 'select', boom)
  with pytest.raises(yax.XPathError, match='exhausted memory'):
    yax.query(expr, mlp[3])


def test_other_elementpath_exceptions_are_xpath_errors(mlp, monkeypatch):
  # A raw exception from inside elementpath (not an ElementPathError) is
  # reported as an XPathError with its type, never leaked.
  expr = 'upper-case("a")'
  selector = _query.compile_xpath(expr).elementpath_selector()

  def boom(*args, **kwargs):
    raise KeyError('internal')
  monkeypatch.setattr(selector, 'select', boom)
  with pytest.raises(yax.XPathError, match="could not evaluate.*\n.*KeyError"):
    yax.query(expr, mlp[3])


def test_other_exceptions_while_parsing_are_xpath_errors(mlp, monkeypatch):
  class Broken:
    def __init__(self, *args, **kwargs):
      raise KeyError('internal')
  monkeypatch.setattr(_query, '_parser', lambda: Broken)
  expr = 'upper-case("only in this test")'  # not compiled before
  with pytest.raises(yax.XPathError, match=r"(?s)invalid XPath.*"
                     r"XPath 3.1 \(elementpath\): KeyError: 'internal'"):
    yax.query(expr, mlp[3])
  _query.compile_xpath.cache_clear()


def test_failed_evaluation_does_not_change_later_results(mlp):
  mox = mlp[3]
  # lxml compiles these (XPath 1.0) but cannot run them without $n.
  count = 'count(//module_call[@name=$n])'
  select = '//module_call[@name=$n]'
  expected_count = yax.query(count, mox, variables={'n': 'head'})
  expected_nodes = yax.query(select, mox, variables={'n': 'head'})
  assert type(expected_count) is float and expected_count == 1.0
  for _ in range(2):
    with pytest.raises(yax.XPathError, match="unknown variable 'n'"):
      yax.query(count, mox)
    with pytest.raises(yax.XPathError):
      yax.query(select, mox)
  again = yax.query(count, mox, variables={'n': 'head'})
  assert type(again) is float and again == expected_count  # still lxml
  assert yax.query(select, mox, variables={'n': 'head'}) == expected_nodes
  assert _query.compile_xpath(count).lxml is not None


def test_slash_returns_the_root(mlp):
  mox = mlp[3]
  for expr in ('/', ' / ', '(/)', '/.', '/self::node()', 'root()'):
    assert yax.query(expr, mox) == [mox], expr
  assert yax.query('/*', mox) == [mox]
  # The document node and the root element both stand for the tree.
  assert yax.query('/ | /*', mox) == [mox, mox]
  assert yax.query('//module_call[@name="head"]/../..', mox) == [mox]
  assert yax.query('count(/)', mox) == 1.0


def test_elements_not_in_the_view_raise(mlp):
  for expr in ('parse-xml("<module_call/>")',
               'parse-xml("<module_call/>")/module_call',
               'parse-xml-fragment("<a/>")'):
    with pytest.raises(yax.XPathError, match='not part of the XML view'):
      yax.query(expr, mlp[3])


def test_view_maps_only_its_own_elements(mlp):
  view = _serialize.xml_view(mlp[3])
  assert view.node(view.root, mlp[3]) is mlp[3]
  with pytest.raises(yax.YaxError, match='is not an element of the XML view'):
    view.node(etree.Element('module_call'), mlp[3])


def test_maps_and_arrays_map_back_to_nodes(mlp):
  mox = mlp[3]
  head = yax.query('//module_call[@name="head"]', mox)
  assert yax.query('map{"m": //module_call[@name="head"]}', mox) == {
      'm': head}
  assert yax.query('array{//module_call[@name="head"]}', mox) == head


def test_wrong_argument_types_raise_yax_errors(mlp):
  with pytest.raises(yax.XPathError, match='expected an XPath expression '
                     r'\(str\), got bytes'):
    yax.query(b'//module_call', mlp[3])
  with pytest.raises(yax.XPathError, match=r'variables: \$t must be a str'):
    yax.query('//*[@type=$t]', mlp[3], variables={'t': object()})
  with pytest.raises(yax.XPathError, match=r'invalid value of \$t: .*U\+0000'):
    yax.query('//*[@type=$t]', mlp[3], variables={'t': 'a\x00'})
  with pytest.raises(yax.XPathError, match='not a valid XPath variable'):
    yax.query('//*', mlp[3], variables={'a b': 1})
  with pytest.raises(yax.XPathError, match='expected a dict'):
    yax.query('//*', mlp[3], variables=[('t', 1)])
  with pytest.raises(yax.YaxError, match='expected a Mox'):
    yax.query('//*', 'not a tree')


# ================================================================= views

class Odd(nn.Module):
  """A module with fields that XML and printing find awkward."""
  xmlns: str = 'urn:odd'
  label: str = 'a\x00b\x1bc\ud800d'
  blob: str = 'z' * 100_000

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name='inner')(x)


@pytest.fixture(scope='module')
def odd():
  model, x = Odd(), jnp.ones((1, 3))
  variables = model.init(jax.random.key(0), x)
  return yax.make_mox(model.apply)(variables, x)


def test_field_named_xmlns_is_renamed(odd):
  # Written as-is, xmlns="urn:odd" put the element in a namespace and every
  # query for `module_call` missed it.
  assert len(yax.query('//module_call', odd)) == 3
  (node,) = yax.query('//module_call[@_xmlns="urn:odd"]', odd)
  assert node.module_ty is Odd
  text = io.StringIO()
  yax.dump_xml(odd, text)
  root = etree.fromstring(text.getvalue())
  assert all(el.nsmap == {} for el in root.iter())


def test_reserved_and_invalid_attribute_names_are_renamed(mlp):
  mox = mlp[3]
  (relu,) = yax.query('//*[@name="relu"]', mox)
  params = {**relu.params, 'xmlns': 'u', 'xmlns:p': 'v', 'xml:lang': 'w',
            'XMLNS': 'x', 'a b': 1, '1x': 2, '': 3, 'é': 4}
  odd = relu.replace(params=params)
  attrs = yax.to_dict(odd)['attrs']
  assert attrs['_xmlns'] == 'u' and attrs['_xmlns_p'] == 'v'
  assert attrs['_xml_lang'] == 'w' and attrs['_XMLNS'] == 'x'
  assert attrs['a_b'] == '1' and attrs['_1x'] == '2' and attrs['_'] == '3'
  assert attrs['__'] == '4'  # 'é' -> '_', which is taken -> '__'
  assert yax.query('self::custom_jvp_call/@_xmlns', odd) == ['u']


def test_unprintable_characters_are_escaped_everywhere(odd):
  escaped = 'a\\x00b\\x1bc\\ud800d'
  text = str(odd)
  text.encode('utf-8')  # no lone surrogate left
  assert f"label={escaped}" in text
  assert yax.query('//module_call[@type="Odd"]/@label', odd) == [escaped]
  xml = io.StringIO()
  yax.dump_xml(odd, xml)
  assert f'label="{escaped}"' in xml.getvalue()
  data = json.loads(yax.to_json(odd))
  assert data['children'][3]['attrs']['label'] == escaped
  yson = pytest.importorskip('yt.yson')
  out = io.BytesIO()
  yax.dump_yson(odd, out)
  assert yson.loads(out.getvalue())[3].attributes['label'] == escaped


def test_huge_field_values_are_truncated(odd):
  (blob,) = yax.query('//module_call[@type="Odd"]/@blob', odd)
  assert blob.startswith('zzz') and blob.endswith('...[100000 characters]')
  assert len(blob) < _text.MAX_TEXT + 40
  assert len(str(odd)) < 20_000


class _RaisingDtype:
  @property
  def dtype(self):
    raise ValueError('no dtype')
  shape = (2,)


class _OddShape:
  dtype = np.float32
  shape = 'not a shape'


class _NonsenseDtype:
  dtype = 'nonsense'
  shape = (2, 3)


class _BadRepr(str):
  def __repr__(self):
    raise RuntimeError('repr')


class _RaisingName:
  @property
  def name(self):
    raise RuntimeError('name')


class _RaisingModule:
  def __init__(self):
    self.__qualname__ = 'Callable'

  def __call__(self):
    return None

  @property
  def __module__(self):
    raise RuntimeError('module')


class _ArrayLike:
  dtype = np.dtype('int8')
  shape = (4, 5)


def test_fields_with_odd_attributes_format():
  fv = _text.format_value
  assert fv(_RaisingDtype()) == '_RaisingDtype'
  assert fv(_OddShape()) == '_OddShape'
  assert fv(_NonsenseDtype()) == '_NonsenseDtype'
  assert fv(_ArrayLike()) == 'int8[4, 5]'
  assert fv((_BadRepr('s'),)) == '(<_BadRepr object; repr raised RuntimeError>,)'
  assert _text.safe_repr(_BadRepr('s')) == (
      '<_BadRepr object; repr raised RuntimeError>')
  assert fv(_RaisingName()) == '_RaisingName'
  assert fv(_RaisingModule()) == 'Callable'
  assert fv(10 ** 5000) == '<int with 16610 bits>'
  assert fv('\ud800\x00') == '\\ud800\\x00'
  loop = []
  loop.append(loop)
  assert fv(loop).startswith('[[[[') and fv(loop).endswith(']]]]')
  assert '...' in fv(loop)


class _BrokenMapping(collections.abc.Mapping):
  def __getitem__(self, key):
    raise KeyError(key)

  def __len__(self):
    return 1

  def __iter__(self):
    raise RuntimeError('cannot iterate')


def test_format_value_never_raises():
  assert _text.format_value(_BrokenMapping()) == (
      '<_BrokenMapping; formatting raised RuntimeError>')


class OddFields(nn.Module):
  weird: object = None

  @nn.compact
  def __call__(self, x):
    return x * 2.0


@pytest.mark.parametrize('value', [
    _RaisingDtype(), _OddShape(), _NonsenseDtype(), _RaisingName(),
    (_BadRepr('s'),), 10 ** 5000, _BrokenMapping()],
    ids=lambda v: type(v).__name__)
def test_modules_with_odd_fields_print_and_export(value):
  model, x = OddFields(weird=value), jnp.ones((2,))
  node = yax.make_mox(model.apply)({}, x).children[0]
  mox = yax.Mox(node.inputs, node.outputs, children=[node])
  shown = _text.format_value(value)
  assert f'weird={shown}' in str(mox)
  assert yax.to_dict(mox)['children'][-2]['attrs']['weird'] == shown
  yax.dump_xml(mox, io.StringIO())


def test_literal_that_numpy_cannot_convert():
  class NotAnArray:
    def __array__(self, *args, **kwargs):
      raise TypeError('not convertible')

    def __repr__(self):
      return 'NotAnArray()'
  lit = yax.Literal(NotAnArray(), jax.core.ShapedArray((), jnp.float32))
  data = yax.to_dict(yax.Mox([lit], [lit]))
  assert data['children'][0]['text'] == 'NotAnArray()'


def test_symbol_with_an_odd_aval():
  sym = yax.Var(None)
  data = yax.to_dict(yax.Mox([sym], [sym]))
  assert data['children'][0]['attrs']['type'] == 'None'




def test_var_paths_of_a_picky_pytree_are_left_out():
  var = yax.Var(jax.core.ShapedArray((2,), jnp.float32))
  tree = jax.tree_util.tree_structure(Picky(jnp.ones(2)))
  node = yax.Mox([var], [var], module_ty=MLP, var_tree=tree, path=('p',))
  (inp, _) = yax.to_dict(node)['children']
  assert 'var' not in inp['attrs']  # no path can be named, none is shown


def test_nnx_variable_kinds_of_a_picky_pytree_are_shown():
  """The variable types of an NNX call come from its VariableTree's own
  node: a picky pytree below it (its unflatten refuses placeholders) used
  to make the call look like Linen (no vartype, no NNX grouping)."""
  from flax import nnx
  from yax._src.ir.variables import VariableTree
  tree = VariableTree({'w': Picky(jnp.ones(2))})
  tree.kinds, tree.flags = ('Param',), ((True, True),)
  var = yax.Var(jax.core.ShapedArray((2,), jnp.float32))
  node = yax.Mox([var], [var], module_ty=nnx.Linear,
                 var_tree=jax.tree_util.tree_structure(tree), path=('p',))
  (inp, _) = yax.to_dict(node)['children']
  assert inp['attrs']['vartype'] == 'Param'


# ============================================================== eval_mox

def test_mox_is_positional_only():
  def fn(x, mox):
    return x * mox
  x, y = jnp.arange(3.0), jnp.full(3, 2.0)
  tree = yax.make_mox(fn)(x, mox=y)
  np.testing.assert_allclose(yax.eval_mox(tree, x, mox=y), fn(x, mox=y))


def _layers(n=40, bias=3):
  return {'params': {f'layer_{i}': {'bias': jnp.ones(bias),
                                    'kernel': jnp.ones((3, 3))}
                     for i in range(n)}}


def _stack(p, x):
  for i in range(40):
    layer = p['params'][f'layer_{i}']
    x = x @ layer['kernel'] + layer['bias']
  return x


def test_tree_mismatch_names_the_first_differing_path():
  params, x = _layers(), jnp.ones((1, 3))
  mox = yax.make_mox(_stack)(params, x)
  missing = _layers()
  del missing['params']['layer_39']['bias']
  with pytest.raises(yax.SignatureError, match=re.escape(
      "args[0]['params']['layer_39']['bias']: missing\n"
      '  expected: f32[3]\n  given:    nothing')):
    yax.eval_mox(mox, missing, x)
  extra = _layers()
  extra['params']['layer_2']['scale'] = jnp.ones(3)
  with pytest.raises(yax.SignatureError, match=re.escape(
      "args[0]['params']['layer_2']['scale']: unexpected\n"
      '  expected: nothing\n  given:    f32[3]')):
    yax.eval_mox(mox, extra, x)
  nested = _layers()
  nested['params']['layer_5']['bias'] = {'b': jnp.ones(3)}
  with pytest.raises(yax.SignatureError, match=re.escape(
      "args[0]['params']['layer_5']['bias']: expected f32[3], given a "
      "container (holding args[0]['params']['layer_5']['bias']['b'])")):
    yax.eval_mox(mox, nested, x)
  with pytest.raises(yax.SignatureError, match=re.escape(
      "argument args[0]['params']['layer_39']['bias'] does not match the "
      'trace.\n  expected: f32[3]\n  given:    f32[4]')):
    yax.eval_mox(mox, jax.tree_util.tree_map(
        lambda a: a, {'params': {**params['params'], 'layer_39': {
            'bias': jnp.ones(4), 'kernel': jnp.ones((3, 3))}}}), x)
  with pytest.raises(yax.SignatureError, match=re.escape(
      "kwargs['x']: unexpected")):
    yax.eval_mox(mox, params, x, x=x)


def test_frozendict_and_dict_params_are_interchangeable(mlp):
  model, variables, x, mox = mlp
  expected = model.apply(variables, x)
  frozen = FrozenDict(variables)
  np.testing.assert_allclose(yax.eval_mox(mox, frozen, x), expected)
  traced_frozen = yax.make_mox(model.apply)(frozen, x)
  np.testing.assert_allclose(yax.eval_mox(traced_frozen, variables, x),
                             expected)
  np.testing.assert_allclose(
      jax.jit(lambda v, x: yax.eval_mox(mox, v, x))(frozen, x), expected)
  # A real difference inside the other container type is still named.
  bad = FrozenDict({'params': {'hidden': variables['params']['hidden']}})
  with pytest.raises(yax.SignatureError, match=re.escape(
      "args[0]['params']['head']['bias']: missing")):
    yax.eval_mox(mox, bad, x)


def test_abstract_values_only_under_eval_shape(mlp):
  model, variables, x, mox = mlp
  spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
  with pytest.raises(yax.SignatureError, match=r'args\[1\] .*\n.*\n  given: '
                     r'   an abstract value, ShapeDtypeStruct f32\[1,3\]'):
    yax.eval_mox(mox, variables, spec)
  shapes = jax.eval_shape(lambda v, x: yax.eval_mox(mox, v, x), variables,
                          spec)
  assert shapes == jax.eval_shape(model.apply, variables, spec)


# ================================================ forward compatibility

def _in_yax(filename: str) -> bool:
  return os.path.abspath(filename).startswith(YAX_DIR + os.sep)


_LIBRARIES = ('/jax/', '/jaxlib/', '/flax/', '/contextlib.py', '/functools.py',
              '/warnings.py')


class _WarningOrigins:
  """Records, for each DeprecationWarning, the innermost frame of the stack
  that is not JAX or Flax itself: the code that called into them."""

  def __init__(self):
    self.caused_by_yax = []

  def __enter__(self):
    self._warn = warnings.warn
    origins = self

    def warn(message, category=None, stacklevel=1, source=None, **kw):
      cls = category or (type(message) if isinstance(message, Warning)
                         else UserWarning)
      if issubclass(cls, DeprecationWarning):
        stack = traceback.extract_stack()[:-1]
        outer = [f for f in stack if not any(
            lib in f.filename for lib in _LIBRARIES)]
        if outer and _in_yax(outer[-1].filename):
          origins.caused_by_yax.append(
              f'{message} (from {outer[-1].filename}:{outer[-1].lineno})')
      return origins._warn(message, category, stacklevel + 1, source, **kw)

    warnings.warn = warn
    return self

  def __exit__(self, *exc):
    warnings.warn = self._warn
    return False


def _exercise(fn, args, xpath, lora_xpath, sub_xpath, repl):
  mox = yax.make_mox(fn)(*args)
  yax.eval_mox(mox, *args)
  jax.jit(lambda *a: yax.eval_mox(mox, *a))(*args)
  str(mox)
  yax.dump_xml(mox, io.StringIO())
  mox.to_json()
  yax.to_jaxpr(mox)
  assert yax.query(xpath, mox)
  yax.query(f'{xpath}[matches(@path, ".")]', mox)  # elementpath
  new = yax.sub(sub_xpath, repl, mox)
  yax.check_mox(new)
  yax.eval_mox(new, *args)
  str(new)
  res = yax.lora(mox, args[0], lora_xpath, rank=2)
  yax.check_mox(res.mox)
  yax.eval_mox(res.mox, res.params, *args[1:])


def test_no_deprecation_warning_from_yax_calls():
  from transformers import BertConfig, FlaxBertModel

  with warnings.catch_warnings(record=True) as record, \
      _WarningOrigins() as origins:
    warnings.simplefilter('always')
    model, x = MLP(), jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), x)
    gelu = yax.make_mox(nn.gelu)(jnp.ones((1, 4)))
    _exercise(model.apply, (variables, x), '//module_call[@type="Dense"]',
              '//module_call[@type="Dense"]', '//*[@name="relu"]', gelu)

    bert = FlaxBertModel(BertConfig(
        vocab_size=99, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=20,
        max_position_embeddings=16), seed=0)
    ids = jnp.ones((1, 4), jnp.int32)
    tanh = yax.make_mox(jnp.tanh)(jnp.ones((1, 16)))
    _exercise(lambda p, i: bert(i, params=p), (bert.params, ids),
              '//module_call[@type="FlaxBertSelfAttention"]',
              '//module_call[@name="query" or @name="value"]',
              '//module_call[@type="FlaxBertPooler"]//tanh', tanh)

  deprecations = [w for w in record
                  if issubclass(w.category, DeprecationWarning)]
  from_yax_files = [f'{w.message} ({w.filename}:{w.lineno})'
                    for w in deprecations if _in_yax(w.filename)]
  assert not from_yax_files, from_yax_files
  assert not origins.caused_by_yax, origins.caused_by_yax


def test_warning_origin_detection_sees_yax_calls():
  # JAX warns from its own file (stacklevel points into JAX), as it does for
  # a Jaxpr built without DebugInfo; the origin is still found to be YAX.
  jax_dir = os.path.dirname(jax.__file__)
  deprecated = {}
  exec(compile('import warnings\n'
               'def api():\n'
               '  warnings.warn("api is deprecated", DeprecationWarning)\n',
               os.path.join(jax_dir, '_fake_api.py'), 'exec'), deprecated)
  caller = {'api': deprecated['api']}
  exec(compile('def use():\n  api()\n',
               os.path.join(YAX_DIR, '_fake_caller.py'), 'exec'), caller)
  for fn, from_yax in ((deprecated['api'], False), (caller['use'], True)):
    with warnings.catch_warnings(record=True), _WarningOrigins() as origins:
      warnings.simplefilter('always')
      fn()
    assert bool(origins.caused_by_yax) == from_yax
  assert '_fake_caller.py:2' in origins.caused_by_yax[0]


# ----------------------------------------------------------------- helpers

_SMALL = []


def _small_mox():
  if not _SMALL:
    _SMALL.append(yax.make_mox(lambda x: jnp.sin(x) * 2.0)(jnp.ones(3)))
  return _SMALL[0]


# ------------------------------------------- every view sees the same calls

def test_every_view_sees_the_same_module_calls_with_jitted_helpers():
  """A jit-ed helper (nn.silu) and a jax.jit-ed function called inside a
  module: their bodies call no module, so no view shows them as module
  calls; map_mox used to yield each body as an ephemeral Mox at <root>."""
  from helpers import assert_views_agree, module_calls_per_view

  @jax.jit
  def helper(x):
    return jnp.tanh(x) * 2.0

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return helper(nn.silu(nn.Dense(3, name='fc')(x)))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Block(name='b1')(Block(name='b0')(x))

  x = jnp.ones((2, 3))
  variables = Net().init(jax.random.key(0), x)
  mox = yax.make_mox(Net().apply)(variables, x)
  views = module_calls_per_view(mox)
  # What plain Flax calls: Net, b0, b0/fc, b1, b1/fc (and the root).
  want = [('', '', 'true'), ('', 'Net', 'false'), ('b0', 'Block', 'false'),
          ('b0/fc', 'Dense', 'false'), ('b1', 'Block', 'false'),
          ('b1/fc', 'Dense', 'false')]
  assert views['map_mox'] == want
  assert assert_views_agree(mox) == 5
