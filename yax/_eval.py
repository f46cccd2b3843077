"""Evaluation of module expressions, and conversion back to a Jaxpr.

``Interpreter`` is the one walker that runs a tree: one method per node kind
(``run_module``, ``run_equation``), an environment dict, read and write.
Subclass it to observe or change evaluation (e.g. record activations).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend import core as jex

from yax._errors import SignatureError
from yax._ir import (Equation, Expr, JaxDropVar, Literal, Mox, Symbol, Var,
                     leaf_equations, new_jaxpr_eqn)


# ------------------------------------------------------------- to_jaxpr

class _JaxVars:
  """Maps YAX symbols to fresh JAX variables (one per symbol)."""

  def __init__(self):
    self.env: dict[Symbol, Any] = {}

  def __call__(self, sym: Symbol):
    if isinstance(sym, Literal):
      return jex.Literal(sym.value, sym.aval)
    var = self.env.get(sym)
    if var is None:
      var = JaxDropVar(sym.aval) if sym.dropped else jex.Var(sym.aval)
      self.env[sym] = var
    return var


def jax_equation(eqn: Equation, jv: _JaxVars):
  return new_jaxpr_eqn(
      [jv(s) for s in eqn.inputs], [jv(s) for s in eqn.outputs], eqn.prim,
      eqn.params, eqn.effects, eqn.source_info, eqn.ctx)


def dynamic(symbols: Sequence[Symbol]) -> list[Symbol]:
  """Symbols that exist at run time (drops static Python values)."""
  return [s for s in symbols if not (isinstance(s, Literal) and s.is_static)]


def to_jaxpr(mox: Mox) -> jex.ClosedJaxpr:
  """Returns an equivalent ``ClosedJaxpr`` with every module call inlined.

  Its inputs are the dynamic inputs of ``mox`` (static Python values are
  baked in), its outputs the dynamic outputs, so every Jaxpr tool
  (``jax.core.eval_jaxpr``, ``jax.extend``-based passes) works on a MoX.
  """
  jv = _JaxVars()
  constvars = [jv(s) for s in mox.constvars]
  invars = [jv(s) for s in dynamic(mox.inputs)]
  eqns = [jax_equation(e, jv) for e in leaf_equations(mox)]
  outvars = [jv(s) for s in dynamic(mox.outputs)]
  effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
  jaxpr = jex.Jaxpr(constvars, invars, outvars, eqns, effects)
  return jex.ClosedJaxpr(jaxpr, list(mox.consts))


# ---------------------------------------------------------- interpreter

def _single_equation_jaxpr(eqn: Equation) -> jex.Jaxpr:
  jv = _JaxVars()
  ins = [jv(s) for s in eqn.inputs if not isinstance(s, Literal)]
  jeqn = jax_equation(eqn, jv)
  outs = [jex.Var(s.aval) if s.dropped else jv(s) for s in eqn.outputs]
  jeqn = jeqn.replace(outvars=outs)
  return jex.Jaxpr([], ins, outs, [jeqn], jeqn.effects)


# Equations are immutable, so their one-equation Jaxprs are built once.
_JAXPR_CACHE: 'weakref.WeakKeyDictionary[Equation, jex.Jaxpr]' = (
    weakref.WeakKeyDictionary())


class Interpreter:
  """Runs a tree node by node. Override a ``run_*`` method to change a kind.

  Each equation is executed by JAX's own ``jax.core.eval_jaxpr`` on a
  one-equation Jaxpr, so primitives with sub-Jaxprs (``jit``, ``scan``,
  ``custom_jvp_call``) are bound exactly as JAX binds them.
  """

  def __init__(self):
    self.env: dict[Symbol, Any] = {}

  def read(self, sym: Symbol):
    if isinstance(sym, Literal):
      return sym.value
    return self.env[sym]

  def write(self, sym: Symbol, value) -> None:
    if not isinstance(sym, Literal):
      self.env[sym] = value

  def run(self, mox: Mox, consts: Sequence[Any], inputs: Sequence[Any]) -> list:
    """Binds ``mox.constvars`` and ``mox.inputs``, runs, returns outputs."""
    for s, v in zip(mox.constvars, consts):
      self.write(s, v)
    for s, v in zip(mox.inputs, inputs):
      self.write(s, v)
    self.run_module(mox)
    return [self.read(s) for s in mox.outputs]

  def run_node(self, node: Expr) -> None:
    if isinstance(node, Mox):
      self.run_module(node)
    else:
      self.run_equation(node)

  def run_module(self, mox: Mox) -> None:
    for child in mox.children:
      self.run_node(child)

  def run_equation(self, eqn: Equation) -> None:
    jaxpr = _JAXPR_CACHE.get(eqn)
    if jaxpr is None:
      jaxpr = _JAXPR_CACHE[eqn] = _single_equation_jaxpr(eqn)
    args = [self.read(s) for s in eqn.inputs if not isinstance(s, Literal)]
    outs = jax.core.eval_jaxpr(jaxpr, [], *args)
    for s, v in zip(eqn.outputs, outs):
      self.write(s, v)


# ------------------------------------------------------------- eval_mox

def _given_type(x) -> str:
  try:
    return jax.typeof(x).str_short(short_dtypes=True)
  except Exception:  # noqa: BLE001 - not a JAX value
    return f'{type(x).__name__} {x!r}'


def _describe_tree(tree) -> str:
  text = str(tree)
  return text if len(text) < 600 else text[:600] + ' ...'


def check_arguments(mox: Mox, args, kwargs) -> list:
  """Flattens ``(args, kwargs)`` and checks them against ``mox.in_tree``.

  Raises ``SignatureError`` with expected vs given on any mismatch.
  """
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  if mox.in_tree is not None and tree != mox.in_tree:
    raise SignatureError(
        'eval_mox: the argument tree differs from the traced one.\n'
        f'  expected: {_describe_tree(mox.in_tree)}\n'
        f'  given:    {_describe_tree(tree)}\n'
        'Pass arguments with the same structure as when the function was '
        'traced (same positional/keyword arguments, same dict keys).')
  paths = None
  for i, (sym, x) in enumerate(zip(mox.inputs, leaves)):
    problem = None
    if isinstance(sym, Literal) and sym.is_static:
      same = sym.value is x
      if not same:
        try:
          same = bool(sym.value == x) and type(sym.value) is type(x)
        except Exception:  # noqa: BLE001 - incomparable objects differ
          same = False
      if not same:
        problem = (f'static value {sym.value!r} (it was baked into the trace)',
                   f'{x!r}; trace again with make_mox to use another value')
    else:
      try:
        aval = jax.typeof(x)
      except Exception:  # noqa: BLE001 - not a JAX value
        aval = None
      if aval is None or not hasattr(aval, 'shape'):
        problem = (sym.type_str, f'{type(x).__name__} {x!r}')
      elif (tuple(aval.shape) != tuple(sym.aval.shape)
            or aval.dtype != sym.aval.dtype):
        problem = (sym.type_str, _given_type(x))
    if problem:
      if paths is None:
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path((args, kwargs))[0]]
      where = _argument_position(paths[i])
      raise SignatureError(
          f'eval_mox: argument {where} does not match the trace.\n'
          f'  expected: {problem[0]}\n  given:    {problem[1]}')
  return leaves


def _argument_position(keystr: str) -> str:
  """``[0][1]['params']`` -> ``args[1]['params']``; ``[1]['x']`` -> ``x=``."""
  if keystr.startswith('[0]'):
    rest = keystr[3:]
    return f'args{rest}' if rest else 'args'
  if keystr.startswith('[1]'):
    return f'kwargs{keystr[3:]}'
  return keystr


def eval_mox(mox: Mox, *args, **kwargs):
  """Evaluates a module expression on new arguments.

  **Arguments:**
  - ``mox``: a tree returned by ``make_mox`` (or a rewrite of one).
  - ``*args, **kwargs``: arguments with the structure, shapes and dtypes of
    the traced call (``mox.in_tree``); static values must be equal.

  **Returns:** the same pytree that the traced function returns.

  Works eagerly and under ``jax.jit``, ``vmap``, ``grad`` and ``lax.scan``.
  Raises ``yax.SignatureError`` when the arguments do not match.
  """
  if not isinstance(mox, Mox):
    raise SignatureError(f'eval_mox expects a Mox as first argument, found '
                         f'{type(mox).__name__}')
  leaves = check_arguments(mox, args, kwargs)
  outs = Interpreter().run(mox, mox.consts, leaves)
  if mox.out_tree is None:
    return outs
  return jax.tree_util.tree_unflatten(mox.out_tree, outs)
