"""The NNX object graph as a trace walks it: what a value is in the graph
(a leaf, a Variable, a module, another node), the walk ``nnx.split`` makes
(:func:`graph_nodes`), a module's static attributes, a Variable's stored
value. Shared by the other ``nnx*`` modules of ``trace/``."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping

import jax
import numpy as np
from jax import tree_util as jtu

from yax._src.compat import nnx_is_node_type, nnx_node_items
from yax._src.trace.calls import is_traced_value

try:  # flax.nnx is part of every supported Flax; stay importable without it
  from flax import nnx
except ImportError:  # pragma: no cover - flax without nnx
  nnx = None

GraphNode = (getattr(nnx, 'Pytree', None) or getattr(nnx, 'Object', None)) \
    if nnx is not None else None


def is_graph_node(x) -> bool:
  """NNX modules and other graph objects (``nnx.Rngs``)."""
  return GraphNode is not None and isinstance(x, GraphNode)


# ---------------------------------- node kinds, walks, static attributes

def str_path(path) -> tuple[str, ...]:
  return tuple(str(p) for p in path)


def static_params(module, path) -> dict:
  """A module's static attributes (no variables, submodules or arrays)."""
  params, kinds = {}, _PARAM_KINDS
  for key, value in vars(module).items():
    if key[0] == '_':
      continue
    kind = kinds.get(type(value))  # (one lookup per attribute of every module)
    if kind is None:
      kind = _param_kind(type(value))
    if kind == _STATIC or (kind == NODE and _is_static_tree(value)):
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
  return not any(_is_graph_object(x) or is_array_type(type(x))
                 for x in leaves)


_STATIC = -1  # _param_kind of a leaf that is not an array
_PARAM_KINDS: dict[type, int] = {}  # type -> _param_kind (read inline too)


def _param_kind(ty: type) -> int:
  """``node_kind``, with leaves that are not arrays told apart
  (``_STATIC``): those are a module's static params. Decided once per type."""
  kind = _PARAM_KINDS.get(ty)
  if kind is None:
    kind = node_kind(ty)
    if kind == LEAF and not is_array_type(ty):
      kind = _STATIC
    _PARAM_KINDS[ty] = kind
  return kind


@functools.lru_cache(maxsize=None)
def is_array_type(ty: type) -> bool:
  return issubclass(ty, (jax.Array, np.ndarray, jax.core.Tracer))


LEAF, VARIABLE, MODULE, NODE = range(4)


def _is_graph_object(x) -> bool:
  """A Variable, module or other NNX graph object (``nnx.Rngs``)."""
  return node_kind(type(x)) in (VARIABLE, MODULE) or is_graph_node(x)


@functools.lru_cache(maxsize=None)
def node_kind(ty: type) -> int:
  """What a value of type ``ty`` is in an NNX graph, decided once per type
  (``isinstance`` against ``nnx.Variable`` goes through a metaclass hook).
  Values of types that NNX never looks into (arrays, numbers, functions,
  dtypes) are leaves; other graph nodes and pytrees (``nnx.Rngs``, lists,
  dicts) are nodes."""
  if issubclass(ty, nnx.Variable):
    return VARIABLE
  if issubclass(ty, nnx.Module):
    return MODULE
  if ty in (int, float, bool, str, type(None), np.ndarray) or issubclass(
      ty, (jax.Array, jax.core.Tracer)) or not nnx_is_node_type(ty):
    return LEAF
  return NODE


def holds_nothing(node) -> bool:
  """A tuple of leaves (a shape, axes) or an empty mapping (Flax keeps
  empty ``FrozenDict`` s as static attributes): no Variable or module can be
  under it, so the walks skip it (two thirds of a Transformer's nodes)."""
  if type(node) is tuple:
    return all(node_kind(type(x)) == LEAF for x in node)
  return isinstance(node, Mapping) and not node


def graph_nodes(root) -> list:
  """``[(path, node, kind)]`` for ``root`` and every module, other graph
  node and Variable under it, each once, at the first path a depth-first
  walk reaches it with children in the order ``nnx.split`` lists them (so
  the paths are those of ``nnx.split``'s state and ``nnx.iter_graph``);
  ``kind`` is ``MODULE``, ``VARIABLE`` or ``NODE``."""
  found, visited = [], set()
  kind = node_kind(type(root))
  stack = [] if kind == LEAF else [((), root, kind)]
  while stack:
    path, node, kind = stack.pop()
    if id(node) in visited:
      continue
    visited.add(id(node))
    found.append((path, node, kind))
    if kind != VARIABLE:
      for key, child in reversed(nnx_node_items(node)):
        child_kind = node_kind(type(child))
        if child_kind != LEAF and not (child_kind == NODE
                                        and holds_nothing(child)):
          stack.append(((*path, key), child, child_kind))
  return found


# A Variable's value as stored (no ``on_get_value`` hooks, no warning):
# ``get_raw_value()`` on newer Flax, the ``raw_value`` slot before it.
raw_value = (operator.methodcaller('get_raw_value')
              if hasattr(getattr(nnx, 'Variable', None), 'get_raw_value')
              else operator.attrgetter('raw_value'))


def is_variable(x) -> bool:
  return node_kind(type(x)) == VARIABLE


def value_leaves(var) -> tuple:
  """The arrays a Variable holds (one for most; a pytree value's leaves)."""
  value = raw_value(var)
  if is_traced_value(value):
    return (value,)
  return tuple(jtu.tree_leaves(value))


