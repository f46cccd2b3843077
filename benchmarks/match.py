"""Pattern matching time on full-size BERT-base, next to tracing time.

Run: ``python benchmarks/match.py`` (about a minute on 2 CPU cores; no
downloads: ``FlaxBertModel(BertConfig(), seed=0)`` has random weights), or
``--small`` for a tiny BERT (seconds).

Prints the median over ``--repeat`` runs of:

* ``make_mox``: tracing BERT's forward pass into a tree (a fresh function
  each run, so JAX's trace cache does not help);
* ``match``: ``yax.match(exact GELU, mox)`` on that tree, the pattern a fresh
  function each run (so it is traced again: no cache between runs), and the
  same with the pattern's traces cached (``match (cached pattern)``);
* ``group``: ``yax.group`` (matching included);
* the ratio match / make_mox (goal: under 0.25).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_FLAX', '1')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import yax  # noqa: E402


def median_s(fn, repeat: int) -> float:
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--small', action='store_true', help='tiny BERT')
  parser.add_argument('--repeat', type=int, default=5)
  args = parser.parse_args(argv)

  from transformers import BertConfig, FlaxBertModel
  sizes = (dict(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=37,
                max_position_embeddings=64) if args.small else {})
  t0 = time.perf_counter()
  model = FlaxBertModel(BertConfig(**sizes), seed=0)  # hidden_act='gelu'
  print(f'built BERT{" (small)" if args.small else "-base"} in '
        f'{time.perf_counter() - t0:.1f} s')
  ids = jnp.ones((1, 128), jnp.int32)

  def trace():
    fn = lambda params, ids: model(ids, params=params)  # fresh: no cache
    return yax.make_mox(fn)(model.params, ids)

  mox = trace()
  n_eqns = len(yax.query('//*[@primitive != "module_call"]', mox))
  n_calls = len(yax.query('//module_call', mox))
  print(f'tree: {n_eqns} equations, {n_calls} module calls')

  def fresh_match():
    gelu = lambda x: jax.nn.gelu(x, approximate=False)  # fresh: traced again
    return yax.match(gelu, mox)

  cached_gelu = lambda x: jax.nn.gelu(x, approximate=False)
  matches = yax.match(cached_gelu, mox)
  print(f'matches: {len(matches)} exact GELUs, at '
        f'{sorted({"/".join(m.path) for m in matches})[:2]} ...')

  t_trace = median_s(trace, args.repeat)
  t_match = median_s(fresh_match, args.repeat)
  t_cached = median_s(lambda: yax.match(cached_gelu, mox), args.repeat)
  t_group = median_s(lambda: yax.group(cached_gelu, mox, 'gelu'), args.repeat)
  print(f'make_mox:               {t_trace * 1e3:8.1f} ms')
  print(f'match:                  {t_match * 1e3:8.1f} ms  '
        f'(ratio to make_mox {t_match / t_trace:.3f}; goal < 0.25)')
  print(f'match (cached pattern): {t_cached * 1e3:8.1f} ms')
  print(f'group:                  {t_group * 1e3:8.1f} ms')
  print(f'jax: {jax.__version__}, median of {args.repeat}')


if __name__ == '__main__':
  main()
