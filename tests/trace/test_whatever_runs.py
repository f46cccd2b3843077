"""SPEC guarantee "Whatever runs, traces": protocol methods are never module
calls; a call ended by an exception the model catches, or one whose start
and end fall in two JAX traces, is left out with a ``yax.TraceWarning`` and
the tree still replays exactly."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import yax
from yax._src.trace import calls as _calls
from yax._src.trace import markers as _markers
from helpers import modules

X = jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7


def _no_trace_warnings(fn, *args):
  with warnings.catch_warnings():
    warnings.simplefilter('error', yax.TraceWarning)
    return yax.make_mox(fn)(*args)


def _replays(mox, fn, *args):
  want = fn(*args)
  np.testing.assert_allclose(yax.eval_mox(mox, *args), want, rtol=1e-6)
  np.testing.assert_allclose(
      jax.jit(lambda *a: yax.eval_mox(mox, *a))(*args), want, rtol=1e-6)
  yax.check_mox(mox)


class GemmaLike(nn.Module):
  """Gemma's Transformer pattern: ``__getattr__`` and ``__call__`` under
  ``nn.jit`` (JAX and Flax probe attributes with ``hasattr``, so
  ``__getattr__`` raises AttributeError while tracing)."""

  def setup(self):
    self.d = nn.Dense(4)

  def __getattr__(self, name):
    return 3 if name == 'extra' else super().__getattr__(name)

  @functools.partial(nn.jit, static_argnames=('self',))
  def __call__(self, x):
    return self.d(x) * self.extra


class GetattrNoJit(GemmaLike):

  def __call__(self, x):
    return self.d(x) * self.extra


@pytest.mark.parametrize('cls', [GemmaLike, GetattrNoJit])
def test_getattr_is_never_a_module_call(cls):
  m = cls()
  v = m.init(jax.random.key(0), X)
  mox = _no_trace_warnings(m.apply, v, X)
  calls = [(n.type_name, n.entrypoint) for n in modules(mox)]
  assert calls == [(cls.__name__, '__call__'), ('Dense', '__call__')]
  assert yax.query('//module_call[@method="__getattr__"]', mox) == []
  _replays(mox, m.apply, v, X)


class Indexed(nn.Module):
  """Protocol methods a model may define and use in its forward pass."""

  def setup(self):
    self.layers = [nn.Dense(3), nn.Dense(3)]

  def __getitem__(self, i):
    return self.layers[i]

  def __len__(self):
    return len(self.layers)

  def __call__(self, x):
    for i in range(len(self)):
      x = self[i](x)
    return x


def test_protocol_dunders_are_never_module_calls():
  m = Indexed()
  v = m.init(jax.random.key(0), X)
  mox = _no_trace_warnings(m.apply, v, X)
  assert [n.entrypoint for n in modules(mox)] == ['__call__'] * 3
  assert [n.path for n in modules(mox, 'Dense')] == [('layers_0',),
                                                     ('layers_1',)]
  _replays(mox, m.apply, v, X)


def test_is_module_method():
  assert _calls.is_module_method('__call__')
  assert _calls.is_module_method('attend')
  assert _calls.is_module_method('_split_heads')
  for name in ('setup', '__getattr__', '__setattr__', '__getitem__',
               '__len__', '__iter__', '__post_init__'):
    assert not _calls.is_module_method(name), name


class Failing(nn.Module):
  """Reads its own parameter, calls a submodule, then raises."""

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.initializers.ones, (3,))
    y = nn.Dense(3, name='inner')(x * scale)
    if y.shape[-1] == 3:
      raise ValueError('this input is not supported')
    return y


class Catching(nn.Module):

  @nn.compact
  def __call__(self, x):
    try:
      y = Failing(name='fragile')(x)
    except ValueError:
      y = x * 2.0
    return nn.Dense(2, name='out')(y)


def test_caught_exception_leaves_the_call_out_with_a_warning():
  m = Catching()
  v = m.init(jax.random.key(0), X)
  with pytest.warns(yax.TraceWarning) as record:
    mox = yax.make_mox(m.apply)(v, X)
  messages = [str(w.message) for w in record
              if issubclass(w.category, yax.TraceWarning)]
  assert len(messages) == 1, messages
  assert "Failing.__call__ at path 'fragile'" in messages[0]
  assert 'ValueError' in messages[0]
  # The failed call is no node; the calls that completed are.
  assert [n.path for n in modules(mox)] == [(), ('fragile', 'inner'),
                                            ('out',)]
  # Its own parameter, read by equations left in the enclosing body, is an
  # input of the enclosing call (check_mox checks every body's reads).
  root_call = modules(mox)[0]
  assert len(root_call.var_inputs) == 5
  _replays(mox, m.apply, v, X)


class NnxFailing(nnx.Module):

  def __init__(self, rngs):
    self.lin = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    self.lin(x)
    raise KeyError('unsupported')


class NnxCatching(nnx.Module):

  def __init__(self, rngs):
    self.fragile = NnxFailing(rngs)
    self.out = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    try:
      y = self.fragile(x)
    except KeyError:
      y = x + 1.0
    return self.out(y)


def test_caught_exception_nnx():
  model = NnxCatching(nnx.Rngs(0))
  fn = lambda m, x: m(x)
  with pytest.warns(yax.TraceWarning, match="NnxFailing.__call__ at path "
                    "'fragile'.*KeyError"):
    mox = yax.make_mox(fn)(model, X)
  assert [n.type_name for n in modules(mox)] == ['NnxCatching', 'Linear',
                                                 'Linear']
  np.testing.assert_allclose(yax.eval_mox(mox, model, X), model(X),
                             rtol=1e-6)


def test_call_straddling_two_traces_is_left_out():
  """A call whose enter marker is bound in one trace and its exit in another
  (here: inside a ``jax.jit`` body) is no node, with a warning."""
  record = _calls.CallRecord(
      module_ty=Catching, method='__call__', params={'name': 'odd'},
      path=('odd',), var_tree=jax.tree_util.tree_structure({}),
      in_tree=jax.tree_util.tree_structure(((X,), {})), arg_statics={},
      num_arg_leaves=1, out_tree=jax.tree_util.tree_structure(X),
      num_out_leaves=1)

  def f(x):
    (h,) = _markers.enter_p.bind(x, call_id=_calls.CallId(record), num_vars=0)
    h = jnp.sin(h)
    return jax.jit(lambda h: _markers.exit_p.bind(h * 2, call_id=_calls.CallId(record))[0])(h)

  with pytest.warns(yax.TraceWarning,
                    match="Catching.__call__ at path 'odd'.*two different "
                    'JAX traces'):
    mox = yax.make_mox(f)(X)
  assert modules(mox) == []
  np.testing.assert_allclose(yax.eval_mox(mox, X), jnp.sin(X) * 2, rtol=1e-6)
  yax.check_mox(mox)
