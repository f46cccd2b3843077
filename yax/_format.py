"""Formatting of parameter values for text, XML, YSON and JSON views.

Module fields are arbitrary Python objects (dtypes, initializers, config
objects, other modules). The views show each as a short, stable string.
"""

from __future__ import annotations

import collections.abc
import enum
import functools
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
  if isinstance(value, functools.partial):
    return f'functools.partial({format_value(value.func, bools=bools)})'
  if isinstance(value, (types.FunctionType, types.BuiltinFunctionType,
                        types.MethodType, type)) or (
                            callable(value) and hasattr(value, '__qualname__')):
    return qualified_name(value)
  if isinstance(value, collections.abc.Mapping):  # dict, flax FrozenDict
    items = ', '.join(f'{k}: {format_value(v, bools=bools)}'
                      for k, v in value.items())
    return '{' + items + '}'
  # Flax modules, HF configs and other objects: their class, plus a name.
  name = getattr(value, 'name', None)
  cls = type(value).__name__
  return f'{cls}({name})' if isinstance(name, str) else cls
