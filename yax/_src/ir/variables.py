"""The variables of a module call, as data on its node.

A module call's variable inputs are described by its ``var_tree``, in one
of two encodings: Linen's ``{collection: {name: ...}}`` dicts (boxes such
as ``nn.Partitioned`` kept), or an NNX :class:`VariableTree` whose treedef
also carries each leaf's Variable type. :func:`var_entries` reads either
into one list of :class:`VarEntry` (cached per node: nodes are immutable),
and :func:`with_variables` is the one writer of a call's variables, so no
other module branches on the encoding.

A variable's place is a key path tuple: ``VarEntry.rel_path`` inside the
call's scope, ``(group, *module path, *rel_path)`` in the whole model
(:func:`location`), where the group is the Linen collection or
:data:`NNX_GROUP`.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir.containers import set_many
from yax._src.ir.nodes import Mox, Symbol

# The variable group of NNX variables: an NNX model keeps all its Variables
# in one state (an ``nnx.State`` or the module itself), where Linen splits
# them into collections. A location ``('nnx', *module path, *name)`` is the
# Variable's place in that state.
NNX_GROUP = 'nnx'


# ------------------------------------------------------ key paths

def key_name(key) -> Any:
  """The dict key, attribute name or index of one step of a key path."""
  if isinstance(key, (jtu.DictKey, jtu.FlattenedIndexKey)):
    return key.key
  if isinstance(key, jtu.GetAttrKey):
    return key.name
  if isinstance(key, jtu.SequenceKey):
    return key.idx
  raise SubstitutionError(
      f'internal: a key path step of unknown kind {type(key).__name__} '
      f'({key!r}); expected DictKey, GetAttrKey, SequenceKey or '
      'FlattenedIndexKey')


def placeholder_parts(treedef, start: int = 0) -> list[tuple[tuple, Any]]:
  """``treedef`` built with each leaf's index (from ``start``) as its leaf,
  as ``[(key path, subtree)]`` parts that cover its leaves in order.

  One part, ``((), whole tree)``, unless a pytree node of the treedef
  refuses placeholder leaves (a user's class whose constructor checks its
  children): then each child of every node that refuses is built on its
  own, and that node's children are keyed as its type flattens them when
  that is known without an instance (dicts by key, lists and tuples by
  position, namedtuples by field), else by position
  (``FlattenedIndexKey``). So every leaf is reached, and keys below the
  refusing node keep their names.

  Example: ``placeholder_parts(tree_structure({'a': 1}))`` is
  ``[((), {'a': 0})]``.
  """
  n = treedef.num_leaves
  try:
    return [((), jtu.tree_unflatten(treedef, range(start, start + n)))]
  except Exception:  # noqa: BLE001 - a node refuses placeholders: handled
    children = treedef.children()
    if not children:
      raise
  ty, aux = treedef.node_data()
  if ty is dict:
    keys = [jtu.DictKey(k) for k in aux]
  elif issubclass(ty, tuple) and hasattr(ty, '_fields'):
    keys = [jtu.GetAttrKey(f) for f in ty._fields]
  elif ty in (list, tuple):
    keys = [jtu.SequenceKey(i) for i in range(len(children))]
  else:
    keys = [jtu.FlattenedIndexKey(i) for i in range(len(children))]
  out = []
  for key, child in zip(keys, children, strict=True):
    out.extend(((key, *kp), sub) for kp, sub in placeholder_parts(child, start))
    start += child.num_leaves
  return out


def leaf_keypaths(treedef) -> list[tuple]:
  """The key path of each leaf of ``treedef``, in leaf order, as
  ``jax.tree_util.tree_flatten_with_path`` names them (see
  :func:`placeholder_parts` for a node that refuses placeholder leaves).

  Example: ``leaf_keypaths(tree_structure({'a': 1}))`` is
  ``[(DictKey('a'),)]``.
  """
  out: list = [None] * treedef.num_leaves
  for prefix, sub in placeholder_parts(treedef):
    for kp, i in jtu.tree_flatten_with_path(sub)[0]:
      out[i] = (*prefix, *kp)
  return out


def unboxed_path(keypath: tuple) -> tuple:
  """A key path without the ``value`` field of the box that holds the
  array (a Linen ``nn.Partitioned``, an NNX Variable)."""
  if keypath and isinstance(keypath[-1], jtu.GetAttrKey) and \
      keypath[-1].name == 'value':
    return keypath[:-1]
  return keypath


def _str_keys(keypath) -> tuple:
  return tuple(str(key_name(k)) for k in unboxed_path(keypath))


# ------------------------------------------------------ NNX's encoding

class VariableTree(dict):
  """The variables of an NNX module call, keyed as ``nnx.state`` shows them.

  A dict (nested dicts under it) whose treedef also carries, in leaf order,
  each leaf's Variable type name (``kinds``: ``Param``, ``BatchStat``,
  ``RngCount``...) and ``flags``: ``(is_param, own)``, where ``is_param``
  holds for ``nnx.Param`` and its subclasses (``nnx.LoRAParam``, custom
  parameter types) and ``own`` for a variable of the module itself rather
  than of a submodule. So ``Mox.var_tree`` tells every view what kind each
  variable input is.
  """

  kinds: tuple = ()
  flags: tuple = ()


def _vt_flatten_with_keys(tree: VariableTree):
  keys = sorted(tree)
  return ([(jtu.DictKey(k), tree[k]) for k in keys],
          (tuple(keys), tuple(tree.kinds), tuple(tree.flags)))


def _vt_flatten(tree: VariableTree):
  keys = sorted(tree)
  return [tree[k] for k in keys], (tuple(keys), tuple(tree.kinds),
                                   tuple(tree.flags))


def _vt_unflatten(aux, children):
  keys, kinds, flags = aux
  tree = VariableTree(zip(keys, children, strict=True))
  tree.kinds = kinds
  tree.flags = flags
  return tree


jtu.register_pytree_with_keys(VariableTree, _vt_flatten_with_keys,
                              _vt_unflatten, _vt_flatten)


def is_variable_treedef(treedef) -> bool:
  """Whether ``treedef`` is that of a ``VariableTree`` (an NNX call's
  variables), read from its root node without building the tree."""
  data = treedef.node_data()
  return data is not None and data[0] is VariableTree


def variable_treedef(entries) -> Any:
  """The treedef of a ``VariableTree`` with one leaf per ``(relative path,
  (kind, is_param, own))`` entry, in the order the tree flattens."""
  nested: dict = {}
  for relpath, _ in entries:
    node = nested
    for key in relpath[:-1]:
      node = node.setdefault(key, {})
    node[relpath[-1]] = 0
  tree = VariableTree(nested)
  by_path = dict(entries)
  order = [_str_keys(kp) for kp, _ in jtu.tree_flatten_with_path(tree)[0]]
  tree.kinds = tuple(by_path[p][0] for p in order)
  tree.flags = tuple(by_path[p][1:] for p in order)
  return jtu.tree_structure(tree)


# ------------------------------------------------------ the model

@dataclasses.dataclass(frozen=True)
class VarEntry:
  """One variable input of a module call.

  Attributes:
    group: the Linen collection (``'params'``, ``'batch_stats'``) or
      :data:`NNX_GROUP` for an NNX Variable.
    kind: the Linen collection, or the NNX Variable type name (``'Param'``,
      ``'LoRAParam'``, ``'BatchStat'``).
    rel_path: the variable's key path inside the call's scope
      (``('kernel',)``, ``('lin', 'kernel')`` for a submodule's), as strings.
    is_param: a parameter (the ``params`` collection, an ``nnx.Param``).
    own: the module's own variable rather than a submodule's.
    symbol: the call's input symbol that holds it.
  """
  group: str
  kind: str
  rel_path: tuple
  is_param: bool
  own: bool
  symbol: Symbol

  @property
  def keys(self) -> tuple:
    """``(group, *rel_path)``: the variable's place relative to the call."""
    return (self.group, *self.rel_path)

  @property
  def name(self) -> str:
    return self.rel_path[-1]


def location(node: Mox, entry: VarEntry) -> tuple:
  """``(group, *module path, *rel_path)``: where ``entry`` of ``node`` sits
  in the whole model's variables."""
  return (entry.group, *node.path, *entry.rel_path)


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def var_entries(node: Mox) -> tuple[VarEntry, ...]:
  """The variable inputs of ``node``, in input order (cached per node)."""
  found = _cache.get(node)
  if found is not None:
    return found
  n = node.num_vars
  if n == 0:
    found = ()
  else:
    found = tuple(
        VarEntry(group, kind, rel, is_param, own, sym)
        for (group, kind, rel, is_param, own), sym in zip(
            _layout(node.var_tree, n), node.var_inputs, strict=True))
  _cache[node] = found
  return found


# Layouts by treedef: a rewrite rebuilds the calls around every replaced
# node, and calls of one module type share a treedef (BERT-base's 73 Dense
# layers: one), so each layout is read once rather than per node object.
_layouts: dict = {}


def _layout(var_tree, n: int) -> tuple:
  """``(group, kind, rel_path, is_param, own)`` of each leaf of a
  ``var_tree`` of ``n`` leaves, in leaf order."""
  try:
    found = _layouts.get(var_tree)
  except TypeError:  # a treedef whose node data does not hash
    return _read_layout(var_tree, n)
  if found is None:
    found = _read_layout(var_tree, n)
    if len(_layouts) > 4096:
      _layouts.clear()
    _layouts[var_tree] = found
  return found


def _read_layout(var_tree, n: int) -> tuple:
  tree = jtu.tree_unflatten(var_tree, range(n))
  paths = [_str_keys(kp) for kp, _ in jtu.tree_flatten_with_path(tree)[0]]
  if isinstance(tree, VariableTree):
    return tuple((NNX_GROUP, kind, p, flags[0], flags[1])
                 for p, kind, flags in zip(paths, tree.kinds, tree.flags,
                                           strict=True))
  return tuple((p[0], p[0], p[1:], p[0] == 'params', len(p) == 2)
               for p in paths)


def var_keys(node: Mox) -> list[tuple]:
  """``(group, *name)`` of each variable input of a module call, Linen and
  NNX alike: ``('params', 'kernel')`` for a Linen Dense, ``('nnx',
  'kernel')`` for an NNX Linear, ``('nnx', 'lin', 'kernel')`` for a
  submodule's Variable an NNX call reads."""
  return [e.keys for e in var_entries(node)]


def var_kind(node: Mox, index: int) -> tuple[str, bool]:
  """``(kind, is_param)`` of variable input ``index``: the Linen
  collection, or the NNX Variable type (``nnx.Param`` subclasses are
  parameters)."""
  entry = var_entries(node)[index]
  return entry.kind, entry.is_param


def is_nnx(node: Mox) -> bool:
  """Whether ``node``'s variables are in NNX's encoding."""
  return node.num_vars > 0 and is_variable_treedef(node.var_tree)


# ------------------------------------------------------ the one writer

def with_variables(node: Mox, symbols=None, added=()) -> tuple[list, Any]:
  """``(var_inputs, var_tree)`` of ``node`` with its variables held by
  ``symbols`` (its own by default, same order) and the ``added`` entries
  (:class:`VarEntry`, ``rel_path`` inside the call's scope) inserted; an
  entry at a place the call already has is left out. The encoding is the
  node's (NNX where it has Variables or an entry is an NNX one); boxes of
  Linen variables (``nn.Partitioned``) are kept."""
  entries = var_entries(node)
  symbols = list(node.var_inputs if symbols is None else symbols)
  if any(e.group == NNX_GROUP for e in added) or is_nnx(node):
    order = [(e.rel_path, (e.kind, e.is_param, e.own)) for e in entries]
    leaves = list(symbols)
    seen = {e.rel_path for e in entries}
    for e in added:
      if e.rel_path not in seen:
        seen.add(e.rel_path)
        order.append((e.rel_path, (e.kind, e.is_param, e.own)))
        leaves.append(e.symbol)
    treedef = variable_treedef(order)
    position = {rel: i for i, (rel, _) in enumerate(order)}
    flat = jtu.tree_flatten_with_path(
        jtu.tree_unflatten(treedef, range(len(order))))[0]
    return [leaves[position[_str_keys(kp)]] for kp, _ in flat], treedef
  tree = jtu.tree_unflatten(node.var_tree, symbols) if entries else {}
  # The first entry at each place that holds no value yet, all inserted
  # in one copy of the containers on their way (types kept).
  new = {}
  for e in added:
    if e.keys not in new and not _holds(tree, e.keys):
      new[e.keys] = e.symbol
  tree = set_many(tree, list(new.items()))
  leaves, treedef = jtu.tree_flatten(
      tree, is_leaf=lambda x: isinstance(x, Symbol))
  return leaves, treedef


def _holds(tree, keys: tuple) -> bool:
  """Whether ``tree`` (nested mappings) holds a value at ``keys``."""
  node = tree
  for key in keys:
    if not hasattr(node, 'keys') or key not in node:
      return False
    node = node[key]
  return True
