"""Invariant checker for module expressions (the MoX analogue of check_jaxpr).

Checks, for every node:

* **scopes**: the root and each body of an equation (``nn.scan``,
  ``nn.remat``, ``nn.jit`` ...) is a scope of its own, as in a Jaxpr: its
  constants and inputs are defined in it, and a symbol defined in a body is
  not visible outside it (nor one of the outside inside it). Module calls
  are not scopes: their inputs and outputs are symbols of the enclosing one;
* a symbol is defined once and read only after its definition;
* a module call's ``inputs`` are its ``var_tree`` leaves then its
  ``in_tree`` leaves, its ``outputs`` the leaves of ``out_tree``, and its
  outputs are defined by the time the call ends;
* an equation has one body form and key per body, and its bodies have as
  many inputs and outputs as it passes in and gets back (by type);
* **types**: each equation's outputs are what its primitive computes from
  its inputs (JAX's own type checker run on ``to_jaxpr(mox)``, so bodies
  and their primitives' rules are checked too).
"""

from __future__ import annotations

from yax import _lower
from yax._errors import YaxError
from yax._ir import Equation, Literal, Mox, Symbol


class InvariantError(YaxError):
  """A module expression breaks one of its structural invariants."""


def _where(node, path=()) -> str:
  if isinstance(node, Mox):
    return (f"module_call {node.type_name or '(ephemeral)'} at path "
            f"'{'/'.join(node.path) or '<root>'}'")
  inside = f" in the module call at path '{'/'.join(path)}'" if path else ''
  return f'equation {node.prim.name}{inside}'


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
  - ``mox``: a tree from ``make_mox`` or a rewrite.
  - ``types``: also type-check every equation (JAX's ``check_jaxpr`` on
    ``yax.to_jaxpr(mox)``); ``False`` checks the structure only.
  """
  if not isinstance(mox, Mox):
    raise InvariantError(f'check_mox expects a Mox, found {type(mox).__name__}')
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

  def walk(scope: _Scope, node, path):
    if isinstance(node, Equation):
      for i, s in enumerate(node.inputs):
        read(scope, s, node, f'input {i}', path)
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
      return
    check_counts(node)
    for i, s in enumerate(node.inputs):
      read(scope, s, node, f'input {i}', path)
    for child in node.children:
      walk(scope, child, node.path)
    for i, s in enumerate(node.outputs):
      read(scope, s, node, f'output {i}', path)

  def body_scope(root: Mox, outer: _Scope | None, owner: str):
    scope = _Scope(owner, outer)
    check_counts(root)
    for s in list(root.constvars) + list(root.inputs):
      define(scope, s, root, root.path)
    for child in root.children:
      walk(scope, child, root.path)
    for i, s in enumerate(root.outputs):
      read(scope, s, root, f'output {i}', root.path)

  body_scope(mox, None, 'the root')
  if types:
    _check_types(mox)


def _check_types(mox: Mox) -> None:
  problem = _lower.type_errors(_lower.to_jaxpr(mox))
  if problem is None:
    return
  # Name the first equation that does not type-check on its own.
  for eqn, path in _equations_with_paths(mox):
    jaxpr = _lower.one_equation_jaxpr(eqn)
    own = _lower.type_errors(jaxpr)
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
