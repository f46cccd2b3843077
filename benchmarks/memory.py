"""Training memory of YAX's memory rewrites on Hugging Face BERT and RoBERTa.

Run: ``python benchmarks/memory.py`` (BERT-base and RoBERTa-base for
sequence classification, batch 128, length 128, float32: the memory
columns come from tracing and compiling one training step at that size,
nothing of that size is run; step time and gradient error run the same
variants at ``--time-batch`` (default 4) on 2 shared CPU cores), or
``--small`` (2-layer width-128 models, batch 8, length 32, a couple of
minutes). ``--models bert`` for one model, ``--batch``/``--seq`` to change
the size, ``--no-time`` for the memory columns only, ``--variants
randomized,fewbit`` for the baseline and those variants only. Weights are random (from the configs); nothing is downloaded.

One training step: cross-entropy of the classifier's logits, its gradient
and an Adam update (optax), jitted with the params and Adam state donated.
Dropout is off (``train=False``), so every variant computes the same
function. Variants, each a rewrite of the traced model
(``yax.make_mox(lambda p, ids, mask: model(...).logits)``):

* ``baseline``: the traced model, as it is;
* ``fewbit 3-bit GELU``: ``yax.fewbit`` with ``bits=3`` searching each
  layer's MLP (``//module_call[@type="FlaxBertIntermediate"]``): the GELU
  of every layer and nothing else (the pooler's ``tanh`` keeps its exact
  derivative; a "missing" row while ``yax.fewbit`` is not in this
  checkout);
* ``randomized 20%``: ``yax.randomized_linear`` of every ``Dense``,
  ``ratio=0.2`` (a new ``sketch_key`` per step), with the default count
  sketch (linear in the rows);
* ``randomized 20% gaussian``: the same with ``kind='gaussian'`` (the
  dense sketch, quadratic in the rows), side by side;
* ``fewbit + randomized``: both;
* ``lean_norm(activations)``: ``yax.lean_norm(..., activations=True)``
  (each LayerNorm keeps its input and row statistics, each activation its
  input);
* ``fewbit + randomized + lean``: the three together (fewbit first);
* ``remat every layer``: ``yax.remat`` of every ``Flax*Layer`` call;
* ``HF gradient_checkpointing``: the same model built with
  ``gradient_checkpointing=True`` (not a YAX rewrite: the reference);
* ``remat dots_no_batch``: ``yax.remat`` of every layer with
  ``policy='dots_with_no_batch_dims_saveable'``;
* ``plan 0.5``, ``plan 0.25``, ``plan 0.12``: ``yax.fit_memory`` of the
  traced model at those budgets (fractions of the baseline's training
  memory), every choice allowed; its table is printed, and its choices are
  made again (``MemoryPlan.apply``) on the trace at ``--time-batch``. A
  budget below the least memory the planner reaches is a "refused" row
  naming that memory. ``--plan-choices lean_norm,remat`` restricts the
  choices (exact gradients).

Columns:

* ``saved MiB``: the bytes JAX keeps for the backward pass of the loss
  (``jax.ad_checkpoint.print_saved_residuals``), the arguments (params,
  inputs) and literals excluded;
* ``train MiB`` and ``ratio``: the headline, as PyTorch's peak counts it in
  fewbit's table: 4 x param bytes (params, gradients, two Adam moments) plus
  the saved bytes, and its ratio to the baseline. It depends only on the
  traced program, not on the backend;
* ``XLA arg/out/temp/alias MiB``: ``compiled.memory_analysis()`` of the
  jitted training step. On CPU, XLA's schedule is not memory-aware, so the
  temp column is printed for reference, not as the goal;
* ``step x``: median step time at ``--time-batch`` against the baseline's,
  measured side by side: each of ``--rounds`` rounds (default 5) runs one
  step of every variant in turn, so a change of load on the (shared)
  machine slows every variant alike; ``--time-batch 16 --seq 128`` is the
  issue's n = 2,048 rows;
* ``grad err``: ``||g - g_exact|| / ||g_exact||`` over all params at
  ``--time-batch`` (one sketch key for the randomized variants);
* ``peak MiB`` and ``peak r``: ``train MiB`` plus ``yax.memory_report``'s
  ``recompute`` (the largest body a rematerialized call recomputes while
  its backward pass runs), and its ratio to the baseline's; what
  ``yax.fit_memory`` plans on.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import statistics
import sys
import time
import traceback

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_TF', '0')
os.environ.setdefault('USE_FLAX', '1')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))

import jax  # noqa: E402
import jax.ad_checkpoint  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import yax  # noqa: E402

MiB = 2 ** 20
_DTYPE_BYTES = {'f64': 8, 'f32': 4, 'bf16': 2, 'f16': 2, 'i64': 8, 'i32': 4,
                'i16': 2, 'i8': 1, 'u64': 8, 'u32': 4, 'u16': 2, 'u8': 1,
                'bool': 1, 'pred': 1, 'u4': 0.5, 'i4': 0.5, 'key<fry>': 8}


def _type_bytes(type_str: str) -> float:
  """``f32[128,128,768]`` -> bytes (a threefry key, ``key<fry>[]``: its
  two uint32 words)."""
  m = re.fullmatch(r'([a-z0-9]+|key<fry>)\[([0-9,]*)\]', type_str)
  if m is None:
    raise ValueError(f'cannot read the residual type {type_str!r}')
  dims = [int(d) for d in m.group(2).split(',') if d]
  return _DTYPE_BYTES[m.group(1)] * math.prod(dims)


def saved_bytes(fn, *args) -> float:
  """Bytes JAX keeps for the backward pass of ``fn``, arguments and
  literals excluded."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
  return sum(_type_bytes(line.split(' ')[0])
             for line in buf.getvalue().splitlines()
             if line and ' from the argument ' not in line
             and ' from a literal' not in line)


# ------------------------------------------------------------------ models

def build(name: str, small: bool, checkpointing: bool = False, params=None):
  from transformers import (BertConfig, FlaxBertForSequenceClassification,
                            FlaxRobertaForSequenceClassification,
                            RobertaConfig)
  size = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=512) if small else {}
  if name == 'bert':
    config = BertConfig(num_labels=2, **size)
    cls, layer = FlaxBertForSequenceClassification, 'FlaxBertLayer'
  else:  # roberta-base's own config values
    config = RobertaConfig(vocab_size=50265, max_position_embeddings=514,
                           type_vocab_size=1, layer_norm_eps=1e-5,
                           pad_token_id=1, bos_token_id=0, eos_token_id=2,
                           num_labels=2, **size)
    cls, layer = FlaxRobertaForSequenceClassification, 'FlaxRobertaLayer'
  model = cls(config, seed=0, gradient_checkpointing=checkpointing,
              _do_init=params is None)
  return model, layer, (model.params if params is None else params)


def batch_of(batch: int, seq: int, vocab: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(rng.integers(3, vocab, (batch, seq)), jnp.int32)
  mask = jnp.ones((batch, seq), jnp.int32)
  labels = jnp.asarray(rng.integers(0, 2, (batch,)), jnp.int32)
  return ids, mask, labels


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# ---------------------------------------------------------------- variants

PLAN_BUDGETS = (0.5, 0.25, 0.12)


def plans(mox, labels, choices) -> dict:
  """``yax.fit_memory`` of ``mox`` at each budget: name -> the plan, or a
  string saying why there is none."""
  out = {}

  def loss(logits):  # one function: the planner measures the tree once
    return cross_entropy(logits, labels)

  for budget in PLAN_BUDGETS:
    t0 = time.perf_counter()
    try:
      plan = yax.fit_memory(mox, loss, budget=budget, choices=choices)
    except yax.SubstitutionError as e:
      text = str(e)
      out[f'plan {budget}'] = (  # a budget below the least reachable
          'refused: ' + text.split(' reach: ')[-1] if ' reach: ' in text
          else f'fails: {text[:200]}')
      continue
    print(f'plan {budget} ({time.perf_counter() - t0:.0f} s to plan):\n'
          f'{plan}', flush=True)
    out[f'plan {budget}'] = plan
  return out


def variants(model, layer: str, hf_checkpointed, params, ids, mask,
             planned: dict | None = None):
  """name -> (loss(params, ids, mask, labels, key), takes_key) or a string
  saying why the variant is missing. ``planned``: name -> a
  ``yax.MemoryPlan`` (made again on this trace) or a string."""
  def forward(p, ids, mask):
    return model(ids, attention_mask=mask, params=p, train=False).logits

  mox = yax.make_mox(forward)(params, ids, mask)
  dense = '//module_call[@type="Dense"]'
  layers = f'//module_call[@type="{layer}"]'

  def of(tree):
    if isinstance(tree, str):
      return tree
    takes_key = 'sketch_key' in jax.tree_util.tree_unflatten(
        tree.in_tree, tree.inputs)[1]

    def loss(p, ids, mask, labels, key):
      kw = {'sketch_key': key} if takes_key else {}
      return cross_entropy(yax.eval_mox(tree, p, ids, mask, **kw), labels)
    return loss

  def hf(p, ids, mask, labels, key):
    del key
    logits = hf_checkpointed(ids, attention_mask=mask, params=p,
                             train=False).logits
    return cross_entropy(logits, labels)

  fewbit = getattr(yax, 'fewbit', None)
  missing = 'missing: yax.fewbit is not in this checkout'
  few = missing
  if fewbit:  # the GELU of each layer's MLP, and only it
    mlp = layer.replace('Layer', 'Intermediate')
    few = fewbit(mox, f'//module_call[@type="{mlp}"]', bits=3)
    names = {n.name for n in yax.query('//module_call[@type="FewBit"]', few)}
    if names != {'gelu'}:
      few = f'fails: fewbit in {mlp} rewrote {sorted(names)}, not GELU only'
  out = {
      'baseline': of(mox),
      'fewbit 3-bit GELU': of(few),
      'randomized 20%': of(yax.randomized_linear(mox, dense, ratio=0.2)),
      'randomized 20% gaussian': of(yax.randomized_linear(
          mox, dense, ratio=0.2, kind='gaussian')),
      'fewbit + randomized': of(
          yax.randomized_linear(few, dense, ratio=0.2) if fewbit else missing),
      'lean_norm(activations)': of(yax.lean_norm(mox, activations=True)),
      'fewbit + randomized + lean': of(yax.lean_norm(
          yax.randomized_linear(few, dense, ratio=0.2), activations=True)
          if fewbit else missing),
      'remat every layer': of(yax.remat(mox, layers)),
      'HF gradient_checkpointing': hf,
      'remat dots_no_batch': of(yax.remat(
          mox, layers, policy='dots_with_no_batch_dims_saveable')),
  }
  for label, plan in (planned or {}).items():
    out[label] = plan if isinstance(plan, str) else of(plan.apply(mox))
  return out


def train_step(loss, opt):
  def step(params, state, ids, mask, labels, key):
    grads = jax.grad(loss)(params, ids, mask, labels, key)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1))


def xla_memory(loss, opt, params, state, batch, key):
  compiled = train_step(loss, opt).lower(params, state, *batch,
                                         key).compile()
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes, m.output_size_in_bytes,
          m.temp_size_in_bytes, m.alias_size_in_bytes)


def step_times(losses: dict, opt, params, batch, key, rounds: int
               ) -> dict[str, float]:
  """Median step time of each variant, measured side by side: each round
  runs one step of every variant in turn (one params/Adam state passed
  from step to step: the steps donate them), so a change of load on the
  machine slows every variant alike."""
  steps = {label: train_step(loss, opt) for label, loss in losses.items()}
  p = jax.tree_util.tree_map(jnp.array, params)
  s = opt.init(params)
  for step in steps.values():  # compile and warm up
    p, s = step(p, s, *batch, key)
    jax.block_until_ready(p)
  times = {label: [] for label in steps}
  for _ in range(rounds):
    for label, step in steps.items():
      t0 = time.perf_counter()
      p, s = step(p, s, *batch, key)
      jax.block_until_ready(p)
      times[label].append(time.perf_counter() - t0)
  return {label: statistics.median(t) for label, t in times.items()}


def grad_error(loss, exact, params, batch, key) -> float:
  g = jax.jit(jax.grad(loss))(params, *batch, key)
  num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(
      jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(exact)))
  den = sum(float(jnp.sum(b ** 2)) for b in jax.tree_util.tree_leaves(exact))
  return math.sqrt(num / den)


# -------------------------------------------------------------------- main

def run_model(name: str, args) -> list[str]:
  small = args.small
  model, layer, params = build(name, small)
  hf_gc, _, _ = build(name, small, checkpointing=True, params=params)
  vocab = model.config.vocab_size
  big = batch_of(args.batch, args.seq, vocab)
  little = batch_of(args.time_batch, args.seq, vocab, seed=1)
  key = jax.random.PRNGKey(0)
  opt = optax.adam(1e-4)
  state = opt.init(params)
  param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  planned = {}
  if not args.variants or any(w.strip().startswith('plan')
                              for w in args.variants.split(',')):
    def forward(p, ids, mask):
      return model(ids, attention_mask=mask, params=p, train=False).logits
    planned = plans(yax.make_mox(forward)(params, big[0], big[1]), big[2],
                    tuple(args.plan_choices.split(',')))
  found = _only(variants(model, layer, hf_gc, params, big[0], big[1],
                         planned), args.variants)
  if args.no_time:
    timed = exact = times = None
  else:  # the traced trees have the benchmark's batch: trace again
    timed = _only(variants(model, layer, hf_gc, params, little[0],
                           little[1], planned), args.variants)
    exact = jax.jit(jax.grad(timed['baseline']))(params, *little, key)
    times = step_times({k: v for k, v in timed.items()
                        if not isinstance(v, str)}, opt, params, little, key,
                       args.rounds)
  lines = [f'{name}: {param_bytes / MiB:.1f} MiB of params, batch '
           f'{args.batch} x {args.seq} (step time, the median of '
           f'{args.rounds} steps side by side, and gradient error at batch '
           f'{"-" if args.no_time else args.time_batch} x {args.seq})',
           f'{"variant":28s} {"saved MiB":>10s} {"train MiB":>10s} '
           f'{"ratio":>6s} {"XLA arg":>8s} {"out":>8s} {"temp":>8s} '
           f'{"alias":>8s} {"step x":>7s} {"grad err":>9s} '
           f'{"peak MiB":>9s} {"peak r":>6s}']
  base_train = base_time = base_peak = None
  for label, loss in found.items():
    if isinstance(loss, str):
      lines.append(f'{label:28s} {loss}')
      print(lines[-1], flush=True)
      continue
    try:
      saved = saved_bytes(loss, params, *big, key)
      train = 4 * param_bytes + saved
      base_train = base_train or train
      arg, out, temp, alias = xla_memory(loss, opt, params, state, big, key)
      if args.no_time:
        timing = f'{"-":>7s} {"-":>9s}'
      else:
        t = times[label]
        base_time = base_time or times['baseline']
        err = grad_error(timed[label], exact, params, little, key)
        timing = f'{t / base_time:7.2f} {err:9.2e}'
      # The peak: training memory plus the largest body a rematerialized
      # call recomputes in its backward pass (memory_report's recompute).
      peak = train + yax.memory_report(loss, params, *big, key,
                                       xla=False).recompute
      base_peak = base_peak or peak
      lines.append(
          f'{label:28s} {saved / MiB:10.1f} {train / MiB:10.1f} '
          f'{train / base_train:6.3f} {arg / MiB:8.1f} {out / MiB:8.1f} '
          f'{temp / MiB:8.1f} {alias / MiB:8.1f} {timing} '
          f'{peak / MiB:9.1f} {peak / base_peak:6.3f}')
    except Exception as e:  # noqa: BLE001 - a failing variant is a row
      if args.verbose:
        traceback.print_exc()
      lines.append(f'{label:28s} fails: {type(e).__name__}: {str(e)[:200]}')
    print(lines[-1], flush=True)
  return lines


def _only(found: dict, wanted: str | None) -> dict:
  """The baseline (every ratio is to it) and the variants whose names
  start with one of the comma-separated ``wanted``."""
  if not wanted:
    return found
  prefixes = [w.strip() for w in wanted.split(',')]
  return {k: v for k, v in found.items()
          if k == 'baseline' or any(k.startswith(p) for p in prefixes)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--small', action='store_true')
  parser.add_argument('--models', default='bert,roberta')
  parser.add_argument('--batch', type=int, default=None)
  parser.add_argument('--seq', type=int, default=None)
  parser.add_argument('--time-batch', type=int, default=None)
  parser.add_argument('--no-time', action='store_true',
                      help='memory columns only (no step time, no gradient '
                      'error: each needs two more compiles per variant)')
  parser.add_argument('--variants', default=None,
                      help='comma-separated name prefixes of the variants to '
                      'run beside the baseline, e.g. "randomized,fewbit"')
  parser.add_argument('--plan-choices',
                      default='lean_norm,remat,fewbit,randomized',
                      help='what yax.fit_memory may choose for the "plan" '
                      'variants (comma-separated)')
  parser.add_argument('--rounds', type=int, default=5,
                      help='steps timed per variant, side by side (the '
                      'median is printed)')
  parser.add_argument('--verbose', action='store_true')
  args = parser.parse_args(argv)
  args.batch = args.batch or (8 if args.small else 128)
  args.seq = args.seq or (32 if args.small else 128)
  args.time_batch = args.time_batch or (args.batch if args.small else 4)
  print(f'jax {jax.__version__}, {jax.devices()[0].platform}, '
        f'{os.cpu_count()} CPUs; command: python benchmarks/memory.py '
        + ' '.join(sys.argv[1:] if argv is None else argv), flush=True)
  out = []
  for name in args.models.split(','):
    lines = run_model(name.strip(), args)
    out.extend(lines + [''])
  print('\n'.join(out))


if __name__ == '__main__':
  main()
