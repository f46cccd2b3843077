"""Invariant checker for module expressions (the MoX analogue of check_jaxpr).

Checks, for every node:
* a symbol is defined once (root inputs, constants or one equation output)
  and read only after its definition;
* a module call's ``inputs`` are its ``var_tree`` leaves then its
  ``in_tree`` leaves, and its ``outputs`` the leaves of ``out_tree``;
* a module call's outputs are defined by the time the call ends.
"""

from __future__ import annotations

from yax._errors import YaxError
from yax._ir import Equation, Literal, Mox, Symbol


class InvariantError(YaxError):
  """A module expression breaks one of its structural invariants."""


def _where(node) -> str:
  if isinstance(node, Mox):
    return (f"module_call {node.type_name or '(ephemeral)'} at path "
            f"'{'/'.join(node.path) or '<root>'}'")
  return f'equation {node.prim.name}'


def check_mox(mox: Mox) -> None:
  """Raises ``InvariantError`` naming the node when ``mox`` is malformed."""
  if not isinstance(mox, Mox):
    raise InvariantError(f'check_mox expects a Mox, found {type(mox).__name__}')
  defined: set[Symbol] = set()

  def define(sym, node):
    if isinstance(sym, Literal):
      return
    if sym in defined:
      raise InvariantError(f'{_where(node)} defines {sym!r} a second time')
    defined.add(sym)

  def read(sym, node, what):
    if not isinstance(sym, Literal) and sym not in defined:
      raise InvariantError(f'{_where(node)} reads {what} {sym!r} before it '
                           'is defined')

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

  def walk(node):
    if isinstance(node, Equation):
      for i, s in enumerate(node.inputs):
        read(s, node, f'input {i}')
      for body in node.children:
        scope(body)
      for s in node.outputs:
        define(s, node)
      return
    check_counts(node)
    for i, s in enumerate(node.inputs):
      read(s, node, f'input {i}')
    for child in node.children:
      walk(child)
    for i, s in enumerate(node.outputs):
      read(s, node, f'output {i}')

  def scope(root: Mox):
    for s in list(root.constvars) + list(root.inputs):
      define(s, root)
    check_counts(root)
    for child in root.children:
      walk(child)
    for i, s in enumerate(root.outputs):
      read(s, root, f'output {i}')

  scope(mox)
