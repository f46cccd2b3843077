"""FLOP counts of equations, from a per-primitive rule table.

:data:`FLOP_RULES` maps a primitive name to a rule
``rule(in_avals, out_avals, params) -> int``. The conventions follow XLA's
HLO cost analysis (what ``jax.jit(f).lower(...).cost_analysis()`` and
``nn.tabulate(..., compute_flops=True)`` report), so the figures can be
compared:

* ``dot_general``: ``2 * M * N * K`` (a multiply-accumulate is two FLOPs);
  ``conv_general_dilated``: two per multiply-accumulate that reads a real
  input element (taps on padding or on the holes of an input dilation are
  not counted, as in XLA), so the count equals XLA's at any padding,
  stride and dilation.
* element-wise arithmetic, comparisons, ``select_n`` and
  ``convert_element_type``: one per output element (``integer_pow`` as many
  as the multiplications of square-and-multiply, ``logistic`` four).
* transcendental functions (``exp``, ``log``, ``tanh``, ``rsqrt``, ``erf``,
  ...): one per output element. XLA counts these separately as
  ``transcendentals`` and not in ``flops``; compare with the sum of both.
* reductions: one per combined pair, ``input size - output size``;
  cumulative ones (``cumsum``, ...) one per element.
* data movement (``reshape``, ``broadcast_in_dim``, ``transpose``, slices,
  gathers, ``concatenate``, ``iota``, ...): zero.
* higher-order primitives: ``jit``, ``custom_jvp_call``, ``custom_vjp_call``,
  ``remat`` and other call-like primitives sum their bodies; ``scan`` counts
  its body ``length`` times, ``cond`` its costliest branch, ``while`` its
  condition and body once (the trip count is not known statically).
* ``top_k``: one comparison per operand element (XLA reports no cost).

**Unknown primitives** (not in the table): the default rule sums the FLOPs
of the Jaxprs found in the equation's params (so new call-like primitives
are still counted through their bodies) and counts zero otherwise;
:func:`uncounted_primitives` lists such primitives so that a summary can say
which work is missing. Add a rule with ``FLOP_RULES['my_prim'] = rule``.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, Sequence

from jax.extend import core as jex

FlopRule = Callable[[Sequence, Sequence, dict], int]


def _size(aval) -> int:
  shape = getattr(aval, 'shape', None)
  return int(math.prod(shape)) if shape is not None else 0


def sub_jaxprs(params: dict) -> Iterator[jex.Jaxpr]:
  """The Jaxprs held by an equation's params (bodies, branches)."""
  for value in params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      if isinstance(item, jex.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jex.Jaxpr):
        yield item


def _per_element(k: int = 1) -> FlopRule:
  def rule(ins, outs, params):
    return k * sum(_size(a) for a in outs)
  return rule


def _zero(ins, outs, params) -> int:
  return 0


def _dot_general(ins, outs, params) -> int:
  (lhs_contract, _), _ = params['dimension_numbers']
  k = math.prod(ins[0].shape[d] for d in lhs_contract)
  return 2 * _size(outs[0]) * k


def _valid_positions(size_in: int, size_k: int, size_out: int, stride: int,
                     pad_lo: int, lhs_dil: int, rhs_dil: int) -> int:
  """Pairs (output position, kernel position) along one spatial dimension
  whose input position is a real input element: not padding, not a hole
  of the input (base) dilation. XLA's cost analysis counts a convolution's
  multiply-accumulates over exactly these pairs.

  Output ``o`` and kernel tap ``k`` read the dilated input at
  ``u = o * stride - pad_lo + k * rhs_dil``, a real element when
  ``u % lhs_dil == 0`` and ``0 <= u // lhs_dil < size_in``. For each ``k``
  the valid ``o`` form an arithmetic progression, counted in O(1).
  """
  stride, lhs_dil = max(int(stride), 1), max(int(lhs_dil), 1)
  last = (size_in - 1) * lhs_dil  # the last real element, dilated
  total = 0
  for k in range(size_k):
    c = k * rhs_dil - pad_lo  # u = o * stride + c
    lo = max(0, _ceil_div(-c, stride))
    hi = min(size_out - 1, (last - c) // stride)
    if lo > hi:
      continue
    if lhs_dil == 1:
      total += hi - lo + 1
      continue
    # o * stride + c = 0 (mod lhs_dil)
    g = math.gcd(stride, lhs_dil)
    if c % g:
      continue
    m = lhs_dil // g
    o0 = (-c // g) * pow(stride // g, -1, m) % m if m > 1 else 0
    first = lo + (o0 - lo) % m
    if first <= hi:
      total += (hi - first) // m + 1
  return total


def _ceil_div(a: int, b: int) -> int:
  return -((-a) // b)


def _conv(ins, outs, params) -> int:
  """Two FLOPs per multiply-accumulate with a real input element, as XLA's
  cost analysis counts them: taps that fall on padding or between the
  elements of a dilated input are not counted (SAME padding, strides and
  dilation all change the count)."""
  lhs, rhs, out = ins[0].shape, ins[1].shape, outs[0].shape
  dn = params['dimension_numbers']
  lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  n_spatial = len(lhs_spec) - 2
  strides = params.get('window_strides') or (1,) * n_spatial
  padding = params.get('padding') or ((0, 0),) * n_spatial
  lhs_dil = params.get('lhs_dilation') or (1,) * n_spatial
  rhs_dil = params.get('rhs_dilation') or (1,) * n_spatial
  valid = 1
  for i in range(n_spatial):
    valid *= _valid_positions(
        lhs[lhs_spec[2 + i]], rhs[rhs_spec[2 + i]], out[out_spec[2 + i]],
        strides[i], padding[i][0], lhs_dil[i], rhs_dil[i])
  groups = max(int(params.get('feature_group_count', 1) or 1), 1)
  batch_groups = max(int(params.get('batch_group_count', 1) or 1), 1)
  in_features = lhs[lhs_spec[1]] // groups
  batch = lhs[lhs_spec[0]] // batch_groups
  return 2 * batch * in_features * out[out_spec[1]] * valid


def _reduce(ins, outs, params) -> int:
  return max(_size(ins[0]) - _size(outs[0]), 0)


def _integer_pow(ins, outs, params) -> int:
  y = abs(int(params.get('y', 2)))
  if y <= 1:
    mults = 0
  else:  # square-and-multiply
    mults = y.bit_length() - 1 + bin(y).count('1') - 1
  if int(params.get('y', 2)) < 0:
    mults += 1  # the reciprocal
  return mults * _size(outs[0])


def _bodies(params: dict) -> list[int]:
  return [jaxpr_flops(j) for j in sub_jaxprs(params)]


def _sum_bodies(ins, outs, params) -> int:
  return sum(_bodies(params))


def _scan(ins, outs, params) -> int:
  return int(params.get('length', 1)) * sum(_bodies(params))


def _cond(ins, outs, params) -> int:
  return max(_bodies(params), default=0)


_ELEMENTWISE = (
    'add', 'sub', 'mul', 'div', 'rem', 'max', 'min', 'neg', 'abs', 'sign',
    'floor', 'ceil', 'round', 'square', 'reciprocal', 'eq', 'ne', 'lt', 'le',
    'gt', 'ge', 'and', 'or', 'xor', 'not', 'select_n', 'convert_element_type',
    'clamp', 'is_finite', 'shift_left', 'shift_right_logical',
    'shift_right_arithmetic', 'population_count', 'real', 'imag', 'conj',
    'add_any', 'nextafter', 'copysign', 'reduce_precision',
)
_TRANSCENDENTAL = (
    'exp', 'exp2', 'log', 'log1p', 'expm1', 'tanh', 'sin', 'cos', 'tan',
    'asin', 'acos', 'atan', 'atan2', 'sinh', 'cosh', 'asinh', 'acosh',
    'atanh', 'sqrt', 'rsqrt', 'cbrt', 'pow', 'erf', 'erfc', 'erf_inv',
    'lgamma', 'digamma', 'igamma', 'igammac', 'bessel_i0e', 'bessel_i1e',
)
_REDUCTIONS = (
    'reduce_sum', 'reduce_max', 'reduce_min', 'reduce_prod', 'reduce_and',
    'reduce_or', 'reduce_xor', 'argmax', 'argmin',
)
_CUMULATIVE = ('cumsum', 'cumprod', 'cummax', 'cummin', 'cumlogsumexp')
_DATA_MOVEMENT = (
    'reshape', 'broadcast_in_dim', 'transpose', 'squeeze', 'expand_dims',
    'slice', 'dynamic_slice', 'dynamic_update_slice', 'gather', 'concatenate',
    'pad', 'iota', 'copy', 'copy_p', 'rev', 'stop_gradient', 'device_put',
    'sharding_constraint', 'bitcast_convert_type', 'split', 'sort',
    'random_seed', 'random_wrap', 'random_unwrap', 'random_bits',
    'random_fold_in', 'random_split', 'threefry2x32', 'optimization_barrier',
    'pvary', 'mesh_cast', 'reshard', 'module_marker',
)
_CALLS = ('jit', 'pjit', 'closed_call', 'core_call', 'custom_jvp_call',
          'custom_vjp_call', 'custom_vjp_call_jaxpr', 'remat', 'checkpoint',
          'remat2', 'custom_lin', 'shard_map', 'xla_call', 'named_call')

FLOP_RULES: dict[str, FlopRule] = {
    **{p: _per_element(1) for p in _ELEMENTWISE},
    **{p: _per_element(1) for p in _TRANSCENDENTAL},
    **{p: _reduce for p in _REDUCTIONS},
    **{p: _per_element(1) for p in _CUMULATIVE},
    **{p: _zero for p in _DATA_MOVEMENT},
    **{p: _sum_bodies for p in _CALLS},
    'dot_general': _dot_general,
    'conv_general_dilated': _conv,
    'integer_pow': _integer_pow,
    'logistic': _per_element(4),  # 1 / (1 + exp(-x)): neg, exp, add, div
    'scatter-add': lambda ins, outs, params: _size(ins[2]),  # one per update
    'scatter': _zero,
    # top_k: one comparison per operand element (XLA's cost analysis gives
    # none: -1 for its custom call).
    'top_k': lambda ins, outs, params: _size(ins[0]),
    'scan': _scan,
    'cond': _cond,
    'while': _sum_bodies,
}


def default_rule(ins, outs, params) -> int:
  """The rule for primitives missing from :data:`FLOP_RULES`: the FLOPs of
  the Jaxprs among the params, zero if there are none."""
  return sum(_bodies(params))


def equation_flops(prim: str, in_avals, out_avals, params: dict) -> int:
  """FLOPs of one equation by :data:`FLOP_RULES` (see the module doc)."""
  return int(FLOP_RULES.get(prim, default_rule)(in_avals, out_avals, params))


def jaxpr_flops(jaxpr: jex.Jaxpr) -> int:
  return sum(
      equation_flops(e.primitive.name, [v.aval for v in e.invars],
                     [v.aval for v in e.outvars], e.params)
      for e in jaxpr.eqns)


def _jaxpr_unknown(jaxpr: jex.Jaxpr, out: set[str]):
  for e in jaxpr.eqns:
    if e.primitive.name not in FLOP_RULES:
      out.add(e.primitive.name)
    for sub in sub_jaxprs(e.params):
      _jaxpr_unknown(sub, out)


def uncounted_primitives(equations: Iterable) -> set[str]:
  """Names of primitives among ``equations`` (YAX ``Equation`` s, searched
  through their bodies) that :data:`FLOP_RULES` does not know."""
  out: set[str] = set()
  for e in equations:
    if e.prim.name not in FLOP_RULES:
      out.add(e.prim.name)
    for sub in sub_jaxprs(e.params):
      _jaxpr_unknown(sub, out)
  return out
