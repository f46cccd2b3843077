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
it (weighted by the normal density), so only the borders are searched:

1. dynamic programming over a coarse grid of candidate borders (every
   multiple of 1/64 in (-6, 6); 1/128 at 8 bits) finds the optimal
   partition on that grid,
   globally (``f'`` of GELU or SiLU is not monotone, so a local search from
   a guess can stop in a worse partition);
2. coordinate descent then moves each border over the grid of cells
   (1/1024) near its place, each move keeping the levels optimal, until no move
   lowers the error.

Kinks of the piecewise-linear activations (0, +-1, +-3, 6) lie on the grid,
so their tables are exact at the bits their pieces need (ReLU at 1 bit,
ReLU6 at 2). This module is used offline: ``python -m yax._fewbit_solver``
writes ``yax/_fewbit_tables.py``, which ``yax.fewbit`` reads.
"""

from __future__ import annotations

import math
import pathlib

import jax
import numpy as np

LO, HI = -8.0, 8.0
FINE_PER_UNIT = 1024  # cells per unit: f' sampled at their midpoints
# Candidate borders of the dynamic programme: every 1/64 (1/128 at 8 bits,
# where the central intervals are narrower than 1/64) within +-6; past
# that the normal density is below 1e-8.
COARSE = {1: 64, 2: 64, 3: 64, 4: 64, 8: 128}
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


def _descend(sums: _Sums, bounds: list[int], reach: int) -> list[int]:
  """Moves each inner border within ``reach`` fine cells while that lowers
  the error of its two intervals; stops when a sweep moves nothing."""
  bounds = list(bounds)
  for _ in range(2000):
    moved = False
    for t in range(1, len(bounds) - 1):
      lo = max(bounds[t - 1], bounds[t] - reach)
      hi = min(bounds[t + 1], bounds[t] + reach)
      options = np.arange(lo, hi + 1)
      errors = sums.cost(bounds[t - 1], options) + sums.cost(
          options, bounds[t + 1])
      here = sums.cost(bounds[t - 1], bounds[t]) + sums.cost(
          bounds[t], bounds[t + 1])
      pick = int(options[np.argmin(errors)])
      if errors.min() < here - 1e-18 and pick != bounds[t]:
        bounds[t] = pick
        moved = True
    if not moved:
      break
  return bounds


def solve(fn, bits: int):
  """``(borders, levels, rmse)`` of the optimal ``2**bits``-level step
  function for ``f'`` of ``fn``; ``rmse = sqrt(E[(f' - s)^2])``."""
  k = 2 ** bits
  edges, weights, mids = _cells(FINE_PER_UNIT)
  values = derivative(fn, mids)
  sums = _Sums(weights, values)
  stride = FINE_PER_UNIT // COARSE[bits]
  inner = np.arange(0, len(weights) + 1, stride)
  inner = inner[np.abs(edges[inner]) < SPAN]
  cuts = np.concatenate([[0], inner, [len(weights)]])
  bounds = _partition(sums, cuts, k)
  bounds = _descend(sums, bounds, stride)
  levels = [sums.mean(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
  error = sum(float(sums.cost(a, b)) for a, b in zip(bounds[:-1], bounds[1:]))
  borders = [float(edges[b]) for b in bounds[1:-1]]
  return borders, levels, math.sqrt(max(error, 0.0))


def write_tables(path: pathlib.Path | None = None) -> pathlib.Path:
  """Solves every (activation, bits) and writes the table module."""
  from yax._fewbit import ACTIVATIONS, BITS
  path = path or pathlib.Path(__file__).with_name('_fewbit_tables.py')
  lines = [
      '"""Step-function derivatives for ``yax.fewbit``, one per (activation,',
      'bits). Generated by ``python -m yax._fewbit_solver``; do not edit.',
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
