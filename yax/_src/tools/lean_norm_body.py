"""Reading a module call's body as a LayerNorm or RMSNorm, by data flow.

Libraries write their own norm classes (MaxText's ``RMSNorm``, Gemma's
with ``x * (1 + scale)``, Tunix's ``w * x / sqrt(mean(x**2) + eps)``,
Hugging Face's ``FlaxT5LayerNorm`` ...), so ``yax.lean_norm`` does not
trust class names: :func:`read_norm` evaluates the body's equations on
symbols instead of numbers and says whether the output is

``y = (x - [mean(x)]) * rsqrt(var + eps) * (scale + offset) + bias``

with ``var`` the mean of squares (RMSNorm) or of the centred input
(LayerNorm, in either form: ``E[(x - E[x])^2]`` and ``E[x^2] - E[x]^2``
are the same polynomial), every mean over the last axis, ``scale`` and
``bias`` optional variables of the call of shape ``(features,)``.

Each value is a polynomial (a dict from monomial to coefficient) in the
atoms ``x`` (the input), ``('var', i)`` (the call's variable ``i``),
``('mean', m)`` (the mean over the features of monomial ``m``: a per-row
statistic) and ``('poly', p)`` (a polynomial that is not one term, raised
to a power: ``rsqrt(var + eps)``), with a *layout* that names, for each
array axis, the axis of ``x`` it runs along (None: the value is constant
along it). Casts, reshapes that add or drop unit axes, broadcasts,
transposes and ``dot_general`` without contraction (an ``einsum`` such as
``'...k,k->...k'``) keep the polynomial; ``add``, ``sub``, ``mul``,
``div``, ``square``, ``integer_pow``, ``pow``, ``sqrt``, ``rsqrt`` compute
it; ``reduce_sum`` over the feature axis makes per-row means;
``max(v, 0)`` (Flax's clamp of the fast variance) is ``v``. Anything else
makes the value unknown, and the body is then refused with what was found.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np

from yax._src.ir.nodes import Equation, Literal, Mox
from yax._src.trace.make import opened

_SAME = ('convert_element_type', 'copy', 'copy_p', 'reduce_precision',
         'sharding_constraint', 'device_put', 'optimization_barrier')
_CALLS = ('jit', 'pjit', 'closed_call', 'core_call')


@dataclasses.dataclass(frozen=True)
class BodyNorm:
  """A norm read from a body: what ``lean_function`` needs, and which of
  the call's variables (by index) hold the scale and bias."""
  rms: bool
  eps: float
  offset: float
  scale: int | None
  bias: int | None
  x: int  # the input's position among the call's arguments


class _Unknown(Exception):
  """A value the body computes that is not a polynomial of the input."""


def _key(atom):
  return repr(atom)


def _mono(factors: dict) -> tuple:
  """A canonical monomial from ``{atom: exponent}`` (zero powers out)."""
  return tuple(sorted(((a, Fraction(e)) for a, e in factors.items()
                       if e != 0), key=lambda t: _key(t[0])))


def _add(p: dict, q: dict, sign: float = 1.0) -> dict:
  out = dict(p)
  for m, c in q.items():
    out[m] = out.get(m, 0.0) + sign * c
  return {m: c for m, c in out.items() if c != 0.0}


def _mul(p: dict, q: dict) -> dict:
  out: dict = {}
  for m1, c1 in p.items():
    for m2, c2 in q.items():
      factors = dict(m1)
      for a, e in m2:
        factors[a] = factors.get(a, 0) + e
      m = _mono(factors)
      out[m] = out.get(m, 0.0) + c1 * c2
  return {m: c for m, c in out.items() if c != 0.0}


def _frozen(p: dict) -> tuple:
  """A polynomial as an atom's key: coefficients to float32's digits."""
  return tuple(sorted(((m, float(f'{c:.7g}')) for m, c in p.items()),
                      key=repr))


def _power(p: dict, e: Fraction) -> dict:
  if len(p) == 1:
    ((m, c),) = p.items()
    if c < 0 and e.denominator != 1:
      raise _Unknown('a fractional power of a negative value')
    return {_mono({a: k * e for a, k in m}): float(c) ** float(e)}
  if e.denominator == 1 and 0 < e <= 4:
    out = {(): 1.0}
    for _ in range(int(e)):
      out = _mul(out, p)
    return out
  return {_mono({('poly', _frozen(p)): e}): 1.0}


def _full(atom) -> bool:
  """Whether an atom varies along the features (the input, a variable,
  or a power of a polynomial that holds one)."""
  if atom == 'x' or atom[0] == 'var':
    return True
  if atom[0] == 'poly':
    return any(_full(a) for m, _ in atom[1] for a, _ in m)
  return False


def _feature_mean(p: dict) -> dict:
  """The mean over the features of ``p``: per-row factors come out, the
  rest becomes a ``('mean', monomial)`` atom."""
  out: dict = {}
  for m, c in p.items():
    row = {a: e for a, e in m if not _full(a)}
    full = _mono({a: e for a, e in m if _full(a)})
    if full:
      row[('mean', full)] = row.get(('mean', full), 0) + 1
    k = _mono(row)
    out[k] = out.get(k, 0.0) + c
  return {m: c for m, c in out.items() if c != 0.0}


def _nonnegative(p: dict) -> bool:
  """Whether ``p`` is a mean of squares or the variance ``E[x^2] -
  E[x]^2``: never negative, so ``max(p, 0)`` is ``p`` (a ReLU of the input
  is not)."""
  mean = {_mono({('mean', _mono({'x': 1})): 1}): 1.0}
  squares = {_mono({('mean', _mono({'x': 2})): 1}): 1.0}
  return p in (squares, _add(squares, _mul(mean, mean), -1.0))


def _merge(a: tuple, b: tuple) -> tuple:
  """The layout of an element-wise result of values laid out ``a``, ``b``."""
  if not a:
    return b
  if not b:
    return a
  if len(a) != len(b):
    raise _Unknown('operands of different ranks')
  out = []
  for i, j in zip(a, b):
    if i is not None and j is not None and i != j:
      raise _Unknown('operands laid out along different axes')
    out.append(i if i is not None else j)
  return tuple(out)


def _checked(layout: tuple) -> tuple:
  named = [i for i in layout if i is not None]
  if len(named) != len(set(named)):
    raise _Unknown('an outer product of an axis with itself')
  return layout


def _shape(symbol) -> tuple:
  return tuple(getattr(symbol.aval, 'shape', ()))


class _Reader:
  """Evaluates a body on polynomials; ``env`` maps symbols to
  ``(polynomial, layout)``."""

  def __init__(self, ndim: int, features: int):
    self.ndim = ndim
    self.features = features
    self.first_unknown: str | None = None

  def value(self, env, symbol):
    if isinstance(symbol, Literal):
      if _shape(symbol):
        raise _Unknown('an array literal')
      v = float(np.asarray(symbol.value))
      return ({(): v} if v != 0.0 else {}), ()
    if symbol not in env:
      raise _Unknown('a value from outside the call')
    return env[symbol]

  def run(self, children, env):
    for k, eqn in enumerate(children):
      if isinstance(eqn, Mox):
        raise _Unknown(f'it calls the module {eqn.type_name}')
      try:
        outs = self.equation(eqn, env)
      except _Unknown as why:
        # A value of no concern (a constant) may be unknown; the output
        # decides. Remember the first place the input's flow was lost.
        if self.first_unknown is None and any(
            not isinstance(s, Literal) and s in env and env[s][0] and
            any(m for m in env[s][0]) for s in eqn.inputs):
          self.first_unknown = f'{eqn.prim.name} (equation {k}): {why}'
        for s in eqn.outputs:
          env.pop(s, None)
        continue
      for s, v in zip(eqn.outputs, outs, strict=True):
        env[s] = v

  def equation(self, eqn: Equation, env) -> list:
    name = eqn.prim.name
    p = eqn.params
    if name in _CALLS:
      holder = opened(eqn)
      if holder is None or len(holder.children) != 1:
        raise _Unknown('a call without one body')
      body = holder.children[0]
      inner = {s: self.value(env, v)
               for s, v in zip(body.inputs, eqn.inputs)}
      self.run(body.children, inner)
      return [self.value(inner, s) for s in body.outputs]
    if eqn.children:
      raise _Unknown('an equation with bodies')
    args = [self.value(env, s) for s in eqn.inputs]
    if name in _SAME:
      return args[:len(eqn.outputs)]
    if len(eqn.outputs) != 1:
      raise _Unknown('several outputs')
    if name in ('add', 'sub', 'mul', 'div', 'max', 'pow'):
      (a, la), (b, lb) = args
      layout = _checked(_merge(la, lb))
      if name == 'add':
        return [(_add(a, b), layout)]
      if name == 'sub':
        return [(_add(a, b, -1.0), layout)]
      if name == 'mul':
        return [(_mul(a, b), layout)]
      if name == 'div':
        return [(_mul(a, _power(b, Fraction(-1))), layout)]
      if name == 'max':  # the clamp max(var, 0) of Flax's fast variance
        if b == {} and _nonnegative(a):
          return [(a, layout)]
        if a == {} and _nonnegative(b):
          return [(b, layout)]
        raise _Unknown('a maximum other than max(variance, 0)')
      if list(b) not in ([()], []):
        raise _Unknown('a power with an exponent that is not a constant')
      exponent = Fraction(b.get((), 0.0)).limit_denominator(8)
      return [(_power(a, exponent), la)]
    (a, la), = args[:1]
    if name == 'neg':
      return [({m: -c for m, c in a.items()}, la)]
    if name == 'square':
      return [(_mul(a, a), la)]
    if name == 'integer_pow':
      return [(_power(a, Fraction(p['y'])), la)]
    if name == 'sqrt':
      return [(_power(a, Fraction(1, 2)), la)]
    if name == 'rsqrt':
      return [(_power(a, Fraction(-1, 2)), la)]
    if name == 'reduce_sum':
      return [self.reduce(a, la, eqn)]
    if name == 'broadcast_in_dim':
      dims = p['broadcast_dimensions']
      shape, old = p['shape'], _shape(eqn.inputs[0])
      layout = [None] * len(shape)
      for k, d in enumerate(dims):
        layout[d] = la[k] if old[k] == shape[d] else None
      return [(a, tuple(layout))]
    if name in ('reshape', 'squeeze'):
      return [(a, self.reshape(la, _shape(eqn.inputs[0]),
                               _shape(eqn.outputs[0])))]
    if name == 'transpose':
      return [(a, tuple(la[k] for k in p['permutation']))]
    if name == 'dot_general':
      ((lc, rc), (lb, rb)) = p['dimension_numbers']
      if lc or rc:
        raise _Unknown('a contraction')
      (b, lbl) = args[1]
      batch = [_merge((la[i],), (lbl[j],))[0] for i, j in zip(lb, rb)]
      free_l = [la[i] for i in range(len(la)) if i not in lb]
      free_r = [lbl[j] for j in range(len(lbl)) if j not in rb]
      return [(_mul(a, b), _checked(tuple(batch + free_l + free_r)))]
    raise _Unknown(f'the primitive {name}')

  def reduce(self, a, layout, eqn):
    axes = tuple(eqn.params['axes'])
    shape = _shape(eqn.inputs[0])
    out, feature = dict(a), False
    for ax in axes:
      if layout[ax] == self.ndim - 1:
        feature = True
      elif layout[ax] is None:  # constant along it: times its size
        out = {m: c * shape[ax] for m, c in out.items()}
      else:
        raise _Unknown(f'a sum over axis {layout[ax]} of the input, not '
                       'the last')
    if feature:
      out = {m: c * self.features for m, c in _feature_mean(out).items()}
    return out, tuple(l for k, l in enumerate(layout) if k not in axes)

  @staticmethod
  def reshape(layout, old, new):
    kept = [(n, l) for n, l in zip(old, layout) if n != 1]
    if [n for n, _ in kept] != [n for n in new if n != 1]:
      raise _Unknown('a reshape that merges or splits axes')
    labels = iter(l for _, l in kept)
    return tuple(next(labels) if n != 1 else None for n in new)


def _close(p: dict, q: dict) -> bool:
  keys = set(p) | set(q)
  scale = max([abs(c) for c in list(p.values()) + list(q.values())] + [1.0])
  return all(abs(p.get(k, 0.0) - q.get(k, 0.0)) <= 1e-5 * scale
             for k in keys)


def _match(y: dict, num_vars: int, x_index: int) -> BodyNorm | None:
  """The norm whose polynomial is ``y``, or None."""
  x = {_mono({'x': 1}): 1.0}
  mean = {_mono({('mean', _mono({'x': 1})): 1}): 1.0}
  squares = {_mono({('mean', _mono({'x': 2})): 1}): 1.0}
  powers = {a[1] for m in y for a, e in m
            if a[0] == 'poly' and e == Fraction(-1, 2)}
  for frozen in powers:
    var_eps = {m: c for m, c in frozen}
    for rms, var in ((True, squares), (False, _add(squares,
                                                   _mul(mean, mean), -1))):
      rest = _add(var_eps, var, -1.0)
      if list(rest) != [()] or rest[()] <= 0:
        continue
      eps = rest[()]
      rstd = {_mono({('poly', frozen): Fraction(-1, 2)}): 1.0}
      xhat = _mul(x if rms else _add(x, mean, -1.0), rstd)
      offset = y.get(_mono({'x': 1, ('poly', frozen): Fraction(-1, 2)}),
                     0.0)
      for scale in [None, *range(num_vars)]:
        for bias in [None, *range(num_vars)]:
          if bias is not None and bias == scale:
            continue
          used = {scale, bias} - {None}
          if len(used) != num_vars:
            continue
          want = xhat
          if scale is not None:
            s = {_mono({('var', scale): 1}): 1.0}
            want = _mul(xhat, _add(s, {(): offset} if offset else {}))
          if bias is not None:
            want = _add(want, {_mono({('var', bias): 1}): 1.0})
          if _close(y, want):
            return BodyNorm(rms, float(eps),
                            float(offset) if scale is not None else 0.0,
                            scale, bias, x_index)
  return None


EXPECTED = ('(x - [mean(x)]) * rsqrt(mean of squares + eps) * '
            '[scale (+ constant)] [+ bias] over the last axis')


def read_norm(node: Mox) -> BodyNorm | str:
  """The norm ``node``'s body computes of its one argument, or why it is
  not one (a sentence for an error message)."""
  traced = [k for k, s in enumerate(node.arg_inputs)
            if not isinstance(s, Literal)]
  if len(traced) != 1 or len(node.outputs) != 1:
    return (f'it takes {len(traced)} traced arguments and returns '
            f'{len(node.outputs)} values, expected one of each')
  x = node.arg_inputs[traced[0]]
  shape = _shape(x)
  if not shape:
    return 'its argument is not a traced array with a feature axis'
  features = shape[-1]
  shapes = [_shape(s) for s in node.var_inputs]
  if any(s != (features,) for s in shapes):
    return (f'its variables have the shapes {shapes}, expected '
            f'({features},) each: a norm reads a scale and a bias per '
            'feature')
  env = {x: ({_mono({'x': 1}): 1.0}, tuple(range(len(shape))))}
  for k, s in enumerate(node.var_inputs):
    env[s] = ({_mono({('var', k): 1}): 1.0}, (len(shape) - 1,))
  reader = _Reader(len(shape), features)
  try:
    reader.run(node.children, env)
    y, layout = reader.value(env, node.outputs[0])
  except _Unknown as why:
    lost = reader.first_unknown or str(why)
    return (f'its body does not compute a norm: expected {EXPECTED}, '
            f'found {lost}')
  if layout != tuple(range(len(shape))) or _shape(node.outputs[0]) != shape:
    return (f'its output is not laid out as its input {shape} (found '
            f'{_shape(node.outputs[0])})')
  norm = _match(y, node.num_vars, traced[0])
  if norm is None:
    lost = (f' (first value not followed: {reader.first_unknown})'
            if reader.first_unknown else '')
    return (f'its body does not compute a norm: expected {EXPECTED}, '
            f'found another function of its input{lost}')
  return norm
