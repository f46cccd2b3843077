"""The XML view of a module expression, and its YSON and JSON forms.

Every node of a tree becomes one XML element: ``module_call`` for a
:class:`~yax.Mox`, the primitive name for an :class:`~yax.Equation`
(``dot_general``, ``jit``, ...). Inside it come one ``input`` element per
input symbol, then the body (module calls and equations, in evaluation
order), then one ``output`` element per output symbol::

  <module_call primitive="module_call" type="Dense" name="Dense_0" ...>
    <input type="f32[3]" var="params/bias">a</input>
    <input type="f32[4,3]" var="params/kernel">b</input>
    <input type="f32[1,4]">c</input>
    <dot_general primitive="dot_general" dimension_numbers="...">
      <input type="f32[1,4]">c</input>
      <input type="f32[4,3]">b</input>
      <output type="f32[1,3]">d</output>
    </dot_general>
    ...
    <output type="f32[1,3]">f</output>
  </module_call>

A symbol has one name in the whole document (``a``, ``b``, ..., ``z``,
``ba``, ... in order of first appearance), so data flow can be followed with
XPath: ``//*[input = "d"]`` are the readers of ``d``. ``docs/xml-schema.md``
lists every element and attribute.

The view of a tree is built once (lxml elements, no text round trip) and
kept in a weak cache keyed by the tree, together with the map from each
element back to its :class:`~yax.Mox`, :class:`~yax.Equation` or
:class:`~yax.Symbol`; :func:`yax.query` evaluates XPath on it. Trees are
immutable by convention: a tree changed in place after its first query keeps
its old view.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from typing import IO, Any

import jax
import numpy as np
from lxml import etree

from yax._src.errors import YaxError
from yax._src.ir.nodes import (Equation, Expr, Literal, Mox, Symbol,
                               register_view)
from yax._src.ir.text import escape_text, format_value, safe_repr, truncate
from yax._src.trace import systems as _systems

__all__ = ['dump_xml', 'dump_yson', 'to_dict', 'to_json', 'xml_view']

# Attribute names that YAX itself writes on a module_call; module fields
# with these names are written with a leading underscore (``_type``).
_MOX_RESERVED = frozenset(
    ('primitive', 'type', 'fqn', 'name', 'path', 'method', 'ephemeral',
     'rewritten', 'param'))
_EQN_RESERVED = frozenset(('primitive', 'jax_primitive'))
# Element names YAX uses for its own elements; a primitive with such a name
# is written as ``_input`` etc.
_RESERVED_TAGS = frozenset(('module_call', 'input', 'output'))

_NAME_OK = re.compile(r'[A-Za-z_][A-Za-z0-9_.\-]*\Z')
_NAME_BAD_CHAR = re.compile(r'[^A-Za-z0-9_.\-]')
# Attribute names that XML gives a meaning of its own: `xmlns` and `xmlns:p`
# declare namespaces (an element with `xmlns="..."` is no longer a plain
# `module_call`, so every query would miss it), `xml:lang` etc. are reserved.
_XML_RESERVED_ATTR = re.compile(r'xmlns(:|\Z)|xml:', re.IGNORECASE)


def xml_name(name) -> str:
  """A valid XML name for ``name``: characters other than ASCII letters,
  digits, ``_``, ``-`` and ``.`` become ``_``; a leading ``_`` is added when
  the name does not start with a letter or ``_``. Never raises."""
  name = name if isinstance(name, str) else safe_repr(name, 200)
  if _NAME_OK.match(name):
    return name
  name = _NAME_BAD_CHAR.sub('_', truncate(name, 200))
  if not name or not (name[0].isalpha() or name[0] == '_'):
    name = '_' + name
  return name


def xml_attr_name(name) -> str:
  """:func:`xml_name`, plus a leading ``_`` for names XML reserves for
  attributes (``xmlns`` -> ``_xmlns``, ``xmlns:p`` -> ``_xmlns_p``,
  ``xml:lang`` -> ``_xml_lang``)."""
  text = name if isinstance(name, str) else ''
  if _XML_RESERVED_ATTR.match(text):
    return '_' + xml_name(text)
  return xml_name(name)


def _unique(key: str, used) -> str:
  while key in used:
    key = '_' + key
  return key


def _format(value) -> str | None:
  key = _plain_key(value)
  if key is None:
    return _format_uncached(value)
  try:
    return _FORMATTED[key]
  except KeyError:
    text = _FORMATTED[key] = _format_uncached(value)
    if len(_FORMATTED) > 4096:
      _FORMATTED.clear()
    return text


def _format_uncached(value) -> str | None:
  text = format_value(value, bools='xml')
  return None if text is None else escape_text(text)


# Texts of plain param values (ints, strings, tuples of them: axes, shapes,
# dimension numbers), which most equations repeat: formatting them was a
# third of building BERT-base's view.
_FORMATTED: dict = {}
_PLAIN = (type(None), bool, int, str)


def _plain_key(value):
  """A key that tells apart every plain value with another text (``1``,
  ``True`` and ``1.0`` are equal but print differently, so the type is part
  of it), or None for any other value."""
  if type(value) in _PLAIN:
    if type(value) is str and len(value) > 200:
      return None  # kept out: the cache would hold every long string
    return (type(value), value)
  if type(value) is tuple:
    keys = tuple(map(_plain_key, value))
    if None not in keys:
      return (tuple, keys)
  return None


# ------------------------------------------------------------ attributes

# Attributes depend only on the node, and nodes are immutable, so they are
# computed once per node (rewritten trees share most nodes with the original).
_ATTRS: 'weakref.WeakKeyDictionary[Expr, tuple]' = weakref.WeakKeyDictionary()


def _func_name(fun) -> str | None:
  info = getattr(fun, 'debug_info', None)
  name = getattr(info, 'func_name', None)
  return name if isinstance(name, str) else None


def _equation_params(eqn: Equation) -> dict[str, Any]:
  """Params as JAX prints them: ``custom_jvp_call``/``custom_vjp_call`` get
  ``name`` (of the wrapped function) and ``jvp``/``fwd``/``bwd`` names."""
  params = dict(eqn.params)
  call = params.get('call_jaxpr')
  if 'name' not in params and call is not None:
    name = _func_name(getattr(call, 'jaxpr', call))
    if name is not None:
      params = {'name': name, **params}
  for key, short in (('jvp_jaxpr_fun', 'jvp'), ('fwd_jaxpr_thunk', 'fwd'),
                     ('bwd', 'bwd')):
    name = _func_name(params[key]) if key in params else None
    if name is not None:
      del params[key]
      params[short] = name
  if eqn.prim.name == 'custom_vjp_call':
    params.pop('out_trees', None)  # a thunk: nothing to show
  return params


def _equation_attrs(eqn: Equation) -> tuple[str, dict[str, str]]:
  prim_name = eqn.prim.name
  tag = xml_name(prim_name)
  if tag in _RESERVED_TAGS:
    tag = '_' + tag
  attrs = {'primitive': tag}
  if tag != prim_name:
    attrs['jax_primitive'] = escape_text(prim_name)
  _add_params(attrs, _equation_params(eqn).items(), _EQN_RESERVED)
  return tag, attrs


def _add_params(attrs: dict[str, str], params, reserved: frozenset) -> None:
  """Adds the ``(key, value)`` params that have a text form to ``attrs``,
  each under its XML name; a name that is ``reserved`` or taken already
  gets ``_`` prefixes until it is free (``_name``, ``__name``...)."""
  for key, value in params:
    text = _format(value)
    if text is None:
      continue
    key = xml_attr_name(key)
    if key in reserved or key in attrs:
      key = _unique('_' + key, attrs)
    attrs[key] = text


def _key_text(key) -> str:
  for field in ('key', 'name', 'idx'):
    if hasattr(key, field):
      return str(getattr(key, field))
  return str(key)


def _var_paths(mox: Mox) -> list[str]:
  """'params/kernel'-style paths of the variable inputs of a module call."""
  n = mox.num_vars
  if not n:
    return []
  try:
    tree = jax.tree_util.tree_unflatten(mox.var_tree, range(n))
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = ['/'.join(_key_text(k) for k in path) for path, _ in leaves]
  except Exception:  # noqa: BLE001 - see below
    # Why skipping is right: a custom pytree node whose unflatten rejects
    # placeholder leaves (it validates its children) cannot be walked without
    # the real values, which a view does not have. The variables are then
    # shown without `var` attributes, as docs/xml-schema.md says
    # (test_var_paths_of_a_picky_pytree_are_left_out).
    return [''] * n
  if len(paths) != n:
    raise YaxError(
        f'module_call at {"/".join(map(str, mox.path)) or "<root>"}: its '
        f'var_tree has {n} leaves but flattening it with paths gave '
        f'{len(paths)}; the pytree node types in it are inconsistent')
  return [escape_text(truncate(p, 200)) for p in paths]


def _mox_attrs(mox: Mox) -> dict[str, str]:
  attrs = {'primitive': 'module_call'}
  ty = mox.module_ty
  if ty is not None:
    attrs['type'] = escape_text(ty.__name__)
    attrs['fqn'] = escape_text(f'{ty.__module__}.{ty.__qualname__}')
  if mox.name is not None:
    attrs['name'] = escape_text(str(mox.name))
  if mox.path:
    attrs['path'] = escape_text('/'.join(map(str, mox.path)))
  if mox.entrypoint is not None:
    attrs['method'] = escape_text(str(mox.entrypoint))
  _add_params(attrs, ((k, v) for k, v in mox.params.items() if k != 'name'),
              _MOX_RESERVED)
  attrs['ephemeral'] = 'true' if mox.is_ephemeral else 'false'
  if mox.rewritten:  # a rewrite added variables or arguments to the call
    attrs['rewritten'] = 'true'
  return attrs


_ESCAPE = str.maketrans({'&': '&amp;', '<': '&lt;', '>': '&gt;',
                         '"': '&quot;', '\n': '&#10;', '\r': '&#13;',
                         '\t': '&#9;'})


def _escape(text: str) -> str:
  return text.translate(_ESCAPE)


def _start_tag(tag: str, attrs: dict[str, str]) -> str:
  return '<' + tag + ''.join(
      f' {k}="{_escape(v)}"' for k, v in attrs.items()) + '>'


def _node_markup(node: Expr) -> tuple[str, str, list[str]]:
  """(element name, start tag, escaped var paths) of a node, cached."""
  cached = _ATTRS.get(node)
  if cached is None:
    if isinstance(node, Mox):
      tag, attrs = 'module_call', _mox_attrs(node)
      var_paths = [f' var="{_escape(p)}"' if p else ''
                   for p in _var_paths(node)]
      kinds = _systems.variable_kinds(node)  # Param, BatchStat, RngCount ...
      if kinds:
        var_paths = [f'{v} vartype="{_escape(k)}"' if k else v
                     for v, k in zip(var_paths, kinds, strict=True)]
    else:
      (tag, attrs), var_paths = _equation_attrs(node), []
    cached = (tag, _start_tag(tag, attrs), var_paths)
    _ATTRS[node] = cached
  return cached


def _literal_text(lit: Literal) -> str:
  value = lit.value
  if lit.is_static:
    if value is None or isinstance(value, (bool, float, str)) or (
        isinstance(value, int) and value.bit_length() <= 3000):
      return safe_repr(value)
    return format_value(value, bools='python') or safe_repr(value)
  try:
    arr = np.asarray(value)
  except Exception:  # noqa: BLE001 - see below
    # Why skipping is right: a constant NumPy cannot convert (a typed PRNG
    # key array, an object standing in for an array in a hand-built tree) is
    # still a value of the tree; it is shown by its repr
    # (test_literal_that_numpy_cannot_convert).
    return safe_repr(value)
  if arr.ndim == 0:
    return repr(arr.item())
  return np.array2string(arr, separator=',', threshold=16).replace('\n', '')


# ------------------------------------------------------------------ view

# Type strings by abstract value: avals are immutable and hash fast, and
# formatting one (``aval.str_short``) is the most expensive part of a view.
_TYPES: dict[Any, str] = {}


def _type_str(aval) -> str:
  """The escaped type string of an aval (``f32[1,10]``)."""
  try:
    text = _TYPES.get(aval)
  except TypeError:  # an unhashable aval: format it every time
    return _format_type(aval)
  if text is None:
    text = _format_type(aval)
    if len(_TYPES) > 4096:
      _TYPES.clear()
    _TYPES[aval] = text
  return text


def _format_type(aval) -> str:
  try:
    text = aval.str_short(short_dtypes=True)
  except Exception:  # noqa: BLE001 - see below
    # Why skipping is right: a symbol of a hand-built tree may carry an aval
    # that is not a JAX abstract value (or None); its type is then shown as
    # its repr (test_symbol_with_an_odd_aval).
    text = safe_repr(aval, 200)
  return _escape(escape_text(text))


class XmlView:
  """The lxml element tree of a module expression and the map back.

  ``root`` is the ``module_call`` (or equation) element of the tree;
  ``objects`` maps each element to its node or symbol (the root element maps
  to ``None`` and stands for the tree itself, which the view must not keep
  alive: it is cached by a weak reference to that tree); ``names`` maps each
  symbol (not literals) to its name in the document.
  """

  __slots__ = ('root', 'objects', 'names', '_ep_root')

  def __init__(self, root, objects, names):
    self.root = root
    self.objects = objects
    self.names = names
    self._ep_root = None

  def node(self, element, tree: Expr):
    """The node or symbol ``element`` stands for (``tree`` for the root
    element); raises :class:`YaxError` for an element of another document."""
    try:
      obj = self.objects[element]
    except (KeyError, TypeError):
      raise YaxError(
          f'{safe_repr(element, 80)} is not an element of the XML view of '
          f'{safe_repr(tree, 80)}') from None
    return tree if obj is None else obj

  def elementpath_root(self):
    """The elementpath node tree of the document (built on first use): its
    document node, whose one child is the root element."""
    if self._ep_root is None:
      import elementpath
      self._ep_root = elementpath.get_node_tree(self.root.getroottree())
    return self._ep_root


class _Builder:
  """Writes the markup of a tree and lists its nodes in document order.

  Building markup and parsing it with libxml2 is about twice as fast as
  creating the elements one by one with ``etree.SubElement`` (measured on
  BERT-base: the per-element Python calls dominate either way, and the
  markup of each node is cached).
  """

  def __init__(self):
    self.parts: list[str] = []
    self.objects: list = []
    self.names: dict[Symbol, str] = {}

  def name(self, sym: Symbol) -> str:
    name = self.names.get(sym)
    if name is None:
      n = len(self.names)
      name = ''
      while True:
        name = chr(97 + n % 26) + name
        n //= 26
        if not n:
          break
      self.names[sym] = name
    return name

  def symbol(self, tag: str, sym: Symbol, var: str = ''):
    self.objects.append(sym)
    if isinstance(sym, Literal):
      text = _escape(_literal_text(sym))
      if sym.is_static:
        ty = _escape(type(sym.value).__name__)
        self.parts.append(
            f'<{tag} type="{ty}" literal="true" static="true">{text}</{tag}>')
      else:
        ty = _type_str(sym.aval)
        self.parts.append(f'<{tag} type="{ty}" literal="true">{text}</{tag}>')
      return
    ty = _type_str(sym.aval)
    name = self.names.get(sym) or self.name(sym)
    if getattr(sym, 'dropped', False):
      var += ' dropped="true"'
    self.parts.append(f'<{tag} type="{ty}"{var}>{name}</{tag}>')

  def node(self, node: Expr, param: str | None = None):
    tag, start, var_paths = _node_markup(node)
    if param is not None:
      start = f'{start[:-1]} param="{_escape(param)}">'
    self.parts.append(start)
    self.objects.append(node)
    symbol = self.symbol
    nvars = len(var_paths)
    for i, sym in enumerate(node.inputs):
      symbol('input', sym, var_paths[i] if i < nvars else '')
    children = node.children
    if isinstance(node, Equation) and children:
      # A view shows any tree, one check_mox refuses too: a body without a
      # key gets none (the keys are cut or padded to the bodies).
      keys = [_body_key(k) for k in node.body_keys[:len(children)]]
      keys += [None] * (len(children) - len(keys))
      for child, key in zip(children, keys, strict=True):
        self.node(child, key)
    else:
      for child in children:
        self.node(child)
    for sym in node.outputs:
      symbol('output', sym)
    self.parts.append(f'</{tag}>')


def module_calls_of_type(expr: Expr, type_name: str) -> list:
  """What ``//module_call[@type="<type_name>"]`` selects in the XML view
  of ``expr``, found without building the view: each module call whose
  ``type`` attribute is ``type_name``, in document order.

  It walks the nodes as :meth:`_Builder.node` writes them (a node, then
  its children, equation bodies included); the root is ``expr`` itself.

  Example::

    dense = module_calls_of_type(mox, 'Dense')
  """
  _check_expr(expr)
  found, stack = [], [expr]
  while stack:
    node = stack.pop()
    if isinstance(node, Mox) and node.module_ty is not None and \
        escape_text(node.module_ty.__name__) == type_name:
      found.append(node)
    stack.extend(reversed(node.children))
  return found


def _body_key(key) -> str:
  if isinstance(key, tuple):
    return escape_text('/'.join(map(str, key)))
  return escape_text(str(key))


def _check_expr(expr):
  if not isinstance(expr, Expr):
    raise YaxError(
        f'expected a Mox (what yax.make_mox returns) or an Equation, got '
        f'{type(expr).__name__}: {expr!r:.80}')


def build_view(expr: Expr) -> XmlView:
  """Builds the XML view of ``expr`` (uncached; see :func:`xml_view`)."""
  _check_expr(expr)
  builder = _Builder()
  builder.node(expr)
  parser = etree.XMLParser(huge_tree=True)
  root = etree.fromstring(''.join(builder.parts), parser)
  objects = dict(zip(root.iter(), builder.objects, strict=True))
  objects[root] = None  # the tree itself; see XmlView
  return XmlView(root, objects, builder.names)


_VIEWS: 'weakref.WeakKeyDictionary[Expr, XmlView]' = weakref.WeakKeyDictionary()


def xml_view(expr: Expr) -> XmlView:
  """The cached XML view of ``expr`` (built on first use).

  Treat the returned elements as read-only: they are shared by every query.
  """
  _check_expr(expr)
  view = _VIEWS.get(expr)
  if view is None:
    view = build_view(expr)
    _VIEWS[expr] = view
  return view


# ---------------------------------------------------------------- dumping

def _write(fileobj, data, mode: str) -> None:
  """Writes ``data`` to ``fileobj``: a path (opened with ``mode``, ASCII for
  text, and closed here) or a file object (left open)."""
  if isinstance(fileobj, (str, os.PathLike)):
    with open(fileobj, mode,
              **({} if 'b' in mode else {'encoding': 'ascii'})) as f:
      f.write(data)
  else:
    fileobj.write(data)


def _serialize_xml(expr: Expr, indent: int | None) -> bytes:
  root = xml_view(expr).root
  if indent is None:
    return etree.tostring(root, encoding='ascii', xml_declaration=False)
  if indent != 2:
    import copy
    root = copy.deepcopy(root)
    etree.indent(root, space=' ' * indent)
  return etree.tostring(root, encoding='ascii', xml_declaration=False,
                        pretty_print=True)


def dump_xml(mox: Expr, fileobj: IO[str] | str | os.PathLike,
             indent: int | None = 2) -> None:
  """Writes the XML view of ``mox`` to a text file object.

  **Arguments:**
  - ``mox``: the tree (what :func:`yax.make_mox` returns), or any node of it.
  - ``fileobj``: a text file object (``open(path, 'w')``, ``io.StringIO``) or
    a path.
  - ``indent``: spaces per nesting level; ``None`` writes one line.

  The text is plain ASCII (other characters as character references) with no
  XML declaration, so it is valid whatever the file's encoding. Elements and
  attributes are described in ``docs/xml-schema.md``.
  """
  _write(fileobj, _serialize_xml(mox, indent).decode('ascii'), 'w')


_SYMBOL_TAGS = ('input', 'output')  # an equation is never named so


def _dict(el) -> dict:
  tag = el.tag
  if tag in _SYMBOL_TAGS:
    return {'tag': tag, 'attrs': dict(el.attrib), 'text': el.text or ''}
  return {'tag': tag, 'attrs': dict(el.attrib),
          'children': [_dict(child) for child in el]}


def to_dict(mox: Expr) -> dict:
  """The XML view as nested dicts, ready for ``json.dumps``.

  Each element becomes ``{"tag": ..., "attrs": {...}, "children": [...]}``;
  an ``input``/``output`` element becomes ``{"tag": ..., "attrs": {...},
  "text": "a"}``. Attribute values are the XML attribute strings.
  """
  return _dict(xml_view(mox).root)


def to_json(mox: Expr, indent: int | None = None) -> str:
  """:func:`to_dict` as a JSON string."""
  return json.dumps(to_dict(mox), indent=indent)


def _yson(el, yson):
  if el.tag in _SYMBOL_TAGS:
    node = yson.YsonUnicode(el.text or '')
    node.attributes = {'tag': el.tag, **el.attrib}
  else:
    node = yson.YsonList([_yson(child, yson) for child in el])
    node.attributes = dict(el.attrib)
  return node


def to_yson(mox: Expr):
  """The XML view as ``yt.yson`` objects (see :func:`dump_yson`)."""
  try:
    import yt.yson as yson
  except ImportError as e:
    raise YaxError(
        'YSON export needs the ytsaurus-client package, which is not '
        'installed: pip install yax-mox[yson]') from e
  return _yson(xml_view(mox).root, yson)


def dump_yson(mox: Expr, fileobj: IO[bytes] | str | os.PathLike,
              indent: int | None = 2) -> None:
  """Writes the XML view of ``mox`` as YSON to a binary file object.

  Needs the ``yson`` extra (``pip install yax-mox[yson]``). A module call or
  equation element becomes a list of its children whose YSON attributes are
  the element's XML attributes (``primitive`` is the element name); an
  ``input``/``output`` element becomes a string (the symbol name) with its
  attributes plus ``tag`` (``input`` or ``output``). ``indent=None`` writes
  compact text YSON.
  """
  obj = to_yson(mox)
  import yt.yson as yson
  if indent is None:
    data = yson.dumps(obj, yson_format='text')
  else:
    data = yson.dumps(obj, yson_format='pretty', indent=indent)
  _write(fileobj, data, 'wb')


# Mox.to_dict / Mox.to_json: the data model (``ir/nodes.py``) does not import this
# module.
register_view('dict', to_dict)
register_view('json', to_json)
