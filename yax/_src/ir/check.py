"""Invariant checker for module expressions (the MoX analogue of check_jaxpr).

Checks, for every node:

* **scopes**: the root and each body of an equation (``nn.scan``,
  ``nn.remat``, ``nn.jit`` ...) is a scope of its own, as in a Jaxpr: its
  constants and inputs are defined in it, and a symbol defined in a body is
  not visible outside it (nor one of the outside inside it). Module calls
  are not scopes: their inputs and outputs are symbols of the enclosing one;
* a symbol is defined once and read only after its definition;
* **variables**: every module call is a variable scope, for every module
  system and inside every body: a variable (a symbol some call lists among
  its variable inputs) defined before a call starts and read under it is
  among the call's inputs;
* a module call's ``inputs`` are its ``var_tree`` leaves then its
  ``in_tree`` leaves, its ``outputs`` the leaves of ``out_tree``, and its
  outputs are defined by the time the call ends;
* an equation has one body form and key per body, and its bodies have as
  many inputs and outputs as it passes in and gets back (by type);
* **types**: each equation's outputs are what its primitive computes from
  its inputs (JAX's own type checker run on ``to_jaxpr(mox)``, so bodies
  and their primitives' rules are checked too); each constant value and
  each array literal has the shape and dtype of its symbol.

Before any of this, the **structure** is checked: every node is a ``Mox``
or an ``Equation`` with each field of the kind the data model says (lists
of ``Symbol`` s, a dict of params, ``PyTreeDef`` s, a tuple of strings for a
path, a JAX primitive ...), and no node holds itself. Whatever the tree,
``check_mox`` returns or raises :class:`InvariantError`, never another
exception: one that escapes a check on a tree built in some unforeseen way
is reported as an ``InvariantError`` too (with the original as its cause).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core as jex

from yax._src.errors import YaxError
from yax._src.ir import lower as _lower
from yax._src.ir.nodes import Equation, Expr, Literal, Mox, Symbol, Var
from yax._src.ir.variables import var_entries


class InvariantError(YaxError):
  """A module expression breaks one of its structural invariants."""


def _where(node, path=()) -> str:
  try:
    if isinstance(node, Mox):
      return (f"module_call {node.type_name or '(ephemeral)'} at path "
              f"'{'/'.join(node.path) or '<root>'}'")
    inside = f" in the module call at path '{'/'.join(path)}'" if path else ''
    return f'equation {node.prim.name}{inside}'
  except Exception:  # noqa: BLE001 - a malformed node: name its class only
    return f'a {type(node).__name__} node'


def _short(value, limit: int = 120) -> str:
  try:
    text = repr(value)
  except Exception:  # noqa: BLE001 - an object whose repr fails
    text = f'<{type(value).__name__} object>'
  text = ' '.join(text.split())
  return text if len(text) <= limit else text[:limit - 3] + '...'


class _Scope:
  def __init__(self, owner: str, outer: '_Scope | None'):
    self.owner = owner
    self.defined: set[Symbol] = set()
    self.outer = outer

  def visible_elsewhere(self, sym) -> str | None:
    scope = self.outer
    while scope is not None:
      if sym in scope.defined:
        return scope.owner
      scope = scope.outer
    return None


def check_mox(mox: Mox, *, types: bool = True) -> None:
  """Raises ``InvariantError`` naming the node when ``mox`` is malformed.

  **Arguments:**
  - ``mox``: a tree from ``make_mox`` or a rewrite (or built any other way:
    whatever it holds, the result is a return or an ``InvariantError``).
  - ``types``: also type-check every equation (JAX's ``check_jaxpr`` on
    ``yax.to_jaxpr(mox)``) and every constant; ``False`` checks the
    structure and scopes only.
  """
  if not isinstance(mox, Mox):
    raise InvariantError(f'check_mox expects a Mox, found {type(mox).__name__}')
  try:
    _check_structure(mox)
    _check_scopes(mox)
    if types:
      _check_constants(mox)
      _check_types(mox)
  except InvariantError:
    raise
  except RecursionError:
    raise InvariantError(
        'the tree is nested too deeply to be checked') from None
  except Exception as e:  # noqa: BLE001 - any tree gives an InvariantError
    raise InvariantError(
        f'the tree is malformed: checking it raised {type(e).__name__}: '
        f'{_short(_message(e), 300)}') from e


def _message(e: BaseException) -> str:
  try:
    return str(e)
  except Exception:  # noqa: BLE001 - an exception whose str fails
    return type(e).__name__


# ------------------------------------------------------------- structure

_TREEDEF = type(jax.tree_util.tree_structure(()))
_FORMS = (_lower.CLOSED, _lower.OPEN)


def _aval_problem(aval) -> str | None:
  """Why ``aval`` is not an abstract array value, or None."""
  shape = getattr(aval, 'shape', None)
  if not isinstance(shape, tuple):
    return f'an aval without a shape tuple ({_short(aval)})'
  # Dimensions are ints, or JAX's symbolic dimensions (shape polymorphism).
  if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool)
             or type(d).__module__.startswith('jax') for d in shape):
    return f'an aval with an odd shape {_short(shape)}'
  dtype = getattr(aval, 'dtype', None)
  try:
    if not (isinstance(dtype, np.dtype) or jax.dtypes.issubdtype(
        dtype, jax.dtypes.extended)):
      return f'an aval with an odd dtype {_short(dtype)}'
  except Exception:  # noqa: BLE001 - not a dtype at all
    return f'an aval with an odd dtype {_short(dtype)}'
  if not callable(getattr(aval, 'str_short', None)):
    return f'an odd aval {_short(aval)}'
  return None


def _symbol_problem(sym) -> str | None:
  """Why ``sym`` is not a well-formed symbol, or None."""
  if not isinstance(sym, Symbol):
    return f'{_short(sym)} (a {type(sym).__name__}), not a Symbol'
  if not hasattr(sym, 'aval'):
    return f'a {type(sym).__name__} without an aval'
  if isinstance(sym, Literal):
    if not hasattr(sym, 'value'):
      return 'a Literal without a value'
    if sym.aval is None:
      return None
    why = _aval_problem(sym.aval)
    if why:
      return f'a Literal with {why}'
    return None
  if not isinstance(sym, Var):
    return f'a {type(sym).__name__}, neither a Var nor a Literal'
  if not isinstance(getattr(sym, 'dropped', None), (bool, np.bool_)):
    return 'a Var without a bool dropped flag'
  why = _aval_problem(sym.aval)
  return f'a {type(sym).__name__} with {why}' if why else None


def _check_symbols(node, field: str, where: str, *, variables=False):
  value = getattr(node, field)
  if not isinstance(value, (list, tuple)):
    raise InvariantError(f'{where} has {field} {_short(value)} (a '
                         f'{type(value).__name__}), not a list of symbols')
  for i, sym in enumerate(value):
    why = _symbol_problem(sym)
    if why is None and variables and isinstance(sym, Literal):
      why = 'a Literal, not a Var'
    if why:
      raise InvariantError(f'{where}: {field}[{i}] is {why}')


_MOX_FIELDS = ('inputs', 'outputs', 'params', 'children', 'module_ty',
               'entrypoint', 'path', 'in_tree', 'out_tree', 'var_tree',
               'constvars', 'consts', 'debug_info')
_EQN_FIELDS = ('inputs', 'outputs', 'params', 'prim', 'children',
               'body_keys', 'body_forms', 'effects', 'source_info', 'ctx')


def _check_node_fields(node, where: str):
  is_mox = isinstance(node, Mox)
  for field in (_MOX_FIELDS if is_mox else _EQN_FIELDS):
    if not hasattr(node, field):
      raise InvariantError(f'{where} has no {field!r} field')
  _check_symbols(node, 'inputs', where)
  _check_symbols(node, 'outputs', where)
  if not isinstance(node.params, dict):
    raise InvariantError(f'{where} has params {_short(node.params)}, not a '
                         'dict')
  if not isinstance(node.children, (list, tuple)):
    raise InvariantError(f'{where} has children {_short(node.children)}, '
                         'not a list of nodes')
  if is_mox:
    if node.module_ty is not None and not isinstance(node.module_ty, type):
      raise InvariantError(f'{where} has module_ty {_short(node.module_ty)}, '
                           'not a class or None')
    if node.entrypoint is not None and not isinstance(node.entrypoint, str):
      raise InvariantError(f'{where} has entrypoint '
                           f'{_short(node.entrypoint)}, not a str or None')
    if not isinstance(node.path, tuple) or not all(
        isinstance(p, str) for p in node.path):
      raise InvariantError(f'{where} has path {_short(node.path)}, not a '
                           'tuple of str')
    if not isinstance(node.var_tree, _TREEDEF):
      raise InvariantError(f'{where} has var_tree {_short(node.var_tree)}, '
                           'not a PyTreeDef')
    for field in ('in_tree', 'out_tree'):
      value = getattr(node, field)
      if value is not None and not isinstance(value, _TREEDEF):
        raise InvariantError(f'{where} has {field} {_short(value)}, not a '
                             'PyTreeDef or None')
    _check_symbols(node, 'constvars', where, variables=True)
    if not isinstance(node.consts, (list, tuple)):
      raise InvariantError(f'{where} has consts {_short(node.consts)}, not a '
                           'list')
    for child in node.children:
      if not isinstance(child, Expr) or not isinstance(child, (Mox, Equation)):
        raise InvariantError(f'{where} has a child {_short(child)} that is '
                             'not a Mox or an Equation')
    inits = getattr(node, 'inits', None)
    if inits:  # records of new variables: each of a variable of the call
      have = {e.keys for e in var_entries(node)}
      for keys, init in inits.items():
        if keys not in have or not callable(init):
          raise InvariantError(
              f'{where} records how to make the variable {_short(keys)}, '
              + ('which it does not read' if keys not in have else
                 f'with {_short(init)}, which is not callable'))
    return
  for i, sym in enumerate(node.inputs):
    if isinstance(sym, Literal) and sym.aval is None:
      raise InvariantError(f'{where}: inputs[{i}] is a static value '
                           f'({_short(sym.value, 60)}); an equation reads '
                           'arrays only')
  for i, sym in enumerate(node.outputs):
    if isinstance(sym, Literal):
      raise InvariantError(f'{where}: outputs[{i}] is a Literal; an '
                           'equation defines Vars')
  if not isinstance(node.prim, jex.Primitive) or not isinstance(
      getattr(node.prim, 'name', None), str):
    raise InvariantError(f'{where} has prim {_short(node.prim)}, not a JAX '
                         'primitive')
  if not all(isinstance(k, str) for k in node.params):
    raise InvariantError(f'{where} has a params key that is not a str')
  for field in ('body_keys', 'body_forms'):
    if not isinstance(getattr(node, field), (list, tuple)):
      raise InvariantError(f'{where} has {field} '
                           f'{_short(getattr(node, field))}, not a list')
  for key in node.body_keys:
    if not (isinstance(key, str) or (
        isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)
        and isinstance(key[1], int))):
      raise InvariantError(f'{where} has a body key {_short(key)}; a key is '
                           "a param name or (name, index)")
  for form in node.body_forms:
    if not (isinstance(form, str) and form in _FORMS):
      raise InvariantError(f'{where} has a body form {_short(form)}; a form '
                           f'is one of {_FORMS}')
  # Where the equation came from, and the context JAX traced it in: what
  # JAX's own equations carry (or None, for JAX's defaults).
  if node.source_info is not None and not all(
      hasattr(node.source_info, a) for a in ('traceback', 'name_stack')):
    raise InvariantError(f'{where} has source_info '
                         f'{_short(node.source_info)}, not a JAX SourceInfo '
                         'or None')
  if node.ctx is not None and not hasattr(node.ctx, 'manager'):
    raise InvariantError(f'{where} has ctx {_short(node.ctx)}, not a JAX '
                         'equation context or None')
  if not isinstance(node.effects, (set, frozenset)):
    raise InvariantError(f'{where} has effects {_short(node.effects)}, not a '
                         'set')
  for child in node.children:
    if not isinstance(child, Mox):
      raise InvariantError(f'{where} holds a body {_short(child)} that is not '
                           'a Mox')


def _check_structure(root: Mox) -> None:
  """Every node's fields are of the right kinds; no node holds itself.
  Iterative, so any depth is checked without recursion."""
  on_path: set[int] = set()
  stack: list = [(root, False)]
  while stack:
    node, leaving = stack.pop()
    if leaving:
      on_path.discard(id(node))
      continue
    if id(node) in on_path:
      raise InvariantError(f'{_where(node)} holds itself (the tree has a '
                           'cycle)')
    _check_node_fields(node, _where(node))
    on_path.add(id(node))
    stack.append((node, True))
    stack.extend((c, False) for c in reversed(node.children))


def _check_constants(root: Mox) -> None:
  """Constant values and array literals have their symbols' types."""
  for node in _walk(root):
    if isinstance(node, Mox):
      if len(node.constvars) != len(node.consts):
        continue  # reported by the scope check
      for i, (sym, value) in enumerate(zip(node.constvars, node.consts, strict=True)):
        why = _value_mismatch(sym.aval, value)
        if why:
          raise InvariantError(
              f'{_where(node)}: constant {i} ({_short(value, 60)}) {why}, '
              f'but its symbol is {sym.type_str}')
    for field in ('inputs', 'outputs'):
      for i, sym in enumerate(getattr(node, field)):
        if isinstance(sym, Literal) and sym.aval is not None:
          why = _value_mismatch(sym.aval, sym.value)
          if why:
            raise InvariantError(
                f'{_where(node)}: {field}[{i}] is the literal '
                f'{_short(sym.value, 60)}, which {why}, but its type is '
                f'{sym.type_str}')


def _value_mismatch(aval, value) -> str | None:
  """How ``value`` differs from ``aval`` (shape, then dtype), or None."""
  try:
    shape = tuple(np.shape(value))
  except Exception:  # noqa: BLE001 - not an array at all
    return f'is a {type(value).__name__}, not an array'
  if shape != tuple(aval.shape):
    return f'has shape {shape}'
  dtype = getattr(value, 'dtype', None)
  if dtype is not None:
    try:
      if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended) or \
          jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        same = dtype == aval.dtype  # PRNG keys and other extended dtypes
      else:
        # JAX may keep a closed-over NumPy float64 array as it is, with a
        # float32 aval (64-bit types off): compare as JAX would see it.
        same = jax.dtypes.canonicalize_dtype(np.dtype(dtype)) == \
            jax.dtypes.canonicalize_dtype(np.dtype(aval.dtype))
    except Exception:  # noqa: BLE001 - an odd dtype
      same = False
    if not same:
      return f'has dtype {str(dtype)[:40]}'
  return None


def _walk(root: Mox):
  stack = [root]
  while stack:
    node = stack.pop()
    yield node
    stack.extend(reversed(node.children))


# ---------------------------------------------------------------- scopes

def _check_scopes(mox: Mox) -> None:
  every: set[Symbol] = set()  # defined anywhere: a symbol is defined once

  def define(scope: _Scope, sym, node, path):
    if isinstance(sym, Literal):
      return
    if sym in every:
      raise InvariantError(f'{_where(node, path)} defines {sym!r} a second '
                           'time')
    every.add(sym)
    scope.defined.add(sym)

  def read(scope: _Scope, sym, node, what, path):
    if isinstance(sym, Literal) or sym in scope.defined:
      return
    other = scope.visible_elsewhere(sym)
    if other is not None:
      raise InvariantError(
          f'{_where(node, path)} reads {what} {sym!r}, which is defined in '
          f'{other}, outside the body ({scope.owner}) it reads it from; a body '
          'can only read its own inputs, constants and what it computes')
    if sym in every:
      raise InvariantError(
          f'{_where(node, path)} reads {what} {sym!r}, which is defined '
          'inside a body, not in the scope that reads it')
    raise InvariantError(f'{_where(node, path)} reads {what} {sym!r} before '
                         'it is defined')

  def check_counts(node: Mox):
    expected = node.var_tree.num_leaves + (
        node.in_tree.num_leaves if node.in_tree is not None else 0)
    if node.in_tree is not None and len(node.inputs) != expected:
      raise InvariantError(
          f'{_where(node)} has {len(node.inputs)} inputs but var_tree and '
          f'in_tree describe {expected}')
    if node.out_tree is not None and len(node.outputs) != node.out_tree.num_leaves:
      raise InvariantError(
          f'{_where(node)} has {len(node.outputs)} outputs but out_tree '
          f'describes {node.out_tree.num_leaves}')
    if len(node.constvars) != len(node.consts):
      raise InvariantError(
          f'{_where(node)} has {len(node.constvars)} constant symbols but '
          f'{len(node.consts)} constant values')

  # Every module call is a variable scope, whatever module system traced
  # it and inside every body: a variable (a symbol some call lists among its
  # variable inputs) that is defined before a call starts and read under it
  # is among that call's inputs. (A variable computed inside the call, as a
  # kernel tied to an embedding table, is the call's own work.)
  # Where each variable lives: the path of the module that owns it, from
  # every call that lists it (the call's path, then the variable's path
  # relative to it). The rule binds a call for the variables of its own
  # module and its submodules; a module handed to a call as an argument
  # (MaxText's decoder takes the shared embedding module) is another
  # module, whose variables reach the body through that argument.
  owners: dict[Symbol, set] = {}
  for node in _walk(mox):
    if isinstance(node, Mox) and 0 < node.num_vars <= len(node.inputs):
      for entry in var_entries(node):
        if not isinstance(entry.symbol, Literal):
          owners.setdefault(entry.symbol, set()).add(
              tuple(node.path) + tuple(entry.rel_path[:-1]))
  born: dict[Symbol, int] = {}

  def owned_under(sym, call_path) -> bool:
    n = len(call_path)
    return any(o[:n] == call_path for o in owners.get(sym, ()))

  def read_in(call, scope: _Scope, sym, node, what, path):
    read(scope, sym, node, what, path)
    if call is None or sym not in owners or sym in call[1]:
      return
    if not owned_under(sym, tuple(call[0].path)):
      return
    if born.get(sym, -1) < call[2]:
      raise InvariantError(
          f'{_where(node, path)} reads {what} {sym!r}, a variable, inside '
          f'{_where(call[0])}, which does not list it among its inputs; a '
          'module call lists every variable its body reads')

  def walk(scope: _Scope, node, path, call=None):
    if isinstance(node, Equation):
      for i, s in enumerate(node.inputs):
        read_in(call, scope, s, node, f'input {i}', path)
      if not len(node.children) == len(node.body_keys) == len(node.body_forms):
        raise InvariantError(
            f'{_where(node, path)} has {len(node.children)} bodies, '
            f'{len(node.body_keys)} body keys and {len(node.body_forms)} '
            'body forms')
      for key, body in zip(node.body_keys, node.children, strict=True):
        if key in node.params or (isinstance(key, tuple)
                                  and key[0] in node.params):
          raise InvariantError(
              f'{_where(node, path)} holds its body {key!r} twice: in '
              'children and in params')
        body_scope(body, scope, f'the body {key!r} of {_where(node, path)}')
      for s in node.outputs:
        define(scope, s, node, path)
        born[s] = len(born)
      return
    check_counts(node)
    for i, s in enumerate(node.inputs):
      read_in(call, scope, s, node, f'input {i}', path)
    # A rewritten call is checked as its enclosing call, as when rewrites
    # made it ephemeral (a tied head's call-site adapter reads the embedding
    # without the call listing it).
    inner = call if node.is_ephemeral or node.rewritten else (
        node, set(node.inputs), len(born))
    for child in node.children:
      walk(scope, child, node.path, inner)
    for i, s in enumerate(node.outputs):
      read_in(inner, scope, s, node, f'output {i}', path)

  def body_scope(root: Mox, outer: _Scope | None, owner: str):
    scope = _Scope(owner, outer)
    check_counts(root)
    for s in list(root.constvars) + list(root.inputs):
      define(scope, s, root, root.path)
      born[s] = len(born)
    for child in root.children:
      walk(scope, child, root.path)
    for i, s in enumerate(root.outputs):
      read(scope, s, root, f'output {i}', root.path)

  body_scope(mox, None, 'the root')


def _type_problem(make_jaxpr) -> str | None:
  """JAX's type check of the Jaxpr ``make_jaxpr()`` builds: the problem,
  or None. A primitive rule that fails on inputs it does not accept (an
  ``assert`` on the number of operands, an attribute of a missing aval)
  is a type problem of the equation too, whatever it raises."""
  try:
    return _lower.type_errors(make_jaxpr())
  except Exception as e:  # noqa: BLE001 - see above
    return f'{type(e).__name__}: {_short(_message(e), 500)}'


def _check_types(mox: Mox) -> None:
  problem = _type_problem(lambda: _lower.to_jaxpr(mox))
  if problem is None:
    return
  # Name the first equation that does not type-check on its own.
  for eqn, path in _equations_with_paths(mox):
    own = _type_problem(lambda: _lower.one_equation_jaxpr(eqn))
    if own is not None:
      raise InvariantError(
          f'{_where(eqn, path)} does not type-check: its outputs '
          f'({", ".join(s.type_str for s in eqn.outputs)}) are not what '
          f'{eqn.prim.name} computes from its inputs '
          f'({", ".join(s.type_str for s in eqn.inputs)}).\n{own}')
  raise InvariantError(f'the tree does not type-check:\n{problem}')


def _equations_with_paths(mox: Mox):
  stack = [(mox, mox.path)]
  while stack:
    node, path = stack.pop()
    if isinstance(node, Equation):
      yield node, path
      stack.extend((b, path) for b in reversed(node.children))
    else:
      stack.extend((c, node.path if not node.is_ephemeral or node.path else
                    path) for c in reversed(node.children))
