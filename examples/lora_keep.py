"""A LoRA model kept: fine-tuned, saved, loaded elsewhere, generating at
any shape with its adapters unmerged, merged, exported and served without
YAX.

On a tiny Hugging Face Flax GPT-2 (random weights, nothing downloaded), the
script

1. traces ``model(ids, params=p)``, adds LoRA adapters to every
   ``FlaxConv1D`` with ``yax.lora`` and trains them a few steps with optax
   (``res.mask`` selects what trains) on a toy task: count up by 3;
2. saves the adapters with ``res.save`` (one safetensors file);
3. in a FRESH process: traces the base model's decode step, puts the
   adapters on it with ``yax.load_lora``, and with ``yax.keep`` generates
   greedily (KV cache) at two batch sizes and two prompt lengths, adapters
   unmerged; each generation is compared token for token with the base
   model run by Hugging Face on ``res.merge``'s merged weights;
4. exports the merged model's forward pass with ``yax.export`` (a
   symbolic batch), serializes it with its weights;
5. in a process that never imports YAX: deserializes and runs it, and
   compares the logits with those computed before the export.

Run::

    python examples/lora_keep.py             # a minute or two on a CPU
    python examples/lora_keep.py --small     # fewer steps (CI)

Each check prints a line ending in ``True``; the script exits non-zero if
one fails.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_TF', '0')

VOCAB, MAX_LEN = 32, 16


def build():
  """The base model: a tiny GPT-2, the same weights in every process."""
  import transformers
  config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32,
                                   n_embd=32, n_layer=2, n_head=2)
  return transformers.FlaxGPT2LMHeadModel(config, seed=0)


def counting(batch: int, length: int, seed: int):
  """Sequences that count up by 3 modulo the vocabulary."""
  import numpy as np
  start = np.random.default_rng(seed).integers(0, VOCAB, (batch, 1))
  return (start + 3 * np.arange(length)) % VOCAB


def check(label: str, ok: bool) -> bool:
  print(f'{label}: {bool(ok)}', flush=True)
  return bool(ok)


# ------------------------------------------------------------ 1-2. train

def train_and_save(workdir: pathlib.Path, steps: int) -> bool:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import yax

  model = build()

  def forward(params, ids):
    return model(ids, params=params).logits

  ids = jnp.asarray(counting(8, 12, seed=0))
  mox = yax.make_mox(forward)(model.params, ids)
  res = yax.lora(mox, model.params, '//module_call[@type="FlaxConv1D"]',
                 rank=4, alpha=8.0)
  forward_lora = yax.keep(forward, res.recipe)

  def loss_fn(params, ids):
    logits = forward_lora(params, ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, ids[:, 1:]).mean()

  tx = optax.masked(optax.adam(3e-2), res.mask)
  params, state = res.params, tx.init(res.params)

  @jax.jit
  def train_step(params, state, ids):
    loss, grads = jax.value_and_grad(loss_fn)(params, ids)
    updates, state = tx.update(grads, state, params)
    # Only the adapters move: zero updates elsewhere.
    updates = jax.tree.map(lambda u, m: u if m else jnp.zeros_like(u),
                           updates, res.mask)
    return optax.apply_updates(params, updates), state, loss

  first = None
  for step in range(steps):
    batch = jnp.asarray(counting(8, 12, seed=step + 1))
    params, state, loss = train_step(params, state, batch)
    first = float(loss) if first is None else first
  print(f'LoRA training: loss {first:.3f} -> {float(loss):.3f}', flush=True)
  ok = check('loss went down', float(loss) < first)
  same = jax.tree.map(lambda p, p0, m: bool(m) or bool(jnp.all(p == p0)),
                      params, res.params, res.mask)
  ok &= check('frozen weights unchanged', all(jax.tree.leaves(same)))
  path = workdir / 'adapters.safetensors'
  res.save(str(path), params)
  print(f'adapters saved to {path} ({path.stat().st_size:,} bytes)',
        flush=True)
  return ok


# --------------------------------------------- 3-4. generate, merge, export

def greedy(model, step, params, prompt, new_tokens: int):
  """Greedy decoding with HF's KV cache (``model.init_cache``): the
  prompt, then one token at a time; ``step(params, ids, mask, positions,
  cache)``."""
  import jax.numpy as jnp
  import numpy as np
  batch, length = prompt.shape
  cache = model.init_cache(batch, MAX_LEN)
  mask = jnp.ones((batch, MAX_LEN), jnp.int32)
  out = step(params, prompt, mask,
             jnp.broadcast_to(jnp.arange(length), (batch, length)), cache)
  tokens = [jnp.argmax(out.logits[:, -1], axis=-1)]
  for i in range(new_tokens - 1):
    out = step(params, tokens[-1][:, None], mask,
               jnp.full((batch, 1), length + i), out.past_key_values)
    tokens.append(jnp.argmax(out.logits[:, -1], axis=-1))
  return np.stack([np.asarray(t) for t in tokens], axis=1)


def generate_and_export(workdir: pathlib.Path) -> bool:
  import jax
  import jax.numpy as jnp
  import numpy as np

  import yax

  model = build()

  def step(params, ids, mask, positions, cache):
    return model(ids, attention_mask=mask, position_ids=positions,
                 params=params, past_key_values=cache)

  # A fresh trace of the base model, at any shape; the adapters loaded.
  ids = jnp.zeros((2, 4), jnp.int32)
  mox = yax.make_mox(step)(model.params, ids, jnp.ones((2, MAX_LEN),
                                                         jnp.int32),
                           jnp.zeros((2, 4), jnp.int32),
                           model.init_cache(2, MAX_LEN))
  res = yax.load_lora(mox, model.params, str(workdir / 'adapters.safetensors'))
  step_lora = jax.jit(yax.keep(step, res.recipe))
  merged = res.merge(res.params)
  step_merged = jax.jit(step)
  ok = True
  for batch in (1, 3):
    for length in (3, 6):
      prompt = jnp.asarray(counting(batch, length, seed=100 + batch))
      got = greedy(model, step_lora, res.params, prompt, MAX_LEN - length)
      want = greedy(model, step_merged, merged, prompt, MAX_LEN - length)
      ok &= check(f'batch {batch}, prompt {length}: unmerged adapters '
                  f'generate the merged model\'s tokens {got[0].tolist()}',
                  np.array_equal(got, want))
  base = greedy(model, step_merged, model.params, prompt, MAX_LEN - length)
  ok &= check('the adapters change the generation', not np.array_equal(
      base, want))

  # The merged model, exported with a symbolic batch and serialized.
  def forward(params, ids):
    return model(ids, params=params).logits

  # yax.export of the merged model's tree, traced at a symbolic batch: each
  # op's location names its module path (what Model Explorer nests).
  batch_dim, = jax.export.symbolic_shape('b')
  spec = jax.ShapeDtypeStruct((batch_dim, 8), jnp.int32)
  forward_mox = yax.make_mox(forward)(merged, spec)
  exported = yax.export(forward_mox, merged, spec)
  ok &= check('the export locates ops at their module paths',
              'transformer/h/0/attn' in exported.mlir_module())
  (workdir / 'model.jax').write_bytes(exported.serialize())
  leaves = jax.tree.leaves((merged,))
  ids = jnp.asarray(counting(5, 8, seed=7))
  np.savez(workdir / 'weights.npz', *[np.asarray(x) for x in leaves])
  np.savez(workdir / 'check.npz', ids=np.asarray(ids),
           logits=np.asarray(forward(merged, ids)))
  print(f'merged model exported to {workdir / "model.jax"}', flush=True)
  return ok


# ------------------------------------------------------ 5. serve, no YAX

def serve(workdir: pathlib.Path) -> bool:
  import jax
  import numpy as np
  exported = jax.export.deserialize(bytearray(
      (workdir / 'model.jax').read_bytes()))
  weights = np.load(workdir / 'weights.npz')
  params = jax.tree.unflatten(
      exported.in_tree.children()[0].children()[0],
      [weights[f'arr_{i}'] for i in range(len(weights.files))])
  check_data = np.load(workdir / 'check.npz')
  logits = exported.call(params, check_data['ids'])
  ok = check('yax was never imported here', 'yax' not in sys.modules)
  ok &= check('the served export computes the merged model\'s logits',
              np.allclose(logits, check_data['logits'], atol=1e-5))
  return ok


def run_stage(stage: str, workdir: pathlib.Path) -> bool:
  proc = subprocess.run([sys.executable, __file__, '--stage', stage,
                         '--dir', str(workdir)], text=True,
                        capture_output=True)
  sys.stdout.write(proc.stdout)
  if proc.returncode:
    sys.stderr.write(proc.stderr[-4000:])
  return proc.returncode == 0


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--small', action='store_true', help='fewer steps')
  parser.add_argument('--stage', choices=('generate', 'serve'))
  parser.add_argument('--dir', type=pathlib.Path)
  args = parser.parse_args()
  if args.stage == 'generate':
    sys.exit(0 if generate_and_export(args.dir) else 1)
  if args.stage == 'serve':
    sys.exit(0 if serve(args.dir) else 1)
  with tempfile.TemporaryDirectory() as tmp:
    workdir = pathlib.Path(tmp)
    ok = train_and_save(workdir, steps=15 if args.small else 60)
    print('--- a fresh process: load, generate, merge, export', flush=True)
    ok &= run_stage('generate', workdir)
    if (workdir / 'model.jax').exists():
      print('--- a process without YAX: serve the export', flush=True)
      ok &= run_stage('serve', workdir)
  print(f'all checks passed: {bool(ok)}')
  sys.exit(0 if ok else 1)


if __name__ == '__main__':
  main()
