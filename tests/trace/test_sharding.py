"""eval_mox under sharding: a Mesh of 8 host CPU devices.

The device count is fixed when JAX starts, so the check runs in a fresh
Python process with ``--xla_force_host_platform_device_count=8``.
"""

import textwrap

from helpers import run_on_host_devices

SCRIPT = textwrap.dedent('''
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import yax
    from helpers import assert_trees_close

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('data', 'model'))

    class MLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))
        h = jax.lax.with_sharding_constraint(
            h, NamedSharding(mesh, P('data', 'model')))
        return nn.Dense(4)(h)

    model = MLP()
    x = jax.random.normal(jax.random.key(1), (8, 6))
    variables = model.init(jax.random.key(0), x)

    def shard_params(path, leaf):
      name = path[-1].key
      spec = P(None, 'model') if name == 'kernel' and leaf.shape[-1] == 16 \\
          else P('model', None) if name == 'kernel' else P()
      return jax.device_put(leaf, NamedSharding(mesh, spec))

    sv = jax.tree_util.tree_map_with_path(shard_params, variables)
    sx = jax.device_put(x, NamedSharding(mesh, P('data', None)))

    # Trace on the sharded arrays; replay on them eagerly and under jit.
    mox = yax.make_mox(model.apply)(sv, sx)
    ref = jax.jit(model.apply)(sv, sx)
    got = jax.jit(lambda v, x: yax.eval_mox(mox, v, x))(sv, sx)
    assert_trees_close(got, ref, rtol=1e-5, atol=1e-5)
    assert_trees_close(got, model.apply(variables, x), rtol=1e-5, atol=1e-5)
    assert got.sharding.is_equivalent_to(ref.sharding, got.ndim), (
        got.sharding, ref.sharding)
    assert len(got.sharding.device_set) == 8
    eager = yax.eval_mox(mox, sv, sx)
    assert_trees_close(eager, ref, rtol=1e-5, atol=1e-5)
    assert len(eager.sharding.device_set) == 8

    # A tree traced on unsharded arrays runs on sharded ones too.
    mox = yax.make_mox(model.apply)(variables, x)
    got = jax.jit(lambda v, x: yax.eval_mox(mox, v, x))(sv, sx)
    assert_trees_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got.sharding.is_equivalent_to(ref.sharding, got.ndim)

    # Explicit in/out shardings and a batch split over the data axis.
    out_s = NamedSharding(mesh, P('data', None))
    f = jax.jit(lambda v, x: yax.eval_mox(mox, v, x), out_shardings=out_s)
    got = f(sv, sx)
    assert got.sharding == out_s
    assert_trees_close(got, ref, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(
        lambda v: yax.eval_mox(mox, v, sx).sum()))(sv)
    ref_grads = jax.jit(jax.grad(lambda v: model.apply(v, sx).sum()))(sv)
    assert_trees_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    for g, r in zip(jax.tree_util.tree_leaves(grads),
                    jax.tree_util.tree_leaves(ref_grads)):
      assert g.sharding.is_equivalent_to(r.sharding, g.ndim), (
          g.sharding, r.sharding)
    print('SHARDING-OK')
''')


def test_eval_mox_on_a_mesh_of_8_cpu_devices(tmp_path):
  run_on_host_devices(SCRIPT, tmp_path, 'SHARDING-OK')
