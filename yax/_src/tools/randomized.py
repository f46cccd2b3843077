"""``yax.randomized_linear``: a linear layer that keeps a sketch of its input.

A linear layer ``Z = X K`` keeps its input ``X`` (``n`` rows, one per
position that is not contracted, ``d`` columns) for the kernel gradient
``X^T G``. Keeping a random sketch ``S^T X`` of ``k = ceil(ratio * n)``
rows instead and returning ``(S^T X)^T (S^T G)`` gives an unbiased kernel
gradient whenever ``E[S S^T] = I`` (Bershatsky et al. 2022,
"Memory-efficient backpropagation through large linear layers", the
randomized linear layer of fewbit). The input gradient ``G K^T`` does not
need ``X`` and stays exact, and so does the forward pass.

Kinds of ``S`` (``[n, k]``, never built by the rewrite):

* ``'count'`` (the default): a count sketch (Clarkson and Woodruff 2013).
  Row ``i`` of ``X`` is added, times a random sign ``s_i``, to bucket
  ``h_i`` of ``k``, drawn uniformly: ``S[i, h_i] = s_i``, zero elsewhere.
  ``S^T X`` is one scatter-add of the signed rows: ``n * d`` additions,
  linear in the rows, and only ``n`` signs and bucket indices are drawn.
  ``E[S S^T] = I`` (the signs are independent), so the gradient is
  unbiased; the variance of each element ``(a, b)`` of the kernel
  gradient is ``(|x_a|^2 |g_b|^2 + (x_a . g_b)^2
  - 2 sum_i x_ia^2 g_ib^2) / k`` (``x_a``, ``g_b``: columns of ``X`` and
  ``G``), never above the Gaussian sketch's.
* ``'gaussian'``: iid ``N(0, 1/k)`` entries; variance ``(|x_a|^2 |g_b|^2 +
  (x_a . g_b)^2) / k``. Applying it costs ``k * n * d = ratio * n**2 * d``
  multiply-adds, quadratic in the rows (at BERT-base's batch 128 x 128,
  about four times the layer's own matmul); it is drawn and applied in
  blocks of rows, so ``S`` is never whole in memory.
* ``'rademacher'``: ``+-1/sqrt(k)`` entries, the same cost as Gaussian.

``S`` is drawn from a PRNG key, so the backward pass draws it again instead
of keeping it: the rewritten tree takes one new root keyword argument,
``sketch_key`` (any JAX key: a typed ``jax.random.key`` or a raw
``jax.random.PRNGKey``), and each site folds its own index into it. A
training loop passes a new key every step. Inside ``nn.scan`` bodies the
key is a loop constant: every layer of the scan draws the same sketch
(each gradient is still unbiased).

The rewrite replaces the contraction of each selected call (the
``dot_general`` the kernel plan of ``yax.lora`` finds) through the
substitution engine; the key is a named input of the engine.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from yax._src.errors import SubstitutionError
from yax._src.ir.nodes import Equation, Mox, iter_nodes
from yax._src.rewrite.contraction import RAGGED, kernel_plans
from yax._src.rewrite.engine import (describe, leave_out_hint, non_literals,
                                     select, substitute)
from yax._src.trace.make import make_mox

KEY_NAME = 'sketch_key'
KINDS = ('count', 'gaussian', 'rademacher')


# ------------------------------------------------------- the sketched dot

def _free_axes(ndim: int, contracting, batch) -> list[int]:
  return [a for a in range(ndim) if a not in contracting and a not in batch]


# The sketch is drawn and applied in blocks of rows of at most this many
# entries (16 MiB in float32): ``S`` has ``k * n = ratio * n**2`` entries,
# more than the input itself at BERT-base's batch 128 (n = 16384 rows: a
# whole ``S`` of 205 MiB per layer, where the input is 48 MiB), so it is
# never built whole, in the forward or the backward pass.
BLOCK_ENTRIES = 2 ** 22


def _block_rows(n: int, k: int) -> int:
  return max(1, min(n, BLOCK_ENTRIES // k))


def _draw(key, rows: int, k: int, kind: str):
  """``rows`` rows of ``S``, iid, with ``E[S S^T] = I``."""
  if kind == 'gaussian':
    s = jax.random.normal(key, (rows, k), jnp.float32)
  else:
    s = jax.random.rademacher(key, (rows, k), jnp.float32)
  return s / np.sqrt(k)


def sketch_matrix(key, n: int, k: int, kind: str, dtype=jnp.float32):
  """The whole ``S: [n, k]`` that :func:`sketch` applies block by block:
  row block ``b`` is drawn from ``fold_in(key, b)``; for ``'count'``, the
  signs at the drawn buckets. (For inspection and tests: the rewrite never
  builds it.)"""
  if kind == 'count':
    return count_sketch(key, jnp.eye(n, dtype=jnp.float32), k).T.astype(dtype)
  rows = _block_rows(n, k)
  blocks = [_draw(jax.random.fold_in(key, b), min(rows, n - start), k, kind)
            for b, start in enumerate(range(0, n, rows))]
  return jnp.concatenate(blocks).astype(dtype)


def count_sketch(key, flat, k: int):
  """``S^T flat`` for the count sketch: row ``i`` of ``flat`` (``[n, m]``)
  times sign ``s_i`` added to bucket ``h_i`` (``[k, m]``), accumulated in
  float32. ``(h, s)`` come from ``key``: the same key gives the same
  sketch, so the backward pass sketches the output gradient alike."""
  n = flat.shape[0]
  k_bucket, k_sign = jax.random.split(key)
  buckets = jax.random.randint(k_bucket, (n,), 0, k)
  signs = jax.random.rademacher(k_sign, (n,), jnp.float32)
  rows = flat.astype(jnp.float32) * signs[:, None]
  return jax.ops.segment_sum(rows, buckets, num_segments=k).astype(flat.dtype)


def sketch(key, flat, k: int, kind: str):
  """``S^T flat`` (``flat: [n, m]`` -> ``[k, m]``), accumulated in float32
  over row blocks of ``S`` drawn one at a time (a loop, so that only one
  block is alive)."""
  if kind == 'count':
    return count_sketch(key, flat, k)
  n, m = flat.shape
  rows = _block_rows(n, k)
  full, rest = divmod(n, rows)

  def term(b, block):
    s = _draw(jax.random.fold_in(key, b), block.shape[0], k, kind)
    return jnp.dot(s.astype(flat.dtype).T, block,
                   preferred_element_type=jnp.float32)

  if full == 1:
    acc = term(0, flat[:rows])
  else:
    blocks = flat[:full * rows].reshape(full, rows, m)
    acc, _ = jax.lax.scan(lambda acc, xs: (acc + term(*xs), None),
                          jnp.zeros((k, m), jnp.float32),
                          (jnp.arange(full), blocks))
  if rest:
    acc = acc + term(full, flat[full * rows:])
  return acc.astype(flat.dtype)


def _sketch_rows(key, value, axes: list[int], k: int, kind: str):
  """``S^T`` applied to the positions ``axes`` of ``value`` (flattened in
  order): those axes become one axis of size ``k`` at ``axes[0]``."""
  rest = [a for a in range(value.ndim) if a not in axes]
  n = math.prod(value.shape[a] for a in axes)
  flat = jnp.transpose(value, (*axes, *rest)).reshape(
      (n, math.prod(value.shape[a] for a in rest)))
  out = sketch(key, flat, k, kind).reshape(
      (k, *(value.shape[a] for a in rest)))
  return jnp.moveaxis(out, 0, axes[0] if axes else 0)


def sketched_dot(params: dict, x_side: int, x_shape: tuple, ratio: float,
                 kind: str, site: int):
  """``dot_general`` with the given params whose backward pass keeps a
  sketch of operand ``x_side`` (the layer input) instead of the operand."""
  (lc, rc), (lb, rb) = params['dimension_numbers']
  xc, kc = ((lc, rc), (rc, lc))[x_side]
  xb, kb = ((lb, rb), (rb, lb))[x_side]

  def dot(x, w):
    lhs, rhs = (x, w) if x_side == 0 else (w, x)
    return jax.lax.dot_general_p.bind(lhs, rhs, **params)

  @jax.custom_vjp
  def f(lhs, rhs, key):
    del key
    return jax.lax.dot_general_p.bind(lhs, rhs, **params)

  def fwd(lhs, rhs, key):
    x, w = (lhs, rhs) if x_side == 0 else (rhs, lhs)
    key = jax.random.fold_in(key, site)
    xf = _free_axes(x.ndim, xc, xb)
    n = math.prod(x.shape[a] for a in xf)
    k = max(1, math.ceil(ratio * n))
    sx = _sketch_rows(key, x, xf, k, kind)
    return jax.lax.dot_general_p.bind(lhs, rhs, **params), (sx, w, key)

  def bwd(res, g):
    sx, w, key = res
    x_spec = jax.ShapeDtypeStruct(x_shape, sx.dtype)
    # The exact input gradient: the transpose of x -> x K.
    (dx,) = jax.linear_transpose(lambda x: dot(x, w), x_spec)(g)
    # The kernel gradient from the sketches: the sketched input is an
    # operand with one free axis of k rows, where the input had n rows.
    xf = _free_axes(len(x_shape), xc, xb)
    k = sx.shape[xf[0]] if xf else 1
    nb, x_nfree = len(xb), len(xf)
    k_nfree = w.ndim - len(kc) - len(kb)
    # Where the input's free axes sit in the output: after the batch axes
    # for the lhs, after the kernel's free axes for the rhs.
    start = nb if x_side == 0 else nb + k_nfree
    sg = _sketch_rows(key, g, list(range(start, start + x_nfree)), k, kind)
    # Axes of the sketched input: the free axes collapsed into one.
    keep = [a for a in range(len(x_shape)) if a not in xf[1:]]
    new = {a: i for i, a in enumerate(keep)}
    sxc, sxb = tuple(new[a] for a in xc), tuple(new[a] for a in xb)
    dn = ((sxc, kc), (sxb, kb)) if x_side == 0 else ((kc, sxc), (kb, sxb))
    sparams = dict(params, dimension_numbers=dn)

    def sdot(w):
      lhs, rhs = (sx, w) if x_side == 0 else (w, sx)
      return jax.lax.dot_general_p.bind(lhs, rhs, **sparams)
    (dw,) = jax.linear_transpose(
        sdot, jax.ShapeDtypeStruct(w.shape, w.dtype))(sg.astype(g.dtype))
    return (dx, dw, None) if x_side == 0 else (dw, dx, None)

  f.defvjp(fwd, bwd)
  return f


# ----------------------------------------------------------- the rewrite

def _contraction_equation(node: Mox, plan) -> Equation | str:
  """The one ``dot_general`` of ``node`` that contracts the kernel."""
  c = plan.contraction
  want = dict(c.params)
  found = []
  for n in iter_nodes(node):
    if not isinstance(n, Equation) or n.prim.name != 'dot_general':
      continue
    if n.params != want or len(n.inputs) != 2:
      continue
    x = n.inputs[1 - c.kernel_side]
    if x.aval is None or (tuple(x.aval.shape), x.aval.dtype) != (
        tuple(c.operand_aval.shape), c.operand_aval.dtype):
      continue
    found.append(n)
  if len(found) != 1:
    return (f'{len(found)} dot_general equations of the call look like its '
            'kernel contraction; select calls that contract their kernel once')
  return found[0]


def _site(node: Mox, plan, ratio: float):
  """``(the contraction equation, the kernel's operand side)`` that
  sketches ``plan``'s kernel, or why it cannot be sketched."""
  name = '/'.join(plan.kernel_keys)
  kind = plan.contraction.kind
  if kind == RAGGED:
    return (f'its kernel {name} is contracted by ragged_dot: each group '
            "(expert) has a kernel gradient of its own rows, and how many "
            'rows each group gets is known only at run time (the group '
            'sizes are an input), so no sketch of a fixed size per group '
            'can be drawn, and one over all rows would mix the groups; '
            'randomized_linear sketches dot_general layers only')
  if kind != 'dot_general':
    return ('it is a convolution; randomized_linear sketches dot_general '
            'layers only')
  eqn = plan.site if plan.site is not None else \
      _contraction_equation(node, plan)
  if isinstance(eqn, str):
    return eqn
  side_x = 1 - plan.contraction.kernel_side
  (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
  x_aval = eqn.inputs[side_x].aval
  free = _free_axes(x_aval.ndim, (lc, rc)[side_x], (lb, rb)[side_x])
  if not free:
    return ('its input has no position that is not contracted (one row): '
            'there is nothing to sketch')
  n, k, kept, full = _sketch_bytes(x_aval, free, ratio)
  if kept > full:
    return (f'its sketch would keep {kept} bytes ({k} of {n} rows at ratio '
            f'{ratio:g}, and the {KEY_BYTES}-byte key), more than its input '
            f'{x_aval.str_short(short_dtypes=True)} ({full} bytes)')
  return eqn, plan.contraction.kernel_side


def _check(ratio, kind) -> float:
  if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or \
      not 0 < ratio <= 1:
    raise SubstitutionError(
        f'randomized_linear: ratio must be a number in (0, 1] (the fraction '
        f'of rows the sketch keeps), found {ratio!r}')
  if kind not in KINDS:
    raise SubstitutionError(
        f'randomized_linear: kind must be one of {", ".join(KINDS)}, found '
        f'{kind!r}')
  return float(ratio)


# Bytes of the key the backward pass keeps with each sketch (threefry's
# two uint32 words).
KEY_BYTES = 8


def _sketch_bytes(x_aval, free: list[int], ratio: float) -> tuple[int, int,
                                                                   int, int]:
  """``(n, k, sketch bytes, input bytes)`` of one layer input."""
  n = math.prod(x_aval.shape[a] for a in free)
  k = max(1, math.ceil(ratio * n))
  size = math.prod(x_aval.shape)
  itemsize = np.dtype(x_aval.dtype).itemsize
  return n, k, size // n * k * itemsize + KEY_BYTES, size * itemsize


def randomized_linear(mox: Mox, selection, *, ratio: float = 0.2,
                      kind: str = 'count') -> Mox:
  """Selected linear layers keep a random sketch of their input for the
  kernel gradient (unbiased) instead of the input itself.

  **Arguments:**
  - ``mox``: the traced tree (left unchanged).
  - ``selection``: XPath or node list of module calls that contract a
    kernel with a ``dot_general`` (every non-convolution layout
    ``yax.lora`` adapts: Dense, DenseGeneral, Einsum, nnx.Linear ...).
  - ``ratio``: the sketch keeps ``k = ceil(ratio * n)`` of the input's
    ``n`` rows (every position that is not contracted).
  - ``kind``: ``'count'`` (a count sketch, linear in the rows: the
    default), ``'gaussian'`` (``N(0, 1/k)`` entries) or ``'rademacher'``
    (both quadratic in the rows); variances in the module docstring.

  **Returns:** the new tree. It takes one more keyword argument,
  ``sketch_key`` (any JAX key: ``jax.random.key(0)`` or a raw
  ``jax.random.PRNGKey(0)``), which draws the sketches;
  pass a new one every training step. ``eval_mox`` without it raises
  ``yax.SignatureError``. Outputs and input gradients are exact.

  Raises ``SubstitutionError`` naming each selected call that cannot be
  sketched (not a ``dot_general`` layer, or one whose sketch and key would
  keep more bytes than its input, with the figures), ending with an XPath
  that leaves them out.

  Example::

      new = yax.randomized_linear(mox, '//module_call[@type="Dense"]')
      loss = lambda p: yax.eval_mox(new, p, x, sketch_key=key).sum()
  """
  if not isinstance(mox, Mox):
    raise SubstitutionError(
        f'randomized_linear expects a Mox, found {type(mox).__name__}')
  ratio = _check(ratio, kind)
  chosen = select(selection, mox)
  sites, problems = [], []
  for node in chosen.targets:
    if not isinstance(node, Mox) or node.is_ephemeral:
      problems.append((node, 'it is not a module call'))
      continue
    plans = kernel_plans(node, 1)
    if isinstance(plans, str):
      problems.append((node, plans))
      continue
    # Every kernel of the call is sketched, or the call is refused.
    found, why = [], []
    for plan in plans:
      got = _site(node, plan, ratio)
      if isinstance(got, str) and len(plans) > 1:
        got = f"{'/'.join(plan.kernel_keys)}: {got}"
      (why if isinstance(got, str) else found).append(got)
    if why:
      problems.append((node, '; '.join(why)))
      continue
    sites.extend(found)
  if problems:
    lines = '\n'.join(f'  - {describe(n)}: {why}' for n, why in problems)
    hint = leave_out_hint([(n, False) for n, _ in problems], selection,
                          chosen.targets)
    raise SubstitutionError(
        f'randomized_linear cannot sketch {len(problems)} of the '
        f'{len(chosen.targets)} calls selected by {chosen.description}:\n'
        f'{lines}\n{hint}')
  side = {id(eqn): (i, 1 - kernel_side)
          for i, (eqn, kernel_side) in enumerate(sites)}
  named: dict = {}
  key_spec = jax.eval_shape(lambda: jax.random.key(0))

  def replace(path, eqn):
    del path
    site, x_side = side[id(eqn)]
    x_shape = tuple(eqn.inputs[x_side].aval.shape)
    fn = sketched_dot(eqn.params, x_side, x_shape, ratio, kind, site)
    specs = [jax.ShapeDtypeStruct(tuple(s.aval.shape), s.aval.dtype)
             for s in eqn.inputs]
    template = make_mox(fn)(*specs, key_spec)
    named[non_literals(template.inputs)[2]] = KEY_NAME
    return template

  return substitute([eqn for eqn, _ in sites], replace, mox,
                    inputs=named).mox
