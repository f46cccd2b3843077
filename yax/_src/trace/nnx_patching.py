"""NNX module methods wrapped at class level while a trace runs.

NNX has no method interceptor like Linen's ``intercept_methods``: while a
trace runs, the methods of every ``nnx.Module`` subclass are wrapped
(``__call__`` and the other methods each class defines itself). A wrapper
hands the call to the trace context of its thread (:data:`current`) and
otherwise calls the method as it is; nested and threaded traces share one
patch (``patching.ClassPatch``, as Equinox's), and the last to leave puts
the original methods back (see ``docs/design.md``, "NNX modules")."""

from __future__ import annotations

import functools
import inspect
import threading

try:  # flax.nnx is part of every supported Flax; stay importable without it
  from flax import nnx
except ImportError:  # pragma: no cover - flax without nnx
  nnx = None

from yax._src.trace import patching as _patching


# The NNX side of the trace running on this thread (``nnx._Context``) as
# ``current.ctx``; without it a wrapper calls the method as it is.
current = threading.local()


def _module_classes():
  return _patching.subclasses(nnx.Module)


def _wrapped_names(cls) -> list[str]:
  """Methods a class defines itself that become module calls: ``__call__``
  and other plain functions; private helpers only in user classes."""
  from_flax = cls.__module__.startswith('flax.')
  names = []
  for name, value in vars(cls).items():
    if not _is_method(value) or getattr(value, '_yax_original', None):
      continue
    if name == '__call__':
      names.append(name)
    elif name.startswith('__') or (from_flax and name.startswith('_')):
      continue
    elif name.startswith(('_pytree', '_graph', '_object', '_module')):
      continue
    else:
      names.append(name)
  return names


def _is_method(value) -> bool:
  """A plain function, or a method wrapped by an NNX transform that is no
  function itself (``@nnx.jit`` makes a ``JitWrapped`` object, a descriptor
  whose ``__wrapped__`` is the method): either is called with the module
  first. ``nnx.remat``/``nnx.vmap`` return plain functions."""
  if inspect.isfunction(value):
    return True
  return (inspect.isfunction(getattr(value, '__wrapped__', None))
          and hasattr(type(value), '__get__') and callable(value))


def _wrap(fn, name: str):
  @functools.wraps(fn)
  def method(self, *args, **kwargs):
    ctx = getattr(current, 'ctx', None)
    if ctx is None or not isinstance(self, nnx.Module):
      return fn(self, *args, **kwargs)
    return ctx.call(self, name, fn, args, kwargs)
  method._yax_original = fn
  return method


_patch = _patching.ClassPatch(_module_classes, _wrapped_names, _wrap)


def patched_classes():
  """Wraps NNX module methods while the block runs (nested and threaded
  traces share one patch; the last to leave restores the classes)."""
  return _patch.applied()
