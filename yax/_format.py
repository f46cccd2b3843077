"""Formatting of parameter values for text, XML, YSON and JSON views.

Module fields are arbitrary Python objects (dtypes, initializers, config
objects, other modules). The views show each as a short, stable string.
"""

from __future__ import annotations

import collections.abc
import enum
import functools
import inspect
import sys
import types

import jax
import numpy as np
from jax.extend import core as jex

_SIMPLE = (str, int, float, complex)


def qualified_name(obj) -> str:
  module = getattr(obj, '__module__', None) or ''
  name = getattr(obj, '__qualname__', None) or getattr(obj, '__name__', None)
  if name is None:
    name = type(obj).__qualname__
  return f'{module}.{name}' if module else name


def _public_name(obj) -> str:
  """``module.qualname`` without ``<locals>``; a module under ``_src`` is
  replaced by the public module that exposes the same object
  (``jax._src.nn.functions.gelu`` -> ``jax.nn.gelu``), if one is loaded."""
  name = getattr(obj, '__qualname__', None) or getattr(obj, '__name__', None)
  if name is None:
    name = type(obj).__qualname__
  name = name.replace('<locals>.', '')
  module = getattr(obj, '__module__', None) or ''
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
  for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
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
  qualified name; Jaxprs in Jaxpr text; arrays by type (``f32[3]``).
  """
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)):
    if bools == 'xml':
      return 'true' if value else 'false'
    return 'True' if value else 'False'
  if isinstance(value, enum.Enum):
    return str(value.name)
  if isinstance(value, _SIMPLE):
    return value if isinstance(value, str) else repr(value)
  if isinstance(value, np.generic):
    return repr(value.item())
  if isinstance(value, np.dtype):
    return value.name
  if isinstance(value, type) and issubclass(value, np.generic):
    return np.dtype(value).name
  if callable(value) and isinstance(getattr(value, 'dtype', None), np.dtype):
    return value.dtype.name  # jnp.float32 and friends
  if hasattr(value, 'dtype') and hasattr(value, 'shape') and not isinstance(
      value, type):
    try:
      return jax.typeof(value).str_short(short_dtypes=True)
    except Exception:  # noqa: BLE001 - not a JAX type
      return f'{np.dtype(value.dtype).name}{list(value.shape)}'
  if isinstance(value, (jex.Jaxpr, jex.ClosedJaxpr)):
    return str(value)
  if isinstance(value, (tuple, list)):
    inner = [repr(v) if isinstance(v, str) else format_value(v, bools=bools)
             for v in value]
    inner = ['None' if s is None else s for s in inner]
    if isinstance(value, tuple):
      return '(' + ', '.join(inner) + (',)' if len(inner) == 1 else ')')
    return '[' + ', '.join(inner) + ']'
  if isinstance(value, functools.partial) or (
      isinstance(value, types.FunctionType) and value.__closure__):
    return callable_text(value)
  if isinstance(value, (types.FunctionType, types.BuiltinFunctionType,
                        types.MethodType, type)) or (
                            callable(value) and hasattr(value, '__qualname__')):
    return callable_text(value)
  if isinstance(value, collections.abc.Mapping):  # dict, flax FrozenDict
    items = ', '.join(f'{k}: {format_value(v, bools=bools)}'
                      for k, v in value.items())
    return '{' + items + '}'
  # Flax modules, HF configs and other objects: their class, plus a name.
  name = getattr(value, 'name', None)
  cls = type(value).__name__
  return f'{cls}({name})' if isinstance(name, str) else cls
