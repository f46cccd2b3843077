"""Jaxpr-style text for module expressions.

The tree is converted to a *display Jaxpr* in which each module call is one
equation of a ``module_call`` primitive (never bound, only printed) whose
body is printed as a nested ``{ lambda ; ... }`` block. JAX's own printer
then does the naming and line breaking, so a tree without module calls prints
exactly as ``jax.make_jaxpr`` does, and a symbol has one name in the whole
text.
"""

from __future__ import annotations

from jax.extend import core as jex

from yax._src import compat as _compat
from yax._src.ir import lower as _lower
from yax._src.ir.lower import dynamic, jax_equation, new_jaxpr_eqn
from yax._src.errors import YaxError
from yax._src.ir.nodes import (Equation, Expr, Mox, iter_nodes,
                               register_view)
from yax._src.ir.text import escape_text, format_value

module_call_p = jex.Primitive('module_call')
module_call_p.multiple_results = True
# The body of a module call printed below the depth asked for: one line
# that says how much it holds (never bound, only printed).
folded_p = jex.Primitive('folded')
folded_p.multiple_results = True


class _Body:
  """Holds a module body; not a Jaxpr, so JAX does not hoist it."""

  def __init__(self, jaxpr):
    self.jaxpr = jaxpr


def module_attributes(mox: Mox) -> list[tuple[str, str]]:
  """(key, text) pairs shown for a module call: type, name, path, method,
  then the module fields (``None`` fields omitted). Characters that XML
  cannot hold are escaped as in the XML view (``\\x01``), so any field
  value prints."""
  out = []
  if mox.module_ty is not None:
    out.append(('type', escape_text(mox.module_ty.__name__)))
  if mox.name is not None:
    out.append(('name', escape_text(str(mox.name))))
  if mox.path:
    out.append(('path', escape_text('/'.join(map(str, mox.path)))))
  if mox.entrypoint is not None:
    out.append(('method', escape_text(str(mox.entrypoint))))
  for key, value in mox.params.items():
    if key == 'name':
      continue
    text = format_value(value, bools='python')
    if text is not None:
      out.append((escape_text(str(key)), text))
  return out


def _pp_module_call(eqn, context, settings):
  pp = _compat.pp
  mox: Mox = eqn.params['mox']
  body = eqn.params['body'].jaxpr
  lhs = _compat.pp_vars(eqn.outvars, context,
                        print_shapes=settings.print_shapes)
  attrs = [(k, v) for k, v in module_attributes(mox)]
  if mox.is_ephemeral:
    attrs.insert(0, ('ephemeral', 'True'))
  if mox.rewritten:
    attrs.append(('rewritten', 'True'))
  skeleton = _compat.pp_jaxpr_skeleton(
      body, lambda: _compat.pp_eqns(body.eqns, context, settings),
      context, settings)
  rhs = [pp.text('module_call'), _compat.pp_kv_pairs(attrs, context, settings),
         pp.text(' '), skeleton]
  if eqn.outvars:
    return pp.concat([lhs, pp.text(' = '), *rhs])
  return pp.concat(rhs)


if _compat.HAVE_PRINTER:
  _compat.pp_eqn_rules[module_call_p] = _pp_module_call


class _Display:
  """Builds the display Jaxpr; module calls more than ``depth`` levels
  below the printed node show a folded body (``None``: all)."""

  def __init__(self, depth: int | None = None, level: int = 0, jv=None):
    self.jv = _lower.JaxVars() if jv is None else jv
    self.depth = depth
    self.level = level

  def eqns(self, children) -> list:
    out = []
    for child in children:
      if isinstance(child, Mox):
        out.append(self.module_call(child))
      else:
        out.append(self.equation(child))
    return out

  def module_call(self, mox: Mox):
    jv = self.jv
    invars = [jv(s) for s in dynamic(mox.inputs)]
    outvars = [jv(s) for s in dynamic(mox.outputs)]
    level = self.level + (0 if mox.is_ephemeral else 1)
    if self.depth is not None and level > self.depth and mox.children:
      eqns = [_folded(mox, invars, outvars)]
    else:
      inner = _Display(self.depth, level, jv)
      eqns = inner.eqns(mox.children)
    body = jex.Jaxpr([], [v for v in invars if isinstance(v, jex.Var)],
                     outvars, eqns,
                     debug_info=_lower.new_debug_info('yax.print'))
    binders = [v for v in outvars if isinstance(v, jex.Var)]
    return new_jaxpr_eqn(invars, binders, module_call_p,
                             {'mox': mox, 'body': _Body(body)}, frozenset())

  def equation(self, eqn: Equation):
    if not eqn.children:
      return jax_equation(eqn, self.jv)
    shown = [_Display(self.depth, self.level).closed(body)
             for body in eqn.children]
    shown = [s if form == _lower.CLOSED else s.jaxpr
             for s, form in zip(shown, eqn.body_forms, strict=True)]
    return jax_equation(eqn, self.jv, _lower.set_bodies(eqn, shown))

  def closed(self, mox: Mox) -> jex.ClosedJaxpr:
    jv = self.jv
    constvars = [jv(s) for s in mox.constvars]
    # Array literals are not binders (they occur when a single equation or
    # module call with a literal operand is printed on its own).
    invars = [v for v in map(jv, dynamic(mox.inputs)) if isinstance(v, jex.Var)]
    eqns = self.eqns(mox.children)
    outvars = [jv(s) for s in dynamic(mox.outputs)]
    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    return _lower.make_closed(
        jex.Jaxpr(constvars, invars, outvars, eqns, effects,
                  _lower.new_debug_info('yax.print')), mox.consts)


def _folded(mox: Mox, invars, outvars):
  """One ``folded`` equation standing for the body of ``mox``."""
  below = [n for n in iter_nodes(mox) if n is not mox]
  calls = sum(1 for n in below if isinstance(n, Mox) and not n.is_ephemeral)
  equations = sum(1 for n in below if isinstance(n, Equation))
  ins = [v for v in invars if isinstance(v, jex.Var)]
  binders = [v for v in dict.fromkeys(outvars)
             if isinstance(v, jex.Var) and v not in ins]
  return new_jaxpr_eqn(ins, binders, folded_p,
                       {'module_calls': calls, 'equations': equations},
                       frozenset())


def display_jaxpr(expr: Expr, depth: int | None = None) -> jex.ClosedJaxpr:
  """The Jaxpr that ``str(expr)`` prints (module calls as equations);
  module calls more than ``depth`` levels down show folded bodies."""
  display = _Display(depth)
  if isinstance(expr, Equation):
    wrapper = Mox(expr.inputs, expr.outputs, children=[expr])
    return display.closed(wrapper)
  if not expr.is_ephemeral:
    # A module call on its own prints as a function of its inputs.
    return display.closed(Mox(expr.inputs, expr.outputs, children=[expr]))
  return display.closed(expr)


def pp_expr(expr: Expr) -> str:
  if not _compat.HAVE_PRINTER:  # pragma: no cover - depends on JAX version
    return repr(expr)
  return str(display_jaxpr(expr))


def pformat(expr: Expr, *, depth: int | None = None) -> str:
  """The text ``print(expr)`` shows, module calls folded below ``depth``.

  **Arguments:**
  - ``expr``: a tree, a module call or an equation.
  - ``depth``: how many levels of module calls show their bodies (the
    node itself is level 1 when it is a module call). A call further down
    still shows its header (type, name, path, fields), but its body is one
    line, ``folded[equations=.. module_calls=..]``, with the same inputs
    and outputs. ``None`` shows everything, as ``str`` does.

  **Returns:** the text.

  Example::

      print(yax.pformat(mox, depth=2))   # the model and its direct children
  """
  if depth is not None and (not isinstance(depth, int) or
                            isinstance(depth, bool) or depth < 0):
    raise YaxError(f'pformat: depth must be an int >= 0 or None, found '
                   f'{depth!r}')
  if not isinstance(expr, Expr):
    raise YaxError(f'pformat expects a Mox or an Equation, found '
                   f'{type(expr).__name__}')
  if not _compat.HAVE_PRINTER:  # pragma: no cover - depends on JAX version
    return repr(expr)
  return str(display_jaxpr(expr, depth))


# str(expr): the data model (``ir/nodes.py``) does not import this module.
register_view('text', pp_expr)
