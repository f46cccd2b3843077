"""Formatting of parameter values for text, XML, YSON and JSON views.

Module fields are arbitrary Python objects (dtypes, initializers, config
objects, other modules). The views show each as a short, stable string, and
formatting never raises: a field whose own methods raise (a ``.dtype``
property that fails, a ``__repr__`` that raises) is shown by its class, a
huge text is cut to ``MAX_TEXT`` characters, and characters that XML cannot
hold are written as Python escapes, so ``str(mox)`` and every export show the
same text.
"""

from __future__ import annotations

import collections.abc
import enum
import functools
import inspect
import re
import sys
import types

import jax
import numpy as np
from jax.extend import core as jex

_SIMPLE = (str, int, float, complex)

# Characters that XML 1.0 does not allow anywhere in a document: NUL and the
# other C0 controls except tab, newline and carriage return, lone surrogates,
# U+FFFE and U+FFFF.
XML_BAD_CHAR = re.compile(
    '[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]')

# Longest text shown for one value (strings, reprs, containers); Jaxpr text
# is never cut, it is the program itself.
MAX_TEXT = 1000
# Deepest nesting of containers shown (a list that contains itself ends here).
_MAX_DEPTH = 16


def escape_text(text: str) -> str:
  """``text`` with characters that XML cannot hold (NUL, most control
  characters, lone surrogates) written as Python escapes (``\\x01``)."""
  if XML_BAD_CHAR.search(text) is None:
    return text
  return XML_BAD_CHAR.sub(
      lambda m: m.group().encode('unicode_escape', 'backslashreplace')
      .decode('ascii'), text)


def truncate(text: str, limit: int = MAX_TEXT) -> str:
  """``text`` cut to ``limit`` characters, saying how long it was."""
  if len(text) <= limit:
    return text
  return f'{text[:limit]}...[{len(text)} characters]'


def safe_getattr(obj, name: str):
  """``getattr(obj, name, None)``, also when the attribute raises."""
  try:
    return getattr(obj, name, None)
  except Exception:  # noqa: BLE001 - a property of a user object raised
    # Why skipping is right: a view shows what an object has; an attribute
    # that cannot be read is treated as absent (tests/views/test_guarantees_views.py
    # test_fields_with_odd_attributes_format).
    return None


def safe_repr(obj, limit: int = MAX_TEXT) -> str:
  """``repr(obj)``, cut to ``limit`` characters; never raises."""
  try:
    text = repr(obj)
    if not isinstance(text, str):
      raise TypeError(f'__repr__ returned {type(text).__name__}')
  except Exception as e:  # noqa: BLE001 - a user object's __repr__ raised
    # Why skipping is right: the repr is only shown; the class and the error
    # say as much (test_fields_with_odd_attributes_format).
    text = f'<{type(obj).__qualname__} object; repr raised {type(e).__name__}>'
  return escape_text(truncate(text, limit))


def _public_name(obj) -> str:
  """``module.qualname`` without ``<locals>``; a module under ``_src`` is
  replaced by the public module that exposes the same object
  (``jax._src.nn.functions.gelu`` -> ``jax.nn.gelu``), if one is loaded."""
  name = safe_getattr(obj, '__qualname__') or safe_getattr(obj, '__name__')
  if not isinstance(name, str):
    name = type(obj).__qualname__
  name = name.replace('<locals>.', '')
  module = safe_getattr(obj, '__module__')
  module = module if isinstance(module, str) else ''
  if '._src' in module or module.startswith('_'):
    parts = module.replace('._src', '').split('.')
    short = name.rsplit('.', 1)[-1]
    for k in range(len(parts), 0, -1):
      candidate = sys.modules.get('.'.join(parts[:k]))
      if candidate is not None and getattr(candidate, short, None) is obj:
        return f"{'.'.join(parts[:k])}.{short}"
  return f'{module}.{name}' if module else name


def _closure_call(fn: types.FunctionType) -> str | None:
  """``outer(args)`` for a function returned by ``outer(...)``: the values
  of ``outer``'s parameters are read from ``fn``'s closure cells
  (``jax.nn.initializers.variance_scaling(1.0, 'fan_in', ...)`` ->
  ``variance_scaling(1.0, 'fan_in', 'truncated_normal')``). Parameters left
  at their default are omitted. ``None`` when ``outer`` cannot be found or
  its parameters are not all in the closure."""
  qual = fn.__qualname__
  if '.<locals>.' not in qual or not fn.__closure__:
    return None
  outer_name = qual.rsplit('.<locals>.', 1)[0]
  if '<locals>' in outer_name:
    return None  # a factory nested in a function: not reachable by name
  module = sys.modules.get(fn.__module__ or '')
  outer = module
  for part in outer_name.split('.'):
    outer = getattr(outer, part, None)
  if not callable(outer):
    return None
  try:
    params = inspect.signature(outer).parameters
  except (TypeError, ValueError):
    return None
  cells = {}
  for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (),
                        strict=True):
    try:
      cells[name] = cell.cell_contents
    except ValueError:  # an empty cell
      pass
  args, keyword = [], False
  for name, p in params.items():
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      return None
    if name not in cells:
      if p.default is p.empty:
        return None  # a required argument we cannot recover
      keyword = True
      continue
    value = cells[name]
    if p.default is not p.empty and _same(value, p.default):
      keyword = True
      continue
    text = _arg_text(value)
    args.append(f'{name}={text}' if keyword or p.kind is p.KEYWORD_ONLY
                else text)
  return f"{outer_name.rsplit('.', 1)[-1]}({', '.join(args)})"


def _same(a, b) -> bool:
  try:
    return bool(a is b or (type(a) is type(b) and a == b))
  except Exception:  # noqa: BLE001 - arrays and other odd values
    return False


def _arg_text(value) -> str:
  if isinstance(value, str):
    return repr(value)
  text = format_value(value, bools='python')
  return 'None' if text is None else text


def callable_text(value) -> str:
  """A readable name for a callable: ``partial(f, args)`` for a
  ``functools.partial``; ``outer(args)`` for a closure made by a factory
  such as an initializer (see :func:`_closure_call`), else its short name;
  ``module.qualname`` (public module, no ``<locals>``) for other functions
  and classes."""
  if isinstance(value, functools.partial):
    parts = [callable_text(value.func)]
    parts += [_arg_text(a) for a in value.args]
    parts += [f'{k}={_arg_text(v)}' for k, v in value.keywords.items()]
    return f"partial({', '.join(parts)})"
  if isinstance(value, types.FunctionType) and '<locals>' in value.__qualname__:
    try:
      call = _closure_call(value)
    except Exception:  # noqa: BLE001 - never fail on an odd closure
      call = None
    if call is not None:
      return call
    return value.__qualname__.replace('<locals>.', '')
  return _public_name(value)


def format_value(value, *, bools: str = 'xml') -> str | None:
  """The string shown for a parameter value; ``None`` means "omit it".

  ints/floats: Python repr; bools: ``true``/``false`` (``bools='xml'``) or
  ``True``/``False`` (``bools='python'``); dtypes by name; callables by
  qualified name; Jaxprs in Jaxpr text; arrays by type (``f32[3]``). Never
  raises; the text holds no character that XML cannot hold (see
  :func:`escape_text`) and, except for Jaxprs, at most about ``MAX_TEXT``
  characters.
  """
  try:
    text = _format(value, bools, 0)
  except Exception as e:  # noqa: BLE001 - a user object misbehaved
    # Why skipping is right: a field value's own methods raised while being
    # shown (a Mapping whose items() fails...). The view shows its class and
    # the error instead of failing to print the whole tree
    # (test_format_value_never_raises).
    text = f'<{type(value).__qualname__}; formatting raised {type(e).__name__}>'
  return None if text is None else escape_text(text)


def _is_jaxpr(value) -> bool:
  return isinstance(value, (jex.Jaxpr, jex.ClosedJaxpr))


def _format(value, bools: str, depth: int) -> str | None:
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)):
    if bools == 'xml':
      return 'true' if value else 'false'
    return 'True' if value else 'False'
  if isinstance(value, enum.Enum):
    return truncate(str(value.name))
  if isinstance(value, str):
    return truncate(str.__str__(value))
  if isinstance(value, int) and value.bit_length() > 3000:
    return f'<int with {value.bit_length()} bits>'  # repr would refuse it
  if isinstance(value, _SIMPLE):
    return truncate(repr(value))
  if isinstance(value, np.generic):
    return safe_repr(value.item())
  if isinstance(value, np.dtype):
    return value.name
  if isinstance(value, type) and issubclass(value, np.generic):
    return np.dtype(value).name
  dtype = safe_getattr(value, 'dtype')
  if callable(value) and isinstance(dtype, np.dtype):
    return dtype.name  # jnp.float32 and friends
  if dtype is not None and not isinstance(value, type):
    shape = safe_getattr(value, 'shape')
    if shape is not None:
      text = _array_type(value, dtype, shape)
      if text is not None:
        return text
  if _is_jaxpr(value):
    return str(value)
  if depth >= _MAX_DEPTH and isinstance(
      value, (tuple, list, collections.abc.Mapping)):
    return '...'
  if isinstance(value, (tuple, list)):
    inner = [safe_repr(v) if isinstance(v, str)
             else _format(v, bools, depth + 1) for v in value]
    inner = ['None' if s is None else s for s in inner]
    if isinstance(value, tuple):
      text = '(' + ', '.join(inner) + (',)' if len(inner) == 1 else ')')
    else:
      text = '[' + ', '.join(inner) + ']'
    return text if any(map(_is_jaxpr, value)) else truncate(text)
  if isinstance(value, functools.partial) or (
      isinstance(value, types.FunctionType) and value.__closure__):
    return truncate(callable_text(value))
  if isinstance(value, (types.FunctionType, types.BuiltinFunctionType,
                        types.MethodType, type)) or (
                            callable(value) and isinstance(
                                safe_getattr(value, '__qualname__'), str)):
    return truncate(callable_text(value))
  if isinstance(value, collections.abc.Mapping):  # dict, flax FrozenDict
    items = ', '.join(f'{k}: {_format(v, bools, depth + 1)}'
                      for k, v in value.items())
    return truncate('{' + items + '}')
  # Flax modules, HF configs and other objects: their class, plus a name.
  name = safe_getattr(value, 'name')
  cls = type(value).__name__
  return truncate(f'{cls}({name})') if isinstance(name, str) else cls


def _array_type(value, dtype, shape) -> str | None:
  """``f32[3]`` for an array-like value, None if it is not one after all."""
  try:
    return jax.typeof(value).str_short(short_dtypes=True)
  except Exception:  # noqa: BLE001 - not a JAX value; see below
    # Why skipping is right: many objects have .dtype and .shape without
    # being JAX values (NumPy-like arrays, config objects); they are shown
    # from those two attributes instead (test_fields_with_odd_attributes_format).
    pass
  try:
    dims = [int(d) for d in shape]
    return f'{np.dtype(dtype).name}{dims}'
  except Exception:  # noqa: BLE001 - odd .dtype/.shape: shown by class
    # Why skipping is right: .dtype/.shape that are not a dtype and a tuple
    # of ints mean this is not array-like; the object is shown like any other
    # (by class and name) (test_fields_with_odd_attributes_format).
    return None
