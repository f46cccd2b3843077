"""The root arguments of a traced tree, as the tools that rewrite params
see them: a params leaf's array and its box (an NNX Variable, a Linen
``nn.Partitioned``), and the root's expected argument structure."""

from __future__ import annotations

from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir.nodes import Mox, Symbol


def unboxed(x):
  """The array in a params leaf (an NNX Variable holds one)."""
  leaves = jtu.tree_leaves(x)
  return leaves[0] if len(leaves) == 1 and leaves[0] is not x else x


def boxed_like(like, value):
  """``value`` in the container ``like`` came in (an NNX Variable keeps its
  type and metadata, sharding included)."""
  if unboxed(like) is like:
    return value
  return jtu.tree_unflatten(jtu.tree_structure(like), [value])


def with_argument_structure(root: Mox, where: tuple, value) -> Mox:
  """``root`` expecting, at argument ``where`` (``(0, position)`` or
  ``(1, name)``), the structure of ``value``: new params in the boxes
  (``nn.Partitioned``, NNX Variables with metadata) a tool returns them
  in. The leaves and their order are unchanged."""
  args, kwargs = jtu.tree_unflatten(root.in_tree, root.inputs)
  holder = list(args) if where[0] == 0 else dict(kwargs)
  leaves = jtu.tree_leaves(holder[where[1]],
                           is_leaf=lambda s: isinstance(s, Symbol))
  structure = jtu.tree_structure(value)
  if structure.num_leaves != len(leaves):
    raise SubstitutionError(
        f'internal: the rewrite returns params with {structure.num_leaves} '
        f'arrays but the rewritten tree reads {len(leaves)}')
  holder[where[1]] = jtu.tree_unflatten(structure, leaves)
  if where[0] == 0:
    args = type(args)(holder) if isinstance(args, tuple) else holder
  else:
    kwargs = holder
  inputs, in_tree = jtu.tree_flatten((args, kwargs),
                                     is_leaf=lambda s: isinstance(s, Symbol))
  if inputs != list(root.inputs):
    raise SubstitutionError(
        'internal: giving new params their boxes reordered the inputs')
  return root.replace(in_tree=in_tree)
