"""Find the exact GELUs of a Hugging Face BERT by data flow and swap them.

JAX inlines ``jax.nn.gelu`` into the module that calls it: in
``FlaxBertIntermediate`` the exact GELU is six primitive equations (``mul``,
``neg``, ``mul``, ``erfc``, ``mul``, ``copy``), not a node that XPath can
select. ``yax.match`` finds them with the GELU itself as the pattern, and
``yax.sub`` replaces them. This script:

1. finds the exact GELUs (12 in BERT-base, one per layer);
2. groups them into ``module_call`` nodes named ``gelu`` (``yax.group``),
   selects them with XPath and writes the HTML viewer of the grouped tree;
3. swaps them for the tanh approximation and checks the result against the
   same weights in a BERT configured with ``hidden_act='gelu_new'``;
4. swaps them for a fewbit-style GELU (Novikov et al., "Few-bit Backward:
   Quantized Gradients of Activation Functions for Memory Footprint
   Reduction", 2023): the forward pass is the exact GELU, the backward pass
   uses a piecewise-constant derivative with a few levels, so only a small
   integer code per activation is saved for it. A ``jax.custom_vjp`` keeps
   that rule through the rewrite: the gradients of the rewritten tree equal
   those of a reference BERT that calls the custom function itself, and
   differ from the true gradients. A few optax steps fine-tune it.

Models are built from configs (random weights, no download). Run::

    python examples/gelu_swap.py            # a small BERT (seconds)
    python examples/gelu_swap.py --full     # BERT-base
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_FLAX', '1')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import yax  # noqa: E402

exact_gelu = lambda x: jax.nn.gelu(x, approximate=False)
tanh_gelu = lambda x: jax.nn.gelu(x, approximate=True)

# ------------------------------------------------------- fewbit-style GELU

# Segment boundaries of the piecewise-constant derivative; each level is
# the GELU's mean slope over its segment (0 and 1 on the unbounded ends), so
# the backward pass needs only the segment index (3 bits) of each input.
BOUNDS = np.array([-2.5, -1.0, -0.25, 0.25, 1.0, 2.5], np.float32)


def _levels() -> np.ndarray:
  g = np.asarray(exact_gelu(jnp.asarray(BOUNDS, jnp.float32)), np.float64)
  inner = np.diff(g) / np.diff(BOUNDS.astype(np.float64))
  return np.concatenate([[0.0], inner, [1.0]]).astype(np.float32)


LEVELS = _levels()


@jax.custom_vjp
def fewbit_gelu(x):
  """Exact GELU forward; piecewise-constant derivative backward."""
  return exact_gelu(x)


def _fewbit_fwd(x):
  code = jnp.searchsorted(jnp.asarray(BOUNDS), x).astype(jnp.uint8)
  return exact_gelu(x), code  # the residual: one small integer per input


def _fewbit_bwd(code, g):
  return (g * jnp.asarray(LEVELS, g.dtype)[code],)


fewbit_gelu.defvjp(_fewbit_fwd, _fewbit_bwd)


# ------------------------------------------------------------ the model

def random_params(model, shape, seed=0):
  """Random weights of the HF model's shapes (``jax.eval_shape`` of its
  init): kernels with std 1/sqrt(fan_in), so GELU inputs spread over the
  range where the exact and tanh GELUs differ; LayerNorm scales 1."""
  shapes = jax.eval_shape(lambda k: model.init_weights(k, shape),
                          jax.random.key(0))
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = str(getattr(path[-1], 'key', path[-1]))
    if name == 'scale':
      return np.ones(leaf.shape, leaf.dtype)
    fan_in = leaf.shape[0] if leaf.ndim > 1 else 100
    return (rng.standard_normal(leaf.shape) / np.sqrt(fan_in)).astype(
        leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def bert_config(full: bool, act: str):
  from transformers import BertConfig
  sizes = {} if full else dict(
      vocab_size=99, hidden_size=32, num_hidden_layers=3,
      num_attention_heads=4, intermediate_size=37,
      max_position_embeddings=64)
  return BertConfig(hidden_act=act, **sizes)


@contextlib.contextmanager
def hf_gelu_is(fn):
  """Makes HF Flax modules that look up ``ACT2FN['gelu']`` get ``fn``."""
  from transformers import modeling_flax_utils
  table = modeling_flax_utils.ACT2FN
  saved = table['gelu']
  table['gelu'] = fn
  try:
    yield
  finally:
    table['gelu'] = saved


def max_diff(a, b) -> float:
  return max(float(jnp.abs(x - y).max()) for x, y in
             zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--full', action='store_true', help='BERT-base')
  parser.add_argument('--steps', type=int, default=3,
                      help='fine-tuning steps')
  parser.add_argument('--html', default='gelu_swap.html',
                      help='where to write the viewer of the grouped tree')
  args = parser.parse_args(argv)
  from transformers import FlaxBertModel

  start = time.perf_counter()
  model = FlaxBertModel(bert_config(args.full, 'gelu'), _do_init=False)
  seq = 128 if args.full else 16
  ids = jax.random.randint(jax.random.key(1), (2, seq), 0,
                           model.config.vocab_size)
  params = random_params(model, ids.shape)
  mox = yax.make_mox(lambda p, i: model(i, params=p))(params, ids)
  print(f'traced BERT ({model.config.num_hidden_layers} layers) in '
        f'{time.perf_counter() - start:.1f} s')

  # 1. Find the exact GELUs.
  t0 = time.perf_counter()
  matches = yax.match(exact_gelu, mox)
  t_match = time.perf_counter() - t0
  print(f'found {len(matches)} exact GELUs in {t_match * 1e3:.0f} ms, e.g. '
        f'{matches[0]}')
  print(f'enclosing modules: {sorted({m.path[-1] for m in matches})}, '
        f'{len(matches)} of {model.config.num_hidden_layers} layers')

  # 2. Group them into nodes: XPath, printing and the viewer see them.
  grouped = yax.group(exact_gelu, mox, 'gelu')
  yax.check_mox(grouped)
  nodes = yax.query('//module_call[@name="gelu"]', grouped)
  print(f'XPath //module_call[@name="gelu"] selects {len(nodes)} nodes, '
        f'e.g. at {"/".join(nodes[0].path)}')
  print(yax.query('//module_call[@type="FlaxBertIntermediate"]', grouped)[0])
  run = lambda tree: jax.jit(lambda p, i: yax.eval_mox(tree, p, i))
  same = max_diff(run(grouped)(params, ids), run(mox)(params, ids))
  print(f'grouped tree evaluates like the original: max |diff| = {same:.1e}')
  size = yax.write_html(grouped, args.html, title='BERT, GELUs grouped')
  print(f'viewer of the grouped tree written to {args.html} ({size} bytes)')

  # 3. Swap for the tanh approximation; check against HF's gelu_new BERT.
  tanh_tree = yax.sub(matches, yax.trace_like(tanh_gelu), mox)
  yax.check_mox(tanh_tree)
  ref_model = FlaxBertModel(bert_config(args.full, 'gelu_new'),
                            _do_init=False)
  ref = jax.jit(lambda p, i: ref_model(i, params=p))(params, ids)
  d_new = max_diff(run(tanh_tree)(params, ids).last_hidden_state,
                   ref.last_hidden_state)
  d_old = max_diff(run(mox)(params, ids).last_hidden_state,
                   ref.last_hidden_state)
  print(f'tanh swap vs HF gelu_new BERT: max |diff| = {d_new:.2e} '
        f'(original exact-GELU BERT: {d_old:.2e})')

  # 4. Swap for the fewbit GELU; its backward pass is kept.
  few_tree = yax.sub(matches, yax.trace_like(fewbit_gelu), mox)
  yax.check_mox(few_tree)
  n_vjp = len(yax.query('//custom_vjp_call', few_tree))
  print(f'fewbit swap: {n_vjp} custom_vjp_call equations, '
        f'{len(yax.match(exact_gelu, few_tree))} exact GELUs left')
  target = jax.random.normal(jax.random.key(2), (2, seq,
                                                 model.config.hidden_size))

  def loss_of(apply):
    return lambda p: jnp.mean((apply(p, ids).last_hidden_state - target) ** 2)

  tree_loss = lambda tree: loss_of(lambda p, i: yax.eval_mox(tree, p, i))
  with hf_gelu_is(fewbit_gelu):  # a BERT that calls fewbit_gelu itself
    direct = FlaxBertModel(bert_config(args.full, 'gelu'), _do_init=False)
    direct_loss = loss_of(lambda p, i: direct(i, params=p))
    g_ref = jax.jit(jax.grad(direct_loss))(params)
  g_few = jax.jit(jax.grad(tree_loss(few_tree)))(params)
  g_true = jax.jit(jax.grad(tree_loss(mox)))(params)
  scale = max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(g_ref))
  print(f'gradients of the fewbit tree vs a BERT calling fewbit_gelu: '
        f'max |diff| = {max_diff(g_few, g_ref):.2e} (largest gradient '
        f'{scale:.2e}); vs the true GELU gradients: '
        f'{max_diff(g_few, g_true):.2e}')

  # A few steps of fine-tuning through the rewritten tree, and the same
  # steps through the reference BERT: the same trajectory.
  opt = optax.adam(1e-3)

  def trainer(loss):
    @jax.jit
    def step(p, state):
      value, grads = jax.value_and_grad(loss)(p)
      updates, state = opt.update(grads, state, p)
      return optax.apply_updates(p, updates), state, value
    return step

  def train(step):
    p, state, losses = params, opt.init(params), []
    for _ in range(args.steps):
      p, state, value = step(p, state)
      losses.append(float(value))
    return p, losses

  p_few, losses = train(trainer(tree_loss(few_tree)))
  with hf_gelu_is(fewbit_gelu):
    p_ref, losses_ref = train(trainer(direct_loss))
  print('fine-tuning losses: ' + ' -> '.join(f'{v:.4f}' for v in losses))
  print(f'after {args.steps} steps, params trained through the tree vs the '
        f'reference BERT: max |diff| = {max_diff(p_few, p_ref):.2e}')
  print(f'done in {time.perf_counter() - start:.1f} s')
  ok = (len(matches) == model.config.num_hidden_layers and same == 0.0
        and d_new < d_old / 20 and max_diff(g_few, g_ref) < 1e-4 * scale
        and max_diff(g_few, g_true) > 1e-3 * scale)
  return 0 if ok else 1


if __name__ == '__main__':
  raise SystemExit(main())
