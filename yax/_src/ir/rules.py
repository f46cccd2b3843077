"""Per-primitive rules for equations that hold bodies with module calls.

Two tables, keyed by primitive name (not every primitive object is public
in every supported JAX release: ``remat2`` is missing from
``jax.extend.core.primitives`` in jax 0.8.0; names are stable):

* :data:`RUN_RULES`: how the interpreter runs such an equation. Each body is
  traced with ``jax.make_jaxpr`` of a function that runs the interpreter on
  it, and the equation is bound through its own primitive with those
  bodies; the rule says what to do with constants that trace produced.
* :data:`THREAD_RULES`: how a rewrite passes values that a body needs from
  outside (new variables of a replacement, its constants) as new inputs of
  the equation.

A primitive with no run rule is run with its bodies lowered as they stand
(``shard_map`` ...); one with no thread rule raises ``YaxError`` naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.extend import core as jex

from yax._src.compat import scan_num_consts, scan_params_with_inputs
from yax._src.errors import SubstitutionError, YaxError
from yax._src.ir import lower as _lower
from yax._src.ir.nodes import Equation, Mox, Var

CHECKPOINT = ('checkpoint', 'remat2', 'remat')
JIT = ('jit', 'pjit')


# --------------------------------------------------------------- running

def _traced_bodies(interp, eqn: Equation) -> list:
  """Each body as ``(jaxpr, consts)``: the interpreter, traced."""
  out = []
  for body in eqn.children:
    def run(*args, body=body):
      return interp.run_body(body, args)
    closed = jax.make_jaxpr(run)(*[s.aval for s in body.inputs])
    out.append((closed.jaxpr, list(closed.consts)))
  return out


def _keep_consts(interp, eqn):
  """Primitives whose closed bodies may carry constants (scan, jit, while,
  custom_jvp_call ...): the traced bodies are used as they are."""
  bodies = []
  for i, ((jaxpr, consts), form) in enumerate(
      zip(_traced_bodies(interp, eqn), eqn.body_forms, strict=True)):
    jaxpr = _named(eqn, i, jaxpr)
    if form == _lower.CLOSED:
      bodies.append(_lower.make_closed(jaxpr, consts))
    elif consts:
      raise YaxError(
          f'cannot evaluate {eqn.prim.name}: its body traced to '
          f'{len(consts)} constants, which an open Jaxpr cannot hold')
    else:
      bodies.append(jaxpr)
  return _lower.set_bodies(eqn, bodies), list(eqn.inputs)


def _const_symbols(interp, consts) -> list[Var]:
  """Fresh symbols holding ``consts`` in the interpreter's environment."""
  out = []
  for c in consts:
    sym = Var(jax.typeof(c))
    interp.write(sym, c)
    out.append(sym)
  return out


def _hoist_leading(interp, eqn):
  """``checkpoint`` (``nn.remat``): constants become leading inputs (the
  equation's inputs are exactly its body's inputs)."""
  ((jaxpr, consts),) = _traced_bodies(interp, eqn)
  jaxpr = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
  jaxpr = _named(eqn, 0, jaxpr)
  body = jaxpr if eqn.body_forms[0] == _lower.OPEN else _lower.make_closed(
      jaxpr, [])
  return (_lower.set_bodies(eqn, [body]),
          [*_const_symbols(interp, consts), *eqn.inputs])


def _hoist_cond(interp, eqn):
  """``cond``: branches take no constants; each branch's constants become
  operands that the other branches ignore."""
  traced = _traced_bodies(interp, eqn)
  every = [v for jaxpr, _ in traced for v in jaxpr.constvars]
  branches = []
  for i, (jaxpr, _) in enumerate(traced):
    own = {id(v) for v in jaxpr.constvars}
    lead = [v if id(v) in own else jex.Var(v.aval) for v in every]
    jaxpr = jaxpr.replace(constvars=[], invars=[*lead, *jaxpr.invars])
    branches.append(_lower.make_closed(_named(eqn, i, jaxpr), []))
  consts = _const_symbols(interp, [c for _, cs in traced for c in cs])
  index, *ops = eqn.inputs
  return _lower.set_bodies(eqn, branches), [index, *consts, *ops]


def _named(eqn, i, jaxpr):
  info = eqn.children[i].debug_info
  info = _lower.debug_info_for(info, len(jaxpr.invars), len(jaxpr.outvars))
  return jaxpr if info is None else jaxpr.replace(debug_info=info)


# rule(interpreter, eqn) -> (params with bodies, input symbols)
RunRule = Callable[[Any, Equation], tuple[dict, list]]

RUN_RULES: dict[str, RunRule] = {
    'scan': _keep_consts, 'while': _keep_consts, 'closed_call': _keep_consts,
    'core_call': _keep_consts, 'custom_jvp_call': _keep_consts,
    'custom_vjp_call': _keep_consts,
    **{name: _keep_consts for name in JIT},
    **{name: _hoist_leading for name in CHECKPOINT},
    'cond': _hoist_cond,
}


def _lowered(interp, eqn):
  """Any other primitive (``shard_map`` ...): the bodies lowered as they
  stand, module calls inlined. Nothing is traced outside the primitive's
  own context (a ``shard_map`` body may use collectives over its mesh
  axes); a body must then lower without constants of its own."""
  del interp
  return _lower.equation_params(eqn), list(eqn.inputs)


def run_rule(eqn: Equation) -> RunRule:
  return RUN_RULES.get(eqn.prim.name, _lowered)


# ------------------------------------------------------------- threading

@dataclasses.dataclass
class Threaded:
  """What a threading rule returns: the equation's new inputs, bodies and
  params, and for each value passed in, ``(key, outer symbol)``."""
  inputs: list
  bodies: list
  params: dict
  outer: list


@dataclasses.dataclass
class Needed:
  """A value that body ``body`` needs from outside: ``inner`` is the body's
  symbol for it, ``key`` identifies it (a variable location), ``sibling``
  the position among the body's inputs of another variable of the same
  module (``scan`` passes the value the way it passes that one), if any."""
  body: int
  key: Any
  inner: Var
  sibling: int | None = None


def _append_all(eqn, inputs, bodies, params, needed):
  """Primitives whose inputs are their body's inputs (jit, checkpoint,
  closed_call): one new input at the end of both."""
  bodies = list(bodies)
  outer = []
  for n in needed:
    bodies[n.body] = bodies[n.body].replace(
        inputs=[*bodies[n.body].inputs, n.inner])
    outer.append((n.key, Var(n.inner.aval)))
  return Threaded([*inputs, *(v for _, v in outer)], bodies, params, outer)


def _thread_jit(eqn, inputs, bodies, params, needed):
  out = _append_all(eqn, inputs, bodies, params, needed)
  params = dict(params)
  k = len(needed)
  params['donated_invars'] = (*params['donated_invars'], *[False] * k)
  if 'in_layouts' in params:
    params['in_layouts'] = (*params['in_layouts'], *[None] * k)
  from yax._src.compat import UNSPECIFIED
  params['in_shardings'] = (*params['in_shardings'], *[UNSPECIFIED] * k)
  out.params = params
  return out


def _thread_scan(eqn, inputs, bodies, params, needed):
  """A value whose siblings are scanned over (Flax's default
  ``variable_axes={'params': 0}``) is a new scanned input of shape
  ``[length, *shape]``; otherwise a new loop constant."""
  (body,) = bodies
  num_consts, length = scan_num_consts(params), params['length']
  is_const = [n.sibling is not None and n.sibling < num_consts or
              isinstance(n.key, ConstKey) for n in needed]
  consts = [n for n, c in zip(needed, is_const, strict=True) if c]
  xs = [n for n, c in zip(needed, is_const, strict=True) if not c]
  outer_c = [(n.key, Var(n.inner.aval)) for n in consts]
  outer_x = [(n.key, Var(n.inner.aval.update(
      shape=(length, *n.inner.aval.shape)))) for n in xs]
  b_in = list(body.inputs)
  body = body.replace(inputs=[*b_in[:num_consts], *(n.inner for n in consts),
                              *b_in[num_consts:], *(n.inner for n in xs)])
  inputs = [*inputs[:num_consts], *(v for _, v in outer_c),
            *inputs[num_consts:], *(v for _, v in outer_x)]
  params = scan_params_with_inputs(params, len(consts), len(xs))
  return Threaded(inputs, [body], params, outer_c + outer_x)


def _thread_cond(eqn, inputs, bodies, params, needed):
  """A new operand for every branch; branches that do not read it ignore
  it."""
  bodies = list(bodies)
  outer = []
  for n in needed:
    for i, b in enumerate(bodies):
      extra = n.inner if i == n.body else Var(n.inner.aval)
      bodies[i] = b.replace(inputs=[*b.inputs, extra])
    outer.append((n.key, Var(n.inner.aval)))
  return Threaded([*inputs, *(v for _, v in outer)], bodies, params, outer)


def _thread_while(eqn, inputs, bodies, params, needed):
  """A loop constant of the condition or of the body (loop-invariant)."""
  bodies = list(bodies)
  inputs = list(inputs)
  params = dict(params)
  outer = []
  for n in needed:
    key = eqn.body_keys[n.body]
    nc, nb = params['cond_nconsts'], params['body_nconsts']
    b = bodies[n.body]
    var = Var(n.inner.aval)
    if key == 'cond_jaxpr':
      bodies[n.body] = b.replace(inputs=[*b.inputs[:nc], n.inner,
                                         *b.inputs[nc:]])
      inputs.insert(nc, var)
      params['cond_nconsts'] = nc + 1
    else:
      bodies[n.body] = b.replace(inputs=[*b.inputs[:nb], n.inner,
                                         *b.inputs[nb:]])
      inputs.insert(nc + nb, var)
      params['body_nconsts'] = nb + 1
    outer.append((n.key, var))
  return Threaded(inputs, bodies, params, outer)


class ConstKey(tuple):
  """The key of a constant (of a replacement) passed into a body: it is
  loop-invariant, so ``scan`` passes it as a constant."""


# Primitives whose closed bodies may hold constants themselves; a constant
# in any other body is passed in from outside as an input.
CONSTS_IN_BODY = frozenset({'scan', 'while', 'closed_call', 'core_call',
                            'custom_jvp_call', 'custom_vjp_call', *JIT})

ThreadRule = Callable[..., Threaded]

THREAD_RULES: dict[str, ThreadRule] = {
    'scan': _thread_scan, 'cond': _thread_cond, 'while': _thread_while,
    'closed_call': _append_all, 'core_call': _append_all,
    **{name: _append_all for name in CHECKPOINT},
    **{name: _thread_jit for name in JIT},
}


def thread(eqn: Equation, inputs, bodies: list[Mox], params: dict,
           needed: list[Needed], where: str) -> Threaded:
  """Passes ``needed`` values into the bodies of ``eqn`` from outside."""
  rule = THREAD_RULES.get(eqn.prim.name)
  if rule is None:
    raise SubstitutionError(
        f'cannot pass new values ({", ".join(_key_text(n.key) for n in needed)}'
        f') into the body of {where}: YAX has no rule for threading inputs '
        f'through {eqn.prim.name!r} bodies (it has rules for '
        f'{", ".join(sorted(THREAD_RULES))})')
  return rule(eqn, list(inputs), list(bodies), dict(params), needed)


def _key_text(key) -> str:
  return '/'.join(map(str, key)) if isinstance(key, tuple) else str(key)


# --------------------------------------------------- body inputs, outside

def _same_positions(eqn, index):
  return list(range(len(eqn.children[index].inputs)))


def _cond_positions(eqn, index):
  return [i + 1 for i in range(len(eqn.children[index].inputs))]


def _while_positions(eqn, index):
  nc, nb = eqn.params['cond_nconsts'], eqn.params['body_nconsts']
  n = len(eqn.children[index].inputs)
  if eqn.body_keys[index] == 'cond_jaxpr':
    return [*range(nc), *range(nc + nb, nc + nb + n - nc)]
  return [*range(nc, nc + nb), *range(nc + nb, nc + nb + n - nb)]


# rule(eqn, body index) -> for each body input, the position of the
# equation input it receives (a ``scan`` body gets one slice of a stacked
# input: the same value per iteration, one row of it).
INPUT_RULES: dict[str, Callable[[Equation, int], list]] = {
    'scan': _same_positions, 'closed_call': _same_positions,
    'core_call': _same_positions, 'custom_jvp_call': _same_positions,
    'custom_vjp_call': _same_positions,
    **{name: _same_positions for name in (*JIT, *CHECKPOINT)},
    'cond': _cond_positions, 'while': _while_positions,
    # A shard_map body gets each input's shard, position for position.
    'shard_map': _same_positions,
}


def body_input_positions(eqn: Equation, index: int) -> list[int]:
  """For each input of body ``index`` of ``eqn``, the position of the
  equation input that it receives."""
  rule = INPUT_RULES.get(eqn.prim.name)
  if rule is None:
    raise YaxError(
        f'YAX has no rule for how {eqn.prim.name!r} passes its inputs to its '
        f'bodies (it has rules for {", ".join(sorted(INPUT_RULES))})')
  positions = rule(eqn, index)
  body = eqn.children[index]
  if len(positions) != len(body.inputs) or max(positions, default=-1) >= len(
      eqn.inputs):
    raise YaxError(
        f'{eqn.prim.name}: body {eqn.body_keys[index]!r} has '
        f'{len(body.inputs)} inputs, which do not match the equation\'s '
        f'{len(eqn.inputs)} inputs')
  return positions


def body_input_sources(eqn: Equation, index: int) -> list:
  """For each input of body ``index`` of ``eqn``, the equation input (a
  symbol of the enclosing scope) that it receives."""
  return [eqn.inputs[p] for p in body_input_positions(eqn, index)]
