"""One of the processes tests/test_multiprocess.py starts (not a test file).

Run as ``python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT DIR``
with JAX_PLATFORMS=cpu and XLA_FLAGS giving it four host CPU devices. Every
process runs the same program (JAX's multi-controller model) on one mesh of
all processes' devices; each checks its results against the same
computation done by plain Flax on one of its own devices, and prints
``worker PROCESS_ID done`` at the end.
"""

from __future__ import annotations

import sys


import jax

# Cross-process collectives on CPU: gloo (already the default from jax 0.8.0
# to 0.12; said here because without it a CPU computation spanning two
# processes cannot run).
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
PROCESS, COUNT, PORT, DIR = (int(sys.argv[1]), int(sys.argv[2]),
                             int(sys.argv[3]), sys.argv[4])
jax.distributed.initialize(coordinator_address=f'localhost:{PORT}',
                           num_processes=COUNT, process_id=PROCESS)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import yax  # noqa: E402

TOL = dict(rtol=2e-5, atol=2e-5)
LR = 0.1


class MLP(nn.Module):
  """Two Dense layers, their kernels sharded over 'model'."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    h = nn.Dense(16, use_bias=False, name='up', kernel_init=nn.with_partitioning(
        init, (None, 'model')))(x)
    return nn.Dense(8, use_bias=False, name='down', kernel_init=(
        nn.with_partitioning(init, ('model', None))))(jnp.tanh(h))


def on_mesh(tree, mesh):
  """A global array for every leaf (boxes kept): each process makes its own
  shards from the same host values; a box's names say how it is sharded."""
  def place(leaf):
    if isinstance(leaf, nn.Partitioned):
      spec = P(*leaf.names)
      return leaf.replace(value=place_array(leaf.value, spec))
    return place_array(leaf, P())

  def place_array(host, spec):
    host = np.asarray(host)
    return jax.make_array_from_callback(
        host.shape, NamedSharding(mesh, spec), lambda index: host[index])
  return jax.tree.map(place, tree,
                      is_leaf=lambda x: isinstance(x, nn.Partitioned))


def on_host(tree):
  """Host copies of global arrays (gathered from every process)."""
  return jax.tree.map(
      lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)),
      tree)


def step_fn(mox, mask):
  """One SGD step on the marked params; the loss."""
  def step(params, x, y):
    def loss(p):
      return jnp.mean((yax.eval_mox(mox, p, x) - y) ** 2)
    value, grads = jax.value_and_grad(loss, allow_int=True)(params)
    new = jax.tree.map(lambda p, g, m: p - LR * g if m else p, params, grads,
                       mask)
    return new, value
  return jax.jit(step)


def plain(host, x):
  """The model with adapters, written by hand on one local device."""
  p = host['params']
  dev = jax.local_devices()[0]
  x = jax.device_put(x, dev)

  def dense(q, h):
    w = q['kernel'].value if isinstance(q['kernel'], nn.Partitioned) else (
        q['kernel'])
    out = h @ w
    if 'lora_a' in q:
      a, b = (q[n].value if isinstance(q[n], nn.Partitioned) else q[n]
              for n in ('lora_a', 'lora_b'))
      out = out + (2.0 / 2) * (h @ a) @ b
    return out
  return dense(p['down'], jnp.tanh(dense(p['up'], x)))


def main():
  assert jax.process_count() == COUNT and jax.device_count() == 4 * COUNT
  mesh = jax.make_mesh((COUNT, 4), ('data', 'model'), devices=jax.devices(),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  model = MLP()
  rng = np.random.default_rng(0)  # the same values in every process
  x_host = rng.standard_normal((8, 6)).astype(np.float32)
  y_host = rng.standard_normal((8, 8)).astype(np.float32)
  host = jax.tree.map(
      lambda s: np.asarray(rng.standard_normal(s.shape) * 0.3, s.dtype),
      jax.eval_shape(model.init, jax.random.key(0), x_host))
  params = on_mesh(host, mesh)
  batch = NamedSharding(mesh, P('data'))
  x = jax.make_array_from_callback(x_host.shape, batch, lambda i: x_host[i])
  y = jax.make_array_from_callback(y_host.shape, batch, lambda i: y_host[i])

  # Trace and LoRA with global (multi-process) params.
  mox = yax.make_mox(model.apply)(params, x)
  yax.check_mox(mox)
  res = yax.lora(mox, params, '//module_call[@type="Dense"]', rank=2,
                 alpha=2.0)
  yax.check_mox(res.mox)
  a = res.params['params']['up']['lora_a'].value
  assert not a.is_fully_addressable and a.sharding.spec == P(None, None), (
      a.sharding)
  b = res.params['params']['up']['lora_b'].value
  assert b.sharding.spec == P(None, 'model'), b.sharding

  # A sharded training step equals the same step on one device.
  step = step_fn(res.mox, res.mask)
  trained, loss = step(res.params, x, y)
  host_res = on_host(res.params)
  dev = jax.local_devices()[0]
  one = jax.device_put(host_res, dev)
  ref, ref_loss = step(one, jax.device_put(x_host, dev),
                       jax.device_put(y_host, dev))
  np.testing.assert_allclose(float(loss), float(ref_loss), **TOL)
  for got, want in zip(jax.tree.leaves(on_host(trained)),
                       jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(got, np.asarray(want), **TOL)
  out = on_host(yax.eval_mox(res.mox, trained, x))
  np.testing.assert_allclose(out, plain(on_host(trained), x_host), **TOL)
  print(f'worker {PROCESS}: lora step on {jax.device_count()} devices of '
        f'{COUNT} processes equals one device (loss {float(loss):.6f})',
        flush=True)

  # Adapters saved and loaded with orbax, each process its own shards.
  res.save(f'{DIR}/lora', trained, format='orbax')
  fresh = yax.make_mox(model.apply)(params, x)
  loaded = yax.load_lora(fresh, params, f'{DIR}/lora')
  yax.check_mox(loaded.mox)
  a = loaded.params['params']['up']['lora_b'].value
  assert not a.is_fully_addressable and a.sharding.spec == P(None, 'model')
  np.testing.assert_array_equal(
      on_host(yax.eval_mox(loaded.mox, loaded.params, x)), out)
  try:  # one file would have to gather them: refused
    res.save(f'{DIR}/lora.safetensors', trained)
  except yax.AdapterFileError as e:
    assert 'format="orbax"' in str(e), e
  else:
    raise AssertionError('a safetensors save of global adapters passed')
  print(f'worker {PROCESS}: orbax adapters loaded', flush=True)

  # QLoRA: quantize the global params, then lora; a step, a save and load.
  q = yax.quantize(mox, params, '//module_call[@type="Dense"]',
                   weight='int8')
  qres = yax.lora(q.mox, q.params, '//module_call[@type="Dense"]', rank=2,
                  alpha=2.0)
  yax.check_mox(qres.mox)
  qstep = step_fn(qres.mox, qres.mask)
  qtrained, qloss = qstep(qres.params, x, y)
  qone = jax.device_put(on_host(qres.params), dev)
  _, qref = qstep(qone, jax.device_put(x_host, dev),
                  jax.device_put(y_host, dev))
  np.testing.assert_allclose(float(qloss), float(qref), **TOL)
  qres.save(f'{DIR}/qlora', qtrained, format='orbax')
  q2 = yax.quantize(yax.make_mox(model.apply)(params, x), params,
                    '//module_call[@type="Dense"]', weight='int8')
  qloaded = yax.load_lora(q2.mox, q2.params, f'{DIR}/qlora')
  np.testing.assert_array_equal(
      on_host(yax.eval_mox(qloaded.mox, qloaded.params, x)),
      on_host(yax.eval_mox(qres.mox, qtrained, x)))
  print(f'worker {PROCESS}: qlora step equals one device, adapters loaded',
        flush=True)
  print(f'worker {PROCESS} done', flush=True)


if __name__ == '__main__':
  main()
  jax.distributed.shutdown()
