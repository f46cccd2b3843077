"""``yax.init_params``: the variables a rewritten tree expects and the given
params lack, initialised by the modules that declare them.

A replacement with variables (ReLU -> PReLU at two sites) makes the tree
read ``params['PReLU_0']['alpha']`` and ``params['PReLU_1']['alpha']``.
``init_params`` finds, for each such variable, the module call that
declares it, builds that module again from the fields the trace recorded
(a Linen dataclass; an NNX module whose ``__init__`` arguments are among
its recorded attributes, with ``rngs``) and runs its initialiser at that
site's shapes, with ``key`` folded by the variable's path. A variable a
tool added (a LoRA adapter, a quantization scale) is made by the record
that tool left on the call (``Mox.inits``); this module knows no tool.
Variables already in ``params`` are returned unchanged, in the same
containers.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir.arguments import boxed_like
from yax._src.ir.containers import is_record, set_many
from yax._src.ir.nodes import Mox, Symbol, iter_nodes
from yax._src.ir.variables import (NNX_GROUP, key_name, location, unboxed_path,
                                   var_entries)
from yax._src.rewrite.engine import collections_of
from yax._src.trace import systems as _systems


def _declared(mox: Mox) -> dict:
  """``(collection, *module path, name)`` -> the module call that declares
  the variable: the call that recorded how to make it (``Mox.inits``: a
  rewrite added it), else the first call in evaluation order that holds
  it as its own."""
  out = {}
  # A call that a later rewrite gave new variables (LoRA adapting a
  # quantized kernel in place, in its body) is rebuilt without its class,
  # its records kept: they count too.
  for node in iter_nodes(mox):
    if isinstance(node, Mox):
      for keys in node.inits or ():
        out.setdefault((keys[0], *node.path, *keys[1:]), node)
  nodes = [n for n in iter_nodes(mox)
           if isinstance(n, Mox) and not n.is_ephemeral]
  for node in nodes:
    for entry in var_entries(node):
      if len(entry.rel_path) == 1:
        out.setdefault(location(node, entry), node)
  return out


def _example_args(node: Mox):
  """Zeros of the call's argument shapes, static arguments as traced."""
  values = [jnp.zeros(s.aval.shape, s.aval.dtype) if s.aval is not None
            else s.value for s in node.arg_inputs]
  return jtu.tree_unflatten(node.in_tree, values)


def init_params(mox: Mox, params, *, key):
  """Returns ``params`` completed with every variable ``mox`` expects and
  ``params`` lacks.

  **Arguments:**
  - ``mox``: a tree, typically rewritten by ``yax.sub`` with a replacement
    that brings variables (``PReLU`` in place of ``relu``).
  - ``params``: the argument of the traced function that holds the
    variables (the Linen variables dict, an HF params tree, an
    ``nnx.State``).
  - ``key``: a PRNG key; each variable's initialiser gets it folded with
    the variable's path.

  **Returns:** ``params`` (same container types) with the missing
  variables, each initialised by the ``init`` of the module that declares
  it, at that site's shapes. Raises ``yax.SubstitutionError`` naming the
  path of a missing variable that no module can initialise.

  Example::

      new = yax.sub('//*[@name="relu"]', prelu_mox, mox)
      full = yax.init_params(new, variables, key=jax.random.key(0))
      y = yax.eval_mox(new, full, x)
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(
        f'init_params expects a Mox, found {type(mox).__name__}')
  prefixes = collections_of(mox)
  if not prefixes:
    raise SubstitutionError(
        'init_params found no variable collection among the traced '
        'arguments of this tree')
  where_arg = {tuple(p[:2]) for p in prefixes.values()}
  if len(where_arg) != 1:
    raise SubstitutionError(
        'init_params needs the variables in one argument of the traced '
        f'function; this tree reads them from {sorted(where_arg)}')
  (side, position), = where_arg
  args, kwargs = jtu.tree_unflatten(mox.in_tree, mox.inputs)
  expected = (args if side == 0 else kwargs)[position]
  flat_expected = jtu.tree_flatten_with_path(
      expected, is_leaf=lambda s: isinstance(s, Symbol))[0]
  # How the tree holds each NNX variable: its Variable type with the
  # metadata the rewrite gave it (a LoRAParam's axis names), which eval_mox
  # checks as static structure.
  boxes = {_keys(kp): jtu.tree_structure(v) for kp, v in
           jtu.tree_flatten_with_path(
               expected, is_leaf=_systems.is_typed_variable)[0]
           if _systems.is_typed_variable(v)}
  have = {_keys(kp) for kp, _ in jtu.tree_flatten_with_path(params)[0]}
  # How params hold a new variable: an NNX Variable in an NNX state, a
  # plain array in an Equinox model.
  box = _systems.new_variable_boxer(params)
  declared = _declared(mox)
  inside = {col: tuple(p[2:]) for col, p in prefixes.items()}
  cache, values = {}, []
  for keypath, sym in flat_expected:
    path = _keys(keypath)
    if path in have:
      continue
    col = next((c for c, pre in inside.items() if path[:len(pre)] == pre),
               None)
    # The variable's location: module paths and names are strings.
    loc = ((col, *map(str, path[len(inside[col]):])) if col is not None
           else None)
    node = declared.get(loc) if loc is not None else None
    where = 'params' + ''.join(f'[{k!r}]' for k in path)
    if node is None:
      raise SubstitutionError(
          f'init_params: the tree reads {where} ({sym.type_str}), which '
          'params lacks, and no module call of the tree declares it')
    folded = jax.random.fold_in(key, zlib.crc32('/'.join(loc).encode()))
    keys = (loc[0], *loc[1 + len(node.path):])  # relative to the call
    init = (node.inits or {}).get(keys)
    if init is not None:  # a rewrite's variable: a LoRA adapter, a scale
      values.extend(_recorded(node, init, keys, path, sym, folded, params,
                              where, boxes, box))
      continue
    if id(node) not in cache:
      made = _systems.new_module_variables(
          node.rebuild_ty, node.params, folded, _example_args(node),
          node.entrypoint or '__call__', where)
      if made is None:
        raise SubstitutionError(
            f'init_params: {where} is declared by {node.type_name} at path '
            f"{'/'.join(node.path) or '<root>'}, which is not a Flax module "
            'YAX can initialise')
      cache[id(node)] = made
    value = _lookup(cache[id(node)], loc, node, where, col == NNX_GROUP)
    if tuple(value.shape) != tuple(sym.aval.shape) or \
        value.dtype != sym.aval.dtype:
      raise SubstitutionError(
          f'init_params: {node.type_name}.init gives {where} as '
          f'{value.dtype}{list(value.shape)}, but the tree reads '
          f'{sym.type_str}')
    if col == NNX_GROUP and path in boxes:
      value = jtu.tree_unflatten(boxes[path], [value])
    elif col == NNX_GROUP:
      entry = next(e for e in var_entries(node)
                   if location(node, e) == loc)
      value = box(NNX_GROUP, entry.kind, value)
    values.append((path, value))
  return set_many(params, values)


def _recorded(node: Mox, init, keys, path, sym, key, params, where: str,
              boxes: dict, box):
  """``[(native key path, value), ...]`` that the record ``init`` of
  ``node`` (``Mox.inits``) makes for the variable at ``keys`` (relative to
  the call) whose native key path is ``path``: the other variables it
  reads and writes are at the same native prefix. ``boxes``: native key
  path -> how the tree holds an NNX variable there (type and metadata);
  ``box``: how params hold a new variable (``new_variable_boxer``)."""
  base = path[:len(path) - (len(keys) - 1)]
  native = lambda k: (*base, *k[1:])

  def read(k):
    try:
      value = _get(params, native(k))
    except (KeyError, IndexError, TypeError, AttributeError):
      raise SubstitutionError(
          f'init_params: {where} is made from '
          f"params{''.join(f'[{p!r}]' for p in native(k))}, which params "
          'lacks') from None
    return _systems.unboxed(value)

  try:
    made = init(key, sym.aval, read)
  except SubstitutionError as e:
    raise SubstitutionError(f'init_params: {where}: {e}') from None
  kinds = {e.keys: e.kind for e in var_entries(node)}
  out = []
  for k, value in made.items():
    try:
      old = _get(params, native(k))
    except (KeyError, IndexError, TypeError, AttributeError):
      old = None
    if old is not None:  # stored anew (a kernel quantized with its scale)
      out.append((native(k), boxed_like(old, value)))
    elif k[0] == NNX_GROUP and native(k) in boxes:
      out.append((native(k), jtu.tree_unflatten(boxes[native(k)], [value])))
    elif k[0] == NNX_GROUP:
      out.append((native(k), box(NNX_GROUP, kinds[k], value)))
    else:
      out.append((native(k), value))
  return out


def _get(tree, keys):
  for k in keys:  # an Equinox module's fields by name
    tree = getattr(tree, k) if is_record(tree) else tree[k]
  return tree


def _lookup(variables, loc, node: Mox, where: str, is_nnx: bool):
  """The array the module's init made for ``loc``."""
  name = loc[-1]
  if is_nnx:
    tree = variables
  else:
    tree = variables.get(loc[0], {})
  value = tree.get(name) if hasattr(tree, 'get') else None
  if value is None:
    raise SubstitutionError(
        f'init_params: {node.type_name}.init does not create {where} '
        f'(it creates {sorted(map(str, tree))})')
  return _systems.unboxed(value)


def _keys(keypath) -> tuple:
  """A params key path as its dict keys, attribute names and indices (the
  ``value`` field of an NNX Variable left out)."""
  return tuple(key_name(k) for k in unboxed_path(keypath))
