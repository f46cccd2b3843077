"""Lowering: every conversion between YAX objects and JAX's Jaxpr objects.

A module expression keeps each body that holds module calls (the body of an
``nn.scan``, ``nn.remat``, ``nn.jit``, ``cond`` or ``while``) in one place:
``Equation.children``. The parameters JAX needs (a ``Jaxpr`` or
``ClosedJaxpr`` under ``params['jaxpr']``, ``params['branches']`` ...) are
produced from the children on demand, here, and nowhere else:

* symbols to JAX variables (:class:`JaxVars`, ``DropVar`` for dropped
  outputs);
* an equation to a ``JaxprEqn`` (:func:`jax_equation`), its full parameters
  with bodies lowered (:func:`equation_params`);
* a tree to a ``ClosedJaxpr`` with module calls inlined (:func:`to_jaxpr`);
* one-equation Jaxprs for the interpreter, cached per equation;
* ``DebugInfo`` kept from the trace and adjusted when a rewrite adds inputs;
* the two Jaxpr forms. JAX 0.11 makes ``ClosedJaxpr`` an alias of ``Jaxpr``;
  :func:`jaxpr_form` checks ``ClosedJaxpr`` first, so the answer for a value
  does not change meaning when that happens (every Jaxpr is then "closed").

A JAX release that changes these objects is a change to this file only.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import jax
from jax.extend import core as jex

from yax._src.ir.nodes import Equation, Literal, Mox, Symbol, leaf_equations

# Version shim (public APIs only). ``jax.extend.core`` exports ``DropVar`` and
# ``new_jaxpr_eqn`` from jax 0.8.1 on; jax 0.8.0 (the oldest supported
# release) has them only as ``jax.core.DropVar`` / ``jax.core.new_jaxpr_eqn``,
# which later releases deprecate. Prefer the ``jax.extend`` names.
JaxDropVar = getattr(jex, 'DropVar', None) or jax.core.DropVar
new_jaxpr_eqn = getattr(jex, 'new_jaxpr_eqn', None) or jax.core.new_jaxpr_eqn

CLOSED = 'closed'
OPEN = 'open'


# ------------------------------------------------------------- Jaxpr forms

def jaxpr_form(value) -> str | None:
  """``'closed'`` for a ``ClosedJaxpr``, ``'open'`` for a ``Jaxpr``, else None.

  ``ClosedJaxpr`` is tested first: where it is an alias (or a subclass) of
  ``Jaxpr``, every Jaxpr is closed and none is open.
  """
  if isinstance(value, jex.ClosedJaxpr):
    return CLOSED
  if isinstance(value, jex.Jaxpr):
    return OPEN
  return None


def open_part(value) -> jex.Jaxpr:
  """The ``Jaxpr`` of a ``ClosedJaxpr`` (or the ``Jaxpr`` itself)."""
  if jaxpr_form(value) == CLOSED and hasattr(value, 'jaxpr') and (
      value.jaxpr is not value):
    return value.jaxpr
  return value


def consts_of(value) -> list:
  return list(value.consts) if jaxpr_form(value) == CLOSED else []


def make_closed(jaxpr: jex.Jaxpr, consts: Sequence[Any]):
  return jex.ClosedJaxpr(jaxpr, list(consts))


_JAXPRS = (jex.ClosedJaxpr, jex.Jaxpr)
_MAY_HOLD_BODIES = (*_JAXPRS, tuple, list)


def body_params(params: dict) -> list[tuple[Any, Any, str]]:
  """``(key, value, form)`` for every Jaxpr in ``params``; a key is a param
  name, or ``(name, index)`` for an element of a tuple/list param."""
  out = []
  for key, value in params.items():
    if not isinstance(value, _MAY_HOLD_BODIES):
      continue  # most parameters: one type test
    form = jaxpr_form(value)
    if form is not None:
      out.append((key, value, form))
    else:  # a tuple or list
      for i, item in enumerate(value):
        if isinstance(item, _JAXPRS):
          out.append(((key, i), item, jaxpr_form(item)))
  return out


# ------------------------------------------------------------------ symbols

def dynamic(symbols: Sequence[Symbol]) -> list[Symbol]:
  """Symbols that exist at run time (drops static Python values)."""
  return [s for s in symbols if not (isinstance(s, Literal) and s.is_static)]


class JaxVars:
  """Maps YAX symbols to JAX variables, one fresh variable per symbol."""

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

  def binder(self, sym: Symbol):
    """An input variable: never a ``DropVar`` (JAX binds every input)."""
    var = self.env.get(sym)
    if var is None or isinstance(var, JaxDropVar):
      var = self.env[sym] = jex.Var(sym.aval)
    return var


# -------------------------------------------------------------- debug info

def debug_info_for(info, num_inputs: int, num_outputs: int):
  """``info`` (a ``DebugInfo`` from the trace) fitted to a body with
  ``num_inputs``/``num_outputs``: names of added inputs/outputs are empty
  (JAX's convention for arguments that have no user-facing name). ``None``
  when there is no info to keep."""
  if info is None or not hasattr(info, '_replace'):
    return None
  names = getattr(info, 'arg_names', None)
  if names is not None and len(names) != num_inputs:
    names = tuple(names[:num_inputs]) + ('',) * (num_inputs - len(names))
  paths = getattr(info, 'result_paths', None)
  if isinstance(paths, tuple) and len(paths) != num_outputs:
    paths = tuple(paths[:num_outputs]) + ('',) * (num_outputs - len(paths))
  elif not isinstance(paths, tuple):
    paths = None
  return info._replace(arg_names=names, result_paths=paths)


def _debug_info_type():
  """``jax.extend.core.DebugInfo`` (jax >= 0.8.1). jax 0.8.0 does not export
  the class but already warns about Jaxprs built without one: take the type
  of the debug info of a Jaxpr traced by the public ``jax.make_jaxpr``."""
  cls = getattr(jex, 'DebugInfo', None)
  if cls is None:
    cls = type(jax.make_jaxpr(lambda x: x)(0.0).jaxpr.debug_info)
  return cls


_DebugInfo = _debug_info_type()


def new_debug_info(traced_for: str):
  """A ``DebugInfo`` for a Jaxpr YAX builds itself: JAX deprecates Jaxprs
  made without one (jax-ml/jax#26480). None where ``jax.extend.core`` has no
  such type (then JAX does not ask for one)."""
  if _DebugInfo is None:  # pragma: no cover - depends on the JAX version
    return None
  return _DebugInfo(traced_for, '<yax>', None, None)


def _with_debug_info(jaxpr: jex.Jaxpr, info) -> jex.Jaxpr:
  info = debug_info_for(info, len(jaxpr.invars), len(jaxpr.outvars))
  return jaxpr if info is None else jaxpr.replace(debug_info=info)


# ---------------------------------------------------------------- lowering

def _effects(eqns) -> frozenset:
  return frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()


def lower_body(body: Mox, form: str):
  """A body (an ephemeral ``Mox`` in ``Equation.children``) as the Jaxpr
  form its primitive expects, module calls inlined, debug info kept."""
  closed = to_jaxpr(body)
  if form == OPEN:
    if closed.consts:
      raise_internal(f'a body lowered to an open Jaxpr has '
                     f'{len(closed.consts)} constants')
    return closed.jaxpr
  return closed


def set_bodies(eqn: Equation, bodies: Sequence[Any]) -> dict:
  """``eqn.params`` with each body key set to the given Jaxpr (in order of
  ``eqn.body_keys``)."""
  if len(bodies) != len(eqn.body_keys):
    raise_internal(f'{eqn.prim.name} has {len(eqn.body_keys)} bodies, '
                   f'{len(bodies)} given')
  params = dict(eqn.params)
  seqs: dict[str, list] = {}
  for key, body in zip(eqn.body_keys, bodies, strict=True):
    if isinstance(key, tuple):
      name, i = key
      seq = seqs.setdefault(name, list(params.get(name, ())))
      while len(seq) <= i:
        seq.append(None)
      seq[i] = body
    else:
      params[key] = body
  for name, seq in seqs.items():
    if any(item is None for item in seq):
      raise_internal(f'{eqn.prim.name}: no body for every element of '
                     f'{name!r} ({len(seq)} elements)')
    params[name] = tuple(seq)
  return params


def equation_params(eqn: Equation) -> dict:
  """The parameters JAX sees for ``eqn``: bodies lowered from the children."""
  if not eqn.children:
    return eqn.params
  return set_bodies(eqn, [lower_body(b, f) for b, f in
                          zip(eqn.children, eqn.body_forms, strict=True)])


def jax_equation(eqn: Equation, jv: JaxVars, params: dict | None = None):
  """A ``JaxprEqn`` for ``eqn`` with variables from ``jv``."""
  return new_jaxpr_eqn(
      [jv(s) for s in eqn.inputs], [jv(s) for s in eqn.outputs], eqn.prim,
      equation_params(eqn) if params is None else params, eqn.effects,
      eqn.source_info, eqn.ctx)


def to_jaxpr(mox: Mox) -> jex.ClosedJaxpr:
  """Returns an equivalent ``ClosedJaxpr`` with every module call inlined.

  Its inputs are the dynamic inputs of ``mox`` (static Python values are
  baked in), its outputs the dynamic outputs, so every Jaxpr tool
  (``jax.core.eval_jaxpr``, ``jax.extend``-based passes) works on a MoX.
  """
  jv = JaxVars()
  constvars = [jv.binder(s) for s in mox.constvars]
  invars = [jv.binder(s) for s in dynamic(mox.inputs)
            if not isinstance(s, Literal)]
  eqns = [jax_equation(e, jv) for e in leaf_equations(mox)]
  outvars = [jv(s) for s in dynamic(mox.outputs)]
  jaxpr = jex.Jaxpr(constvars, invars, outvars, eqns, _effects(eqns),
                    new_debug_info('yax.to_jaxpr'))
  return make_closed(_with_debug_info(jaxpr, mox.debug_info), mox.consts)


# --------------------------------------------- one-equation Jaxprs (eval)

def one_equation_jaxpr(eqn: Equation, params: dict | None = None) -> jex.Jaxpr:
  """``{ lambda ; inputs. let outputs = eqn in (outputs) }`` for evaluation
  with ``jax.core.eval_jaxpr``; inputs are the non-literal inputs in order.

  Equations without bodies are cached (nodes are immutable); pass
  ``params`` to lower with bodies of your own (the interpreter does).
  """
  if params is None and not eqn.children:
    jaxpr = _ONE_EQUATION.get(eqn)
    if jaxpr is None:
      jaxpr = _ONE_EQUATION[eqn] = _one_equation(eqn, eqn.params)
    return jaxpr
  return _one_equation(eqn, equation_params(eqn) if params is None else params)


def _one_equation(eqn: Equation, params: dict) -> jex.Jaxpr:
  jv = JaxVars()
  ins = [jv.binder(s) for s in eqn.inputs if not isinstance(s, Literal)]
  jeqn = jax_equation(eqn, jv, params)
  # Every output is returned (a dropped one too), so the interpreter can
  # write each output symbol.
  outs = [jex.Var(s.aval) if s.dropped else jv(s) for s in eqn.outputs]
  jeqn = jeqn.replace(outvars=outs)
  return jex.Jaxpr([], ins, outs, [jeqn], jeqn.effects,
                   new_debug_info('yax.eval_mox'))


_ONE_EQUATION: 'weakref.WeakKeyDictionary[Equation, jex.Jaxpr]' = (
    weakref.WeakKeyDictionary())


def raise_internal(message: str):
  from yax._src.errors import YaxError
  raise YaxError(f'internal error in YAX lowering: {message}')


# Version shim (public APIs only): ``jax.extend.core.check_jaxpr`` and
# ``JaxprTypeError`` exist from jax 0.8.1 on; jax 0.8.0 has them only in
# ``jax.core``, which later releases deprecate.
_check_jaxpr = getattr(jex, 'check_jaxpr', None) or jax.core.check_jaxpr
JaxprTypeError = (getattr(jex, 'JaxprTypeError', None)
                  or jax.core.JaxprTypeError)


def type_errors(jaxpr) -> str | None:
  """JAX's own type check of a Jaxpr (each equation's outputs against what
  its primitive computes from its inputs, bodies included): the message,
  or ``None`` when it type-checks."""
  try:
    _check_jaxpr(open_part(jaxpr))
  except JaxprTypeError as e:
    return str(e)
  except (TypeError, ValueError) as e:
    # A primitive's shape rule rejecting its inputs (``dot_general`` with
    # contracting dimensions of different sizes) raises these from inside
    # the check: a type error of the equation as well.
    return f'{type(e).__name__}: {e}'
  return None
