"""``yax.fit_memory`` against MaxText's own remat presets on a MaxText Llama
with scanned layers.

Run: ``python benchmarks/memory_maxtext.py`` (a small Llama 2: 4 scanned
layers, width 128, MLP 256, 4 heads, vocabulary 256, batch 8 x 256,
float32, random weights; a few minutes on 2 CPU cores); ``--layers``,
``--emb``, ``--mlp``, ``--vocab``, ``--batch``, ``--seq`` change the size,
``--presets`` and ``--choices`` narrow the rows. Needs MaxText (``bash
tests/install_real_models.sh``, Python >= 3.12). Nothing is downloaded.

The baseline keeps everything. MaxText has no preset that does: with
``scan_layers=True`` it wraps the scanned layer body in ``jax.checkpoint``
whatever the preset, and ``remat_policy='none'`` gives that checkpoint
``policy=None``, the same as ``'full'`` (both keep only each layer's
input: identical residuals and FLOPs, printed as two rows below). So the
baseline is MaxText's own model with ``remat_policy='none'`` built and
traced with MaxText's own ``skip_block_remat=True`` switch (which its
Gemma 4 and Qwen3-Next decoders use) forced on
``NNXDecoder._apply_layers_sequentially``: the same ``scan`` of the same
layer, with no ``checkpoint`` around the body, so it keeps every
residual. (A checkpoint with ``jax.checkpoint_policies.everything_saveable``
saves the same bytes, but a ``yax.remat`` nested inside it then saves
nothing: the outer policy keeps what the inner one drops. So it would
hide the per-layer choices from the planner.)

For the baseline and for each MaxText preset that needs no host memory
(``remat_policy``: ``none``, ``minimal``, ``save_dot_except_mlp``,
``save_qkv_proj``, ``save_out_proj``, ``full``), the model is built with
that preset and measured: peak training memory (``yax.memory_report``'s
``peak``: 4 x param bytes + the residuals JAX saves for the backward pass
+ the largest body a checkpoint recomputes in its backward pass) and XLA's
FLOP count of the compiled gradient (``cost_analysis``). Then
``yax.fit_memory`` plans the baseline's traced tree (``all``: every
choice; ``exact``: only ``lean_norm`` and ``remat``, both with the
planner's default remat policies ``None`` and ``'dots_saveable'``;
``exact+nobatch``: the exact ones with
``'dots_with_no_batch_dims_saveable'`` offered too, which keeps the
projections' outputs but not the attention scores, as MaxText's
``minimal`` keeps its named projections) with each preset's
training memory as its budget, and at 0.5, 0.25 and 0.12 of the
baseline's; the planned tree is measured the same way. The loss is the
cross-entropy of the logits against the tokens shifted by one.

Columns: ``peak MiB`` and its ratio to the baseline; ``grad GFLOP`` and
its ratio to the baseline (what recomputation costs); for each plan, the
same, and the seconds planning took.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import yax  # noqa: E402

MiB = 1 << 20
BASELINE = 'keep all'
PRESETS = ('none', 'minimal', 'save_dot_except_mlp', 'save_qkv_proj',
           'save_out_proj', 'full')
FRACTIONS = (0.5, 0.25, 0.12)
DEFAULT_POLICIES = (None, 'dots_saveable')  # fit_memory's own default
CHOICE_SETS = {  # name: (choices, remat policies)
    'all': (('lean_norm', 'remat', 'fewbit', 'randomized'), DEFAULT_POLICIES),
    'exact': (('lean_norm', 'remat'), DEFAULT_POLICIES),
    'exact+nobatch': (('lean_norm', 'remat'), DEFAULT_POLICIES + (
        'dots_with_no_batch_dims_saveable',)),
}


def _maxtext():
  saved = getattr(flax.config, 'flax_always_shard_variable', None)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)
    mods = {n.split('.')[-1]: importlib.import_module(f'maxtext.{n}')
            for n in ('configs.pyconfig', 'layers.quantizations',
                      'layers.nnx_decoders', 'models.models',
                      'utils.maxtext_utils')}
  if saved is not None:  # MaxText sets it at import; put it back
    flax.config.update('flax_always_shard_variable', saved)
  return mods


@contextlib.contextmanager
def _keep_everything(mt):
  """MaxText's decoder with its scanned layers not wrapped in
  ``jax.checkpoint`` (MaxText's own ``skip_block_remat`` switch)."""
  cls = mt['nnx_decoders'].NNXDecoder
  original = cls._apply_layers_sequentially

  def no_block_remat(self, *args, **kwargs):
    return original(self, *args, **{**kwargs, 'skip_block_remat': True})

  cls._apply_layers_sequentially = no_block_remat
  try:
    yield
  finally:
    cls._apply_layers_sequentially = original


def build(mt, args, policy):
  """``(run(state, tokens, positions), state, tokens, positions, ctx)`` of
  a Llama 2 with scanned layers and MaxText's ``remat_policy``."""
  base = os.path.join(os.path.dirname(mt['pyconfig'].__file__), 'base.yml')
  cfg = mt['pyconfig'].initialize(
      ['', base], model_name='llama2-7b', override_model_config=True,
      base_num_decoder_layers=args.layers, base_emb_dim=args.emb,
      base_mlp_dim=args.mlp, base_num_query_heads=4, base_num_kv_heads=4,
      head_dim=args.emb // 4, vocab_size=args.vocab, scan_layers=True,
      attention='dot_product', per_device_batch_size=args.batch,
      max_target_length=args.seq, max_prefill_predict_length=args.seq,
      enable_checkpointing=False, run_name='yax',
      base_output_directory=tempfile.mkdtemp(prefix='yax-bench-'),
      dtype='float32', weight_dtype='float32',
      remat_policy='none' if policy == BASELINE else policy,
      skip_jax_distributed_system=True)
  mesh = mt['maxtext_utils'].get_mesh_from_config(cfg)
  quant = mt['quantizations'].configure_quantization(cfg)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, args.vocab, (args.batch, args.seq)),
                       jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(args.seq), tokens.shape)

  @contextlib.contextmanager
  def ctx():
    with contextlib.ExitStack() as stack:
      stack.enter_context(jax.set_mesh(mesh))
      stack.enter_context(nn.logical_axis_rules(cfg.logical_axis_rules))
      if policy == BASELINE:
        stack.enter_context(_keep_everything(mt))
      yield

  with ctx():  # MaxText's model, an NNX Transformer wrapped as Linen
    model = mt['models'].transformer_as_linen(cfg, mesh, quant=quant)
    shapes = jax.eval_shape(lambda: model.init(
        {'params': jax.random.key(0), 'dropout': jax.random.key(1)},
        tokens, positions, enable_dropout=False))

  def fill(s):
    if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
      return jax.random.key(0)
    if not jnp.issubdtype(s.dtype, jnp.floating):
      return jnp.zeros(s.shape, s.dtype)
    return jnp.asarray(rng.normal(0.0, 0.05, s.shape), s.dtype)

  state = jax.tree.map(fill, shapes)
  run = lambda v, t, p: model.apply(v, t, p, enable_dropout=False)
  return run, state, tokens, positions, ctx


def xent(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], tokens[:, 1:]).mean()


def measure(loss, state, *rest):
  """(peak training bytes, gradient FLOPs) of ``loss(state, *rest)``: the
  peak, as ``yax.fit_memory`` plans on it, so that a preset's checkpointed
  layer pays for the layer it recomputes."""
  report = yax.memory_report(loss, state, *rest, xla=False)
  cost = jax.jit(jax.grad(loss, allow_int=True)).lower(
      state, *rest).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return report.peak, float(cost.get('flops', 0.0))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--emb', type=int, default=128)
  parser.add_argument('--mlp', type=int, default=256)
  parser.add_argument('--vocab', type=int, default=256)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--seq', type=int, default=256)
  parser.add_argument('--presets', default=','.join(PRESETS))
  parser.add_argument('--choices', default=','.join(CHOICE_SETS))
  args = parser.parse_args(argv)
  print(f'jax {jax.__version__}, {jax.devices()[0].platform}; command: '
        'python benchmarks/memory_maxtext.py '
        + ' '.join(sys.argv[1:] if argv is None else argv), flush=True)
  mt = _maxtext()
  measured = {}
  for policy in (BASELINE, *args.presets.split(',')):
    t0 = time.perf_counter()
    run, state, tokens, positions, ctx = build(mt, args, policy)
    loss = lambda s, t, p, run=run: xent(run(s, t, p), t)
    with ctx():
      measured[policy] = measure(loss, state, tokens, positions)
      if policy == BASELINE:
        mox = yax.make_mox(run)(state, tokens, positions)
    print(f'{policy}: {measured[policy][0]:,} bytes, '
          f'{measured[policy][1]:,.0f} FLOPs '
          f'({time.perf_counter() - t0:.0f} s)', flush=True)
  base_mem, base_flops = measured[BASELINE]
  rows = []

  def row(label, mem, flops, seconds=None):
    took = '' if seconds is None else f'{seconds:8.0f}'
    rows.append(f'| {label} | {mem / MiB:.2f} | {mem / base_mem:.3f} | '
                f'{flops / 1e9:.3f} | {flops / base_flops:.3f} | {took} |')
    print(rows[-1], flush=True)

  for policy, (mem, flops) in measured.items():
    name = ('baseline: no remat (skip_block_remat)' if policy == BASELINE
            else f'MaxText remat_policy={policy}')
    row(name, mem, flops)
  budgets = [(f'{f} of the baseline', int(f * base_mem)) for f in FRACTIONS]
  seen = set()
  for policy, (mem, _) in measured.items():
    if policy != BASELINE and mem not in seen:
      seen.add(mem)
      budgets.append((f'{policy}\'s memory', int(mem)))
  for where, budget in budgets:
    for name in args.choices.split(','):
      label = f'fit_memory({name}) at {where}'
      t0 = time.perf_counter()
      try:
        with ctx():
          choices, policies = CHOICE_SETS[name]
          plan = yax.fit_memory(mox, lambda y: xent(y, tokens),
                                budget=budget, choices=choices,
                                policies=policies)
      except yax.SubstitutionError as e:
        rows.append(f'| {label} | refused: {str(e).splitlines()[0]} |'
                    ' | | | |')
        print(rows[-1], flush=True)
        continue
      seconds = time.perf_counter() - t0
      yax.check_mox(plan.mox)
      kw = ({'sketch_key': jax.random.key(1)}
            if plan.takes_sketch_key else {})
      loss = lambda s, t, p, tree=plan.mox, kw=kw: xent(
          yax.eval_mox(tree, s, t, p, **kw), t)
      with ctx():
        got = measure(loss, state, tokens, positions)
      print(plan, flush=True)
      row(label, *got, seconds)
  print('\n| variant | peak MiB | ratio | grad GFLOP | ratio | plan s |\n'
        '|---|---:|---:|---:|---:|---:|')
  print('\n'.join(rows))


if __name__ == '__main__':
  main()
