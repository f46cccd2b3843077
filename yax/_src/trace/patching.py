"""Module methods wrapped at class level while a trace runs.

NNX and Equinox have no method interceptor like Linen's
``intercept_methods``: while a trace runs, the methods of every subclass of
their module class are wrapped. Each frontend makes one :class:`ClassPatch`
saying which classes and methods it wraps and how; the patch counts its
users, so nested and threaded traces share it, and the last to leave puts
the original methods back. One lock guards every patch.

Example::

    patch = ClassPatch(module_classes, wrapped_names, wrap)
    with patch.applied():
      out = fn(*args)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

# One lock for every patch: patching and restoring classes are rare (at the
# start and end of the outermost trace) and never nest.
_lock = threading.Lock()


class ClassPatch:
  """The methods of a module system's classes, wrapped while in use.

  Args:
    classes: ``() -> list of classes`` to wrap, asked each time the patch
      is applied (classes defined since are wrapped too).
    names: ``cls -> list of method names`` ``cls`` defines itself that
      are wrapped.
    wrap: ``(function, name) -> wrapper``; the wrapper gets a
      ``_yax_original`` attribute, so that a wrapped class is recognised.

  Example::

      patch = ClassPatch(lambda: [MyModule], lambda cls: ['__call__'],
                         wrap)
      with patch.applied():
        ...
  """

  def __init__(self, classes: Callable[[], list[type]],
               names: Callable[[type], list[str]],
               wrap: Callable[[Any, str], Any]):
    self._classes, self._names, self._wrap = classes, names, wrap
    self._users = 0
    self._patched: dict[type, dict[str, Any]] = {}  # class -> originals

  def _patch(self) -> None:
    for cls in self._classes():
      if cls in self._patched:
        continue
      originals = {}
      for name in self._names(cls):
        fn = vars(cls)[name]
        originals[name] = fn
        # ``type.__setattr__``: a module metaclass may refuse or redirect
        # class attribute assignment.
        type.__setattr__(cls, name, self._wrap(fn, name))
      self._patched[cls] = originals

  def _restore(self) -> None:
    for cls, originals in self._patched.items():
      for name, fn in originals.items():
        type.__setattr__(cls, name, fn)
    self._patched.clear()

  @contextlib.contextmanager
  def applied(self):
    """The methods wrapped while the block runs (nested and threaded
    traces share one patch; the last to leave restores the classes)."""
    with _lock:
      self._users += 1
      try:
        self._patch()
      except BaseException:
        self._users -= 1
        if not self._users:
          self._restore()
        raise
    try:
      yield
    finally:
      with _lock:
        self._users -= 1
        if not self._users:
          self._restore()


def subclasses(base: type) -> list[type]:
  """Every subclass of ``base``, direct or not, each once."""
  seen, stack = [], [base]
  while stack:
    cls = stack.pop()
    for sub in cls.__subclasses__():
      if sub not in seen:
        seen.append(sub)
        stack.append(sub)
  return seen
