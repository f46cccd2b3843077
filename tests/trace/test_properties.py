"""Property tests: random Linen architectures replay exactly.

Hypothesis draws an architecture as a nested tuple spec (Dense, Conv,
LayerNorm, BatchNorm, Dropout, activations, residual and nested blocks,
shared modules, ``nn.scan`` stacks); ``Seq`` builds it. For each one,
``eval_mox`` must equal ``apply`` eagerly and under ``jax.jit``, and the tree
must hold one ``module_call`` per Flax call the spec makes.
"""

import functools

import flax.linen as nn
import jax
import pytest

hypothesis = pytest.importorskip('hypothesis')
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import yax  # noqa: E402
from helpers import assert_trees_close, jit_call, modules  # noqa: E402

ACTIVATIONS = {'relu': nn.relu, 'gelu': nn.gelu, 'silu': nn.silu,
               'tanh': nn.tanh}
SHAPE = (2, 4, 4, 3)  # NHWC, so Conv applies; every other layer is per-feature
TOL = dict(rtol=1e-4, atol=1e-4)


class Seq(nn.Module):
  """Applies a layer spec; see ``layers`` below for the vocabulary."""
  spec: tuple

  @nn.compact
  def __call__(self, x):
    for layer in self.spec:
      kind, arg = layer[0], layer[1:]
      dim = x.shape[-1]
      if kind == 'dense':
        x = nn.Dense(arg[0] or dim)(x)
      elif kind == 'conv':
        x = nn.Conv(arg[0] or dim, (3, 3))(x)
      elif kind == 'layernorm':
        x = nn.LayerNorm()(x)
      elif kind == 'batchnorm':
        x = nn.BatchNorm(use_running_average=arg[0], momentum=0.9)(x)
      elif kind == 'dropout':
        x = nn.Dropout(arg[0], deterministic=arg[1])(x)
      elif kind == 'act':
        x = ACTIVATIONS[arg[0]](x)
      elif kind == 'residual':  # x + Dense(dim)(block(x))
        x = x + nn.Dense(dim)(Seq(arg[0])(x))
      elif kind == 'nested':
        x = Seq(arg[0])(x)
      elif kind == 'shared':  # one Dense, two calls
        dense = nn.Dense(dim)
        x = dense(ACTIVATIONS[arg[0]](dense(x)))
      elif kind == 'scan':
        stack = nn.scan(ScanBody, variable_axes={'params': 0},
                        split_rngs={'params': True, 'dropout': True},
                        length=arg[0])
        x, _ = stack(arg[1])(x, None)
      else:  # pragma: no cover - the strategies only draw the kinds above
        raise ValueError(kind)
    return x


class ScanBody(nn.Module):
  spec: tuple

  @nn.compact
  def __call__(self, carry, _):
    return Seq(self.spec)(carry), None


# Layers that keep the feature size (for nn.scan bodies).
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
    st.tuples(st.just('scan'), st.integers(1, 3),
              st.lists(same_size, min_size=1, max_size=3).map(tuple)),
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


def walk(spec):
  for layer in spec:
    yield layer
    if layer[0] in ('residual', 'nested'):
      yield from walk(layer[1])
    elif layer[0] == 'scan':
      yield from walk(layer[2])


def expected_counts(spec) -> dict:
  """Module calls of each class that the spec makes (a scan body once)."""
  counts = {'Dense': 0, 'Conv': 0, 'BatchNorm': 0, 'Seq': 1}
  for layer in walk(spec):
    kind = layer[0]
    if kind == 'dense':
      counts['Dense'] += 1
    elif kind == 'conv':
      counts['Conv'] += 1
    elif kind == 'batchnorm':
      counts['BatchNorm'] += 1
    elif kind == 'shared':
      counts['Dense'] += 2
    elif kind == 'residual':
      counts['Dense'] += 1
      counts['Seq'] += 1
    elif kind in ('nested', 'scan'):
      counts['Seq'] += 1
  return counts


@functools.lru_cache(maxsize=None)
def _input():
  return jax.random.normal(jax.random.key(1), SHAPE)


@settings(max_examples=25, deadline=None)
@given(spec=architectures, seed=st.integers(0, 2**16))
def test_random_architecture_replays(spec, seed):
  model = Seq(spec)
  x = _input()
  key = jax.random.key(seed)
  variables = model.init({'params': key, 'dropout': key}, x)
  kwargs = {}
  if any(l[0] == 'batchnorm' and not l[1] for l in walk(spec)):
    kwargs['mutable'] = ['batch_stats']
  if any(l[0] == 'dropout' and not l[2] for l in walk(spec)):
    kwargs['rngs'] = {'dropout': jax.random.fold_in(key, 1)}

  mox = yax.make_mox(model.apply)(variables, x, **kwargs)
  for name, count in expected_counts(spec).items():
    assert len(modules(mox, name)) == count, (name, spec)

  expected = model.apply(variables, x, **kwargs)
  got = yax.eval_mox(mox, variables, x, **kwargs)
  if 'mutable' in kwargs:
    assert isinstance(got, tuple) and len(got) == 2
  assert_trees_close(got, expected, **TOL)
  got = jit_call(lambda *a, **k: yax.eval_mox(mox, *a, **k),
                 variables, x, **kwargs)
  assert_trees_close(got, expected, **TOL)


@settings(max_examples=15, deadline=None)
@given(spec=architectures)
def test_random_architecture_prints_and_inlines_like_jax(spec):
  # A scan whose body is the identity (only no-op dropouts) differs in one
  # way: JAX sees the carry forwarded and drops it from the scan outputs,
  # while the module boundary hides that from it until the markers are gone.
  # Both compile to the same program (XLA removes the empty loop).
  hypothesis.assume(not any(
      l[0] == 'scan' and all(b[0] == 'dropout' and (b[2] or b[1] == 0.0)
                             for b in l[2]) for l in walk(spec)))
  model = Seq(spec)
  x = _input()
  variables = model.init({'params': jax.random.key(0),
                          'dropout': jax.random.key(0)}, x)
  kwargs = {'rngs': {'dropout': jax.random.key(2)}}
  if any(l[0] == 'batchnorm' and not l[1] for l in walk(spec)):
    kwargs['mutable'] = ['batch_stats']
  mox = yax.make_mox(model.apply)(variables, x, **kwargs)
  text = str(mox)
  assert text.count('module_call[') == len(modules(mox))
  fn = lambda v, x, r: model.apply(v, x, rngs=r,
                                   mutable=kwargs.get('mutable', False))
  ref = jax.make_jaxpr(fn)(variables, x, kwargs['rngs'])
  assert str(yax.to_jaxpr(mox)) == str(ref)
