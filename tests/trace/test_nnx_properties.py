"""Property tests: random Flax NNX architectures replay exactly.

Hypothesis draws an architecture as a nested tuple spec (Linear, Conv,
LayerNorm, BatchNorm in training or evaluation mode, Dropout, activations,
residual and nested blocks, a shared Linear, a scan-over-layers stack built
with ``nnx.vmap``); ``Seq`` builds it from ``flax.nnx`` layers. For each one,
``eval_mox`` must return what calling the model returns and leave the same
state behind (RNG counts, batch statistics), eagerly and under ``nnx.jit``;
tracing must leave the model bit-identical; the tree holds one
``module_call`` per layer call the spec makes, each at its attribute path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

hypothesis = pytest.importorskip('hypothesis')
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import yax  # noqa: E402

ACTIVATIONS = {'relu': nnx.relu, 'gelu': nnx.gelu, 'silu': nnx.silu,
               'tanh': nnx.tanh}
SHAPE = (2, 4, 4, 3)  # NHWC, so Conv applies; every other layer is per-feature
TOL = dict(rtol=1e-4, atol=1e-4)


class Act(nnx.Module):
  def __init__(self, name):
    self.fn = ACTIVATIONS[name]

  def __call__(self, x):
    return self.fn(x)


class SharedPair(nnx.Module):
  """One Linear called twice, around an activation."""

  def __init__(self, dim, act, *, rngs):
    self.dense = nnx.Linear(dim, dim, rngs=rngs)
    self.act = act

  def __call__(self, x):
    return self.dense(ACTIVATIONS[self.act](self.dense(x)))


class Residual(nnx.Module):
  def __init__(self, spec, dim, *, rngs):
    self.body = Seq(spec, dim, rngs=rngs)
    self.proj = nnx.Linear(self.body.out_dim, dim, rngs=rngs)

  def __call__(self, x):
    return x + self.proj(self.body(x))


class Stack(nnx.Module):
  """``depth`` copies of a same-size block, created with nnx.vmap and
  applied with nnx.scan."""

  def __init__(self, depth, spec, dim, *, rngs):
    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return Seq(spec, dim, rngs=rngs)
    self.layers = create(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, layer):
      return layer(x)
    return forward(x, self.layers)


class Seq(nnx.Module):
  """Applies a layer spec; see the strategies below for the vocabulary."""

  def __init__(self, spec, dim, *, rngs):
    layers = []
    for layer in spec:
      kind, arg = layer[0], layer[1:]
      if kind == 'dense':
        out = arg[0] or dim
        layers.append(nnx.Linear(dim, out, rngs=rngs))
        dim = out
      elif kind == 'conv':
        layers.append(nnx.Conv(dim, arg[0], kernel_size=(3, 3), rngs=rngs))
        dim = arg[0]
      elif kind == 'layernorm':
        layers.append(nnx.LayerNorm(dim, rngs=rngs))
      elif kind == 'batchnorm':
        layers.append(nnx.BatchNorm(dim, use_running_average=arg[0],
                                    momentum=0.9, rngs=rngs))
      elif kind == 'dropout':
        layers.append(nnx.Dropout(arg[0], deterministic=arg[1], rngs=rngs))
      elif kind == 'act':
        layers.append(Act(arg[0]))
      elif kind == 'shared':
        layers.append(SharedPair(dim, arg[0], rngs=rngs))
      elif kind == 'residual':
        layers.append(Residual(arg[0], dim, rngs=rngs))
      elif kind == 'nested':
        layers.append(Seq(arg[0], dim, rngs=rngs))
        dim = layers[-1].out_dim
      elif kind == 'scan':
        layers.append(Stack(arg[0], arg[1], dim, rngs=rngs))
      else:  # pragma: no cover - the strategies only draw the kinds above
        raise ValueError(kind)
    self.layers = nnx.List(layers)
    self.out_dim = dim

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


# Layers that keep the feature size (for scan bodies). Dropout in a scan
# body draws from per-layer RNG streams split at creation.
same_size = st.one_of(
    st.just(('dense', 0)),
    st.just(('layernorm',)),
    st.sampled_from(sorted(ACTIVATIONS)).map(lambda a: ('act', a)),
    st.tuples(st.just('dropout'), st.sampled_from([0.0, 0.3]),
              st.booleans()),
)

simple = st.one_of(
    same_size,
    st.integers(1, 5).map(lambda f: ('dense', f)),
    st.integers(1, 4).map(lambda f: ('conv', f)),
    st.booleans().map(lambda r: ('batchnorm', r)),
    st.sampled_from(sorted(ACTIVATIONS)).map(lambda a: ('shared', a)),
    # A scan body starts with a Linear: something to scan over.
    st.tuples(st.just('scan'), st.integers(1, 3),
              st.lists(same_size, min_size=0, max_size=2).map(
                  lambda ls: (('dense', 0), *ls))),
)

layers = st.recursive(
    simple,
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3).map(
            lambda ls: ('residual', tuple(ls))),
        st.lists(inner, min_size=1, max_size=3).map(
            lambda ls: ('nested', tuple(ls))),
    ),
    max_leaves=6,
)

architectures = st.lists(layers, min_size=1, max_size=4).map(tuple)


def expected_calls(spec) -> dict:
  """Module calls by class that one call of ``Seq(spec)`` makes outside
  scan bodies (a scan body is traced by JAX, possibly more than once)."""
  counts = {'Linear': 0, 'Conv': 0, 'BatchNorm': 0, 'Seq': 1}
  for layer in spec:
    kind = layer[0]
    if kind == 'dense':
      counts['Linear'] += 1
    elif kind == 'conv':
      counts['Conv'] += 1
    elif kind == 'batchnorm':
      counts['BatchNorm'] += 1
    elif kind == 'shared':
      counts['Linear'] += 2
    elif kind in ('residual', 'nested'):
      inner = expected_calls(layer[1])
      for k, v in inner.items():
        counts[k] += v
      counts['Linear'] += kind == 'residual'
  return counts


def _plain(x):
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def _state(model):
  graphdef, state = nnx.split(model)
  return graphdef, [(jax.tree_util.keystr(p), _plain(v)) for p, v in
                    jax.tree_util.tree_flatten_with_path(state)[0]]


def _assert_states(a, b, exact=False):
  assert a[0] == b[0]
  assert [k for k, _ in a[1]] == [k for k, _ in b[1]]
  for (k, x), (_, y) in zip(a[1], b[1]):
    if exact:
      np.testing.assert_array_equal(x, y, err_msg=k)
    else:
      np.testing.assert_allclose(x, y, err_msg=k, **TOL)


def _outside_bodies(mox, type_name):
  """Module calls of a class that are not inside an equation's body."""
  found, stack = [], list(mox.children)
  while stack:
    node = stack.pop()
    if isinstance(node, yax.Mox):
      if node.type_name == type_name:
        found.append(node)
      stack.extend(node.children)
  return found


@settings(max_examples=8)
@given(architectures)
def test_random_nnx_architectures_replay(spec):
  model = Seq(spec, SHAPE[-1], rngs=nnx.Rngs(0, dropout=1))
  # Random, not evenly spaced: rows of a linspace have a mean far larger
  # than their spread, so a one-pass variance (LayerNorm on Flax 0.12.0)
  # loses 4 digits to cancellation and equal computations differ by 2e-4.
  x = jax.random.normal(jax.random.key(0), SHAPE)
  before = _state(model)
  fn = lambda m, x: m(x)
  mox = yax.make_mox(fn)(model, x)
  _assert_states(before, _state(model), exact=True)
  yax.check_mox(mox)

  counts = expected_calls(spec)
  for type_name, n in counts.items():
    assert len(_outside_bodies(mox, type_name)) == n, type_name
  for node in yax.query('//module_call[@ephemeral="false"]', mox):
    target = model
    for key in node.path:  # each path leads to a module of that class
      target = target[int(key)] if key.isdigit() else getattr(target, key)
    assert type(target).__name__ == node.type_name

  ref, ours = nnx.clone(model), nnx.clone(model)
  for _ in range(2):  # twice: the second call starts from updated state
    np.testing.assert_allclose(yax.eval_mox(mox, ours, x), fn(ref, x), **TOL)
    _assert_states(_state(ours), _state(ref))

  ref, ours = nnx.clone(model), nnx.clone(model)
  got = nnx.jit(lambda m, x: yax.eval_mox(mox, m, x))(ours, x)
  np.testing.assert_allclose(got, nnx.jit(fn)(ref, x), **TOL)
  _assert_states(_state(ours), _state(ref))
