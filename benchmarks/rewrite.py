"""LoRA rewrite timings on full-size BERT-base, next to a hand-written LoRA.

Run: ``python benchmarks/rewrite.py`` (a few minutes on 2 CPU cores; no
downloads: ``FlaxBertModel(BertConfig(), seed=0)`` has random weights), or
``--small`` for a tiny BERT (seconds). ``--batch 8`` for ids of shape
(8, 128); ``--goals-only`` stops after the goals table.

Prints, in one run:

* the three speed goals side by side (issue 24), each beside its goal, in
  CPU seconds of this process (steadier than wall time on a shared
  machine; wall time printed next to it), the garbage collected before
  each timed call (a collection owed by earlier work must not land on it)
  but left on during it:
  - tracing: ``make_mox`` / ``make_jaxpr`` beside the interceptor floor
    (``make_jaxpr`` under a Flax interceptor that does nothing), medians
    of interleaved runs (``trace_eval.measure_trace``); goal: at most 0.1
    above the floor;
  - the first ``yax.lora`` of the process, on a fresh traced tree (goal:
    <= 0.3 s; it builds the tree's XML view for the query and traces each
    adapter shape), and the median over further fresh trees;
  - the first ``yax.quantize(weight='int8')`` of every Dense layer, on
    another fresh traced tree (goal: <= 0.5 s; it compiles the
    quantization once per kernel shape), and the median over further
    fresh trees;
* ``yax.lora`` on every Dense layer (73 in BERT-base) of an already-traced
  tree: the warm median (goal: <= 0.5 s), the XPath query part
  alone and ``yax.lora`` given the pre-queried node list;
* ``yax.quantize`` warm median on the same tree;
* steady-state ``jax.jit`` runtime and XLA FLOPs of
  - the LoRA MoX: ``jit(lambda p, x: yax.eval_mox(res.mox, p, x))``;
  - the baseline, a hand-written Flax LoRA with the same shapes: the original
    HF model run under ``flax.linen.intercept_methods`` so that every
    ``nn.Dense`` computes ``y = x W + b + (alpha / rank) * (x A) B`` (the
    same math, same order, as the MoX; no YAX involved);
  - the HF model without adapters, for reference;
  and the ratio LoRA MoX / baseline (goal: <= 1.05), plus the largest output
  difference between the two.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import re
import statistics
import time

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_FLAX', '1')

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import yax  # noqa: E402

import trace_eval  # noqa: E402  (benchmarks/, first on sys.path when run)

DENSE = '//module_call[@type="Dense"]'


def median_s(fn, repeat: int) -> float:
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def cpu_and_wall(fn) -> tuple[float, float]:
  """CPU seconds of this process and wall seconds of one ``fn()``, after a
  garbage collection (the collector stays on during the call)."""
  gc.collect()
  c0, w0 = time.process_time(), time.perf_counter()
  fn()
  return time.process_time() - c0, time.perf_counter() - w0


def goals(trace, make_fresh, lora, quantize, repeat: int) -> list:
  """The rows of the goals table: ``(name, CPU s, wall s, goal text,
  met)``. ``make_fresh()`` traces the model anew; ``lora(mox)`` and
  ``quantize(mox)`` rewrite one tree. The first call of each rewrite is
  the first of this process (nothing compiled or traced for it yet)."""
  (mox_t, jaxpr_t), (noop_t, jaxpr2_t) = trace['trace'], trace['noop']
  ratio, floor = mox_t / jaxpr_t, noop_t / jaxpr2_t
  rows = [('tracing: make_mox / make_jaxpr', ratio, None,
           f'<= floor + 0.1 = {floor + 0.1:.2f} (floor: no-op '
           f'interceptor {floor:.2f}; {mox_t * 1e3:.0f} ms / '
           f'{jaxpr_t * 1e3:.0f} ms)', ratio <= floor + 0.1)]
  for name, fn, goal in (('yax.lora', lora, 0.3),
                         ('yax.quantize int8', quantize, 0.5)):
    trees = [make_fresh() for _ in range(repeat + 1)]
    first = cpu_and_wall(lambda: fn(trees[0]))
    rest = [cpu_and_wall(lambda t=t: fn(t)) for t in trees[1:]]
    del trees
    rows.append((f'{name}, first call, fresh tree', *first,
                 f'<= {goal} s', first[0] <= goal))
    cpu = statistics.median(c for c, _ in rest)
    wall = statistics.median(w for _, w in rest)
    rows.append((f'{name}, median of {repeat} more fresh trees', cpu, wall,
                 f'<= {goal} s', cpu <= goal))
  return rows


def print_goals(rows) -> None:
  width = max(len(r[0]) for r in rows)
  print(f'\n{"speed goal (issue 24)":<{width}}  {"CPU s":>7}  {"wall s":>7}'
        '  goal')
  for name, cpu, wall, goal, met in rows:
    wall_text = '' if wall is None else f'{wall:.3f}'
    cpu_text = f'{cpu:.3f}' if wall is not None else f'{cpu:.2f}x'
    print(f'{name:<{width}}  {cpu_text:>7}  {wall_text:>7}  {goal}: '
          f'{"OK" if met else "MISSED"}')


def flops(compiled) -> float:
  """FLOPs from ``cost_analysis()``: a dict, or a list of dicts on some JAX
  versions."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get('flops', float('nan')))


def hlo_ops(compiled) -> collections.Counter:
  """Instruction counts by opcode in the optimized HLO."""
  return collections.Counter(
      re.findall(r'= \S+ (\w[\w-]*)\(', compiled.as_text()))


def split_adapters(params):
  """(params without adapters, {module path: (lora_a, lora_b)})."""
  adapters = {}

  def walk(tree, path):
    if not isinstance(tree, dict):
      return tree
    if 'lora_a' in tree:
      adapters[path] = (tree['lora_a'], tree['lora_b'])
    return {k: walk(v, (*path, k)) for k, v in tree.items()
            if k not in ('lora_a', 'lora_b')}

  return walk(params, ()), adapters


def flax_lora(model, scale: float):
  """The baseline: the HF model with LoRA added to every ``nn.Dense`` by a
  Flax method interceptor. Takes the same params tree as the LoRA MoX."""

  def forward(params, ids):
    base, adapters = split_adapters(params)

    def interceptor(next_fun, args, kwargs, context):
      y = next_fun(*args, **kwargs)
      if context.method_name != '__call__' or not isinstance(
          context.module, nn.Dense):
        return y
      a, b = adapters[tuple(context.module.scope.path)]
      x = args[0]
      delta = (x.astype(a.dtype) @ a) @ b
      return y + (scale * delta).astype(y.dtype)

    with nn.intercept_methods(interceptor):
      return model(ids, params=base).last_hidden_state

  return forward


def timed(fns: dict, args, rounds: int, calls: int) -> dict:
  """Per-call seconds (median and best round) of each compiled function,
  interleaved in rounds so that machine noise hits all of them alike."""
  samples = {name: [] for name in fns}
  for fn in fns.values():  # warm up
    for _ in range(2):
      jax.block_until_ready(fn(*args))
  for _ in range(rounds):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - t0) / calls)
  return {name: (statistics.median(s), min(s)) for name, s in samples.items()}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--small', action='store_true',
                      help='a tiny BERT and few repeats (seconds)')
  parser.add_argument('--batch', type=int, default=1)
  parser.add_argument('--seq', type=int, default=128)
  parser.add_argument('--rank', type=int, default=8)
  parser.add_argument('--alpha', type=float, default=16.0)
  parser.add_argument('--goals-only', action='store_true',
                      help='print the goals table only')
  parser.add_argument('--trace-repeats', type=int, default=11,
                      help='interleaved tracing runs per median (default 11, '
                      'as trace_eval.py)')
  parser.add_argument('--fresh-repeats', type=int, default=3,
                      help='fresh traced trees per rewrite median after '
                      'the first (default 3)')
  parser.add_argument('--rounds', type=int, default=None,
                      help='timing rounds (default 15, 3 with --small)')
  args = parser.parse_args(argv)

  from transformers import BertConfig, FlaxBertModel
  if args.small:
    config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=37,
                        max_position_embeddings=64)
    args.seq = min(args.seq, 32)
    repeat, rounds, calls = 3, 3, 5
  else:
    config = BertConfig()
    repeat, rounds, calls = 7, 15, 3
  rounds = args.rounds or rounds

  t0 = time.perf_counter()
  model = FlaxBertModel(config, seed=0)
  ids = jax.random.randint(jax.random.key(0), (args.batch, args.seq), 0,
                           config.vocab_size)
  t1 = time.perf_counter()
  make_fresh = lambda: yax.make_mox(lambda p, x: model(x, params=p))(
      model.params, ids)
  mox = make_fresh()
  t2 = time.perf_counter()
  print(f'model: FlaxBertModel({"small config" if args.small else "BertConfig()"}'
        f'), ids {tuple(ids.shape)}, built in {t1 - t0:.1f} s, traced in '
        f'{t2 - t1:.2f} s; backend {jax.default_backend()}, '
        f'jax {jax.__version__}')

  # -- the goals, side by side: tracing first (nothing compiled yet, as in
  # trace_eval.py), then the first rewrite of each kind in this process.
  trace_eval.CLOCK = time.process_time
  trace = trace_eval.measure_trace(model, ids, model.params,
                                   {'trace': args.trace_repeats})
  lora_on = lambda tree: yax.lora(tree, model.params, DENSE, rank=args.rank,
                                  alpha=args.alpha, key=jax.random.key(1))
  quantize_on = lambda tree: yax.quantize(tree, model.params, DENSE,
                                          weight='int8')
  print_goals(goals(trace, make_fresh, lora_on, quantize_on,
                    args.fresh_repeats))
  if args.goals_only:
    return

  # -- the rewrite itself, on one traced tree
  lora = lambda sel: yax.lora(mox, model.params, sel, rank=args.rank,
                              alpha=args.alpha, key=jax.random.key(1))
  t0 = time.perf_counter()
  res = lora(DENSE)
  first = time.perf_counter() - t0
  nodes = yax.query(DENSE, mox)
  warm = median_s(lambda: lora(DENSE), repeat)
  query = median_s(lambda: yax.query(DENSE, mox), max(repeat, 20))
  with_nodes = median_s(lambda: lora(nodes), repeat)

  quantize = lambda sel: yax.quantize(mox, model.params, sel, weight='int8')
  t0 = time.perf_counter()
  quantized = quantize(DENSE)
  first_quantize = time.perf_counter() - t0
  warm_quantize = median_s(lambda: quantize(DENSE), repeat)

  n_params = sum(x.size for x in jax.tree_util.tree_leaves(res.params))
  n_train = sum(x.size for x, m in zip(jax.tree_util.tree_leaves(res.params),
                                       jax.tree_util.tree_leaves(res.mask))
                if m)
  print(f'yax.lora(rank={args.rank}) on {len(res.paths)} Dense layers: '
        f'{n_train:,} adapter weights of {n_params:,}')
  rows = [
      ('yax.lora, first call on this tree', first,
       'builds the XML view (adapters traced above)'),
      ('yax.lora, warm median', warm,
       f'goal <= 0.5 s: {"OK" if warm <= 0.5 else "MISSED"}'),
      ('  of which the query', query, DENSE),
      ('yax.lora given the node list', with_nodes, 'no query'),
      (f'yax.quantize int8, {len(quantized.paths)} Dense, first on this '
       'tree', first_quantize, 'after lora: the XML view is built'),
      ('yax.quantize int8, warm median', warm_quantize,
       f'goal <= 0.5 s: {"OK" if warm_quantize <= 0.5 else "MISSED"}'),
  ]
  width = max(len(r[0]) for r in rows)
  print(f'\n{"rewrite":<{width}}  {"ms":>9}  notes')
  for name, s, note in rows:
    print(f'{name:<{width}}  {s * 1e3:9.1f}  {note}')

  # -- the rewritten model vs a hand-written LoRA
  # Trained-looking adapters (B = 0 would hide a wrong adapter path).
  leaves, tree = jax.tree_util.tree_flatten(res.params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  params = jax.tree_util.tree_unflatten(tree, [
      x + 0.02 * jax.random.normal(k, x.shape, x.dtype) if m else x
      for x, m, k in zip(leaves, jax.tree_util.tree_leaves(res.mask), keys)])

  fns = {
      'LoRA MoX (yax.eval_mox)':
          lambda p, x: yax.eval_mox(res.mox, p, x).last_hidden_state,
      'hand-written Flax LoRA': flax_lora(model, args.alpha / args.rank),
  }
  compiled, compile_s = {}, {}
  for name, fn in fns.items():
    t0 = time.perf_counter()
    compiled[name] = jax.jit(fn).lower(params, ids).compile()
    compile_s[name] = time.perf_counter() - t0
  plain, _ = split_adapters(params)
  t0 = time.perf_counter()
  compiled['HF model, no adapters'] = jax.jit(
      lambda p, x: model(x, params=p).last_hidden_state).lower(
          plain, ids).compile()
  compile_s['HF model, no adapters'] = time.perf_counter() - t0

  names = list(compiled)
  out_mox = compiled[names[0]](params, ids)
  out_ref = compiled[names[1]](params, ids)
  out_plain = compiled[names[2]](plain, ids)
  diff = float(jnp.abs(out_mox - out_ref).max())
  effect = float(jnp.abs(out_ref - out_plain).max())

  # The plain model takes the params without adapters: time it in the same
  # rounds through a wrapper with the same signature.
  run_plain = compiled[names[2]]
  run_s = timed({names[0]: compiled[names[0]], names[1]: compiled[names[1]],
                 names[2]: lambda p, x: run_plain(plain, x)}, (params, ids),
                rounds, calls)
  width = max(map(len, names))
  print(f'\n{"steady-state jit":<{width}}  {"median ms":>9}  {"best ms":>9}  '
        f'{"GFLOPs":>9}  {"compile s":>9}')
  for name in names:
    med, best = run_s[name]
    print(f'{name:<{width}}  {med * 1e3:9.2f}  {best * 1e3:9.2f}  '
          f'{flops(compiled[name]) / 1e9:9.4g}  {compile_s[name]:9.2f}')
  ratio = run_s[names[0]][0] / run_s[names[1]][0]
  best_ratio = run_s[names[0]][1] / run_s[names[1]][1]
  flop_ratio = flops(compiled[names[0]]) / flops(compiled[names[1]])
  print(f'\nruntime ratio LoRA MoX / hand-written: median {ratio:.3f}, best '
        f'{best_ratio:.3f} (goal <= 1.05: '
        f'{"OK" if min(ratio, best_ratio) <= 1.05 else "MISSED"}); '
        f'FLOPs ratio {flop_ratio:.4f} ({rounds} rounds of {calls} calls)')
  same = hlo_ops(compiled[names[0]]) == hlo_ops(compiled[names[1]])
  print(f'optimized HLO of the two: same instruction counts: {same} '
        f'({sum(hlo_ops(compiled[names[0]]).values())} vs '
        f'{sum(hlo_ops(compiled[names[1]]).values())} instructions)')
  print(f'max |LoRA MoX - hand-written| = {diff:.2e} '
        f'(the adapters move the output by {effect:.2e})')


if __name__ == '__main__':
  main()
