"""Memory-lean fine-tuning on scikit-learn's digits: few-bit activation
gradients, randomized linear layers and lean norms on a traced Flax model.

The data ships with scikit-learn (``sklearn.datasets.load_digits``: 1,797
8x8 images, no download). The script

1. pretrains a small Linen MLP (blocks of Dense, LayerNorm, GELU) on the
   digits 0-4 (plain Flax);
2. traces it once with ``yax.make_mox(model.apply)(variables, x)``;
3. fine-tunes every weight on all ten digits from the same start, six
   ways: the exact tree; ``yax.fewbit(mox, bits=3)`` (each GELU keeps a
   3-bit code of its input for the backward pass); ``yax.randomized_linear``
   on every ``Dense`` (each keeps a sketch of 20% of its input rows); both;
   ``yax.lean_norm(mox, activations=True)`` (each LayerNorm keeps its
   input and row statistics, each GELU its input: exact gradients); all
   three; and the plan ``yax.fit_memory`` makes, per module call, to bring
   training memory to half the exact tree's (``--budget``) at the least
   added compute (its table is printed);
4. prints a table of final test accuracy and training memory, counted as
   PyTorch's peak counts it in the fewbit paper: 4 x param bytes (params,
   grads, two Adam moments) plus the bytes JAX keeps for the backward pass
   (``yax.memory_report``: JAX's saved residuals, arguments excluded,
   attributed to the module call computing each); and draws one PNG: the
   loss curves and, per block, the bytes each variant keeps (the exact
   tree's bars are the plan's "before", the plan's bars its "after").

Run::

    python examples/memory_finetune.py               # about a minute on a CPU
    python examples/memory_finetune.py --small       # a few seconds (CI)

It needs ``optax``, ``scikit-learn`` and ``matplotlib``
(``pip install 'yax-mox[examples]'``).
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import numpy as np
import optax
from sklearn.datasets import load_digits

import yax


class Block(nn.Module):
  """Dense, LayerNorm, GELU (exact, as BERT's)."""
  hidden: int

  @nn.compact
  def __call__(self, x):
    return nn.gelu(nn.LayerNorm()(nn.Dense(self.hidden)(x)),
                   approximate=False)


class MLP(nn.Module):
  """64 pixels -> 10 logits through three blocks."""
  hidden: int = 512

  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = Block(self.hidden, name=f'block{i}')(x)
    return nn.Dense(10, name='head')(x)


def data(seed=0):
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  cut = int(0.75 * len(x))
  return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(x, y, batch, steps, seed):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    idx = rng.choice(len(x), batch, replace=False)
    yield x[idx], y[idx]


def train(forward, params, x, y, *, steps, batch, lr, seed, keyed=False):
  """Adam on ``forward(params, xb, **extra)``; returns params and losses."""
  opt = optax.adam(lr)

  @jax.jit
  def step(params, state, xb, yb, key):
    extra = {'sketch_key': key} if keyed else {}
    loss, grads = jax.value_and_grad(
        lambda p: xent(forward(p, xb, **extra), yb))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state, losses = opt.init(params), []
  key = jax.random.PRNGKey(seed)
  for i, (xb, yb) in enumerate(batches(x, y, batch, steps, seed)):
    params, state, loss = step(params, state, xb, yb,
                               jax.random.fold_in(key, i))
    losses.append(float(loss))
  return params, losses


def kept_per_block(report) -> dict[str, int]:
  """Bytes kept for the backward pass per top-level module (a block, the
  head), from a ``yax.memory_report``; ``(outside)``: the loss's own."""
  kept: dict[str, int] = {}
  for row in report.rows:
    top = row.path.split('/')[0]
    kept[top] = kept.get(top, 0) + row.bytes
  kept['(outside)'] = report.unattributed
  return kept


def param_bytes(params) -> int:
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


def accuracy(forward, params, x, y) -> float:
  return float((jax.jit(forward)(params, x).argmax(-1) == y).mean())


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--small', action='store_true',
                      help='a smaller model and fewer steps (for CI)')
  parser.add_argument('--out', default='memory_finetune.png',
                      help='where to save the loss curves')
  parser.add_argument('--budget', type=float, default=0.5,
                      help="yax.fit_memory's budget: a fraction of the exact "
                           "tree's training memory (default 0.5)")
  args = parser.parse_args()
  hidden, pre_steps, steps, batch = (
      (128, 150, 150, 128) if args.small else (512, 300, 600, 128))

  (xtr, ytr), (xte, yte) = data()
  model = MLP(hidden)
  variables = model.init(jax.random.key(0), xtr[:batch])
  few = ytr < 5
  variables, _ = train(model.apply, variables, xtr[few], ytr[few],
                       steps=pre_steps, batch=batch, lr=1e-3, seed=1)
  print(f'pretrained on 0-4: test accuracy on 0-9 '
        f'{accuracy(model.apply, variables, xte, yte):.3f}')

  mox = yax.make_mox(model.apply)(variables, xtr[:batch])
  dense = '//module_call[@type="Dense"]'
  fewbit = yax.fewbit(mox, bits=3)
  randomized = yax.randomized_linear(mox, dense, ratio=0.2)
  both = yax.randomized_linear(fewbit, dense, ratio=0.2)
  lean = yax.lean_norm(mox, activations=True)
  # fewbit first: its GELUs stay FewBit, lean_norm takes the norms.
  every = yax.lean_norm(both, activations=True)
  names = yax.query('//module_call[@type="FewBit"]/@name', fewbit)
  print(f'fewbit: {len(names)} sites, 3 bits each: {names}')
  # The planner measures on the batch it is given: the loss of the logits
  # on these labels, with respect to the params (the first argument).
  xb, yb = xtr[:batch], ytr[:batch]
  plan = yax.fit_memory(mox, lambda logits: xent(logits, yb),
                        budget=args.budget, args=((variables, xb), {}))
  print(f'\nyax.fit_memory at {args.budget} of the exact training memory:')
  print(plan)

  variants = [('exact', mox, False), ('fewbit 3-bit', fewbit, False),
              ('randomized 20%', randomized, True),
              ('fewbit + randomized', both, True),
              ('lean norm + GELU', lean, False),
              ('all three', every, True),
              (f'plan {args.budget}', plan.mox, plan.takes_sketch_key)]
  key = jax.random.PRNGKey(7)
  rows, curves, kept = [], {}, {}
  for name, tree, keyed in variants:
    def forward(p, x, tree=tree, **extra):
      return yax.eval_mox(tree, p, x, **extra)
    extra = {'sketch_key': key} if keyed else {}
    out = jax.jit(forward)(variables, xb, **extra)
    # fewbit and randomized_linear keep the forward pass bit for bit; the
    # lean norm computes the same norm, rounded differently.
    np.testing.assert_allclose(out, model.apply(variables, xb), rtol=1e-4,
                               atol=1e-4, err_msg=name)
    report = yax.memory_report(lambda p: xent(forward(p, xb, **extra), yb),
                               variables, xla=False)
    saved, peak = report.total, report.training
    kept[name] = kept_per_block(report)
    params, losses = train(forward, variables, xtr, ytr, steps=steps,
                           batch=batch, lr=1e-3, seed=2, keyed=keyed)
    curves[name] = losses
    rows.append((name, accuracy(model.apply, params, xte, yte), saved, peak))

  base_peak = rows[0][3]
  print(f'\n{"variant":<22}{"test acc":>9}{"residuals":>12}{"peak":>12}'
        f'{"vs exact":>10}')
  for name, acc, saved, peak in rows:
    print(f'{name:<22}{acc:>9.3f}{saved / 2**10:>10.1f}Ki'
          f'{peak / 2**10:>10.1f}Ki{peak / base_peak:>10.3f}')
  print(f'(peak = 4 x {param_bytes(variables) / 2**10:.1f} KiB of params + '
        f'saved residuals at batch {batch})')
  gap = 100 * (rows[0][1] - rows[1][1])
  print(f'\nfewbit 3-bit accuracy within 1 point of exact: {gap <= 1.0} '
        f'({gap:+.2f} points)')
  gap = 100 * (rows[0][1] - rows[4][1])
  print(f'lean norm + GELU accuracy within 1 point of exact: {gap <= 1.0} '
        f'({gap:+.2f} points)')
  gap = 100 * (rows[0][1] - rows[6][1])
  print(f'plan {args.budget} accuracy within 1 point of exact: {gap <= 1.0} '
        f'({gap:+.2f} points)')

  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.5))
  for name, losses in curves.items():
    smooth = np.convolve(losses, np.ones(10) / 10, mode='valid')
    ax.plot(smooth, label=name)
  ax.set_xlabel('step')
  ax.set_ylabel('training loss (10-step mean)')
  ax.set_yscale('log')
  ax.set_title('Fine-tuning a GELU MLP on digits 0-9')
  ax.legend()
  # The memory report as a picture: bytes each block keeps, per variant.
  blocks = [b for b in kept['exact']
            if any(per.get(b, 0) for per in kept.values())]
  width = 0.8 / len(kept)
  for i, (name, per) in enumerate(kept.items()):
    bars.bar(np.arange(len(blocks)) + i * width,
             [per.get(b, 0) / 2**10 for b in blocks], width, label=name)
  bars.set_xticks(np.arange(len(blocks)) + 0.4 - width / 2, blocks)
  bars.set_ylabel('KiB kept for the backward pass')
  bars.set_title(f'yax.memory_report per module, batch {batch}')
  bars.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(args.out, dpi=100)
  print(f'loss curves and memory per block saved to {args.out}')


if __name__ == '__main__':
  main()
