"""Equinox modules: every call of an ``eqx.Module`` method is a module call.

Equinox has no method interceptor. While a trace runs, the methods of every
``eqx.Module`` subclass (``__call__`` and the other methods each class
defines itself; Equinox's own transform wrappers left alone) are wrapped at
class level, as for NNX; the wrappers record a module call only while a
trace is active on this thread, and the originals are put back when the
last trace ends.

A module's place is its pytree path from the traced function's arguments
(``layers/0/attention/q_proj``): the root arguments, and the fields of
every module whose method is running, are indexed by object identity. A
module rebuilt inside a transformation (``eqx.filter_jit``, ``filter_vmap``,
a ``lax.scan`` body that ``eqx.combine`` s one layer of a stack) is a new
object; it takes the place of the indexed module of its class and pytree
structure, whose leaves have its shapes or one more leading (stacked) axis.

A call's variables are the module's array leaves (keyed by field path, the
inexact ones are parameters: Equinox's own ``is_inexact_array``), carried in
the enter marker; the tree builder keeps those the body reads. Its
attributes are the module's static fields and its leaves that are not
arrays (Python numbers, functions). At the root, Equinox's filter rule
decides what is traced: the arrays of a module are, its other leaves (a
``Dropout``'s ``p``) are static.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from typing import Any

import jax
from jax import tree_util as jtu

from yax._src.errors import YaxError
from yax._src.ir import containers as _containers
from yax._src.ir.variables import key_name, variable_treedef
from yax._src.trace import patching as _patching
from yax._src.trace.calls import (constructor_kwargs, is_traced_value,
                                  marked_call)

try:  # an optional module system: YAX works without Equinox installed
  import equinox as eqx
except ImportError:  # pragma: no cover - equinox is not installed
  eqx = None


def is_module(x) -> bool:
  """An Equinox module (an instance of an ``eqx.Module`` subclass)."""
  return eqx is not None and isinstance(x, eqx.Module)


def is_module_class(cls: type) -> bool:
  """An ``eqx.Module`` subclass."""
  return eqx is not None and issubclass(cls, eqx.Module)


# ------------------------------------------------------------ root leaves

def static_leaves(leaves_tree) -> set[int]:
  """Positions among ``jax.tree_util.tree_leaves(leaves_tree)`` of the
  leaves inside Equinox modules that are not arrays: Equinox's filter rule
  makes them static (``Dropout.p``, an activation function), where a
  Python number elsewhere among the arguments is traced."""
  if eqx is None:
    return set()
  found: set[int] = set()
  position = 0
  for top in jtu.tree_leaves(leaves_tree, is_leaf=is_module):
    if not is_module(top):
      position += 1
      continue
    for leaf in jtu.tree_leaves(top):
      if not eqx.is_array(leaf):
        found.add(position)
      position += 1
  return found


# ------------------------------------------------------------ patching

_local = threading.local()


def _module_classes() -> list[type]:
  """Every subclass of ``eqx.Module`` but Equinox's own internals (its
  transform wrappers, bound methods, ``Partial``...); ``eqx.nn`` layers and
  every class of other packages are included."""
  return [c for c in _patching.subclasses(eqx.Module) if not c.__module__.startswith('equinox.')
          or c.__module__.startswith('equinox.nn.')]


def _wrapped_names(cls) -> list[str]:
  """The methods ``cls`` defines itself that are module calls: ``__call__``
  and the other methods (private ones only in classes outside Equinox)."""
  from_eqx = cls.__module__.startswith('equinox.')
  names = []
  for name, value in vars(cls).items():
    if name != '__call__' and (name.startswith('__') or (
        from_eqx and name.startswith('_'))):
      continue
    if getattr(value, '_yax_original', None) is not None:
      continue
    if inspect.isfunction(value) or (
        is_module(value) and hasattr(type(value), '__get__')
        and callable(value)):  # a method wrapped in ``eqx.filter_jit``
      names.append(name)
  return names


def _wrap(fn, name: str):
  if inspect.isfunction(fn):
    call = fn
  else:  # a descriptor (``eqx.filter_jit`` of a method): bind, then call
    def call(self, *args, **kwargs):
      return fn.__get__(self, type(self))(*args, **kwargs)

  @functools.wraps(call)
  def method(self, *args, **kwargs):
    ctx = getattr(_local, 'ctx', None)
    if ctx is None or not is_module(self):
      return call(self, *args, **kwargs)
    return ctx.call(self, name, call, args, kwargs)

  method._yax_original = fn
  return method


_patch = _patching.ClassPatch(_module_classes, _wrapped_names, _wrap)


def patched_classes():
  """Module methods wrapped while the block runs (nested and threaded
  traces share one patch; the last to leave restores the classes). The
  wrappers record nothing on a thread with no trace context."""
  return _patch.applied()


@contextlib.contextmanager
def tracing(args, kwargs):
  """Module methods wrapped, and the modules among ``(args, kwargs)``
  indexed at their paths, while the block runs."""
  if eqx is None:
    yield
    return
  with patched_classes():
    saved = getattr(_local, 'ctx', None)
    _local.ctx = _Context(args, kwargs)
    try:
      yield
    finally:
      _local.ctx = saved


# ------------------------------------------------------------ paths

def _keys(keypath) -> tuple[str, ...]:
  return tuple(str(key_name(k)) for k in keypath)


def _submodules(root) -> list[tuple[tuple, Any]]:
  """``[(path, module)]`` of every module in ``root`` (a pytree), at its
  pytree path."""
  found = []
  stack = [((), root)]
  while stack:
    path, node = stack.pop()
    if is_module(node):
      found.append((path, node))
    children = jtu.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node and is_module(x))[0]
    if is_module(node) or path == ():
      for keypath, child in reversed(children):
        if is_module(child) and child is not node:
          stack.append(((*path, *_keys(keypath)), child))
  return found


def _shapes(module) -> tuple:
  return tuple(getattr(x, 'shape', None) for x in jtu.tree_leaves(module)
               if eqx.is_array(x))


class _Context:
  """The modules one trace has seen, by identity, and their paths."""

  def __init__(self, args, kwargs):
    self.paths: dict[int, tuple] = {}
    self.known: list[tuple[tuple, Any]] = []  # [(path, module)], in order
    self.keep: list = []  # keeps ids valid for the trace's lifetime
    self.params: dict[int, dict] = {}
    tops = [(kp, x) for kp, x in jtu.tree_flatten_with_path(
        (args, kwargs), is_leaf=is_module)[0] if is_module(x)]
    for kp, top in tops:
      # One module argument is the root of the paths; several are told
      # apart by their place among the arguments (``0/enc``, ``1/enc``).
      prefix = () if len(tops) == 1 else _argument_prefix(kp)
      self.index(top, prefix)

  def index(self, root, prefix: tuple) -> None:
    for path, module in _submodules(root):
      if id(module) not in self.paths:
        self.paths[id(module)] = (*prefix, *path)
        self.keep.append(module)
        self.known.append(((*prefix, *path), module))

  def path_of(self, module) -> tuple:
    path = self.paths.get(id(module))
    if path is not None:
      return path
    # A module rebuilt in a transformation: the indexed module of its class
    # and structure, whose arrays have its shapes (a jit, a vmap over
    # inputs) or one more leading axis (the stack a scan slices).
    treedef, shapes = jtu.tree_structure(module), _shapes(module)
    stacked = None
    for path, known in self.known:
      if type(known) is not type(module) or \
          jtu.tree_structure(known) != treedef:
        continue
      known_shapes = _shapes(known)
      if known_shapes == shapes:
        return self._found(module, path)
      if stacked is None and len(known_shapes) == len(shapes) and all(
          a is not None and b is not None and tuple(a[1:]) == tuple(b)
          for a, b in zip(known_shapes, shapes, strict=True)):
        stacked = path
    if stacked is not None:
      return self._found(module, stacked)
    # Built inside the traced function (or captured by a closure): a place
    # of its own, named by its class.
    return self._found(module, ('<built>', type(module).__name__))

  def _found(self, module, path: tuple) -> tuple:
    self.index(module, path)
    return path

  def call(self, module, name: str, fn, args, kwargs):
    path = self.path_of(module)
    var_leaves, var_tree = _variables(module)
    # The module's arrays ride in the marker as its variables; the method
    # runs on the module itself (``self`` is no argument of the call).
    return marked_call(type(module), name, self.attributes(module, path),
                       path, var_leaves, var_tree,
                       functools.partial(fn, module), args, kwargs)

  def attributes(self, module, path: tuple) -> dict:
    """The static fields of ``module`` and its fields that hold no array
    nor module (Python numbers, functions, dtypes)."""
    found = self.params.get(id(module))
    if found is None:
      found = {'name': path[-1] if path else None}
      for field in dataclasses.fields(module):
        value = getattr(module, field.name, None)
        if field.metadata.get('static', False) or not any(
            eqx.is_array(x) or is_module(x) for x in jtu.tree_leaves(
                value, is_leaf=is_module)):
          found[field.name] = value
      self.params[id(module)] = found
    return found


def _argument_prefix(keypath) -> tuple:
  """``args[1]`` -> ``('1',)``; ``kwargs['model']`` -> ``('model',)``."""
  return _keys(keypath[1:])


_entries_of: dict = {}  # treedef -> the entries it was made from


@functools.lru_cache(maxsize=4096)
def _treedef_of(entries: tuple):
  treedef = variable_treedef(entries)
  _entries_of[treedef] = entries
  return treedef


def _variables(module) -> tuple[list, Any]:
  """The traced arrays of ``module`` (its submodules' included), keyed by
  field path; the inexact ones are parameters (kind ``Param``), the others
  buffers (kind ``Buffer``). The layout is computed once per module
  structure (treedef and which leaves are traced, inexact or not)."""
  leaves, treedef = jtu.tree_flatten(module)
  kinds = tuple(_leaf_kind(x) for x in leaves)
  key = (treedef, kinds)
  try:
    found = _LAYOUTS.get(key)
  except TypeError:  # a static field that cannot be hashed: no cache
    key, found = None, None
  if found is None:
    found = _layout(module, kinds)
    if key is not None and len(_LAYOUTS) < 4096:
      _LAYOUTS[key] = found
  var_tree, order = found
  return [leaves[i] for i in order], var_tree


_LAYOUTS: dict = {}  # (treedef, kinds) -> (variable treedef, leaf order)


def _leaf_kind(x) -> bool | None:
  """None: not traced; else whether it is inexact (a parameter)."""
  return _is_inexact(x.dtype) if is_traced_value(x) else None


@functools.lru_cache(maxsize=None)
def _is_inexact(dtype) -> bool:
  return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))


def _layout(module, kinds: tuple) -> tuple[Any, tuple[int, ...]]:
  """``(variable treedef, positions)``: the ``VariableTree`` of the traced
  leaves of ``module`` and, for each of its leaves in flattening order,
  the leaf's position among the module's leaves."""
  own_keys = {id(x) for x in jtu.tree_leaves(
      module, is_leaf=lambda x: x is not module and is_module(x))}
  entries, positions = [], []
  for i, (keypath, leaf) in enumerate(jtu.tree_flatten_with_path(module)[0]):
    if kinds[i] is None:
      continue
    entries.append((_keys(keypath), ('Param' if kinds[i] else 'Buffer',
                                     kinds[i], id(leaf) in own_keys)))
    positions.append(i)
  if not entries:
    return _treedef_of(()), ()
  treedef = _treedef_of(tuple(entries))
  return treedef, tuple(positions[j] for j in _leaf_order(treedef))


@functools.lru_cache(maxsize=4096)
def _leaf_order(treedef) -> tuple[int, ...]:
  """For each leaf of ``treedef`` (a ``VariableTree`` made by
  ``_variables``), in flattening order, its position among the entries
  it was made from."""
  entries = _entries_of[treedef]
  position = {keys: i for i, (keys, _) in enumerate(entries)}
  tree = jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
  return tuple(position[_keys(kp)]
               for kp, _ in jtu.tree_flatten_with_path(tree)[0])



# ------------------------------------------------- new variables of a model

def holds_modules(tree) -> bool:
  """Whether ``tree`` (the traced arguments) holds an Equinox module: new
  variables then go into modules as plain arrays, not NNX Variables."""
  return eqx is not None and any(
      is_module(x) for x in jtu.tree_leaves(tree, is_leaf=is_module))


_EXTENDED: dict[tuple, type] = {}


def _base_class(cls: type) -> type:
  return getattr(cls, '_yax_base', cls)


def extended_class(base: type, names: tuple) -> type:
  """The module class YAX makes for ``base`` with the new array fields
  ``names`` (LoRA adapters, a quantized kernel's scale): a subclass, named
  ``<Base>WithVariables``, whose instances flatten as ``base`` does and then
  the new fields, so ``eqx.partition``/``eqx.filter`` see them as arrays.
  Its methods are ``base``'s (YAX runs the rewritten tree, not them)."""
  key = (base, names)
  cls = _EXTENDED.get(key)
  if cls is None:
    namespace = {
        '__annotations__': {name: Any for name in names},
        '__module__': __name__, '_yax_base': base,
        '__doc__': f'{base.__name__} with the variables {", ".join(names)} '
                   'a YAX rewrite added.',
        **{name: dataclasses.field(default=None) for name in names}}
    cls = _EXTENDED[key] = type(base)(f'{base.__name__}WithVariables',
                                      (base,), namespace)
  return cls


def _fields(module) -> dict:
  return {f.name: getattr(module, f.name)
          for f in dataclasses.fields(module)}


def _rebuild(like, items: dict):
  """A module of ``like``'s class (or of its YAX-extended class when
  ``items`` has fields the class lacks; back to the original class when
  they are all gone) holding exactly ``items``."""
  base = _base_class(type(like))
  known = {f.name for f in dataclasses.fields(base)}
  missing = known - set(items)
  if missing:
    raise YaxError(f'cannot rebuild a {base.__name__} without its fields '
                   f'{sorted(missing)}')
  extra = tuple(sorted(set(items) - known))
  cls = extended_class(base, extra) if extra else base
  module = object.__new__(cls)
  for name in [f.name for f in dataclasses.fields(cls)]:
    object.__setattr__(module, name, items.get(name))
  return module


if eqx is not None:
  _containers.register_record(is_module, _fields, _rebuild)


# ------------------------------------------------ a module built anew

def init_variables(cls: type, attributes: dict, key, where: str) -> dict:
  """``{field name: array}`` of a new ``cls`` module, built by its own
  ``__init__``: a parameter named ``key`` gets ``key``, the others the
  values the trace recorded as the call's attributes (static fields and
  fields that hold no array), or their defaults.

  ``where`` names the variable asked for (for the error raised when
  ``__init__`` needs an argument the trace did not record).

  Example::

      init_variables(eqx.nn.PReLU, {'name': 'PReLU_0'}, jax.random.key(0),
                     "params['PReLU_0']['negative_slope']")
      # {'negative_slope': Array([0.25], dtype=float32)}
  """
  kwargs = constructor_kwargs(
      cls, attributes, rng=('key', key), where=where, system='Equinox',
      remedy='make them fields of the module', skip=('name',))
  module = cls(**kwargs)
  return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
          if eqx.is_array(getattr(module, f.name, None))}
