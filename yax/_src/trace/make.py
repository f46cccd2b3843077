"""Tracing: any JAX callable -> module expression (MoX).

How it works, in three steps, all on public APIs:

1. ``jax.make_jaxpr`` traces the function while every module system's
   interception is active (``systems.TraceScope``: Linen's in ``linen.py``,
   NNX's in ``nnx.py``, Equinox's in ``equinox.py``), under a fresh
   value of a JAX user context, so that JAX's caches neither serve this
   trace an entry made without markers nor keep one for later plain calls.
2. The interception wraps every module method call in boundary markers
   (see ``trace/markers.py``): ``yax_enter(*variables, *args)`` before the call
   and ``yax_exit(*outputs)`` after it, and records what the call was (module
   class, fields, path, argument and output trees) under a fresh call id.
3. A small interpreter walks the Jaxpr, opening a ``module_call`` node at each
   enter marker and closing it at the matching exit marker. Markers are
   dropped; marker outputs become aliases of marker inputs, so a module call
   reads and writes the same symbols as the code around it. A call's
   variables are those its module reaches that its body reads; bodies of equations become ``Equation.children``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import jax
import numpy as np
from jax.extend import core as jex

from yax._src.errors import TraceError, TraceWarning
from yax._src.ir import lower as _lower
from yax._src.ir.nodes import Equation, Literal, Mox, Symbol, Var
from yax._src.ir.variables import is_variable_treedef
from yax._src.trace import calls as _calls
from yax._src.trace import markers as _markers
from yax._src.trace import nnx_variables as _nnx_variables
from yax._src.trace import systems as _systems
from yax._src.trace.calls import CallRecord

tree_flatten = jax.tree_util.tree_flatten
tree_unflatten = jax.tree_util.tree_unflatten


# ----------------------------------------------------------------- leaves

def is_dynamic_arg(x) -> bool:
  """At the root, arrays and Python numbers are traced; everything else
  (``bool``, strings, other objects) is static and baked into the trace."""
  if isinstance(x, (bool, np.bool_)):
    return False
  return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex,
                        jax.core.Tracer, jax.ShapeDtypeStruct))


def _is_jax_output(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex,
                        bool, jax.core.Tracer))


# Every trace runs with this JAX user context set. JAX keys its tracing,
# lowering and compilation caches on it (``jax.make_user_context``), so a YAX
# trace never reuses a Jaxpr that ``jax.jit`` (or Flax's ``nn.jit``) traced
# without markers, and no plain call reuses one traced with markers. YAX
# traces share their entries (a cached Jaxpr's markers carry their call
# records), so jitted helpers such as the ``eval_shape`` of Flax's
# initializers are traced once, not once per ``make_mox``. The user's cache
# entries stay where they are: nothing is cleared.
_trace_context = jax.make_user_context(default_value=None)
_WITH_MARKERS = 'yax: module call markers'



# Primitives whose body's outputs are the equation's outputs and whose
# body's inputs are the equation's inputs, one for one: an output the body
# forwards from an input is that input.
_FORWARDING = frozenset({'jit', 'pjit'})


# ------------------------------------------------------------ make_mox

def make_mox(fn: Callable, **jaxpr_kwargs) -> Callable[..., Mox]:
  """Returns a function that traces ``fn`` into a module expression.

  **Arguments:**
  - ``fn``: any JAX callable: ``model.apply``, ``model.init``, a Hugging Face
    Flax model (``model(input_ids, params=...)``) or a plain function.
  - ``jaxpr_kwargs``: passed to ``jax.make_jaxpr`` (e.g. ``axis_env``).

  **Returns:** ``trace(*args, **kwargs) -> Mox``. The root is ephemeral (it
  stands for ``fn``); its ``inputs`` are the leaves of ``(args, kwargs)`` and
  its ``outputs`` the leaves of ``fn``'s result. Arrays and Python numbers are
  dynamic inputs; ``bool``, strings and other objects are static.

  Example::

      mox = yax.make_mox(model.apply)(variables, x)
      print(mox)
  """
  if not callable(fn):
    raise TraceError(f'make_mox expects a callable, found {type(fn).__name__}: '
                     f'{fn!r}')

  @functools.wraps(fn)
  def trace(*args, **kwargs) -> Mox:
    # NNX graph nodes among the arguments are split as nnx.split does; an
    # Equinox module's leaves that are not arrays are static.
    scope = _systems.TraceScope(args, kwargs)
    leaves, in_tree = scope.leaves, scope.in_tree
    dyn = [i for i, x in enumerate(leaves)
           if is_dynamic_arg(x) and i not in scope.static]
    out_info = {}

    this = _calls.Trace()
    active = _calls.active()

    def flat_fn(*dyn_vals):
      this.enter_root(dyn_vals)
      full = list(leaves)
      for i, v in zip(dyn, dyn_vals, strict=True):
        full[i] = v
      a, k = tree_unflatten(in_tree, full)
      with scope.active(this, a, k):
        out = _calls.call_with_stack_room(scope.call, (fn, a, k), {})
      out_leaves, out_tree = tree_flatten(out)
      out_dyn = [i for i, x in enumerate(out_leaves) if _is_jax_output(x)]
      out_info.update(tree=out_tree, leaves=out_leaves, dyn=out_dyn)
      return [out_leaves[i] for i in out_dyn]

    active.append(this)
    try:
      with _trace_context(_WITH_MARKERS):
        closed = jax.make_jaxpr(flat_fn, **jaxpr_kwargs)(
            *[leaves[i] for i in dyn])
    finally:
      active.pop()
    builder = _Builder()
    # Why the collector is paused: the builder allocates one node per
    # equation and frees nothing, so the collections that these allocations
    # trigger find no garbage; each one only rescans the objects the trace
    # just made (a fifth of the build time on an NNX Transformer).
    collecting = gc.isenabled()
    gc.disable()
    try:
      root = build_root(builder, closed, leaves, in_tree, dyn, out_info)
    finally:
      if collecting:
        gc.enable()
    for record, why in builder.left_out.items():
      warnings.warn(TraceWarning(
          f"the call {_call_name(record)} is not recorded as a module_call: "
          f"{why}; its equations stay in the enclosing body, so the tree "
          "still computes what the function computes"), stacklevel=2)
    return root

  return trace


# Bodies never opened: a custom derivative rule belongs to the function its
# body computes, so a rewrite inside would change the value and not the
# derivative.
_SEALED = frozenset({'custom_jvp_call', 'custom_vjp_call', 'custom_lin'})


def opened(eqn: Equation) -> Equation | None:
  """``eqn`` with the Jaxprs in its parameters built into ``children``
  bodies, as the tree builder does for bodies that call modules; for an
  equation whose bodies call none (a ``jit``-ed helper, the ``shard_map``
  of a mixture of experts). None when it holds no such body, or when it
  is a ``custom_jvp_call``/``custom_vjp_call``.

  The tree keeps ``eqn`` as it is; pattern matching searches the bodies of
  this equivalent equation, and a rewrite inside them puts it (rewritten)
  in the new tree. Built once per equation (``eqn`` is immutable)."""
  if eqn.children or eqn.prim.name in _SEALED:
    return None
  found = _OPENED.get(eqn, False)
  if found is not False:
    return found
  bodies = _lower.body_params(eqn.params)
  result = None
  if bodies:
    builder = _Builder()
    params = dict(eqn.params)
    for key, _, _ in bodies:
      params.pop(key[0] if isinstance(key, tuple) else key, None)
    result = eqn.replace(
        params=params, children=[builder.subtree(v) for _, v, _ in bodies],
        body_keys=[k for k, _, _ in bodies],
        body_forms=[f for _, _, f in bodies])
  _OPENED[eqn] = result
  return result


def map_mox(fn: Callable, mox) -> list:
  """Calls ``fn`` on every node of the tree in pre-order; returns the results.

  **Arguments:**
  - ``fn``: called as ``fn(node)`` for the root, then each child, depth first.
  - ``mox``: the tree (or any node of it).

  **Returns:** the list of ``fn``'s return values, in visiting order.

  Every node includes the equations in the bodies an equation holds as
  Jaxpr parameters although they call no module (a ``jit``-ed helper, the
  ``shard_map`` of a mixture of experts: see :func:`opened`), visited after
  the equation that holds them: a pattern match can lie there, and every
  equation of a ``yax.Match`` is one that ``map_mox`` visits. Such a body
  is visited as its equations only: it is no module call, so ``fn`` never
  sees a :class:`Mox` that the XML view does not show.

  Example: ``yax.map_mox(lambda n: n, mox)`` lists every node;
  ``[n for n in that if isinstance(n, yax.Mox)]`` are the tree's
  ``module_call`` elements.
  """
  out = []
  stack = [mox]
  while stack:
    node = stack.pop()
    out.append(fn(node))
    children = getattr(node, 'children', ())
    if not children and isinstance(node, Equation):
      holder = opened(node)
      # The opened bodies' own nodes (equations), not the bodies.
      children = ([c for body in holder.children for c in body.children]
                  if holder is not None else ())
    stack.extend(reversed(children))
  return out


_OPENED: 'weakref.WeakKeyDictionary[Equation, Equation | None]' = \
    weakref.WeakKeyDictionary()


def _call_name(rec: CallRecord) -> str:
  return (f"{rec.module_ty.__name__}.{rec.method} at path "
          f"'{'/'.join(rec.path) or '<root>'}'")


def build_root(builder, closed, leaves, in_tree, dyn, out_info) -> Mox:
  jaxpr = closed.jaxpr
  constvars = [builder.bind(v) for v in jaxpr.constvars]
  builder.roots = [builder.bind(v) for v in jaxpr.invars]
  invars = iter(builder.roots)
  dyn_set = set(dyn)
  inputs = [next(invars) if i in dyn_set else Literal(x)
            for i, x in enumerate(leaves)]
  children = builder.build_body(jaxpr)
  builder.roots = None
  outvars = iter(builder.read(v) for v in jaxpr.outvars)
  out_dyn = set(out_info['dyn'])
  outputs = [next(outvars) if i in out_dyn else Literal(x)
             for i, x in enumerate(out_info['leaves'])]
  return Mox(inputs, outputs, {}, children=children, in_tree=in_tree,
             out_tree=out_info['tree'], constvars=constvars,
             consts=list(closed.consts), debug_info=jaxpr.debug_info)


# -------------------------------------------------------- tree builder

def _is_symbol(x) -> bool:
  return isinstance(x, Symbol)


def _read_part(tree, reads: set):
  """The nested dicts of ``tree`` (Linen collections and scopes, symbols
  at the leaves, boxes such as ``nn.Partitioned`` kept whole) with only
  the variables whose symbols are all in ``reads``; empty dicts dropped."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      value = _read_part(value, reads)
      if value:
        out[key] = value
    elif all(s in reads for s in _symbols(value)):
      out[key] = value
  return out


def _symbols(tree) -> list:
  if isinstance(tree, Symbol):  # most variables: one symbol, no tree walk
    return [tree]
  return jax.tree_util.tree_leaves(tree, is_leaf=_is_symbol)


def contains_markers(jaxpr) -> bool:
  for eqn in _lower.open_part(jaxpr).eqns:
    if eqn.primitive in _markers.MARKERS:
      return True
    if any(contains_markers(j) for _, j, _ in _lower.body_params(eqn.params)):
      return True
  return False


@dataclasses.dataclass
class _Frame:
  call_id: CallRecord | None
  record: CallRecord | None
  var_inputs: list
  arg_inputs: list
  children: list


class _Builder:
  """Turns a Jaxpr with markers into a tree, one scope at a time."""

  def __init__(self):
    self.env: dict[Any, Symbol] = {}
    # The root's dynamic inputs while its body is built (``var_refs`` of
    # the calls in it point there); None while building any other body.
    self.roots: list | None = None
    # Calls seen but not recorded as nodes -> why (one warning each).
    self.left_out: dict[CallRecord, str] = {}
  def bind(self, v) -> Var:
    sym = Var(v.aval, dropped=isinstance(v, _lower.JaxDropVar))
    self.env[v] = sym
    return sym

  def read(self, v) -> Symbol:
    if isinstance(v, jex.Literal):
      return Literal(v.val, v.aval)
    return self.env[v]

  def build_body(self, jaxpr) -> list:
    root = _Frame(None, None, [], [], [])
    stack = [root]
    body = root.children
    enter_p, exit_p = _markers.enter_p, _markers.exit_p
    env, read = self.env, self.read
    taking, body_params, drop = Equation._taking, _lower.body_params, \
        _lower.JaxDropVar
    for eqn in jaxpr.eqns:
      prim = eqn.primitive
      if prim is enter_p:
        ins = [read(v) for v in eqn.invars]
        n = eqn.params['num_vars']
        for o, s in zip(eqn.outvars, ins[n:], strict=True):
          env[o] = s
        record = eqn.params['call_id'].record
        var_inputs = ins[:n]
        if record.var_refs is not None:
          var_inputs = self._referenced(record, var_inputs)
        stack.append(_Frame(record, record, var_inputs, ins[n:], []))
        body = stack[-1].children
      elif prim is exit_p:
        outs = [read(v) for v in eqn.invars]
        for o, s in zip(eqn.outvars, outs, strict=True):
          env[o] = s
        record = eqn.params['call_id'].record
        depth = next((i for i in range(len(stack) - 1, 0, -1)
                      if stack[i].record is record), None)
        if depth is None:  # entered in another JAX trace
          self.leave_out(record)
          continue
        while len(stack) - 1 > depth:  # calls ended by a caught exception
          self.dissolve(stack)
        frame = stack.pop()
        body = stack[-1].children
        body.append(self._module_call(frame, outs))
      elif found := body_params(eqn.params):
        body.append(self.equation(eqn, found))
      else:
        # An equation without bodies (most of them), with ``read`` and
        # ``bind`` inlined, since this runs once per traced equation.
        try:
          inputs = [env[v] for v in eqn.invars]
        except TypeError:  # a literal (unhashable) among them
          inputs = [read(v) for v in eqn.invars]
        outputs = []
        for v in eqn.outvars:
          sym = Var(v.aval, dropped=isinstance(v, drop))
          env[v] = sym
          outputs.append(sym)
        body.append(taking(prim, inputs, outputs, eqn.params, eqn.effects,
                           eqn.source_info, eqn.ctx))
    while len(stack) > 1:  # no exit here: an exception, or another trace
      self.dissolve(stack)
    return root.children

  def _referenced(self, record: CallRecord, bound: list) -> list:
    """A call's variables: those its marker carries, and the root inputs
    it names by position (``CallRecord.var_refs``)."""
    if self.roots is None:
      raise TraceError(
          f'internal: the call {_call_name(record)} names root inputs as its '
          'variables, but its markers are not in the root body')
    carried = iter(bound)
    roots = self.roots
    found = [next(carried) if r is None else roots[r]
             for r in record.var_refs]
    if next(carried, None) is not None:
      raise TraceError(f'internal: the call {_call_name(record)} carries '
                       'more variables than its record names')
    return found

  def leave_out(self, record: CallRecord) -> None:
    if record.failed:
      why = (f'it ended in an exception ({record.failed}) that the traced '
             'function caught')
    else:
      why = ('it started and ended in two different JAX traces (a method '
             'entered in one transformation and left in another)')
    self.left_out.setdefault(record, why)

  def dissolve(self, stack: list) -> None:
    """Leaves the innermost open call out of the tree: its body's
    equations and module calls go to the enclosing body, and its variables
    to the enclosing call's."""
    frame = stack.pop()
    parent = stack[-1]
    parent.children.extend(frame.children)
    self.leave_out(frame.record)

  def _module_call(self, frame: _Frame, dyn_outs) -> Mox:
    rec = frame.record
    arg_syms, out_syms = frame.arg_inputs, dyn_outs
    if rec.arg_statics:
      args = iter(arg_syms)
      arg_syms = [Literal(rec.arg_statics[i]) if i in rec.arg_statics
                  else next(args) for i in range(rec.num_arg_leaves)]
    if rec.out_statics:
      outs = iter(out_syms)
      out_syms = [Literal(rec.out_statics[i]) if i in rec.out_statics
                  else next(outs) for i in range(rec.num_out_leaves)]
    var_inputs, var_tree = self._variables(frame, out_syms)
    mox = Mox(var_inputs + arg_syms, out_syms, dict(rec.params),
              children=frame.children, module_ty=rec.module_ty,
              entrypoint=rec.method, path=rec.path, in_tree=rec.in_tree,
              out_tree=rec.out_tree, var_tree=var_tree)
    return mox

  def _variables(self, frame: _Frame, outs: list):
    """The call's variables: of those its marker carried (every variable
    its module reaches), the ones its body reads, directly or through the
    calls and equations in it, or returns. One rule for every module
    system; a variable computed inside the call (a kernel tied to an
    embedding table, a param created by ``init``) is not carried."""
    rec = frame.record
    reads = {s for child in frame.children for s in child.inputs}
    reads.update(outs)
    if is_variable_treedef(rec.var_tree):
      return _nnx_variables.read_only(rec.var_tree, frame.var_inputs, reads)
    if all(sym in reads for sym in frame.var_inputs):
      return list(frame.var_inputs), rec.var_tree
    kept = _read_part(tree_unflatten(rec.var_tree, frame.var_inputs), reads)
    return tree_flatten(kept, is_leaf=_is_symbol)

  def equation(self, eqn, found: list) -> Equation:
    """An equation whose parameters hold Jaxprs (``found``, as
    ``_lower.body_params`` lists them); ``build_body`` builds the others."""
    inputs = [self.read(v) for v in eqn.invars]
    params = dict(eqn.params)
    # A parameter holding a body with module calls moves, whole, into the
    # children (all elements of a tuple parameter such as ``branches``).
    moved = {key[0] if isinstance(key, tuple) else key
             for key, value, _ in found if contains_markers(value)}
    bodies, keys, forms = [], [], []
    for key, value, form in found:
      name = key[0] if isinstance(key, tuple) else key
      if name in moved:
        bodies.append(self.subtree(value))
        keys.append(key)
        forms.append(form)
        params.pop(name, None)
    outputs = [self.bind(v) for v in eqn.outvars]
    if eqn.primitive.name in _FORWARDING and 'jaxpr' in eqn.params:
      # A jit body that gives back one of its inputs as it is (an
      # ``nnx.jit`` method returns every Variable of its module, changed or
      # not): what reads that output reads the input, so a kernel passed
      # through stays the parameter it is, not a value computed by the jit.
      body = _lower.open_part(eqn.params['jaxpr'])
      position = {v: j for j, v in enumerate(body.invars)}
      for i, v in enumerate(body.outvars):
        j = position.get(v) if not isinstance(v, jex.Literal) else None
        if j is not None and not isinstance(eqn.outvars[i], _lower.JaxDropVar):
          self.env[eqn.outvars[i]] = inputs[j]
    built = Equation(eqn.primitive, inputs, outputs, params, children=bodies,
                     body_keys=keys, body_forms=forms, effects=eqn.effects,
                     source_info=eqn.source_info, ctx=eqn.ctx)
    return built

  def subtree(self, jaxpr_like) -> Mox:
    """An ephemeral node for a Jaxpr held in an equation's parameters."""
    jaxpr = _lower.open_part(jaxpr_like)
    constvars = [self.bind(v) for v in jaxpr.constvars]
    inputs = [self.bind(v) for v in jaxpr.invars]
    roots, self.roots = self.roots, None  # a body is not the root's scope
    try:
      children = self.build_body(jaxpr)
    finally:
      self.roots = roots
    outputs = [self.read(v) for v in jaxpr.outvars]
    return Mox(inputs, outputs, {}, children=children,
               in_tree=jax.tree_util.tree_structure(list(inputs)),
               out_tree=jax.tree_util.tree_structure(list(outputs)),
               constvars=constvars, consts=_lower.consts_of(jaxpr_like),
               debug_info=jaxpr.debug_info)
