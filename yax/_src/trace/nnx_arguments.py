"""NNX graph nodes among a traced function's arguments, and their replay.

The graph nodes among the arguments (modules, ``nnx.Rngs``) are split
together as ``nnx.split`` does (:func:`split_arguments`; a fast path when
JAX's pytree flatten gives the same state), each replaced by a
:class:`GraphArgument`; ``eval_mox`` flattens its arguments the same way
(:func:`flatten_arguments`) and writes the state updates a call returns
(:class:`NnxResult`) back into the given modules (:func:`apply_updates`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
from jax import tree_util as jtu

from yax._src.compat import nnx_node_items
from yax._src.ir import containers as _containers
from yax._src.ir.variables import key_name
from yax._src.trace.nnx_graph import (MODULE, VARIABLE, GraphNode, graph_nodes,
                                      is_graph_node, is_variable, node_kind,
                                      value_leaves)

try:  # flax.nnx is part of every supported Flax; stay importable without it
  from flax import nnx
except ImportError:  # pragma: no cover - flax without nnx
  nnx = None


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


def split_arguments(args, kwargs) -> tuple[list, Any, bool]:
  """``(leaves, treedef, has_nodes)`` of ``(args, kwargs)`` with the NNX
  graph nodes among them split together as ``nnx.split`` does (a shared
  module or variable is one leaf), each replaced by a ``GraphArgument``."""
  if GraphNode is None:
    return (*jtu.tree_flatten((args, kwargs)), False)
  leaves, treedef = jtu.tree_flatten((args, kwargs), is_leaf=is_graph_node)
  positions = [i for i, x in enumerate(leaves) if is_graph_node(x)]
  if not positions:
    # No graph node stopped the flatten: these are the plain leaves.
    return leaves, treedef, False
  nodes = tuple(leaves[i] for i in positions)
  hidden = _HiddenCaches()
  try:
    graphdef, state = (pytree_split(nodes, hidden)
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
    names = cached_names(type(module))
    if names:
      attrs = vars(module)
      self.taken += [(attrs, name, attrs.pop(name)) for name in names
                     if name in attrs]

  def restore(self) -> None:
    for attrs, name, value in reversed(self.taken):
      attrs[name] = value
    self.taken.clear()


_CACHED_NAMES: dict[type, tuple] = {}


def cached_names(ty: type) -> tuple:
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
    if kind == MODULE:
      hidden.hide(node)
  return nnx.split(nodes)


class PytreeGraph:
  """The ``graphdef`` of graph arguments split by :func:`pytree_split`:
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


def pytree_split(nodes: tuple, hidden: _HiddenCaches | None = None
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
    kind = node_kind(type(x))
    if kind == VARIABLE or kind == MODULE or is_graph_node(x):
      shared = shared or id(x) in seen
      seen.add(id(x))
      if kind == MODULE and hidden is not None:
        hidden.hide(x)  # (before the flatten reads its attributes)
    return kind == VARIABLE

  try:
    flat, treedef = jtu.tree_flatten_with_path(nodes, is_leaf=stop)
  except Exception:  # noqa: BLE001 - a node Flax flattens but JAX cannot
    return None
  if shared:
    return None
  nested: dict = {}
  for keypath, var in flat:
    if node_kind(type(var)) != VARIABLE:
      return None
    node = nested
    for k in keypath[:-1]:
      node = node.setdefault(key_name(k), {})
    node[key_name(keypath[-1])] = var
  state = nnx.State(nested)
  in_order = jtu.tree_leaves(state, is_leaf=is_variable)
  if len(in_order) != len(flat) or any(
      a is not b for a, (_, b) in zip(in_order, flat, strict=True)):
    return None
  return PytreeGraph(treedef), state


def flatten_arguments(args, kwargs):
  """``tree_flatten((args, kwargs))`` for ``eval_mox``, with NNX graph nodes
  split as when tracing."""
  leaves, treedef, _ = split_arguments(args, kwargs)
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


def _without_traced_caches(node, update):
  """``update`` (the state updates of graph node ``node``) less the caches
  computed in a transformation: a ``functools.cached_property`` value
  holding a tracer would outlive its trace (plain NNX leaks it there, and
  fails on the next call). The next replay computes the cache again, as
  the trace splits models without their caches (``_HiddenCaches``)."""
  names = cached_names(type(node)) if node_kind(
      type(node)) == MODULE else ()
  children = None
  kept = {}
  for key, value in update.items():
    if key in names and is_variable(value) and any(
        isinstance(x, jax.core.Tracer) for x in value_leaves(value)):
      continue
    if isinstance(value, Mapping):  # the updates of a child node
      if children is None:
        children = dict(nnx_node_items(node))
      child = children.get(key)
      if child is not None:
        value = _without_traced_caches(child, value)
    kept[key] = value
  return nnx.State(kept)


# ------------------------------------------------------------ rewrites

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


