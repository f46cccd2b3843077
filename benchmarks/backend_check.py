"""Every rewrite, replayed on the default JAX backend (a GPU where there is
one), against plain Flax on the same device and the same values.

Run: ``python benchmarks/backend_check.py`` (``JAX_PLATFORMS=cuda`` to insist
on a GPU). The test suite checks all of this on the CPU; this script is for
the accelerators CI does not have. Models: Hugging Face's
``FlaxBertForSequenceClassification`` (a small config, random weights) and
an NNX MLP. Each row is one check, compiled with ``jax.jit``; ``max |diff|``
is the largest absolute difference from the reference, ``ok`` whether it is
within the row's tolerance (exact rows: 0). Matrix products run in full
float32 (``jax_default_matmul_precision='highest'``), not a GPU's TF32. The exit status is 1 if any row
is not ok.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_TF', '0')
os.environ.setdefault('USE_FLAX', '1')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import yax  # noqa: E402

ROWS = []


def leaves(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def check(name, got, want, *, rtol=0.0, atol=0.0, relative=False):
  """One row: the largest |got - want| (or, with ``relative``, the norm of
  the difference over the norm of ``want``, over all leaves)."""
  g, w = leaves(got), leaves(want)
  assert len(g) == len(w), (name, len(g), len(w))
  if relative:
    num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(g, w, strict=True))
    den = sum(float(np.sum(b ** 2)) for b in w)
    diff = (num / den) ** 0.5
    ok = diff <= rtol
  else:
    diff = max(float(np.max(np.abs(a - b), initial=0.0))
               for a, b in zip(g, w, strict=True))
    ok = all(np.allclose(a, b, rtol=rtol, atol=atol)
             for a, b in zip(g, w, strict=True))
  ROWS.append((name, diff, 'rel' if relative else 'abs', rtol, atol, ok))


def bert():
  from transformers import BertConfig, FlaxBertForSequenceClassification
  config = BertConfig(hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=128,
                      vocab_size=500, num_labels=3)
  model = FlaxBertForSequenceClassification(config, seed=0)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(3, 500, (4, 16)), jnp.int32)
  mask = jnp.ones((4, 16), jnp.int32)

  def forward(p, ids, mask):
    return model(ids, attention_mask=mask, params=p, train=False).logits
  return forward, model.params, ids, mask


def linen_checks():
  forward, params, ids, mask = bert()
  mox = yax.make_mox(forward)(params, ids, mask)
  ref = jax.jit(forward)
  run = jax.jit(lambda tree, p, *a, **k: yax.eval_mox(tree, p, *a, **k),
                static_argnums=0)

  def grad(tree):
    """The jitted gradient of sum(logits**2) for the params, of ``tree``
    replayed (or, with None, of the plain model)."""
    fn = forward if tree is None else (
        lambda p, i, m: yax.eval_mox(tree, p, i, m))
    return jax.jit(jax.grad(lambda p, i, m: jnp.sum(fn(p, i, m) ** 2)))(
        params, ids, mask)

  check('bert: replay (jit)', run(mox, params, ids, mask),
        ref(params, ids, mask), rtol=1e-5, atol=1e-5)
  check('bert: replay grad (jit)',
        grad(mox), grad(None),
        rtol=1e-4, atol=1e-5)
  many = jnp.stack([ids, ids[::-1]])
  check('bert: replay vmap (jit)',
        jax.jit(jax.vmap(lambda i: yax.eval_mox(mox, params, i, mask)))(many),
        jax.jit(jax.vmap(lambda i: forward(params, i, mask)))(many),
        rtol=1e-5, atol=1e-5)

  dense = '//module_call[@type="Dense"]'
  res = yax.lora(mox, params, dense, rank=4, alpha=8.0)
  rng = np.random.default_rng(1)
  trained = jax.tree.map(
      lambda v, m: v + rng.normal(0, 0.05, np.shape(v)).astype(v.dtype)
      if m else v, res.params, res.mask)
  check('bert: lora vs merged kernels', run(res.mox, trained, ids, mask),
        ref(res.merge(trained), ids, mask), rtol=1e-4, atol=1e-4)

  for fmt in ('int8', 'int4', 'nf4'):
    q = yax.quantize(mox, params, dense, weight=fmt)
    check(f'bert: quantize {fmt} vs dequantized', run(q.mox, q.params, ids,
                                                      mask),
          ref(q.dequantize(q.params), ids, mask), rtol=1e-4, atol=1e-4)
  q = yax.quantize(mox, params, dense, weight='nf4')
  ql = yax.lora(q.mox, q.params, dense, rank=4)
  # B = 0 at init, but the adapted program is another XLA program: its
  # fusions may round the same sums in another order.
  check('bert: qlora nf4 at init', run(ql.mox, ql.params, ids, mask),
        run(q.mox, q.params, ids, mask), rtol=1e-6, atol=1e-6)

  half = yax.cast(mox, dense, 'bfloat16')
  check('bert: cast bf16 (relative)', run(half, params, ids, mask),
        ref(params, ids, mask), rtol=5e-2, relative=True)

  few = yax.fewbit(mox, bits=3)
  check('fewbit 3-bit: forward exact', run(few, params, ids, mask),
        ref(params, ids, mask))
  check('fewbit 3-bit: grad (relative)',
        grad(few), grad(None),
        rtol=0.1, relative=True)

  sk = yax.randomized_linear(mox, dense, ratio=0.5)
  key = jax.random.PRNGKey(0)
  check('randomized 50%: forward exact',
        run(sk, params, ids, mask, sketch_key=key), ref(params, ids, mask))

  layers = '//module_call[@type="FlaxBertLayer"]'
  rem = yax.remat(mox, layers)
  check('remat layers: forward', run(rem, params, ids, mask),
        ref(params, ids, mask), rtol=1e-5, atol=1e-5)
  check('remat layers: grad',
        grad(rem), grad(None),
        rtol=1e-4, atol=1e-5)


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


def nnx_checks():
  model = MLP(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 16))
  mox = yax.make_mox(lambda m, x: m(x))(model, x)
  check('nnx mlp: replay (jit)',
        jax.jit(lambda x: yax.eval_mox(mox, model, x))(x),
        jax.jit(lambda x: model(x))(x), rtol=1e-5, atol=1e-6)
  graph, state = nnx.split(model)
  split = yax.make_mox(lambda s, x: nnx.merge(graph, s)(x))(state, x)
  res = yax.lora(split, state, '//module_call[@type="Linear"]', rank=2)
  check('nnx mlp: lora at init',
        jax.jit(lambda s, x: yax.eval_mox(res.mox, s, x))(res.params, x),
        jax.jit(lambda x: model(x))(x), rtol=1e-5, atol=1e-6)


def main() -> int:
  # Full float32 matrix products: on a GPU, XLA's default takes TF32 for
  # them, and a rewrite that computes the same function in another order
  # (LoRA's x @ A @ B beside x @ W, against the merged W + A @ B) then
  # differs from its reference by about 1e-4 for that reason alone.
  jax.config.update('jax_default_matmul_precision', 'highest')
  device = jax.devices()[0]
  print(f'JAX {jax.__version__} on {jax.default_backend()}: '
        f'{device.device_kind} ({len(jax.devices())} device(s))')
  linen_checks()
  nnx_checks()
  width = max(len(r[0]) for r in ROWS)
  print(f'{"check":<{width}}  {"max |diff|":>11}  tolerance           ok')
  for name, diff, kind, rtol, atol, ok in ROWS:
    tol = (f'rel {rtol:g}' if kind == 'rel' else
           'exact' if rtol == atol == 0 else f'rtol {rtol:g} atol {atol:g}')
    print(f'{name:<{width}}  {diff:11.3g}  {tol:<18}  {"yes" if ok else "NO"}')
  bad = [r[0] for r in ROWS if not r[-1]]
  print(f'{len(ROWS) - len(bad)} of {len(ROWS)} checks ok'
        + (f'; not ok: {", ".join(bad)}' if bad else ''))
  return 1 if bad else 0


if __name__ == '__main__':
  sys.exit(main())
