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
  ``yax/_src/rewrite/contraction.py``: the kernel must reach one
  ``dot_general`` or ungrouped convolution, and nothing else).

Where the module holds one kernel whose contraction reads an input of the
call and whose output reaches the call's output linearly (casts, reshapes,
transposes, added biases), the adapter goes around the call. Otherwise
every kernel the call contracts is adapted in place: the contraction
equation in the module's body becomes a ``LoRA`` call (at the module's
path) that adds the adapter, computed from the contraction's own operand,
to the contraction's output. That covers several kernels in one call (a
MoE's ``wi_0``/``wi_1``/``wo``; each pair is then named after its kernel,
``wi_0_lora_a``), operands computed in the module (routed tokens, a
clipped input) and outputs that go through an activation. A kernel
adapted in place whose leading axes come before its contracted axes, with
other axes after them (``[experts, in, out]``), is a stack of matrices:
one adapter pair per slice, ``A: [experts, in, rank]``, ``B: [experts,
rank, out]``; so is a kernel read by ``jax.lax.ragged_dot`` (its rows
grouped by expert), always adapted in place.

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
import math
import numbers
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util as jtu

from yax._src.errors import SubstitutionError
from yax._src.ir.arguments import boxed_like, unboxed, with_argument_structure
from yax._src.ir.containers import get_in, set_in, set_many, without
from yax._src.ir.nodes import Literal, Mox, Symbol, Var
from yax._src.ir.variables import NNX_GROUP, VarEntry, is_nnx, with_variables
from yax._src.rewrite import contraction as _contraction
from yax._src.rewrite.engine import (IN_PLACE, Selection, collections_of,
                                     describe,
                                     inline, leave_out_hint, select, substitute)
from yax._src.rewrite.quant_formats import dequantize_kernel
from yax._src.trace import nnx as _nnx
from yax._src.trace.make import make_mox
from yax._src.tools import lora_files as _files


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
    config: what made the adapters: the arguments of the ``lora`` call
      (``selection``, ``rank``, ``alpha`` ...) and the adapted ``paths``.
  """
  mox: Mox
  params: Any
  mask: Any
  merge: Callable[[Any], Any]
  paths: list  # module paths that were adapted
  config: dict = dataclasses.field(default_factory=dict)

  def save(self, path, params=None, *, format: str = 'safetensors') -> None:
    """Saves the adapters (the leaves ``.mask`` marks) and what made them.

    **Arguments:**
    - ``path``: a file (``format='safetensors'``: one file, every adapter
      gathered to this host) or a new directory (``format='orbax'``:
      ``orbax-checkpoint``, each process writes its own shards).
    - ``params``: the params to take the adapters from (the trained ones),
      with ``.params``' structure; ``.params`` if omitted.
    - ``format``: ``'safetensors'`` or ``'orbax'``.

    Keys are the params paths joined with ``'/'``; the file's metadata
    records the ``lora`` arguments, the adapted paths, the YAX version, the
    adapters' dtypes and the types of the other params (the model they fit).
    ``yax.load_lora`` reads either format. Raises ``yax.AdapterFileError``
    (writing nothing) for params that cannot be saved.

    Example::

        res = yax.lora(mox, variables, rank=8)
        trained = ...  # res.params trained where res.mask is True
        res.save('adapters.safetensors', trained)
    """
    _files.save(self, path, self.params if params is None else params,
                format=format, lora=lora)



_ADAPTER_NAMES = ('lora_a', 'lora_b')


def adapter_dtype(kernel: Symbol, c: _contraction.Contraction):
  """The kernel's dtype, or for a quantized kernel (int8, fp8 ...) the
  dtype its contraction computes in."""
  dtype = kernel.aval.dtype
  if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize >= 2:
    return dtype
  return c.z_aval.dtype


def _is_adapter_name(name) -> bool:
  return isinstance(name, str) and name.endswith(_ADAPTER_NAMES)


def _path_str(node: Mox) -> str:
  return '/'.join(node.path)


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
  # A stack axis the operand lacks (experts, ``[experts, in, out]`` read
  # by ``BSM,EMH->BSEH``) is one of h's axes too: one A per slice.
  h_sub = ''.join(xs[i] for i in range(x_ndim) if i not in xc) + ''.join(
      var[v] for v in stack if var[v] not in xs) + 'r'
  batch = ''.join(xs[i] for i in xb)
  x_free = ''.join(xs[i] for i in range(x_ndim) if i not in xc and i not in xb)
  k_free = ''.join(op[j] for j in range(k_ndim) if j not in kc and j not in kb)
  out = batch + (x_free + k_free if side == 1 else k_free + x_free)
  return ''.join(xs), a_sub, h_sub, b_sub, out, ''.join(var)


def _delta(c: _contraction.Contraction, k_ndim: int, x, a, b, stack=(),
           *more):
  """The change of the contraction's output for the kernel change
  ``A @ B``, computed without forming it: ``(x A) B`` (``more``: the
  contraction's other inputs, a ragged_dot's group sizes)."""
  if c.kind == _contraction.RAGGED:  # each row group with its own pair
    (group_sizes,) = more
    h = jax.lax.ragged_dot(x, a, group_sizes)
    return jax.lax.ragged_dot(h, b, group_sizes)
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


def _kernel_delta(plan: _contraction.KernelPlan, a, b):
  """``A @ B`` in the kernel's shape (leading axes of a stacked kernel, as
  ``nn.scan`` makes them, kept; moved back where a transpose took them
  from, see ``KernelPlan.source_perm``)."""
  c, n = plan.contraction, len(plan.kernel_shape)
  if c.kind == _contraction.RAGGED:
    delta = jnp.einsum('...gir,...gro->...gio', a, b)
  elif c.kind == 'dot_general':
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
                    x_aval, y_aval, dtype, scale, stack=(), extra=()):
  def adapter(y, x, a, b, *more):
    for step in c.x_steps:
      x = step.apply(x)
    delta = _delta(c, k_ndim, x.astype(dtype), a, b, stack, *more)
    delta = (scale * delta).astype(c.z_aval.dtype)
    for step in c.y_steps:
      delta = step.apply(delta)
    return y + delta.astype(y.dtype)
  spec = jax.ShapeDtypeStruct
  return make_mox(adapter)(
      spec(y_aval.shape, y_aval.dtype), spec(x_aval.shape, x_aval.dtype),
      spec(a_shape, dtype), spec(b_shape, dtype),
      *(spec(shape, kind) for shape, kind in extra))


def _adapter_mox(plan: _contraction.KernelPlan, x_aval, y_aval, dtype, scale,
                 extra=()):
  """The traced adapter; ``extra``: (shape, dtype) of the contraction's
  inputs beyond its two operands, which the adapter reads too."""
  args = (plan.contraction, len(plan.kernel_shape), plan.a_shape,
          plan.b_shape, x_aval, y_aval, dtype, scale, plan.stack,
          tuple(extra))
  try:
    return _traced_adapter(*args)
  except TypeError as e:  # a step's parameter that is not hashable
    if 'unhashable' not in str(e):
      raise
    return _traced_adapter.__wrapped__(*args)


def _lora_template(node: Mox, plan: _contraction.KernelPlan, rank: int, alpha: float) -> Mox:
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
  out = Var(y.aval)  # the module output's type, sharding included
  children = [node, *inline(adapter, [y, x, a, b], [out])]
  if is_nnx(node):  # NNX: typed nnx.LoRAParam s next to the kernel
    rel, group, kind = (), NNX_GROUP, 'LoRAParam'
  else:
    # Relative to the node: () next to its kernel, the calling module's
    # path and the head's name for a nested apply's root (path ()).
    rel, group = tuple(plan.place[len(node.path):]), plan.kernel_keys[0]
    kind = group
  var_inputs, var_tree = with_variables(node, added=[
      VarEntry(group, kind, (*rel, name), True, not rel, sym)
      for name, sym in zip(plan.names, (a, b), strict=True)])
  outputs = [out if i == c.y_index else s for i, s in enumerate(node.outputs)]
  return Mox(var_inputs + list(node.arg_inputs), outputs,
             {'name': node.name, 'rank': rank, 'alpha': alpha,
              'base': node.type_name, 'kernel': plan.kernel_name},
             children=children, module_ty=LoRA, entrypoint='__call__',
             path=node.path, in_tree=node.in_tree, out_tree=node.out_tree,
             var_tree=var_tree, inits=_inits(group, rel, plan))


def _inits(group: str, rel: tuple, plan: _contraction.KernelPlan) -> dict:
  """The record of the adapters for ``yax.init_params``: ``A`` normal with
  variance 1 / fan_in, ``B`` zero, as ``lora`` draws them."""
  a, b = ((group, *rel, name) for name in plan.names)
  return {a: functools.partial(_init_a, a, plan.fan_in),
          b: functools.partial(_init_b, b)}


def _init_a(keys, fan_in, key, aval, read):
  del read
  value = jax.random.normal(key, aval.shape, jnp.float32) / math.sqrt(fan_in)
  return {keys: value.astype(aval.dtype)}


def _init_b(keys, key, aval, read):
  del key, read
  return {keys: jnp.zeros(aval.shape, aval.dtype)}


def _site_template(node: Mox, plan: _contraction.KernelPlan, rank: int,
                   alpha: float) -> Mox:
  """A ``LoRA`` module call in place of the contraction equation
  ``plan.site`` inside ``node``'s body, at ``node``'s path: the
  contraction, then the adapter on its operand added to its output. Its
  variables are the adapters, which the rewrite adds to ``node``'s own."""
  c, eqn = plan.contraction, plan.site
  kernel = node.var_inputs[c.kernel_index]
  args = [s if isinstance(s, Literal) else Var(s.aval) for s in eqn.inputs]
  x = args[c.x_index]
  z = Var(eqn.outputs[0].aval)
  dtype = adapter_dtype(kernel, c)
  # A ragged_dot's group sizes: the adapter groups the rows as it does.
  more = [s for s in args[2:] if not isinstance(s, Literal)]
  adapter = _adapter_mox(plan, x.aval, z.aval, dtype, alpha / rank,
                         [(tuple(s.aval.shape), s.aval.dtype) for s in more])
  a = Var(jax.core.ShapedArray(plan.a_shape, dtype))
  b = Var(jax.core.ShapedArray(plan.b_shape, dtype))
  out = Var(z.aval)
  children = [eqn.replace(inputs=args, outputs=[z]),
              *inline(adapter, [z, x, a, b, *more], [out])]
  if is_nnx(node):
    group, kind = NNX_GROUP, 'LoRAParam'
  else:
    group = kind = plan.kernel_keys[0]
  bare = Mox([], [], module_ty=LoRA)
  var_inputs, var_tree = with_variables(bare, [], added=[
      VarEntry(group, kind, (name,), True, True, sym)
      for name, sym in zip(plan.names, (a, b), strict=True)])
  arg_inputs = [s for s in args if not isinstance(s, Literal)]
  return Mox(var_inputs + arg_inputs, [out],
             {'name': node.name, 'rank': rank, 'alpha': alpha,
              'base': eqn.prim.name, 'kernel': plan.kernel_name,
              IN_PLACE: True},
             children=children, module_ty=LoRA, entrypoint='__call__',
             path=node.path, in_tree=jtu.tree_structure((tuple(arg_inputs),
                                                         {})),
             out_tree=jtu.tree_structure(out), var_tree=var_tree,
             inits=_inits(group, (), plan))


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
  targets = _contraction.plan_kernels(chosen, 'lora', rank, every=True)
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
  keypaths = chosen.keypaths
  adapter_places = {kp for kp in keypaths.values()
                    if kp and _is_adapter_name(kp[-1])}
  # Per module call, the first reason it cannot be adapted; the plans of
  # the kernels it can, by (call, kernel position).
  problems: dict = {}
  plans: dict = {}
  for target in targets:
    node, plan = target.node, target.plan
    if id(node) in problems:
      continue
    ancestors = chosen.ancestors[id(node)]
    wrapper = next((a for a in ancestors if isinstance(a, Mox)
                    and a.module_ty is LoRA), None)
    held = sorted(n for n in _contraction.own_param_names(node)
                  if _is_adapter_name(n))
    if node.module_ty is LoRA:
      problems[id(node)] = (node, 'it is a LoRA adapter already', False)
      continue
    if wrapper is not None:
      problems[id(node)] = (
          node, 'it already carries an adapter (it is wrapped by the LoRA '
          f'call at path {_path_str(wrapper)!r})', wrapper in ancestors[-1:])
      continue
    if held:
      problems[id(node)] = (node, 'it already carries an adapter (its '
                            f'params hold {held})', False)
      continue
    if plan is None:
      problems[id(node)] = (node, target.why, False)
      continue
    pkey = (id(node), plan.contraction.kernel_index)
    kernel = node.var_inputs[plan.contraction.kernel_index]
    method = node.entrypoint if node.entrypoint not in (None, '__call__') \
        else None
    names = (tuple(f'{method}_{n}' for n in _ADAPTER_NAMES) if method
             else _ADAPTER_NAMES)
    keypath = target.keypath
    own_place = (*prefix, *node.path, *plan.kernel_keys[1:])
    if target.own:
      if any(p[:-1] == keypath[:-1] and p[-1] in (
          *names, *(f'{plan.kernel_name}_{n}' for n in names))
             for p in adapter_places):
        problems[id(node)] = (node, 'it already carries an adapter (the '
                              f'traced arguments hold {_arg_str(keypath[:-1])}'
                              f'[{names[0]!r}/{names[1]!r}])', False)
        continue
      plans[pkey] = dataclasses.replace(plan, names=names,
                                       place=tuple(node.path))
      continue
    # A head applied through a nested Module.apply with a kernel it does
    # not own (a tied embedding, transposed): its adapter sits at the call
    # site, under the calling module's path and the head's name.
    found = (f'the traced argument {_arg_str(keypath)}' if keypath is not None
             else target.source)
    caller = next((a for a in reversed(ancestors) if isinstance(a, Mox)
                   and not a.is_ephemeral), None)
    if node.path or not node.name or caller is None or plan.site is not None:
      problems[id(node)] = (
          node, f'its kernel {kernel.type_str} is {found}, not the parameter '
          f'{_arg_str(own_place)}, so an adapter would not sit next to its '
          'kernel in the params tree', False)
      continue
    place = (*caller.path, node.name)
    if any(_contraction.same_place(kp[:len(prefix) + len(place)],
                                   (*prefix, *place))
           for kp in keypaths.values()):
      problems[id(node)] = (
          node, f'its kernel {kernel.type_str} is {found}; its call-site '
          f'adapter would go to {_arg_str((*prefix, *place))}, which holds '
          'variables of another module', False)
      continue
    plans[pkey] = dataclasses.replace(
        plan, names=names, place=place,
        tied=f'its kernel is {found} (a head tied to an embedding)')
  if problems:
    _refuse(list(problems.values()), chosen, selection)
  by_node = {id(t.node): t.node for t in targets}
  # A kernel read by a call that does not carry the same adapter (an
  # embedding lookup next to Embed.attend, a Param shared by two NNX
  # modules): the adapter sits at this call site and is never merged.
  holders = _contraction.kernel_holders(mox)
  for target in targets:
    pkey = (id(target.node), target.plan.contraction.kernel_index)
    plan = plans[pkey]
    if plan.tied is not None:
      continue
    others = [
        h for h in _contraction.other_readers(holders, chosen, target)
        if not any(k[0] == id(h) and p.place == plan.place
                   and p.names == plan.names for k, p in plans.items())]
    if others:
      plans[pkey] = dataclasses.replace(plan, tied=(
          'its kernel is also read by ' + ', '.join(sorted(
              {f'{describe(h)} (method {h.entrypoint})' for h in others}))))
  # Where one scope holds several adapted kernels (nn.share_scope, a MoE's
  # expert kernels), each pair is named after its kernel: 'wi_0_lora_a'.
  kernels_at: dict = {}
  for plan in plans.values():
    kernels_at.setdefault((plan.place, plan.names), set()).add(
        plan.kernel_name)
  for pkey, plan in plans.items():
    if len(kernels_at[(plan.place, plan.names)]) > 1:
      plans[pkey] = dataclasses.replace(plan, names=tuple(
          f'{plan.kernel_name}_{n}' for n in plan.names))
  # What the rewrite replaces: the call (an adapter around it), or the
  # contraction equations of the kernels adapted in place.
  replaced = {}
  for (node_id, _), plan in plans.items():
    node = by_node[node_id]
    item = node if plan.site is None else plan.site
    replaced[id(item)] = (item, node, plan)

  def make(path, item):
    _, node, plan = replaced[id(item)]
    if plan.site is None:
      return _lora_template(node, plan, rank, alpha)
    return _site_template(node, plan, rank, alpha)

  sites = select([item for item, _, _ in replaced.values()], mox)
  done = substitute(sites, make, mox)
  if done.collections.get(group) != prefix:
    raise SubstitutionError(
        f"internal: the params collection moved from {_arg_str(prefix)} to "
        f"{_arg_str(done.collections.get(group))} during the rewrite")

  inside = tuple(prefix[2:])  # keys of the collection inside `params`
  adapted = {}  # (module path, adapter name) -> plan
  for plan in plans.values():
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
    # A Linen box (a bridged NNX model's params, ToLinen): the adapter too.
    box = _adapter_box(kernel, plan, is_a, group == NNX_GROUP and not
                       isinstance(kernel, nn.meta.AxisMetadata))
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
  tied = [(path, plan) for (path, _), plan in merges if plan.tied]
  refusal = None
  if tied:
    heads = [(by_node[k[0]], False) for k, p in plans.items() if p.tied]
    refusal = (
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
  config = dict(selection=selection, rank=rank, alpha=alpha,
                paths=['/'.join(p) for p in paths])
  return LoraResult(new_mox, new_params, mask, functools.partial(
      merge, merges=tuple(merges), inside=inside, scale=scale,
      refusal=refusal), paths, config)


def load_lora(mox: Mox, params, path) -> LoraResult:
  """Puts saved LoRA adapters on a freshly traced base model.

  **Arguments:**
  - ``mox``: the base model's tree, traced in this or another process (for
    adapters made over a quantized base, QLoRA: the tree ``yax.quantize``
    returned, quantized with the same arguments).
  - ``params``: its params (as for ``yax.lora``).
  - ``path``: what ``LoraResult.save`` wrote: a safetensors file or an
    orbax directory.

  **Returns:** the :class:`LoraResult` of ``lora`` re-run with the
  recorded arguments, its ``.params`` holding the saved adapters, each on
  the devices and sharding the fresh adapter has (an orbax checkpoint is
  read shard by shard).

  Raises ``yax.AdapterFileError`` when the file does not fit: a file made
  for another model (the params path where they differ), or a missing,
  extra or misshapen adapter (its params path).

  Example::

      mox = yax.make_mox(model.apply)(variables, x)   # a fresh process
      res = yax.load_lora(mox, variables, 'adapters.safetensors')
      y = yax.eval_mox(res.mox, res.params, x)
  """
  res, loaded = _files.load(mox, params, path, lora=lora)
  return dataclasses.replace(res, params=loaded)


def merge(trained, *, merges: tuple, inside: tuple, scale: float,
          refusal: str | None = None):
  """Folds ``kernel + scale * A @ B`` (in the kernel's layout) for every
  adapter of ``merges`` (``((module path, adapter names), plan)``, under
  ``inside`` in ``trained``) and returns params for the original tree
  (adapters removed), in ``trained``'s container types. ``refusal``: why
  these adapters cannot be merged (call-site adapters of tied heads)."""
  if refusal is not None:
    raise SubstitutionError(refusal)
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
      kernel = dequantize_kernel(
          kernel, unboxed(get_in(out, (*keys, scale_name))), plan.quant,
          a.dtype, plan.contracted, kernel.ndim - len(plan.kernel_shape),
          plan.source_perm)
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


def _get_or_none(tree, keys):
  try:
    return get_in(tree, keys)
  except SubstitutionError:
    return None


def _adapter_axis_names(names, plan: _contraction.KernelPlan, is_a: bool):
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


def _adapter_value(kernel, plan: _contraction.KernelPlan, is_a: bool, shape, dtype, rng):
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
    host = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(
        plan.fan_in)
  else:
    host = np.zeros(shape, np.float32)
  host = host.astype(dtype)
  return jax.device_put(host, sharding) if sharding else jax.device_put(host)


def _adapter_box(kernel, plan: _contraction.KernelPlan, is_a: bool, is_nnx: bool):
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


def _arg_str(keypath) -> str:
  if not keypath:
    return 'arguments'
  head = 'args' if keypath[0] == 0 else 'kwargs'
  rest = keypath[1:]
  if keypath[0] == 1 and rest:
    return f'{rest[0]}=' + ''.join(f'[{k!r}]' for k in rest[1:])
  return head + ''.join(f'[{k!r}]' for k in rest)
