"""Storage formats of quantized kernels: symmetric absmax integers
(``int8``, ``int4``), ``float8_e4m3fn`` (``fp8``) and the 16 NormalFloat
levels of QLoRA (``nf4``), with float32 scales over the contracted axes.
Used by ``yax.quantize`` and by ``yax.lora``'s merge on a quantized tree."""

from __future__ import annotations

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


def quantize_array(w, fmt: str, contracted: tuple):
  """``(q, scale)``: ``w`` stored in ``fmt`` with absmax scales over the
  ``contracted`` axes (kept as size-1 axes in ``scale``)."""
  dtype, top, _ = FORMATS[fmt]
  w = jnp.asarray(w, jnp.float32)
  absmax = jnp.max(jnp.abs(w), axis=contracted, keepdims=True)
  scale = jnp.where(absmax > 0, absmax / top, 1.0).astype(jnp.float32)
  if fmt == 'nf4':
    x = w / scale
    codes = jnp.argmin(jnp.abs(x[..., None] - NF4_LEVELS), axis=-1)
    return codes.astype(dtype), scale
  if fmt == 'fp8':
    return (w / scale).astype(dtype), scale
  return jnp.clip(jnp.round(w / scale), -top, top).astype(dtype), scale


def dequantize_array(q, scale, fmt: str, dtype=jnp.float32):
  if fmt == 'nf4':
    values = jnp.take(jnp.asarray(NF4_LEVELS), q.astype(jnp.int32))
  else:
    values = q.astype(jnp.float32)
  return (values * scale).astype(dtype)
