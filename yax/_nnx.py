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
* The method wrappers bind the boundary markers of ``_markers`` around each
  call and record a ``CallRecord``, so the tree builder of ``_trace`` makes
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
import threading
from typing import Any

import jax
import numpy as np
from jax import tree_util as jtu

from yax._calls import is_traced_value, marked_call, recording

try:  # flax.nnx is part of every supported Flax; stay importable without it
  from flax import nnx
except ImportError:  # pragma: no cover - flax without nnx
  nnx = None

_GraphNode = (getattr(nnx, 'Pytree', None) or getattr(nnx, 'Object', None)) \
    if nnx is not None else None


def is_graph_node(x) -> bool:
  """NNX modules and other graph objects (``nnx.Rngs``)."""
  return _GraphNode is not None and isinstance(x, _GraphNode)


def _is_variable(x) -> bool:
  return nnx is not None and isinstance(x, nnx.Variable)


# ------------------------------------------------------ typed variables

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
  tree = VariableTree(zip(keys, children))
  tree.kinds = kinds
  tree.flags = flags
  return tree


jtu.register_pytree_with_keys(VariableTree, _vt_flatten_with_keys,
                              _vt_unflatten, _vt_flatten)


def var_kinds(mox) -> list[str] | None:
  """Variable type names of a module call's variable inputs, if NNX."""
  n = mox.num_vars
  if not n:
    return None
  try:
    tree = jtu.tree_unflatten(mox.var_tree, [None] * n)
  except Exception:  # noqa: BLE001 - an unusual treedef: no kinds
    return None
  if isinstance(tree, VariableTree) and len(tree.kinds) == n:
    return list(tree.kinds)
  return None


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
    if not inspect.isfunction(value) or getattr(value, '_yax_original', None):
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


_SIMPLE = (bool, int, float, str, type, np.dtype)


def _static_params(module, path) -> dict:
  """A module's static attributes (no variables, submodules or arrays)."""
  params = {}
  for key, value in vars(module).items():
    if key.startswith('_'):
      continue
    if value is None or isinstance(value, _SIMPLE):
      params[key] = value
      continue
    if _is_variable(value) or is_graph_node(value):
      continue
    leaves = jtu.tree_leaves(
        value, is_leaf=lambda x: _is_variable(x) or is_graph_node(x))
    if any(_is_variable(x) or is_graph_node(x) or
           isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer))
           for x in leaves):
      continue
    params[key] = value
  if 'name' not in params:
    params = {'name': path[-1] if path else None, **params}
  return params


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
    self.params: dict[int, dict] = {}
    self.keep: list = []  # keeps ids valid for the trace's lifetime
    self.stack: list = []  # [(module, method name, path)]
    # id(traced value) -> path of its Variable among the traced arguments
    # (argument prefix, then the attribute path as ``nnx.state`` shows it).
    self.sources: dict[int, tuple] = {}

  def register(self, root, prefix: tuple, tag: bool = False) -> None:
    """Gives every module under ``root`` not seen yet its first path.

    With ``tag``, the path is also stored on each module as a static
    attribute (``_yax_path``): NNX transforms (``nnx.scan``, ``nnx.vmap``,
    ``nnx.remat``, ``nnx.jit``) carry static attributes into the copies they
    merge inside their bodies, so calls on those copies get the right path.
    Only modules this trace created are tagged, never the user's objects.
    """
    for path, node in nnx.iter_graph(root):
      if isinstance(node, nnx.Module) and id(node) not in self.paths:
        full = vars(node).get(_TAG, (*prefix, *_str_path(path)))
        self.paths[id(node)] = full
        self.taken.add(full)
        self.keep.append(node)
        if tag and _TAG not in vars(node):
          object.__setattr__(node, _TAG, full)

  def path_of(self, module) -> tuple:
    path = self.paths.get(id(module))
    if path is not None:
      return path
    path = vars(module).get(_TAG)
    if path is None:
      path = self._path_from_sources(module)
    if path is None:  # reached through a closure, or built in the call
      name = type(module).__name__
      path, k = ('<closure>', name), 0
      while path in self.taken:
        k += 1
        path = ('<closure>', f'{name}_{k}')
    self.register(module, path, tag=_created_by_trace(module))
    return self.paths[id(module)]

  def _path_from_sources(self, module) -> tuple | None:
    for relpath, var, _ in self.subtree(module):
      src = self.sources.get(id(_raw_value(var)))
      n = len(relpath)
      if src is not None and len(src) >= n and src[len(src) - n:] == relpath:
        return src[:len(src) - n]
    return None

  def subtree(self, module) -> list:
    """``[(relative path, Variable, own)]`` for every Variable reachable
    from ``module`` (its own and its submodules'), each once, at its first
    path as ``nnx.state(module)`` shows it; ``own`` is False for a
    Variable that lives in a submodule."""
    found = self.subtrees.get(id(module))
    if found is None:
      items = [(tuple(p), n) for p, n in nnx.iter_graph(module)]
      modules = {p for p, n in items if isinstance(n, nnx.Module)}
      found = [(_str_path(p), n,
                not any(p[:i] in modules for i in range(1, len(p))))
               for p, n in items if _is_variable(n)]
      self.subtrees[id(module)] = found
      self.keep.append(module)
    return found

  def variables(self, module) -> tuple[list, Any]:
    """(leaves, treedef) of every variable the module can read (its own
    and its submodules'), typed; the tree builder keeps those its body
    reads."""
    nested: dict = {}
    meta_at: dict[tuple, tuple] = {}
    for relpath, var, own in self.subtree(module):
      node = nested
      for key in relpath[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
          break
      else:
        node[relpath[-1]] = _raw_value(var)
        meta_at[relpath] = (type(var).__name__,
                            isinstance(var, nnx.Param), own)
    flat = jtu.tree_flatten_with_path(VariableTree(nested))[0]
    leaves, metas = [], []
    for keypath, leaf in flat:
      if not is_traced_value(leaf):
        continue
      keys = tuple(str(_key(k)) for k in keypath)
      meta = next((meta_at[keys[:i]] for i in range(len(keys), 0, -1)
                   if keys[:i] in meta_at), ('', False, True))
      leaves.append(leaf)
      metas.append(meta)
    return leaves, variable_treedef([(tuple(str(_key(k)) for k in kp), m)
                                     for (kp, leaf), m in zip(
                                         [f for f in flat
                                          if is_traced_value(f[1])], metas,
                                         strict=True)])

  def call(self, module, name, fn, args, kwargs):
    top = self.stack[-1] if self.stack else None
    if not recording() or (top is not None and top[0] is module
                           and top[1] == name):
      return fn(module, *args, **kwargs)  # not recording, or a super() call
    path = self.path_of(module)
    params = self.params.get(id(module))
    if params is None:
      params = self.params[id(module)] = _static_params(module, path)
    var_leaves, var_tree = self.variables(module)
    self.stack.append((module, name, path))
    try:
      return marked_call(type(module), name, params, path, var_leaves,
                         var_tree, lambda *a, **k: fn(module, *a, **k),
                         args, kwargs, is_leaf=is_graph_node)
    finally:
      self.stack.pop()


_TAG = '_yax_path'


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
  order = [tuple(str(_key(k)) for k in kp)
           for kp, _ in jtu.tree_flatten_with_path(tree)[0]]
  tree.kinds = tuple(by_path[p][0] for p in order)
  tree.flags = tuple(by_path[p][1:] for p in order)
  return jtu.tree_structure(tree)


def read_only(var_tree, var_inputs, reads) -> tuple[list, Any]:
  """An NNX call's variables narrowed to those its body reads."""
  tree = jtu.tree_unflatten(var_tree, var_inputs)
  flat = jtu.tree_flatten_with_path(tree)[0]
  entries, leaves = [], []
  for (keypath, sym), kind, flags in zip(flat, tree.kinds, tree.flags,
                                         strict=True):
    if sym in reads:
      entries.append((tuple(str(_key(k)) for k in keypath), (kind, *flags)))
      leaves.append(sym)
  if not entries:
    return [], jtu.tree_structure(VariableTree())
  return leaves, variable_treedef(entries)


def _created_by_trace(module) -> bool:
  """True when every variable of ``module`` holds a tracer: a module merged
  or built inside the traced function (the split form), not a user's
  object captured by the function."""
  leaves = jtu.tree_leaves(nnx.state(module))
  return bool(leaves) and all(isinstance(x, jax.core.Tracer) for x in leaves)


def _key(k):
  for field in ('key', 'name', 'idx'):
    if hasattr(k, field):
      return getattr(k, field)
  return k


def _raw_value(var):
  """A Variable's value as stored (no ``on_get_value`` hooks, no warning)."""
  return jtu.tree_leaves(var, is_leaf=lambda x: x is not var)[0]


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
  return GraphArgument(graphdef, index, nnx.State(dict(zip(keys, children))))


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


def _split_arguments(args, kwargs):
  """(args, kwargs) with graph nodes replaced by ``GraphArgument`` s, the
  nodes in order, and their key paths; ``None`` when there are none."""
  if _GraphNode is None:
    return None
  leaves, treedef = jtu.tree_flatten((args, kwargs), is_leaf=is_graph_node)
  positions = [i for i, x in enumerate(leaves) if is_graph_node(x)]
  if not positions:
    return None
  nodes = [leaves[i] for i in positions]
  graphdef, state = nnx.split(tuple(nodes))
  leaves = list(leaves)
  for k, i in enumerate(positions):
    sub = state[k] if k in state else nnx.State({})
    leaves[i] = GraphArgument(graphdef, k, sub)
  return jtu.tree_unflatten(treedef, leaves), nodes, positions, treedef


def flatten_arguments(args, kwargs):
  """``tree_flatten((args, kwargs))`` for ``eval_mox``, with NNX graph nodes
  split as when tracing."""
  split = _split_arguments(args, kwargs)
  if split is None:
    return jtu.tree_flatten((args, kwargs))
  return jtu.tree_flatten(split[0])


def apply_updates(result, args, kwargs):
  """The traced function's output; state updates applied to the modules."""
  if not isinstance(result, NnxResult):
    return result
  leaves = jtu.tree_leaves((args, kwargs), is_leaf=is_graph_node)
  nodes = [x for x in leaves if is_graph_node(x)]
  if len(nodes) > 1:  # apply all at once: shared variables live in one place
    nnx.update(tuple(nodes), nnx.State(
        {k: u for k, u in enumerate(result.updates) if len(u)}))
  elif nodes and len(result.updates[0]):
    nnx.update(nodes[0], result.updates[0])
  return result.output


def _flat_variables(state) -> dict:
  """{path: Variable} of a state."""
  out = {}
  for keypath, var in jtu.tree_flatten_with_path(
      state, is_leaf=_is_variable)[0]:
    out[tuple(_key(k) for k in keypath)] = var
  return out


class TraceScope:
  """The NNX side of one ``make_mox`` trace.

  ``leaves``/``in_tree`` flatten the arguments (graph nodes split as
  ``nnx.split`` does); use the scope as a context manager around the traced
  call (module methods are wrapped while it is active on this thread) and
  call the function with :meth:`call`.
  """

  def __init__(self, args, kwargs):
    split = None if nnx is None else _split_arguments(args, kwargs)
    self.has_nodes = split is not None
    tree = (args, kwargs) if split is None else split[0]
    self.leaves, self.in_tree = jtu.tree_flatten(tree)
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
    prefixes = _model_prefixes(args, kwargs)
    for prefix, container in prefixes:
      state = container.state if isinstance(container, GraphArgument) \
          else container
      for keypath, leaf in jtu.tree_flatten_with_path(state)[0]:
        keys = [_key(k) for k in keypath]
        if keys and keys[-1] == 'value':  # the Variable's own value field
          keys = keys[:-1]
        ctx.sources.setdefault(id(leaf), (*prefix, *_str_path(keys)))
    if not self.has_nodes:
      return fn(*args, **kwargs)
    leaves, treedef = jtu.tree_flatten(
        (args, kwargs), is_leaf=lambda x: isinstance(x, GraphArgument))
    positions = [i for i, x in enumerate(leaves)
                 if isinstance(x, GraphArgument)]
    graphs = [leaves[i] for i in positions]
    graphdef = graphs[0].graphdef
    state = nnx.State({g.index: g.state for g in graphs})
    copies = nnx.merge(graphdef, state)
    leaves = list(leaves)
    for i, g in zip(positions, graphs, strict=True):
      leaves[i] = copies[g.index]
    prefix_of = {id(c): p for p, c in prefixes}
    for g in graphs:
      ctx.register(copies[g.index], prefix_of[id(g)], tag=True)
    before = _flat_variables(state)
    before_leaves = {p: jtu.tree_leaves(v) for p, v in before.items()}
    a, k = jtu.tree_unflatten(treedef, leaves)
    out = fn(*a, **k)
    _, after = nnx.split(copies)
    updates = [dict() for _ in graphs]
    for path, var in _flat_variables(after).items():
      old = before_leaves.get(path)
      new = jtu.tree_leaves(var)
      if old is not None and len(old) == len(new) and all(
          x is y for x, y in zip(old, new)):
        continue
      updates[path[0]][path[1:]] = var
    states = tuple(_nested_state(u) for u in updates)
    return NnxResult(out, states)


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
  keys = [_key(k) for k in keypath]
  return _str_path(keys[1:])


# ---------------------------------------------------------------- LoRA

def is_nnx_tree(mox) -> bool:
  """True for a tree traced from NNX modules (either form)."""
  from yax._ir import Mox, iter_nodes
  if mox.in_tree is not None and _has_graph_argument(mox):
    return True
  for node in iter_nodes(mox):
    if isinstance(node, Mox) and not node.is_ephemeral and node.num_vars:
      return var_kinds(node) is not None
  return False


def _has_graph_argument(mox) -> bool:
  try:
    tree = jtu.tree_unflatten(mox.in_tree, [None] * len(mox.inputs))
  except Exception:  # noqa: BLE001
    return False
  return any(isinstance(x, GraphArgument) for x in jtu.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, GraphArgument)))


def _rename_output(node, old, new):
  """A copy of module call ``node`` whose body defines ``new`` instead of
  ``old`` (and returns it)."""
  from yax._ir import Mox
  sub = lambda syms: [new if s is old else s for s in syms]

  def copy(n):
    if isinstance(n, Mox):
      return n.replace(inputs=sub(n.inputs), outputs=sub(n.outputs),
                       children=[copy(c) for c in n.children])
    return n.replace(inputs=sub(n.inputs), outputs=sub(n.outputs))
  return copy(node)


@functools.lru_cache(maxsize=64)
def _adapter(x_shape, x_dtype, y_shape, y_dtype, d_in, d_out, rank, dtype,
             scale):
  from yax._trace import make_mox

  def adapter(y, x, a, b):
    return y + (scale * ((x.astype(dtype) @ a) @ b)).astype(y.dtype)
  spec = jax.ShapeDtypeStruct
  return make_mox(adapter)(spec(y_shape, y_dtype), spec(x_shape, x_dtype),
                           spec((d_in, rank), dtype), spec((rank, d_out), dtype))


def _lora_node(node, rank, alpha):
  """(LoRA module call wrapping ``node``, lora_a Var, lora_b Var)."""
  from yax._errors import SubstitutionError
  from yax._ir import Literal, Mox, Var
  from yax._lora import LoRA
  where = f"'{'/'.join(node.path) or '<root>'}'"
  tree = jtu.tree_unflatten(node.var_tree, node.var_inputs)
  kernel = tree.get('kernel') if isinstance(tree, dict) else None
  if kernel is None or kernel.aval is None or kernel.aval.ndim != 2:
    found = ', '.join(f'{k}: {v.type_str}' for k, v in (
        tree.items() if isinstance(tree, dict) else ()) if hasattr(v, 'aval'))
    raise SubstitutionError(
        f'lora expects Linear-like module calls (a 2-D kernel [in, out]); the '
        f'{node.type_name or "ephemeral"} call at path {where} has variables '
        f'[{found or "none"}]')
  if 'lora_a' in tree:
    raise SubstitutionError(f'lora: the module call at path {where} already '
                            'has an adapter')
  xs = [s for s in node.arg_inputs if not isinstance(s, Literal)]
  ys = [s for s in node.outputs if not isinstance(s, Literal)]
  d_in, d_out = kernel.aval.shape
  if (len(xs) != 1 or len(ys) != 1 or xs[0].aval.shape[-1:] != (d_in,)
      or ys[0].aval.shape[-1:] != (d_out,)):
    raise SubstitutionError(
        f'lora expects a module call with one input [..., {d_in}] and one '
        f'output [..., {d_out}]; the call at path {where} takes '
        f'({", ".join(s.type_str for s in xs)}) and returns '
        f'({", ".join(s.type_str for s in ys)})')
  x, y = xs[0], ys[0]
  dtype = kernel.aval.dtype
  adapter = _adapter(tuple(x.aval.shape), x.aval.dtype, tuple(y.aval.shape),
                     y.aval.dtype, d_in, d_out, rank, dtype, alpha / rank)
  a = Var(jax.core.ShapedArray((d_in, rank), dtype))
  b = Var(jax.core.ShapedArray((rank, d_out), dtype))
  inner_y = Var(y.aval)
  inner = _rename_output(node, y, inner_y)
  y_in, x_in, a_in, b_in = adapter.inputs
  wiring = {y_in: inner_y, x_in: x, a_in: a, b_in: b,
            adapter.outputs[0]: y}
  children = [inner]
  for eqn in adapter.children:
    outs = [wiring.setdefault(s, Var(s.aval)) for s in eqn.outputs]
    children.append(eqn.replace(inputs=[wiring.get(s, s) for s in eqn.inputs],
                                outputs=outs))
  var_dict = VariableTree({**tree, 'lora_a': a, 'lora_b': b})
  kinds = dict(zip(sorted(tree), var_kinds(node) or ()))  # flat trees only
  var_dict.kinds = tuple(kinds.get(k, 'Param') for k in sorted(var_dict))
  var_inputs, var_tree = jtu.tree_flatten(
      var_dict, is_leaf=lambda s: isinstance(s, (Var, Literal)))
  lora_node = Mox(var_inputs + list(node.arg_inputs), list(node.outputs),
                  {'name': node.name, 'rank': rank, 'alpha': alpha,
                   'base': node.type_name},
                  children=children, module_ty=LoRA, entrypoint='__call__',
                  path=node.path, in_tree=node.in_tree, out_tree=node.out_tree,
                  var_tree=var_tree)
  return lora_node, a, b


def _state_key(mapping, name: str):
  for k in mapping.keys():
    if str(k) == name:
      return k
  return None


def lora(mox, params, selection, *, rank: int, alpha: float, key):
  """``yax.lora`` for trees traced from NNX modules (see ``yax.lora``).

  ``params`` is the ``nnx.State`` the traced function took (the split form,
  ``make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)``). Returns a
  ``LoraResult`` whose ``params`` is that state with ``lora_a``/``lora_b``
  ``nnx.Param`` s next to each adapted kernel.
  """
  from yax._errors import SubstitutionError
  from yax._ir import Mox, iter_nodes
  from yax._lora import LoraResult
  from yax._sub import resolve_targets
  if _has_graph_argument(mox):
    raise SubstitutionError(
        'lora on an NNX tree needs the split form, where the parameters are '
        'an argument: graphdef, state = nnx.split(model); mox = '
        'yax.make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, x); '
        'res = yax.lora(mox, state, ...)')
  if not isinstance(params, nnx.State):
    raise SubstitutionError(
        f'lora on an NNX tree expects the traced nnx.State as params, found '
        f'{type(params).__name__}')
  if selection == '//module_call[@type="Dense"]':  # yax.lora's default
    selection = '//module_call[@type="Linear"]'
  targets = list(resolve_targets(selection, mox))
  if not targets:
    raise SubstitutionError(f'lora: {selection!r} matched no module call')
  # Where the state sits among the root arguments.
  root_args = jtu.tree_unflatten(mox.in_tree, mox.inputs)
  position = None
  for which, group in enumerate(root_args):
    items = enumerate(group) if which == 0 else group.items()
    for name, arg in items:
      if isinstance(arg, nnx.State) and (
          jtu.tree_structure(arg) == jtu.tree_structure(params)):
        position = (which, name)
        break
    if position is not None:
      break
  if position is None:
    raise SubstitutionError(
        'lora: `params` must be the nnx.State the traced function took as an '
        f'argument; none of the traced arguments has its structure '
        f'({jtu.tree_structure(params)})')
  # Targets must be module calls of this tree, outside equation bodies.
  top_level, parents = set(), {}
  stack = [mox]
  while stack:
    node = stack.pop()
    if isinstance(node, Mox):
      for child in node.children:
        parents[id(child)] = node
        if isinstance(child, Mox):
          top_level.add(id(child))
          stack.append(child)
  all_ids = {id(n) for n in iter_nodes(mox)}
  for node in targets:
    if not isinstance(node, Mox) or node.is_ephemeral or id(node) not in all_ids:
      raise SubstitutionError(
          f'lora selects module calls of this tree, but {selection!r} '
          f'matched {node!r}')
    if id(node) not in top_level:
      raise SubstitutionError(
          f"lora on NNX trees adapts module calls outside lifted transforms; "
          f"the call at path '{'/'.join(node.path)}' is inside the body of an "
          "equation (nnx.scan, nnx.jit, nnx.remat ...)")
  paths = {}
  for node in targets:
    for other in targets:
      if other is not node and _is_ancestor(other, node, parents):
        raise SubstitutionError(
            f"lora: the selection matched the call at path "
            f"'{'/'.join(node.path)}' and its ancestor at "
            f"'{'/'.join(other.path)}'")
  new_nodes, new_vars = {}, {}
  for node in targets:
    lora_node, a, b = _lora_node(node, rank, alpha)
    new_nodes[id(node)] = lora_node
    if node.path in paths:  # a module called twice: one adapter
      a0, b0 = paths[node.path]
      lora_node = _rename_vars(lora_node, {a: a0, b: b0})
      new_nodes[id(node)] = lora_node
    else:
      paths[node.path] = (a, b)

  def rebuild(node):
    if id(node) in new_nodes:
      return new_nodes[id(node)]
    if not isinstance(node, Mox):
      return node
    children = [rebuild(c) for c in node.children]
    if all(x is y for x, y in zip(children, node.children)):
      return node
    return node.replace(children=children)

  children = [rebuild(c) for c in mox.children]

  # New root arguments: the state with the adapters at each module's path.
  key = jax.random.key(0) if key is None else key
  sym_state = root_args[position[0]][position[1]]
  new_params, mask = params, jax.tree.map(lambda _: False, params)
  added = []
  for path, (a, b) in paths.items():
    key, sub_key = jax.random.split(key)
    d_in = a.aval.shape[0]
    a_value = (jax.random.normal(sub_key, a.aval.shape, a.aval.dtype)
               / jnp_sqrt(d_in, a.aval.dtype))
    b_value = np.zeros(b.aval.shape, b.aval.dtype)
    keys = _state_keys(params, path)
    for name, sym, value in (('lora_a', a, a_value), ('lora_b', b, b_value)):
      sym_state = _state_insert(sym_state, keys, name, _param_like(sym))
      new_params = _state_insert(new_params, keys, name, nnx.Param(
          jax.numpy.asarray(value)))
      mask = _state_insert(mask, keys, name, nnx.Param(True))
    added.append(keys)
  args, kwargs = root_args
  if position[0] == 0:
    args = tuple(sym_state if i == position[1] else x
                 for i, x in enumerate(args))
  else:
    kwargs = {**kwargs, position[1]: sym_state}
  from yax._ir import Symbol
  inputs, in_tree = jtu.tree_flatten(
      (args, kwargs), is_leaf=lambda s: isinstance(s, Symbol))
  new_mox = mox.replace(inputs=inputs, in_tree=in_tree, children=children)
  scale = alpha / rank

  def merge(trained):
    """Folds ``kernel + (alpha/rank) * lora_a @ lora_b`` into each adapted
    kernel and returns a state for the ORIGINAL tree (adapters removed)."""
    out = trained
    for keys in added:
      module = _state_get(out, keys)
      a, b, kernel = (_value_of(module[k]) for k in ('lora_a', 'lora_b',
                                                      'kernel'))
      merged = {k: v for k, v in _raw(module).items()
                if k not in ('lora_a', 'lora_b')}
      merged['kernel'] = nnx.Param((kernel + scale * (a @ b)).astype(
          kernel.dtype))
      out = _state_replace(out, keys, merged)
    return out

  return LoraResult(new_mox, new_params, mask, merge,
                    [tuple(map(str, k)) for k in added])


def _value_of(x):
  return _raw_value(x) if _is_variable(x) else x


def jnp_sqrt(n, dtype):
  return jax.numpy.sqrt(jax.numpy.asarray(n, dtype))


def _is_ancestor(a, b, parents) -> bool:
  node = parents.get(id(b))
  while node is not None:
    if node is a:
      return True
    node = parents.get(id(node))
  return False


def _rename_vars(node, mapping):
  from yax._ir import Mox
  sub = lambda syms: [mapping.get(s, s) for s in syms]

  def copy(n):
    if isinstance(n, Mox):
      return n.replace(inputs=sub(n.inputs), outputs=sub(n.outputs),
                       children=[copy(c) for c in n.children])
    return n.replace(inputs=sub(n.inputs), outputs=sub(n.outputs))
  return copy(node)


def _param_like(sym):
  """An ``nnx.Param`` holding a symbol (built without running its init)."""
  treedef = jtu.tree_structure(nnx.Param(np.zeros((), np.float32)))
  return jtu.tree_unflatten(treedef, [sym])


def _state_keys(state, path) -> tuple:
  keys, node = [], state
  for name in path:
    k = _state_key(node, name)
    if k is None:
      from yax._errors import SubstitutionError
      raise SubstitutionError(
          f"lora: the state has no entry for module path '{'/'.join(path)}'")
    keys.append(k)
    node = node[k]
  return tuple(keys)


def _state_get(state, keys):
  for k in keys:
    state = state[k]
  return state


def _raw(state) -> dict:
  """A state's nested mapping as stored (inner levels are plain dicts)."""
  if isinstance(state, nnx.State):
    return dict(state.raw_mapping)
  return dict(state)


def _at_top(state, raw: dict):
  return nnx.State(raw) if isinstance(state, nnx.State) else raw


def _raw_insert(raw: dict, keys, name, value) -> dict:
  if not keys:
    return {**raw, name: value}
  k = keys[0]
  return {**raw, k: _raw_insert(_raw(raw[k]), keys[1:], name, value)}


def _raw_replace(raw: dict, keys, value) -> dict:
  if len(keys) == 1:
    return {**raw, keys[0]: value}
  k = keys[0]
  return {**raw, k: _raw_replace(_raw(raw[k]), keys[1:], value)}


def _state_insert(state, keys, name, value):
  """A copy of ``state`` with ``value`` at ``keys + (name,)``."""
  return _at_top(state, _raw_insert(_raw(state), keys, name, value))


def _state_replace(state, keys, value):
  return _at_top(state, _raw_replace(_raw(state), keys, value))


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
  paths = ['/'.join(str(_key(k)) for k in kp)
           for kp, _ in jtu.tree_flatten_with_path(tree)[0]]
  out: dict = {}
  for path, sym, (kind, is_param, own) in zip(
      paths, mox.var_inputs, _metas(mox), strict=True):
    if own:
      out.setdefault(_group(kind, is_param), {})[path] = sym
  return out
