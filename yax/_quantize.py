"""``yax.quantize``: weight quantization of the kernels of selected module
calls, decided by the contraction as LoRA's adapters are.

Each selected module call keeps its type and path (``quant`` among its
fields says the format) and now reads its kernel in a storage format:
``int8``/``int4`` (symmetric absmax integers), ``fp8`` (``float8_e4m3fn``
scaled so the absmax maps to 448) or ``nf4`` (4-bit codes into the 16
NormalFloat levels of QLoRA), with one float32 scale per output channel
(the kernel axes its contraction does not contract) stored next to the
kernel as ``<kernel>_scale``. The body dequantizes (``q * scale``) before
the original computation. ``mode='qat'`` keeps float params and
fake-quantizes the kernel in the forward pass with a straight-through
gradient.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util as jtu

from yax import _contraction, _lora, _nnx
from yax._formats import (FORMATS, dequantize_array, quantize_array,
                          scale_shape)
from yax._containers import get_in, set_in, set_many, without
from yax._errors import SubstitutionError
from yax._ir import Equation, Literal, Mox, Symbol, Var
from yax._sub import (NNX_GROUP, collections_of, describe, leave_out_hint,
                      non_literals, root_keypaths, select, substitute,
                      var_keys)
from yax._trace import make_mox

@dataclasses.dataclass
class QuantizeResult:
  """What ``yax.quantize`` returns.

  Attributes:
    mox: the rewritten tree.
    params: the argument to pass where ``params`` went: quantized kernels
      (``mode='ptq'``) and their scales, everything else unchanged.
    paths: module paths whose kernels were quantized.
    nbytes: ``(before, after)`` bytes of all params (4-bit values count
      half a byte).
    dequantize: ``dequantize(p)`` returns float params for the original
      tree.
  """
  mox: Mox
  params: Any
  paths: list
  nbytes: tuple
  dequantize: Callable[[Any], Any]


def _fake_quant(w, fmt: str, contracted: tuple, tile=None):
  """The forward pass sees the quantized kernel, the gradient is the
  identity (straight-through)."""
  q, scale = quantize_array(w, fmt, contracted, tile)
  return w + jax.lax.stop_gradient(
      dequantize_array(q, scale, fmt, w.dtype, contracted) - w)


def _nbytes(tree) -> int:
  total = 0
  for leaf in jtu.tree_leaves(tree):
    dtype = jnp.dtype(getattr(leaf, 'dtype', np.float32))
    bits = 4 if dtype in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else \
        8 * dtype.itemsize
    total += math.prod(np.shape(leaf)) * bits / 8
  return int(math.ceil(total))


def _contracted_axes(plan) -> tuple:
  """Kernel axes reduced by a per-output-channel scale."""
  return plan.contracted


def _traced(fn, *specs):
  """The equations of ``fn`` traced at ``specs`` (an ephemeral root)."""
  return make_mox(fn)(*(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
                        for x in specs))


def _act_quant(x, fmt: str, contracted: tuple):
  """Dynamic activation quantization: ``x`` rounded to ``fmt`` with one
  absmax scale per row (over the ``contracted`` axes), straight-through."""
  q, scale = quantize_array(x, fmt, contracted)
  return x + jax.lax.stop_gradient(
      dequantize_array(q, scale, fmt, x.dtype) - x)


def _x_axes(c) -> tuple | None:
  """The contracted axes of the module input that feeds a dot_general
  unchanged but for casts; None where steps move its axes."""
  if c.kind != 'dot_general' or any(
      step.prim.name not in ('convert_element_type', 'copy', 'copy_p')
      for step in c.x_steps):
    return None
  (lc, rc), _ = c.dimension_numbers
  return tuple((lc, rc)[1 - c.kernel_side])


def _equation_template(eqn: Equation, act: str) -> Mox:
  """A weight-free dot_general (attention scores) on quantized inputs."""
  (lc, rc), _ = eqn.params['dimension_numbers']
  a, b = (jax.ShapeDtypeStruct(tuple(s.aval.shape), s.aval.dtype)
          for s in eqn.inputs)

  def fn(a, b):
    return eqn.prim.bind(_act_quant(a, act, tuple(lc)),
                         _act_quant(b, act, tuple(rc)), **eqn.params)
  return make_mox(fn)(a, b)


def _template(node: Mox, plan, fmt: str, mode: str, act=None,
              kernel_index=None, tile=None) -> Mox:
  """``node`` reading its kernel through (de)quantization equations
  (``kernel_index``: where the kernel is among the node's variables, for a
  call that reads the kernel of another call's plan, as Embed's lookup
  reads the table its attend contracts)."""
  c = plan.contraction
  index = c.kernel_index if kernel_index is None else kernel_index
  kernel = node.var_inputs[index]
  contracted = _contracted_axes(plan)
  shape, dtype = tuple(kernel.aval.shape), kernel.aval.dtype
  keys = var_keys(node)
  scale_name = f'{plan.kernel_name}_scale'
  if mode == 'qat':
    stored = Var(kernel.aval)
    root = _traced(lambda w: _fake_quant(w, fmt, contracted, tile),
                   jax.ShapeDtypeStruct(shape, dtype))
    extra = []
  else:
    q_dtype = FORMATS[fmt][0]
    s_shape = scale_shape(shape, contracted, tile)
    stored = Var(jax.core.ShapedArray(shape, jnp.dtype(q_dtype)))
    scale = Var(jax.core.ShapedArray(s_shape, jnp.float32))
    root = _traced(lambda q, s: dequantize_array(q, s, fmt, dtype, contracted),
                   jax.ShapeDtypeStruct(shape, q_dtype),
                   jax.ShapeDtypeStruct(s_shape, jnp.float32))
    extra = [(scale_name, scale)]
  inputs = non_literals(root.inputs)
  wiring = dict(zip(inputs, [stored] + [v for _, v in extra], strict=True))
  wiring.update((v, v) for v in root.constvars)  # NF4's levels
  children = []
  for eqn in root.children:
    ins = [s if isinstance(s, Literal) else wiring[s] for s in eqn.inputs]
    outs = [kernel if s is root.outputs[0] else Var(s.aval)
            for s in eqn.outputs]
    wiring.update(zip(eqn.outputs, outs, strict=True))
    children.append(eqn.replace(inputs=ins, outputs=outs))
  if not children:  # nothing to compute: cannot happen for these formats
    raise SubstitutionError('internal: an empty dequantization')
  var_inputs = [stored if i == index else s
                for i, s in enumerate(node.var_inputs)]
  tree = jtu.tree_unflatten(node.var_tree, var_inputs)
  if isinstance(tree, _nnx.VariableTree):
    entries = [(k[1:], (kind, *flags)) for k, kind, flags in zip(
        keys, tree.kinds, tree.flags, strict=True)]
    entries += [((name,), ('Param', True, True)) for name, _ in extra]
    var_tree = _nnx.variable_treedef(entries)
    by_rel = {rel: sym for (rel, _), sym in zip(
        entries, [*var_inputs, *(v for _, v in extra)], strict=True)}
    var_inputs = [by_rel[tuple(str(k.key) for k in kp)] for kp, _ in
                  jtu.tree_flatten_with_path(jtu.tree_unflatten(
                      var_tree, [0] * len(entries)))[0]]
  else:
    group = plan.kernel_keys[0]
    tree = {**tree, group: {**tree.get(group, {}),
                            **{name: v for name, v in extra}}}
    var_inputs, var_tree = jtu.tree_flatten(
        tree, is_leaf=lambda s: isinstance(s, Symbol))
  arg_inputs = list(node.arg_inputs)
  if act is not None:  # the input, quantized per row before the body
    x = node.inputs[c.x_index]
    x_in = Var(x.aval)
    act_root = _traced(lambda v: _act_quant(v, act, _x_axes(c)),
                       jax.ShapeDtypeStruct(tuple(x.aval.shape), x.aval.dtype))
    act_wiring = {non_literals(act_root.inputs)[0]: x_in}
    act_children = []
    for eqn in act_root.children:
      ins = [s if isinstance(s, Literal) else act_wiring[s]
             for s in eqn.inputs]
      outs = [x if s is act_root.outputs[0] else Var(s.aval)
              for s in eqn.outputs]
      act_wiring.update(zip(eqn.outputs, outs, strict=True))
      act_children.append(eqn.replace(inputs=ins, outputs=outs))
    children = act_children + children
    arg_inputs = [x_in if s is x else s for s in arg_inputs]
  call = Mox(var_inputs + arg_inputs, list(node.outputs),
             {**node.params, 'quant': fmt if mode == 'ptq' else f'{fmt}-qat'},
             children=children + list(node.children),
             module_ty=node.module_ty, entrypoint=node.entrypoint,
             path=node.path, in_tree=node.in_tree, out_tree=node.out_tree,
             var_tree=var_tree)
  return Mox(call.inputs, call.outputs, {}, children=[call],
             constvars=root.constvars, consts=root.consts)


def quantize(mox: Mox, params, selection, *, weight='int8', act=None,
             tile=None, mode='ptq') -> QuantizeResult:
  """Quantizes the kernels of the selected module calls.

  **Arguments:**
  - ``mox``: the traced tree (left unchanged).
  - ``params``: the traced argument that holds the parameters (a Linen
    variables dict, an HF params tree, an ``nnx.State``).
  - ``selection``: XPath (or node list) of module calls whose kernel
    reaches a contraction (every layout ``yax.lora`` adapts).
  - ``weight``: ``'int8'``, ``'int4'``, ``'fp8'`` (``float8_e4m3fn``) or
    ``'nf4'``; one absmax scale per output channel.
  - ``mode``: ``'ptq'`` stores the quantized kernels; ``'qat'`` keeps
    float params and fake-quantizes them in the forward pass with a
    straight-through gradient.
  - ``act``: ``None``, ``'int8'`` or ``'fp8'``: also quantize the
    contraction's other operand dynamically, one scale per row; with it, a
    selected weight-free ``dot_general`` (attention scores ``q.k``,
    ``p.v``) has both operands quantized.
  - ``tile``: ``None`` (one scale per output channel) or a positive int:
    one scale per ``tile`` elements of the contracted axes (flattened in
    kernel order), per output channel.

  **Returns:** a :class:`QuantizeResult` (``.mox``, ``.params``,
  ``.paths``, ``.nbytes``, ``.dequantize``). Integer leaves in ``.params``
  need ``jax.grad(..., allow_int=True)`` or a mask.

  Example::

      q = yax.quantize(mox, variables, '//module_call[@type="Dense"]',
                       weight='int8')
      y = yax.eval_mox(q.mox, q.params, x)
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(
        f'quantize expects a Mox, found {type(mox).__name__}')
  if weight not in FORMATS:
    raise SubstitutionError(
        f'quantize: weight must be one of {sorted(FORMATS)}, found {weight!r}')
  if mode not in ('ptq', 'qat'):
    raise SubstitutionError(
        f"quantize: mode must be 'ptq' or 'qat', found {mode!r}")
  if act not in (None, 'int8', 'fp8'):
    raise SubstitutionError(
        f"quantize: act must be None, 'int8' or 'fp8', found {act!r}")
  if tile is not None and (isinstance(tile, bool) or not isinstance(
      tile, int) or tile < 1):
    raise SubstitutionError(
        f'quantize: tile must be a positive int (elements of the contracted '
        f'axes per scale) or None (one scale per output channel); found '
        f'{tile!r}')
  collections = collections_of(mox)
  group = NNX_GROUP if NNX_GROUP in collections else 'params'
  prefix = collections.get(group)
  if prefix is None or len(prefix) < 2:
    raise SubstitutionError(
        "quantize needs the parameters in one argument of the traced "
        "function, e.g. make_mox(model.apply)(variables, x) or the NNX split "
        "form make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)")
  inside = tuple(prefix[2:])
  chosen = select(selection, mox)
  keypaths = root_keypaths(mox)
  plans, problems = {}, []
  equations = {}
  for node in chosen.targets:
    if isinstance(node, Equation) and node.prim.name == 'dot_general':
      if act is None:
        problems.append((node, 'a dot_general with no parameter operand is '
                         "quantized on its activations: pass act='int8' or "
                         "act='fp8'"))
      else:
        equations[id(node)] = _equation_template(node, act)
      continue
    if not isinstance(node, Mox) or node.is_ephemeral:
      raise SubstitutionError(
          f'quantize selects module calls and dot_general equations, but '
          f'{chosen.description} matched {describe(node)}')
    if any(isinstance(a, Equation) for a in chosen.ancestors[id(node)]):
      problems.append((node, 'it runs inside the body of a lifted transform '
                       '(nn.scan, nn.remat, jit ...), which quantize does not '
                       'reach yet'))
      continue
    plan = _lora.kernel_plan(node, 1)
    if isinstance(plan, str):
      problems.append((node, plan))
      continue
    kernel = node.var_inputs[plan.contraction.kernel_index]
    place = (*prefix, *node.path, plan.kernel_name)
    if tuple(map(str, keypaths.get(kernel, ()))) != tuple(map(str, place)):
      problems.append((node, f'its kernel {kernel.type_str} is not the '
                       'parameter at its own path (a tied or computed '
                       'kernel)'))
      continue
    size = math.prod(plan.kernel_shape[i] for i in _contracted_axes(plan))
    if tile is not None and size % tile:
      problems.append((node, f'tile={tile} does not divide the {size} '
                       'contracted elements of its kernel '
                       f'{kernel.type_str}'))
      continue
    if act is not None and _x_axes(plan.contraction) is None:
      problems.append((node, 'act= quantizes the input of a dot_general fed '
                       'by the module input unchanged; this one is a '
                       f'{plan.contraction.kind} or reshapes its input first'))
      continue
    plans[id(node)] = plan
  if problems:
    lines = '\n'.join(f'  - {describe(n)}: {why}' for n, why in problems)
    raise SubstitutionError(
        f'quantize cannot quantize {len(problems)} of the '
        f'{len(chosen.targets)} module calls selected by '
        f'{chosen.description}:\n{lines}\n' + leave_out_hint(
            [(n, False) for n, _ in problems], selection, chosen.targets))
  # Every reader of a quantized kernel reads it quantized: another call
  # of the same module (Embed's lookup next to its attend) dequantizes the
  # same table; any other reader must be selected too.
  selected = {id(n) for n in chosen.targets}
  readers = {}  # id -> (reader, plan, kernel index)
  holders = _lora.kernel_holders(mox)
  for node in chosen.targets:
    if id(node) in equations:
      continue
    kernel = node.var_inputs[plans[id(node)].contraction.kernel_index]
    for other in (h for h in holders.get(kernel, ())
                  if _contraction.reads(h, kernel)):
      if id(other) in selected or any(
          other is a for a in chosen.ancestors[id(node)]):
        continue
      if other.path == node.path and other.module_ty is node.module_ty:
        readers[id(other)] = (other, plans[id(node)],
                              other.var_inputs.index(kernel))
        continue
      raise SubstitutionError(
          f'quantize: the kernel of {describe(node)} is also read by '
          f'{describe(other)}, which is not selected; quantize both or '
          'neither')
  if readers:
    chosen = select([*chosen.targets, *(r for r, _, _ in readers.values())],
                    mox)

  def make(path, node):
    if id(node) in equations:
      return equations[id(node)]
    if id(node) in readers:
      _, plan, index = readers[id(node)]
      return _template(node, plan, weight, mode, None, index, tile)
    return _template(node, plans[id(node)], weight, mode, act, None, tile)

  done = substitute(chosen, make, mox, retype=(mode == 'ptq'))
  modules = [n for n in chosen.targets if id(n) in plans]
  paths = sorted({tuple(n.path) for n in modules})
  if mode == 'qat':
    return QuantizeResult(done.mox, params, paths,
                          (_nbytes(params), _nbytes(params)), lambda p: p)
  values, seen = [], set()
  for node in modules:
    plan = plans[id(node)]
    keys = (*inside, *node.path)
    if keys in seen:
      continue
    seen.add(keys)
    boxed = get_in(params, (*keys, plan.kernel_name))
    q, scale = quantize_array(_lora.unboxed(boxed), weight,
                              _contracted_axes(plan), tile)
    values.append(((*keys, plan.kernel_name), _lora.boxed_like(boxed, q)))
    scale_value = scale if group != NNX_GROUP else _nnx.variable_holding(
        'Param', scale)
    values.append(((*keys, f'{plan.kernel_name}_scale'), scale_value))
  new_params = set_many(params, values)
  new_mox = _lora.with_argument_structure(done.mox, prefix[:2], new_params)
  quantized = {(*inside, *n.path): plans[id(n)] for n in modules}

  def dequantize(p):
    """Float params for the original tree: each kernel dequantized, its
    scale removed (containers and Variable metadata kept)."""
    out = p
    for keys, plan in sorted(quantized.items()):
      module = get_in(out, keys)
      boxed = get_in(out, (*keys, plan.kernel_name))
      scale = _lora.unboxed(get_in(out, (*keys, f'{plan.kernel_name}_scale')))
      kernel = dequantize_array(_lora.unboxed(boxed), scale, weight,
                                plan_dtype[keys], _contracted_axes(plan))
      out = set_in(out, keys, set_in(
          without(module, (f'{plan.kernel_name}_scale',)),
          (plan.kernel_name,), _lora.boxed_like(boxed, kernel)))
    return out

  plan_dtype = {(*inside, *n.path): n.var_inputs[
      plans[id(n)].contraction.kernel_index].aval.dtype
                for n in modules}
  return QuantizeResult(new_mox, new_params, paths,
                        (_nbytes(params), _nbytes(new_params)), dequantize)
