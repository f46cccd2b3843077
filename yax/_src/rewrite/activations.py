"""Element-wise activations found by data flow, shared by the tools that
rewrite them (``yax.fewbit``, ``yax.lean_norm(..., activations=True)``).

Each supported function is traced at the shapes and dtypes of the
candidates and matched equation by equation (``rewrite/pattern.py``), so a
GELU that Hugging Face inlines as ``mul``/``erfc`` equations is found as
well as a ``nn.gelu``. :func:`find` returns the matches per activation and
:func:`group` puts each under one ephemeral call named after it, ready to
be substituted.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from yax._src.ir.nodes import Equation, Literal, Mox, iter_nodes
from yax._src.rewrite import pattern as _pattern
from yax._src.trace.make import opened

# Module classes (by name) that already rewrite one activation: no tool
# searches inside them, so a FewBit site stays FewBit and a lean one lean.
REWRITTEN = ('FewBit', 'LeanActivation')


def _gelu(x):
  return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x):
  return jax.nn.gelu(x, approximate=True)


# Supported activations, by the name a FewBit call carries. The order is
# the search order: an activation built from others (Mish from softplus and
# tanh, SiLU from sigmoid, hard swish from hard sigmoid from ReLU6) is
# matched before its parts, so its parts are not taken alone.
ACTIVATIONS: dict[str, Callable] = {
    'mish': jax.nn.mish,
    'hard_swish': jax.nn.hard_swish,
    'gelu_tanh': _gelu_tanh,
    'gelu': _gelu,
    'silu': jax.nn.silu,
    'elu': jax.nn.elu,
    'hard_sigmoid': jax.nn.hard_sigmoid,
    'relu6': jax.nn.relu6,
    'leaky_relu': jax.nn.leaky_relu,
    'hard_tanh': jax.nn.hard_tanh,
    'softplus': jax.nn.softplus,
    'sigmoid': jax.nn.sigmoid,
    'tanh': jnp.tanh,
    'relu': jax.nn.relu,
}


# Leaky ReLU's slope where none is given (``jax.nn.leaky_relu``'s default).
LEAKY_SLOPE = 0.01


def _rewritten_paths(mox: Mox) -> list[tuple]:
  return [n.path for n in iter_nodes(mox)
          if isinstance(n, Mox) and n.type_name in REWRITTEN]


def _inside(path: tuple, paths) -> bool:
  return any(tuple(path[:len(p)]) == tuple(p) for p in paths)


def _elementwise(eqn: Equation) -> bool:
  """Each input has the output's shape or is a scalar; one is an array."""
  out = tuple(getattr(eqn.outputs[0].aval, 'shape', ()))
  shapes = [tuple(getattr(s.aval, 'shape', ())) for s in eqn.inputs]
  return bool(out) and out in shapes and all(s in (out, ()) for s in shapes)


def elementwise_found(nodes) -> list[str]:
  """Names of the element-wise equations under ``nodes``, for errors."""
  seen: dict[str, None] = {}
  for node in nodes:
    for n in iter_nodes(node):
      if isinstance(n, Equation) and len(n.outputs) == 1 and not \
          n.children and n.prim.name not in ('copy', 'convert_element_type') \
          and _elementwise(n):
        seen.setdefault(n.params.get('name') or n.prim.name, None)
  return list(seen)


def _within(eqn: Equation) -> set[int]:
  """Ids of ``eqn`` and of every equation in its bodies, opened ones
  included (a ``jit``-ed SiLU holds the sigmoid that must not be taken
  alone)."""
  ids, stack = set(), [eqn]
  while stack:
    node = stack.pop()
    ids.add(id(node))
    stack.extend(getattr(node, 'children', ()))
    if isinstance(node, Equation):
      holder = opened(node)
      if holder is not None:
        stack.extend(holder.children)
  return ids


def leaky_slope(eqn: Equation) -> float | None:
  """The negative slope of a ``jit[name=leaky_relu]`` equation when it is
  a literal (``jax.nn.leaky_relu(x, 0.1)``), else None."""
  if not isinstance(eqn, Equation) or eqn.prim.name != 'jit' or \
      eqn.params.get('name') != 'leaky_relu' or \
      len(eqn.inputs) != 2 or not isinstance(eqn.inputs[1], Literal):
    return None
  try:
    return float(eqn.inputs[1].value)
  except (TypeError, ValueError):  # not a number: no leaky ReLU of ours
    return None


def _leaky_slopes(mox: Mox) -> list[float]:
  """Every slope a leaky ReLU of the tree is given explicitly as a literal
  (opened bodies included): each is searched as its own pattern."""
  slopes: dict[float, None] = {}
  stack = [mox]
  while stack:
    node = stack.pop()
    if isinstance(node, Equation):
      slope = leaky_slope(node)
      if slope is not None:
        slopes.setdefault(slope, None)
      holder = opened(node)
      if holder is not None:
        stack.extend(holder.children)
    stack.extend(getattr(node, 'children', ()))
  return list(slopes)


def _patterns(mox: Mox):
  """``(activation, function)`` in search order; leaky ReLU with its
  default slope (baked into the jaxpr as a constant), then once per slope
  given explicitly (a literal input of its ``jit``; a pattern matches
  literals by value)."""
  for name, fn in ACTIVATIONS.items():
    yield name, fn
    if name != 'leaky_relu':
      continue
    for slope in _leaky_slopes(mox):
      yield name, functools.partial(fn, negative_slope=slope)


def find(mox: Mox, within) -> list[tuple[str, list]]:
  """``(activation, function, matches)`` per supported activation, in
  search order, with no equation in two matches and none inside a call
  that already rewrites an activation (``REWRITTEN``). ``within``: module
  calls to search (None: the whole tree)."""
  taken: set[int] = set()
  skip = _rewritten_paths(mox)
  found = []
  for name, fn in _patterns(mox):
    chosen = []
    for m in _pattern.match(fn, mox, within=within):
      if any(id(e) in taken for e in m.equations) or _inside(m.path, skip):
        continue
      for e in m.equations:
        taken |= _within(e)
      chosen.append(m)
    if chosen:
      found.append((name, fn, chosen))
  return found


def group(mox: Mox, found) -> tuple[Mox, list]:
  """Each activation's matches grouped under its name (a replacement call
  then keeps the group's fresh path), one activation at a time: matches
  are found again on each grouped tree and kept where they are the same
  equations as found on the original (grouping keeps equations). Returns
  the grouped tree and the group nodes, for ``substitute``."""
  tree, nodes = mox, []
  for name, fn, matches in found:
    wanted = {frozenset(id(e) for e in m.equations) for m in matches}
    again = [m for m in _pattern.match(fn, tree)
             if frozenset(id(e) for e in m.equations) in wanted]
    tree, grouped = _pattern.group_matches(tree, again, name)
    nodes.extend(grouped)
  return tree, nodes
