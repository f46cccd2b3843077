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

from collections.abc import Mapping
import dataclasses
import functools
import math
import numbers
from typing import Any, Callable

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
from yax._src.rewrite.recipe import recorded
from yax._src.trace import systems as _systems
from yax._src.trace.make import make_mox
from yax._src.tools import lora_files as _files
from yax._src.version import __version__


class LoRA:
  """Marker class for LoRA module calls (``module_ty`` of adapted nodes)."""


class TrainableCount(tuple):
  """``(trainable, total)`` parameter counts, as ``peft``'s
  ``print_trainable_parameters`` prints them (``str``)."""

  def __new__(cls, trainable: int, total: int):
    return super().__new__(cls, (int(trainable), int(total)))

  @property
  def trainable(self) -> int:
    return self[0]

  @property
  def total(self) -> int:
    return self[1]

  @property
  def fraction(self) -> float:
    """``trainable / total`` (0.0 for an empty tree)."""
    return self[0] / self[1] if self[1] else 0.0

  def __str__(self):
    return (f'trainable params: {self[0]:,} || all params: {self[1]:,} || '
            f'trainable%: {100 * self.fraction:.4f}')


def count_trainable(params, mask) -> TrainableCount:
  """Elements of the leaves of ``params`` where ``mask`` is True, and of all
  leaves (abstract ``ShapeDtypeStruct`` leaves count by their shape).

  Example::

      n = count_trainable(res.params, res.mask)   # (trainable, total)
  """
  trainable = total = 0
  # Boxes (nn.Partitioned, NNX Variables) flatten to their value in both.
  leaves, flags = jtu.tree_leaves(params), jtu.tree_leaves(mask)
  if len(leaves) != len(flags):
    raise SubstitutionError(
        f'count_trainable: params has {len(leaves)} leaves, the mask '
        f'{len(flags)}; the mask must have the params\' structure')
  for leaf, flag in zip(leaves, flags):
    size = math.prod(np.shape(leaf))
    total += size
    trainable += size if flag else 0
  return TrainableCount(trainable, total)


@dataclasses.dataclass
class LoraResult:
  """What ``yax.lora`` returns.

  Attributes:
    mox: the rewritten tree (no dropout: evaluation and inference).
    params: the argument to pass where ``params`` went: the original weights
      and the adapters (``lora_a`` random, ``lora_b`` zero; with
      ``init='svd'`` the kernels hold the residual).
    mask: a pytree of bools with ``params``' structure, True exactly on the
      adapter weights and on the params ``train=`` selected
      (for ``optax.masked`` / ``optax.multi_transform``).
    merge: ``merge(p)`` folds trained adapters in ``p`` into the kernels and
      returns a params tree for the ORIGINAL tree.
    paths: module paths that were adapted.
    config: what made the adapters, plain Python values (JSON-ready):
      ``selection``, ``rank``, ``alpha``, ``scale``, ``variant`` ('lora' or
      'dora'), ``init``, ``rslora``, ``dropout``, ``adapter_name``,
      ``train``, ``collection`` (keys of the params collection inside
      ``params``), ``paths`` and ``adapters`` (one dict per adapter pair:
      ``path``, ``names``, ``kernel``, ``a_shape``, ``b_shape``,
      ``magnitude`` (DoRA), ``mergeable``), ``yax_version``.
    train_mox: the tree with LoRA dropout (``dropout > 0``): it takes one
      more keyword argument, ``lora_dropout_key`` (a raw
      ``jax.random.PRNGKey``); ``mox`` itself when ``dropout == 0``.
    unmerge: ``unmerge(merged, trained)`` undoes ``merge``: params for
      ``mox`` whose kernels are ``merged``'s with ``trained``'s adapters
      taken out again.
    recipe: this call recorded, to replay it on a new trace (``yax.keep``).
  """
  mox: Mox
  params: Any
  mask: Any
  merge: Callable[[Any], Any]
  paths: list  # module paths that were adapted
  config: dict = dataclasses.field(default_factory=dict)
  train_mox: Mox | None = None
  unmerge: Callable[[Any, Any], Any] | None = None
  recipe: Any = None

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

  def trainable_count(self, params=None) -> TrainableCount:
    """``(trainable, total)`` element counts of ``params`` (default
    ``.params``) under ``.mask``; ``str()`` of it reads as ``peft``'s
    ``print_trainable_parameters``; ``.fraction`` is the ratio.

    Example::

        print(res.trainable_count())
        # trainable params: 1,536 || all params: 52,000 || trainable%: 2.9538
    """
    return count_trainable(self.params if params is None else params,
                           self.mask)

  @property
  def num_trainable(self) -> int:
    """Trainable elements (adapters and ``train=`` params)."""
    return self.trainable_count().trainable

  def weighted(self, params, weights: dict):
    """``params`` with the weights of named adapters set: ``weights``
    maps an adapter name (``lora(adapter_name=...)``) to the factor its
    adapters are scaled by (1 when made). Several adapters with weights:
    their weighted sum (a combination); see :meth:`switch`. Works on any
    params tree of this result's ``mox`` or of a later named ``lora`` on
    it.

    Example::

        p = res_b.weighted(trained, {'a': 0.5, 'b': 0.5})
    """
    return set_adapter_weights(params, weights)

  def switch(self, params, active: str):
    """``params`` where only the named adapter ``active`` acts (weight 1;
    every other named adapter 0)."""
    names = adapter_weight_names(params)
    if active not in names:
      raise SubstitutionError(
          f'switch: no adapter named {active!r} in params; its named '
          f'adapters are {sorted(names)}')
    return set_adapter_weights(params, {n: float(n == active)
                                        for n in names})


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


def _dora_delta(c: _contraction.Contraction, k_ndim: int, x, w, a, b, m,
                lora_out, scale: float):
  """DoRA's change of a 2-D ``dot_general`` output: with ``W' = W + s A B``
  and ``g = m / ||W'||`` (norm over the contracted axis, one per output
  channel), the new output is ``g * (x W')``; returned as its difference
  from ``x W``: ``(g - 1) * (x W) + g * lora_out`` (``lora_out``: ``s (x A)
  B``, dropout applied to its input only)."""
  x_sub, a_sub, _, b_sub, out, k_sub = _dot_letters(c, k_ndim, x.ndim)
  full = w + scale * jnp.einsum(f'{a_sub},{b_sub}->{k_sub}', a, b)
  contracted = tuple(i for i, l in enumerate(k_sub) if l in a_sub)
  g = m / jnp.sqrt(jnp.sum(full * full, axis=contracted))
  g_sub = ''.join(l for l in k_sub if l not in a_sub)
  base = jnp.einsum(f'{x_sub},{k_sub}->{out}', x, w)
  return (jnp.einsum(f'{out},{g_sub}->{out}', base, g - 1) +
          jnp.einsum(f'{out},{g_sub}->{out}', lora_out, g))


# The traced adapter is only read (its symbols are re-wired per node), so one
# trace serves every node of the same plan: BERT-base's 73 Dense layers need
# 3 traces instead of 73.
@functools.lru_cache(maxsize=256)
def _traced_adapter(c: _contraction.Contraction, k_ndim, a_shape, b_shape,
                    x_aval, y_aval, dtype, scale, stack=(), extra=(),
                    dropout=0.0, site=0, dora=None, weighted=False):
  def adapter(y, x, a, b, *rest):
    more, rest = rest[:len(extra)], rest[len(extra):]
    if dora is not None:
      kernel, magnitude, *rest = rest
    if weighted:
      weight, *rest = rest
    for step in c.x_steps:
      x = step.apply(x)
    x = x.astype(dtype)
    dropped = x
    if dropout:  # LoRA dropout: on the adapter's input only
      (key,) = rest
      keep = jax.random.bernoulli(jax.random.fold_in(key, site),
                                  1.0 - dropout, x.shape)
      dropped = jnp.where(keep, x / (1.0 - dropout), jnp.zeros_like(x))
    delta = scale * _delta(c, k_ndim, dropped, a, b, stack, *more)
    if dora is not None:
      delta = _dora_delta(c, k_ndim, x, kernel.astype(dtype), a, b,
                          magnitude, delta, scale)
    if weighted:
      delta = weight * delta
    delta = delta.astype(c.z_aval.dtype)
    for step in c.y_steps:
      delta = step.apply(delta)
    return y + delta.astype(y.dtype)
  spec = jax.ShapeDtypeStruct
  specs = [spec(y_aval.shape, y_aval.dtype), spec(x_aval.shape, x_aval.dtype),
           spec(a_shape, dtype), spec(b_shape, dtype),
           *(spec(shape, kind) for shape, kind in extra)]
  if dora is not None:
    k_shape, k_dtype, m_shape = dora
    specs += [spec(k_shape, k_dtype), spec(m_shape, dtype)]
  if weighted:
    specs.append(spec((), dtype))
  if dropout:
    specs.append(spec((2,), jnp.uint32))
  return make_mox(adapter)(*specs)


def _adapter_mox(plan: _contraction.KernelPlan, x_aval, y_aval, dtype,
                 opts: '_Options', extra=(), site=0, dora=None):
  """The traced adapter; ``extra``: (shape, dtype) of the contraction's
  inputs beyond its two operands, which the adapter reads too; ``site``:
  the adapter's number (its dropout mask folds it into the key);
  ``dora``: (kernel shape, kernel dtype, magnitude shape) for DoRA."""
  args = (plan.contraction, len(plan.kernel_shape), plan.a_shape,
          plan.b_shape, x_aval, y_aval, dtype, opts.scale, plan.stack,
          tuple(extra), opts.dropout, site if opts.dropout else 0, dora,
          opts.weighted)
  try:
    return _traced_adapter(*args)
  except TypeError as e:  # a step's parameter that is not hashable
    if 'unhashable' not in str(e):
      raise
    return _traced_adapter.__wrapped__(*args)


@dataclasses.dataclass(frozen=True)
class _Options:
  """How the adapters are built: ``scale`` multiplies ``(x A) B``;
  ``dropout`` > 0 reads the root keyword argument ``lora_dropout_key``."""
  rank: int
  alpha: float
  scale: float
  dropout: float = 0.0
  dora: bool = False
  weighted: bool = False  # a named adapter: its weight scales it


DROPOUT_KEY = 'lora_dropout_key'


def _key_input(opts: _Options, named: dict) -> list:
  """The dropout key the adapter reads, as a new input of its call that
  the rewrite makes the root keyword argument ``lora_dropout_key``."""
  if not opts.dropout:
    return []
  key = Var(jax.core.ShapedArray((2,), jnp.uint32))
  named[key] = DROPOUT_KEY
  return [key]


def _lora_template(node: Mox, plan: _contraction.KernelPlan, opts: _Options,
                   site: int = 0, named: dict | None = None,
                   init: str = 'default', named_adapter=None) -> Mox:
  """A ``LoRA`` module call wrapping ``node``; reads the node's symbols."""
  c = plan.contraction
  kernel = node.var_inputs[c.kernel_index]
  x, y = node.inputs[c.x_index], node.outputs[c.y_index]
  dtype = adapter_dtype(kernel, c)
  dora = None
  reads = []
  if opts.dora:
    m_shape = tuple(plan.b_shape[1:])
    dora = (tuple(kernel.aval.shape), kernel.aval.dtype, m_shape)
    magnitude = Var(jax.core.ShapedArray(m_shape, dtype))
    reads = [kernel, magnitude]
  if opts.weighted:
    weight = Var(jax.core.ShapedArray((), dtype))
    reads = [weight]
  adapter = _adapter_mox(plan, x.aval, y.aval, dtype, opts, site=site,
                         dora=dora)
  if adapter.constvars:
    raise SubstitutionError(
        f'internal: the traced LoRA adapter captured {len(adapter.constvars)} '
        'constants; it must be a function of (y, x, a, b) only')
  a = Var(jax.core.ShapedArray(plan.a_shape, dtype))
  b = Var(jax.core.ShapedArray(plan.b_shape, dtype))
  keys = _key_input(opts, {} if named is None else named)
  out = Var(y.aval)  # the module output's type, sharding included
  children = [node, *inline(adapter, [y, x, a, b, *reads, *keys], [out])]
  if is_nnx(node):  # NNX: typed nnx.LoRAParam s next to the kernel
    rel, group, kind = (), NNX_GROUP, 'LoRAParam'
  else:
    # Relative to the node: () next to its kernel, the calling module's
    # path and the head's name for a nested apply's root (path ()).
    rel, group = tuple(plan.place[len(node.path):]), plan.kernel_keys[0]
    kind = group
  syms = [a, b] + ([magnitude] if opts.dora else []) + (
      [weight] if opts.weighted else [])
  var_inputs, var_tree = with_variables(node, added=[
      VarEntry(group, _kind(kind, name), (*rel, name), True, not rel, sym)
      for name, sym in zip(_var_names(plan, opts), syms, strict=True)])
  outputs = [out if i == c.y_index else s for i, s in enumerate(node.outputs)]
  in_tree = node.in_tree
  if keys:  # the key after the call's own arguments
    args, kwargs = jtu.tree_unflatten(in_tree, node.arg_inputs)
    in_tree = jtu.tree_structure(((*args, *keys), kwargs))
  return Mox(var_inputs + list(node.arg_inputs) + keys, outputs,
             {'name': node.name, 'rank': opts.rank, 'alpha': opts.alpha,
              'base': node.type_name, 'kernel': plan.kernel_name,
              **_named(named_adapter)},
             children=children, module_ty=LoRA, entrypoint='__call__',
             path=node.path, in_tree=in_tree, out_tree=node.out_tree,
             var_tree=var_tree, inits=_inits(group, rel, plan, opts, init))


def _var_names(plan: _contraction.KernelPlan, opts: _Options) -> tuple:
  """The new variables' names: ``lora_a``, ``lora_b`` (as named in the
  plan), for DoRA the magnitude ``lora_magnitude``, for a named adapter
  its weight ``<name>_lora_weight``."""
  return (*plan.names, *([_magnitude_name(plan.names)] if opts.dora else []),
          *([_weight_name(plan.names)] if opts.weighted else []))


def _weight_name(names: tuple) -> str:
  return names[0][:-len('lora_a')] + 'lora_weight'


def _kind(kind: str, name: str) -> str:
  """A named adapter's weight is a frozen NNX ``Param``, not a
  ``LoRAParam``."""
  return 'Param' if kind == 'LoRAParam' and name.endswith('lora_weight') \
      else kind


def _named(adapter_name) -> dict:
  """The LoRA call's field naming its adapter (none for the unnamed)."""
  return {} if adapter_name is None else {'adapter': adapter_name}


def _magnitude_name(names: tuple) -> str:
  return names[0][:-len('lora_a')] + 'lora_magnitude'


def _inits(group: str, rel: tuple, plan: _contraction.KernelPlan,
           opts: _Options, init: str = 'default') -> dict:
  """The record of the adapters for ``yax.init_params``, as ``lora`` draws
  them: ``A`` normal with variance 1 / fan_in (``init='gaussian'``: standard
  deviation 1 / rank), ``B`` zero; DoRA's magnitude the kernel's norm per
  output channel."""
  names = _var_names(plan, opts)
  a, b = ((group, *rel, name) for name in names[:2])
  std = 1 / opts.rank if init == 'gaussian' else 1 / math.sqrt(plan.fan_in)
  record = {a: functools.partial(_init_a, a, std, init),
            b: functools.partial(_init_b, b)}
  if opts.dora:
    m = (group, *rel, names[2])
    record[m] = functools.partial(_init_magnitude, m,
                                  (group, *rel, plan.kernel_name), plan)
  if opts.weighted:
    w = (group, *rel, names[-1])
    record[w] = functools.partial(_init_weight, w)
  return record


def _init_weight(keys, key, aval, read):
  del key, read
  return {keys: jnp.ones(aval.shape, aval.dtype)}


def _init_a(keys, std, init, key, aval, read):
  del read
  if init == 'svd':
    raise SubstitutionError(
        f'{"/".join(keys)} was made by lora(init="svd") from the kernel it '
        'adapts (the kernel then holds the residual); take the params lora '
        'returned, init_params does not redo the decomposition')
  value = jax.random.normal(key, aval.shape, jnp.float32) * std
  return {keys: value.astype(aval.dtype)}


def _init_b(keys, key, aval, read):
  del key, read
  return {keys: jnp.zeros(aval.shape, aval.dtype)}


def _init_magnitude(keys, kernel_keys, plan, key, aval, read):
  del key
  return {keys: _column_norm(plan, read(kernel_keys)).astype(aval.dtype)}


def _site_template(node: Mox, plan: _contraction.KernelPlan, opts: _Options,
                   site: int = 0, named: dict | None = None,
                   init: str = 'default', named_adapter=None) -> Mox:
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
  adapter = _adapter_mox(plan, x.aval, z.aval, dtype, opts,
                         [(tuple(s.aval.shape), s.aval.dtype) for s in more],
                         site=site)
  weights = [Var(jax.core.ShapedArray((), dtype))] if opts.weighted else []
  a = Var(jax.core.ShapedArray(plan.a_shape, dtype))
  b = Var(jax.core.ShapedArray(plan.b_shape, dtype))
  keys = _key_input(opts, {} if named is None else named)
  out = Var(z.aval)
  children = [eqn.replace(inputs=args, outputs=[z]),
              *inline(adapter, [z, x, a, b, *more, *weights, *keys], [out])]
  if is_nnx(node):
    group, kind = NNX_GROUP, 'LoRAParam'
  else:
    group = kind = plan.kernel_keys[0]
  bare = Mox([], [], module_ty=LoRA)
  var_inputs, var_tree = with_variables(bare, [], added=[
      VarEntry(group, _kind(kind, name), (name,), True, True, sym)
      for name, sym in zip(_var_names(plan, opts), (a, b, *weights),
                           strict=True)])
  arg_inputs = [s for s in args if not isinstance(s, Literal)] + keys
  return Mox(var_inputs + arg_inputs, [out],
             {'name': node.name, 'rank': opts.rank, 'alpha': opts.alpha,
              'base': eqn.prim.name, 'kernel': plan.kernel_name,
              IN_PLACE: True, **_named(named_adapter)},
             children=children, module_ty=LoRA, entrypoint='__call__',
             path=node.path, in_tree=jtu.tree_structure((tuple(arg_inputs),
                                                         {})),
             out_tree=jtu.tree_structure(out), var_tree=var_tree,
             inits=_inits(group, (), plan, opts, init))


def _refuse(problems, chosen: Selection, selection):
  """One error for every module lora cannot adapt, with a way around."""
  lines = [f"  - {describe(n)}{f' (name {n.name!r})' if n.name else ''}: "
           f'{why}' for n, why, _ in problems]
  raise SubstitutionError(
      f'lora cannot adapt {len(problems)} of the {len(chosen.targets)} module '
      f'calls selected by {chosen.description}:\n' + '\n'.join(lines) +
      '\n' + leave_out_hint([(n, wrapped) for n, _, wrapped in problems],
                             selection, chosen.targets, chosen.root))


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


def _check_flag(name, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise SubstitutionError(
        f'lora: {name} must be True or False, found {type(value).__name__} '
        f'{value!r}')
  return bool(value)


def _check_scale(alpha: float, rank: int, rslora) -> float:
  """``alpha / rank``, or ``alpha / sqrt(rank)`` for rsLoRA."""
  if _check_flag('rslora', rslora):
    return alpha / math.sqrt(rank)
  return alpha / rank


def _check_dropout(dropout) -> float:
  if (isinstance(dropout, bool) or not isinstance(dropout, numbers.Real)
      or not 0 <= dropout < 1):
    raise SubstitutionError(
        f'lora: dropout must be a rate in [0, 1), found '
        f'{type(dropout).__name__} {dropout!r}')
  return float(dropout)


INITS = ('default', 'gaussian', 'svd')


def _check_init(init) -> str:
  if init not in INITS:
    raise SubstitutionError(
        f'lora: init must be one of {", ".join(map(repr, INITS))}, found '
        f'{init!r}')
  return init


def _check_train_names(names):
  if names is None:
    return None
  if isinstance(names, str):
    names = (names,)
  names = tuple(names)
  if not names or not all(isinstance(n, str) for n in names):
    raise SubstitutionError(
        f'lora: train_names must be param names (strings), e.g. '
        f"('bias',); found {names!r}")
  return names


def _check_adapter_name(name):
  if name is None:
    return None
  if not isinstance(name, str) or not name.isidentifier():
    raise SubstitutionError(
        f'lora: adapter_name must be an identifier (a str such as '
        f"'task_a'), found {type(name).__name__} {name!r}")
  return name


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
  """Checks ``params`` against the traced argument at ``prefix``; a
  mismatch names the first key path that differs."""
  # prefix = (0|1, position or kwarg name, *keys inside that argument)
  root_args = jtu.tree_unflatten(mox.in_tree, mox.inputs)
  arg = root_args[prefix[0]][prefix[1]]
  if jtu.tree_structure(arg) == jtu.tree_structure(params):
    return
  where = ('args' if prefix[0] == 0 else 'kwargs') + f'[{prefix[1]!r}]'
  traced = [jtu.keystr(k) for k, _ in jtu.tree_flatten_with_path(
      arg, is_leaf=lambda s: isinstance(s, Symbol))[0]]
  types = dict(zip(traced, (s.type_str for s in jtu.tree_leaves(
      arg, is_leaf=lambda s: isinstance(s, Symbol))), strict=True))
  given = jtu.tree_flatten_with_path(params)[0]
  found = dict((jtu.keystr(k), v) for k, v in given)
  head = ('lora: `params` must have the structure of the traced argument '
          f'that holds the parameters ({where}); ')
  for path in traced:
    if path not in found:
      raise SubstitutionError(
          head + f'{where}{path} is missing (expected {types[path]})')
  for path, value in found.items():
    if path not in types:
      raise SubstitutionError(
          head + f'{where}{path} is not in the traced argument (given '
          f'{getattr(value, "dtype", type(value).__name__)}'
          f'{list(np.shape(value))})')
  raise SubstitutionError(
      head + 'the key paths are the same, the containers differ (e.g. an '
      f'nn.Partitioned box or a list where the trace had none): traced '
      f'{type(arg).__name__}, given {type(params).__name__}')


# The linear layers of Linen, NNX and Hugging Face Flax (GPT-2's Conv1D).
LINEAR_TYPES = ('Dense', 'DenseGeneral', 'Einsum', 'FlaxConv1D', 'Linear',
                'LinearGeneral')
_DEFAULT_SELECTION = '//module_call[{}]'.format(
    ' or '.join(f'@type="{t}"' for t in LINEAR_TYPES))


@recorded
def lora(mox: Mox, params, selection=_DEFAULT_SELECTION, *,
         rank: int = 4, alpha: float = 1.0, key=None, init: str = 'default',
         rslora: bool = False, dropout: float = 0.0, dora: bool = False,
         train=None, train_names=None, adapter_name=None) -> LoraResult:
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
    nodes of ``mox``, and no node together with one of its ancestors. The
    default selects the linear layers (``Dense``, ``DenseGeneral``,
    ``Einsum``, Hugging Face's ``FlaxConv1D``, ``nnx.Linear``,
    ``nnx.LinearGeneral``) whose kernel is their own parameter, read by
    them alone: a head tied to an embedding is left out, as peft does.
  - ``rank``: a positive int; ``alpha``: a finite real. The adapter is
    scaled by ``alpha / rank``.
  - ``key``: PRNG key for ``lora_a`` (``jax.random.key(0)`` if omitted).
  - ``init``: ``'default'`` (``A`` normal with variance 1 / fan_in, ``B``
    zero), ``'gaussian'`` (``A`` normal with standard deviation 1 / rank,
    as peft's ``init_lora_weights='gaussian'``, ``B`` zero) or ``'svd'``
    (PiSSA: ``scale * A @ B`` is the kernel's top-``rank`` singular part,
    ``A = U_r sqrt(S_r / scale)``, ``B = sqrt(S_r / scale) V_r^T``, and the
    kernel in ``.params`` holds the residual ``W - scale * A @ B``, so the
    model is unchanged and ``.merge`` of the untrained adapters gives the
    kernel back).
  - ``rslora``: scale by ``alpha / sqrt(rank)`` (rank-stabilized LoRA)
    instead of ``alpha / rank``.
  - ``dropout``: LoRA dropout rate in ``[0, 1)`` on the adapter's input
    (``(dropout(x) A) B``; the kernel's own path sees ``x``). ``.mox``
    stays deterministic (evaluation, inference, ``.merge``); ``.train_mox``
    applies the dropout and takes the keyword argument
    ``lora_dropout_key``, a raw ``jax.random.PRNGKey`` (pass a new one per
    step). Adapter ``i`` (in ``.config['adapters']`` order) keeps ``x``
    where ``jax.random.bernoulli(jax.random.fold_in(key, i), 1 - dropout,
    x.shape)`` and scales it by ``1 / (1 - dropout)``. Inside a lifted
    body (``nn.scan``) every iteration draws the same mask.
  - ``dora``: DoRA (Liu et al. 2024, https://arxiv.org/abs/2402.09353):
    the output is ``g * (x W')`` with ``W' = W + scale * A @ B`` and ``g =
    m / ||W'||`` (norm over the contracted axis, per output channel); the
    trainable magnitude ``m`` (``lora_magnitude``, next to ``lora_a``)
    starts at ``||W||``. 2-D ``dot_general`` kernels adapted around their
    call (Dense, ``nnx.Linear``, GPT-2's ``Conv1D``) only; ``.merge`` folds
    ``g`` into the kernel.
  - ``train``: XPath (or node list) of more module calls whose own params
    train too (peft's ``modules_to_save``: a classifier head, LayerNorms);
    ``train_names``: only params with these names (``('bias',)``: the
    biases of the selected calls). Both set ``.mask`` True there; ``.merge``
    keeps their trained values.
  - ``adapter_name``: a named adapter (an identifier): its variables are
    ``<name>_lora_a``, ``<name>_lora_b`` and a frozen scalar
    ``<name>_lora_weight`` (1) that scales it. It may go on a tree that
    already has adapters of other names (``yax.lora(res_a.mox,
    res_a.params, adapter_name='b')``): they add up, and
    ``.switch(p, name)`` / ``.weighted(p, {name: w})`` set the weights
    (switch adapters, combine them). ``.merge`` folds this call's adapters
    (weighted), for the tree it started from. Without a name the adapter
    is ``lora_a``/``lora_b``, unweighted, as before.

  **Returns:** a :class:`LoraResult` with ``.mox``, ``.params``, ``.mask``,
  ``.merge``, ``.unmerge``, ``.paths``, ``.config``, ``.train_mox`` and
  ``.trainable_count()``.

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
  opts = _Options(rank, alpha, _check_scale(alpha, rank, rslora),
                  _check_dropout(dropout), _check_flag('dora', dora))
  init = _check_init(init)
  train_names = _check_train_names(train_names)
  collections = collections_of(mox)
  group = NNX_GROUP if NNX_GROUP in collections else 'params'
  if group == NNX_GROUP:
    if _systems.holds_module_argument(mox):
      raise SubstitutionError(
          'lora on an NNX tree needs the split form, where the parameters are '
          'an argument: graphdef, state = nnx.split(model); mox = '
          'yax.make_mox(lambda s, x: nnx.merge(graphdef, s)(x))(state, x); '
          'res = yax.lora(mox, state, ...)')
  adapter_name = _check_adapter_name(adapter_name)
  if adapter_name is not None and opts.dora:
    raise SubstitutionError(
        'lora: a named adapter (adapter_name=) is weighted by a scalar '
        'param, which DoRA\'s magnitude does not take; use one unnamed DoRA '
        'adapter')
  opts = dataclasses.replace(opts, weighted=adapter_name is not None)
  ours = (_ADAPTER_NAMES if adapter_name is None
          else tuple(f'{adapter_name}_{n}' for n in _ADAPTER_NAMES))
  default = isinstance(selection, str) and selection == _DEFAULT_SELECTION
  chosen = select(selection, mox)
  targets = _contraction.plan_kernels(chosen, 'lora', rank, every=True)
  if default:  # a head tied to an embedding is left out, as peft does
    computed = {id(t.node) for t in targets if t.plan is not None
                and not t.own}
    targets = [t for t in targets if id(t.node) not in computed]
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
    # Named adapters stack: another name's LoRA call may wrap the node.
    wrapper = next((a for a in ancestors if isinstance(a, Mox)
                    and a.module_ty is LoRA
                    and a.params.get('adapter') == adapter_name), None)
    held = sorted(n for n in _contraction.own_param_names(node)
                  if isinstance(n, str) and n.endswith(ours))
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
    names = (tuple(f'{method}_{n}' for n in ours) if method else ours)
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
  if default:  # kernels other calls read too (Embed.attend) stay as they are
    plans = {k: p for k, p in plans.items() if p.tied is None}
    kept = {k[0] for k in plans}
    targets = [t for t in targets if id(t.node) in kept]
    if not plans:
      raise SubstitutionError(
          "lora's default selection (the linear layers: "
          f"{', '.join(LINEAR_TYPES)}) found no layer whose kernel is its "
          'own parameter and read by it alone; pass an XPath of the module '
          "calls to adapt, e.g. '//module_call[@type=\"MyDense\"]'")
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
  if opts.dora or init == 'svd':
    _check_variant(plans, by_node, params, prefix, opts, init, chosen,
                   selection)
  # What the rewrite replaces: the call (an adapter around it), or the
  # contraction equations of the kernels adapted in place.
  replaced = {}
  for (node_id, _), plan in plans.items():
    node = by_node[node_id]
    item = node if plan.site is None else plan.site
    replaced[id(item)] = (item, node, plan)
  # Each adapter pair's number: its dropout mask folds it into the key.
  order = sorted({(tuple(p.place), p.names) for p in plans.values()})
  number = {place: i for i, place in enumerate(order)}

  def rewrite(opts):
    named = {}

    def make(path, item):
      _, node, plan = replaced[id(item)]
      site = number[(tuple(plan.place), plan.names)]
      template = _lora_template if plan.site is None else _site_template
      return template(node, plan, opts, site, named, init, adapter_name)

    sites = select([item for item, _, _ in replaced.values()], mox)
    return substitute(sites, make, mox, inputs=named)

  done = rewrite(dataclasses.replace(opts, dropout=0.0))
  if done.collections.get(group) != prefix:
    raise SubstitutionError(
        f"internal: the params collection moved from {_arg_str(prefix)} to "
        f"{_arg_str(done.collections.get(group))} during the rewrite")

  inside = tuple(prefix[2:])  # keys of the collection inside `params`
  adapted = {}  # (module path, variable name) -> plan
  for plan in plans.values():
    for name in _var_names(plan, opts):
      adapted[(tuple(plan.place), name)] = plan
  # Initial values on the host, from one generator seeded by ``key``: no
  # XLA computation to compile per adapter shape.
  rng = np.random.default_rng(
      np.asarray(jax.random.key_data(key)).ravel().tolist())
  values, flags = [], []
  svd_done = {}  # (module path, names) -> (A, B, residual kernel)
  for loc, var in sorted(done.added.items()):
    plan = adapted.get((tuple(loc[1:-1]), loc[-1]))
    if loc[0] != group or plan is None:
      raise SubstitutionError(
          f"internal: lora added a variable at {'/'.join(loc)}, which is not "
          'the adapter of a selected module')
    shape, dtype = tuple(var.aval.shape), var.aval.dtype
    # None for a call-site adapter of a head whose kernel is not here.
    kernel_at = (*inside, *loc[1:-1], plan.kernel_name)
    kernel = _get_or_none(params, kernel_at)
    role = dict(zip(_var_names(plan, opts), 'abmw' if opts.dora else 'abw'))[
        loc[-1]]
    if role == 'w':  # a named adapter's weight: 1, frozen
      value = jnp.ones((), dtype)
      box = (functools.partial(_systems.typed_variable, 'Param')
             if group == NNX_GROUP else (lambda v: v))
      values.append(((*inside, *loc[1:]), box(value)))
      flags.append(((*inside, *loc[1:]), box(False)))
      continue
    if role == 'm':
      value = _column_norm(plan, unboxed(kernel)).astype(dtype)
    elif init == 'svd':
      pair = (tuple(loc[1:-1]), plan.names)
      if pair not in svd_done:
        svd_done[pair] = _svd_init(plan, unboxed(kernel), opts.scale, dtype)
        values.append((kernel_at, boxed_like(kernel, svd_done[pair][2])))
      value = svd_done[pair][0 if role == 'a' else 1]
    else:
      value = _adapter_value(unboxed(kernel), plan, role == 'a', shape,
                             dtype, rng, opts.rank if init == 'gaussian'
                             else None)
    # A Linen box (a bridged NNX model's params, ToLinen): the adapter too.
    # (An Equinox model's kernel is a plain array, and so are its adapters.)
    boxed_nnx = group == NNX_GROUP and not isinstance(
        kernel, jax.Array) and not _systems.is_metadata_box(kernel)
    box = _adapter_box(kernel, plan, role != 'b', boxed_nnx)
    if role == 'm':  # axes as B's last ones
      box = _adapter_box(kernel, plan, False, boxed_nnx, magnitude=True)
    value, flag = box(value), box(True)
    values.append(((*inside, *loc[1:]), value))
    flags.append(((*inside, *loc[1:]), flag))
  new_params = set_many(params, values)
  if train is not None:
    flags = _train_flags(mox, train, train_names, params, prefix, flags)
  mask = set_many(jtu.tree_map(lambda _: False, params), flags)
  new_mox = with_argument_structure(done.mox, prefix[:2], new_params)
  train_mox = new_mox
  if opts.dropout:
    train_mox = with_argument_structure(rewrite(opts).mox, prefix[:2],
                                        new_params)
  scale = opts.scale
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
            heads, selection, chosen.targets, mox))
  config = {
      'selection': (selection if isinstance(selection, str)
                    else chosen.description),
      'rank': rank, 'alpha': alpha, 'scale': scale,
      'variant': 'dora' if opts.dora else 'lora', 'init': init,
      'rslora': bool(rslora), 'dropout': opts.dropout,
      'adapter_name': adapter_name,
      'train': train if isinstance(train, str) or train is None
               else select(train, mox).description,
      'train_names': None if train_names is None else list(train_names),
      'collection': list(inside),
      'paths': ['/'.join(p) for p in paths],
      'adapters': [{
          'path': list(path), 'names': list(_var_names(plan, opts)),
          'kernel': plan.kernel_name, 'a_shape': list(plan.a_shape),
          'b_shape': list(plan.b_shape),
          'magnitude': _magnitude_name(names) if opts.dora else None,
          'weight': _weight_name(names) if opts.weighted else None,
          'mergeable': plan.tied is None}
                   for (path, names), plan in merges],
      'yax_version': __version__,
  }
  folds = dict(merges=tuple(merges), inside=inside, scale=scale,
               dora=opts.dora, weighted=opts.weighted)
  return LoraResult(
      new_mox, new_params, mask,
      functools.partial(merge, **folds, refusal=refusal), paths, config,
      train_mox, functools.partial(unmerge, **folds, refusal=refusal))


def _fold(kernel, a, b, m, plan, scale):
  """The merged kernel: ``W + scale * A @ B``, DoRA's ``g * (W + scale *
  A @ B)`` with ``g = m / ||W + scale * A @ B||`` when ``m`` is given."""
  full = kernel + scale * _kernel_delta(plan, a, b)
  if m is None:
    return full
  return _from_matrix(plan, _as_matrix(plan, full) * (
      m.reshape(-1) / _norm(_as_matrix(plan, full))))


def _norm(matrix):
  return jnp.sqrt(jnp.sum(matrix * matrix, axis=0))


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
          refusal: str | None = None, dora: bool = False,
          weighted: bool = False):
  """Folds ``kernel + scale * A @ B`` (in the kernel's layout) for every
  adapter of ``merges`` (``((module path, adapter names), plan)``, under
  ``inside`` in ``trained``) and returns params for the original tree
  (adapters removed), in ``trained``'s container types. ``refusal``: why
  these adapters cannot be merged (call-site adapters of tied heads).
  ``dora``: the kernel is scaled per output channel by DoRA's magnitude
  over the norm (see :func:`lora`). ``weighted``: a named adapter, scaled
  by its weight too."""
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
    _check_pair(where, names, a, b, plan)
    drop = names
    m = None
    if dora:
      m = unboxed(get_in(out, (*keys, _magnitude_name(names))))
      drop = (*names, _magnitude_name(names))
    weight = 1.0
    if weighted:
      weight = unboxed(get_in(out, (*keys, _weight_name(names))))
      drop = (*drop, _weight_name(names))
    if plan.quant is not None:  # QLoRA: back to the float kernel
      scale_name = f'{plan.kernel_name}_scale'
      kernel = dequantize_kernel(
          kernel, unboxed(get_in(out, (*keys, scale_name))), plan.quant,
          a.dtype, plan.contracted, kernel.ndim - len(plan.kernel_shape),
          plan.source_perm)
      drop = (*drop, scale_name)
    delta = _kernel_delta(plan, a, b)
    if tuple(delta.shape) != tuple(kernel.shape):
      raise SubstitutionError(
          f'merge: at {where} {names[0]} {tuple(a.shape)} times {names[1]} '
          f'{tuple(b.shape)} is {tuple(delta.shape)}, which does not fit '
          f'the kernel {plan.kernel_name} {tuple(kernel.shape)}')
    folded = _fold(kernel, a, b, m, plan, scale * weight)
    merged = boxed_like(boxed, folded.astype(kernel.dtype))
    out = set_in(out, keys, set_in(without(module, drop),
                                   (plan.kernel_name,), merged))
  return out


def _weight_leaves(params):
  """``[(key path, adapter name)]`` of the named adapters' weights."""
  out = []
  for path, _ in jtu.tree_flatten_with_path(params)[0]:
    keys = [getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', None)))
            for k in path]
    name = next((k for k in reversed(keys) if isinstance(k, str)), '')
    if name.endswith('_lora_weight'):
      out.append((tuple(keys), name[:-len('_lora_weight')]))
  return out


def adapter_weight_names(params) -> set:
  """The names of the named adapters whose weights ``params`` holds."""
  return {n for _, n in _weight_leaves(params)}


def set_adapter_weights(params, weights: dict):
  """``params`` with each named adapter's weight set to ``weights[name]``
  (see :meth:`LoraResult.weighted`)."""
  found = adapter_weight_names(params)
  unknown = sorted(set(weights) - found)
  if unknown:
    raise SubstitutionError(
        f'weighted: no adapter named {unknown[0]!r} in params; its named '
        f'adapters are {sorted(found)}')
  flat, treedef = jtu.tree_flatten_with_path(params)
  by_path = {tuple(keys): n for keys, n in _weight_leaves(params)}
  leaves = []
  for path, leaf in flat:
    keys = tuple(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', None)))
                 for k in path)
    name = by_path.get(keys)
    if name in weights:
      leaf = jnp.asarray(weights[name], jnp.asarray(leaf).dtype).reshape(
          np.shape(leaf))
    leaves.append(leaf)
  return jtu.tree_unflatten(treedef, leaves)


def _check_pair(where, names, a, b, plan):
  if (tuple(a.shape[a.ndim - len(plan.a_shape):]) != plan.a_shape or
      tuple(b.shape[b.ndim - len(plan.b_shape):]) != plan.b_shape):
    raise SubstitutionError(
        f'merge: at {where} the adapters are {names[0]} {tuple(a.shape)} '
        f'and {names[1]} {tuple(b.shape)}; lora made them '
        f'{plan.a_shape} and {plan.b_shape}')


def unmerge(merged, trained, *, merges: tuple, inside: tuple, scale: float,
            refusal: str | None = None, dora: bool = False,
            weighted: bool = False):
  """Undoes :func:`merge`: params for the LoRA tree, each kernel being
  ``merged``'s with ``trained``'s adapters taken out (``W = W_merged -
  scale * A @ B``; DoRA: ``W = W_merged * ||W_t + scale * A @ B|| / m -
  scale * A @ B``, the norm from ``trained``'s kernel ``W_t``), the
  adapters and every other leaf ``trained``'s. A quantized kernel
  (QLoRA) is not unmerged (``merge`` returned it as floats)."""
  if refusal is not None:
    raise SubstitutionError('un' + refusal)
  out = trained
  for (module_path, names), plan in merges:
    keys = (*inside, *module_path)
    where = f"params{''.join(f'[{k!r}]' for k in keys)}"
    if plan.quant is not None:
      raise SubstitutionError(
          f'unmerge: the kernel at {where} is stored quantized ({plan.quant})'
          ' in the LoRA tree; merge made it float, which unmerge cannot '
          'quantize again the same way')
    boxed = get_in(out, (*keys, plan.kernel_name))
    folded = unboxed(get_in(merged, (*keys, plan.kernel_name)))
    a, b = (unboxed(get_in(out, (*keys, n))) for n in names)
    _check_pair(where, names, a, b, plan)
    weight = (unboxed(get_in(out, (*keys, _weight_name(names))))
              if weighted else 1.0)
    delta = weight * scale * _kernel_delta(plan, a, b)
    if tuple(np.shape(folded)) != tuple(delta.shape):
      raise SubstitutionError(
          f'unmerge: the merged kernel at {where} is '
          f'{tuple(np.shape(folded))}; the adapters give {tuple(delta.shape)}')
    if dora:
      m = unboxed(get_in(out, (*keys, _magnitude_name(names))))
      norm = _norm(_as_matrix(plan, unboxed(boxed) + delta))
      folded = _from_matrix(plan, _as_matrix(plan, folded) * (
          norm / m.reshape(-1)))
    kernel = (folded - delta).astype(unboxed(boxed).dtype)
    out = set_in(out, (*keys, plan.kernel_name), boxed_like(boxed, kernel))
  return out


def _check_variant(plans: dict, by_node: dict, params, prefix: tuple,
                   opts: _Options, init: str, chosen: Selection, selection):
  """Refuses, in one round, the kernels DoRA or the SVD init cannot take."""
  inside = tuple(prefix[2:])
  problems = {}
  for (node_id, _), plan in plans.items():
    node = by_node[node_id]
    kernel = _get_or_none(params, (*inside, *plan.place, plan.kernel_name))
    kernel = None if kernel is None else unboxed(kernel)
    what = 'DoRA' if opts.dora else "init='svd'"
    why = None
    if plan.tied is not None or kernel is None:
      why = f'{what} needs the kernel it adapts ({plan.tied or "not here"})'
    elif plan.quant is not None:
      why = f'{what} needs a float kernel; it is stored {plan.quant}'
    elif plan.stack or np.ndim(kernel) != len(plan.kernel_shape):
      why = (f'{what} takes one kernel per call; its kernel '
             f'{tuple(np.shape(kernel))} is a stack of {plan.kernel_shape}')
    elif plan.contraction.kind == _contraction.RAGGED:
      why = f'{what} does not take ragged_dot kernels'
    elif opts.dora and (plan.contraction.kind != 'dot_general' or
                        len(plan.kernel_shape) != 2 or plan.site is not None):
      why = ('DoRA takes 2-D dot_general kernels adapted around their call '
             f'(Dense, nnx.Linear, Conv1D); its kernel {plan.kernel_shape} '
             f'is contracted by {plan.contraction.kind}'
             + (' inside its body' if plan.site is not None else ''))
    elif init == 'svd' and isinstance(kernel, jax.ShapeDtypeStruct):
      why = "init='svd' needs the kernel's values; params are abstract"
    elif init == 'svd' and opts.rank > min(math.prod(plan.a_shape[:-1]),
                                           math.prod(plan.b_shape[1:])):
      why = (f"init='svd' needs rank <= the kernel's smaller side "
             f'({min(math.prod(plan.a_shape[:-1]), math.prod(plan.b_shape[1:]))})'
             f', found rank {opts.rank}')
    elif init == 'svd' and opts.scale == 0:
      why = "init='svd' needs a nonzero scale (alpha)"
    if why is not None and id(node) not in problems:
      problems[id(node)] = (node, why, False)
  if problems:
    _refuse(list(problems.values()), chosen, selection)


def _from_matrix(plan: _contraction.KernelPlan, matrix):
  """The kernel whose ``[contracted, other]`` matrix (A's axes by B's, in
  their order) is ``matrix``."""
  n = math.prod(plan.a_shape[:-1])
  eye = jnp.eye(n, dtype=matrix.dtype).reshape(*plan.a_shape[:-1], n)
  return _kernel_delta(plan, eye, matrix.reshape(n, *plan.b_shape[1:]))


def _as_matrix(plan: _contraction.KernelPlan, kernel):
  """The kernel as ``[contracted, other]`` (the inverse of
  :func:`_from_matrix`, an axis permutation and reshape)."""
  kernel = jnp.asarray(kernel)
  zero = jnp.zeros((math.prod(plan.a_shape[:-1]), math.prod(plan.b_shape[1:])),
                   kernel.dtype)
  (matrix,) = jax.linear_transpose(lambda m: _from_matrix(plan, m),
                                   zero)(kernel)
  return matrix


def _column_norm(plan: _contraction.KernelPlan, kernel):
  """DoRA's initial magnitude: the kernel's norm over its contracted axes,
  shaped as B's axes without the rank."""
  matrix = _as_matrix(plan, jnp.asarray(kernel, jnp.float32))
  return _norm(matrix).reshape(plan.b_shape[1:])


def _svd_init(plan: _contraction.KernelPlan, kernel, scale: float, dtype):
  """PiSSA: ``A``, ``B`` with ``scale * A @ B`` the kernel's top-rank
  singular part, and the residual kernel ``W - scale * A @ B``."""
  rank = plan.a_shape[-1]
  w = jnp.asarray(kernel, jnp.float32)
  u, s, vt = jnp.linalg.svd(_as_matrix(plan, w), full_matrices=False)
  root = jnp.sqrt(s[:rank] / abs(scale))
  a = (u[:, :rank] * root).reshape(plan.a_shape).astype(dtype)
  b = (np.sign(scale) * root[:, None] * vt[:rank]).reshape(
      plan.b_shape).astype(dtype)
  residual = w - scale * _kernel_delta(plan, a.astype(jnp.float32),
                                       b.astype(jnp.float32))
  return a, b, residual.astype(jnp.asarray(kernel).dtype)


def _train_flags(mox: Mox, train, names, params, prefix: tuple,
                 flags: list) -> list:
  """``flags`` plus True on every param (named in ``names``, if given) of
  the module calls ``train`` selects."""
  inside = tuple(prefix[2:])
  chosen = select(train, mox)
  more = []
  for node in chosen.targets:
    if not isinstance(node, Mox) or node.is_ephemeral:
      raise SubstitutionError(
          f'lora: train= selects {describe(node)}, which is not a module '
          'call; select the module calls whose params train')
    where = (*inside, *node.path)
    own = _get_or_none(params, where)
    found = []
    if isinstance(own, Mapping):
      found = [(k, v) for k, v in own.items()
               if not isinstance(v, Mapping)
               and (names is None or k in names)]
    if not found:
      raise SubstitutionError(
          f'lora: train= selects {describe(node)}, but params'
          f"{''.join(f'[{k!r}]' for k in where)} holds no params"
          + ('' if names is None else f' named {list(names)}'))
    for k, v in found:
      more.append(((*where, k), jtu.tree_map(lambda _: True, v)))
  return flags + more


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


def _adapter_value(kernel, plan: _contraction.KernelPlan, is_a: bool, shape,
                   dtype, rng, gaussian_rank: int | None = None):
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
  if is_a:  # N(0, 1 / fan_in); init='gaussian': standard deviation 1 / rank
    std = (1 / gaussian_rank if gaussian_rank is not None
           else 1 / np.sqrt(plan.fan_in))
    host = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
  else:
    host = np.zeros(shape, np.float32)
  host = host.astype(dtype)
  return jax.device_put(host, sharding) if sharding else jax.device_put(host)


def _adapter_box(kernel, plan: _contraction.KernelPlan, is_a: bool,
                 is_nnx: bool, magnitude: bool = False):
  """How an adapter is held, from how its kernel is: NNX adapters are
  ``nnx.LoRAParam`` s; a kernel with axis names (Linen ``nn.Partitioned``,
  ``nn.LogicallyPartitioned``; NNX sharding metadata) gives its adapters
  the names of their axes (``A``: the contracted axes' names then None,
  ``B``: None then the other axes' names; a stacked kernel's leading names
  lead both)."""
  def adapter_names(names):
    found = _adapter_axis_names(names, plan, is_a)
    # DoRA's magnitude: B's axes without the rank.
    return found[1:] if magnitude and found is not None else found
  if is_nnx:
    found = _systems.sharding_names(kernel)
    names = adapter_names(found[1]) if found else None
    if names is None:
      return lambda v: _systems.typed_variable('LoRAParam', v)
    return lambda v: _systems.typed_variable_like('LoRAParam', v, kernel,
                                                  **{found[0]: names})
  names = _systems.box_axis_names(kernel)
  if names is not None and adapter_names(names) is not None:
    new = adapter_names(names)
    return lambda v: _systems.reboxed(kernel, v, new)
  return lambda v: v


def _arg_str(keypath) -> str:
  if not keypath:
    return 'arguments'
  head = 'args' if keypath[0] == 0 else 'kwargs'
  rest = keypath[1:]
  if keypath[0] == 1 and rest:
    return f'{rest[0]}=' + ''.join(f'[{k!r}]' for k in rest[1:])
  return head + ''.join(f'[{k!r}]' for k in rest)
