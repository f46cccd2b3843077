"""The structural guarantees of SPEC.md ("Guarantees"), checked against plain
JAX/Flax: cache-independent and nested tracing, one interpreter that sees
every module call, rewrites that reach every body, errors during evaluation
that name where they happened, and a scoped, typed ``check_mox``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from yax._src.ir.nodes import iter_nodes
from helpers import assert_trees_close, check_rewrite, modules

KEY = jax.random.key(0)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(4, name='fc0')(x))
    return nn.Dense(3, name='fc1')(x)


@pytest.fixture
def mlp():
  model = MLP()
  x = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)
  return model, model.init(KEY, x), x


def _paths(mox):
  return sorted('/'.join(m.path) + ':' + m.type_name for m in modules(mox))


def _no_yax(text: str) -> bool:
  return 'yax_enter' not in text and 'yax_exit' not in text


# ------------------------------------------------ tracing and JAX's caches

def test_jitted_apply_traced_after_a_plain_call_gives_the_full_tree(mlp):
  model, variables, x = mlp
  alone = yax.make_mox(model.apply)(variables, x)
  f = jax.jit(model.apply)
  expected = f(variables, x)
  mox = yax.make_mox(f)(variables, x)
  assert _paths(mox) == _paths(alone) == [':MLP', 'fc0:Dense', 'fc1:Dense']
  again = yax.make_mox(f)(variables, x)  # tracing twice works
  assert str(again) == str(mox)
  assert_trees_close(yax.eval_mox(mox, variables, x), expected)
  # Nothing of YAX stays in JAX's caches.
  assert _no_yax(str(jax.make_jaxpr(f)(variables, x)))
  assert _no_yax(jax.jit(f).lower(variables, x).as_text())
  # A fresh jax.jit of the same bound method (it shares JAX's trace cache
  # with the first one) gets the full tree too.
  g = jax.jit(model.apply)
  g(variables, x)
  assert _paths(yax.make_mox(g)(variables, x)) == _paths(alone)


def test_the_users_compiled_functions_are_neither_evicted_nor_polluted(mlp):
  model, variables, x = mlp
  traces = []

  def fn(v, x):
    traces.append(1)  # runs each time JAX traces fn
    return model.apply(v, x)

  f = jax.jit(fn)
  expected = f(variables, x)
  assert len(traces) == 1
  mox = yax.make_mox(f)(variables, x)
  assert len(traces) == 2 and len(modules(mox, 'Dense')) == 2
  assert_trees_close(f(variables, x), expected)
  assert len(traces) == 2  # served from the user's cache entry: not evicted
  assert _no_yax(str(jax.make_jaxpr(f)(variables, x)))
  assert len(traces) == 2


class JitChild(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.jit(nn.Dense)(4, name='jitted')(x)
    return nn.Dense(2, name='out')(jnp.tanh(x))


def test_nn_jit_modules_traced_after_a_plain_call(mlp):
  model = JitChild()
  x = mlp[2]
  variables = model.init(KEY, x)
  expected = model.apply(variables, x)  # fills Flax's and JAX's caches
  first = yax.make_mox(model.apply)(variables, x)
  second = yax.make_mox(model.apply)(variables, x)
  assert _paths(first) == _paths(second) == [
      ':JitChild', 'jitted:Dense', 'out:Dense']
  assert_trees_close(yax.eval_mox(second, variables, x), expected)
  assert _no_yax(str(jax.make_jaxpr(model.apply)(variables, x)))


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name='ln')(x)
    h = nn.SelfAttention(num_heads=2, qkv_features=8, name='attn')(h)
    x = x + h
    h = nn.Dense(16, name='up')(nn.LayerNorm(name='ln2')(x))
    return x + nn.Dense(8, name='down')(nn.gelu(h))


class JitTransformer(nn.Module):
  """A small Transformer whose whole ``__call__`` is under ``nn.jit``."""

  @nn.jit
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Block(name=f'block{i}')(x)
    return nn.Dense(5, name='head')(x)


def _eager_call_count(model, variables, x) -> int:
  """Module method calls, counted by Flax's own interceptor with jit off.

  Not counted: the ``<lambda>`` wrapper through which Flax's ``nn.jit``
  reaches the decorated method (Flax internals, no computation of its own).
  """
  calls = []

  def count(next_fun, args, kwargs, context):
    if context.method_name not in ('setup', '<lambda>'):
      calls.append(context.module.path)
    return next_fun(*args, **kwargs)

  with jax.disable_jit(), nn.intercept_methods(count):
    model.apply(variables, x)
  return len(calls)


@pytest.fixture(scope='module')
def jit_transformer():
  model = JitTransformer()
  x = jax.random.normal(KEY, (2, 3, 8))
  return model, model.init(KEY, x), x


def test_whole_model_under_nn_jit(jit_transformer):
  model, variables, x = jit_transformer
  expected = model.apply(variables, x)
  mox = yax.make_mox(model.apply)(variables, x)
  again = yax.make_mox(model.apply)(variables, x)
  assert len(modules(mox)) == _eager_call_count(model, variables, x) > 20
  assert str(again) == str(mox)
  assert_trees_close(yax.eval_mox(mox, variables, x), expected, atol=1e-4)
  # LoRA reaches the Dense layers inside the jit body.
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=2)
  check_rewrite(res.mox)
  assert_trees_close(yax.eval_mox(res.mox, res.params, x), expected, atol=1e-4)
  trained = jax.tree_util.tree_map(
      lambda p, m: p + 0.1 if m else p, res.params, res.mask)
  assert_trees_close(yax.eval_mox(res.mox, trained, x),
                     model.apply(res.merge(trained), x), atol=1e-4)


def test_tiny_hf_bert_jitted_after_a_plain_call(tiny_bert_mox):
  from transformers import BertConfig, FlaxBertModel
  model = FlaxBertModel(BertConfig(
      vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=37, max_position_embeddings=64), seed=0)
  ids = jnp.ones((1, 8), jnp.int32)
  f = jax.jit(model.__call__)
  expected = f(ids, params=model.params)
  mox = yax.make_mox(f)(ids, params=model.params)
  assert _paths(mox) == _paths(tiny_bert_mox)
  assert_trees_close(yax.eval_mox(mox, ids, params=model.params), expected,
                     atol=1e-4)
  assert _no_yax(str(jax.make_jaxpr(f)(ids, params=model.params)))


# ---------------------------------------------------------- nested tracing

def test_make_mox_inside_a_traced_function_gives_the_same_tree(mlp):
  model, variables, x = mlp
  alone = yax.make_mox(model.apply)(variables, x)
  inner = []

  def outer(v, x):
    inner.append(yax.make_mox(model.apply)(v, x))
    return model.apply(v, x) * 2.0

  outer_mox = yax.make_mox(outer)(variables, x)
  (nested,) = inner
  assert str(nested) == str(alone)
  assert _paths(nested) == _paths(alone)
  assert _paths(outer_mox) == _paths(alone)
  assert_trees_close(yax.eval_mox(outer_mox, variables, x),
                     model.apply(variables, x) * 2.0)


# ----------------------------------------------------- one interpreter

class Lifted(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.scan(ScanBlock, variable_axes={'params': 0},
                split_rngs={'params': True}, length=2)(name='stack')(x, None)[0]
    x = nn.remat(nn.Dense)(4, name='remat')(x)
    return nn.jit(nn.Dense)(4, name='jitted')(x)


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return jnp.tanh(nn.Dense(4, name='fc')(c)), None


class Recorder(yax.Interpreter):
  def __init__(self):
    super().__init__()
    self.seen = []

  def run_module(self, mox):
    if not mox.is_ephemeral:
      self.seen.append('/'.join(mox.path))
    super().run_module(mox)


def test_interpreter_subclass_sees_module_calls_inside_bodies():
  model = Lifted()
  x = jnp.ones((2, 4))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  rec = Recorder()
  leaves = jax.tree_util.tree_leaves(((variables, x), {}))
  out = rec.run(mox, mox.consts, leaves)
  assert_trees_close(out[0], model.apply(variables, x))
  assert sorted(set(rec.seen)) == ['', 'jitted', 'remat', 'stack', 'stack/fc']
  assert sorted(rec.seen) == sorted('/'.join(m.path) for m in modules(mox))


# ------------------------------------------------ rewrites reach every body

class Branchy(nn.Module):
  def setup(self):
    self.a = nn.Dense(3)
    self.b = nn.Dense(3)
    self.loop = nn.Dense(3)

  def __call__(self, x, p):
    if self.is_initializing():
      self.a(x), self.b(x), self.loop(x)
    y = nn.cond(p > 0, lambda m, x: m.a(x), lambda m, x: m.b(x), self, x)
    return nn.while_loop(lambda m, c: c[0] < 2,
                         lambda m, c: (c[0] + 1, m.loop(c[1])), self, (0, y))[1]


@pytest.mark.parametrize('model_cls, extra', [(Lifted, ()), (Branchy, (1.0,))])
def test_lora_inside_scan_remat_jit_cond_and_while_bodies(model_cls, extra):
  model = model_cls()
  x = jnp.linspace(-1, 1, 8, dtype=jnp.float32).reshape(2, 4)[:, :4]
  if model_cls is Branchy:
    x = x[:, :3]
  variables = model.init(KEY, x, *extra)
  mox = yax.make_mox(model.apply)(variables, x, *extra)
  res = yax.lora(mox, variables, '//module_call[@type="Dense"]', rank=2)
  check_rewrite(res.mox)
  expected = model.apply(variables, x, *extra)
  assert_trees_close(yax.eval_mox(res.mox, res.params, x, *extra), expected)
  trained = jax.tree_util.tree_map(
      lambda p, m: p + 0.1 if m else p, res.params, res.mask)
  got = jax.jit(lambda v, x: yax.eval_mox(res.mox, v, x, *extra))(trained, x)
  assert not np.allclose(got, expected, atol=1e-3)
  assert_trees_close(got, model.apply(res.merge(trained), x, *extra),
                     atol=1e-5)


def test_replacement_constants_inside_a_body_stay_in_the_body():
  model = Lifted()
  x = jnp.ones((2, 4))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  scale = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
  repl = yax.make_mox(lambda h: jnp.sin(h) * scale)(jnp.zeros((2, 4)))
  assert repl.consts  # the array is a constant of the replacement
  new = yax.sub('//scan//tanh', repl, mox)
  check_rewrite(new)
  assert len(new.consts) == len(mox.consts)  # not added to the root
  p = variables['params']['stack']['fc']
  c = x
  for i in range(2):
    c = jnp.sin(c @ p['kernel'][i] + p['bias'][i]) * scale
  c = nn.Dense(4).apply({'params': variables['params']['remat']}, c)
  c = nn.Dense(4).apply({'params': variables['params']['jitted']}, c)
  assert_trees_close(yax.eval_mox(new, variables, x), c)
  assert_trees_close(jax.jit(lambda v, x: yax.eval_mox(new, v, x))(
      variables, x), c)


# ---------------------------------------------- errors during evaluation

def test_an_error_during_evaluation_names_the_module_and_equation(mlp):
  model, variables, x = mlp
  mox = yax.make_mox(model.apply)(variables, x)
  (dot,) = [e for e in iter_nodes(mox) if isinstance(e, yax.Equation)
            and e.prim.name == 'dot_general'
            and any(m.path == ('fc1',) and e in m.children
                    for m in modules(mox, 'Dense'))]
  broken = _swap(mox, dot, dot.replace(
      params={**dot.params, 'dimension_numbers': (((0,), (0,)), ((), ()))}))
  with pytest.raises(yax.InvariantError, match='dot_general'):
    yax.check_mox(broken)
  with pytest.raises(yax.EvaluationError,
                     match=r"dot_general in module call Dense.__call__ at "
                           r"path 'fc1'") as info:
    yax.eval_mox(broken, variables, x)
  assert info.value.__cause__ is not None


# --------------------------------------------------------------- check_mox

def _swap(node, old, new):
  """``node`` with ``old`` replaced by ``new`` (by identity), unchecked."""
  if node is old:
    return new
  children = [_swap(c, old, new) for c in node.children]
  if all(a is b for a, b in zip(children, node.children)):
    return node
  return node.replace(children=children)


def test_check_mox_rejects_a_symbol_read_outside_its_body():
  model = Lifted()
  x = jnp.ones((2, 4))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  yax.check_mox(mox)
  (scan,) = [e for e in iter_nodes(mox) if isinstance(e, yax.Equation)
             and e.prim.name == 'scan']
  inner = scan.children[0].outputs[0]
  leak = yax.Equation(jax.lax.neg_p, [inner], [yax.Var(inner.aval)])
  broken = mox.replace(children=[*mox.children, leak])
  with pytest.raises(yax.InvariantError, match='defined inside a body'):
    yax.check_mox(broken)
  # ... and a body that reads a symbol of the scope around it.
  outer = mox.inputs[-1]
  body = scan.children[0]
  eqn = yax.Equation(jax.lax.neg_p, [outer], [yax.Var(outer.aval)])
  bad_body = body.replace(children=[eqn, *body.children])
  bad_scan = scan.replace(children=[bad_body])
  broken = _swap(mox, scan, bad_scan)
  with pytest.raises(yax.InvariantError, match='outside the body'):
    yax.check_mox(broken)


def test_check_mox_rejects_an_equation_whose_outputs_do_not_type_check():
  mox = yax.make_mox(lambda x: jnp.sum(x, axis=0) * 2.0)(jnp.ones((3, 4)))
  yax.check_mox(mox)
  (red,) = [e for e in iter_nodes(mox) if isinstance(e, yax.Equation)
            and e.prim.name == 'reduce_sum']
  bad = red.replace(params={**red.params, 'axes': (1,)})
  broken = mox.replace(children=[bad if c is red else c for c in mox.children])
  with pytest.raises(yax.InvariantError, match='reduce_sum.*does not '
                     'type-check'):
    yax.check_mox(broken)
  yax.check_mox(broken, types=False)  # structurally fine


def test_check_mox_rejects_a_body_kept_twice():
  model = Lifted()
  x = jnp.ones((2, 4))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  (scan,) = [e for e in iter_nodes(mox) if isinstance(e, yax.Equation)
             and e.prim.name == 'scan']
  twice = scan.replace(params={**scan.params, 'jaxpr': None})
  broken = _swap(mox, scan, twice)
  with pytest.raises(yax.InvariantError, match='twice'):
    yax.check_mox(broken)


# ------------------------------------------------------------ fallbacks

def test_unbound_module_methods_are_not_recorded():
  """An unbound module's method runs as plain Python: nothing to record."""

  class Helper(nn.Module):
    width: int = 3

    def double(self, x):
      return x * 2.0

  helper = Helper()
  mox = yax.make_mox(lambda x: helper.double(x) + 1.0)(jnp.ones(3))
  assert not modules(mox)
  assert_trees_close(yax.eval_mox(mox, jnp.ones(3)), jnp.full(3, 3.0))


def test_python_values_in_a_collection_are_not_variables_of_the_call():
  """A collection may hold a Python value (a string, not traced): it is
  baked into the trace, and only array variables are inputs of the call."""

  class Counted(nn.Module):
    @nn.compact
    def __call__(self, x):
      tag = self.variable('info', 'tag', lambda: 'double')
      y = nn.Dense(2, name='fc')(x)
      return y * 2.0 if tag.value == 'double' else y

  model = Counted()
  x = jnp.ones((1, 3))
  variables = model.init(KEY, x)
  mox = yax.make_mox(model.apply)(variables, x)
  (root,) = modules(mox, 'Counted')
  assert [s.type_str for s in root.var_inputs] == ['f32[2]', 'f32[3,2]']
  assert_trees_close(yax.eval_mox(mox, variables, x), model.apply(variables, x))
