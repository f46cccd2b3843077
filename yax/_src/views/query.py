"""XPath queries over the XML view of a module expression.

``query(expr, mox)`` evaluates ``expr`` on the XML view of ``mox`` (see
:mod:`yax._src.views.serialize`) and maps the result back to the tree: elements to the
:class:`~yax.Mox`, :class:`~yax.Equation` and :class:`~yax.Symbol` objects
they stand for, attributes and text to strings, numbers and booleans as
XPath returns them.

Two engines: XPath 1.0 runs on lxml (libxml2, fast, compiled once per
expression); an expression that is not XPath 1.0 (XPath 2.0/3.1: ``matches()``
and other functions XPath 1.0 lacks, sequences ``(a, b)``, ``if``/``for``/
``let``, ...) runs on elementpath (pure Python, XPath 3.1, slower).

The contract (each point has a test in ``tests/views/test_guarantees_views.py``):

* every ``str`` either evaluates or raises :class:`~yax.XPathError` (characters
  XML cannot hold, nesting deeper than Python's stack, expressions that would
  exhaust memory included);
* the answer depends only on the expression, the tree and the variables: the
  engine is chosen from the text of the expression, and an evaluation that
  lxml cannot finish is handed to elementpath for that call only, so a failed
  evaluation never changes what the same expression returns later;
* every element of a result maps back to a node of the tree, or the query
  raises (an element that is not part of the view, e.g. from ``parse-xml()``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import sys
import threading
from typing import Any

from lxml import etree

from yax._src.errors import XPathError
from yax._src.ir.nodes import Equation, Expr, Mox, Symbol
from yax._src.ir.text import XML_BAD_CHAR, safe_repr
from yax._src.views.serialize import module_calls_of_type, xml_view

__all__ = ['query']

# ------------------------------------------------------------------ limits

# Range expressions (``1 to N``) longer than this are refused: elementpath
# materializes a range as a Python list in one C call, which no watchdog can
# interrupt (10**7 integers take about 360 MB).
MAX_RANGE = 10_000_000
# An elementpath evaluation that grows the process by more than this many
# bytes is stopped (see ``_MemoryGuard``).
MEMORY_BUDGET = 2 << 30

# The function library of XPath 1.0 (plus the node tests that look like
# calls). An expression calling any other function is XPath 2.0 or later.
_XPATH1_CALLS = frozenset((
    'last', 'position', 'count', 'id', 'local-name', 'namespace-uri', 'name',
    'string', 'concat', 'starts-with', 'contains', 'substring-before',
    'substring-after', 'substring', 'string-length', 'normalize-space',
    'translate', 'boolean', 'not', 'true', 'false', 'lang', 'number', 'sum',
    'floor', 'ceiling', 'round', 'node', 'text', 'comment',
    'processing-instruction'))
# A name followed by ``(``. It may start only where a name starts (not
# inside one, nor after a QName prefix's ``:``), and its quantifiers are
# possessive: every character is looked at a bounded number of times, so a
# name test 100,000 characters long is scanned in linear time, not
# quadratic (which took minutes).
_CALL = re.compile(r'(?<![\w.\-])(?<![\w.\-]:)'
                   r'([A-Za-z_][\w.\-]*+(?::[A-Za-z_][\w.\-]*+)?+)\s*+\(')
_TOO_DEEP = ('the expression is nested too deeply for the Python stack '
             '(sys.getrecursionlimit())')
_VARIABLE_NAME = re.compile(r'[A-Za-z_][\w.\-]*\Z')
# The selection of every tool's examples, answered without the XML view
# (building it is most of the first rewrite of a large tree): the type
# name as a literal in double or single quotes.
_TYPE_QUERY = re.compile(
    r'//module_call\[@type=(?:"([^"]*)"|\'([^\']*)\')\]\Z')


class _LimitExceeded(BaseException):
  """Stops an elementpath evaluation from inside (a ``BaseException``, so that
  elementpath's own ``except Exception`` clauses cannot swallow it)."""


# ----------------------------------------------------------- expressions

# White space between XPath tokens (XPath 1.0 ``S``). The viewer's
# ``rewriteShorthand`` (viewer/viewer.js) uses the same four characters.
XPATH_SPACE = ' \t\r\n'


def rewrite_shorthand(expr: str) -> tuple[str, list[int]]:
  """Rewrites steps with no node test (``//[@k=v]``, ``a/[1]``) to ``*``.

  Older YAX examples write ``//[@name="relu"]`` for ``//*[@name="relu"]``.
  Returns the new text and the positions (in ``expr``) where ``*`` went in.
  String literals are left alone. ``yax.render_html``'s page does the same
  in the browser (``rewriteShorthand`` in ``viewer/viewer.js``).
  """
  out = []
  inserted = []
  quote = None
  last = ''  # the last character outside string literals that is not space
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
    if ch not in XPATH_SPACE:
      last = ch
  return ''.join(out), inserted


def _outside_literals(text: str) -> str:
  """``text`` with the contents of string literals blanked out."""
  return re.sub(r'"[^"]*"|\'[^\']*\'', lambda m: ' ' * len(m.group()), text)


def needs_xpath2(text: str) -> bool:
  """Whether ``text`` calls a function (or kind test) that XPath 1.0 lacks."""
  return any(name not in _XPATH1_CALLS
             for name in _CALL.findall(_outside_literals(text)))


def _check_characters(expr: str, what: str = 'XPath expression') -> None:
  bad = XML_BAD_CHAR.search(expr)
  if bad is not None:
    ch = bad.group()
    raise XPathError(
        f'invalid {what}: it contains U+{ord(ch):04X} '
        f'({ch!r}) at column {bad.start() + 1}, a character that XML, and so '
        f'XPath, cannot hold: {expr!r:.200}\n'
        '  In the XML view such characters of module fields are written as '
        'Python escapes (\\x01); query for that text instead.')


class _Compiled:
  """One expression, compiled for the engine that runs it.

  Everything here is a function of the text alone: compiling twice gives the
  same object, and evaluating never changes it.
  """

  __slots__ = ('expr', 'text', 'inserted', 'lxml', 'lxml_error', 'selector',
               'may_select_document', 'lxml_count')

  def __init__(self, expr: str):
    self.expr = expr
    self.text, self.inserted = rewrite_shorthand(expr)
    self.lxml = None
    self.lxml_error = None
    self.selector = None
    self.lxml_count = None
    # lxml drops the document node from node sets; expressions that can
    # select it are counted as well (see ``_lxml_select``).
    plain = _outside_literals(self.text)
    self.may_select_document = bool(re.search(
        r'\.\.|parent|ancestor|self::|/\s*(?=[^\s/\w*@(]|$)', plain))
    if needs_xpath2(self.text):
      self.selector, _ = self._parse_elementpath()
      if self.selector is not None:
        return
    try:
      self.lxml = etree.XPath(self.text, smart_strings=False)
    except etree.XPathSyntaxError as e:
      # Not XPath 1.0 (sequences, `if`, `for`, ...): elementpath's turn.
      self.lxml_error = e
      self.elementpath_selector()

  def _parse_elementpath(self):
    """(selector, None), or (None, why elementpath cannot parse the text)."""
    try:
      return _elementpath().Selector(self.text, parser=_parser()), None
    except _elementpath().ElementPathError as e:
      return None, e
    except RecursionError:
      return None, _Reason(_TOO_DEEP)
    except _LimitExceeded as e:  # elementpath folds constant ranges
      return None, _Reason(str(e))
    except Exception as e:  # noqa: BLE001 - reported, see below
      # elementpath is pure Python; an exception of its own that is not an
      # ElementPathError (TypeError, KeyError...) still means it could not
      # parse this text. It is reported as such, with its type.
      return None, _Reason(e)

  def elementpath_selector(self, lxml_error=None):
    """The elementpath parse of the expression (built on first use); raises
    XPathError with both engines' reasons when it cannot be parsed."""
    if self.selector is None:
      selector, ep_error = self._parse_elementpath()
      if selector is None:
        raise self.error(ep_error, lxml_error)
      self.selector = selector
    return self.selector

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

  def error(self, ep_error=None, lxml_error=None, *,
            what='invalid XPath expression') -> XPathError:
    lxml_error = lxml_error or self.lxml_error
    reasons = []
    if lxml_error is not None:
      reasons.append(f'XPath 1.0 (lxml): {_lxml_message(lxml_error)}')
    if ep_error is not None:
      reasons.append(f'XPath 3.1 (elementpath): {_ep_message(ep_error)}')
    pos = self.position(lxml_error, ep_error)
    where = '' if pos is None else f' at column {pos + 1}'
    shown = self.expr if len(self.expr) <= 400 else self.expr[:400] + '...'
    lines = [f'{what}{where}: {shown!r}']
    if pos is not None and '\n' not in self.expr and len(self.expr) <= 400:
      lines += ['  ' + self.expr, '  ' + ' ' * min(pos, len(self.expr)) + '^']
    lines += ['  ' + r for r in reasons]
    if self.text != self.expr and len(self.text) <= 400:
      lines.append(f'  (evaluated as {self.text!r})')
    return XPathError('\n'.join(lines))


class _Reason:
  """An error message that is not an exception of either engine."""

  def __init__(self, exc_or_text):
    if isinstance(exc_or_text, BaseException):
      exc_or_text = f'{type(exc_or_text).__name__}: {exc_or_text}'
    self.message = str(exc_or_text)[:500]


def _lxml_message(e) -> str:
  msgs = [entry.message for entry in getattr(e, 'error_log', ())]
  return '; '.join(dict.fromkeys(msgs)) or str(e) or type(e).__name__


def _ep_message(e) -> str:
  if isinstance(e, _Reason):
    return e.message
  code = getattr(e, 'code', None)
  message = getattr(e, 'message', None) or str(e)
  return f'[{code}] {message}' if code else message


@functools.lru_cache(maxsize=512)
def compile_xpath(expr: str) -> _Compiled:
  """Compiles ``expr`` once (cached); raises :class:`XPathError`."""
  _check_characters(expr)
  return _Compiled(expr)


# ------------------------------------------------------------ elementpath

def _elementpath():
  import elementpath
  return elementpath


@functools.cache
def _parser():
  """XPath 3.1 with range expressions limited to ``MAX_RANGE`` items."""
  from elementpath.xpath31 import XPath31Parser
  base = XPath31Parser.symbol_table['to']

  class _BoundedRange(base):
    def evaluate(self, context=None):
      bounds = [_as_int(op.evaluate(context)) for op in self]
      if None not in bounds:
        n = bounds[1] - bounds[0] + 1
        if n > MAX_RANGE:
          raise _LimitExceeded(
              f'the range {bounds[0]} to {bounds[1]} has {n} items; '
              f'at most {MAX_RANGE} are allowed')
      return super().evaluate(context)

  class _Parser(XPath31Parser):
    symbol_table = {**XPath31Parser.symbol_table, 'to': _BoundedRange}

  return _Parser


def _as_int(value) -> int | None:
  """A range bound as an int, or None when it is not a number."""
  if isinstance(value, list):
    if len(value) != 1:
      return None
    value = value[0]
  if isinstance(value, bool):
    return None
  try:
    return int(value if isinstance(value, (int, float)) else str(value))
  except (TypeError, ValueError, OverflowError):  # not a number: no range
    return None


def _resident_bytes() -> int:
  """The memory the process holds now (Linux), or its peak (elsewhere)."""
  try:
    with open('/proc/self/statm', 'rb') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
  except OSError:  # no /proc (macOS): the peak, which grows as well
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == 'darwin' else peak * 1024


class _MemoryGuard:
  """Stops the calling thread's Python code if the process grows too much.

  elementpath builds sequences and strings in Python; an expression such as
  ``string-join(for $i in 1 to 9999999 return $i, ",")`` nested a few times
  would take all memory (and end in the operating system killing the
  process, not in ``MemoryError``). A watchdog thread samples the process
  size every few milliseconds and, past the budget, raises
  ``_LimitExceeded`` in the evaluating thread with CPython's
  ``PyThreadState_SetAsyncExc`` (delivered between two bytecodes).
  """

  def __init__(self, budget: int):
    self.budget = budget
    self.target = threading.get_ident()
    self.lock = threading.Lock()
    self.done = threading.Event()
    self.fired = False
    self.thread = threading.Thread(target=self._watch, daemon=True,
                                   name='yax-xpath-memory-guard')

  def _watch(self):
    start = _resident_bytes()
    while not self.done.wait(0.005):
      if _resident_bytes() - start > self.budget:
        with self.lock:
          if not self.done.is_set():
            self.fired = True
            _async_raise(self.target, _LimitExceeded)
        return

  def __enter__(self):
    self.thread.start()
    return self

  def __exit__(self, *exc):
    with self.lock:
      self.done.set()
      if self.fired:
        _async_raise(self.target, None)  # clear it if not yet delivered
    self.thread.join()
    if self.fired:
      raise _LimitExceeded(
          f'the evaluation grew the process by more than '
          f'{self.budget >> 20} MiB (yax._src.views.query.MEMORY_BUDGET)')
    return False


def _async_raise(thread_id: int, exc_type) -> None:
  ctypes.pythonapi.PyThreadState_SetAsyncExc(
      ctypes.c_ulong(thread_id),
      ctypes.py_object(exc_type) if exc_type is not None else None)


@contextlib.contextmanager
def _limits(compiled: _Compiled, lxml_error=None):
  """Turns running out of stack, memory or range size into ``XPathError``."""
  try:
    try:
      yield
    except RecursionError:
      raise compiled.error(_Reason(_TOO_DEEP), lxml_error,
                           what='XPath expression too deep') from None
    except MemoryError:
      raise compiled.error(_Reason('out of memory'), lxml_error,
                           what='XPath expression exhausted memory') from None
  except _LimitExceeded as e:
    raise compiled.error(_Reason(str(e) or 'memory budget exceeded'),
                         lxml_error,
                         what='XPath expression exceeded a limit') from None


def _elementpath_select(compiled: _Compiled, view, variables, lxml_error):
  selector = compiled.elementpath_selector(lxml_error)
  ep = _elementpath()
  root = view.elementpath_root()
  try:
    with _limits(compiled, lxml_error):
      with _MemoryGuard(MEMORY_BUDGET):
        return selector.select(root, item=root.children[0],
                               variables=variables)
  except ep.ElementPathError as e:
    raise compiled.error(e, lxml_error,
                         what='could not evaluate XPath expression') from None
  except XPathError:
    raise
  except Exception as e:  # noqa: BLE001 - reported, see below
    # Anything else elementpath raises while evaluating (an OverflowError on
    # a huge number, a TypeError from an odd operand) is still a failure to
    # evaluate this expression; it is reported with its type.
    raise compiled.error(_Reason(e), lxml_error,
                         what='could not evaluate XPath expression') from None


# ------------------------------------------------------------------ query

def _check_variables(variables) -> dict[str, Any]:
  if variables is None:
    return {}
  if not isinstance(variables, dict):
    raise XPathError(f'variables: expected a dict of name -> value, got '
                     f'{type(variables).__name__}')
  for name, value in variables.items():
    if not isinstance(name, str) or not _VARIABLE_NAME.match(name):
      raise XPathError(f'variables: {name!r} is not a valid XPath variable '
                       'name (letters, digits, _, - and ., not first a digit)')
    if isinstance(value, str):
      _check_characters(value, f'value of ${name}')
    elif not isinstance(value, (bool, int, float)):
      raise XPathError(
          f'variables: ${name} must be a str, int, float or bool, got '
          f'{type(value).__name__}')
  return variables


def query(expr: str, mox: Expr, *, variables: dict[str, Any] | None = None
          ) -> list | Any:
  """Evaluates XPath ``expr`` over the XML view of ``mox``; maps results back.

  **Arguments:**
  - ``expr``: an XPath 1.0 expression (run by lxml) or an XPath 2.0/3.1 one
    (``matches()``, sequences, ``if``..., run by elementpath). A step with no
    node test, ``//[@name="relu"]``, means ``//*[@name="relu"]``.
  - ``mox``: the tree (what :func:`yax.make_mox` returns) or any node of it.
  - ``variables``: values (str, int, float, bool) for ``$name`` references.

  **Returns:** for a node sequence, a list in document order: a
  ``module_call`` or equation element gives the :class:`~yax.Mox` /
  :class:`~yax.Equation` itself (``query(...)[0] is node``), an ``input`` /
  ``output`` element its :class:`~yax.Symbol`, an attribute or text node its
  string value; the root element and the document node (``'/'``) give
  ``mox``. An expression with an atomic value (``count(...)``,
  ``string(...)``, comparisons) returns that value as the engine gives it
  (lxml: ``float``/``str``/``bool``).

  Expressions are evaluated with the root element as the context node, so
  ``.`` is ``mox`` and relative paths (``module_call``) start below it.

  **Raises:** :class:`yax.XPathError` (a ``ValueError``) for anything that is
  not a valid expression (with where it failed), that cannot be evaluated,
  that is nested too deeply or would exhaust memory (ranges over
  ``MAX_RANGE`` items, evaluations that grow the process by more than
  ``MEMORY_BUDGET`` bytes), or whose result holds an element that is not part
  of the view. :class:`yax.YaxError` when ``mox`` is not a tree.

  >>> yax.query('//module_call[@type="Dense"]', mox)    # doctest: +SKIP
  [Mox(Dense at Dense_0, 3 inputs, 1 outputs, 3 children)]
  """
  if not isinstance(expr, str):
    raise XPathError(
        f'expected an XPath expression (str), got {type(expr).__name__}: '
        f'{safe_repr(expr, 80)}')
  by_type = _TYPE_QUERY.match(expr)
  if by_type is not None and XML_BAD_CHAR.search(expr) is None:
    name = by_type.group(1)
    found = module_calls_of_type(mox, by_type.group(2) if name is None
                                 else name)
    _check_variables(variables)
    return found
  compiled = compile_xpath(expr)
  view = xml_view(mox)
  variables = _check_variables(variables)
  lxml_error = None
  if compiled.lxml is not None:
    try:
      result = _lxml_select(compiled, view, variables)
    except etree.Error as e:
      # E.g. an undefined variable or a type lxml cannot convert: elementpath
      # gets this call (and only this one; the next call tries lxml again).
      lxml_error = e
    else:
      return _map(result, view, mox, compiled)
  result = _elementpath_select(compiled, view, variables, lxml_error)
  return _map(result, view, mox, compiled)


def _lxml_select(compiled: _Compiled, view, variables):
  result = compiled.lxml(view.root, **variables)
  if isinstance(result, list) and compiled.may_select_document:
    # lxml leaves the document node out of node sets; count it back in.
    if compiled.lxml_count is None:
      compiled.lxml_count = etree.XPath(f'count(({compiled.text}))')
    if compiled.lxml_count(view.root, **variables) > len(result):
      result = [view.root.getroottree(), *result]
  return result


def _map(result, view, mox, compiled):
  if isinstance(result, list):
    return [_map(item, view, mox, compiled) for item in result]
  if isinstance(result, etree._Element):
    if result not in view.objects:
      raise _foreign(compiled, f'<{result.tag}>')
    return view.node(result, mox)
  if isinstance(result, etree._ElementTree):
    if result.getroot() is not view.root:
      raise _foreign(compiled, 'a document')
    return mox
  return _atom(result, view, mox, compiled)


def _foreign(compiled: _Compiled, what: str) -> XPathError:
  return XPathError(
      f'XPath expression {compiled.expr!r:.200} returned {what}, which is not '
      'part of the XML view of the tree (built by parse-xml() or a similar '
      'function), so it stands for no node of the tree')


def _atom(value, view, mox, compiled):
  if isinstance(value, str):
    return str(value)  # lxml/elementpath string subclasses -> plain str
  if isinstance(value, (bool, int, float, Mox, Equation, Symbol)):
    return value
  from elementpath.datatypes import UntypedAtomic
  if isinstance(value, UntypedAtomic):  # e.g. data(@features)
    return str(value)
  ep = _elementpath()
  if isinstance(value, ep.XPathNode):  # inside XPath 3.1 maps and arrays
    node = getattr(value, 'elem', None)
    if node is None and isinstance(value, ep.DocumentNode):
      node = value.document
    if node is None:  # an attribute, text or namespace node: its value
      return str(value.string_value)
    return _map(node, view, mox, compiled)
  from elementpath.xpath_tokens import XPathArray, XPathMap
  if isinstance(value, XPathArray):
    return [_map(item, view, mox, compiled) for item in value.items()]
  if isinstance(value, XPathMap):
    return {_map(k, view, mox, compiled): _map(v, view, mox, compiled)
            for k, v in value.items()}
  return value
