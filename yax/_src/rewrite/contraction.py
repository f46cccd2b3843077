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

:func:`find_site` asks less: only the one contraction that reads the
kernel, to rewrite in place inside the module's body (LoRA on a kernel no
adapter around the call fits: several kernels in one call, a MoE's routed
operand, an activation after the contraction); :func:`kernel_plans` gives
every kernel of a call so.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.extend.core as jex
from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir import rules as _rules
from yax._src.ir.nodes import Equation, Literal, Mox, Symbol, Var, iter_nodes
from yax._src.ir.variables import var_entries, var_keys
from yax._src.rewrite.engine import describe
from yax._src.rewrite.quant_formats import FORMATS
from yax._src.trace import systems as _systems

CONTRACTIONS = ('dot_general', 'conv_general_dilated')
# ``jax.lax.ragged_dot``: rows of the lhs grouped (``group_sizes``, its
# third input), each group times its own slice of a stacked kernel
# ``[groups, in, out]`` (a MoE's experts). Adapted in place only.
RAGGED = 'ragged_dot_general'
_RAGGED_LAYOUT = (((1,), (1,)), ((), ()))
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
  # The equation of the tree it stands for (None: an equation of a raw
  # jaxpr held in a call's params, which a rewrite cannot reach).
  origin: Equation | None = None
  # It sits in the body of another module call inside the node (a
  # submodule that was passed the kernel).
  nested: bool = False


class _Flattener:
  """The equations of a module call's body, with call-like bodies inlined
  and every value named by one canonical object."""

  def __init__(self, path: tuple = ()):
    self.alias: dict = {}
    self.eqns: list[_Flat] = []
    self.path = path  # the node's: calls of its other methods are its own
    self.depth = 0  # calls of other modules entered below the node
    self.inlined = 0  # call bodies being inlined

  def canon(self, sym):
    while sym in self.alias:
      sym = self.alias[sym]
    return sym

  def _defined(self, outputs) -> list:
    """The values an equation defines. Inside an inlined body, fresh ones
    at each inlining: one body object may be called at several places (a
    traced helper spliced in twice shares its ``jit`` bodies), and each
    place computes its own values."""
    if not self.inlined:
      return list(outputs)
    fresh = []
    for out in outputs:
      new = Var(out.aval)
      self.alias[out] = new
      fresh.append(new)
    return fresh

  def _input(self, sym):
    if isinstance(sym, Literal):
      return ('literal', sym.value)
    if isinstance(sym, jex.Literal):
      return ('literal', sym.val)
    return self.canon(sym)

  def node_children(self, children):
    for child in children:
      if isinstance(child, Mox):
        other = child.path != self.path
        self.depth += other
        self.node_children(child.children)
        self.depth -= other
      elif child.prim.name in _CALLS and len(child.children) == 1:
        body = child.children[0]
        sources = _rules.body_input_sources(child, 0)
        for inner, outer in zip(body.inputs, sources, strict=True):
          if not isinstance(outer, Literal) and inner is not outer:
            self.alias[inner] = self.canon(outer)
        self.inlined += 1
        self.node_children(body.children)
        self.inlined -= 1
        for outer, inner in zip(child.outputs, body.outputs, strict=True):
          if not isinstance(inner, Literal) and outer is not inner:
            self.alias[outer] = self.canon(inner)
      elif child.prim.name in _CALLS and not child.children and \
          _raw_body(child.params) is not None:
        self.raw(_raw_body(child.params), child.inputs, child.outputs)
      else:
        self.eqns.append(_Flat(child.prim, dict(child.params),
                               [self._input(s) for s in child.inputs],
                               self._defined(child.outputs), child,
                               self.depth > 0))

  def raw(self, jaxpr, inputs, outputs):
    jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)
    if len(jaxpr.invars) != len(inputs):
      self.eqns.append(_Flat(None, {}, [self._input(s) for s in inputs],
                             self._defined(outputs)))
      return
    for inner, outer in zip(jaxpr.invars, inputs, strict=True):
      if not isinstance(outer, Literal):
        self.alias[inner] = self.canon(outer)
    self.inlined += 1
    for eqn in jaxpr.eqns:
      body = _raw_body(eqn.params)
      if eqn.primitive.name in _CALLS and body is not None:
        self.raw(body, eqn.invars, eqn.outvars)
      else:
        self.eqns.append(_Flat(eqn.primitive, dict(eqn.params),
                               [self._input(s) for s in eqn.invars],
                               self._defined(eqn.outvars)))
    self.inlined -= 1
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


def _kernel_use(flat: _Flattener, node: Mox, kernel_index: int):
  """The one contraction that reads the kernel: ``(equation, kernel side,
  kernel layouts by symbol, scaled)``, or why there is none."""
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
    elif name == RAGGED and hit == [1]:
      numbers = eqn.params['ragged_dot_dimension_numbers']
      if (layout != (tuple(range(3)), None) or tuple(
          numbers.dot_dimension_numbers) != _RAGGED_LAYOUT or tuple(
              numbers.lhs_ragged_dimensions) != (0,) or tuple(
                  numbers.rhs_group_dimensions) != (0,)):
        return (f'its {name} reads it in a layout other than ragged_dot\'s '
                '[groups, in, out] with rows grouped')
      uses.append((eqn, 1))
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
  outputs = {flat.canon(s) for s in node.outputs if not isinstance(s, Literal)}
  if any(s in derived for s in outputs):
    return ('it returns its kernel (the module that calls it contracts '
            'it, in another module call than the one holding it)')
  if not uses:
    return 'its kernel reaches no dot_general or convolution'
  if len(uses) > 1:
    return (f'its kernel is read by {len(uses)} contractions; one adapter '
            'fits one contraction')
  eqn, side = uses[0]
  if eqn.prim.name == 'conv_general_dilated':
    params = eqn.params
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
  if _is_literal(eqn.inputs[1 - side]):
    return 'its contraction reads a constant, not an input of the module'
  return eqn, side, derived, scaled


def find(node: Mox, kernel_index: int) -> Contraction | str:
  """How ``node`` contracts its variable input ``kernel_index``, or why it
  is none of the layouts a contraction rewrite supports."""
  flat = _Flattener()
  flat.node_children(node.children)
  used = _kernel_use(flat, node, kernel_index)
  if isinstance(used, str):
    return used
  eqn, side, derived, scaled = used
  if eqn.prim.name == RAGGED:
    return 'its ragged_dot groups the rows of its input: adapted in place'
  outputs = [flat.canon(s) for s in node.outputs if not isinstance(s, Literal)]
  name = eqn.prim.name
  params = dict(eqn.params)
  operand = eqn.inputs[1 - side]
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


def find_site(node: Mox, kernel_index: int):
  """The contraction that reads ``node``'s variable input ``kernel_index``,
  to adapt in place: ``(Contraction, the equation)``, or why there is none.
  Its operand and output are whatever the module computes them from and
  does with them (a MoE's routed inputs, an activation after it), so the
  Contraction has no steps: the adapter reads the operand as the
  contraction does and adds to the contraction's own output."""
  flat = _Flattener(node.path)
  flat.node_children(node.children)
  used = _kernel_use(flat, node, kernel_index)
  if isinstance(used, str):
    return used
  eqn, side, derived, scaled = used
  if eqn.origin is None:
    return (f'its {eqn.prim.name} sits in a call body held as a raw jaxpr, '
            'which a rewrite cannot reach')
  if eqn.nested:
    return (f'its {eqn.prim.name} sits in the body of another module call '
            'that the module passes its kernel to')
  if any(_is_literal(s) for s in eqn.inputs[2:]):
    return f'its {eqn.prim.name} reads constant group sizes'
  operand = eqn.inputs[1 - side]
  return Contraction(
      kernel_index=kernel_index, kind=eqn.prim.name,
      params=tuple(sorted(eqn.params.items())), kernel_side=side,
      perm=derived[eqn.inputs[side]][0], x_index=1 - side, x_steps=(),
      operand_aval=_aval(operand), z_aval=_aval(eqn.outputs[0]), y_index=0,
      y_steps=(), scaled=scaled), eqn.origin


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


# ------------------------------------------------- kernel plans

@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """How one module call contracts its kernel, and what a rewrite of the
  kernel needs: the rank-``r`` factor shapes of a kernel change, in the
  kernel's own axis order (LoRA's adapters; quantization's scales reduce
  the ``a_axes``).

  ``A: [*contracted kernel axes, rank]`` and ``B: [rank, *other kernel
  axes]`` for a ``dot_general``; ``A: [*kernel axes but the output feature,
  rank]`` (the window and input features) and ``B: [rank, out]`` for a
  convolution.
  """
  contraction: Contraction
  kernel_keys: tuple  # ('params', 'kernel'), ('nnx', 'w') ...
  kernel_shape: tuple
  a_shape: tuple
  b_shape: tuple
  a_axes: tuple  # kernel axis of each axis of A (None: the rank)
  b_axes: tuple
  names: tuple = ()  # the new variables' names (LoRA's adapters)
  # Where the adapters live: the module path (None: the node's own), and,
  # for a call-site adapter, why merging it into the kernel is refused.
  place: tuple | None = None
  tied: str | None = None
  # The storage format of a kernel quantized by yax.quantize (merge then
  # returns float params for the tree quantize started from).
  quant: str | None = None
  # Kernel axes that stack one kernel per slice (an nn.vmap with
  # variable_axes): A and B carry them too, one adapter pair per slice.
  stack: tuple = ()
  # A stacked param whose axes a transpose moved before a scan sliced it
  # (MaxText's scanned layers, stacked on axis 1): the scanned array's axis
  # j is the param's axis source_perm[j]. Adapters stack on axis 0.
  source_perm: tuple | None = None
  # The contraction equation to rewrite in place (``kernel_plans``: the
  # adapter reads its operand and adds to its output inside the module's
  # body); None: the adapter goes around the module call.
  site: Equation | None = None

  @property
  def kernel_name(self) -> str:
    return self.kernel_keys[-1]

  @property
  def contracted(self) -> tuple:
    """The kernel axes its contraction reduces (a per-output-channel
    scale's size-1 axes)."""
    return tuple(v for v in self.a_axes
                 if v is not None and v not in self.stack)

  @property
  def fan_in(self) -> int:
    """The kernel elements one output reads (what LoRA's ``A`` is drawn
    for: ``N(0, 1 / fan_in)``)."""
    if self.contraction.kind in ('dot_general', RAGGED):
      return math.prod(self.kernel_shape[v] for v in self.contracted)
    return math.prod(self.a_shape[:-1])


def _own_params(node: Mox) -> list[int]:
  """Variable input positions of the module's own parameters."""
  return [i for i, e in enumerate(var_entries(node))
          if len(e.rel_path) == 1 and e.is_param]


def own_param_names(node: Mox) -> set:
  """Names of the module's own parameters (``kernel``, ``bias`` ...)."""
  entries = var_entries(node)
  return {entries[i].name for i in _own_params(node)}


def kernel_plan(node: Mox, rank: int = 1) -> KernelPlan | str:
  """How ``node`` contracts its one kernel, or why it has none a rewrite
  of the kernel fits."""
  keys = var_keys(node)
  candidates = [i for i in _own_params(node)
                if node.var_inputs[i].aval is not None
                and node.var_inputs[i].aval.ndim >= 2]
  found, reasons = [], []
  for i in sorted(candidates, key=lambda i: keys[i][-1] != 'kernel'):
    got = find(node, i)
    (found if isinstance(got, Contraction) else reasons).append(
        (i, got))
  if not found:
    if reasons:
      i, why = reasons[0]
      return (f"its kernel {'/'.join(keys[i])}:"
              f'{node.var_inputs[i].type_str} does not fit a kernel '
              f'rewrite: {why}')
    listed = ', '.join('/'.join(k) + ':' + s.type_str
                       for k, s in zip(keys, node.var_inputs, strict=True))
    own = set(_own_params(node))
    held = [i for i, e in enumerate(var_entries(node))
            if i not in own and e.is_param
            and node.var_inputs[i].aval is not None
            and node.var_inputs[i].aval.ndim >= 2
            and _contracted_here(node, i)]
    if held:
      names = ', '.join('/'.join(keys[i]) for i in held)
      return (f'the kernels it contracts ({names}) are variables of its '
              'submodules, not its own (a submodule that returns its '
              'weight, as gemma 4 MoERagged reads its experts); a kernel '
              'rewrite needs the module that holds a kernel to contract '
              'it, which YAX does not rewrite across module calls')
    return ('it has no parameter of 2 or more axes that reaches a '
            'dot_general or convolution (a kernel); its variables are '
            f"[{listed or 'none'}]")
  if len(found) > 1:
    names = ', '.join('/'.join(keys[i]) for i, _ in found)
    return (f'it contracts several kernels ({names}); select the modules '
            'that hold one kernel each')
  return _plan(node, *found[0], rank)


def kernel_plans(node: Mox, rank: int = 1) -> list[KernelPlan] | str:
  """Every kernel ``node`` contracts: its one kernel adapted around the
  call where :func:`kernel_plan` finds one; else each of its kernels
  adapted in place, at the contraction that reads it (``KernelPlan.site``:
  a MoE's expert kernels, a kernel whose output goes through an
  activation before the module returns it). A parameter that reaches no
  contraction (an embedding table, a norm's scale) is no kernel; a kernel
  that reaches one but fits no rewrite, next to kernels that do, makes the
  whole call refused, naming it and why (never some kernels of a call
  rewritten and others silently not); the reason of :func:`kernel_plan`
  when none fits."""
  one = kernel_plan(node, rank)
  if isinstance(one, KernelPlan):
    return [one]
  keys = var_keys(node)
  plans, left = [], []
  for i in _own_params(node):
    if node.var_inputs[i].aval is None or node.var_inputs[i].aval.ndim < 2:
      continue
    got = find_site(node, i)
    plan = got if isinstance(got, str) else _plan(node, i, got[0], rank,
                                                  site=got[1])
    if isinstance(plan, KernelPlan):
      plans.append(plan)
    elif _reaches_contraction(node, i):
      left.append((keys[i], f"{'/'.join(keys[i])} ({plan})"))
  # A quantized kernel's scales reach its contraction as part of it.
  scales = {(*p.kernel_keys[:-1], f'{p.kernel_name}_scale') for p in plans
            if p.quant is not None}
  left = [why for k, why in left if tuple(k) not in scales]
  if plans and left:
    done = ', '.join('/'.join(p.kernel_keys) for p in plans)
    return (f'it contracts kernels that fit ({done}) and kernels that do '
            f"not: {'; '.join(left)}; a rewrite of some kernels of a call "
            'and not others is refused')
  return plans or one


def _contracted_here(node: Mox, index: int) -> bool:
  """Whether a contraction in ``node``'s own body (not in a module call
  inside it) reads its variable input ``index``."""
  return _reaches_contraction(node, index, own_body=True)


def _reaches_contraction(node: Mox, index: int, *,
                         own_body: bool = False) -> bool:
  """Whether ``node``'s variable input ``index``, or a value computed
  from it in the call's body, is an operand of a contraction; with
  ``own_body``, only a contraction outside the module calls inside it
  counts (a submodule's contraction outputs no kernel)."""
  flat = _Flattener(node.path) if own_body else _Flattener()
  flat.node_children(node.children)
  reached = {flat.canon(node.inputs[index])}
  for eqn in flat.eqns:
    if not any(not _is_literal(s) and s in reached for s in eqn.inputs):
      continue
    name = eqn.prim.name if eqn.prim is not None else None
    if name in CONTRACTIONS or name == RAGGED:
      if not (own_body and eqn.nested):
        return True
      continue
    reached.update(flat.canon(s) for s in eqn.outputs)
  return False


def _plan(node: Mox, index: int, c: Contraction, rank: int,
          site: Equation | None = None) -> KernelPlan | str:
  keys = var_keys(node)
  shape = tuple(node.var_inputs[index].aval.shape)
  stack = ()
  if c.kind == 'dot_general':
    (lc, rc), (lb, rb) = c.dimension_numbers
    kc = (lc, rc)[c.kernel_side]
    contracted = sorted(c.perm[a] for a in kc)
    stack = _stacked_axes(node, index, sorted(
        c.perm[a] for a in (lb, rb)[c.kernel_side]), contracted)
    if isinstance(stack, str):
      return stack
    if site is not None and not stack:
      stack = _leading_axes(shape, contracted)
    other = [v for v in range(len(shape))
             if v not in contracted and v not in stack]
    a_axes, b_axes = (*stack, *contracted, None), (*stack, None, *other)
  elif c.kind == RAGGED:  # one pair per group: [g, in, r], [g, r, out]
    stack = (0,)
    a_axes, b_axes = (0, 1, None), (0, None, 2)
  else:
    out = c.dimension_numbers.rhs_spec[0]
    a_axes = (*(v for v in range(len(shape)) if v != out), None)
    b_axes = (None, out)
  size = lambda axes: tuple(rank if v is None else shape[v] for v in axes)
  quant = node.params.get('quant')
  quant = quant if quant in FORMATS else None
  if c.scaled and quant is None:
    return (f"its kernel {'/'.join(keys[index])} is combined with other "
            'values before its contraction (a computed kernel that merge '
            'could not update)')
  return KernelPlan(c, keys[index], shape, size(a_axes), size(b_axes),
                    a_axes, b_axes, quant=quant, stack=stack, site=site)


def _leading_axes(shape: tuple, contracted: list) -> tuple:
  """The kernel axes before its contracted ones, where others follow them
  too: a stack of matrices (MaxText's experts, ``[experts, in, out]``),
  one adapter pair per slice. A kernel adapted in place only (one adapted
  around its call keeps the layout of the SPEC's ``B: [rank, *other
  axes]``)."""
  if not contracted:
    return ()
  first, last = min(contracted), max(contracted)
  if first == 0 or last == len(shape) - 1:
    return ()
  return tuple(range(first))


def _stacked_axes(node: Mox, index: int, batch: list,
                  contracted: list) -> tuple | str:
  """The kernel axes that a lifted ``nn.vmap`` stacked: the axes the
  kernel has beyond the shape the module itself declares at the call's
  argument shapes, looked for among its contraction's ``batch`` axes (a
  batched input), then among its other non-contracted axes (an input the
  vmap does not batch, ``in_axes=None``: the stack is a free axis of the
  kernel). (A batch axis the module declares, as
  ``DenseGeneral(batch_dims=...)``'s, is a kernel axis like any other.)
  A kernel with at most one non-contracted axis besides ``batch`` has no
  free stack axis, so the module is rebuilt only when there is a candidate.
  A reason string when the module cannot be rebuilt to tell."""
  shape = tuple(node.var_inputs[index].aval.shape)
  free = [v for v in range(len(shape)) if v not in contracted
          and v not in batch]
  if not batch and len(free) < 2:
    return ()
  cls = node.rebuild_ty
  if not _systems.is_rebuilt_module(cls):
    return ()  # NNX: nnx.vmap stacks are traced with their own kernel
  declared = _declared_shape(node, index)
  if isinstance(declared, str):
    return declared
  extra = len(shape) - len(declared)
  if extra <= 0:
    return ()
  for pool in (batch, [*batch, *free]):
    for axes in itertools.combinations(sorted(pool), extra):
      if tuple(n for i, n in enumerate(shape) if i not in axes) == declared:
        return tuple(axes)
  return (f"its kernel {'/'.join(var_keys(node)[index])} has shape "
          f'{shape}, {extra} axes more than the {declared} that '
          f'{cls.__name__} declares, and no choice of its non-contracted '
          'axes as a lifted stack gives that shape')


def _declared_shape(node: Mox, index: int) -> tuple | str:
  """The shape of the kernel at ``index`` that the module declares when
  it is built alone from its recorded fields and initialized at the
  call's argument shapes; a reason string when it cannot be."""
  cls = node.rebuild_ty
  keys = var_keys(node)[index]
  where = '/'.join(keys)

  def init(*arrays):
    it = iter(arrays)
    example = jtu.tree_unflatten(node.in_tree, [
        next(it) if s.aval is not None else s.value
        for s in node.arg_inputs])
    return _systems.new_module_variables(
        cls, node.params, jax.random.key(0), example,
        node.entrypoint or '__call__', where)
  try:
    declared = jax.eval_shape(init, *(
        jax.ShapeDtypeStruct(s.aval.shape, s.aval.dtype)
        for s in node.arg_inputs if s.aval is not None))
    declared = _systems.unboxed(declared[keys[0]][keys[1]])
  except Exception as e:  # pylint: disable=broad-except
    # Named case: the module cannot be rebuilt alone (a field that is not
    # recorded, a submodule it expects from its parent ...). Which kernel
    # axes a lifted transform stacked is then unknown: refused.
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return (f"cannot tell which axes of its kernel {'/'.join(keys)} a "
            f'lifted nn.vmap stacked: {cls.__name__} built alone from its '
            f'recorded fields fails to initialize '
            f'({type(e).__name__}: {first[:200]})')
  return tuple(declared.shape)


def kernel_source(sym: Symbol, ancestors: tuple, keypaths: dict):
  """(root key path of the kernel ``sym``, None, perm) or (None, why it
  has none, None). ``perm``: the transpose a stacked param went through
  before a scan sliced it (see ``KernelPlan.source_perm``), or None."""
  chain = list(ancestors)
  i = len(chain) - 1
  end = len(chain)  # chain[i:end]: the calls of the current scope
  perm = None
  while i >= 1:
    body, eqn = chain[i], chain[i - 1]
    if not isinstance(eqn, Equation):
      i -= 1
      continue
    sym = _unconstrained(chain[i:end], sym, keypaths)
    positions = [j for j, s in enumerate(body.inputs) if s is sym]
    if not positions:
      return None, f'computed inside the body of {describe(eqn)}', None
    index = [id(c) for c in eqn.children].index(id(body))
    sym = _rules.body_input_sources(eqn, index)[positions[0]]
    if eqn.prim.name == 'scan' and i >= 2 and sym not in keypaths:
      sym, perm = _untransposed(chain[i - 2], sym)
    end = i - 1
    i -= 2
  sym = _unconstrained(chain[:end], sym, keypaths)
  if sym in keypaths:
    return keypaths[sym], None, perm
  if any(sym is c for c in chain[0].constvars):
    return None, 'a constant captured by the trace', None
  return None, 'computed in the model', None


def _unconstrained(scopes, sym, keypaths):
  """``sym``, or the value a ``sharding_constraint`` among the children of
  ``scopes`` (calls that share one scope of symbols) constrained into it:
  a constraint only says where a value lives (Linen's
  ``LogicallyPartitioned.unbox`` constrains every param under a mesh
  before an NNX module bridged by ``ToLinen`` reads it)."""
  while sym not in keypaths:
    producer = next((c for scope in scopes for c in scope.children
                     if isinstance(c, Equation)
                     and c.prim.name == 'sharding_constraint'
                     and c.outputs[0] is sym), None)
    if producer is None or isinstance(producer.inputs[0], Literal):
      return sym
    sym = producer.inputs[0]
  return sym


def _untransposed(scope, sym):
  """``sym`` computed by a transpose of a value of ``scope`` (a stacked
  param with its scan axis moved to the front): that value and the
  permutation; else ``sym`` and None."""
  producer = next((c for c in scope.children if isinstance(c, Equation)
                   and c.prim.name == 'transpose' and c.outputs[0] is sym),
                  None)
  if producer is None or isinstance(producer.inputs[0], Literal):
    return sym, None
  return producer.inputs[0], tuple(producer.params['permutation'])


def kernel_holders(mox: Mox) -> dict:
  """Parameter symbol -> the module calls that hold it as their own
  parameter (several: a module called twice, Embed's lookup and attend, a
  Param tied across NNX modules)."""
  holders: dict = {}
  for node in iter_nodes(mox):
    if isinstance(node, Mox) and not node.is_ephemeral:
      for entry in var_entries(node):
        if len(entry.rel_path) == 1:
          holders.setdefault(entry.symbol, []).append(node)
  return holders


@dataclasses.dataclass(frozen=True)
class Target:
  """One selected module call, as the kernel rewrites see it.

  Attributes:
    node: the module call.
    plan: how it contracts its kernel (None where it has no such kernel).
    why: why it has none (None where ``plan`` is given).
    keypath: the kernel's key path in the root arguments (None where it is
      not read from them: computed in the model, see ``source``).
    source: why the kernel has no key path (None where it has one).
    own: the kernel is the parameter at the call's own path
      (``(*collection prefix, *module path, kernel name)``).
  """
  node: Mox
  plan: KernelPlan | None
  why: str | None
  keypath: tuple | None
  source: str | None
  own: bool


def plan_kernels(chosen, tool: str, rank: int = 1,
                 every: bool = False) -> list[Target]:
  """The kernel of every module call of the selection ``chosen`` (a
  ``Selection``): its plan and where it comes from, looked for through
  the bodies of lifted transforms (``nn.jit``, ``nn.scan`` ...). With
  ``every``, one target per kernel a call contracts (:func:`kernel_plans`).
  Raises ``SubstitutionError`` naming ``tool`` where the selection holds
  something else than module calls."""
  keypaths, collections = chosen.keypaths, chosen.collections
  out = []
  for node in chosen.targets:
    if not isinstance(node, Mox) or node.is_ephemeral:
      raise SubstitutionError(
          f'{tool} selects module calls, but {chosen.description} matched '
          f'{describe(node)}')
    plans = kernel_plans(node, rank) if every else kernel_plan(node, rank)
    if isinstance(plans, str):
      out.append(Target(node, None, plans, None, None, False))
      continue
    for plan in (plans if every else [plans]):
      kernel = node.var_inputs[plan.contraction.kernel_index]
      keypath, source, perm = kernel_source(
          kernel, chosen.ancestors[id(node)], keypaths)
      prefix = collections.get(plan.kernel_keys[0])
      own = (keypath is not None and prefix is not None and same_place(
          keypath, (*prefix, *node.path, *plan.kernel_keys[1:])))
      if own and perm is not None:
        plan = dataclasses.replace(plan, source_perm=perm)
      out.append(Target(node, plan, None, keypath, source, own))
  return out


def same_place(keypath: tuple, place: tuple) -> bool:
  """Whether a root key path is ``place`` (module paths are strings, a
  key path may hold the int index of a list)."""
  return len(keypath) == len(place) and all(
      k == p or str(k) == str(p) for k, p in zip(keypath, place, strict=True))


def other_readers(holders: dict, chosen, target: Target) -> list[Mox]:
  """Module calls other than ``target.node`` (and the calls around it)
  whose bodies read its kernel: a module called twice, Embed's lookup
  next to its attend, a Param tied across NNX modules."""
  node = target.node
  kernel = node.var_inputs[target.plan.contraction.kernel_index]
  inside = {id(n) for n in iter_nodes(node)}
  above = {id(a) for a in chosen.ancestors[id(node)]}
  return [h for h in holders.get(kernel, ())
          if id(h) not in inside and id(h) not in above and reads(h, kernel)]
