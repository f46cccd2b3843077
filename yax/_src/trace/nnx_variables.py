"""NNX Variables in the tree: the typed half of the variable model.

A call's variables are a ``VariableTree`` (``ir/variables.py``) whose entries
carry the Variable type, whether it is a parameter and whether it is the
module's own. Here: building those trees for a trace (cached, narrowed to
what a body reads), boxing a value as a Variable of a type (with a kernel's
metadata), and grouping a call's variables as the summary shows them."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from jax import tree_util as jtu

from yax._src.errors import YaxError
from yax._src.ir.variables import (VariableTree, is_variable_treedef, key_name,
                                   variable_treedef)
from yax._src.trace.calls import constructor_kwargs, is_traced_value
from yax._src.trace.nnx_graph import is_variable, raw_value

try:  # flax.nnx is part of every supported Flax; stay importable without it
  from flax import nnx
except ImportError:  # pragma: no cover - flax without nnx
  nnx = None


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


@functools.lru_cache(maxsize=None)
def meta(ty: type, own: bool) -> tuple:
  """``(kind, is_param, own)`` of a Variable of type ``ty``."""
  return ty.__name__, issubclass(ty, nnx.Param), own


@functools.lru_cache(maxsize=4096)
def cached_treedef(entries: tuple) -> Any:
  """``variable_treedef`` of sorted entries, shared by every trace: a model
  traced again (or a layer repeated) asks for the same structures."""
  treedef = variable_treedef(entries)
  if len(_entries_of) > 8192:
    _entries_of.clear()
  _entries_of[treedef] = entries
  return treedef


# treedef -> its entries, for the treedefs ``cached_treedef`` made (so
# ``read_only`` can narrow them without flattening a tree).
_entries_of: dict = {}


def nested_variables(subtree) -> tuple[list, Any]:
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
      node[relpath[-1]] = raw_value(var)
      meta_at[relpath] = meta(type(var), own)
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
            cached_treedef(tuple(entry for entry, _ in kept)))
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
  for leaf in jtu.tree_leaves(arguments, is_leaf=is_variable):
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


# ------------------------------------------------------------- rebuilds


def is_module_class(cls) -> bool:
  """Whether ``cls`` is an NNX module class."""
  return nnx is not None and isinstance(cls, type) and issubclass(
      cls, nnx.Module)


def init_variables(cls: type, attributes: dict, key, where: str):
  """The state (``nnx.State``) of a new ``cls`` built by its ``__init__``:
  an ``rngs`` parameter gets ``nnx.Rngs(key)``, the others the values the
  trace recorded as the call's ``attributes``, or their defaults.

  ``where`` names the variable asked for (for the error raised when
  ``__init__`` needs an argument the trace did not record).

  Example: ``init_variables(nnx.Linear, {'in_features': 2,
  'out_features': 3}, key, where)['kernel']``.
  """
  kwargs = constructor_kwargs(
      cls, attributes, rng=('rngs', nnx.Rngs(key)), where=where, system='NNX',
      remedy='store them as attributes of the module')
  return nnx.state(cls(**kwargs))


def norm_kinds() -> dict[type, str]:
  """NNX's normalisation layers by kind: ``{nnx.LayerNorm: 'layer',
  nnx.RMSNorm: 'rms'}`` (empty without ``flax.nnx``)."""
  if nnx is None:
    return {}
  return {nnx.LayerNorm: 'layer', nnx.RMSNorm: 'rms'}
