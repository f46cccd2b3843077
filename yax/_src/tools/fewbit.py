"""``yax.fewbit``: few-bit activation gradients.

Novikov et al., "Few-Bit Backward: Quantized Gradients of Activation
Functions for Memory Footprint Reduction" (2022),
https://arxiv.org/abs/2202.00441. An element-wise activation ``y = f(x)``
normally keeps ``x`` (``n * itemsize`` bytes) for its backward pass. Here
it keeps only which of ``2**bits`` intervals each ``x`` falls in, packed
into ``ceil(n * bits / 8)`` ``uint8`` bytes, and the backward pass
multiplies the incoming gradient by the step function's level of that
interval in place of ``f'(x)``. The forward pass is the activation's own
computation, so outputs are unchanged bit for bit.

Activations are found by data flow, as :func:`yax.match` finds patterns:
each supported function is traced at the shapes and dtypes of the
candidates and matched equation by equation, so a GELU that Hugging Face
inlines as ``mul``/``erfc`` equations is found as well as a ``nn.gelu``.
Each match is grouped (``yax.group``) under the activation's name, then
substituted (``yax.sub``'s engine) by a ``FewBit`` module call whose body
is one ``custom_vjp`` of the same function.

The step functions (borders and levels) are precomputed by
``yax/_src/tools/fewbit_solver.py`` and shipped in ``yax/_src/tools/fewbit_tables.py``.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from yax._src.errors import SubstitutionError
from yax._src.ir.nodes import Mox, iter_nodes
from yax._src.rewrite import activations as _activations
from yax._src.rewrite.activations import ACTIVATIONS, LEAKY_SLOPE
from yax._src.rewrite.engine import describe, select, substitute
from yax._src.tools.fewbit_tables import TABLES
from yax._src.trace.make import make_mox

BITS = (1, 2, 3, 4, 8)


def _leaky_table(bits: int, slope: float):
  """Leaky ReLU's ``f'`` is ``slope`` below 0 and 1 from 0 on: two pieces,
  exact at every ``bits`` with one border at 0 (the others at ``+inf``,
  never reached by a finite input)."""
  borders = (0.0,) + (math.inf,) * (2 ** bits - 2)
  levels = (float(slope),) + (1.0,) * (2 ** bits - 1)
  return borders, levels, 0.0


def table(name: str, bits: int, slope: float | None = None):
  """``(borders, levels, rmse)`` of the step function for ``f'``.

  ``borders``: ``2**bits - 1`` increasing floats; ``levels``: ``2**bits``
  floats, level ``i`` on ``[borders[i-1], borders[i])``; ``rmse``:
  ``sqrt(E[(f'(x) - s(x))**2])`` for ``x ~ N(0, 1)``. ``slope``: leaky
  ReLU's negative slope (default 0.01); its table is computed, exact.
  """
  if name == 'leaky_relu' and bits in BITS:
    return _leaky_table(bits, LEAKY_SLOPE if slope is None else slope)
  if name not in TABLES:
    raise SubstitutionError(
        f'fewbit has no table for the activation {name!r}; supported: '
        f'{", ".join(ACTIVATIONS)}')
  if bits not in TABLES[name]:
    raise SubstitutionError(
        f'fewbit supports bits in {BITS}, found bits={bits!r}')
  return TABLES[name][bits]


def encode(name: str, bits: int, x, slope: float | None = None) -> jax.Array:
  """Interval index of each element of ``x`` (``uint8``, same shape): the
  number of borders ``b`` with ``not x < b``, which is
  ``jnp.searchsorted(borders, x, side='right')`` (NaN after every border,
  ``-0.0`` equal to ``0.0``).

  Element-wise, so XLA fuses it with the activation: a sum of comparisons
  at up to 4 bits (15 borders), a branchless binary search (one look-up in
  the 255 borders per bit) at 8 bits. ``searchsorted`` lowers to a loop
  that costs several times the activation itself.
  """
  borders = np.asarray(table(name, bits, slope)[0], np.float32)
  x32 = jnp.asarray(x).astype(jnp.float32)
  if bits <= 4:
    codes = jnp.zeros(x32.shape, jnp.uint8)
    for b in borders:
      codes = codes + jnp.logical_not(x32 < b).astype(jnp.uint8)
    return codes
  # The 2**bits - 1 borders passed, found from the largest step down: a
  # step is taken where the border it lands on is not above ``x``.
  lookup = jnp.asarray(borders)
  count = jnp.zeros(x32.shape, jnp.int32)
  for j in reversed(range(bits)):
    ahead = count + 2 ** j
    count = jnp.where(x32 < lookup[ahead - 1], count, ahead)
  return count.astype(jnp.uint8)


def packed_size(n: int, bits: int) -> int:
  """Bytes that ``n`` codes of ``bits`` bits take: ``ceil(n * bits / 8)``."""
  return math.ceil(n * bits / 8)


def _group(bits: int) -> tuple[int, int]:
  """``(codes, bytes)`` of the smallest whole-byte group of codes: 8 codes
  in 3 bytes at 3 bits, 2 codes in 1 byte at 4 bits."""
  codes = 8 // math.gcd(8, bits)
  return codes, codes * bits // 8


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """``uint8`` codes below ``2**bits`` -> ``ceil(n * bits / 8)`` bytes;
  bit ``j`` of code ``i`` is bit ``i * bits + j`` of the little-endian
  byte stream. Each group of codes is one ``uint32`` word on the way."""
  flat = jnp.ravel(codes)
  if bits == 8:
    return flat
  n = flat.size
  g, nbytes = _group(bits)
  grouped = jnp.pad(flat, (0, -n % g)).reshape(-1, g).astype(jnp.uint32)
  shifts = jnp.arange(g, dtype=jnp.uint32) * bits
  words = jnp.sum(grouped << shifts, axis=1, dtype=jnp.uint32)
  out = (words[:, None] >> (8 * jnp.arange(nbytes, dtype=jnp.uint32))) & 255
  return out.astype(jnp.uint8).ravel()[:packed_size(n, bits)]


def unpack(packed: jax.Array, bits: int, shape) -> jax.Array:
  """Inverse of :func:`pack`: the codes, in ``shape``."""
  n = math.prod(shape)
  if bits == 8:
    return packed.reshape(shape)
  g, nbytes = _group(bits)
  grouped = jnp.pad(packed, (0, -packed.size % nbytes)).reshape(-1, nbytes)
  shifts = 8 * jnp.arange(nbytes, dtype=jnp.uint32)
  words = jnp.sum(grouped.astype(jnp.uint32) << shifts, axis=1,
                  dtype=jnp.uint32)
  codes = (words[:, None] >> (jnp.arange(g, dtype=jnp.uint32) * bits)) & (
      2 ** bits - 1)
  return codes.astype(jnp.uint8).ravel()[:n].reshape(shape)


def level(levels, codes: jax.Array) -> jax.Array:
  """``levels[codes]`` as ``float32``: a chain of selects (element-wise,
  fused with the multiplication that follows) at up to 16 levels, a
  look-up in the table above."""
  levels = np.asarray(levels, np.float32)
  if len(levels) > 16:
    return jnp.asarray(levels)[codes]
  out = jnp.full(codes.shape, levels[0], jnp.float32)
  for i in range(1, len(levels)):
    out = jnp.where(codes == i, levels[i], out)
  return out


@functools.lru_cache(maxsize=None)
def fewbit_function(name: str, bits: int,
                    slope: float | None = None) -> Callable:
  """``f`` with its forward pass and a ``bits``-bit backward pass;
  ``slope``: leaky ReLU's negative slope (``None``: its default)."""
  fn = ACTIVATIONS[name]
  if slope is not None:
    fn = functools.partial(fn, negative_slope=slope)
  table(name, bits, slope)  # refuse unknown bits before tracing anything

  @jax.custom_vjp
  def f(x):
    return fn(x)

  def f_fwd(x):
    return fn(x), pack(encode(name, bits, x, slope), bits)

  def f_bwd(packed, g):
    codes = unpack(packed, bits, g.shape)
    step = level(table(name, bits, slope)[1], codes)
    return ((g.astype(jnp.float32) * step).astype(g.dtype),)

  f.defvjp(f_fwd, f_bwd)
  f.__name__ = f'fewbit_{name}'
  return f


class FewBit(nn.Module):
  """An activation with a few-bit backward pass; ``name`` is the
  activation (a key of ``ACTIVATIONS``); ``slope``: leaky ReLU's negative
  slope where it is not the default."""
  bits: int = 3
  slope: float | None = None

  @nn.compact
  def __call__(self, x):
    return fewbit_function(self.name, self.bits, self.slope)(x)


def fewbit(mox: Mox, selection=None, *, bits: int = 3) -> Mox:
  """Gives every supported activation a few-bit backward pass.

  **Arguments:**
  - ``mox``: the tree; it is not modified.
  - ``selection``: module calls to search (an XPath expression, a node or
    a list of nodes), every body under them included; ``None`` searches
    the whole tree.
  - ``bits``: bits kept per element, one of 1, 2, 3, 4, 8.

  **Returns:** a new tree in which each activation found is a
  ``module_call`` of type ``FewBit`` with attributes ``name`` (the
  activation: ``gelu``, ``gelu_tanh``, ``silu``, ``sigmoid``, ``tanh``,
  ``softplus``, ``elu``, ``mish``, ``relu``, ``leaky_relu``, ``relu6``,
  ``hard_sigmoid``, ``hard_tanh``, ``hard_swish``) and ``bits``. Its output
  is the original's bit for bit; its gradient is the incoming gradient
  times the activation's step function (the table of docs/memory.md,
  ``yax/_src/tools/fewbit_tables.py``), and the backward pass keeps
  ``ceil(n * bits / 8)`` bytes per activation of ``n`` elements.

  Raises ``SubstitutionError`` for ``bits`` outside that list, and when
  the selection holds no supported activation (naming the element-wise
  operations it holds).
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(
        f'fewbit expects a Mox as the tree, found {type(mox).__name__}')
  if bits not in BITS:
    raise SubstitutionError(
        f'fewbit keeps bits in {BITS} per element, found bits={bits!r}')
  within = None
  if selection is not None:
    within = list(select(selection, mox).targets)
    calls = [n for n in within if isinstance(n, Mox)]
    if len(calls) != len(within):
      raise SubstitutionError(
          f'fewbit searches module calls, but the selection '
          f'{describe(selection)} holds '
          f'{describe(next(n for n in within if not isinstance(n, Mox)))}')
  found = _activations.find(mox, within)
  if not found:
    where = 'the tree' if selection is None else (
        repr(selection) if isinstance(selection, str) else
        describe(selection))
    ops = _activations.elementwise_found(within if within is not None else [mox])
    raise SubstitutionError(
        f'fewbit found no supported activation in {where}; found the '
        f'element-wise operations {", ".join(ops) or "(none)"}; supported: '
        f'{", ".join(ACTIVATIONS)}')
  # Group each activation's matches under its name (a FewBit call then
  # keeps the group's fresh path), one activation at a time: matches are
  # found again on each grouped tree and kept where they are the same
  # equations as found on the original (equations are kept by grouping).
  tree, nodes = _activations.group(mox, found)
  replacement = _Replacement(bits)
  return substitute(nodes, replacement, tree).mox


class _Replacement:
  """``(path, group node) -> FewBit`` call traced at the node's input."""

  def __init__(self, bits: int):
    self.bits = bits
    self.cache: dict = {}

  def __call__(self, path, node: Mox) -> Mox:
    (x,) = node.arg_inputs
    slope = None
    if node.name == 'leaky_relu':
      slopes = [s for s in map(_activations.leaky_slope, iter_nodes(node))
                if s is not None]
      # The default slope (as the trace's float32 rounds it) stays None.
      if slopes and float(np.float32(slopes[0])) != float(
          np.float32(LEAKY_SLOPE)):
        slope = slopes[0]
    key = (node.name, slope, tuple(x.aval.shape), jnp.dtype(x.aval.dtype))
    traced = self.cache.get(key)
    if traced is None:
      module = FewBit(bits=self.bits, name=node.name, slope=slope)
      spec = jax.ShapeDtypeStruct(tuple(x.aval.shape), x.aval.dtype)
      traced = self.cache[key] = make_mox(module.apply)({}, spec)
    return traced
