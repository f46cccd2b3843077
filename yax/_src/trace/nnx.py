"""Flax NNX modules: seen while tracing, replayed by ``eval_mox``.

NNX has no method interceptor like Linen's ``intercept_methods``. While a
trace runs, the methods of every ``nnx.Module`` subclass are wrapped at class
level (``__call__`` and the other methods each class defines itself); the
wrappers record a module call only on the thread that is tracing, and the
original methods are put back when the last trace ends (see
``docs/design.md``, "NNX modules").

Three pieces:

* :class:`TraceScope` prepares the traced function's arguments: the NNX graph
  nodes among them (modules, ``nnx.Rngs``) are split together, as
  ``nnx.split`` does, so a shared module or variable is one input; the
  function is called on copies merged from that state (the user's objects
  are never touched), and variables the call changed or created (RNG counts,
  batch statistics, ``sow``n values) become extra outputs.
* The method wrappers bind the boundary markers of ``trace/markers.py`` around each
  call and record a ``CallRecord``, so the tree builder of ``trace/make.py`` makes
  the ``module_call`` nodes: path from the object graph of the arguments,
  params from the module's static attributes, variables (its own, keyed as
  ``nnx.state`` shows them, typed ``Param``/``BatchStat``/``RngCount``...).
* :func:`flatten_arguments` and :func:`apply_updates` let ``eval_mox`` take
  the same arguments and apply the state updates to the given modules,
  exactly as calling the model does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import sys
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax import tree_util as jtu

from yax._src.compat import nnx_is_node_type, nnx_node_items
from yax._src.errors import YaxError
from yax._src.ir import containers as _containers
from yax._src.ir.variables import (VariableTree, is_variable_treedef, key_name,
                                   variable_treedef)
from yax._src.trace.calls import is_traced_value, marked_call, recording

try:  # flax.nnx is part of every supported Flax; stay importable without it
  from flax import nnx
except ImportError:  # pragma: no cover - flax without nnx
  nnx = None

_GraphNode = (getattr(nnx, 'Pytree', None) or getattr(nnx, 'Object', None)) \
    if nnx is not None else None


def is_graph_node(x) -> bool:
  """NNX modules and other graph objects (``nnx.Rngs``)."""
  return _GraphNode is not None and isinstance(x, _GraphNode)


# ------------------------------------------------------ typed variables

def var_kinds(mox) -> list[str] | None:
  """Variable type names of a module call's variable inputs, if NNX."""
  n = mox.num_vars
  # Read from the treedef's root node (never by building the tree, which
  # a pytree node that checks its children could refuse): a Linen call's
  # variables are a dict, an NNX call's a VariableTree.
  if not n or not is_variable_treedef(mox.var_tree):
    return None
  _, kinds, _ = mox.var_tree.node_data()[1]
  if len(kinds) != n:
    raise YaxError(
        f'module_call at {"/".join(map(str, mox.path)) or "<root>"}: its '
        f'NNX variable tree names {len(kinds)} variable types for {n} '
        f'variable inputs; the tree was built inconsistently')
  return list(kinds)


# ------------------------------------------------------------ patching

_patch_lock = threading.Lock()
_patch_users = 0
_patched: dict[type, dict[str, Any]] = {}  # class -> original attributes
_local = threading.local()


def _module_classes():
  seen, stack = [], [nnx.Module]
  while stack:
    cls = stack.pop()
    for sub in cls.__subclasses__():
      if sub not in seen:
        seen.append(sub)
        stack.append(sub)
  return seen


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
    ctx = getattr(_local, 'ctx', None)
    if ctx is None or not isinstance(self, nnx.Module):
      return fn(self, *args, **kwargs)
    return ctx.call(self, name, fn, args, kwargs)
  method._yax_original = fn
  return method


def _patch_classes():
  for cls in _module_classes():
    if cls in _patched:
      continue
    originals = {}
    for name in _wrapped_names(cls):
      fn = vars(cls)[name]
      originals[name] = fn
      setattr(cls, name, _wrap(fn, name))
    _patched[cls] = originals


def _restore_classes():
  for cls, originals in _patched.items():
    for name, fn in originals.items():
      setattr(cls, name, fn)
  _patched.clear()


@contextlib.contextmanager
def _patched_classes():
  """Wraps NNX module methods while the block runs (nested and threaded
  traces share one patch; the last to leave restores the classes)."""
  global _patch_users
  with _patch_lock:
    _patch_users += 1
    try:
      _patch_classes()
    except BaseException:
      _patch_users -= 1
      if not _patch_users:
        _restore_classes()
      raise
  try:
    yield
  finally:
    with _patch_lock:
      _patch_users -= 1
      if not _patch_users:
        _restore_classes()


# ------------------------------------------------- per-trace bookkeeping

def _str_path(path) -> tuple[str, ...]:
  return tuple(str(p) for p in path)


def _static_params(module, path) -> dict:
  """A module's static attributes (no variables, submodules or arrays)."""
  params, kinds = {}, _PARAM_KINDS
  for key, value in vars(module).items():
    if key[0] == '_':
      continue
    kind = kinds.get(type(value))  # (one lookup per attribute of every module)
    if kind is None:
      kind = _param_kind(type(value))
    if kind == _STATIC or (kind == _NODE and _is_static_tree(value)):
      params[key] = value
  if 'name' not in params:
    params = {'name': path[-1] if path else None, **params}
  return params


def _is_static_tree(value) -> bool:
  """A pytree (a tuple of ints, a dict of options) that holds no array,
  Variable, module or other graph node."""
  if type(value) is tuple and all(_param_kind(type(x)) == _STATIC
                                  for x in value):
    return True  # the common case: a shape or axes
  if is_graph_node(value):
    return False
  leaves = jtu.tree_leaves(value, is_leaf=_is_graph_object)
  return not any(_is_graph_object(x) or _is_array_type(type(x))
                 for x in leaves)


_STATIC = -1  # _param_kind of a leaf that is not an array
_PARAM_KINDS: dict[type, int] = {}  # type -> _param_kind (read inline too)


def _param_kind(ty: type) -> int:
  """``_node_kind``, with leaves that are not arrays told apart
  (``_STATIC``): those are a module's static params. Decided once per type."""
  kind = _PARAM_KINDS.get(ty)
  if kind is None:
    kind = _node_kind(ty)
    if kind == _LEAF and not _is_array_type(ty):
      kind = _STATIC
    _PARAM_KINDS[ty] = kind
  return kind


@functools.lru_cache(maxsize=None)
def _is_array_type(ty: type) -> bool:
  return issubclass(ty, (jax.Array, np.ndarray, jax.core.Tracer))


_LEAF, _VARIABLE, _MODULE, _NODE = range(4)


def _is_graph_object(x) -> bool:
  """A Variable, module or other NNX graph object (``nnx.Rngs``)."""
  return _node_kind(type(x)) in (_VARIABLE, _MODULE) or is_graph_node(x)


@functools.lru_cache(maxsize=None)
def _node_kind(ty: type) -> int:
  """What a value of type ``ty`` is in an NNX graph, decided once per type
  (``isinstance`` against ``nnx.Variable`` goes through a metaclass hook).
  Values of types that NNX never looks into (arrays, numbers, functions,
  dtypes) are leaves; other graph nodes and pytrees (``nnx.Rngs``, lists,
  dicts) are nodes."""
  if issubclass(ty, nnx.Variable):
    return _VARIABLE
  if issubclass(ty, nnx.Module):
    return _MODULE
  if ty in (int, float, bool, str, type(None), np.ndarray) or issubclass(
      ty, (jax.Array, jax.core.Tracer)) or not nnx_is_node_type(ty):
    return _LEAF
  return _NODE


def _holds_nothing(node) -> bool:
  """A tuple of leaves (a shape, axes) or an empty mapping (Flax keeps
  empty ``FrozenDict`` s as static attributes): no Variable or module can be
  under it, so the walks skip it (two thirds of a Transformer's nodes)."""
  if type(node) is tuple:
    return all(_node_kind(type(x)) == _LEAF for x in node)
  return isinstance(node, Mapping) and not node


def graph_nodes(root) -> list:
  """``[(path, node, kind)]`` for ``root`` and every module, other graph
  node and Variable under it, each once, at the first path a depth-first
  walk reaches it with children in the order ``nnx.split`` lists them (so
  the paths are those of ``nnx.split``'s state and ``nnx.iter_graph``);
  ``kind`` is ``_MODULE``, ``_VARIABLE`` or ``_NODE``."""
  found, visited = [], set()
  kind = _node_kind(type(root))
  stack = [] if kind == _LEAF else [((), root, kind)]
  while stack:
    path, node, kind = stack.pop()
    if id(node) in visited:
      continue
    visited.add(id(node))
    found.append((path, node, kind))
    if kind != _VARIABLE:
      for key, child in reversed(nnx_node_items(node)):
        child_kind = _node_kind(type(child))
        if child_kind != _LEAF and not (child_kind == _NODE
                                        and _holds_nothing(child)):
          stack.append(((*path, key), child, child_kind))
  return found


class _Context:
  """What one trace knows about the NNX modules it has seen.

  Paths come from where modules sit in the traced arguments, never from
  their type: a module given as an argument (or one of its submodules) has
  its attribute path there; a module that ``nnx.merge`` builds inside the
  traced function has the path of its variables in the ``nnx.State``
  argument they come from (``sources``); a copy that an NNX transform makes
  inside its body carries its original's path as a static attribute
  (``_TAG``); any other module (captured by a closure, or built during the
  call) gets a path of its own under ``<closure>``.
  """

  def __init__(self):
    self.paths: dict[int, tuple] = {}
    self.taken: set[tuple] = set()
    self.subtrees: dict[int, list] = {}  # id(module) -> see ``subtree``
    # id(node) -> [(relative path, module)]: the node (if a module) and
    # every module under it, each at its first path (listed with
    # ``subtrees``).
    self.submodules: dict[int, list] = {}
    self.walking: set[int] = set()  # modules whose subtree is being listed
    self.params: dict[int, dict] = {}
    self.keep: list = []  # keeps ids valid for the trace's lifetime
    self.stack: list = []  # [(module, method name, path)]
    # id(traced value) -> path of its Variable among the traced arguments
    # (argument prefix, then the attribute path as ``nnx.state`` shows it).
    self._sources: dict[int, tuple] | None = None
    # [(path prefix, GraphArgument or nnx.State)] among the traced
    # arguments (see ``_model_prefixes``), read by ``sources``.
    self.containers: list = []
    # [(Linen path, NNX class)] of the Linen ``ToLinen`` calls running (see
    # ``bridged``), innermost last.
    self.bridges: list = []

  def register(self, root, prefix: tuple, tag: bool = False) -> None:
    """Gives every module under ``root`` not seen yet its first path.

    With ``tag``, the path is also stored on each module as a static
    attribute (``_yax_path``): NNX transforms (``nnx.scan``, ``nnx.vmap``,
    ``nnx.remat``, ``nnx.jit``) carry static attributes into the copies they
    merge inside their bodies, so calls on those copies get the right path.
    Only modules this trace created are tagged, never the user's objects.

    The modules come from the walk that lists ``root``'s variables
    (``subtree``), so the graph is walked once for both.
    """
    self.subtree(root)
    for path, module in self.submodules[id(root)]:
      if id(module) in self.paths:
        continue
      attrs = vars(module)
      full = attrs.get(_TAG)
      if full is None:
        full = (*prefix, *_str_path(path))
      self.paths[id(module)] = full
      self.taken.add(full)
      self.keep.append(module)
      if tag and _TAG not in attrs:
        object.__setattr__(module, _TAG, full)

  def path_of(self, module) -> tuple:
    path = self.paths.get(id(module))
    if path is not None:
      return path
    path = vars(module).get(_TAG)
    if path is None:
      path = self._path_from_sources(module)
    if path is None and not self.stack and self._only_empty_state():
      # A parameter-free model merged from the one (empty) ``nnx.State``
      # argument: no variable tells where it sits, and there is no other
      # place for it than that state's root (its own variables, once a
      # rewrite adds them, go there, as in a hand-written model).
      path = self.containers[0][0]
    if path is None:  # reached through a closure, or built in the call
      name = type(module).__name__
      path, k = ('<closure>', name), 0
      while path in self.taken:
        k += 1
        path = ('<closure>', f'{name}_{k}')
    self.register(module, path, tag=self._created_by_trace(module))
    return self.paths[id(module)]

  def _only_empty_state(self) -> bool:
    """True when the traced arguments hold exactly one model container,
    an ``nnx.State`` with no variables."""
    if len(self.containers) != 1:
      return False
    container = self.containers[0][1]
    return isinstance(container, nnx.State) and not jtu.tree_leaves(container)

  def _bridged_path(self, module) -> bool:
    """Inside a ``ToLinen`` call: whether ``module`` has a path, giving it
    one if it is the bridged model (an instance of the bridge's NNX class
    called after construction): the Linen module's path, so that each
    submodule's path is the path of its variables in the Linen variables
    (``ToLinen`` keeps the NNX state there as is, per collection)."""
    if id(module) in self.paths or _TAG in vars(module):
      return True
    path, cls = self.bridges[-1]
    if not isinstance(module, cls) or _constructing(module):
      return False
    self.register(module, path, tag=True)
    return True

  def _created_by_trace(self, module) -> bool:
    """True when every variable of ``module`` holds a tracer: a module
    merged or built inside the traced function (the split form), not a
    user's object captured by the function."""
    found = self.subtree(module)
    return bool(found) and all(isinstance(x, jax.core.Tracer)
                               for _, var, _ in found
                               for x in _value_leaves(var))

  def sources(self) -> dict[int, tuple]:
    """id(traced value) -> path of its Variable among the traced arguments
    (argument prefix, then the attribute path as ``nnx.state`` shows it);
    built when a module first needs it."""
    if self._sources is None:
      self._sources = {}
      for prefix, container in self.containers:
        state = container.state if isinstance(container, GraphArgument) \
            else container
        leaves, treedef = jtu.tree_flatten(state)
        for leaf, path in zip(leaves, _leaf_paths(treedef), strict=True):
          self._sources.setdefault(id(leaf), (*prefix, *path))
    return self._sources

  def _path_from_sources(self, module) -> tuple | None:
    sources = self.sources()
    for relpath, var, _ in self.subtree(module):
      src = sources.get(id(_raw_value(var)))
      n = len(relpath)
      if src is not None and len(src) >= n and src[len(src) - n:] == relpath:
        return src[:len(src) - n]
    return None

  def subtree(self, module) -> list:
    """``[(relative path, Variable, own)]`` for every Variable reachable
    from ``module`` (its own and its submodules'), each once, at its first
    path in ``nnx.iter_graph(module)`` order (as ``nnx.state(module)`` shows
    it); ``own`` is False for a Variable that lives in a submodule.

    Built from the submodules' lists, so each graph node's children are
    listed once per trace however deep the model is."""
    found = self.subtrees.get(id(module))
    if found is None:
      found = []
      modules = [((), module)] if _node_kind(type(module)) == _MODULE else []
      self.walking.add(id(module))
      try:
        self._collect(module, (), True, found, set(), modules,
                      {id(module)})
      finally:
        self.walking.discard(id(module))
      self.subtrees[id(module)] = found
      self.submodules[id(module)] = modules
      self.keep.append(module)
    return found

  def _collect(self, node, path, own, found, seen, modules, visited) -> None:
    """Appends to ``found`` the Variables under ``node`` not in ``seen``,
    and to ``modules`` the modules not in ``visited``, depth first in the
    order the graph lists children (the order in which ``nnx.iter_graph``
    first reaches them)."""
    for key, child in nnx_node_items(node):
      kind = _node_kind(type(child))
      if kind == _LEAF or (kind != _VARIABLE and id(child) in visited) or (
          kind == _NODE and _holds_nothing(child)):
        continue
      at = (*path, str(key))
      if kind == _VARIABLE:
        if id(child) not in seen:
          seen.add(id(child))
          found.append((at, child, own))
      elif kind == _MODULE and id(child) not in self.walking:
        for rel, var, _ in self.subtree(child):
          if id(var) not in seen:
            seen.add(id(var))
            found.append(((*at, *rel), var, False))
        for rel, sub in self.submodules[id(child)]:
          if id(sub) not in visited:
            visited.add(id(sub))
            modules.append(((*at, *rel), sub))
      else:  # a list, dict or other pytree; or a module on a cycle
        visited.add(id(child))
        # A module on a cycle is an ancestor: the modules under it are
        # placed from where the walk first reached it, not through here.
        self._collect(child, at, own and kind != _MODULE, found, seen,
                      modules if kind != _MODULE else [], visited)

  def variables(self, module) -> tuple[list, Any]:
    """(leaves, treedef) of every variable the module can read (its own
    and its submodules'), typed; the tree builder keeps those its body
    reads. Leaves in the order the ``VariableTree`` flattens: sorted paths."""
    entries = []
    for relpath, var, own in self.subtree(module):
      value = _raw_value(var)
      if not is_traced_value(value):
        if jtu.tree_leaves(value) in ([], [value]):
          continue  # None, a Python number or string: static, not an input
        return _nested_variables(self.subtree(module))  # a pytree value
      entries.append((relpath, value, _meta(type(var), own)))
    entries.sort(key=_first)
    return ([value for _, value, _ in entries],
            _cached_treedef(tuple((p, m) for p, _, m in entries)))

  def call(self, module, name, fn, args, kwargs):
    top = self.stack[-1] if self.stack else None
    if not recording() or (top is not None and top[0] is module
                           and top[1] == name):
      return fn(module, *args, **kwargs)  # not recording, or a super() call
    if self.bridges and not self._bridged_path(module):
      # A module that a Linen ``ToLinen`` is still building (its
      # constructor calls helper methods): not yet the bridged model, and
      # its variables are initial values that the call then replaces.
      return fn(module, *args, **kwargs)
    path = self.path_of(module)
    params = self.params.get(id(module))
    if params is None:
      params = self.params[id(module)] = _static_params(module, path)
    var_leaves, var_tree = self.variables(module)
    self.stack.append((module, name, path))
    try:
      return marked_call(type(module), name, params, path, var_leaves,
                         var_tree, functools.partial(fn, module),
                         args, kwargs, is_leaf=is_graph_node)
    finally:
      self.stack.pop()


_TAG = '_yax_path'
_first = operator.itemgetter(0)


@functools.lru_cache(maxsize=None)
def _meta(ty: type, own: bool) -> tuple:
  """``(kind, is_param, own)`` of a Variable of type ``ty``."""
  return ty.__name__, issubclass(ty, nnx.Param), own


@functools.lru_cache(maxsize=4096)
def _cached_treedef(entries: tuple) -> Any:
  """``variable_treedef`` of sorted entries, shared by every trace: a model
  traced again (or a layer repeated) asks for the same structures."""
  treedef = variable_treedef(entries)
  if len(_entries_of) > 8192:
    _entries_of.clear()
  _entries_of[treedef] = entries
  return treedef


# treedef -> its entries, for the treedefs ``_cached_treedef`` made (so
# ``read_only`` can narrow them without flattening a tree).
_entries_of: dict = {}


def _nested_variables(subtree) -> tuple[list, Any]:
  """``Context.variables`` for Variables whose values are pytrees (a dict,
  a tuple of arrays): every array leaf under its Variable's path."""
  nested: dict = {}
  meta_at: dict[tuple, tuple] = {}
  for relpath, var, own in subtree:
    node = nested
    for key in relpath[:-1]:
      node = node.setdefault(key, {})
      if not isinstance(node, dict):
        break
    else:
      node[relpath[-1]] = _raw_value(var)
      meta_at[relpath] = _meta(type(var), own)
  flat = [(tuple(str(key_name(k)) for k in keypath), leaf) for keypath, leaf
          in jtu.tree_flatten_with_path(VariableTree(nested))[0]
          if is_traced_value(leaf)]
  entries = [(keys, next((meta_at[keys[:i]] for i in range(len(keys), 0, -1)
                          if keys[:i] in meta_at), ('', False, True)))
             for keys, _ in flat]
  return [leaf for _, leaf in flat], variable_treedef(entries)


def variable_type(kind: str) -> type:
  """The ``nnx.Variable`` subclass named ``kind`` (``Param``,
  ``LoRAParam``...); ``nnx.Param`` for a name NNX does not define."""
  cls = getattr(nnx, kind, None)
  if isinstance(cls, type) and issubclass(cls, nnx.Variable):
    return cls
  return nnx.Param


def is_param_kind(kind: str) -> bool:
  return issubclass(variable_type(kind), nnx.Param)


def variable_holding(kind: str, value):
  """A Variable of type ``kind`` holding ``value`` (a symbol or an array),
  built without running an initializer."""
  proto = variable_type(kind)(np.zeros((), np.float32))
  return jtu.tree_unflatten(jtu.tree_structure(proto), [value])


SHARDING_KEYS = ('out_sharding', 'sharding_names', 'sharding')


def variable_like(kind: str, value, like, **changes):
  """A Variable of type ``kind`` holding ``value`` with the metadata of
  ``like`` (a Variable) updated by ``changes``, built without sharding a
  value (its ``eager_sharding`` flag is kept as metadata)."""
  meta = {**_metadata(like), **changes}
  # ``like`` may carry its axis names under several keys (MaxText's Params:
  # ``out_sharding`` and its deprecated alias ``sharding_names``); a new
  # name goes under every one of them, or Flax would let the stale alias
  # win over it.
  named = [changes[k] for k in SHARDING_KEYS if k in changes]
  aliases = [k for k in SHARDING_KEYS if k in meta]
  if named:
    meta.update((k, named[0]) for k in aliases)
  eager = meta.pop('eager_sharding', None)
  cls = variable_type(kind)
  try:
    # Built unsharded (a scalar stands in for the value), then given the
    # kernel's eager_sharding flag (Flax >= 0.12.1 has one).
    proto = cls(np.zeros((), np.float32), eager_sharding=False, **meta)
    if eager is not None:
      proto.set_metadata(eager_sharding=eager)
    if len(aliases) > 1:  # the constructor folded the aliases: kept, as on
      proto = cls.from_metadata(proto[...], {  # the kernel
          **proto.get_metadata(), **{k: meta[k] for k in aliases}})
  except Exception as e:  # noqa: BLE001 - reported, never dropped
    # Why not fall back to a bare Variable: the adapter would silently lose
    # the kernel's sharding and the merged state would not fit the tree.
    raise YaxError(
        f'cannot build an nnx.{cls.__name__} with the metadata of its kernel '
        f'{sorted(meta)} ({type(e).__name__}: {e})') from None
  return jtu.tree_unflatten(jtu.tree_structure(proto), [value])


def sharding_names(var) -> tuple[str, tuple] | None:
  """``(metadata key, axis names)`` of a Variable annotated with
  ``nnx.with_partitioning`` (or sharding metadata), else None."""
  meta = _metadata(var)
  for key in SHARDING_KEYS:
    names = meta.get(key)
    if isinstance(names, (tuple, list)):
      return key, tuple(names)
  return None


def _metadata(var) -> dict:
  get = getattr(var, 'get_metadata', None)
  meta = dict(get()) if callable(get) else {}
  return {k: v for k, v in meta.items() if k not in ('value',)}


def read_only(var_tree, var_inputs, reads) -> tuple[list, Any]:
  """An NNX call's variables narrowed to those its body reads."""
  if all(sym in reads for sym in var_inputs):  # most calls read them all
    return list(var_inputs), var_tree
  known = _entries_of.get(var_tree)
  if known is not None:
    kept = [(entry, sym) for entry, sym in zip(known, var_inputs, strict=True)
            if sym in reads]
    return ([sym for _, sym in kept],
            _cached_treedef(tuple(entry for entry, _ in kept)))
  tree = jtu.tree_unflatten(var_tree, var_inputs)
  flat = jtu.tree_flatten_with_path(tree)[0]
  entries, leaves = [], []
  for (keypath, sym), kind, flags in zip(flat, tree.kinds, tree.flags,
                                         strict=True):
    if sym in reads:
      entries.append((tuple(str(key_name(k)) for k in keypath), (kind, *flags)))
      leaves.append(sym)
  if not entries:
    return [], jtu.tree_structure(VariableTree())
  return leaves, variable_treedef(entries)


# A Variable's value as stored (no ``on_get_value`` hooks, no warning):
# ``get_raw_value()`` on newer Flax, the ``raw_value`` slot before it.
_raw_value = (operator.methodcaller('get_raw_value')
              if hasattr(getattr(nnx, 'Variable', None), 'get_raw_value')
              else operator.attrgetter('raw_value'))


# ------------------------------------------------- root arguments

class GraphArgument:
  """Stands for an NNX graph node among the traced function's arguments.

  Its pytree children are the node's state as ``nnx.split`` gives it when
  all graph nodes of the arguments are split together (so shared modules and
  variables are one leaf); ``graphdef`` (of all of them) and ``index`` are
  static, so a tree traced on a model in another mode (``model.eval()``) or
  with another structure does not accept this one.
  """

  __slots__ = ('graphdef', 'index', 'state')

  def __init__(self, graphdef, index, state):
    self.graphdef = graphdef
    self.index = index
    self.state = state

  def __repr__(self):
    return f'GraphArgument({self.index})'


def _ga_flatten_with_keys(g: GraphArgument):
  keys = tuple(g.state.keys())
  return ([(jtu.DictKey(k), g.state[k]) for k in keys],
          (g.graphdef, g.index, keys))


def _ga_flatten(g: GraphArgument):
  keys = tuple(g.state.keys())
  return [g.state[k] for k in keys], (g.graphdef, g.index, keys)


def _ga_unflatten(aux, children):
  graphdef, index, keys = aux
  return GraphArgument(graphdef, index, nnx.State(dict(zip(keys, children,
                                                               strict=True))))


class NnxResult:
  """The result of a traced function whose arguments hold NNX graph nodes:
  its ``output`` and, per graph argument, the variables the call changed or
  created (``updates``, one ``nnx.State`` each)."""

  __slots__ = ('output', 'updates')

  def __init__(self, output, updates):
    self.output = output
    self.updates = updates


if nnx is not None:
  jtu.register_pytree_with_keys(GraphArgument, _ga_flatten_with_keys,
                                _ga_unflatten, _ga_flatten)
  jtu.register_pytree_with_keys(
      NnxResult,
      lambda r: ([(jtu.GetAttrKey('output'), r.output),
                  (jtu.GetAttrKey('updates'), r.updates)], None),
      lambda _, ch: NnxResult(*ch),
      lambda r: ([r.output, r.updates], None))


def _state_from_items(like, items: dict):
  """An ``nnx.State`` holding ``items``, stored as ``nnx.split`` stores it:
  inner levels are plain dicts (a ``state[k]`` view is a State again)."""
  return nnx.State({k: dict(v.raw_mapping) if isinstance(v, nnx.State) else v
                    for k, v in items.items()})


if nnx is not None:
  _containers.register_mapping(nnx.State, _state_from_items)


def _split_arguments(args, kwargs) -> tuple[list, Any, bool]:
  """``(leaves, treedef, has_nodes)`` of ``(args, kwargs)`` with the NNX
  graph nodes among them split together as ``nnx.split`` does (a shared
  module or variable is one leaf), each replaced by a ``GraphArgument``."""
  if _GraphNode is None:
    return (*jtu.tree_flatten((args, kwargs)), False)
  leaves, treedef = jtu.tree_flatten((args, kwargs), is_leaf=is_graph_node)
  positions = [i for i, x in enumerate(leaves) if is_graph_node(x)]
  if not positions:
    # No graph node stopped the flatten: these are the plain leaves.
    return leaves, treedef, False
  nodes = tuple(leaves[i] for i in positions)
  hidden = _HiddenCaches()
  try:
    graphdef, state = (_pytree_split(nodes, hidden)
                       or _nnx_split(nodes, hidden))
  finally:
    hidden.restore()
  leaves = list(leaves)
  for k, i in enumerate(positions):
    sub = state[k] if k in state else nnx.State({})
    leaves[i] = GraphArgument(graphdef, k, sub)
  return (*jtu.tree_flatten(jtu.tree_unflatten(treedef, leaves)), True)


class _HiddenCaches:
  """Values that ``functools.cached_property`` attributes stored in modules'
  instance dicts, taken out while the graph arguments are split and put
  back after.

  A cache is no part of a model's structure: the first call of an EasyDeL
  model caches its RoPE table (an nnx Variable) in a static attribute, so
  with it in the split a tree traced before that call would refuse the
  model from the second step on (as would one traced after it, the model
  before). Split without them, the traced copies compute the cache as a
  first call does (a state update, applied as the call applies it), and
  ``eval_mox`` accepts the model with or without it."""

  __slots__ = ('taken',)

  def __init__(self):
    self.taken: list = []

  def hide(self, module) -> None:
    names = _cached_names(type(module))
    if names:
      attrs = vars(module)
      self.taken += [(attrs, name, attrs.pop(name)) for name in names
                     if name in attrs]

  def restore(self) -> None:
    for attrs, name, value in reversed(self.taken):
      attrs[name] = value
    self.taken.clear()


_CACHED_NAMES: dict[type, tuple] = {}


def _cached_names(ty: type) -> tuple:
  """The ``functools.cached_property`` attributes of module class ``ty``."""
  names = _CACHED_NAMES.get(ty)
  if names is None:
    names = _CACHED_NAMES[ty] = tuple(sorted({
        name for cls in ty.__mro__ for name, attr in vars(cls).items()
        if isinstance(attr, functools.cached_property)}))
  return names


def _nnx_split(nodes: tuple, hidden: _HiddenCaches):
  """``nnx.split(nodes)`` with the modules' caches hidden."""
  for _, node, kind in graph_nodes(nodes):
    if kind == _MODULE:
      hidden.hide(node)
  return nnx.split(nodes)


class PytreeGraph:
  """The ``graphdef`` of graph arguments split by :func:`_pytree_split`:
  the JAX treedef of the nodes with their Variables as leaves (module
  classes, static attributes and the structure, as in a ``GraphDef``)."""

  __slots__ = ('treedef',)

  def __init__(self, treedef):
    self.treedef = treedef

  def __eq__(self, other):
    return isinstance(other, PytreeGraph) and other.treedef == self.treedef

  def __hash__(self):
    return hash(self.treedef)

  def __repr__(self):
    return f'PytreeGraph({self.treedef})'


def _pytree_split(nodes: tuple, hidden: _HiddenCaches | None = None
                  ) -> tuple[PytreeGraph, Any] | None:
  """``(PytreeGraph, state)`` for graph nodes that JAX's pytree flatten
  splits as ``nnx.split`` does, at a fraction of its cost (Flax modules
  are pytrees): the state is ``nnx.split``'s (every Variable at its path, in
  the same order). None where the pytree flatten cannot stand for
  ``nnx.split``: a module, Variable or other graph node reached twice (a
  shared one: unflattening would make two), a leaf that is not a Variable
  (an array attribute, a node type that is no pytree), or another order."""
  seen: set[int] = set()
  shared = False

  def stop(x) -> bool:  # called on every node the flatten reaches
    nonlocal shared
    kind = _node_kind(type(x))
    if kind == _VARIABLE or kind == _MODULE or is_graph_node(x):
      shared = shared or id(x) in seen
      seen.add(id(x))
      if kind == _MODULE and hidden is not None:
        hidden.hide(x)  # (before the flatten reads its attributes)
    return kind == _VARIABLE

  try:
    flat, treedef = jtu.tree_flatten_with_path(nodes, is_leaf=stop)
  except Exception:  # noqa: BLE001 - a node Flax flattens but JAX cannot
    return None
  if shared:
    return None
  nested: dict = {}
  for keypath, var in flat:
    if _node_kind(type(var)) != _VARIABLE:
      return None
    node = nested
    for k in keypath[:-1]:
      node = node.setdefault(key_name(k), {})
    node[key_name(keypath[-1])] = var
  state = nnx.State(nested)
  in_order = jtu.tree_leaves(state, is_leaf=_is_variable)
  if len(in_order) != len(flat) or any(
      a is not b for a, (_, b) in zip(in_order, flat, strict=True)):
    return None
  return PytreeGraph(treedef), state


def _is_variable(x) -> bool:
  return _node_kind(type(x)) == _VARIABLE


def flatten_arguments(args, kwargs):
  """``tree_flatten((args, kwargs))`` for ``eval_mox``, with NNX graph nodes
  split as when tracing."""
  leaves, treedef, _ = _split_arguments(args, kwargs)
  return leaves, treedef


def apply_updates(result, args, kwargs):
  """The traced function's output; state updates applied to the modules."""
  if not isinstance(result, NnxResult):
    return result
  leaves = jtu.tree_leaves((args, kwargs), is_leaf=is_graph_node)
  nodes = [x for x in leaves if is_graph_node(x)]
  if any(isinstance(x, jax.core.Tracer) for x in jtu.tree_leaves(
      result.updates)):  # (replayed under a transformation)
    result.updates = tuple(_without_traced_caches(node, u)
                           for node, u in zip(nodes, result.updates,
                                                strict=True))
  if len(nodes) > 1:  # apply all at once: shared variables live in one place
    nnx.update(tuple(nodes), nnx.State(
        {k: u for k, u in enumerate(result.updates) if len(u)}))
  elif nodes and len(result.updates[0]):
    nnx.update(nodes[0], result.updates[0])
  return result.output


def _constructing(module) -> bool:
  """Whether ``module.__init__`` is still running (on this thread's stack):
  its submodules may not all exist yet. Looked up once per module that a
  ``ToLinen`` bridge builds, so walking the frames costs little."""
  frame = sys._getframe(1)
  while frame is not None:
    if frame.f_code.co_name == '__init__' and \
        frame.f_locals.get('self') is module:
      return True
    frame = frame.f_back
  return False


def _without_traced_caches(node, update):
  """``update`` (the state updates of graph node ``node``) less the caches
  computed in a transformation: a ``functools.cached_property`` value
  holding a tracer would outlive its trace (plain NNX leaks it there, and
  fails on the next call). The next replay computes the cache again, as
  the trace splits models without their caches (``_HiddenCaches``)."""
  names = _cached_names(type(node)) if _node_kind(
      type(node)) == _MODULE else ()
  children = None
  kept = {}
  for key, value in update.items():
    if key in names and _is_variable(value) and any(
        isinstance(x, jax.core.Tracer) for x in _value_leaves(value)):
      continue
    if isinstance(value, Mapping):  # the updates of a child node
      if children is None:
        children = dict(nnx_node_items(node))
      child = children.get(key)
      if child is not None:
        value = _without_traced_caches(child, value)
    kept[key] = value
  return nnx.State(kept)


def bridged_class(module) -> type | None:
  """The NNX class behind a Linen module that runs an NNX model as Linen
  (Flax's ``nnx.bridge.ToLinen``, or a copy of it such as MaxText's, told by
  its ``nnx_class`` field), else None."""
  if 'nnx_class' not in getattr(type(module), '__dataclass_fields__', ()):
    return None
  cls = module.nnx_class
  while isinstance(cls, functools.partial):
    cls = cls.func
  if nnx is not None and isinstance(cls, type) and issubclass(cls,
                                                               nnx.Module):
    return cls
  return None


def bridged(path: tuple, nnx_class: type, fn):
  """``fn`` (the call of a ``ToLinen`` module at Linen path ``path``) with
  the NNX model it builds and calls, an instance of ``nnx_class``, placed
  at ``path`` (see ``_Context._bridged_path``)."""
  def call(*args, **kwargs):
    ctx = getattr(_local, 'ctx', None)
    if ctx is None:
      return fn(*args, **kwargs)
    ctx.bridges.append((path, nnx_class))
    try:
      return fn(*args, **kwargs)
    finally:
      ctx.bridges.pop()
  return call


class TraceScope:
  """The NNX side of one ``make_mox`` trace.

  ``leaves``/``in_tree`` flatten the arguments (graph nodes split as
  ``nnx.split`` does); use the scope as a context manager around the traced
  call (module methods are wrapped while it is active on this thread) and
  call the function with :meth:`call`.
  """

  def __init__(self, args, kwargs):
    self.leaves, self.in_tree, self.has_nodes = _split_arguments(args, kwargs)
    self._saved = None
    self._patch = None

  def __enter__(self):
    if nnx is None:
      return self
    self._patch = _patched_classes()
    self._patch.__enter__()
    self._saved = getattr(_local, 'ctx', None)
    _local.ctx = _Context()
    return self

  def __exit__(self, *exc):
    if nnx is None:
      return False
    _local.ctx = self._saved
    self._patch.__exit__(*exc)
    return False

  def call(self, fn, args, kwargs):
    """Calls ``fn`` on copies of the argument graph nodes (merged from the
    traced state) and returns its result, with state updates if any."""
    ctx = _local.ctx
    ctx.containers = _model_prefixes(args, kwargs)
    if not self.has_nodes:
      return fn(*args, **kwargs)
    leaves, treedef = jtu.tree_flatten(
        (args, kwargs), is_leaf=lambda x: isinstance(x, GraphArgument))
    positions = [i for i, x in enumerate(leaves)
                 if isinstance(x, GraphArgument)]
    graphs = [leaves[i] for i in positions]
    graphdef = graphs[0].graphdef
    given = None
    if isinstance(graphdef, PytreeGraph):  # (see ``_pytree_split``)
      by_index = sorted(graphs, key=operator.attrgetter('index'))
      given = [var for g in by_index
               for var in jtu.tree_leaves(g.state, is_leaf=_is_variable)]
      given_values = [_value_leaves(var) for var in given]
      copies = jtu.tree_unflatten(graphdef.treedef, given)
    else:
      copies = nnx.merge(graphdef,
                         nnx.State({g.index: g.state for g in graphs}))
    leaves = list(leaves)
    for i, g in zip(positions, graphs, strict=True):
      leaves[i] = copies[g.index]
    # One walk of the copies (``nnx.split`` paths, the graph's index first),
    # the one that lists each module's variables for its calls, notes every
    # Variable's value; placing each graph reads the same walk.
    before = {path: _value_leaves(var)
              for path, var, _ in ctx.subtree(copies)}
    prefix_of = {id(c): p for p, c in ctx.containers}
    for g in graphs:
      ctx.register(copies[g.index], prefix_of[id(g)], tag=True)
    a, k = jtu.tree_unflatten(treedef, leaves)
    out = fn(*a, **k)
    updates = [dict() for _ in graphs]
    if given is not None and _same_graph(copies, graphdef, given):
      # Nothing was added, removed or replaced (the pytree structure and
      # the Variables are those given): the updates are the values set.
      changed = [i for i, (var, old) in enumerate(
          zip(given, given_values, strict=True))
                 if not _same_leaves(old, _value_leaves(var))]
      if changed:
        flat = jtu.tree_flatten_with_path(copies, is_leaf=_is_variable)[0]
        for i in changed:
          path = tuple(key_name(k) for k in flat[i][0])
          updates[path[0]][path[1:]] = flat[i][1]
    else:
      # Every Variable of the copies after the call, at its nnx.split path
      # (created ones included), compared with what went in.
      for path, var, kind in graph_nodes(copies):
        if kind != _VARIABLE:
          continue
        old = before.get(_str_path(path))
        if old is None or not _same_leaves(old, _value_leaves(var)):
          updates[path[0]][path[1:]] = var
    states = tuple(_nested_state(u) for u in updates)
    return NnxResult(out, states)


def _same_graph(copies, graphdef: PytreeGraph, given: list) -> bool:
  """Whether the copies still have the structure they were built with and
  hold the Variables they were given (so a pytree flatten sees every
  Variable a walk would)."""
  now, treedef = jtu.tree_flatten(copies, is_leaf=_is_variable)
  return (treedef == graphdef.treedef and len(now) == len(given)
          and all(a is b for a, b in zip(now, given, strict=True)))


def _same_leaves(old: tuple, new: tuple) -> bool:
  return len(old) == len(new) and all(
      x is y for x, y in zip(old, new, strict=True))


@functools.lru_cache(maxsize=256)
def _leaf_paths(treedef) -> tuple:
  """The attribute path of each leaf of a state with structure ``treedef``
  (as ``nnx.state`` shows it), computed once per structure."""
  paths = []
  for keypath, _ in jtu.tree_flatten_with_path(
      jtu.tree_unflatten(treedef, [0] * treedef.num_leaves))[0]:
    keys = [key_name(k) for k in keypath]
    if keys and keys[-1] == 'value':  # the Variable's own value field
      keys = keys[:-1]
    paths.append(_str_path(keys))
  return tuple(paths)


def _value_leaves(var) -> tuple:
  """The arrays a Variable holds (one for most; a pytree value's leaves)."""
  value = _raw_value(var)
  if is_traced_value(value):
    return (value,)
  return tuple(jtu.tree_leaves(value))


def _nested_state(flat: dict):
  nested: dict = {}
  for path, var in flat.items():
    node = nested
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = var
  return nnx.State(nested)


def _model_prefixes(args, kwargs) -> list:
  """``[(path prefix, container)]`` for the arguments that hold models: NNX
  graph nodes (as ``GraphArgument`` s) and ``nnx.State`` s. One such
  argument is the root of its paths (prefix ``()``); several are told apart
  by where they sit among the arguments (``0/enc``, ``1/enc``)."""
  is_container = lambda x: isinstance(x, (GraphArgument, nnx.State))
  found = [(kp, x) for kp, x in jtu.tree_flatten_with_path(
      (args, kwargs), is_leaf=is_container)[0] if is_container(x)]
  if len(found) == 1:
    return [((), found[0][1])]
  return [(_argument_prefix(kp), x) for kp, x in found]


def _argument_prefix(keypath) -> tuple:
  """``args[1]`` -> ``('1',)``; ``kwargs['model']`` -> ``('model',)``."""
  keys = [key_name(k) for k in keypath]
  return _str_path(keys[1:])


# ------------------------------------------------------------ rewrites

def is_state(x) -> bool:
  """True for an ``nnx.State`` (False when Flax NNX is not installed)."""
  return nnx is not None and isinstance(x, nnx.State)


def holds_graph_argument(mox) -> bool:
  """True for a tree traced with an NNX module (not its state) among the
  arguments: the module form, whose variables rewrites cannot add to."""
  # Walk the treedef's nodes (never build the tree: a pytree node of the
  # user's that checks its children would refuse placeholder leaves).
  stack = [mox.in_tree] if mox.in_tree is not None else []
  while stack:
    treedef = stack.pop()
    data = treedef.node_data()
    if data is not None and data[0] is GraphArgument:
      return True
    stack.extend(treedef.children())
  return False


# --------------------------------------------------------- command line

def call_module(module, *args, **kwargs):
  """Calls an NNX module (what the command line traces for an NNX model)."""
  return module(*args, **kwargs)


def module_as_argument(fn, args):
  """``(fn, args)`` for a factory; an NNX module given as ``fn`` becomes
  the first argument of :func:`call_module`, so its state is traced as
  inputs (not baked in as constants) and its updates are outputs."""
  if nnx is not None and isinstance(fn, nnx.Module) and isinstance(
      args, (tuple, list)):
    return call_module, (fn, *args)
  return fn, args


def variable_groups(mox) -> dict:
  """An NNX module call's variable inputs by collection, as the summary
  shows them: ``params`` (``nnx.Param`` and its subclasses),
  ``batch_stats`` (``BatchStat``), other Variable types by their name.
  Every variable the call reads, its submodules' included."""
  groups: dict = {}
  for sym, (kind, is_param, _) in zip(mox.var_inputs, _metas(mox),
                                      strict=True):
    groups.setdefault(_group(kind, is_param), []).append(sym)
  return groups


def param_leaves(arguments) -> set:
  """The leaves of ``arguments`` (the traced arguments, unflattened) that
  sit in an ``nnx.Param`` (or a subclass): the model's parameters, told
  apart from its RNG state, caches and batch statistics."""
  if nnx is None:
    return set()
  found = set()
  for leaf in jtu.tree_leaves(arguments, is_leaf=_is_variable):
    if isinstance(leaf, nnx.Param):
      found.update(jtu.tree_leaves(leaf))
  return found


def _group(kind: str, is_param: bool) -> str:
  if is_param:
    return 'params'
  return {'BatchStat': 'batch_stats'}.get(kind, kind or 'variables')


def _metas(mox) -> list:
  tree = jtu.tree_unflatten(mox.var_tree, [None] * mox.num_vars)
  return [(k, *f) for k, f in zip(tree.kinds, tree.flags, strict=True)]


def own_variables(mox) -> dict:
  """``{collection: {path: symbol}}`` of an NNX module call's own variables
  (not its submodules'; collections named as in :func:`variable_groups`,
  paths as ``nnx.state`` shows them: ``kernel``, ``rngs/count``)."""
  tree = jtu.tree_unflatten(mox.var_tree, list(range(mox.num_vars)))
  paths = ['/'.join(str(key_name(k)) for k in kp)
           for kp, _ in jtu.tree_flatten_with_path(tree)[0]]
  out: dict = {}
  for path, sym, (kind, is_param, own) in zip(
      paths, mox.var_inputs, _metas(mox), strict=True):
    if own:
      out.setdefault(_group(kind, is_param), {})[path] = sym
  return out
