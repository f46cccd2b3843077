"""Flax NNX modules: seen while tracing, replayed by ``eval_mox``.

NNX has no method interceptor like Linen's ``intercept_methods``. While a
trace runs, the methods of every ``nnx.Module`` subclass are wrapped at class
level (``nnx_patching.py``); the wrappers record a module call only on the
thread that is tracing, and the original methods are put back when the last
trace ends (see ``docs/design.md``, "NNX modules").

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
* ``eval_mox`` takes the same arguments and applies the state updates to
  the given modules, exactly as calling the model does
  (``nnx_arguments.flatten_arguments``/``apply_updates``).

The NNX frontend is five modules, by concern: this one (the per-trace index of modules and their paths ``_Context``, the Linen
``ToLinen`` bridge, :class:`TraceScope`); ``nnx_graph.py`` (what a value is
in the object graph, the walk ``nnx.split`` makes, static attributes);
``nnx_variables.py`` (typed Variables: variable trees, boxing, summary
groups); ``nnx_patching.py`` (module methods wrapped at class level
while a trace runs); ``nnx_arguments.py`` (graph nodes among the arguments: the split,
replay and state updates). Code outside ``trace/`` reaches them through
``trace/systems.py``.
"""

from __future__ import annotations

import functools
import operator
import sys
from typing import Any

import jax
from jax import tree_util as jtu

from yax._src.compat import nnx_node_items
from yax._src.ir.variables import key_name
from yax._src.trace import nnx_patching as _patching
from yax._src.trace.calls import is_traced_value, marked_call, recording
from yax._src.trace.nnx_arguments import (GraphArgument, NnxResult, PytreeGraph,
                                          split_arguments)
from yax._src.trace.nnx_graph import (LEAF, MODULE, NODE, VARIABLE, graph_nodes,
                                      holds_nothing, is_graph_node, is_variable,
                                      node_kind, raw_value, static_params,
                                      str_path, value_leaves)
from yax._src.trace.nnx_variables import cached_treedef, meta, nested_variables

try:  # flax.nnx is part of every supported Flax; stay importable without it
  from flax import nnx
except ImportError:  # pragma: no cover - flax without nnx
  nnx = None


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
        full = (*prefix, *str_path(path))
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
                               for x in value_leaves(var))

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
      src = sources.get(id(raw_value(var)))
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
      modules = [((), module)] if node_kind(type(module)) == MODULE else []
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
      kind = node_kind(type(child))
      if kind == LEAF or (kind != VARIABLE and id(child) in visited) or (
          kind == NODE and holds_nothing(child)):
        continue
      at = (*path, str(key))
      if kind == VARIABLE:
        if id(child) not in seen:
          seen.add(id(child))
          found.append((at, child, own))
      elif kind == MODULE and id(child) not in self.walking:
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
        self._collect(child, at, own and kind != MODULE, found, seen,
                      modules if kind != MODULE else [], visited)

  def variables(self, module) -> tuple[list, Any]:
    """(leaves, treedef) of every variable the module can read (its own
    and its submodules'), typed; the tree builder keeps those its body
    reads. Leaves in the order the ``VariableTree`` flattens: sorted paths."""
    entries = []
    for relpath, var, own in self.subtree(module):
      value = raw_value(var)
      if not is_traced_value(value):
        if jtu.tree_leaves(value) in ([], [value]):
          continue  # None, a Python number or string: static, not an input
        return nested_variables(self.subtree(module))  # a pytree value
      entries.append((relpath, value, meta(type(var), own)))
    entries.sort(key=_first)
    return ([value for _, value, _ in entries],
            cached_treedef(tuple((p, m) for p, _, m in entries)))

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
      params = self.params[id(module)] = static_params(module, path)
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
    ctx = getattr(_patching.current, 'ctx', None)
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
    self.leaves, self.in_tree, self.has_nodes = split_arguments(args, kwargs)
    self._saved = None
    self._patch = None

  def __enter__(self):
    if nnx is None:
      return self
    self._patch = _patching.patched_classes()
    self._patch.__enter__()
    self._saved = getattr(_patching.current, 'ctx', None)
    _patching.current.ctx = _Context()
    return self

  def __exit__(self, *exc):
    if nnx is None:
      return False
    _patching.current.ctx = self._saved
    self._patch.__exit__(*exc)
    return False

  def call(self, fn, args, kwargs):
    """Calls ``fn`` on copies of the argument graph nodes (merged from the
    traced state) and returns its result, with state updates if any."""
    ctx = _patching.current.ctx
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
    if isinstance(graphdef, PytreeGraph):  # (see ``pytree_split``)
      by_index = sorted(graphs, key=operator.attrgetter('index'))
      given = [var for g in by_index
               for var in jtu.tree_leaves(g.state, is_leaf=is_variable)]
      given_values = [value_leaves(var) for var in given]
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
    before = {path: value_leaves(var)
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
                 if not _same_leaves(old, value_leaves(var))]
      if changed:
        flat = jtu.tree_flatten_with_path(copies, is_leaf=is_variable)[0]
        for i in changed:
          path = tuple(key_name(k) for k in flat[i][0])
          updates[path[0]][path[1:]] = flat[i][1]
    else:
      # Every Variable of the copies after the call, at its nnx.split path
      # (created ones included), compared with what went in.
      for path, var, kind in graph_nodes(copies):
        if kind != VARIABLE:
          continue
        old = before.get(str_path(path))
        if old is None or not _same_leaves(old, value_leaves(var)):
          updates[path[0]][path[1:]] = var
    states = tuple(_nested_state(u) for u in updates)
    return NnxResult(out, states)


def _same_graph(copies, graphdef: PytreeGraph, given: list) -> bool:
  """Whether the copies still have the structure they were built with and
  hold the Variables they were given (so a pytree flatten sees every
  Variable a walk would)."""
  now, treedef = jtu.tree_flatten(copies, is_leaf=is_variable)
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
    paths.append(str_path(keys))
  return tuple(paths)


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
  return str_path(keys[1:])


