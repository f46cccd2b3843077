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
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir.arguments import boxed_like, unboxed, with_argument_structure
from yax._src.ir.containers import get_in, set_in, set_many, without
from yax._src.ir.nodes import Equation, Mox, Var, iter_nodes
from yax._src.ir.variables import (NNX_GROUP, VarEntry, is_nnx, var_entries,
                                   with_variables)
from yax._src.rewrite import contraction as _contraction
from yax._src.rewrite.engine import (describe, inline, leave_out_hint, select,
                                     substitute)
from yax._src.rewrite.recipe import recorded
from yax._src.rewrite.quant_formats import (FORMATS, dequantize_array,
                                            dequantize_kernel,
                                            quantize_array,
                                            quantize_kernel, scale_shape)
from yax._src.trace import systems as _systems
from yax._src.trace.make import make_mox

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
    recipe: this call recorded, to replay it on a new trace (``yax.keep``).
  """
  mox: Mox
  params: Any
  paths: list
  nbytes: tuple
  dequantize: Callable[[Any], Any]
  recipe: Any = None


def _fake_quant(w, fmt: str, contracted: tuple, tile=None):
  """The forward pass sees the quantized kernel, the gradient is the
  identity (straight-through)."""
  q, scale = quantize_array(w, fmt, contracted, tile)
  return w + jax.lax.stop_gradient(
      dequantize_array(q, scale, fmt, w.dtype, contracted) - w)


def _nbytes(tree) -> int:
  total = 0
  for leaf in jtu.tree_leaves(tree):
    dtype = getattr(leaf, 'dtype', np.float32)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
      # A PRNG key (an RNG stream's state, ``key<fry>``): NumPy cannot
      # interpret the dtype; its itemsize is that of the key data.
      bits = 8 * dtype.itemsize
    else:
      dtype = jnp.dtype(dtype)
      bits = 4 if dtype in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else \
          8 * dtype.itemsize
    total += math.prod(np.shape(leaf)) * bits / 8
  return int(math.ceil(total))


def _traced(fn, *specs):
  """The equations of ``fn`` traced at ``specs`` (an ephemeral root)."""
  return make_mox(fn)(*(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
                        for x in specs))


# The traced (de)quantization functions are only read (``inline`` copies
# them with fresh symbols), so one trace serves every kernel of the same
# shape and format: BERT-base's 73 Dense layers need 3 traces, not 73.
@functools.lru_cache(maxsize=256)
def _dequantizer(shape: tuple, dtype, fmt: str, contracted: tuple,
                 tile) -> Mox:
  """``(q, scale) -> kernel`` of a kernel of ``shape`` and ``dtype``."""
  q_dtype = FORMATS[fmt][0]
  return _traced(lambda q, s: dequantize_array(q, s, fmt, dtype, contracted),
                 jax.ShapeDtypeStruct(shape, q_dtype),
                 jax.ShapeDtypeStruct(scale_shape(shape, contracted, tile),
                                      jnp.float32))


@functools.lru_cache(maxsize=256)
def _fake_quantizer(shape: tuple, dtype, fmt: str, contracted: tuple,
                    tile) -> Mox:
  """``kernel -> kernel`` fake-quantized (QAT)."""
  return _traced(lambda w: _fake_quant(w, fmt, contracted, tile),
                 jax.ShapeDtypeStruct(shape, dtype))


@functools.lru_cache(maxsize=256)
def _act_quantizer(shape: tuple, dtype, fmt: str, axes: tuple) -> Mox:
  """``x -> x`` quantized per row over ``axes`` (dynamic, straight-through)."""
  return _traced(lambda v: _act_quant(v, fmt, axes),
                 jax.ShapeDtypeStruct(shape, dtype))


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


def _template(node: Mox, kernels, fmt: str, mode: str, act=None,
              tile=None) -> Mox:
  """``node`` reading its kernels through (de)quantization equations.
  ``kernels``: ``[(plan, index), ...]``, one per kernel the call reads
  quantized (a MoE's expert kernels: several), ``index`` where the kernel
  is among the node's variables (None: the plan's own; a call that reads
  the kernel of another call's plan, as Embed's lookup reads the table its
  attend contracts, gives its own)."""
  var_inputs = list(node.var_inputs)
  children, extra, constvars, consts = [], [], [], []
  inits = dict(node.inits or {})
  group, kind = ((NNX_GROUP, 'Param') if is_nnx(node)
                 else (kernels[0][0].kernel_keys[0],) * 2)
  for plan, kernel_index in kernels:
    index = (plan.contraction.kernel_index if kernel_index is None
             else kernel_index)
    kernel = node.var_inputs[index]
    contracted = plan.contracted
    shape, dtype = tuple(kernel.aval.shape), kernel.aval.dtype
    scale_name = f'{plan.kernel_name}_scale'
    if mode == 'qat':
      stored = Var(kernel.aval)
      root = _fake_quantizer(shape, dtype, fmt, contracted, tile)
      scales = []
    else:
      q_dtype = FORMATS[fmt][0]
      stored = Var(jax.core.ShapedArray(shape, jnp.dtype(q_dtype)))
      scale = Var(jax.core.ShapedArray(scale_shape(shape, contracted, tile),
                                       jnp.float32))
      root = _dequantizer(shape, dtype, fmt, contracted, tile)
      scales = [(scale_name, scale)]
      # How init_params stores a float kernel quantized.
      inits[(group, scale_name)] = functools.partial(
          _init_scale, var_entries(node)[index].keys, (group, scale_name),
          fmt, contracted, tile, len(shape), plan.source_perm)
    children += inline(root, [stored, *(v for _, v in scales)], [kernel])
    constvars += root.constvars
    consts += root.consts
    var_inputs[index] = stored
    extra += scales
  var_inputs, var_tree = with_variables(node, var_inputs, [
      VarEntry(group, kind, (name,), True, True, sym) for name, sym in extra])
  arg_inputs = list(node.arg_inputs)
  if act is not None:  # the input, quantized per row before the body
    c = kernels[0][0].contraction
    x = node.inputs[c.x_index]
    x_in = Var(x.aval)
    act_root = _act_quantizer(tuple(x.aval.shape), x.aval.dtype, act,
                              _x_axes(c))
    children = inline(act_root, [x_in], [x]) + children
    constvars += act_root.constvars
    consts += act_root.consts
    arg_inputs = [x_in if s is x else s for s in arg_inputs]
  call = Mox(var_inputs + arg_inputs, list(node.outputs),
             {**node.params, 'quant': fmt if mode == 'ptq' else f'{fmt}-qat'},
             children=children + list(node.children),
             module_ty=node.module_ty, entrypoint=node.entrypoint,
             path=node.path, in_tree=node.in_tree, out_tree=node.out_tree,
             var_tree=var_tree, inits=inits or None)
  return Mox(call.inputs, call.outputs, {}, children=[call],
             constvars=constvars, consts=consts)


def _init_scale(kernel_keys, scale_keys, fmt, contracted, tile, ndim, perm,
                key, aval, read):
  """The record of a scale for ``yax.init_params``: the kernel the params
  hold (float, stacked or not) stored quantized, and its scales, as
  ``quantize`` stores them."""
  del key, aval
  kernel = read(kernel_keys)
  if not jnp.issubdtype(kernel.dtype, jnp.floating) or \
      jnp.dtype(kernel.dtype).itemsize < 2:
    raise SubstitutionError(
        f'the kernel {kernel_keys[-1]!r} is held already stored as '
        f'{kernel.dtype}; its scale {scale_keys[-1]!r} comes from the float '
        'kernel')
  q, scale = quantize_kernel(kernel, fmt, contracted, tile,
                             kernel.ndim - ndim, perm)
  return {kernel_keys: q, scale_keys: scale}


@recorded
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
  chosen = select(selection, mox)
  group = NNX_GROUP if NNX_GROUP in chosen.collections else 'params'
  prefix = chosen.collections.get(group)
  if prefix is None or len(prefix) < 2:
    raise SubstitutionError(
        "quantize needs the parameters in one argument of the traced "
        "function, e.g. make_mox(model.apply)(variables, x) or the NNX split "
        "form make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)")
  equations, modules, problems = {}, [], []
  for node in chosen.targets:
    if isinstance(node, Equation) and node.prim.name == 'dot_general':
      if act is None:
        problems.append((node, 'a dot_general with no parameter operand is '
                         "quantized on its activations: pass act='int8' or "
                         "act='fp8'"))
      else:
        equations[id(node)] = _equation_template(node, act)
    else:
      modules.append(node)
  # Every kernel a call contracts: its one kernel, or each kernel it
  # contracts in its body (a MoE's experts, [experts, in, out]).
  targets = _contraction.plan_kernels(
      dataclasses.replace(chosen, targets=tuple(modules)), 'quantize',
      every=True)
  plans = {}
  for target in targets:
    node, plan = target.node, target.plan
    if plan is None:
      problems.append((node, target.why))
      continue
    kernel = node.var_inputs[plan.contraction.kernel_index]
    if not target.own:
      problems.append((node, f'its kernel {kernel.type_str} is not the '
                       'parameter at its own path (a tied or computed '
                       'kernel)'))
      continue
    size = math.prod(plan.kernel_shape[i] for i in plan.contracted)
    if tile is not None and size % tile:
      problems.append((node, f'tile={tile} does not divide the {size} '
                       'contracted elements of its kernel '
                       f'{kernel.type_str}'))
      continue
    if act is not None and (plan.site is not None or
                            _x_axes(plan.contraction) is None):
      problems.append((node, 'act= quantizes the input of a dot_general fed '
                       'by the module input unchanged; '
                       + (f'its kernel {plan.kernel_name!r} is contracted '
                          'inside its body' if plan.site is not None else
                          f'this one is a {plan.contraction.kind} or '
                          'reshapes its input first')))
      continue
    plans.setdefault(id(node), []).append(plan)
  if problems:
    lines = '\n'.join(f'  - {describe(n)}: {why}' for n, why in problems)
    refused = list({id(n): n for n, _ in problems}.values())
    raise SubstitutionError(
        f'quantize cannot quantize {len(refused)} of the '
        f'{len(chosen.targets)} module calls selected by '
        f'{chosen.description}:\n{lines}\n' + leave_out_hint(
            [(n, False) for n in refused], selection, chosen.targets))
  # Every reader of a quantized kernel reads it quantized: another call
  # of the same module (Embed's lookup next to its attend) dequantizes the
  # same table; any other reader must be selected too.
  selected = {id(n) for n in chosen.targets}
  readers = {}  # id -> (reader, [(plan, kernel index), ...])
  holders = _contraction.kernel_holders(mox)
  for target in targets:
    node = target.node
    kernel = node.var_inputs[target.plan.contraction.kernel_index]
    for other in _contraction.other_readers(holders, chosen, target):
      if id(other) in selected:
        continue
      if other.path == node.path and other.module_ty is node.module_ty:
        readers.setdefault(id(other), (other, []))[1].append(
            (target.plan, other.var_inputs.index(kernel)))
        continue
      raise SubstitutionError(
          f'quantize: the kernel of {describe(node)} is also read by '
          f'{describe(other)}, which is not selected; quantize both or '
          'neither')
  # A call that lists a kernel among its variables without holding it (an
  # nnx.jit method hands every Variable it is given back out of its jit
  # body) would go on reading the float kernel that the rewrite stores
  # quantized: refused, naming it, rather than a tree that reads an
  # undefined value.
  for target in targets:
    node = target.node
    kernel = node.var_inputs[target.plan.contraction.kernel_index]
    near = ({id(n) for n in iter_nodes(node)} | {
        id(a) for a in chosen.ancestors[id(node)]} | selected | {
            id(h) for h in holders.get(kernel, ())})
    for other in iter_nodes(mox):
      if isinstance(other, Mox) and id(other) not in near and any(
          s is kernel for s in other.var_inputs):
        raise SubstitutionError(
            f'quantize: the kernel {kernel.type_str} of {describe(node)} is '
            f'also a variable input of {describe(other)} (method '
            f'{other.entrypoint or "__call__"}), which neither '
            'holds nor contracts it (an nnx.jit method passes every '
            'Variable through its jit body); storing it quantized would '
            'leave that call reading the float kernel. Select module calls '
            'whose kernels no other call is given')
  if readers:
    chosen = select([*chosen.targets, *(r for r, _ in readers.values())],
                    mox)

  def make(path, node):
    if id(node) in equations:
      return equations[id(node)]
    if id(node) in readers:
      return _template(node, readers[id(node)][1], weight, mode, None, tile)
    return _template(node, [(p, None) for p in plans[id(node)]], weight,
                     mode, act, tile)

  done = substitute(chosen, make, mox, retype=(mode == 'ptq'))
  paths = sorted({tuple(t.node.path) for t in targets})
  if mode == 'qat':
    return QuantizeResult(done.mox, params, paths,
                          (_nbytes(params), _nbytes(params)), lambda p: p)
  # The new params are where the rewrite put them: each kernel the tree
  # now reads quantized (per slice of a stacked kernel), its scale next to
  # it.
  where = prefix[:2]  # the argument that holds the params
  plan_at = {t.keypath: t.plan for t in targets}
  # A location names modules by path (strings); a key path may hold the
  # int index of a list (an nnx.List's state): compared as strings.
  added = {tuple(map(str, (*done.collections[loc[0]], *loc[1:])))
           for loc in done.added}
  values, stored = [], {}
  for keypath, var in sorted(done.retyped.items(), key=lambda kv: str(kv[0])):
    plan = plan_at[keypath]
    scale_path = (*keypath[:-1], f'{plan.kernel_name}_scale')
    if tuple(map(str, scale_path)) not in added:
      raise SubstitutionError(
          f'internal: quantize stored {keypath} quantized but placed no '
          f'scale at {scale_path}')
    keys = keypath[len(where):]
    boxed = get_in(params, keys)
    kernel = unboxed(boxed)
    stack = var.aval.ndim - len(plan.kernel_shape)
    q, scale = quantize_kernel(kernel, weight, plan.contracted, tile, stack,
                               plan.source_perm)
    values.append((keys, boxed_like(boxed, q)))
    # The scale is held as its kernel is: an NNX Variable in an NNX state,
    # a plain array in a Linen dict or an Equinox module.
    values.append((scale_path[len(where):], scale if group != NNX_GROUP
                   or kernel is boxed
                   else _systems.typed_variable('Param', scale)))
    stored[keys] = _Stored(plan.kernel_name, plan.contracted, stack,
                           jnp.dtype(kernel.dtype), plan.source_perm)
  new_params = set_many(params, values)
  new_mox = with_argument_structure(done.mox, where, new_params)
  return QuantizeResult(
      new_mox, new_params, paths, (_nbytes(params), _nbytes(new_params)),
      functools.partial(dequantize, stored=stored, weight=weight))


@dataclasses.dataclass(frozen=True)
class _Stored:
  """How one kernel is stored quantized: its name, the axes its scales
  reduce, how many leading axes stack it (``nn.scan``), its float dtype
  and the transpose that puts the stack first (``KernelPlan.source_perm``;
  None where it is first already)."""
  name: str
  contracted: tuple
  stack: int
  dtype: Any
  perm: tuple | None = None


def dequantize(params, *, stored: dict, weight: str):
  """Float params for the tree ``quantize`` started from: each kernel of
  ``stored`` (key path in ``params`` -> :class:`_Stored`) dequantized and
  its scale removed, containers and Variable metadata kept."""
  out = params
  for keys, kernel in sorted(stored.items(), key=lambda kv: str(kv[0])):
    scale_name = f'{kernel.name}_scale'
    module = get_in(out, keys[:-1])
    boxed = get_in(out, keys)
    scale = unboxed(get_in(out, (*keys[:-1], scale_name)))
    value = dequantize_kernel(unboxed(boxed), scale, weight, kernel.dtype,
                              kernel.contracted, kernel.stack, kernel.perm)
    out = set_in(out, keys[:-1], set_in(without(module, (scale_name,)),
                                        (kernel.name,),
                                        boxed_like(boxed, value)))
  return out
