"""LoRA: low-rank adapters on the linear layers of a traced model.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021),
https://arxiv.org/abs/2106.09685. A frozen linear map ``y = x W + b`` gets a
trainable low-rank update::

    y = x W + b + (alpha / rank) * (x A) B,   A: [in, rank], B: [rank, out]

``B`` starts at zero, so the adapted model computes exactly what the original
did until the adapters are trained. ``yax.lora`` builds this on top of
``yax.sub``: each selected module call becomes a ``LoRA`` module call whose
body is the original call followed by the adapter equations, and whose
variables are the original ones plus ``lora_a`` and ``lora_b`` (stored next
to ``kernel`` in the params tree).

What it refuses, each with a ``SubstitutionError`` that names the module
path and shows an XPath predicate that leaves the module out:

* a module that already carries an adapter (a ``LoRA`` call, a module inside
  one, or one whose params already hold ``lora_a``/``lora_b``): adapting it
  again would count the adapter twice;
* a module whose kernel is not a parameter of the traced arguments at the
  module's own path: a kernel computed in the model (a tied embedding
  transposed and passed to a nested ``Module.apply``, as Hugging Face's
  GPT-Neo, OPT, mBART ... heads do) or passed in under another path. An
  adapter there would land where the module's kernel is not (for a nested
  apply: at the root of the params tree, shared by every such head);
* a module whose kernel is not contracted in a way an adapter fits (see
  ``yax/_contraction.py``: the kernel must reach one ``dot_general`` or
  ungrouped convolution, whose output reaches the module output through
  casts, reshapes, transposes and added biases only).

Which layers are adapted is decided by the contraction, not the class:
``A: [*contracted kernel axes, rank]`` and ``B: [rank, *other kernel
axes]`` for ``dot_general`` layouts (Dense, DenseGeneral on any axes,
Einsum, transposed kernels); ``A: [*window, in, rank]`` and ``B: [rank,
out]`` for convolutions. The adapter runs on the contraction's input, and
its output takes the contraction output's path to the module output.

A module called twice with the same weights (one kernel, two call sites)
gets one adapter pair, read by both calls.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util as jtu

from yax import _contraction, _rules
from yax._containers import get_in, set_in, set_many, without
from yax._errors import SubstitutionError
from yax._formats import FORMATS, dequantize_array
from yax._ir import Equation, Literal, Mox, Symbol, Var, iter_nodes
from yax import _nnx
from yax._sub import (NNX_GROUP, Selection, collections_of, non_literals,
                      describe, leave_out_hint, root_keypaths, select,
                      substitute, var_keys, var_kind)
from yax._trace import make_mox


class LoRA:
  """Marker class for LoRA module calls (``module_ty`` of adapted nodes)."""


@dataclasses.dataclass
class LoraResult:
  """What ``yax.lora`` returns.

  Attributes:
    mox: the rewritten tree.
    params: the argument to pass where ``params`` went: the original weights
      and the adapters (``lora_a`` random, ``lora_b`` zero).
    mask: a pytree of bools with ``params``' structure, True exactly on the
      adapter weights (for ``optax.masked`` / ``optax.multi_transform``).
    merge: ``merge(p)`` folds trained adapters in ``p`` into the kernels and
      returns a params tree for the ORIGINAL tree.
  """
  mox: Mox
  params: Any
  mask: Any
  merge: Callable[[Any], Any]
  paths: list  # module paths that were adapted



_ADAPTER_NAMES = ('lora_a', 'lora_b')


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How one module call gets its adapter: its kernel's contraction and the
  adapter shapes, in the kernel's own axis order.

  ``A: [*contracted kernel axes, rank]`` and ``B: [rank, *other kernel
  axes]`` for a ``dot_general``; ``A: [*kernel axes but the output feature,
  rank]`` (the window and input features) and ``B: [rank, out]`` for a
  convolution.
  """
  contraction: _contraction.Contraction
  kernel_keys: tuple  # ('params', 'kernel'), ('nnx', 'w') ...
  kernel_shape: tuple
  a_shape: tuple
  b_shape: tuple
  a_axes: tuple  # kernel axis of each axis of A (None: the rank)
  b_axes: tuple
  names: tuple = _ADAPTER_NAMES  # the adapters' variable names
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
  # j is the param's axis source_perm[j]. The adapters stack on axis 0.
  source_perm: tuple | None = None

  @property
  def kernel_name(self) -> str:
    return self.kernel_keys[-1]

  @property
  def contracted(self) -> tuple:
    """The kernel axes its contraction contracts."""
    return tuple(v for v in self.a_axes
                 if v is not None and v not in self.stack)


def adapter_dtype(kernel: Symbol, c: _contraction.Contraction):
  """The kernel's dtype, or for a quantized kernel (int8, fp8 ...) the
  dtype its contraction computes in."""
  dtype = kernel.aval.dtype
  if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize >= 2:
    return dtype
  return c.z_aval.dtype


def _own_params(node: Mox) -> list[int]:
  """Variable input positions of the module's own parameters."""
  return [i for i, keys in enumerate(var_keys(node))
          if len(keys) == 2 and var_kind(node, i)[1]]


def _own_param_names(node: Mox) -> set:
  keys = var_keys(node)
  return {keys[i][-1] for i in _own_params(node)}


def _is_adapter_name(name) -> bool:
  return isinstance(name, str) and name.endswith(_ADAPTER_NAMES)


def _path_str(node: Mox) -> str:
  return '/'.join(node.path)


def kernel_plan(node: Mox, rank: int) -> _Plan | str:
  """How ``node`` is adapted, or why it cannot be."""
  keys = var_keys(node)
  candidates = [i for i in _own_params(node)
                if node.var_inputs[i].aval is not None
                and node.var_inputs[i].aval.ndim >= 2]
  found, reasons = [], []
  for i in sorted(candidates, key=lambda i: keys[i][-1] != 'kernel'):
    got = _contraction.find(node, i)
    (found if isinstance(got, _contraction.Contraction) else reasons).append(
        (i, got))
  if not found:
    if reasons:
      i, why = reasons[0]
      return (f"its kernel {'/'.join(keys[i])}:"
              f'{node.var_inputs[i].type_str} cannot carry an adapter: {why}')
    listed = ', '.join('/'.join(k) + ':' + s.type_str
                       for k, s in zip(keys, node.var_inputs, strict=True))
    return ('it has no parameter of 2 or more axes that reaches a '
            'dot_general or convolution (a kernel); its variables are '
            f"[{listed or 'none'}]")
  if len(found) > 1:
    names = ', '.join('/'.join(keys[i]) for i, _ in found)
    return (f'it contracts several kernels ({names}); select the modules '
            'that hold one kernel each')
  index, c = found[0]
  shape = tuple(node.var_inputs[index].aval.shape)
  stack = ()
  if c.kind == 'dot_general':
    (lc, rc), (lb, rb) = c.dimension_numbers
    kc = (lc, rc)[c.kernel_side]
    contracted = sorted(c.perm[a] for a in kc)
    stack = _stacked_axes(node, index, sorted(
        c.perm[a] for a in (lb, rb)[c.kernel_side]))
    other = [v for v in range(len(shape))
             if v not in contracted and v not in stack]
    a_axes, b_axes = (*stack, *contracted, None), (*stack, None, *other)
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
  return _Plan(c, keys[index], shape, size(a_axes), size(b_axes), a_axes,
               b_axes, quant=quant, stack=stack)


def _stacked_axes(node: Mox, index: int, batch: list) -> tuple:
  """The kernel axes among ``batch`` (its contraction's batch axes) that
  a lifted ``nn.vmap`` stacked: the axes the kernel has beyond the shape
  the module itself declares at the call's argument shapes. (A batch axis
  the module declares, as ``DenseGeneral(batch_dims=...)``'s, is a kernel
  axis like any other.)"""
  cls = node.module_ty
  if not batch or not (isinstance(cls, type) and issubclass(cls, nn.Module)):
    return ()
  keys = var_keys(node)[index]
  try:
    fields = {f.name for f in dataclasses.fields(cls)
              if f.init and f.name not in ('parent', 'name')}
    module = cls(**{k: v for k, v in node.params.items() if k in fields})
    method = getattr(cls, node.entrypoint or '__call__')

    def init(*arrays):
      it = iter(arrays)
      args, kwargs = jtu.tree_unflatten(node.in_tree, [
          next(it) if s.aval is not None else s.value
          for s in node.arg_inputs])
      return module.init(jax.random.key(0), *args, method=method, **kwargs)
    declared = jax.eval_shape(init, *(
        jax.ShapeDtypeStruct(s.aval.shape, s.aval.dtype)
        for s in node.arg_inputs if s.aval is not None))
    declared = tuple(nn.meta.unbox(declared)[keys[0]][keys[1]].shape)
  except Exception:  # pylint: disable=broad-except
    # The module cannot be rebuilt from its recorded fields: no stacking
    # is assumed (its batch axes are kernel axes like any other).
    return ()
  shape = tuple(node.var_inputs[index].aval.shape)
  extra = len(shape) - len(declared)
  if extra <= 0:
    return ()
  for axes in itertools.combinations(batch, extra):
    if tuple(n for i, n in enumerate(shape) if i not in axes) == declared:
      return tuple(axes)
  return ()


def _dot_letters(c: _contraction.Contraction, k_ndim: int, x_ndim: int,
                 stack: tuple = ()):
  """einsum subscripts: (x, A, h, B, output, kernel) for a dot_general
  (``stack``: kernel axes that lead both A and B)."""
  (lc, rc), (lb, rb) = c.dimension_numbers
  side = c.kernel_side
  kc, kb = (lc, rc)[side], (lb, rb)[side]
  xc, xb = (lc, rc)[1 - side], (lb, rb)[1 - side]
  pool = iter('abcdefghijklmnopqstuvwxyzABCDEFGHIJKLMNOPQSTUVWXYZ')
  var = [next(pool) for _ in range(k_ndim)]  # by kernel variable axis
  op = [var[c.perm[j]] for j in range(k_ndim)]  # by operand axis
  xs = [None] * x_ndim
  for xa, ka in zip((*xc, *xb), (*kc, *kb), strict=True):
    xs[xa] = op[ka]
  xs = [s or next(pool) for s in xs]
  contracted = sorted(c.perm[a] for a in kc)
  lead = ''.join(var[v] for v in stack)
  a_sub = lead + ''.join(var[v] for v in contracted) + 'r'
  b_sub = lead + 'r' + ''.join(var[v] for v in range(k_ndim)
                               if v not in contracted and v not in stack)
  h_sub = ''.join(xs[i] for i in range(x_ndim) if i not in xc) + 'r'
  batch = ''.join(xs[i] for i in xb)
  x_free = ''.join(xs[i] for i in range(x_ndim) if i not in xc and i not in xb)
  k_free = ''.join(op[j] for j in range(k_ndim) if j not in kc and j not in kb)
  out = batch + (x_free + k_free if side == 1 else k_free + x_free)
  return ''.join(xs), a_sub, h_sub, b_sub, out, ''.join(var)


def _delta(c: _contraction.Contraction, k_ndim: int, x, a, b, stack=()):
  """The change of the contraction's output for the kernel change
  ``A @ B``, computed without forming it: ``(x A) B``."""
  if c.kind == 'dot_general':
    x_sub, a_sub, h_sub, b_sub, out, _ = _dot_letters(c, k_ndim, x.ndim,
                                                      stack)
    h = jnp.einsum(f'{x_sub},{a_sub}->{h_sub}', x, a)
    return jnp.einsum(f'{h_sub},{b_sub}->{out}', h, b)
  params = dict(c.params)
  dn = params['dimension_numbers']
  window = jnp.moveaxis(a, -1, dn.rhs_spec[0])  # the kernel's layout, rank out
  h = jax.lax.conv_general_dilated(
      x, window, params['window_strides'], params['padding'],
      params['lhs_dilation'], params['rhs_dilation'], dimension_numbers=dn)
  feature = dn.out_spec[1]
  return jnp.moveaxis(jnp.moveaxis(h, feature, -1) @ b, -1, feature)


def _kernel_delta(plan: _Plan, a, b):
  """``A @ B`` in the kernel's shape (leading axes of a stacked kernel, as
  ``nn.scan`` makes them, kept; moved back where a transpose took them
  from, see ``_Plan.source_perm``)."""
  c, n = plan.contraction, len(plan.kernel_shape)
  if c.kind == 'dot_general':
    _, a_sub, _, b_sub, _, k_sub = _dot_letters(c, n, c.operand_aval.ndim,
                                                plan.stack)
    delta = jnp.einsum(f'...{a_sub},...{b_sub}->...{k_sub}', a, b)
  else:
    out = c.dimension_numbers.rhs_spec[0]
    rest = 'abcdefghijklmnopq'[:n - 1]
    flat = jnp.einsum(f'...{rest}r,...ro->...{rest}o', a, b)
    delta = jnp.moveaxis(flat, -1, flat.ndim - n + out)
  perm = plan.source_perm
  if perm is not None and delta.ndim == len(perm):
    delta = jnp.transpose(delta, np.argsort(perm))
  return delta


# The traced adapter is only read (its symbols are re-wired per node), so one
# trace serves every node of the same plan: BERT-base's 73 Dense layers need
# 3 traces instead of 73.
@functools.lru_cache(maxsize=256)
def _traced_adapter(c: _contraction.Contraction, k_ndim, a_shape, b_shape,
                    x_aval, y_aval, dtype, scale, stack=()):
  def adapter(y, x, a, b):
    for step in c.x_steps:
      x = step.apply(x)
    delta = _delta(c, k_ndim, x.astype(dtype), a, b, stack)
    delta = (scale * delta).astype(c.z_aval.dtype)
    for step in c.y_steps:
      delta = step.apply(delta)
    return y + delta.astype(y.dtype)
  spec = jax.ShapeDtypeStruct
  return make_mox(adapter)(
      spec(y_aval.shape, y_aval.dtype), spec(x_aval.shape, x_aval.dtype),
      spec(a_shape, dtype), spec(b_shape, dtype))


def _adapter_mox(plan: _Plan, x_aval, y_aval, dtype, scale):
  args = (plan.contraction, len(plan.kernel_shape), plan.a_shape,
          plan.b_shape, x_aval, y_aval, dtype, scale, plan.stack)
  try:
    return _traced_adapter(*args)
  except TypeError as e:  # a step's parameter that is not hashable
    if 'unhashable' not in str(e):
      raise
    return _traced_adapter.__wrapped__(*args)


def _lora_template(node: Mox, plan: _Plan, rank: int, alpha: float) -> Mox:
  """A ``LoRA`` module call wrapping ``node``; reads the node's symbols."""
  c = plan.contraction
  kernel = node.var_inputs[c.kernel_index]
  x, y = node.inputs[c.x_index], node.outputs[c.y_index]
  dtype = adapter_dtype(kernel, c)
  adapter = _adapter_mox(plan, x.aval, y.aval, dtype, alpha / rank)
  if adapter.constvars:
    raise SubstitutionError(
        f'internal: the traced LoRA adapter captured {len(adapter.constvars)} '
        'constants; it must be a function of (y, x, a, b) only')
  a = Var(jax.core.ShapedArray(plan.a_shape, dtype))
  b = Var(jax.core.ShapedArray(plan.b_shape, dtype))
  # Wire the adapter's inputs (y, x, a, b) to the node's symbols.
  y_in, x_in, a_in, b_in = non_literals(adapter.inputs)
  wiring = {y_in: y, x_in: x, a_in: a, b_in: b}

  def wired(sym):
    if isinstance(sym, Literal):
      return sym
    if sym not in wiring:
      raise SubstitutionError(
          f'internal: the traced LoRA adapter reads {sym!r}, which is neither '
          'one of its inputs nor computed by it')
    return wiring[sym]

  children = [node]
  for eqn in adapter.children:
    inputs = [wired(s) for s in eqn.inputs]
    # The result has the module output's type, sharding included.
    new_out = [Var(y.aval if s is adapter.outputs[0] else s.aval)
               for s in eqn.outputs]
    wiring.update(zip(eqn.outputs, new_out, strict=True))
    children.append(eqn.replace(inputs=inputs, outputs=new_out))
  out = wired(adapter.outputs[0])
  a_name, b_name = plan.names
  var_dict = (jtu.tree_unflatten(node.var_tree, node.var_inputs)
              if node.num_vars else {})
  if isinstance(var_dict, _nnx.VariableTree):  # NNX: typed nnx.LoRAParam s
    entries = [(keys[1:], (kind, *flags)) for keys, kind, flags in zip(
        var_keys(node), var_dict.kinds, var_dict.flags, strict=True)]
    entries += [((a_name,), ('LoRAParam', True, True)),
                ((b_name,), ('LoRAParam', True, True))]
    var_tree = _nnx.variable_treedef(entries)
    by_rel = {rel: sym for (rel, _), sym in zip(
        entries, [*node.var_inputs, a, b], strict=True)}
    var_inputs = [by_rel[tuple(str(k.key) for k in kp)] for kp, _ in
                  jtu.tree_flatten_with_path(jtu.tree_unflatten(
                      var_tree, [0] * len(entries)))[0]]
  else:
    group = plan.kernel_keys[0]
    # Relative to the node: () next to its kernel, the calling module's
    # path and the head's name for a nested apply's root (path ()).
    rel = tuple(plan.place[len(node.path):])
    adapters = {a_name: a, b_name: b}
    for key in reversed(rel):
      adapters = {key: adapters}
    var_dict = {**var_dict, group: {**var_dict.get(group, {}), **adapters}}
    var_inputs, var_tree = jtu.tree_flatten(
        var_dict, is_leaf=lambda s: isinstance(s, Symbol))
  outputs = [out if i == c.y_index else s for i, s in enumerate(node.outputs)]
  return Mox(var_inputs + list(node.arg_inputs), outputs,
             {'name': node.name, 'rank': rank, 'alpha': alpha,
              'base': node.type_name, 'kernel': plan.kernel_name},
             children=children, module_ty=LoRA, entrypoint='__call__',
             path=node.path, in_tree=node.in_tree, out_tree=node.out_tree,
             var_tree=var_tree)


# ------------------------------------------------- where a kernel comes from

def _kernel_source(sym: Symbol, ancestors: tuple, keypaths: dict):
  """(root key path of the kernel ``sym``, None, perm) or (None, why it
  has none, None). ``perm``: the transpose a stacked param went through
  before a scan sliced it (see ``_Plan.source_perm``), or None."""
  chain = list(ancestors)
  i = len(chain) - 1
  perm = None
  while i >= 1:
    body, eqn = chain[i], chain[i - 1]
    if not isinstance(eqn, Equation):
      i -= 1
      continue
    positions = [j for j, s in enumerate(body.inputs) if s is sym]
    if not positions:
      return None, f'computed inside the body of {describe(eqn)}', None
    index = [id(c) for c in eqn.children].index(id(body))
    sym = _rules.body_input_sources(eqn, index)[positions[0]]
    if eqn.prim.name == 'scan' and i >= 2 and sym not in keypaths:
      sym, perm = _untransposed(chain[i - 2], sym)
    i -= 2
  if sym in keypaths:
    return keypaths[sym], None, perm
  if any(sym is c for c in chain[0].constvars):
    return None, 'a constant captured by the trace', None
  return None, 'computed in the model', None


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
      for keys, sym in zip(var_keys(node), node.var_inputs, strict=True):
        if len(keys) == 2:
          holders.setdefault(sym, []).append(node)
  return holders


def _refuse(problems, chosen: Selection, selection):
  """One error for every module lora cannot adapt, with a way around."""
  lines = [f"  - {describe(n)}{f' (name {n.name!r})' if n.name else ''}: "
           f'{why}' for n, why, _ in problems]
  raise SubstitutionError(
      f'lora cannot adapt {len(problems)} of the {len(chosen.targets)} module '
      f'calls selected by {chosen.description}:\n' + '\n'.join(lines) +
      '\n' + leave_out_hint([(n, wrapped) for n, _, wrapped in problems],
                             selection, chosen.targets))


# ---------------------------------------------------------- argument checks

def _check_rank(rank) -> int:
  if (isinstance(rank, bool) or not isinstance(rank, numbers.Integral)
      or rank < 1):
    raise SubstitutionError(
        f'lora: rank must be a positive int, found {type(rank).__name__} '
        f'{rank!r}')
  return int(rank)


def _check_alpha(alpha) -> float:
  if (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
      or not math.isfinite(alpha)):
    raise SubstitutionError(
        f'lora: alpha must be a finite real number, found '
        f'{type(alpha).__name__} {alpha!r}')
  return float(alpha)


def _check_key(key):
  if key is None:
    return jax.random.key(0)
  dtype = getattr(key, 'dtype', None)
  shape = tuple(getattr(key, 'shape', (None,)))
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if shape == ():
      return key
  elif dtype == jnp.uint32 and shape == (2,):  # a raw jax.random.PRNGKey
    return key
  raise SubstitutionError(
      'lora: key must be one PRNG key, e.g. jax.random.key(0) (or a raw '
      f'jax.random.PRNGKey(0)); found {type(key).__name__} '
      f'{getattr(key, "dtype", "")}{list(shape) if dtype is not None else ""} '
      f'{key!r}'[:300])


def _params_argument(mox: Mox, prefix: tuple, params):
  """Checks ``params`` against the traced argument at ``prefix``."""
  # prefix = (0|1, position or kwarg name, *keys inside that argument)
  root_args = jtu.tree_unflatten(mox.in_tree, mox.inputs)
  arg = root_args[prefix[0]][prefix[1]]
  if jtu.tree_structure(arg) != jtu.tree_structure(params):
    raise SubstitutionError(
        'lora: `params` must have the structure of the traced argument that '
        f'holds the parameters ({"args" if prefix[0] == 0 else "kwargs"}'
        f'[{prefix[1]!r}]).\n  expected: {jtu.tree_structure(arg)}\n'
        f'  given:    {jtu.tree_structure(params)}')


_DEFAULT_SELECTION = '//module_call[@type="Dense"]'


def lora(mox: Mox, params, selection=_DEFAULT_SELECTION, *,
         rank: int = 4, alpha: float = 1.0, key=None) -> LoraResult:
  """Wraps every selected linear module call in a LoRA adapter.

  **Arguments:**
  - ``mox``: the traced tree (left unchanged).
  - ``params``: the traced argument that holds the parameters: the variables
    dict for ``model.apply`` (``{'params': ...}``) or the params tree of an
    HF-style call (``model(x, params=...)``). Dicts, ``FrozenDict`` s and
    other Mappings come back as the same types in ``.params``, ``.mask``
    and from ``.merge``.
  - ``selection``: XPath (or node list) of module calls whose own kernel
    reaches a ``dot_general`` or convolution (Dense, DenseGeneral, Einsum,
    Conv, ... on Linen and NNX). It must match at least one module call, only
    nodes of ``mox``, and no node together with one of its ancestors.
  - ``rank``: a positive int; ``alpha``: a finite real. The adapter is
    scaled by ``alpha / rank``.
  - ``key``: PRNG key for ``lora_a`` (``jax.random.key(0)`` if omitted).

  **Returns:** a :class:`LoraResult` with ``.mox``, ``.params``, ``.mask``,
  ``.merge``, ``.paths``.

  Raises ``yax.SubstitutionError`` (changing nothing) for a bad argument or
  selection, and for modules it cannot adapt (already adapted, a computed
  kernel, an unsupported kernel layout): the message names each such module
  and shows the selection with a predicate that leaves them out.

  Example::

      res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=8)
      y = yax.eval_mox(res.mox, res.params, x)     # equals the original at init
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(f'lora expects a Mox, found {type(mox).__name__}')
  rank, alpha, key = _check_rank(rank), _check_alpha(alpha), _check_key(key)
  collections = collections_of(mox)
  group = NNX_GROUP if NNX_GROUP in collections else 'params'
  if group == NNX_GROUP:
    if _nnx.holds_graph_argument(mox):
      raise SubstitutionError(
          'lora on an NNX tree needs the split form, where the parameters are '
          'an argument: graphdef, state = nnx.split(model); mox = '
          'yax.make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, x); '
          'res = yax.lora(mox, state, ...)')
    if selection == _DEFAULT_SELECTION:
      selection = '//module_call[@type="Linear"]'
  chosen = select(selection, mox)
  for node in chosen.targets:
    if not isinstance(node, Mox) or node.is_ephemeral:
      raise SubstitutionError(
          f'lora selects module calls, but {chosen.description} matched '
          f'{describe(node)}')
  prefix = collections.get(group)
  if prefix is not None and len(prefix) < 2:
    raise SubstitutionError(
        'lora needs the parameters in one argument of the traced function; '
        'its models sit in several arguments (module paths start with the '
        'argument position). Trace a function that takes one params tree '
        '(or one nnx.State) and pass that')
  if prefix is None:
    raise SubstitutionError(
        "lora found no 'params' collection among the traced arguments; trace "
        "a function that takes the parameters as an argument, e.g. "
        "make_mox(model.apply)(variables, x) or make_mox(model)(x, params=p)")
  _params_argument(mox, prefix, params)
  keypaths = root_keypaths(mox)
  adapter_places = {kp for kp in keypaths.values()
                    if kp and _is_adapter_name(kp[-1])}
  holders = kernel_holders(mox)
  problems, plans = [], {}
  for node in chosen.targets:
    ancestors = chosen.ancestors[id(node)]
    wrapper = next((a for a in ancestors if isinstance(a, Mox)
                    and a.module_ty is LoRA), None)
    held = sorted(n for n in _own_param_names(node) if _is_adapter_name(n))
    if node.module_ty is LoRA:
      problems.append((node, 'it is a LoRA adapter already', False))
      continue
    if wrapper is not None:
      problems.append((node, 'it already carries an adapter (it is wrapped '
                       f'by the LoRA call at path {_path_str(wrapper)!r})',
                       wrapper in ancestors[-1:]))
      continue
    if held:
      problems.append((node, 'it already carries an adapter (its params hold '
                       f'{held})', False))
      continue
    plan = kernel_plan(node, rank)
    if isinstance(plan, str):
      problems.append((node, plan, False))
      continue
    kernel = node.var_inputs[plan.contraction.kernel_index]
    method = node.entrypoint if node.entrypoint not in (None, '__call__') \
        else None
    names = (tuple(f'{method}_{n}' for n in _ADAPTER_NAMES) if method
             else _ADAPTER_NAMES)
    keypath, why, source_perm = _kernel_source(kernel, ancestors, keypaths)
    own_place = (*prefix, *node.path, *plan.kernel_keys[1:])
    if keypath is not None and tuple(map(str, keypath)) == tuple(
        map(str, own_place)):
      if any(p[:-1] == keypath[:-1] and p[-1] in (
          *names, *(f'{plan.kernel_name}_{n}' for n in names))
             for p in adapter_places):
        problems.append((node, 'it already carries an adapter (the traced '
                         f'arguments hold {_arg_str(keypath[:-1])}'
                         f'[{names[0]!r}/{names[1]!r}])', False))
        continue
      plans[id(node)] = dataclasses.replace(
          plan, names=names, place=tuple(node.path), source_perm=source_perm)
      continue
    # A head applied through a nested Module.apply with a kernel it does
    # not own (a tied embedding, transposed): its adapter sits at the call
    # site, under the calling module's path and the head's name.
    found = (f'the traced argument {_arg_str(keypath)}' if why is None
             else why)
    caller = next((a for a in reversed(ancestors) if isinstance(a, Mox)
                   and not a.is_ephemeral), None)
    if node.path or not node.name or caller is None:
      problems.append((
          node, f'its kernel {kernel.type_str} is {found}, not the parameter '
          f'{_arg_str(own_place)}, so an adapter would not sit next to its '
          'kernel in the params tree', False))
      continue
    place = (*caller.path, node.name)
    if any(tuple(map(str, kp[:len(prefix) + len(place)])) == tuple(
        map(str, (*prefix, *place))) for kp in keypaths.values()):
      problems.append((
          node, f'its kernel {kernel.type_str} is {found}; its call-site '
          f'adapter would go to {_arg_str((*prefix, *place))}, which holds '
          'variables of another module', False))
      continue
    plans[id(node)] = dataclasses.replace(
        plan, names=names, place=place,
        tied=f'its kernel is {found} (a head tied to an embedding)')
  if problems:
    _refuse(problems, chosen, selection)
  # A kernel read by a call that does not carry the same adapter (an
  # embedding lookup next to Embed.attend, a Param shared by two NNX
  # modules): the adapter sits at this call site and is never merged.
  for node in chosen.targets:
    plan = plans[id(node)]
    if plan.tied is not None:
      continue
    kernel = node.var_inputs[plan.contraction.kernel_index]
    inside_node = {id(n) for n in iter_nodes(node)}
    above = {id(a) for a in chosen.ancestors[id(node)]}
    others = [
        h for h in holders.get(kernel, ())
        if id(h) not in inside_node and id(h) not in above
        and not (id(h) in plans and plans[id(h)].place == plan.place
                 and plans[id(h)].names == plan.names)
        and _contraction.reads(h, kernel)]
    if others:
      plans[id(node)] = dataclasses.replace(plan, tied=(
          'its kernel is also read by ' + ', '.join(sorted(
              {f'{describe(h)} (method {h.entrypoint})' for h in others}))))
  # Where one scope holds several adapted kernels (nn.share_scope), each
  # pair is named after its kernel: 'linear_lora_a'.
  kernels_at: dict = {}
  for node in chosen.targets:
    plan = plans[id(node)]
    kernels_at.setdefault((plan.place, plan.names), set()).add(
        plan.kernel_name)
  for node in chosen.targets:
    plan = plans[id(node)]
    if len(kernels_at[(plan.place, plan.names)]) > 1:
      plans[id(node)] = dataclasses.replace(plan, names=tuple(
          f'{plan.kernel_name}_{n}' for n in plan.names))

  def make(path, node):
    return _lora_template(node, plans[id(node)], rank, alpha)

  done = substitute(chosen, make, mox)
  if done.collections.get(group) != prefix:
    raise SubstitutionError(
        f"internal: the params collection moved from {_arg_str(prefix)} to "
        f"{_arg_str(done.collections.get(group))} during the rewrite")

  inside = tuple(prefix[2:])  # keys of the collection inside `params`
  adapted = {}  # (module path, adapter name) -> plan
  for node in chosen.targets:
    plan = plans[id(node)]
    for name in plan.names:
      adapted[(tuple(plan.place), name)] = plan
  # Initial values on the host, from one generator seeded by ``key``: no
  # XLA computation to compile per adapter shape.
  rng = np.random.default_rng(
      np.asarray(jax.random.key_data(key)).ravel().tolist())
  values, flags = [], []
  for loc, var in sorted(done.added.items()):
    plan = adapted.get((tuple(loc[1:-1]), loc[-1]))
    if loc[0] != group or plan is None:
      raise SubstitutionError(
          f"internal: lora added a variable at {'/'.join(loc)}, which is not "
          'the adapter of a selected module')
    shape, dtype = tuple(var.aval.shape), var.aval.dtype
    # None for a call-site adapter of a head whose kernel is not here.
    kernel = _get_or_none(params, (*inside, *loc[1:-1], plan.kernel_name))
    is_a = loc[-1] == plan.names[0]
    value = _adapter_value(unboxed(kernel), plan, is_a, shape, dtype, rng)
    box = _adapter_box(kernel, plan, is_a, group == NNX_GROUP)
    value, flag = box(value), box(True)
    values.append(((*inside, *loc[1:]), value))
    flags.append(((*inside, *loc[1:]), flag))
  new_params = set_many(params, values)
  mask = set_many(jtu.tree_map(lambda _: False, params), flags)
  new_mox = with_argument_structure(done.mox, prefix[:2], new_params)
  scale = alpha / rank
  merges = sorted({(path, plan.names): plan
                   for (path, _), plan in adapted.items()}.items())
  paths = sorted({path for (path, _), _ in merges})

  def merge(trained):
    """Folds ``kernel + (alpha/rank) * A @ B`` (in the kernel's layout) for
    every adapter and returns params for the original tree (adapters
    removed), in ``trained``'s container types."""
    tied = [(path, plan) for (path, _), plan in merges if plan.tied]
    if tied:
      heads = [(n, False) for n in chosen.targets if plans[id(n)].tied]
      raise SubstitutionError(
          'merge: ' + '; '.join(
              f"the adapter at params"
              f"{''.join(f'[{k!r}]' for k in (*inside, *path))} "
              f'({plan.names[0]}/{plan.names[1]}) is a call-site adapter: '
              f'{plan.tied}' for path, plan in tied) +
          '. Merged into that kernel it would change every other reader '
          'too, so a tied head could no longer be tied: keep the adapters '
          '(run res.mox with the trained params), or adapt the other '
          'modules only to get mergeable adapters.\n' + leave_out_hint(
              heads, selection, chosen.targets))
    out = trained
    for (module_path, names), plan in merges:
      keys = (*inside, *module_path)
      module = get_in(out, keys)
      boxed = get_in(out, (*keys, plan.kernel_name))
      kernel, a, b = (unboxed(x) for x in (
          boxed, get_in(out, (*keys, names[0])), get_in(out, (*keys, names[1]))))
      where = f"params{''.join(f'[{k!r}]' for k in keys)}"
      if (tuple(a.shape[a.ndim - len(plan.a_shape):]) != plan.a_shape or
          tuple(b.shape[b.ndim - len(plan.b_shape):]) != plan.b_shape):
        raise SubstitutionError(
            f'merge: at {where} the adapters are {names[0]} {tuple(a.shape)} '
            f'and {names[1]} {tuple(b.shape)}; lora made them '
            f'{plan.a_shape} and {plan.b_shape}')
      drop = names
      if plan.quant is not None:  # QLoRA: back to the float kernel
        scale_name = f'{plan.kernel_name}_scale'
        kernel = dequantize_array(kernel, unboxed(get_in(
            out, (*keys, scale_name))), plan.quant, a.dtype,
            plan.contracted)
        drop = (*names, scale_name)
      delta = _kernel_delta(plan, a, b)
      if tuple(delta.shape) != tuple(kernel.shape):
        raise SubstitutionError(
            f'merge: at {where} {names[0]} {tuple(a.shape)} times {names[1]} '
            f'{tuple(b.shape)} is {tuple(delta.shape)}, which does not fit '
            f'the kernel {plan.kernel_name} {tuple(kernel.shape)}')
      merged = boxed_like(boxed, (kernel + scale * delta).astype(kernel.dtype))
      out = set_in(out, keys, set_in(without(module, drop),
                                     (plan.kernel_name,), merged))
    return out

  return LoraResult(new_mox, new_params, mask, merge, paths)


def _get_or_none(tree, keys):
  try:
    return get_in(tree, keys)
  except SubstitutionError:
    return None


def with_argument_structure(root: Mox, where: tuple, value) -> Mox:
  """``root`` expecting, at argument ``where`` (``(0, position)`` or
  ``(1, name)``), the structure of ``value``: the adapters in the boxes
  (``nn.Partitioned``, NNX Variables with metadata) ``lora`` returns them
  in. The leaves and their order are unchanged."""
  args, kwargs = jtu.tree_unflatten(root.in_tree, root.inputs)
  holder = list(args) if where[0] == 0 else dict(kwargs)
  leaves = jtu.tree_leaves(holder[where[1]],
                           is_leaf=lambda s: isinstance(s, Symbol))
  structure = jtu.tree_structure(value)
  if structure.num_leaves != len(leaves):
    raise SubstitutionError(
        f'internal: lora returns params with {structure.num_leaves} arrays '
        f'but the rewritten tree reads {len(leaves)}')
  holder[where[1]] = jtu.tree_unflatten(structure, leaves)
  if where[0] == 0:
    args = type(args)(holder) if isinstance(args, tuple) else holder
  else:
    kwargs = holder
  inputs, in_tree = jtu.tree_flatten((args, kwargs),
                                     is_leaf=lambda s: isinstance(s, Symbol))
  if inputs != list(root.inputs):
    raise SubstitutionError(
        'internal: giving the adapters their boxes reordered the inputs')
  return root.replace(in_tree=in_tree)


def _adapter_axis_names(names, plan: _Plan, is_a: bool):
  """Per-axis names (or mesh axes) of an adapter, from its kernel's: ``A``
  the contracted axes' then None, ``B`` None then the other axes'; leading
  names of a stacked kernel lead both. None if they do not fit."""
  names = tuple(names)
  if plan.source_perm is not None and len(names) == len(plan.source_perm):
    names = tuple(names[p] for p in plan.source_perm)  # as scanned
  n_stack = len(names) - len(plan.kernel_shape)
  if n_stack < 0:
    return None
  axes = plan.a_axes if is_a else plan.b_axes
  return names[:n_stack] + tuple(
      None if v is None else names[n_stack + v] for v in axes)


def _adapter_value(kernel, plan: _Plan, is_a: bool, shape, dtype, rng):
  """The initial adapter (``A`` random, ``B`` zero): an abstract
  ``ShapeDtypeStruct`` for an abstract kernel (nothing materialised), else
  an array; sharded over the kernel's mesh like the kernel's axes."""
  sharding = getattr(kernel, 'sharding', None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    ndim = len(kernel.shape)
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    spec = _adapter_axis_names(spec, plan, is_a)
    sharding = (jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(*spec))
                if spec is not None else None)
  else:
    sharding = None
  if isinstance(kernel, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  if is_a:
    fan_in = math.prod(plan.kernel_shape[v] for v in plan.contracted) \
        if plan.contraction.kind == 'dot_general' else math.prod(
            plan.a_shape[:-1])
    host = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)
  else:
    host = np.zeros(shape, np.float32)
  host = host.astype(dtype)
  return jax.device_put(host, sharding) if sharding else jax.device_put(host)


def _adapter_box(kernel, plan: _Plan, is_a: bool, is_nnx: bool):
  """How an adapter is held, from how its kernel is: NNX adapters are
  ``nnx.LoRAParam`` s; a kernel with axis names (Linen ``nn.Partitioned``,
  ``nn.LogicallyPartitioned``; NNX sharding metadata) gives its adapters
  the names of their axes (``A``: the contracted axes' names then None,
  ``B``: None then the other axes' names; a stacked kernel's leading names
  lead both)."""
  adapter_names = lambda names: _adapter_axis_names(names, plan, is_a)
  if is_nnx:
    found = _nnx.sharding_names(kernel)
    names = adapter_names(found[1]) if found else None
    if names is None:
      return lambda v: _nnx.variable_holding('LoRAParam', v)
    return lambda v: _nnx.variable_like('LoRAParam', v, kernel,
                                        **{found[0]: names})
  names = getattr(kernel, 'names', None)
  if isinstance(kernel, nn.meta.AxisMetadata) and isinstance(
      names, (tuple, list)) and adapter_names(names) is not None:
    new = adapter_names(names)
    return lambda v: kernel.replace(value=v, names=new)
  return lambda v: v


def unboxed(x):
  """The array in a params leaf (an NNX Variable holds one)."""
  leaves = jtu.tree_leaves(x)
  return leaves[0] if len(leaves) == 1 and leaves[0] is not x else x


def boxed_like(like, value):
  """``value`` in the container ``like`` came in (an NNX Variable keeps its
  type and metadata, sharding included)."""
  if unboxed(like) is like:
    return value
  return jtu.tree_unflatten(jtu.tree_structure(like), [value])


def _arg_str(keypath) -> str:
  if not keypath:
    return 'arguments'
  head = 'args' if keypath[0] == 0 else 'kwargs'
  rest = keypath[1:]
  if keypath[0] == 1 and rest:
    return f'{rest[0]}=' + ''.join(f'[{k!r}]' for k in rest[1:])
  return head + ''.join(f'[{k!r}]' for k in rest)
