"""LoRA fine-tuning of a traced Flax model on scikit-learn's digits.

The data ships with scikit-learn (``sklearn.datasets.load_digits``: 1,797
8x8 images, no download). The script

1. pretrains a small Linen MLP with a 10-way head on the digits 0-4 only;
2. traces it with ``yax.make_mox(model.apply)(variables, x)``;
3. wraps every ``Dense`` (the head included) in a LoRA adapter with
   ``yax.lora`` and trains only the adapters on the digits 5-9, with
   ``optax.multi_transform`` driven by ``res.mask``;
4. checks that every frozen weight is bit-identical after training, folds the
   adapters into the kernels with ``res.merge`` and checks that the merged
   weights on the ORIGINAL traced model predict exactly what the LoRA model
   predicts.

Run::

    python examples/lora_finetune.py               # about 20 s on a CPU
    python examples/lora_finetune.py --small       # a few seconds (CI)

It needs ``optax``, ``scikit-learn``, ``tqdm`` and ``matplotlib``
(``pip install -e '.[examples]'`` in a clone).
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import yax


class MLP(nn.Module):
  """A small classifier: 64 pixels -> 10 logits."""
  hidden: int = 256

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.relu(nn.Dense(self.hidden // 2)(x))
    return nn.Dense(10)(x)


def load_data(seed: int = 0):
  """Digits scaled to [0, 1], split 75/25 into train and test."""
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  n_train = int(0.75 * len(x))
  return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def subset(data, classes):
  x, y = data
  keep = np.isin(y, classes)
  return x[keep], y[keep]


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(loss_fn, params, tx, data, steps, batch_size, seed, desc):
  """Mini-batch training with a progress bar; returns (params, losses)."""
  x, y = data
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, xb, yb):
    loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  losses = []
  with tqdm(range(steps), desc=desc, unit='step') as bar:
    for i in bar:
      idx = rng.choice(len(x), size=batch_size, replace=False)
      params, opt_state, loss = step(params, opt_state, x[idx], y[idx])
      losses.append(float(loss))
      if i % 10 == 0 or i == steps - 1:
        bar.set_postfix(loss=f'{losses[-1]:.4f}')
  return params, losses


def accuracy(predict, params, data) -> float:
  x, y = data
  return float(np.mean(np.asarray(predict(params, x)).argmax(-1) == y))


def count(tree) -> int:
  return sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(tree))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=600,
                      help='LoRA fine-tuning steps on the digits 5-9')
  parser.add_argument('--pretrain-steps', type=int, default=800,
                      help='pretraining steps on the digits 0-4')
  parser.add_argument('--rank', type=int, default=4, help='LoRA rank')
  parser.add_argument('--alpha', type=float, default=8.0, help='LoRA alpha')
  parser.add_argument('--lr', type=float, default=3e-3)
  parser.add_argument('--batch-size', type=int, default=64)
  parser.add_argument('--out', default='lora_loss.png',
                      help='where to save the loss curve (PNG)')
  parser.add_argument('--small', action='store_true',
                      help='a quick run for CI (few steps)')
  args = parser.parse_args(argv)
  if args.small:
    args.steps = min(args.steps, 200)
    args.pretrain_steps = min(args.pretrain_steps, 200)
  start = time.perf_counter()

  train_set, test_set = load_data()
  old, new = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]
  print(f'digits: {len(train_set[0])} train / {len(test_set[0])} test images, '
        f'pretrain on {old}, fine-tune on {new}')

  # 1. Pretrain a plain Flax model on the digits 0-4 (10-way head).
  model = MLP()
  variables = model.init(jax.random.key(0), jnp.zeros((64,)))
  plain_loss = lambda v, x, y: cross_entropy(model.apply(v, x), y)
  variables, _ = train(plain_loss, variables, optax.adam(1e-3),
                       subset(train_set, old), args.pretrain_steps,
                       args.batch_size, seed=1, desc='pretrain 0-4')

  # 2. Trace it. A MoX is specialised to the shapes it was traced with: trace
  #    one example and vmap over batches of any size.
  mox = yax.make_mox(model.apply)(variables, jnp.zeros((64,), jnp.float32))

  def batched(tree):
    """A jitted batch predictor for a traced tree: (params, x[B, 64])."""
    one = lambda params, x: yax.eval_mox(tree, params, x)
    return jax.jit(jax.vmap(one, in_axes=(None, 0)))

  predict = batched(mox)
  acc_old0 = accuracy(predict, variables, subset(test_set, old))
  acc_new0 = accuracy(predict, variables, subset(test_set, new))

  # 3. LoRA on every Dense layer, the classifier head included.
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]',
                 rank=args.rank, alpha=args.alpha, key=jax.random.key(1))
  print(f'LoRA on {len(res.paths)} Dense layers: '
        f'{", ".join("/".join(p) for p in res.paths)}')
  n_total, n_train = count(res.params), sum(
      int(np.size(p)) for p, m in zip(jax.tree_util.tree_leaves(res.params),
                                      jax.tree_util.tree_leaves(res.mask))
      if m)
  print(f'trainable parameters: {n_train:,} of {n_total:,} '
        f'({100 * n_train / n_total:.1f}%)')

  lora_predict = batched(res.mox)
  # B = 0 at init: the adapted model computes what the original did.
  at_init = np.abs(np.asarray(lora_predict(res.params, test_set[0]))
                   - np.asarray(predict(variables, test_set[0]))).max()
  print(f'LoRA model at init equals the original: max |logit diff| = '
        f'{at_init:.2e}')

  labels = jax.tree_util.tree_map(lambda m: 'train' if m else 'freeze',
                                  res.mask)
  tx = optax.multi_transform(
      {'train': optax.adam(args.lr), 'freeze': optax.set_to_zero()}, labels)
  lora_one = lambda p, x: yax.eval_mox(res.mox, p, x)
  lora_loss = lambda p, x, y: cross_entropy(
      jax.vmap(lora_one, in_axes=(None, 0))(p, x), y)
  trained, losses = train(lora_loss, res.params, tx, subset(train_set, new),
                          args.steps, args.batch_size, seed=2,
                          desc='LoRA 5-9')

  acc_old1 = accuracy(lora_predict, trained, subset(test_set, old))
  acc_new1 = accuracy(lora_predict, trained, subset(test_set, new))
  print(f'accuracy on 5-9: before {acc_new0:.3f} -> after {acc_new1:.3f}')
  print(f'accuracy on 0-4: before {acc_old0:.3f} -> after {acc_old1:.3f} '
        '(the adapters were trained on 5-9 only)')

  # 4. Frozen weights untouched, adapters trained.
  frozen_same = all(
      np.array_equal(np.asarray(a), np.asarray(b))
      for a, b, m in zip(jax.tree_util.tree_leaves(res.params),
                         jax.tree_util.tree_leaves(trained),
                         jax.tree_util.tree_leaves(res.mask)) if not m)
  adapters_moved = all(
      not np.array_equal(np.asarray(a), np.asarray(b))
      for a, b, m in zip(jax.tree_util.tree_leaves(res.params),
                         jax.tree_util.tree_leaves(trained),
                         jax.tree_util.tree_leaves(res.mask)) if m)
  print(f'frozen weights bit-identical after training: {frozen_same}')
  print(f'every adapter weight changed: {adapters_moved}')

  # 5. Fold the adapters into the kernels: params for the ORIGINAL tree.
  merged = res.merge(trained)
  assert jax.tree_util.tree_structure(merged) == jax.tree_util.tree_structure(
      variables)
  lora_logits = np.asarray(lora_predict(trained, test_set[0]))
  merged_logits = np.asarray(predict(merged, test_set[0]))
  same_preds = bool(np.array_equal(lora_logits.argmax(-1),
                                   merged_logits.argmax(-1)))
  max_diff = float(np.abs(lora_logits - merged_logits).max())
  print(f'merged params on the original mox give the same predictions: '
        f'{same_preds} (max |logit diff| = {max_diff:.2e})')

  # 6. The loss curve.
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(losses, lw=1, alpha=0.4, label='batch loss')
  window = max(1, len(losses) // 20)
  smooth = np.convolve(losses, np.ones(window) / window, mode='valid')
  ax.plot(np.arange(window - 1, len(losses)), smooth, lw=2,
          label=f'moving average ({window})')
  ax.set(xlabel='step', ylabel='cross-entropy', yscale='log',
         title=f'LoRA (rank {args.rank}) on digits 5-9')
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=100)
  plt.close(fig)
  print(f'loss curve saved to {args.out}')
  print(f'done in {time.perf_counter() - start:.1f} s')

  ok = frozen_same and same_preds and acc_new1 > acc_new0 + 0.5
  return 0 if ok else 1


if __name__ == '__main__':
  raise SystemExit(main())
