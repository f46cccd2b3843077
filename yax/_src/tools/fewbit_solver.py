"""The optimal step-function derivative of an activation, for ``yax.fewbit``.

A few-bit backward pass replaces ``f'(x)`` by a step function ``s(x)``
with ``K = 2**bits`` levels: borders ``b_1 < ... < b_{K-1}`` cut the real
line into ``K`` intervals and interval ``i`` has level ``l_i``. The forward
pass stores only the interval index of each input (``bits`` bits); the
backward pass multiplies the incoming gradient by ``l[code]``. Pre-
activations are roughly standard normal after a normalisation layer, so
the borders and levels minimise

    E[(f'(x) - s(x))**2],  x ~ N(0, 1).

For fixed borders the best level of an interval is the mean of ``f'`` over
it (weighted by the normal density), so only the borders are searched, on
a grid of cells 1/1024 wide over [-8, 8] (the outer cells hold the tails):

1. starting partitions: up to 4 bits, the optimum over borders on a
   coarser grid (every 1/64 within +-6), found globally by dynamic
   programming (``f'`` of GELU or SiLU is not monotone, so a local search
   from a guess can stop in a worse partition); the normal quantiles
   ``i / K``; and the high-resolution optimum, whose interval widths have
   density proportional to ``(phi * f''**2) ** (1/3)`` (at 8 bits the
   error has many local optima a few percent apart, and this start lands
   in the best one we found);
2. from each, Lloyd-style alternation (each border where it best splits
   its two fixed levels, then each level the mean of its interval) and
   then coordinate descent (each border to its best place between its
   neighbours, the two levels refitted) until nothing moves;
3. the best end wins.

Kinks of the piecewise-linear activations (0, +-1, +-3, 6) lie on the grid,
so their tables are exact at the bits their pieces need (ReLU at 1 bit,
ReLU6 at 2). This module is used offline: ``python -m yax._src.tools.fewbit_solver``
writes ``yax/_src/tools/fewbit_tables.py``, which ``yax.fewbit`` reads.
"""

from __future__ import annotations

import itertools
import math
import pathlib

import jax
import numpy as np

LO, HI = -8.0, 8.0
FINE_PER_UNIT = 1024  # cells per unit: f' sampled at their midpoints
# Candidate borders of the dynamic programme (up to 4 bits): every 1/64
# within +-6; past that the normal density is below 1e-8.
COARSE = 64
SPAN = 6.0


def _cells(fine_per_unit: int):
  """Edges of the fine cells and the normal mass and midpoint of each."""
  n = int((HI - LO) * fine_per_unit)
  edges = LO + np.arange(n + 1) / fine_per_unit
  cdf = np.array([0.5 * math.erfc(-e / math.sqrt(2)) for e in edges])
  cdf[0], cdf[-1] = 0.0, 1.0  # the outer cells hold the tails
  mids = (edges[:-1] + edges[1:]) / 2
  return edges, np.diff(cdf), mids


def derivative(fn, xs: np.ndarray) -> np.ndarray:
  """``f'`` at ``xs``, by JAX's own derivative of the activation."""
  grad = jax.vmap(jax.grad(lambda x: fn(x).astype(np.float32)))
  return np.asarray(grad(np.asarray(xs, np.float32)), np.float64)


class _Sums:
  """Prefix sums over the fine cells: the error of any interval in O(1)."""

  def __init__(self, weights, values):
    self.w = np.concatenate([[0.0], np.cumsum(weights)])
    self.wv = np.concatenate([[0.0], np.cumsum(weights * values)])
    self.wv2 = np.concatenate([[0.0], np.cumsum(weights * values ** 2)])

  def cost(self, i, j):
    """Weighted squared error of cells ``[i, j)`` around their mean."""
    w = self.w[j] - self.w[i]
    wv = self.wv[j] - self.wv[i]
    wv2 = self.wv2[j] - self.wv2[i]
    with np.errstate(divide='ignore', invalid='ignore'):
      return np.where(w > 0, wv2 - wv ** 2 / np.where(w > 0, w, 1), 0.0)

  def mean(self, i, j):
    w = self.w[j] - self.w[i]
    return (self.wv[j] - self.wv[i]) / w if w > 0 else 0.0


def _partition(sums: _Sums, cuts: np.ndarray, k: int) -> list[int]:
  """Optimal ``k`` intervals whose borders are among ``cuts`` (indices of
  fine edges, first and last the ends): dynamic programming."""
  m = len(cuts)
  cost = sums.cost(cuts[:, None], cuts[None, :])  # [from, to]
  cost = np.where(np.arange(m)[:, None] < np.arange(m)[None, :], cost,
                  np.inf)
  best = np.full(m, np.inf)
  best[0] = 0.0
  back = np.zeros((k + 1, m), dtype=np.int64)
  layers = [best]
  for level in range(1, k + 1):
    total = layers[-1][:, None] + cost
    back[level] = np.argmin(total, axis=0)
    layers.append(total[back[level], np.arange(m)])
  bounds, j = [m - 1], m - 1
  for level in range(k, 0, -1):
    j = back[level][j]
    bounds.append(j)
  return [int(cuts[b]) for b in reversed(bounds)]


def _descend(sums: _Sums, bounds: list[int]) -> list[int]:
  """Moves each inner border to the best place between its neighbours
  (the levels of its two intervals kept optimal) until a sweep moves
  nothing: a local optimum of the continuous problem on the cells."""
  bounds = list(bounds)
  for _ in range(5000):
    moved = False
    for t in range(1, len(bounds) - 1):
      options = np.arange(bounds[t - 1] + 1, bounds[t + 1])
      if len(options) < 2:
        continue
      errors = sums.cost(bounds[t - 1], options) + sums.cost(
          options, bounds[t + 1])
      pick = int(options[np.argmin(errors)])
      here = errors[bounds[t] - options[0]]
      if pick != bounds[t] and errors.min() < here - 1e-18:
        bounds[t] = pick
        moved = True
    if not moved:
      break
  return bounds


def _alternate(sums: _Sums, bounds: list[int]) -> list[int]:
  """Lloyd-style alternation: with the levels fixed, each border moves to
  where it best splits its two levels; then the levels become the means
  again. It escapes optima where the descent stops (moving one border
  with re-fitted levels cannot move a run of borders together)."""
  bounds = list(bounds)
  for _ in range(5000):
    levels = [sums.mean(a, b) for a, b in itertools.pairwise(bounds)]
    old = list(bounds)
    for t in range(1, len(bounds) - 1):
      a, b = bounds[t - 1], bounds[t + 1]
      if b - a < 2:
        continue
      left, right = levels[t - 1], levels[t]
      options = np.arange(a + 1, b)
      # Error change of giving cells [a, p) to the left level.
      w = sums.w[options] - sums.w[a]
      wv = sums.wv[options] - sums.wv[a]
      gain = (right - left) * (2 * wv - (left + right) * w)
      bounds[t] = int(options[np.argmin(gain)])
    if bounds == old:
      break
  return bounds


def _error(sums: _Sums, bounds) -> float:
  return sum(float(sums.cost(a, b)) for a, b in itertools.pairwise(bounds))


def _quantile_start(edges, k: int) -> list[int]:
  """Borders at the normal quantiles i/k, on the cells."""
  qs = [math.sqrt(2) * _erfinv(2 * i / k - 1) for i in range(1, k)]
  at = np.searchsorted(edges, qs)
  at = np.maximum.accumulate(np.clip(at, 1, len(edges) - 2))
  at = at + np.arange(len(at))  # strictly increasing
  return [0, *[int(a) for a in at], len(edges) - 1]


def _companding_start(edges, weights, values, k: int) -> list[int]:
  """Borders of the high-resolution optimum: interval widths spread with
  density proportional to ``(phi * f''**2) ** (1/3)`` (the error of a
  short interval of width ``h`` is ``phi f''^2 h^3 / 12``)."""
  h = np.diff(edges)
  curvature = np.gradient(values, (edges[:-1] + edges[1:]) / 2)
  density = np.cbrt(weights / h * curvature ** 2) * h + 1e-12 * h
  cum = np.cumsum(density)
  at = np.searchsorted(cum, cum[-1] * np.arange(1, k) / k) + 1
  at = np.maximum.accumulate(np.clip(at, 1, len(edges) - 2))
  at = np.maximum(at, np.arange(1, k))  # strictly increasing
  for i in range(1, len(at)):
    at[i] = max(at[i], at[i - 1] + 1)
  return [0, *[int(a) for a in at], len(edges) - 1]


def _erfinv(y: float) -> float:
  """Inverse error function by bisection (no SciPy at runtime)."""
  lo, hi = -6.0, 6.0
  for _ in range(80):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
  return (lo + hi) / 2


def solve(fn, bits: int):
  """``(borders, levels, rmse)`` of the optimal ``2**bits``-level step
  function for ``f'`` of ``fn``; ``rmse = sqrt(E[(f' - s)^2])``."""
  k = 2 ** bits
  edges, weights, mids = _cells(FINE_PER_UNIT)
  values = derivative(fn, mids)
  sums = _Sums(weights, values)
  stride = FINE_PER_UNIT // COARSE
  inner = np.arange(0, len(weights) + 1, stride)
  inner = inner[np.abs(edges[inner]) < SPAN]
  cuts = np.concatenate([[0], inner, [len(weights)]])
  # Alternation then descent, from the grid optimum (up to 4 bits), the
  # normal quantiles and the high-resolution optimum (at 8 bits the error
  # has many local optima a few percent apart, and this start lands in
  # the best we found): the best local optimum wins.
  starts = [_quantile_start(edges, k),
            _companding_start(edges, weights, values, k)]
  if bits <= 4:
    starts.append(_partition(sums, cuts, k))
  bounds = min((_descend(sums, _alternate(sums, b)) for b in starts),
               key=lambda b: _error(sums, b))
  levels = [sums.mean(a, b) for a, b in itertools.pairwise(bounds)]
  error = _error(sums, bounds)
  borders = [float(edges[b]) for b in bounds[1:-1]]
  return borders, levels, math.sqrt(max(error, 0.0))


def write_tables(path: pathlib.Path | None = None) -> pathlib.Path:
  """Solves every (activation, bits) and writes the table module."""
  from yax._src.tools.fewbit import ACTIVATIONS, BITS
  path = path or pathlib.Path(__file__).with_name('fewbit_tables.py')
  lines = [
      '"""Step-function derivatives for ``yax.fewbit``, one per (activation,',
      'bits). Generated by ``python -m yax._src.tools.fewbit_solver``; do not edit.',
      '',
      'TABLES[name][bits] = (borders, levels, rmse): ``2**bits - 1`` borders,',
      '``2**bits`` levels, and ``sqrt(E[(f\'(x) - s(x))**2])`` for x ~ N(0, 1).',
      '"""',
      '',
      '# fmt: off',
      'TABLES = {',
  ]
  for name, fn in ACTIVATIONS.items():
    lines.append(f'    {name!r}: {{')
    for bits in BITS:
      borders, levels, rmse = solve(fn, bits)
      lines.append(f'        {bits}: (')
      lines.append(f'            {_floats(borders)},')
      lines.append(f'            {_floats(levels)},')
      lines.append(f'            {rmse!r}),')
    lines.append('    },')
  lines.append('}')
  path.write_text('\n'.join(lines) + '\n')
  return path


def _floats(values) -> str:
  return '(' + ', '.join(repr(float(v)) for v in values) + \
      (',)' if len(values) == 1 else ')')


if __name__ == '__main__':
  print(write_tables())
