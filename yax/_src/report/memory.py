"""``yax.memory_report``: what a training step keeps, per module call.

A training step keeps, between its forward and its backward pass, the
residuals JAX's autodiff saves (``jax.ad_checkpoint.saved_residuals``
lists them, each with the source line that computes it). This report
says which module call computes each one:

1. ``loss`` is traced with ``yax.make_mox``, so the module calls and
   their paths are known;
2. the tree is evaluated by an interpreter that opens one
   ``jax.named_scope`` per module call around its body, inside
   ``jax.vjp`` with respect to the first argument (the params), as
   ``saved_residuals`` does;
3. each residual belongs to the innermost module call whose scope its
   producing equation carries (exclusive: a ``Block``'s row does not hold
   what its ``Dense`` computes). Residuals computed outside every module
   call (the loss itself) are the unattributed remainder; arguments,
   constants and literals take no memory of their own and are listed
   apart.

Training memory is estimated as ``4 x param bytes + saved`` (params,
gradients and Adam's two moments, plus the residuals); XLA's memory
analysis of the compiled gradient is given beside it.

A rematerialized call (a ``checkpoint`` equation: ``jax.checkpoint``,
``nn.remat``, ``yax.remat``) keeps only its inputs (or what its policy
saves), but while its own backward pass runs its body is recomputed and
the body's residuals are live. That transient is the *recompute* figure:
for each checkpoint the step runs (inside ``jit``, ``scan``, ``while``,
``cond``, custom derivative bodies too), the bytes the body keeps when
differentiated without the checkpoint, minus what the checkpoint keeps,
plus the largest transient of the checkpoints nested in it; the largest
over the checkpoints (the backward pass runs them one at a time). A
checkpoint inside a ``scan`` body counts one iteration; a ``scan`` inside
a checkpoint counts its stacked residuals. The *peak* is ``training +
recompute``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from yax._src import compat
from yax._src.errors import SignatureError
from yax._src.ir.nodes import Mox
from yax._src.ir.nodes import iter_nodes
from yax._src.ir.rules import CHECKPOINT
from yax._src.report.flops import jaxpr_flops
from yax._src.trace.eval import MODULE_SCOPE, Interpreter, check_arguments
from yax._src.trace.make import make_mox

_SCOPE = 'yax.call'
_SCOPE_RE = re.compile(re.escape(_SCOPE) + r'(\d+)')


def nbytes(aval) -> int:
  """Bytes of one value of type ``aval`` (a PRNG key: its key data)."""
  shape = tuple(getattr(aval, 'shape', ()))
  dtype = aval.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape,
                                                                    dtype))
    return math.prod(data.shape) * np.dtype(data.dtype).itemsize
  return math.prod(shape) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MemoryRow:
  """One module call site: ``path`` (``a/b``; ``<Type>`` for a call at
  the root path), its ``type``, the ``bytes`` of the residuals it computes
  itself (exclusive) and their types (``residuals``)."""
  path: str
  type: str
  bytes: int
  residuals: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """What ``yax.memory_report`` returns; ``str()`` prints it as a table.

  Attributes:
    rows: one :class:`MemoryRow` per module path, in call order (every
      module call, those keeping nothing included).
    unattributed: bytes of residuals computed outside every module call.
    unattributed_residuals: their types.
    total: bytes of every residual but the arguments, constants and
      literals (``saved_residuals``' total, arguments excluded).
    excluded: residual types that are arguments, constants or literals.
    param_bytes: bytes of the first argument's array leaves.
    training: ``4 * param_bytes + total``.
    xla: XLA's memory analysis of the compiled ``jax.grad(loss)``
      (``argument``, ``output``, ``temp``, ``alias``, ``generated_code``
      bytes), or None when not computed or the backend gives none.
    recompute: bytes live on top of ``total`` while the backward pass
      recomputes a rematerialized call: the largest, over the checkpoints
      the step runs, of what the checkpoint's body keeps (differentiated
      without the checkpoint) beyond what the checkpoint itself keeps,
      plus the largest such figure of the checkpoints nested in it. 0
      when the step has no checkpoint.
  """
  rows: tuple[MemoryRow, ...]
  unattributed: int
  unattributed_residuals: tuple[str, ...]
  total: int
  excluded: tuple[str, ...]
  param_bytes: int
  training: int
  xla: dict[str, int] | None
  recompute: int = 0

  @property
  def peak(self) -> int:
    """``training + recompute``: the training memory while the backward
    pass recomputes the largest rematerialized call (``training`` when
    nothing is rematerialized)."""
    return self.training + self.recompute

  def by_path(self) -> dict[str, int]:
    """``{path: bytes}`` of the rows."""
    return {r.path: r.bytes for r in self.rows}

  def __str__(self) -> str:
    width = max([len(r.path) for r in self.rows] + [24])
    lines = [f'{"module call":<{width}}  {"type":<20}  {"kept (bytes)":>14}']
    for r in self.rows:
      lines.append(f'{r.path:<{width}}  {r.type[:20]:<20}  {r.bytes:>14,}')
    lines.append(f'{"(outside module calls)":<{width}}  {"":<20}  '
                 f'{self.unattributed:>14,}')
    lines.append(f'{"total saved":<{width}}  {"":<20}  {self.total:>14,}')
    lines.append(f'{"params":<{width}}  {"":<20}  {self.param_bytes:>14,}')
    lines.append(f'{"training (4 x params + saved)":<{width}}  {"":<20}  '
                 f'{self.training:>14,}')
    lines.append(f'{"recompute (largest remat body)":<{width}}  {"":<20}  '
                 f'{self.recompute:>14,}')
    lines.append(f'{"peak (training + recompute)":<{width}}  {"":<20}  '
                 f'{self.peak:>14,}')
    if self.xla:
      lines.append('XLA memory analysis of jax.grad(loss): ' + ', '.join(
          f'{k} {v:,}' for k, v in self.xla.items()))
    return '\n'.join(lines)


class _Scopes:
  """``MODULE_SCOPE`` hook: a ``jax.named_scope`` ``yax.call<i>`` around
  the body of each module call any interpreter runs (``calls[i]``). The
  root of a tree (the traced function: no type, no path) is no call."""

  def __init__(self):
    self.calls: list[Mox] = []

  def __call__(self, mox: Mox):
    if not mox.type_name and not mox.path:
      return contextlib.nullcontext()
    self.calls.append(mox)
    return jax.named_scope(f'{_SCOPE}{len(self.calls) - 1}')


def _path_text(call: Mox) -> str:
  return '/'.join(call.path) or f'<{call.type_name or "root"}>'


def _xla_memory(loss, args) -> dict[str, int] | None:
  compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
  analysis = compiled.memory_analysis()
  if analysis is None:  # the backend does not report one
    return None
  out = {}
  for name in ('argument', 'output', 'temp', 'alias', 'generated_code'):
    value = getattr(analysis, f'{name}_size_in_bytes', None)
    if value is not None:
      out[name] = int(value)
  return out


def memory_report(loss, *args, xla: bool = True) -> MemoryReport:
  """Bytes each module call keeps for the backward pass of ``loss``.

  **Arguments:**
  - ``loss``: a function of ``(params, *rest)`` returning the scalar a
    training step differentiates with respect to ``params``; it may call a
    Flax ``apply``, an NNX module or ``yax.eval_mox``.
  - ``*args``: its arguments (arrays; the first is the params).
  - ``xla``: also compile ``jax.grad(loss)`` for XLA's memory analysis.

  **Returns:** a :class:`MemoryReport`: rows of (module path, bytes kept,
  exclusive), the unattributed remainder, the total (JAX's
  ``saved_residuals`` total with respect to the params, arguments
  excluded), the training memory ``4 x param bytes + saved`` and XLA's
  memory analysis.

  Example::

      report = yax.memory_report(
          lambda p, x: model.apply(p, x).sum(), variables, x)
      print(report)                    # a table
      report.by_path()['encoder/layer_0']
  """
  if not args:
    raise SignatureError(
        'memory_report(loss, *args): expected the arguments of loss (the '
        'params first), found none')
  mox = make_mox(loss)(*args)
  params, rest = args[0], args[1:]
  p_leaves, p_tree = jax.tree_util.tree_flatten(params)
  # A loss whose trace holds module calls (Flax, NNX) is replayed from its
  # tree; one that evaluates YAX trees (``eval_mox``) runs as it is, and
  # those trees' calls open the scopes.
  replay = any(isinstance(n, Mox) and n is not mox for n in iter_nodes(mox))

  def run(p_leaves, rest):
    p = jax.tree_util.tree_unflatten(p_tree, p_leaves)
    if not replay:
      return loss(p, *rest)
    leaves = check_arguments(mox, (p, *rest), {})
    outs = Interpreter().run(mox, mox.consts, leaves)
    return jax.tree_util.tree_unflatten(mox.out_tree, outs) \
        if mox.out_tree is not None else outs

  report, _ = _analyse(run, p_leaves, rest, flops=False)
  return dataclasses.replace(
      report, xla=_xla_memory(loss, args) if xla else None)


def step_memory(loss, *args, flops: bool = False
                ) -> tuple[MemoryReport, int | None]:
  """``memory_report`` (without XLA's analysis) for a ``loss`` that
  evaluates YAX trees with ``eval_mox``, and the FLOPs of its gradient.

  The loss runs as it is (no trace of its own: the calls of the trees it
  evaluates are the rows), inside one trace of its forward and backward
  pass; ``flops=True`` counts that trace's FLOPs (``report/flops.py``,
  XLA's conventions), as ``jax.grad(loss)`` computes them.

  Returns ``(report, flops)`` (``flops`` None unless asked); the
  report's ``recompute`` and ``peak`` are computed as ``memory_report``'s.

  Example::

      report, flops = step_memory(
          lambda p, x: loss(yax.eval_mox(tree, p, x)), params, x, flops=True)
  """
  if not args:
    raise SignatureError(
        'step_memory(loss, *args): expected the arguments of loss (the '
        'params first), found none')
  params, rest = args[0], args[1:]
  p_leaves, p_tree = jax.tree_util.tree_flatten(params)

  def run(p_leaves, rest):
    return loss(jax.tree_util.tree_unflatten(p_tree, p_leaves), *rest)

  return _analyse(run, p_leaves, rest, flops=flops)


def _analyse(run, p_leaves, rest, *, flops: bool
             ) -> tuple[MemoryReport, int | None]:
  """The report of ``run(p_leaves, rest)``'s residuals with respect to
  ``p_leaves`` (``xla`` None) and, with ``flops``, the FLOPs of its
  forward and backward pass."""
  scopes = _Scopes()

  def vjp(p_leaves, rest):
    out, pullback = jax.vjp(lambda *p: run(list(p), rest), *p_leaves)
    if not flops:
      return out, pullback
    # The backward pass too, for its FLOPs: traced after the forward pass,
    # so the residuals are the same values.
    return out, pullback, pullback(jnp.ones_like(out))

  token = MODULE_SCOPE.set(scopes)
  try:
    closed, shapes = jax.make_jaxpr(vjp, return_shape=True)(p_leaves, rest)
  finally:
    MODULE_SCOPE.reset(token)
  calls = scopes.calls
  jaxpr = closed.jaxpr
  n_res = len(jax.tree_util.tree_leaves(shapes[1]))
  n_out = len(jax.tree_util.tree_leaves(shapes[0]))
  res = jaxpr.outvars[n_out:n_out + n_res]
  inputs = set(jaxpr.invars) | set(jaxpr.constvars)
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  by_path: dict[str, list] = {}
  types: dict[str, str] = {}
  for call in calls:  # every call, in order, even those keeping nothing
    by_path.setdefault(_path_text(call), [])
    types.setdefault(_path_text(call), call.type_name or '')
  outside: list = []
  excluded: list[str] = []
  seen = set()
  for v in res:
    if isinstance(v, jax.extend.core.Literal):
      excluded.append(v.aval.str_short(short_dtypes=True))
      continue
    if v in seen:
      continue
    seen.add(v)
    if v in inputs:
      excluded.append(v.aval.str_short(short_dtypes=True))
      continue
    scopes = _SCOPE_RE.findall(compat.name_stack_text(producer[v]))
    target = outside if not scopes else by_path[_path_text(
        calls[int(scopes[-1])])]
    target.append(v.aval)
  rows = tuple(MemoryRow(path, types[path], sum(map(nbytes, avals)),
                         tuple(a.str_short(short_dtypes=True) for a in avals))
               for path, avals in by_path.items())
  unattributed = sum(map(nbytes, outside))
  total = unattributed + sum(r.bytes for r in rows)
  # Arrays and ShapeDtypeStructs alike (fit_memory passes the latter).
  param_bytes = sum(nbytes(x) for x in p_leaves
                    if hasattr(x, 'dtype'))
  report = MemoryReport(
      rows=rows, unattributed=unattributed,
      unattributed_residuals=tuple(a.str_short(short_dtypes=True)
                                   for a in outside),
      total=total, excluded=tuple(excluded), param_bytes=param_bytes,
      training=4 * param_bytes + total,
      xla=None, recompute=_recompute(run, p_leaves, rest))
  return report, (jaxpr_flops(jaxpr) if flops else None)


def _recompute(run, p_leaves, rest) -> int:
  """``MemoryReport.recompute`` of ``run(p_leaves, rest)`` differentiated
  with respect to ``p_leaves``: its forward pass is traced, and each
  checkpoint equation measured (:func:`_transients`)."""
  closed = jax.make_jaxpr(run)(p_leaves, rest)
  n_params = len(jax.tree_util.tree_leaves(p_leaves))
  mask = [i < n_params for i in range(len(closed.jaxpr.invars))]
  return max(_transients(closed.jaxpr, mask)[0], default=0)


def _bodies(eqn, ins: list[bool]) -> list[tuple[Any, list[bool]]]:
  """The bodies of an equation (``jit``, ``scan``, ``while``, ``cond``,
  custom derivatives ...), each with which of its inputs depend on the
  params: an input of the equation passed straight to the body keeps its
  flag; a loop's carry, and any input not matched one to one, depends on
  the params when any input of the equation does (conservative)."""
  anyin = any(ins)
  out = []
  for value in eqn.params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      body = getattr(item, 'jaxpr', item)  # a ClosedJaxpr's open Jaxpr
      if not isinstance(body, jax.extend.core.Jaxpr):
        continue
      n = len(body.invars)
      name = eqn.primitive.name
      if name == 'scan':
        k = compat.scan_num_consts(eqn.params)
        mask = ins[:k] + [anyin] * (n - k)
      elif name == 'while':  # inputs: cond consts, body consts, carry
        cn, bn = eqn.params['cond_nconsts'], eqn.params['body_nconsts']
        consts = ins[:cn] if body is eqn.params['cond_jaxpr'].jaxpr \
            else ins[cn:cn + bn]
        mask = consts + [anyin] * (n - len(consts))
      elif n == len(ins):
        mask = list(ins)
      elif name == 'cond' and n == len(ins) - 1:
        mask = list(ins[1:])  # the branch index first
      else:
        mask = [anyin] * n
      out.append((body, mask))
  return out


def _transients(jaxpr, mask: list[bool]) -> tuple[list[int], list[bool]]:
  """The recompute transient (bytes) of each outermost checkpoint
  equation in ``jaxpr`` (in the bodies of other equations too), whose
  inputs flagged in ``mask`` depend on the params; and that flag for
  each output."""
  flags = dict(zip(jaxpr.invars, mask))

  def depends(v) -> bool:
    return not isinstance(v, jax.extend.core.Literal) and flags.get(v, False)

  found: list[int] = []
  for eqn in jaxpr.eqns:
    ins = [depends(v) for v in eqn.invars]
    if eqn.primitive.name in CHECKPOINT:
      found.append(_checkpoint_transient(eqn, ins))
    else:
      for body, body_mask in _bodies(eqn, ins):
        found.extend(_transients(body, body_mask)[0])
    for v in eqn.outvars:
      flags[v] = any(ins)
  return found, [depends(v) for v in jaxpr.outvars]


# Transients by (body text, flags, policy, prevent_cse): the layers of a
# stack, and the same call in the trees fit_memory measures, have equal
# bodies; the figure depends on their types only, which the text gives.
_TRANSIENTS: dict = {}


def _checkpoint_transient(eqn, ins: list[bool]) -> int:
  """What a checkpoint's body keeps while its backward pass runs, beyond
  what the checkpoint keeps: the residuals of the body differentiated
  without the checkpoint minus those with it (its policy), plus the
  largest transient of the checkpoints nested in the body."""
  avals = [v.aval for v in eqn.invars]
  diff = [d and jnp.issubdtype(a.dtype, jnp.inexact)
          for d, a in zip(ins, avals)]
  if not any(diff):  # no gradient flows through it: no backward pass
    return 0
  body = eqn.params['jaxpr']
  key = (str(body), tuple(diff), repr(eqn.params.get('policy')),
         eqn.params.get('prevent_cse', True))
  if key not in _TRANSIENTS:
    if len(_TRANSIENTS) > 256:
      _TRANSIENTS.clear()
    _TRANSIENTS[key] = _measure_transient(eqn, body, avals, diff)
  return _TRANSIENTS[key]


def _measure_transient(eqn, body, avals, diff: list[bool]) -> int:
  """:func:`_checkpoint_transient`, measured."""
  fun = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(body, []))
  kept = jax.checkpoint(fun, policy=eqn.params.get('policy'),
                        prevent_cse=eqn.params.get('prevent_cse', True))
  inner = max(_transients(body, diff)[0], default=0)
  return max(_residual_bytes(fun, avals, diff)
             - _residual_bytes(kept, avals, diff), 0) + inner


def _residual_bytes(fun, avals, diff: list[bool]) -> int:
  """Bytes of the residuals ``jax.vjp`` of ``fun`` keeps (each once;
  arguments, constants and literals excluded), differentiated with
  respect to the arguments flagged in ``diff`` (the others are held
  fixed)."""
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  primals = [s for s, d in zip(specs, diff) if d]
  fixed = [s for s, d in zip(specs, diff) if not d]

  def vjp(primals, fixed):
    def f(*p):
      ps, fs = iter(p), iter(fixed)
      return fun(*[next(ps) if d else next(fs) for d in diff])
    return jax.vjp(f, *primals)

  closed, shapes = jax.make_jaxpr(vjp, return_shape=True)(primals, fixed)
  jaxpr = closed.jaxpr
  n_out = len(jax.tree_util.tree_leaves(shapes[0]))
  inputs = set(jaxpr.invars) | set(jaxpr.constvars)
  seen = set()
  total = 0
  for v in jaxpr.outvars[n_out:]:
    if isinstance(v, jax.extend.core.Literal) or v in inputs or v in seen:
      continue
    seen.add(v)
    total += nbytes(v.aval)
  return total
