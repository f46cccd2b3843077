"""Where YAX's tracing time goes on an NNX Transformer, measured in place.

``trace_eval.py --nnx`` prints the totals (``make_mox`` / ``make_jaxpr``,
its floor, and the floor with two marker primitives per module call). This
script splits YAX's share into stages. Each repetition traces the model
once as it is and once per stage with that stage replaced by a stub that
does (almost) nothing; the printed cost of a stage is the median, over
repetitions, of the paired difference. The stubbed traces build wrong or no
trees: only their time is used.

Stages:

* tree build:   ``_make.build_root`` (Jaxpr with markers -> MoX tree);
* variables:    listing each call's variables (``_Context.variables``) and
                everything downstream of them (root references, the
                builder's narrowing to what the body reads);
* static params: each module's static attributes (``_static_params``);
* markers:      binding the entry/exit markers and the call records
                (``marked_call`` becomes a plain call; the build then sees no
                module calls).

Usage::

    python benchmarks/nnx_breakdown.py            # split form, 100 repeats, ~20 s
    python benchmarks/nnx_breakdown.py --module   # the model as argument
    python benchmarks/nnx_breakdown.py --repeats 60
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import yax  # noqa: E402
from yax._src.cli import bundled_nnx as _bundled_nnx  # noqa: E402
from yax._src.trace import calls as _calls  # noqa: E402
from yax._src.trace import make as _make  # noqa: E402
from yax._src.trace import nnx as _nnx  # noqa: E402
from yax._src.trace import nnx_variables as _nnx_variables  # noqa: E402


def timed(fn) -> float:
  gc.collect()
  gc.disable()
  try:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
  finally:
    gc.enable()


class Stub:
  """Replaces ``owner.name`` by ``new`` while active."""

  def __init__(self, owner, name, new):
    self.owner, self.name, self.new = owner, name, new
    self.old = getattr(owner, name)

  def __enter__(self):
    setattr(self.owner, self.name, self.new)

  def __exit__(self, *exc):
    setattr(self.owner, self.name, self.old)


def _no_variables(ctx, module):
  ctx.subtree(module)  # the walk still runs: it places submodules too
  return [], _nnx_variables.cached_treedef(())


def _plain_call(module_ty, method, params, path, var_leaves, var_tree, call,
                args, kwargs, *, is_leaf=None):
  del module_ty, method, params, path, var_leaves, var_tree, is_leaf
  return call(*args, **kwargs)


STAGES = {
    'tree build': lambda: [Stub(_make, 'build_root', lambda *a: None)],
    'variables': lambda: [Stub(_nnx._Context, 'variables', _no_variables)],
    'static params': lambda: [Stub(
        _nnx, 'static_params', lambda m, p: {'name': p[-1] if p else None})],
    'markers': lambda: [Stub(_nnx, 'marked_call', _plain_call),
                        Stub(_calls, 'marked_call', _plain_call)],
}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--module', action='store_true',
                      help='trace the model passed as an argument '
                      '(default: the split form, nnx.merge inside)')
  parser.add_argument('--repeats', type=int, default=100)
  args = parser.parse_args(argv)
  model, tokens = _bundled_nnx.make(
      batch=1, length=128, vocab_size=1000, max_length=128, dim=256,
      num_heads=8, hidden=1024, num_layers=4)
  if args.module:
    traced = lambda: yax.make_mox(lambda m, x: m(x))(model, tokens)  # noqa: E731
    plain = lambda: jax.make_jaxpr(lambda m, x: m(x))(model, tokens)  # noqa: E731
  else:
    graphdef, state = nnx.split(model)
    forward = lambda s, x: nnx.merge(graphdef, s)(x)  # noqa: E731
    traced = lambda: yax.make_mox(  # noqa: E731
        lambda s, x: forward(s, x))(state, tokens)
    plain = lambda: jax.make_jaxpr(  # noqa: E731
        lambda s, x: forward(s, x))(state, tokens)

  for _ in range(3):
    traced()
    plain()
  times = {name: [] for name in ('jax', 'yax', *STAGES)}
  for _ in range(args.repeats):
    times['jax'].append(timed(plain))
    times['yax'].append(timed(traced))
    for name, stubs in STAGES.items():
      active = stubs()
      for s in active:
        s.__enter__()
      try:
        times[name].append(timed(traced))
      finally:
        for s in reversed(active):
          s.__exit__()
  jax_t = statistics.median(times['jax'])
  yax_t = statistics.median(times['yax'])
  form = 'module as argument' if args.module else 'split form'
  print(f'NNX Transformer, {form}: make_mox {yax_t * 1e3:.1f} ms, make_jaxpr '
        f'{jax_t * 1e3:.1f} ms (ratio {yax_t / jax_t:.2f}, YAX adds '
        f'{(yax_t - jax_t) * 1e3:.1f} ms); medians of {args.repeats}')
  print(f'{"stage":<14} | {"in place":>9} | share of make_jaxpr')
  for name in STAGES:
    saved = statistics.median(
        a - b for a, b in zip(times['yax'], times[name]))
    print(f'{name:<14} | {saved * 1e3:7.2f}ms | {saved / jax_t:6.3f}')


if __name__ == '__main__':
  main()
