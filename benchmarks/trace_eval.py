"""Cost of tracing and replaying with YAX versus plain JAX, on real models.

For full-size BERT-base (``FlaxBertModel(BertConfig())``, input ids (1, 128))
and ResNet-50 (``FlaxResNetModel(ResNetConfig())``, images (1, 3, 224, 224))
with random weights, prints one table with these ratios (YAX / JAX, medians
over repeats, measurements interleaved so that machine load hits both alike):

* trace:        ``yax.make_mox(fn)(...)`` / ``jax.make_jaxpr(fn)(...)``
                (a fresh function object each time: make_jaxpr caches);
  (floor):      the same ``make_jaxpr`` under a Flax method interceptor that
                does nothing, i.e. what ``nn.intercept_methods`` alone costs;
* jit steady:   ``jit(eval_mox)`` / ``jit(fn)`` per call once compiled;
* jit first:    first call of a fresh ``jit`` (trace + compile + run);
* eager:        ``eval_mox`` / ``fn`` without ``jit`` (after one warm-up);
* FLOPs equal:  ``cost_analysis()`` of both compiled programs.

Usage::

    python benchmarks/trace_eval.py            # full size (minutes)
    python benchmarks/trace_eval.py --small    # tiny configs (seconds)
    python benchmarks/trace_eval.py --trace-only   # tracing rows only
    python benchmarks/trace_eval.py --nnx      # only the NNX Transformer
    python benchmarks/trace_eval.py --equinox  # only eqx-zoo's Qwen 3 MoE
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_FLAX', '1')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import yax  # noqa: E402
from yax._src.trace import calls as _calls  # noqa: E402
from yax._src.trace import markers as _markers  # noqa: E402
from yax._src.trace import nnx as _nnx  # noqa: E402
from yax._src.trace import nnx_patching as _nnx_patching  # noqa: E402

GOALS = {'trace': 1.2, 'jit steady': 1.02, 'jit first': 1.1, 'eager': 1.2}


def block(tree):
  return jax.block_until_ready(tree)


CLOCK = time.perf_counter  # --clock cpu switches to time.process_time


def timed(fn) -> float:
  """Seconds for ``fn()`` to finish, with the garbage collector paused (as
  ``timeit`` does) so that a collection does not land on one side only."""
  gc.collect()
  gc.disable()
  try:
    start = CLOCK()
    block(fn())
    return CLOCK() - start
  finally:
    gc.enable()


def interleaved(a, b, repeats: int) -> tuple[float, float]:
  """Medians of ``repeats`` timings of ``a()`` and ``b()``, alternating."""
  ta, tb = [], []
  for i in range(repeats):
    if i % 2:
      tb.append(timed(b))
      ta.append(timed(a))
    else:
      ta.append(timed(a))
      tb.append(timed(b))
  return statistics.median(ta), statistics.median(tb)


def flops(compiled) -> float:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0] if cost else {}
  return float((cost or {}).get('flops', 0.0))


def build_models(small: bool):
  import transformers
  if small:
    bert_cfg = transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64)
    resnet_cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])
    ids_shape, img_shape = (1, 16), (1, 3, 32, 32)
  else:
    bert_cfg = transformers.BertConfig()
    resnet_cfg = transformers.ResNetConfig()
    ids_shape, img_shape = (1, 128), (1, 3, 224, 224)
  models = []
  start = time.perf_counter()
  bert = transformers.FlaxBertModel(bert_cfg, seed=0)
  ids = jax.random.randint(jax.random.key(0), ids_shape, 0,
                           bert_cfg.vocab_size)
  models.append(('BERT' if small else 'BERT-base', bert, ids))
  resnet = transformers.FlaxResNetModel(resnet_cfg, seed=0)
  images = jax.random.normal(jax.random.key(1), img_shape)
  models.append(('ResNet' if small else 'ResNet-50', resnet, images))
  print(f'# models built in {time.perf_counter() - start:.1f}s',
        file=sys.stderr)
  return models


def _noop_interceptor(next_fun, args, kwargs, context):
  del context
  return next_fun(*args, **kwargs)


def measure_trace(model, x, params, reps: dict) -> dict:
  """Tracing costs; run for every model before anything is compiled, so that
  XLA's worker threads and compiled-program caches do not skew them."""
  import flax.linen as nn

  def call(x, params):
    return model(x, params=params)

  def intercepted(x, params):
    with nn.intercept_methods(_noop_interceptor):
      return call(x, params)

  # Fresh function objects, so nothing is cached between runs.
  mox_t, jaxpr_t = interleaved(
      lambda: yax.make_mox(lambda x, params: call(x, params))(x, params),
      lambda: jax.make_jaxpr(lambda x, params: call(x, params))(x, params)
      .consts,
      reps['trace'])
  # The floor of any interceptor-based tracer: the same make_jaxpr with a
  # Flax method interceptor that does nothing.
  noop_t, jaxpr2_t = interleaved(
      lambda: jax.make_jaxpr(lambda x, p: intercepted(x, p))(x, params)
      .consts,
      lambda: jax.make_jaxpr(lambda x, params: call(x, params))(x, params)
      .consts,
      reps['trace'])
  return {'trace': (mox_t, jaxpr_t), 'noop': (noop_t, jaxpr2_t)}


def measure_run(model, x, params, reps: dict) -> dict:
  def call(x, params):
    return model(x, params=params)

  res = {}
  mox = yax.make_mox(call)(x, params)

  def ev(x, params):
    return yax.eval_mox(mox, x, params)

  # First call of a fresh jit: trace + lower + compile + run. A new function
  # object each time, since jit caches traces and executables per function.
  res['jit first'] = interleaved(
      lambda: jax.jit(lambda x, p: ev(x, p))(x, params),
      lambda: jax.jit(lambda x, p: call(x, p))(x, params),
      reps['first'])
  jit_ev, jit_fn = jax.jit(ev), jax.jit(call)
  block(jit_ev(x, params))
  block(jit_fn(x, params))
  res['jit steady'] = interleaved(lambda: jit_ev(x, params),
                                  lambda: jit_fn(x, params), reps['steady'])
  block(ev(x, params))  # warm the per-primitive caches of both
  block(call(x, params))
  res['eager'] = interleaved(lambda: ev(x, params), lambda: call(x, params),
                             reps['eager'])
  f_ev = flops(jax.jit(ev).lower(x, params).compile())
  f_fn = flops(jax.jit(call).lower(x, params).compile())
  res['flops'] = (f_ev, f_fn)
  n_eqns = sum(1 for _ in yax._src.ir.nodes.leaf_equations(mox))
  n_mods = sum(1 for n in yax._src.ir.nodes.iter_nodes(mox)
               if isinstance(n, yax.Mox) and not n.is_ephemeral)
  res['size'] = (n_eqns, n_mods)
  return res


def fmt_time(t: float) -> str:
  return f'{t * 1e3:.1f}ms' if t < 1 else f'{t:.2f}s'


def print_trace_only(results):
  print(f'jax {jax.__version__}; medians, YAX / JAX (make_jaxpr)')
  for name, res in results.items():
    (a, b), (na, nb) = res['trace'], res['noop']
    print(f'  {name}: make_mox {a / b:.2f} ({fmt_time(a)} / {fmt_time(b)}), '
          f'floor (no-op interceptor) {na / nb:.2f} '
          f'({fmt_time(na)} / {fmt_time(nb)})')


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--small', action='store_true',
                      help='tiny model configs for a quick run')
  parser.add_argument('--repeats', type=int, default=None,
                      help='repeats of the steady-state timing')
  parser.add_argument('--clock', choices=('wall', 'cpu'), default='wall',
                      help='wall time (default) or CPU time of this process '
                      '(steadier on a loaded machine)')
  parser.add_argument('--trace-only', action='store_true',
                      help='measure tracing (and its floor) only')
  parser.add_argument('--equinox', action='store_true',
                      help="only eqx-zoo's Qwen 3 MoE causal LM (Equinox): "
                      'tracing against its floor')
  args = parser.parse_args(argv)
  global CLOCK
  CLOCK = time.process_time if args.clock == 'cpu' else time.perf_counter
  reps = ({'trace': 5, 'first': 3, 'steady': 30, 'eager': 5} if args.small
          else {'trace': 11, 'first': 5, 'steady': 50, 'eager': 9})
  if args.repeats:
    reps['steady'] = args.repeats
  if args.equinox:
    equinox_section(args.small, reps)
    return

  results = {}
  models = build_models(args.small)
  for name, model, x in models:
    print(f'# tracing {name} ...', file=sys.stderr)
    results[name] = measure_trace(model, x, model.params, reps)
  if args.trace_only:
    print_trace_only(results)
    return
  for name, model, x in models:
    print(f'# running {name} ...', file=sys.stderr)
    results[name].update(measure_run(model, x, model.params, reps))

  names = list(results)
  print(f'jax {jax.__version__}, backend {jax.default_backend()}, '
        f'{jax.device_count()} device(s), {args.clock} clock; '
        f'medians, YAX / JAX')
  for name in names:
    eq, mods = results[name]['size']
    print(f'  {name}: {eq} equations, {mods} module calls')
  width = 30
  header = f'{"metric":<12} {"goal":>6}' + ''.join(
      f' | {n:^{width}}' for n in names)
  print(header)
  print('-' * len(header))
  for metric, goal in GOALS.items():
    row = f'{metric:<12} {"<=" + str(goal):>6}'
    for name in names:
      a, b = results[name][metric]
      ratio = a / b
      mark = 'ok' if ratio <= goal else 'MISS'
      cell = f'{ratio:5.2f} {mark:<4} ({fmt_time(a)} / {fmt_time(b)})'
      row += f' | {cell:^{width}}'
    print(row)
    if metric == 'trace':  # what a Flax method interceptor alone costs
      row = f'{" (floor)":<12} {"":>6}'
      for name in names:
        a, b = results[name]['noop']
        cell = f'{a / b:5.2f}      ({fmt_time(a)} / {fmt_time(b)})'
        row += f' | {cell:^{width}}'
      print(row)
  row = f'{"FLOPs equal":<12} {"yes":>6}'
  for name in names:
    a, b = results[name]['flops']
    cell = f'{"yes" if a == b else "NO"} ({a:.3g} / {b:.3g})'
    row += f' | {cell:^{width}}'
  print(row)


# ----------------------------------------------------------------- Equinox

def equinox_section(small: bool, reps: dict) -> None:
  """eqx-zoo's Qwen 3 MoE causal LM (random weights): ``yax.make_mox`` of
  ``lambda m, ids: m(ids)[0]`` against ``jax.make_jaxpr`` of it, and the
  floor of any tracer that wraps Equinox module methods (Equinox has no
  interceptor): ``make_jaxpr`` while YAX's class wrappers are installed but
  record nothing. Goal: the trace ratio within 0.2 of its floor."""
  import eqx_zoo

  from yax._src.trace import equinox as _eqx
  size = (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               num_experts=4, moe_intermediate_size=16, moe_layers=(0, 1))
          if small else
          dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=4, head_dim=32,
               num_experts=8, moe_intermediate_size=128,
               moe_layers=tuple(range(8))))
  cfg = eqx_zoo.Config(
      architecture='Qwen3MoeForCausalLM', vocab_size=1000, rms_norm_eps=1e-6,
      rope_theta=1e4, tie_word_embeddings=False, attention_bias=False,
      qk_norm=True, rope_scaling=None, num_experts_per_tok=2, **size)
  model = eqx_zoo.CausalLM(cfg, key=jax.random.key(0))
  ids = jnp.arange(16 if small else 128) % 1000
  make_fn = lambda: lambda m, ids: m(ids)[0]  # noqa: E731 (fresh each time)

  def floor(fn, *args):
    with _eqx.patched_classes():
      return _plain(fn, *args)

  traced = interleaved(lambda: _recorded(make_fn(), model, ids),
                       lambda: _plain(make_fn(), model, ids), reps['trace'])
  floored = interleaved(lambda: floor(make_fn(), model, ids),
                        lambda: _plain(make_fn(), model, ids), reps['trace'])
  mox = yax.make_mox(make_fn())(model, ids)
  n_eqns = sum(1 for _ in yax._src.ir.nodes.leaf_equations(mox))
  n_mods = sum(1 for n in yax._src.ir.nodes.iter_nodes(mox)
               if isinstance(n, yax.Mox) and not n.is_ephemeral)
  print(f'eqx-zoo Qwen 3 MoE ({cfg.num_hidden_layers} layers, width '
        f'{cfg.hidden_size}, ids {tuple(ids.shape)}): {n_eqns} equations, '
        f'{n_mods} module calls; medians')
  print(f'trace   {fmt_time(traced[0]):>10} / {fmt_time(traced[1]):>10} = '
        f'{traced[0] / traced[1]:5.2f}')
  print(f'(floor) {fmt_time(floored[0]):>10} / {fmt_time(floored[1]):>10} = '
        f'{floored[0] / floored[1]:5.2f}   goal: trace <= floor + 0.2')


# ----------------------------------------------------------------- NNX

class _MarkersOnly:
  """The floor of any tracer that marks NNX module calls with primitives:
  at every call (``super()`` calls of the same method excepted, as YAX
  does) it binds YAX's entry marker on the call's arrays and its exit
  marker on the results, and records nothing else. Installed as the NNX
  trace context (``_nnx_patching.current.ctx``) while YAX's class
  wrappers are on."""

  def __init__(self):
    self.stack = []

  def call(self, module, name, fn, args, kwargs):
    if self.stack and self.stack[-1] == (id(module), name):
      return fn(module, *args, **kwargs)
    a, k = _marked(_markers.enter_p, (args, kwargs), num_vars=0)
    self.stack.append((id(module), name))
    try:
      out = fn(module, *a, **k)
    finally:
      self.stack.pop()
    return _marked(_markers.exit_p, out)


def _marked(prim, tree, **params):
  """``tree`` with its tracers passed through one bind of ``prim``."""
  leaves, treedef = jax.tree_util.tree_flatten(tree,
                                               is_leaf=_nnx.is_graph_node)
  dyn = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
  marked = prim.bind(*[leaves[i] for i in dyn], call_id=_calls.CallId(None),
                     **params)
  for i, x in zip(dyn, marked, strict=True):
    leaves[i] = x
  return jax.tree_util.tree_unflatten(treedef, leaves)


# NNX tracers, each ``(fn, *args)``, timed against ``_plain``:
def _plain(fn, *args):
  return jax.make_jaxpr(fn)(*args).consts


def _recorded(fn, *args):
  return yax.make_mox(fn)(*args)


def _unrecorded(fn, *args):
  """The floor of any tracer that wraps NNX module methods (NNX has no
  interceptor): ``make_jaxpr`` while YAX's class-level wrappers are
  installed but record nothing (no trace context on this thread)."""
  with _nnx_patching.patched_classes():
    return _plain(fn, *args)


def _markers_only(fn, *args):
  """That floor plus two marker binds per module call (``_MarkersOnly``),
  which any tracer that marks calls in the Jaxpr pays."""
  with _nnx_patching.patched_classes():
    saved = getattr(_nnx_patching.current, 'ctx', None)
    _nnx_patching.current.ctx = _MarkersOnly()
    try:
      return _plain(fn, *args)
    finally:
      _nnx_patching.current.ctx = saved


NNX_TRACERS = (('trace ({})', _recorded), ('(floor, {})', _unrecorded),
               ('(+markers, {})', _markers_only))


def nnx_trace_rows(forms, reps: dict) -> list:
  """``[(row name, tracer time, plain time)]`` for every tracer of
  ``NNX_TRACERS`` on every ``(form name, make_fn, args)`` of ``forms``;
  ``make_fn()`` gives a fresh function each time (``make_jaxpr`` caches)."""
  rows = []
  for label, tracer in NNX_TRACERS:
    for form, make_fn, args in forms:
      rows.append((label.format(form), *interleaved(
          lambda: tracer(make_fn(), *args),
          lambda: _plain(make_fn(), *args), reps['trace'])))
  return rows


def nnx_section(small: bool, reps: dict) -> None:
  """An NNX Transformer (``yax._src.cli.bundled_nnx``): tracing and jit steady state,
  YAX vs JAX/NNX, printed side by side, for the model passed as an object
  and for the split form (``nnx.split``/``nnx.merge``), with the floor of
  any method-wrapping tracer (YAX's wrappers installed, recording nothing)
  and that floor plus two marker primitives bound per module call (what
  any tracer that marks calls in the Jaxpr pays; ``_MarkersOnly``).
  Goal: each trace ratio within 0.2 of its floor. ``nnx_breakdown.py``
  splits YAX's share into stages."""
  from flax import nnx

  from yax._src.cli import bundled_nnx as _bundled_nnx
  config = ({} if small else dict(vocab_size=1000, max_length=128, dim=256,
                                  num_heads=8, hidden=1024, num_layers=4))
  model, tokens = _bundled_nnx.make(batch=1, length=16 if small else 128,
                                    **config)
  graphdef, state = nnx.split(model)
  forward = lambda s, x: nnx.merge(graphdef, s)(x)  # noqa: E731
  n_params = sum(x.size for x in jax.tree.leaves(state))
  rows = nnx_trace_rows([
      ('module', lambda: lambda m, x: m(x), (model, tokens)),
      ('split', lambda: lambda s, x: forward(s, x), (state, tokens)),
  ], reps)

  mox = yax.make_mox(lambda m, x: m(x))(model, tokens)
  smox = yax.make_mox(forward)(state, tokens)
  # jit steady state: nnx.jit of eval_mox vs nnx.jit of the model call ...
  ev = nnx.jit(lambda m, x: yax.eval_mox(mox, m, x))
  fn = nnx.jit(lambda m, x: m(x))
  block(ev(model, tokens))
  block(fn(model, tokens))
  rows.append(('nnx.jit steady', *interleaved(
      lambda: ev(model, tokens), lambda: fn(model, tokens), reps['steady'])))
  # ... and jax.jit on the split form.
  sev = jax.jit(lambda s, x: yax.eval_mox(smox, s, x))
  sfn = jax.jit(forward)
  block(sev(state, tokens))
  block(sfn(state, tokens))
  rows.append(('jit steady (split)', *interleaved(
      lambda: sev(state, tokens), lambda: sfn(state, tokens),
      reps['steady'])))
  f_ev = flops(sev.lower(state, tokens).compile())
  f_fn = flops(sfn.lower(state, tokens).compile())

  n_eqns = sum(1 for _ in yax._src.ir.nodes.leaf_equations(mox))
  n_mods = sum(1 for n in yax._src.ir.nodes.iter_nodes(mox)
               if isinstance(n, yax.Mox) and not n.is_ephemeral)
  print(f'NNX Transformer ({n_params:,} params, tokens {tuple(tokens.shape)}):'
        f' {n_eqns} equations, {n_mods} module calls; medians')
  header = f'{"metric":<20} | {"YAX":>10} | {"JAX/NNX":>10} | ratio'
  print(header)
  print('-' * len(header))
  for metric, a, b in rows:
    print(f'{metric:<20} | {fmt_time(a):>10} | {fmt_time(b):>10} | '
          f'{a / b:5.2f}')
  print(f'{"FLOPs equal":<20} | {f_ev:>10.3g} | {f_fn:>10.3g} | '
        f'{"yes" if f_ev == f_fn else "NO"}')
  tunix_llama_rows(reps)


def tunix_llama_rows(reps: dict) -> None:
  """The same tracing rows on real NNX code: Google's tunix Llama 3 (8
  layers, width 512, random weights), when tunix is installed (``bash
  tests/install_real_models.sh``). Its package ``__init__`` imports the
  whole trainer stack, so only the model module is loaded."""
  import importlib
  import importlib.util
  import types

  import flax
  from flax import nnx

  spec = importlib.util.find_spec('tunix')
  if spec is None:
    print('(tunix not installed: no Llama 3 rows)')
    return
  if 'tunix' not in sys.modules:
    package = types.ModuleType('tunix')
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules['tunix'] = package
  lib = importlib.import_module('tunix.models.llama3.model')
  flax.config.update('flax_always_shard_variable', False)  # no mesh here
  config = lib.ModelConfig(
      num_layers=8, vocab_size=32000, embed_dim=512, hidden_dim=1408,
      num_heads=8, head_dim=64, num_kv_heads=4, rope_theta=500_000,
      norm_eps=1e-5, weight_tying=False)
  model = lib.Llama3(config, rngs=nnx.Rngs(0))
  tokens = jnp.ones((1, 128), jnp.int32)
  args = (tokens, jnp.arange(128)[None], None,
          jnp.tril(jnp.ones((1, 128, 128), bool)))

  rows = nnx_trace_rows(
      [('module', lambda: lambda m, *a: m(*a), (model, *args))], reps)
  mox = yax.make_mox(lambda m, *a: m(*a))(model, *args)
  n_mods = sum(1 for n in yax._src.ir.nodes.iter_nodes(mox)
               if isinstance(n, yax.Mox) and not n.is_ephemeral)
  print(f'\ntunix Llama 3 (8 layers, width 512, tokens (1, 128)): '
        f'{sum(1 for _ in yax._src.ir.nodes.leaf_equations(mox))} equations, '
        f'{n_mods} module calls; medians')
  for metric, a, b in rows:
    print(f'{metric:<20} | {fmt_time(a):>10} | {fmt_time(b):>10} | '
          f'{a / b:5.2f}')


if __name__ == '__main__':
  if '--nnx' in sys.argv[1:]:  # only the NNX section
    sys.argv.remove('--nnx')
    small = '--small' in sys.argv[1:]
    # 31 traces per row: a trace takes ~30 ms, and with 11 the ratios moved
    # by +-0.04 between runs on a 2-core machine.
    nnx_section(small, {'trace': 5, 'steady': 30} if small
                else {'trace': 31, 'steady': 50})
  else:
    main()
