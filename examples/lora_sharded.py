"""LoRA on a sharded Llama-style model, then an adapter plan for 70B.

Part 1, on 8 host CPU devices (a 4 x 2 mesh, axes 'fsdp' and 'tp'): a
Llama-style Linen model written the MaxText way (every weight carries
logical axis names through ``nn.with_logical_partitioning``; the attention
projections are Einsum modules, ``BTD,NDH->BTNH`` and ``BTNH,NHD->BTD``;
layers stacked by ``nn.scan``) gets LoRA on every linear layer with one
``yax.lora`` call. The adapters come back boxed with the logical names of
the kernel axes they span, so the same logical rules shard them like their
kernels: the base weights FSDP-sharded, the adapters next to them. A few
jitted training steps update only the adapters and the loss goes down; one
step on the mesh equals the same step on one device.

Part 2: the same model at Llama-3-70B size, abstract (``jax.eval_shape``:
every weight a ``jax.ShapeDtypeStruct`` with its sharding, nothing
materialised). ``yax.make_mox`` and ``yax.lora`` run on it and print the
adapter plan: shapes, shardings and bytes per device, in seconds.

Run: ``python examples/lora_sharded.py`` (``--small`` runs part 2 on a
smaller abstract config as well, for the tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

# 8 host CPU devices; set before JAX starts, beside any other XLA flags (an
# XLA_FLAGS that is set but empty, as MaxText's config leaves it, included).
if 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS',
                                                               ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

import yax  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int
  dim: int
  heads: int
  kv_heads: int
  head_dim: int
  mlp: int
  layers: int


TINY = Config(vocab=64, dim=32, heads=4, kv_heads=2, head_dim=8, mlp=64,
              layers=2)
LLAMA3_70B = Config(vocab=128_256, dim=8192, heads=64, kv_heads=8,
                    head_dim=128, mlp=28_672, layers=80)
MEDIUM = Config(vocab=32_000, dim=2048, heads=16, kv_heads=4, head_dim=128,
                mlp=5632, layers=22)

# Logical axis -> mesh axis (None: replicated).
RULES = (('batch', 'fsdp'), ('embed', 'fsdp'), ('mlp', 'tp'),
         ('heads', 'tp'), ('kv', None), ('vocab', 'tp'), ('layers', None))
init = nn.initializers.normal(0.02)


class Einsum(nn.Module):
  """A weight with logical axis names, contracted by ``jnp.einsum``."""
  shape: tuple
  names: tuple
  eqn: str

  @nn.compact
  def __call__(self, x):
    w = self.param('w', nn.with_logical_partitioning(init, self.names),
                   self.shape)
    return jnp.einsum(self.eqn, x, w)


class RMSNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.with_logical_partitioning(
        nn.initializers.ones, ('embed',)), (x.shape[-1],))
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class Block(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x, _):
    c = self.cfg
    h = RMSNorm(name='attn_norm')(x)
    q = Einsum((c.heads, c.dim, c.head_dim), ('heads', 'embed', 'kv'),
               'BTD,NDH->BTNH', name='q')(h)
    k = Einsum((c.kv_heads, c.dim, c.head_dim), ('heads', 'embed', 'kv'),
               'BTD,NDH->BTNH', name='k')(h)
    v = Einsum((c.kv_heads, c.dim, c.head_dim), ('heads', 'embed', 'kv'),
               'BTD,NDH->BTNH', name='v')(h)
    repeat = c.heads // c.kv_heads
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    logits = jnp.einsum('BTNH,BSNH->BNTS', q, k) / math.sqrt(c.head_dim)
    t = x.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
    attn = jnp.einsum('BNTS,BSNH->BTNH', probs, v)
    x = x + Einsum((c.heads, c.head_dim, c.dim), ('heads', 'kv', 'embed'),
                   'BTNH,NHD->BTD', name='o')(attn)
    h = RMSNorm(name='mlp_norm')(x)
    dense = lambda n, names, name: nn.Dense(
        n, use_bias=False, kernel_init=nn.with_logical_partitioning(
            init, names), name=name)
    gate = dense(c.mlp, ('embed', 'mlp'), 'gate')(h)
    up = dense(c.mlp, ('embed', 'mlp'), 'up')(h)
    x = x + dense(c.dim, ('mlp', 'embed'), 'down')(jax.nn.silu(gate) * up)
    return x, None


class Llama(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, tokens):
    c = self.cfg
    x = nn.Embed(c.vocab, c.dim, embedding_init=nn.with_logical_partitioning(
        init, ('vocab', 'embed')), name='embed')(tokens)
    layers = nn.scan(Block, variable_axes={'params': 0},
                     split_rngs={'params': True}, length=c.layers,
                     metadata_params={nn.PARTITION_NAME: 'layers'})
    x, _ = layers(c, name='layers')(x, None)
    x = RMSNorm(name='final_norm')(x)
    return nn.Dense(c.vocab, use_bias=False,
                    kernel_init=nn.with_logical_partitioning(
                        init, ('embed', 'vocab')), name='head')(x)


LINEAR = '//module_call[@type="Einsum" or @type="Dense"]'


def shardings(boxed, mesh):
  """NamedShardings for a boxed params tree (one per box)."""
  specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), RULES)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))


def loss_fn(mox, params, tokens):
  logits = yax.eval_mox(mox, params, tokens[:, :-1])
  labels = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
  return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))


def train_step(mox, mask, lr):
  def step(params, tokens):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(mox, p, tokens))(params)
    params = jax.tree.map(lambda p, g, m: p - lr * g if m else p, params,
                          grads, mask)
    return params, loss
  return jax.jit(step)


def part1(mesh) -> None:
  cfg = TINY
  model = Llama(cfg)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab, (8, 17)), jnp.int32)
  variables = model.init(jax.random.key(0), tokens[:, :-1])
  mox = yax.make_mox(model.apply)(variables, tokens[:, :-1])
  res = yax.lora(mox, variables, LINEAR, rank=4, alpha=8.0,
                 key=jax.random.key(1))
  n_adapted = len(res.paths)
  print(f'lora on {n_adapted} modules: q, k, v, o, gate, up, down (each '
        f'stacked over the {cfg.layers} layers by nn.scan) and the head')
  a = res.params['params']['layers']['q']['lora_a']
  b = res.params['params']['layers']['q']['lora_b']
  print(f"q kernel {tuple(variables['params']['layers']['q']['w'].names)} -> "
        f'lora_a {tuple(a.names)} {a.value.shape}, lora_b {tuple(b.names)} '
        f'{b.value.shape}')
  # Shard: the base FSDP-sharded, each adapter as its names say.
  on_mesh = jax.device_put(res.params, shardings(res.params, mesh))
  batch = jax.device_put(tokens, NamedSharding(
      mesh, jax.sharding.PartitionSpec('fsdp')))
  spec = on_mesh['params']['layers']['q']['lora_a'].value.sharding.spec
  kspec = on_mesh['params']['layers']['q']['w'].value.sharding.spec
  print(f'on the mesh: q kernel {kspec}, its lora_a {spec}')
  step = train_step(res.mox, res.mask, lr=0.1)
  # One step on the mesh equals the same step on one device.
  one = jax.devices()[0]
  single, loss_single = step(jax.device_put(res.params, one),
                             jax.device_put(tokens, one))
  sharded, loss_sharded = step(on_mesh, batch)
  diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(single), jax.tree.leaves(sharded),
                             strict=True))
  print(f'one step, 8-device mesh vs one device: loss {float(loss_sharded):.6f}'
        f' vs {float(loss_single):.6f}, max |param diff| {diff:.2e}')
  assert abs(float(loss_sharded) - float(loss_single)) < 1e-5 and diff < 1e-5
  params, losses = sharded, [float(loss_sharded)]
  for _ in range(9):
    params, loss = step(params, batch)
    losses.append(float(loss))
  print('loss: ' + ' '.join(f'{x:.4f}' for x in losses))
  assert losses[-1] < losses[0]
  frozen_same = all(
      bool(jnp.array_equal(x, y)) for x, y, m in zip(
          jax.tree.leaves(on_mesh), jax.tree.leaves(params),
          jax.tree.leaves(res.mask), strict=True) if not m)
  print(f'loss went down: {losses[0]:.4f} -> {losses[-1]:.4f}; frozen weights '
        f'unchanged: {frozen_same}')
  merged = res.merge(params)
  got = model.apply(merged, tokens[:, :-1])
  want = yax.eval_mox(res.mox, params, tokens[:, :-1])
  print(f'merged into the kernels, the model itself: max |diff| = '
        f'{float(jnp.max(jnp.abs(got - want))):.2e}')


def part2(cfg: Config, name: str, mesh) -> None:
  model = Llama(cfg)
  start = time.perf_counter()
  tokens = jax.ShapeDtypeStruct((8, 2048), jnp.int32)
  abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
  where = shardings(abstract, mesh)
  abstract = jax.tree.map(
      lambda box, s: box.replace(value=jax.ShapeDtypeStruct(
          box.value.shape, box.value.dtype, sharding=s)),
      abstract, where, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
  mox = yax.make_mox(model.apply)(abstract, tokens)
  res = yax.lora(mox, abstract, LINEAR, rank=16, alpha=32.0)
  took = time.perf_counter() - start

  def per_device(sds):
    return math.prod(sds.sharding.shard_shape(sds.shape)) * sds.dtype.itemsize

  leaves = jax.tree.leaves(res.params)
  flags = jax.tree.leaves(res.mask)
  base = sum(per_device(x) for x, m in zip(leaves, flags, strict=True)
             if not m)
  lora = sum(per_device(x) for x, m in zip(leaves, flags, strict=True) if m)
  n_base = sum(math.prod(x.shape) for x, m in zip(leaves, flags, strict=True)
               if not m)
  n_lora = sum(math.prod(x.shape) for x, m in zip(leaves, flags, strict=True)
               if m)
  print(f'\n{name}: {n_base / 1e9:.1f}B parameters (abstract, nothing '
        f'materialised); make_mox + lora(rank=16) on {len(res.paths)} '
        f'modules in {took:.1f} s')
  print(f"{'adapter':<22} {'shape':<20} {'logical names':<32} "
        f"{'mesh spec':<26} {'MiB/device':>10}")
  flat = jax.tree_util.tree_flatten_with_path(
      res.params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))[0]
  for path, box in flat:
    keys = [str(getattr(k, 'key', k)) for k in path]
    if not keys[-1].endswith(('lora_a', 'lora_b')):
      continue
    sds = box.value
    print(f"{'/'.join(keys[1:]):<22} {str(sds.shape):<20} "
          f"{str(tuple(box.names)):<32} {str(sds.sharding.spec):<26} "
          f'{per_device(sds) / 2**20:10.2f}')
  print(f'per device: base {base / 2**30:.2f} GiB, adapters '
        f'{lora / 2**20:.1f} MiB ({n_lora / 1e6:.1f}M adapter parameters, '
        f'{100 * n_lora / n_base:.2f}% of the base)')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--small', action='store_true',
                      help='part 2 on a 1B-sized config instead of 70B')
  args = parser.parse_args(argv)
  devices = np.array(jax.devices())
  assert devices.size == 8, f'needs 8 devices, found {devices.size}'
  mesh = Mesh(devices.reshape(4, 2), ('fsdp', 'tp'))
  print(f'jax {jax.__version__}, mesh {dict(mesh.shape)} on '
        f'{devices.size} {devices[0].platform} devices')
  part1(mesh)
  if args.small:
    part2(MEDIUM, 'A 1B-sized Llama (--small)', mesh)
  else:
    part2(LLAMA3_70B, 'Llama-3-70B', mesh)


if __name__ == '__main__':
  main()
