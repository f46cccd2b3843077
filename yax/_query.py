"""XPath queries over the XML view of a module expression.

``query(expr, mox)`` evaluates ``expr`` on the XML view of ``mox`` (see
:mod:`yax._serialize`) and maps the result back to the tree: elements to the
:class:`~yax.Mox`, :class:`~yax.Equation` and :class:`~yax.Symbol` objects
they stand for, attributes and text to strings, numbers and booleans as
XPath returns them.

Two engines: XPath 1.0 runs on lxml (libxml2, fast, compiled once per
expression); an expression lxml cannot compile or run (XPath 2.0/3.1:
``matches()``, sequences ``(a, b)``, ``if``/``for``/``let``, ...) runs on
elementpath (pure Python, XPath 3.1, slower). The engine is chosen once per
expression and remembered.
"""

from __future__ import annotations

import functools
from typing import Any

from lxml import etree

from yax._errors import XPathError
from yax._ir import Expr
from yax._serialize import xml_view

__all__ = ['query']


def rewrite_shorthand(expr: str) -> tuple[str, list[int]]:
  """Rewrites steps with no node test (``//[@k=v]``, ``a/[1]``) to ``*``.

  Older YAX examples write ``//[@name="relu"]`` for ``//*[@name="relu"]``.
  Returns the new text and the positions (in ``expr``) where ``*`` went in.
  String literals are left alone.
  """
  out = []
  inserted = []
  quote = None
  last = ''  # the last non-blank character outside string literals
  for i, ch in enumerate(expr):
    if quote is not None:
      if ch == quote:
        quote = None
      out.append(ch)
      continue
    if ch in '"\'':
      quote = ch
    elif ch == '[' and last == '/':
      out.append('*')
      inserted.append(i)
    out.append(ch)
    if not ch.isspace():
      last = ch
  return ''.join(out), inserted


class _Compiled:
  """One expression, compiled for the engine that runs it."""

  __slots__ = ('expr', 'text', 'inserted', 'lxml', 'selector', 'lxml_error')

  def __init__(self, expr: str):
    self.expr = expr
    self.text, self.inserted = rewrite_shorthand(expr)
    self.lxml = None
    self.selector = None
    self.lxml_error = None
    try:
      self.lxml = etree.XPath(self.text, smart_strings=False)
    except etree.XPathSyntaxError as e:
      self.lxml_error = e
      self.use_elementpath()

  def use_elementpath(self, lxml_error=None):
    """Switches this expression to elementpath (XPath 3.1)."""
    if self.selector is not None:
      return
    import elementpath
    from elementpath.xpath31 import XPath31Parser
    try:
      self.selector = elementpath.Selector(self.text, parser=XPath31Parser)
    except elementpath.ElementPathError as e:
      raise self.error(e, lxml_error) from None
    self.lxml = None

  def position(self, lxml_error, ep_error) -> int | None:
    """Where parsing failed, as an index into the user's expression."""
    pos = None
    if lxml_error is not None and isinstance(lxml_error, etree.XPathSyntaxError):
      for entry in lxml_error.error_log:
        pos = entry.column
        break
    if pos is None and ep_error is not None:
      span = getattr(getattr(ep_error, 'token', None), 'span', None)
      if span:
        pos = span[0]
    if pos is None:
      return None
    return pos - sum(1 for i in self.inserted if i < pos)

  def error(self, ep_error=None, lxml_error=None) -> XPathError:
    lxml_error = lxml_error or self.lxml_error
    reasons = []
    if lxml_error is not None:
      reasons.append(f'XPath 1.0 (lxml): {_lxml_message(lxml_error)}')
    if ep_error is not None:
      reasons.append(f'XPath 3.1 (elementpath): {_ep_message(ep_error)}')
    pos = self.position(lxml_error, ep_error)
    where = '' if pos is None else f' at column {pos + 1}'
    lines = [f'invalid XPath expression{where}: {self.expr!r}']
    if pos is not None and '\n' not in self.expr:
      lines += ['  ' + self.expr, '  ' + ' ' * min(pos, len(self.expr)) + '^']
    lines += ['  ' + r for r in reasons]
    if self.text != self.expr:
      lines.append(f'  (evaluated as {self.text!r})')
    return XPathError('\n'.join(lines))


def _lxml_message(e) -> str:
  msgs = [entry.message for entry in e.error_log]
  return '; '.join(dict.fromkeys(msgs)) or str(e)


def _ep_message(e) -> str:
  code = getattr(e, 'code', None)
  message = getattr(e, 'message', None) or str(e)
  return f'[{code}] {message}' if code else message


@functools.lru_cache(maxsize=512)
def compile_xpath(expr: str) -> _Compiled:
  """Compiles ``expr`` once (cached); raises :class:`XPathError`."""
  return _Compiled(expr)


def query(expr: str, mox: Expr, *, variables: dict[str, Any] | None = None
          ) -> list | Any:
  """Evaluates XPath ``expr`` over the XML view of ``mox``; maps results back.

  **Arguments:**
  - ``expr``: an XPath 1.0 expression (run by lxml) or an XPath 2.0/3.1 one
    (``matches()``, sequences, ``if``..., run by elementpath). A step with no
    node test, ``//[@name="relu"]``, means ``//*[@name="relu"]``.
  - ``mox``: the tree (what :func:`yax.make_mox` returns) or any node of it.
  - ``variables``: values for ``$name`` references in ``expr``.

  **Returns:** for a node sequence, a list in document order: a
  ``module_call`` or equation element gives the :class:`~yax.Mox` /
  :class:`~yax.Equation` itself (``query(...)[0] is node``), an ``input`` /
  ``output`` element its :class:`~yax.Symbol`, an attribute or text node its
  string value; the root (and the document node) give ``mox``. An expression
  with an atomic value (``count(...)``, ``string(...)``, comparisons) returns
  that value as the engine gives it (lxml: ``float``/``str``/``bool``).

  Expressions are evaluated with the root element as the context node, so
  ``.`` is ``mox`` and relative paths (``module_call``) start below it.

  **Raises:** :class:`yax.XPathError` (a ``ValueError``) when the expression
  is invalid in both XPath 1.0 and 3.1, showing where it failed.

  >>> yax.query('//module_call[@type="Dense"]', mox)    # doctest: +SKIP
  [Mox(Dense at Dense_0, 3 inputs, 1 outputs, 3 children)]
  """
  if not isinstance(expr, str):
    raise XPathError(
        f'expected an XPath expression (str), got {type(expr).__name__}: '
        f'{expr!r:.80}')
  compiled = compile_xpath(expr)
  view = xml_view(mox)
  variables = variables or {}
  if compiled.lxml is not None:
    try:
      result = compiled.lxml(view.root, **variables)
    except etree.XPathEvalError as e:
      # E.g. an XPath 2.0 function lxml does not know: try elementpath.
      compiled.use_elementpath(e)
    else:
      return _map(result, view, mox)
  result = _select(compiled, view, variables)
  return _map(result, view, mox)


def _select(compiled: _Compiled, view, variables):
  import elementpath
  try:
    return compiled.selector.select(view.elementpath_root(),
                                    variables=variables)
  except elementpath.ElementPathError as e:
    raise compiled.error(e) from None


def _map(result, view, mox):
  if isinstance(result, list):
    objects = view.objects
    out = []
    for item in result:
      if isinstance(item, etree._Element):
        obj = objects.get(item, mox)
        out.append(mox if obj is None else obj)
      elif isinstance(item, etree._ElementTree):
        out.append(mox)
      elif isinstance(item, list):
        out.append(_map(item, view, mox))
      else:
        out.append(_atom(item))
    return out
  if isinstance(result, etree._Element):
    obj = view.objects.get(result)
    return mox if obj is None else obj
  return _atom(result)


def _atom(value):
  if isinstance(value, str):
    return str(value)  # lxml/elementpath string subclasses -> plain str
  if isinstance(value, (bool, int, float)):
    return value
  from elementpath.datatypes import UntypedAtomic
  if isinstance(value, UntypedAtomic):  # e.g. data(@features)
    return str(value)
  return value
