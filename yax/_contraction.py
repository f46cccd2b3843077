"""How a module call contracts its kernel: what LoRA (and, next,
quantization) reads instead of the module's class.

:func:`find` follows a module call's own parameter to the one
``dot_general`` or ``conv_general_dilated`` that reads it, through
everything in between that does not change its values (dtype casts,
transposes) and through the bodies of calls that merely group equations
(``jit``, ``custom_jvp_call``, helper module calls of the same module).
It records:

* the dimension numbers, the kernel's side and the axis permutation from the
  kernel variable to the contraction's operand; the kernel may also be
  computed elementwise from its stored form and values that do not depend
  on the module's inputs (a dequantization: ``q * scale``, NF4's table
  lookup, tiled scales between two reshapes), which sets ``scaled``;
* how the other operand is computed from one input of the module call: a
  chain of one-input equations (casts, reshapes, transposes, padding) to
  replay on the module's input;
* how the contraction's output reaches one output of the module call: a
  chain of one-input equations (casts, reshapes, transposes) and additions
  of values that do not depend on it (a bias), so that a change ``d`` of the
  contraction's output changes that module output by the chain applied to
  ``d``.

Anything else (a kernel read twice, a contraction whose output is scaled or
fed through a nonlinearity before the module returns it) is reported as a
reason string, which the caller turns into a refusal naming the module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.extend.core as jex

from yax import _rules
from yax._ir import Literal, Mox, Symbol

CONTRACTIONS = ('dot_general', 'conv_general_dilated')
# Equations a kernel may pass through on its way to the contraction: they
# keep its values (a transpose only moves axes, which `perm` records; a
# sharding constraint only says where they live, as MaxText's MoE puts on
# its inputs and outputs).
_KERNEL_STEPS = ('convert_element_type', 'copy', 'copy_p', 'transpose',
                 'sharding_constraint')
# One-input equations the other operand may be computed by, from an input
# of the module (replayed on the adapter's input).
_INPUT_STEPS = ('convert_element_type', 'copy', 'copy_p', 'transpose',
                'reshape', 'broadcast_in_dim', 'squeeze', 'expand_dims',
                'pad', 'reduce_precision', 'sharding_constraint')
# One-input linear equations between the contraction and the module output
# (replayed on the change of the contraction's output).
_OUTPUT_STEPS = ('convert_element_type', 'copy', 'copy_p', 'transpose',
                 'reshape', 'squeeze', 'expand_dims', 'reduce_precision',
                 'sharding_constraint')
_ADDS = ('add', 'add_any', 'sub')
# Equations that change a kernel's shape but not the order of its elements
# (a tiled dequantization reshapes into tiles and back).
_KERNEL_VIEWS = ('reshape', 'broadcast_in_dim', 'expand_dims', 'squeeze')
# Elementwise equations a stored kernel may be computed by, with values that
# do not depend on the module's inputs (scales, NF4's levels): a
# dequantization. ``gather`` is NF4's table lookup (the codes index a
# constant table, one value per code).
_KERNEL_ELEMENTWISE = ('mul', 'div', 'add', 'sub', 'neg', 'select_n', 'lt',
                       'le', 'gt', 'ge', 'eq', 'ne', 'and', 'or', 'not',
                       'abs', 'sign', 'max', 'min', 'clamp', 'round',
                       'gather')
# Equations whose body runs exactly once on its inputs (positionally) and
# whose outputs are the body's: looked through.
_CALLS = ('pjit', 'jit', 'closed_call', 'core_call', 'remat', 'checkpoint',
          'custom_jvp_call', 'custom_vjp_call', 'custom_vjp_call_jaxpr')
_RAW_BODY_KEYS = ('jaxpr', 'call_jaxpr', 'fun_jaxpr')


@dataclasses.dataclass(frozen=True)
class Step:
  """One equation to replay: ``prim.bind(*inputs, **params)`` with the
  chained value at ``position`` and literal values elsewhere."""
  prim: Any
  params: tuple  # sorted (name, value) items
  position: int
  literals: tuple  # (position, value) of the other inputs

  def apply(self, value):
    inputs = dict(self.literals)
    inputs[self.position] = value
    return self.prim.bind(*(inputs[i] for i in range(len(inputs))),
                          **dict(self.params))


@dataclasses.dataclass(frozen=True)
class Contraction:
  """How one module call contracts its kernel (see the module docstring)."""
  kernel_index: int  # position among the node's variable inputs
  kind: str  # 'dot_general' or 'conv_general_dilated'
  params: tuple  # the contraction's sorted params items
  kernel_side: int  # 0: the kernel is the lhs operand, 1: the rhs
  perm: tuple  # operand axis j is kernel variable axis perm[j]
  x_index: int  # the module input (position among node.inputs) replayed
  x_steps: tuple  # Steps from that input to the other operand
  operand_aval: Any  # the other operand, as the contraction reads it
  z_aval: Any  # the contraction's output
  y_index: int  # the module output (position among node.outputs) it reaches
  y_steps: tuple  # Steps from the contraction's output to that output
  # The kernel is multiplied by another value on its way (a quantization
  # scale, weight normalisation): the contraction reads a computed kernel.
  scaled: bool = False

  @property
  def dimension_numbers(self):
    return dict(self.params)['dimension_numbers']


@dataclasses.dataclass
class _Flat:
  prim: Any
  params: dict
  inputs: list  # canonical symbols, or ('literal', value)
  outputs: list


class _Flattener:
  """The equations of a module call's body, with call-like bodies inlined
  and every value named by one canonical object."""

  def __init__(self):
    self.alias: dict = {}
    self.eqns: list[_Flat] = []

  def canon(self, sym):
    while sym in self.alias:
      sym = self.alias[sym]
    return sym

  def _input(self, sym):
    if isinstance(sym, Literal):
      return ('literal', sym.value)
    if isinstance(sym, jex.Literal):
      return ('literal', sym.val)
    return self.canon(sym)

  def node_children(self, children):
    for child in children:
      if isinstance(child, Mox):
        self.node_children(child.children)
      elif child.prim.name in _CALLS and len(child.children) == 1:
        body = child.children[0]
        sources = _rules.body_input_sources(child, 0)
        for inner, outer in zip(body.inputs, sources, strict=True):
          if not isinstance(outer, Literal) and inner is not outer:
            self.alias[inner] = self.canon(outer)
        self.node_children(body.children)
        for outer, inner in zip(child.outputs, body.outputs, strict=True):
          if not isinstance(inner, Literal) and outer is not inner:
            self.alias[outer] = self.canon(inner)
      elif child.prim.name in _CALLS and not child.children and \
          _raw_body(child.params) is not None:
        self.raw(_raw_body(child.params), child.inputs, child.outputs)
      else:
        self.eqns.append(_Flat(child.prim, dict(child.params),
                               [self._input(s) for s in child.inputs],
                               list(child.outputs)))

  def raw(self, jaxpr, inputs, outputs):
    jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)
    if len(jaxpr.invars) != len(inputs):
      self.eqns.append(_Flat(None, {}, [self._input(s) for s in inputs],
                             list(outputs)))
      return
    for inner, outer in zip(jaxpr.invars, inputs):
      if not isinstance(outer, Literal):
        self.alias[inner] = self.canon(outer)
    for eqn in jaxpr.eqns:
      body = _raw_body(eqn.params)
      if eqn.primitive.name in _CALLS and body is not None:
        self.raw(body, eqn.invars, eqn.outvars)
      else:
        self.eqns.append(_Flat(eqn.primitive, dict(eqn.params),
                               [self._input(s) for s in eqn.invars],
                               list(eqn.outvars)))
    for outer, inner in zip(outputs, jaxpr.outvars, strict=True):
      if not isinstance(inner, jex.Literal):
        self.alias[outer] = self.canon(inner)


def _raw_body(params):
  for key in _RAW_BODY_KEYS:
    value = params.get(key)
    if value is not None and hasattr(getattr(value, 'jaxpr', value), 'eqns'):
      return value
  return None


def _step(eqn: _Flat, position: int) -> Step:
  literals = tuple((i, v[1]) for i, v in enumerate(eqn.inputs)
                   if i != position)
  return Step(eqn.prim, tuple(sorted(eqn.params.items())), position, literals)


def _is_literal(value) -> bool:
  return isinstance(value, tuple) and len(value) == 2 and value[0] == 'literal'


def find(node: Mox, kernel_index: int) -> Contraction | str:
  """How ``node`` contracts its variable input ``kernel_index``, or why it
  is none of the layouts a contraction rewrite supports."""
  flat = _Flattener()
  flat.node_children(node.children)
  kernel = flat.canon(node.inputs[kernel_index])
  # symbol -> (perm, view): the kernel's axes in the order perm, reshaped
  # to another shape when ``view`` holds that order's own shape.
  derived = {kernel: (tuple(range(node.inputs[kernel_index].aval.ndim)),
                      None)}
  free = _free_values(flat, node)
  uses, scaled = [], False
  for eqn in flat.eqns:
    hit = [i for i, s in enumerate(eqn.inputs)
           if not _is_literal(s) and s in derived]
    if not hit:
      continue
    name = eqn.prim.name if eqn.prim is not None else 'a call'
    layout = derived[eqn.inputs[hit[0]]]
    if name in CONTRACTIONS and len(hit) == 1 and hit[0] in (0, 1):
      if layout[1] is not None:
        return f'its {name} reads its kernel reshaped'
      uses.append((eqn, hit[0]))
    elif name in _KERNEL_STEPS and len(eqn.inputs) == 1:
      perm, view = layout
      if name == 'transpose':
        if view is not None:
          return 'its kernel is reshaped and transposed before its contraction'
        perm = tuple(perm[p] for p in eqn.params['permutation'])
      derived[flat.canon(eqn.outputs[0])] = (perm, view)
    elif name in _KERNEL_VIEWS and len(hit) == 1 and all(
        i == hit[0] or _is_literal(s) for i, s in enumerate(eqn.inputs)):
      derived[flat.canon(eqn.outputs[0])] = _viewed(
          layout, _aval(eqn.inputs[hit[0]]).shape, eqn.outputs[0].aval.shape)
    elif name in _KERNEL_ELEMENTWISE and len(
        {derived[eqn.inputs[i]] for i in hit}) == 1 and not any(
            not _is_literal(s) and s in free for s in eqn.inputs):
      # A computed kernel (a dequantization, a scale): same elements.
      shape = tuple(eqn.outputs[0].aval.shape)
      if shape == tuple(_aval(eqn.inputs[hit[0]]).shape):
        derived[flat.canon(eqn.outputs[0])] = layout
      elif layout[1] is not None and shape == layout[1]:
        derived[flat.canon(eqn.outputs[0])] = (layout[0], None)
      else:
        return (f'its kernel is read by {name}, which changes its shape '
                'before a contraction')
      scaled = True
    else:
      return f'its kernel is read by {name}, not only by a contraction'
  outputs = [flat.canon(s) for s in node.outputs if not isinstance(s, Literal)]
  if any(s in derived for s in outputs):
    return 'it returns its kernel'
  if not uses:
    return 'its kernel reaches no dot_general or convolution'
  if len(uses) > 1:
    return (f'its kernel is read by {len(uses)} contractions; one adapter '
            'fits one contraction')
  eqn, side = uses[0]
  name = eqn.prim.name
  params = dict(eqn.params)
  if name == 'conv_general_dilated':
    if side != 1:
      return 'its kernel is the input of its convolution, not the filter'
    if params.get('feature_group_count', 1) != 1 or \
        params.get('batch_group_count', 1) != 1:
      return ('it is a grouped convolution (feature_group_count='
              f"{params.get('feature_group_count')}, batch_group_count="
              f"{params.get('batch_group_count')}); adapters fit "
              'feature_group_count=1')
    if derived[eqn.inputs[1]][0] != tuple(range(len(
        derived[eqn.inputs[1]][0]))):
      return 'its convolution reads its kernel transposed'
  operand = eqn.inputs[1 - side]
  if _is_literal(operand):
    return 'its contraction reads a constant, not an input of the module'
  # The other operand, back to an input of the module.
  producers = {id(s): e for e in flat.eqns for s in
               (flat.canon(o) for o in e.outputs)}
  inputs = {flat.canon(s): i for i, s in enumerate(node.inputs)
            if not isinstance(s, Literal)}
  x_steps, cur = [], operand
  while cur not in inputs:
    producer = producers.get(id(cur))
    pname = producer.prim.name if producer and producer.prim else None
    dyn = [i for i, s in enumerate(producer.inputs)
           if not _is_literal(s)] if producer else []
    if pname not in _INPUT_STEPS or len(dyn) != 1:
      return (f'the input of its contraction is computed in the module '
              f'(by {pname or "a call"}), not passed to it')
    x_steps.append(_step(producer, dyn[0]))
    cur = producer.inputs[dyn[0]]
  x_index = inputs[cur]
  if x_index < node.num_vars:
    return 'its contraction reads another variable, not an input of the call'
  # The contraction's output, forward to an output of the module.
  readers: dict = {}
  for e in flat.eqns:
    for i, s in enumerate(e.inputs):
      if not _is_literal(s):
        readers.setdefault(id(s), []).append((e, i))
  y_steps, cur = [], flat.canon(eqn.outputs[0])
  cone = {id(cur)}
  while True:
    users = readers.get(id(cur), [])
    if cur in outputs:
      if users:
        return ('the output of its contraction is returned and also used '
                'again in the module')
      break
    if len(users) != 1:
      return (f'the output of its contraction is read by {len(users)} '
              'equations before the module returns it')
    user, pos = users[0]
    uname = user.prim.name if user.prim is not None else 'a call'
    others = [s for i, s in enumerate(user.inputs) if i != pos]
    if uname in _OUTPUT_STEPS and all(_is_literal(s) for s in others):
      y_steps.append(_step(user, pos))
    elif uname in _ADDS and len(user.inputs) == 2 and not (
        uname == 'sub' and pos == 1) and not any(
            not _is_literal(s) and _depends(s, cone, producers, flat)
            for s in others) and tuple(
                user.outputs[0].aval.shape) == tuple(_aval(cur).shape):
      pass  # a bias: the change passes unchanged
    else:
      return (f'the output of its contraction goes through {uname} before '
              'the module returns it (only casts, reshapes, transposes and '
              'added biases are looked through)')
    cur = flat.canon(user.outputs[0])
    cone.add(id(cur))
  y_index = [flat.canon(s) if not isinstance(s, Literal) else None
             for s in node.outputs].index(cur)
  return Contraction(
      kernel_index=kernel_index, kind=name,
      params=tuple(sorted(params.items())), kernel_side=side,
      perm=derived[eqn.inputs[side]][0], x_index=x_index,
      x_steps=tuple(reversed(x_steps)), operand_aval=_aval(operand),
      z_aval=_aval(eqn.outputs[0]), y_index=y_index, y_steps=tuple(y_steps),
      scaled=scaled)


def _aval(sym):
  return sym.aval


def _viewed(layout: tuple, shape, new_shape) -> tuple:
  """The layout of a kernel value of ``shape`` reshaped to
  ``new_shape``: back to its order's own shape ends the view."""
  perm, view = layout
  base = view if view is not None else tuple(shape)
  return (perm, None if tuple(new_shape) == base else base)


def _free_values(flat: _Flattener, node: Mox) -> set:
  """The values computed from the call's arguments (not from its
  variables and constants alone)."""
  free = {flat.canon(s) for s in node.inputs[node.num_vars:]
          if not isinstance(s, Literal)}
  for eqn in flat.eqns:
    if any(not _is_literal(s) and s in free for s in eqn.inputs):
      free.update(flat.canon(o) for o in eqn.outputs)
  return free


def _depends(sym, cone: set, producers: dict, flat: _Flattener) -> bool:
  """Whether ``sym`` is computed from a value of ``cone``."""
  stack, seen = [sym], set()
  while stack:
    s = stack.pop()
    if id(s) in cone:
      return True
    if id(s) in seen:
      continue
    seen.add(id(s))
    producer = producers.get(id(s))
    if producer is not None:
      stack.extend(t for t in producer.inputs if not _is_literal(t))
  return False


def reads(node: Mox, sym: Symbol) -> bool:
  """Whether an equation of ``node``'s body (call bodies looked through)
  reads ``sym``, one of the node's inputs."""
  flat = _Flattener()
  flat.node_children(node.children)
  target = flat.canon(sym)
  return any(not _is_literal(s) and s is target
             for eqn in flat.eqns for s in eqn.inputs)
