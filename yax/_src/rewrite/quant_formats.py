"""Storage formats of quantized kernels: symmetric absmax integers
(``int8``, ``int4``), ``float8_e4m3fn`` (``fp8``) and the 16 NormalFloat
levels of QLoRA (``nf4``), with float32 scales over the contracted axes.
Used by ``yax.quantize`` and by ``yax.lora``'s merge on a quantized tree."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# The 16 NormalFloat levels (Dettmers et al., QLoRA, 2023, appendix E).
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], np.float32)

# format -> (storage dtype, the largest stored magnitude, bits)
FORMATS = {
    'int8': (jnp.int8, 127.0, 8),
    'int4': (jnp.int4, 7.0, 4),
    'fp8': (jnp.float8_e4m3fn, 448.0, 8),
    'nf4': (jnp.uint4, 1.0, 4),
}


def _nf4_table():
  """NF4's levels built from scalar literals: traced, the table is
  computed in the call that reads it, not a constant captured from outside
  it (which a rewrite wrapping the call, QLoRA's adapter, could not see)."""
  return jax.lax.concatenate(
      [jnp.full((1,), float(v), jnp.float32) for v in NF4_LEVELS], 0)


def _tiled(w, contracted: tuple, tile: int):
  """``w`` as ``[n_tiles, tile, *other axes]``: the contracted axes, in
  kernel order, flattened and cut into tiles; and how to undo it."""
  other = [i for i in range(w.ndim) if i not in contracted]
  perm = [*contracted, *other]
  moved = jnp.transpose(w, perm)
  size = int(np.prod([w.shape[i] for i in contracted]))
  if tile <= 0 or size % tile:
    raise ValueError(f'tile={tile} does not divide the {size} contracted '
                     f'elements of a kernel of shape {tuple(w.shape)}')
  tiles = moved.reshape(size // tile, tile, *moved.shape[len(contracted):])

  def back(x):
    return jnp.transpose(x.reshape(moved.shape), np.argsort(perm))
  return tiles, back


def scale_shape(shape: tuple, contracted: tuple, tile: int | None) -> tuple:
  """The shape of the scales of a kernel of ``shape``."""
  if tile is None:
    return tuple(1 if i in contracted else n for i, n in enumerate(shape))
  size = int(np.prod([shape[i] for i in contracted]))
  return (size // tile, 1, *(n for i, n in enumerate(shape)
                              if i not in contracted))


def quantize_array(w, fmt: str, contracted: tuple, tile: int | None = None):
  """``(q, scale)``: ``w`` stored in ``fmt`` with absmax scales over the
  ``contracted`` axes (kept as size-1 axes in ``scale``), or over each
  ``tile`` elements of them (flattened in kernel order)."""
  codes, scale = _array_codes(w, fmt, contracted, tile)
  if tile is None:
    return codes.astype(FORMATS[fmt][0]), scale
  return _stored(codes, fmt), scale


def _array_codes(w, fmt: str, contracted: tuple, tile: int | None):
  """The codes of ``quantize_array`` before their cast, in ``w``'s
  layout, and the scales."""
  if tile is None:
    return _codes(jnp.asarray(w, jnp.float32), fmt, contracted)
  tiles, back = _tiled(jnp.asarray(w, jnp.float32), contracted, tile)
  codes, scale = _codes(tiles, fmt, (1,))
  return back(codes), scale


def _stored(codes, fmt: str):
  """Codes moved back to the kernel's layout, cast to ``fmt``'s type.
  The barrier keeps XLA from fusing the move (a transpose) with the cast:
  jaxlib 0.8.0's CPU backend compiles that fusion, for a 4-bit type, into
  code that corrupts the heap ("malloc_consolidate(): invalid chunk
  size"; tests/tools/test_quantize.py, int4 tiles)."""
  return jax.lax.optimization_barrier(codes).astype(FORMATS[fmt][0])


def _codes(w, fmt: str, contracted: tuple):
  """The codes of ``w`` before their cast to ``fmt``'s storage type (as
  float32, or int32 for nf4) and the absmax scales."""
  _, top, _ = FORMATS[fmt]
  absmax = jnp.max(jnp.abs(w), axis=contracted, keepdims=True)
  scale = jnp.where(absmax > 0, absmax / top, 1.0).astype(jnp.float32)
  if fmt == 'nf4':
    x = w / scale
    return jnp.argmin(jnp.abs(x[..., None] - NF4_LEVELS), axis=-1), scale
  if fmt == 'fp8':
    return w / scale, scale
  # Symmetric absmax (the SPEC): the absmax maps to +-qmax (127, 7), codes
  # are clipped to [-qmax, qmax] and rounded half to even, so that
  # q(-w) = -q(w) and the rounding error has no bias.
  return jnp.clip(jnp.round(w / scale), -top, top), scale


def per_slice(fn, stack: int):
  """``fn`` applied to each slice of ``stack`` leading axes."""
  for _ in range(stack):
    fn = jax.vmap(fn)
  return fn


def quantize_kernel(kernel, fmt: str, contracted: tuple, tile=None,
                    stack: int = 0, perm: tuple | None = None):
  """``quantize_array`` per slice of ``stack`` leading axes. Every tool
  that stores a kernel quantized calls this one function, so they store
  the same codes and scales for the same kernel.

  An ``int8``/``int4`` kernel held on the host (a NumPy array, or a JAX
  array on one CPU device) is quantized in NumPy: nothing to compile (the
  first ``quantize`` of BERT-base compiled once per kernel shape, most of
  its time), with IEEE division as eager ``jnp`` does. Others are compiled
  once per kernel shape (``_quantize_kernel_jit``).

  Args:
    kernel: the kernel as stored.
    fmt: a key of ``FORMATS``.
    contracted: the axes of one slice that its scale reduces.
    tile: elements of the contracted axes per scale (None: all of them).
    stack: leading axes of the sliced kernel that stack one kernel each.
    perm: see ``_quantize_kernel_jit``.

  Returns:
    ``(codes, scale)``: codes in ``FORMATS[fmt][0]`` and the kernel's
    stored layout, float32 scales stacked on the leading axes.

  Example::

    q, scale = quantize_kernel(w, 'int8', (0,))   # w: [in, out]
  """
  if fmt in ('int8', 'int4') and _on_host(kernel):
    return _host_quantize(kernel, fmt, contracted, tile, stack, perm)
  return _quantize_kernel_jit(kernel, fmt, contracted, tile, stack, perm)


def _on_host(kernel) -> bool:
  """Whether ``kernel`` is a concrete array in host memory."""
  if isinstance(kernel, np.ndarray):
    return True
  if not isinstance(kernel, jax.Array) or isinstance(kernel, jax.core.Tracer):
    return False
  devices = kernel.devices()
  return len(devices) == 1 and next(iter(devices)).platform == 'cpu'


def _host_quantize(kernel, fmt: str, contracted: tuple, tile, stack: int,
                   perm):
  """``_quantize_kernel_jit`` for ``int8``/``int4`` in NumPy, the
  results put where ``kernel`` is."""
  w = np.asarray(kernel)
  if perm is not None:
    w = np.transpose(w, perm)
  axes = tuple(stack + a for a in contracted)
  if tile is None:
    groups, back = w, lambda x: x
    reduce = axes
  else:  # [*stack, tiles, tile, *other axes]
    other = [i for i in range(stack, w.ndim) if i not in axes]
    order = [*range(stack), *axes, *other]
    moved = np.transpose(w, order)
    size = int(np.prod([w.shape[i] for i in axes]))
    if tile <= 0 or size % tile:
      raise ValueError(f'tile={tile} does not divide the {size} contracted '
                       f'elements of a kernel of shape {tuple(w.shape)}')
    groups = moved.reshape(*w.shape[:stack], size // tile, tile,
                           *moved.shape[stack + len(axes):])
    back = lambda x: np.transpose(x.reshape(moved.shape), np.argsort(order))
    reduce = (stack + 1,)
  codes, scale = _host_codes(groups, reduce, FORMATS[fmt][1],
                             np.dtype(FORMATS[fmt][0]))
  codes = back(codes)
  if perm is not None:
    codes = np.transpose(codes, np.argsort(perm))
  if isinstance(kernel, jax.Array):
    return (jax.device_put(codes, kernel.sharding),
            jax.device_put(scale, kernel.sharding))
  return jnp.asarray(codes), jnp.asarray(scale)


# Elements of one block of ``_host_codes`` (float32: 256 KiB, within a
# core's cache).
_BLOCK = 1 << 16


def _host_codes(groups: np.ndarray, reduce: tuple, top: float, dtype):
  """The integer codes (of ``dtype``) and float32 scales of ``groups``,
  one absmax scale per slice over the ``reduce`` axes: what
  ``_codes(groups, fmt, reduce)`` computes, cast, bit for bit.

  The codes are computed in blocks of leading rows, each block read from
  memory once and its steps (divide, round, clip, cast) run in cache, and
  divided by its scales laid out to its shape (NumPy divides by a
  broadcast row several times slower).
  """
  top = np.float32(top)
  w = groups if groups.dtype == np.float32 else groups.astype(np.float32)
  m = np.maximum(np.max(w, axis=reduce, keepdims=True),
                 -np.min(w, axis=reduce, keepdims=True))
  scale = np.where(m > 0, m / top, np.float32(1)).astype(np.float32)
  # Division and rounding keep order, so no code exceeds its absmax's: the
  # clip changes nothing where that one is within +-top (a NaN or infinite
  # absmax fails the test: clipped as before).
  clip = not np.all(np.rint(m / scale) <= top)
  codes = np.empty(w.shape, dtype)
  n = w.shape[0] if w.ndim else 1
  row = math.prod(w.shape[1:])
  step = max(1, _BLOCK // row) if w.ndim and row else n
  if step >= n:
    blocks, shape = [...], w.shape
  else:
    blocks, shape = ([slice(i, i + step) for i in range(0, n, step)],
                     (step, *w.shape[1:]))
  x = np.empty(shape, np.float32)
  scales = np.empty(shape, np.float32)
  per_block = 0 not in reduce  # else one row of scales serves every row
  if not per_block:
    np.copyto(scales, scale)
  for where in blocks:
    block = w[where]
    k = len(block) if w.ndim else 1
    out, by = (x, scales) if k == len(x) or not w.ndim else (x[:k],
                                                              scales[:k])
    if per_block:
      np.copyto(by, scale[where])
    np.divide(block, by, out=out)
    np.rint(out, out=out)  # half to even, as jnp.round
    if clip:
      np.clip(out, -top, top, out=out)
    codes[where] = out
  return codes, scale


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _quantize_kernel_jit(kernel, fmt: str, contracted: tuple, tile=None,
                         stack: int = 0, perm: tuple | None = None):
  """``quantize_array`` per slice of ``stack`` leading axes, compiled once
  per kernel shape: compiled, XLA may divide by the constant as a product
  with its reciprocal, one ulp away from the eager division (jax 0.8.0
  does, on the CPU).

  ``perm``: the stacked kernel as stored is ``kernel`` with its axes in
  another order, ``jnp.transpose(kernel, perm)`` the one sliced (a stack
  moved to the front for ``jax.lax.scan``). The codes keep the stored
  order; the scales are in the sliced one (stacked on the leading axes)."""
  if perm is None:
    return per_slice(functools.partial(
        quantize_array, fmt=fmt, contracted=contracted, tile=tile),
                     stack)(kernel)
  codes, scale = per_slice(functools.partial(
      _array_codes, fmt=fmt, contracted=contracted, tile=tile),
                           stack)(jnp.transpose(kernel, perm))
  return _stored(jnp.transpose(codes, np.argsort(perm)), fmt), scale


def dequantize_array(q, scale, fmt: str, dtype=jnp.float32,
                     contracted: tuple = ()):
  """The float kernel of ``q`` and its scales (tiled scales, of rank
  ``q.ndim - len(contracted) + 2``, need the ``contracted`` axes)."""
  if fmt == 'nf4':
    values = jnp.take(_nf4_table(), q.astype(jnp.int32))
  else:
    values = q.astype(jnp.float32)
  if scale.ndim != values.ndim or (
      contracted and any(scale.shape[i] != 1 for i in contracted)):
    tiles, back = _tiled(values, contracted, values.size // (
        scale.shape[0] * int(np.prod(scale.shape[2:]))))
    return back(tiles * scale).astype(dtype)
  return (values * scale).astype(dtype)


def dequantize_kernel(q, scale, fmt: str, dtype, contracted: tuple,
                      stack: int = 0, perm: tuple | None = None):
  """The float kernel ``quantize_kernel`` stored as ``(q, scale)``, in the
  stored layout."""
  fn = per_slice(functools.partial(dequantize_array, fmt=fmt, dtype=dtype,
                                   contracted=contracted), stack)
  if perm is None:
    return fn(q, scale)
  # As float codes (exact for every format) the moves stay off 4-bit types.
  codes = jnp.transpose(q.astype(jnp.float32), perm)
  return jnp.transpose(fn(codes, scale), np.argsort(perm))
