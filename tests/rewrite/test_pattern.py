"""Pattern rewrites: yax.match, yax.group, yax.sub on matches, explain_match.

Every rewrite is checked against an independent reference: a Hugging Face
BERT configured with the other activation and the same params, hand-written
Flax models, and gradients of reference models that call the custom function
directly.
"""

from __future__ import annotations

import io
from typing import Any
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import yax
from helpers import assert_trees_close, equations

exact_gelu = lambda x: jax.nn.gelu(x, approximate=False)
tanh_gelu = lambda x: jax.nn.gelu(x, approximate=True)


@jax.custom_vjp
def stepped_gelu(x):
  """Exact GELU forward; backward a 3-level piecewise-constant derivative
  (fewbit-style), visibly different from GELU's true derivative."""
  return exact_gelu(x)


def _stepped_fwd(x):
  return exact_gelu(x), x


def _stepped_bwd(x, g):
  slope = jnp.where(x < -1.0, 0.0, jnp.where(x < 1.0, 0.5, 1.0))
  return (g * slope.astype(g.dtype),)


stepped_gelu.defvjp(_stepped_fwd, _stepped_bwd)


def max_diff(a, b) -> float:
  return max(float(jnp.abs(jnp.asarray(x, jnp.float32) -
                           jnp.asarray(y, jnp.float32)).max())
             for x, y in zip(jax.tree_util.tree_leaves(a),
                             jax.tree_util.tree_leaves(b)))


# ------------------------------------------------------ Hugging Face BERT

BERT_SIZES = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=37,
                  max_position_embeddings=64)


@pytest.fixture(scope='module')
def bert():
  from transformers import BertConfig, FlaxBertModel
  model = FlaxBertModel(BertConfig(hidden_act='gelu', **BERT_SIZES), seed=0)
  model.params = spread(model.params)
  ids = jax.random.randint(jax.random.key(1), (2, 8), 0, 99)
  mox = yax.make_mox(lambda p, i: model(i, params=p))(model.params, ids)
  return model, ids, mox


def spread(params):
  """BERT's init (std 0.02) keeps GELU inputs near 0, where the exact and
  tanh GELUs agree to 1e-7: scale the kernels to std ~1/sqrt(fan_in)."""
  return jax.tree_util.tree_map(
      lambda a: a * (1 / (0.02 * np.sqrt(a.shape[0]))) if a.ndim == 2 else a,
      params)


def _hf_reference(act: str):
  from transformers import BertConfig, FlaxBertModel
  return FlaxBertModel(BertConfig(hidden_act=act, **BERT_SIZES), seed=0,
                       _do_init=False)


def test_bert_exact_gelus_are_found_in_each_intermediate(bert):
  model, ids, mox = bert
  ms = yax.match(exact_gelu, mox)
  assert [m.path for m in ms] == [
      ('encoder', 'layer', str(i), 'intermediate') for i in range(2)]
  inter = yax.query('//module_call[@type="FlaxBertIntermediate"]', mox)
  for m, node in zip(ms, inter):
    assert all(any(e is c for c in node.children) for e in m.equations)
    dense_out = node.children[0].outputs[0]
    assert m.inputs == [dense_out]
    assert m.outputs == node.outputs
    assert [e.prim.name for e in m.equations] == [
        e.prim.name for e in equations(yax.make_mox(exact_gelu)(
            jnp.zeros((2, 8, 37))))]
  # The tanh GELU is not in this model; the input is not modified.
  assert yax.match(tanh_gelu, mox) == []


def test_bert_sub_matches_equals_hf_gelu_new(bert):
  model, ids, mox = bert
  before = str(mox)
  new = yax.sub(yax.match(exact_gelu, mox), yax.trace_like(tanh_gelu), mox)
  yax.check_mox(new)
  assert str(mox) == before
  assert yax.match(exact_gelu, new) == []
  assert len(yax.match(tanh_gelu, new)) == 2
  ref = _hf_reference('gelu_new')(ids, params=model.params)
  out = jax.jit(lambda p, i: yax.eval_mox(new, p, i))(model.params, ids)
  orig = jax.jit(lambda p, i: yax.eval_mox(mox, p, i))(model.params, ids)
  # tanh and exact GELUs differ by up to ~5e-4: the rewrite must be far
  # closer to the gelu_new model than the original is.
  d_new, d_old = max_diff(out, ref), max_diff(orig, ref)
  assert d_old > 1e-4 and d_new < d_old / 20, (d_new, d_old)


def test_bert_group_is_seen_by_views_and_evaluates_the_same(bert):
  model, ids, mox = bert
  g = yax.group(exact_gelu, mox, 'gelu')
  yax.check_mox(g)
  nodes = yax.query('//module_call[@name="gelu"]', g)
  assert len(nodes) == 2
  assert yax.query('//module_call[@name="gelu"]/@path', g) == [
      f'encoder/layer/{i}/intermediate/gelu' for i in range(2)]
  assert all(n.is_ephemeral and n.module_ty is None for n in nodes)
  # Grouping moves the tree's own equations under the new nodes.
  ms = yax.match(exact_gelu, mox)
  for n, m in zip(nodes, ms):
    assert all(a is b for a, b in zip(n.children, m.equations))
    assert n.inputs == m.inputs and n.outputs == m.outputs
  # Evaluation is unchanged, eagerly and under jit.
  assert max_diff(jax.jit(lambda p, i: yax.eval_mox(g, p, i))(
      model.params, ids), model(ids, params=model.params)) < 1e-6
  # Printing, XML, JSON and the summary see the nodes.
  assert str(g).count('name=gelu') == 2
  buf = io.StringIO()
  yax.dump_xml(g, buf)
  assert buf.getvalue().count('name="gelu"') == 2
  assert json.dumps(g.to_dict()).count('"gelu"') >= 2
  rows = [r for r in yax.summary(g) if r.path.endswith('/gelu')]
  assert [r.path for r in rows] == [
      f'encoder/layer/{i}/intermediate/gelu' for i in range(2)]
  assert rows[0].inputs == ('f32[2,8,37]',) and rows[0].flops > 0
  from yax._src.report.html import render_html
  assert render_html(g, compress=False).count('name=\\"gelu\\"') == 2
  # The input tree has no such node.
  assert yax.query('//module_call[@name="gelu"]', mox) == []


def test_bert_sub_on_grouped_nodes_equals_sub_on_matches(bert):
  model, ids, mox = bert
  g = yax.group(exact_gelu, mox, 'gelu')
  a = yax.sub('//module_call[@name="gelu"]', yax.trace_like(tanh_gelu), g)
  b = yax.sub(yax.match(exact_gelu, mox), yax.trace_like(tanh_gelu), mox)
  yax.check_mox(a)
  yax.check_mox(b)
  assert str(a) == str(b)
  ref = _hf_reference('gelu_new')(ids, params=model.params)
  out = jax.jit(lambda p, i: yax.eval_mox(a, p, i))(model.params, ids)
  assert max_diff(out, ref) < 2e-5


def test_bert_softmax_of_every_rank_is_found_and_swapped(bert):
  # Traced at a probe shape first, then at each candidate's own rank.
  model, ids, mox = bert
  ms = yax.match(jax.nn.softmax, mox)
  assert [m.path for m in ms] == [
      ('encoder', 'layer', str(i), 'attention', 'self') for i in range(2)]
  assert [m.inputs[0].type_str for m in ms] == ['f32[2,4,8,8]'] * 2
  # An equivalent softmax written another way gives the same outputs.
  other = lambda x: jnp.exp(x - jax.nn.logsumexp(x, axis=-1, keepdims=True))
  new = yax.sub(ms, yax.trace_like(other), mox)
  yax.check_mox(new)
  assert yax.match(jax.nn.softmax, new) == []
  out = jax.jit(lambda p, i: yax.eval_mox(new, p, i))(model.params, ids)
  assert max_diff(out, model(ids, params=model.params)) < 1e-4


def test_bert_fewbit_gelu_gradients_match_a_model_using_it():
  from transformers import BertConfig, FlaxBertModel
  from transformers import modeling_flax_utils
  model = FlaxBertModel(BertConfig(hidden_act='gelu', **BERT_SIZES), seed=0)
  model.params = spread(model.params)
  ids = jax.random.randint(jax.random.key(1), (2, 8), 0, 99)
  mox = yax.make_mox(lambda p, i: model(i, params=p))(model.params, ids)
  new = yax.sub(yax.match(exact_gelu, mox), yax.trace_like(stepped_gelu), mox)
  yax.check_mox(new)
  # A loss that LayerNorm does not flatten (the mean square of its output
  # is ~1 whatever the weights).
  w = jax.random.normal(jax.random.key(2), (2, 8, BERT_SIZES['hidden_size']))
  loss = lambda run: lambda p: (run(p).last_hidden_state * w).sum()
  # Reference: HF's own BERT whose activation table entry is the custom GELU.
  table = modeling_flax_utils.ACT2FN
  saved = table['gelu']
  table['gelu'] = stepped_gelu
  try:
    ref_model = FlaxBertModel(BertConfig(hidden_act='gelu', **BERT_SIZES),
                              seed=0, _do_init=False)
    g_ref = jax.jit(jax.grad(loss(lambda p: ref_model(ids, params=p))))(
        model.params)
  finally:
    table['gelu'] = saved
  grad = lambda tree: jax.jit(jax.grad(loss(
      lambda p: yax.eval_mox(tree, p, ids))))(model.params)
  g_new, g_old = grad(new), grad(mox)
  assert max_diff(g_new, g_ref) < 1e-5
  assert max_diff(g_new, g_old) > 1e-3  # the custom backward pass is used
  # The forward pass is the exact GELU: outputs unchanged.
  run = lambda tree: jax.jit(lambda p: yax.eval_mox(tree, p, ids))(model.params)
  assert max_diff(run(new), run(mox)) < 1e-6


# ------------------------------------------------- hand-written Flax models

class Mlp(nn.Module):
  widths: tuple = (8, 12)
  act: object = exact_gelu

  @nn.compact
  def __call__(self, x):
    for w in self.widths:
      x = self.act(nn.Dense(w)(x))
    return nn.Dense(3, name='head')(x)


def test_one_pattern_matches_every_width_and_dtype():
  model = Mlp(widths=(8, 12, 5))
  x = jax.random.normal(jax.random.key(0), (4, 3))
  v = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(v, x)
  ms = yax.match(exact_gelu, mox)
  assert [m.inputs[0].type_str for m in ms] == ['f32[4,8]', 'f32[4,12]',
                                                'f32[4,5]']
  new = yax.sub(ms, yax.trace_like(tanh_gelu), mox)
  yax.check_mox(new)
  ref = Mlp(widths=(8, 12, 5), act=tanh_gelu).apply(v, x)
  assert max_diff(yax.eval_mox(new, v, x), ref) < 1e-6
  # bfloat16 activations: the pattern is traced in bfloat16 too.
  f = lambda x: exact_gelu(x.astype(jnp.bfloat16)).astype(jnp.float32) * 2
  mox16 = yax.make_mox(f)(x)
  (m16,) = yax.match(exact_gelu, mox16)
  assert m16.inputs[0].type_str == 'bf16[4,3]'
  new16 = yax.sub([m16], yax.trace_like(tanh_gelu), mox16)
  yax.check_mox(new16)
  ref16 = tanh_gelu(x.astype(jnp.bfloat16)).astype(jnp.float32) * 2
  assert max_diff(yax.eval_mox(new16, x), ref16) == 0.0


class HalfAttention(nn.Module):
  """Two softmaxes (over 8 and over 5 keys) computed in ``dtype``; JAX
  computes a half-precision softmax through float32 upcasts."""
  dtype: object = jnp.bfloat16
  act: object = jax.nn.softmax

  @nn.compact
  def __call__(self, x):
    a = self.act(nn.Dense(8, dtype=self.dtype)(x))
    b = self.act(nn.Dense(5, dtype=self.dtype, name='second')(a))
    return b


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float16])
def test_half_precision_softmax_in_a_flax_model_is_found(dtype):
  model = HalfAttention(dtype=dtype)
  x = jax.random.normal(jax.random.key(0), (2, 4), dtype)
  v = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(v, x)
  # JAX's own half-precision softmax holds float32 upcasts the float32
  # softmax lacks: the pattern must be traced at the candidate's dtype.
  half = str(jax.make_jaxpr(jax.nn.softmax)(jnp.ones((2, 8), dtype)))
  assert 'convert_element_type' in half
  assert 'convert_element_type' not in str(
      jax.make_jaxpr(jax.nn.softmax)(jnp.ones((2, 8), jnp.float32)))
  ms = yax.match(jax.nn.softmax, mox)
  short = {'bfloat16': 'bf16', 'float16': 'f16'}[jnp.dtype(dtype).name]
  assert [m.inputs[0].type_str for m in ms] == [f'{short}[2,8]',
                                                f'{short}[2,5]']
  new = yax.sub(ms, yax.trace_like(jax.nn.sigmoid), mox)
  yax.check_mox(new)
  ref = HalfAttention(dtype=dtype, act=jax.nn.sigmoid).apply(v, x)
  assert max_diff(yax.eval_mox(new, v, x), ref) == 0.0
  assert max_diff(yax.eval_mox(mox, v, x), model.apply(v, x)) == 0.0


def test_a_traced_pattern_matches_its_own_shapes_only():
  model = Mlp(widths=(8, 12))
  x = jnp.ones((4, 3))
  v = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(v, x)
  fixed = yax.make_mox(exact_gelu)(jnp.zeros((4, 12)))
  ms = yax.match(fixed, mox)
  assert [m.path for m in ms] == [()] and ms[0].inputs[0].type_str == 'f32[4,12]'


def test_within_restricts_the_search():
  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Mlp(name='a')(x) + Mlp(name='b')(x)

  x = jnp.ones((2, 3))
  v = Two().init(jax.random.key(0), x)
  mox = yax.make_mox(Two().apply)(v, x)
  assert len(yax.match(exact_gelu, mox)) == 4
  ms = yax.match(exact_gelu, mox, within='//module_call[@name="b"]')
  assert [m.path for m in ms] == [('b',), ('b',)]
  with pytest.raises(yax.PatternError, match='within= selects module calls'):
    yax.match(exact_gelu, mox, within='//module_call/@name')


def _odd_withins(mox, other):
  sin = yax.query('//sin', mox)[0]
  return [
      (5, 'found an int'), (1.5, 'found a float'), (True, 'found a bool'),
      (b'//module_call', 'found a bytes'), ({'a': 1}, 'found a dict'),
      (object(), 'found an object'),
      ([5], 'selected an int'), ([None], 'selected a NoneType'),
      ('count(//sin)', 'evaluates to the float 1.0'),
      ('true()', 'evaluates to the bool True'),
      ('string(//sin/@primitive)', "evaluates to the str 'sin'"),
      ('//sin/@primitive', "selected a str \\('sin'\\)"),
      ('//sin', 'selected an Equation'), (sin, 'selected an Equation'),
      ('//input', 'selected a Var'), ([mox, sin], 'selected an Equation'),
      ('//nothing', 'selected nothing'), ([], 'selected nothing'),
      (other, 'not a module call of this tree'),
      ([other.children[0]], 'not a module call of this tree'),
      ('//[', 'not a usable XPath expression'),
  ]


def test_odd_within_values_raise_pattern_error_naming_the_selection():
  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Mlp(name='inner')(jnp.sin(x))

  x = jnp.ones((2, 3))
  v = Outer().init(jax.random.key(0), x)
  mox = yax.make_mox(Outer().apply)(v, x)
  other = yax.make_mox(Outer().apply)(v, x)
  for within, message in _odd_withins(mox, other):
    with pytest.raises(yax.PatternError, match=message):
      yax.match(exact_gelu, mox, within=within)
    with pytest.raises(yax.PatternError, match=message):
      yax.group(exact_gelu, mox, 'g', within=within)
  with pytest.raises(yax.XPathError):  # a bad expression is also that
    yax.match(exact_gelu, mox, within='//[')
  # Module calls of this tree, however given, work.
  (inner,) = yax.query('//module_call[@name="inner"]', mox)
  for within in (inner, [inner], (inner,), iter([inner, inner]),
                 '//module_call[@name="inner"]'):
    assert len(yax.match(exact_gelu, mox, within=within)) == 2


class ScanBlock(nn.Module):
  act: object = exact_gelu

  @nn.compact
  def __call__(self, c, _):
    h = self.act(nn.Dense(4)(c))
    return h, None


class Lifted(nn.Module):
  act: object = exact_gelu

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(ScanBlock, variable_axes={'params': 0},
                   split_rngs={'params': True}, length=3)
    c, _ = scan(self.act, name='scan')(x, None)
    c, _ = nn.remat(ScanBlock)(self.act, name='remat')(c, None)
    return c + self.act(c)


def test_matches_inside_scan_and_remat_bodies_with_custom_vjp():
  x = jax.random.normal(jax.random.key(0), (2, 4))
  v = Lifted().init(jax.random.key(1), x)
  mox = yax.make_mox(Lifted().apply)(v, x)
  ms = yax.match(exact_gelu, mox)
  assert [m.path for m in ms] == [('scan',), ('remat',), ()]
  # The scan and remat matches sit in bodies held by equations.
  bodies = [b for e in equations(mox) for b in e.children]
  assert len(bodies) == 2

  g = yax.group(exact_gelu, mox, 'gelu')
  yax.check_mox(g)
  assert len(yax.query('//module_call[@name="gelu"]', g)) == 3
  assert max_diff(yax.eval_mox(g, v, x), Lifted().apply(v, x)) == 0.0

  new = yax.sub(ms, yax.trace_like(stepped_gelu), mox)
  yax.check_mox(new)
  ref = Lifted(act=stepped_gelu)
  assert max_diff(yax.eval_mox(new, v, x), ref.apply(v, x)) < 1e-6
  loss = lambda f: lambda v: (f(v) ** 2).sum()
  g_new = jax.grad(loss(lambda v: yax.eval_mox(new, v, x)))(v)
  g_ref = jax.grad(loss(lambda v: ref.apply(v, x)))(v)
  g_old = jax.grad(loss(lambda v: Lifted().apply(v, x)))(v)
  assert max_diff(g_new, g_ref) < 1e-6
  assert max_diff(g_new, g_old) > 1e-3
  # Also through the grouped tree, by XPath.
  new2 = yax.sub('//module_call[@name="gelu"]', yax.trace_like(stepped_gelu), g)
  yax.check_mox(new2)
  g_new2 = jax.grad(loss(lambda v: yax.eval_mox(new2, v, x)))(v)
  assert max_diff(g_new2, g_ref) < 1e-6


def test_patterns_with_jit_and_custom_jvp_equations():
  # nn.silu is a jit equation and nn.relu a custom_jvp_call: their params
  # hold Jaxprs, compared by structure (a fresh trace is a new object).
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.relu(nn.Dense(4)(x)) * nn.silu(x).sum() + nn.relu(x).sum()

  x = jax.random.normal(jax.random.key(0), (2, 4))
  v = M().init(jax.random.key(1), x)
  mox = yax.make_mox(M().apply)(v, x)
  relu_ms = yax.match(nn.relu, mox)
  assert len(relu_ms) == 2
  assert [m.equations[0].name for m in relu_ms] == ['relu', 'relu']
  assert len(yax.match(nn.silu, mox)) == 1
  # A custom_jvp function with another primal computation does not match.
  assert yax.match(jax.nn.softplus, mox) == []
  new = yax.sub(relu_ms, yax.trace_like(jnp.abs), mox)
  yax.check_mox(new)
  ref = lambda v, x: (jnp.abs(x @ v['params']['Dense_0']['kernel'] +
                              v['params']['Dense_0']['bias'])
                      * nn.silu(x).sum() + jnp.abs(x).sum())
  assert max_diff(yax.eval_mox(new, v, x), ref(v, x)) < 1e-5


def assert_runs_like(mox, ref, v, x, tol):
  """``mox`` computes what ``ref(v, x)`` does: eagerly, under ``jax.jit``,
  and in its gradient with respect to ``v``."""
  assert max_diff(yax.eval_mox(mox, v, x), ref(v, x)) < tol
  assert max_diff(jax.jit(lambda v, x: yax.eval_mox(mox, v, x))(v, x),
                  ref(v, x)) < tol
  loss = lambda f: lambda v: f(v, x).sum()
  assert max_diff(jax.grad(loss(lambda v, x: yax.eval_mox(mox, v, x)))(v),
                  jax.grad(loss(ref))(v)) < tol


class Experts(nn.Module):
  """A mixture-of-experts style block: the activation runs inside a
  ``jax.jit``-ed helper or a ``shard_map`` body that calls no module (as in
  EasyDeL's Mixtral, whose expert silu sits in the shard_map of its grouped
  matmul)."""
  wrap: str
  act: Any = jax.nn.silu

  @nn.compact
  def __call__(self, x):
    w = self.param('w', nn.initializers.normal(1.0), (4, 4))

    def body(x, w):
      return self.act(x @ w) * 2.0

    if self.wrap == 'jit':
      body = jax.jit(body)
    else:
      mesh = jax.make_mesh((1,), ('x',))
      spec = jax.sharding.PartitionSpec()
      body = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec),
                           out_specs=spec)
    return nn.Dense(3)(body(x, w))


@pytest.mark.parametrize('wrap', ['jit', 'shard_map'])
def test_matches_inside_a_body_that_calls_no_module(wrap):
  x = jax.random.normal(jax.random.key(0), (2, 4))
  v = Experts(wrap).init(jax.random.key(1), x)
  mox = yax.make_mox(Experts(wrap).apply)(v, x)
  before = str(mox)
  (m,) = yax.match(jax.nn.silu, mox)
  assert m.path == ()  # the body of Experts' own call
  new = yax.sub([m], yax.trace_like(jax.nn.gelu), mox)
  yax.check_mox(new)
  assert str(mox) == before  # the original tree is untouched
  ref = Experts(wrap, act=jax.nn.gelu).apply
  assert_runs_like(new, ref, v, x, 1e-5)
  assert max_diff(yax.eval_mox(mox, v, x), Experts(wrap).apply(v, x)) < 1e-6
  # Grouped first, then substituted: the same tree; a match on the new
  # tree finds gelu where silu was.
  grouped = yax.group(jax.nn.silu, mox, 'act')
  again = yax.sub('//module_call[@name="act"]', yax.trace_like(jax.nn.gelu),
                  grouped)
  assert max_diff(yax.eval_mox(again, v, x), ref(v, x)) < 1e-5
  assert yax.match(jax.nn.silu, new) == []
  assert len(yax.match(jax.nn.gelu, new)) == 1


class Looping(nn.Module):
  """An activation inside marker-free ``cond``/``scan``/``while`` bodies or
  nested ``jax.jit`` helpers."""
  kind: str
  act: Any = jnp.tanh

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4)(x)
    act = self.act
    if self.kind == 'cond':
      return jax.lax.cond(h.sum() > 0, lambda h: act(h) * 2,
                          lambda h: act(h) - 1, h)
    if self.kind == 'scan':
      return jax.lax.scan(lambda c, _: (act(c) + 0.5, None), h, None,
                          length=3)[0]
    if self.kind == 'while':
      return jax.lax.fori_loop(0, 3, lambda i, c: act(c) * 1.1, h)
    return jax.jit(lambda h: jax.jit(lambda g: act(g) * 3)(h) + 1)(h)


@pytest.mark.parametrize('kind,sites', [('cond', 2), ('scan', 1),
                                        ('while', 1), ('nested jit', 1)])
def test_matches_in_marker_free_control_flow_and_nested_jit(kind, sites):
  x = jax.random.normal(jax.random.key(0), (2, 3))
  v = Looping(kind).init(jax.random.key(1), x)
  mox = yax.make_mox(Looping(kind).apply)(v, x)
  found = yax.match(jnp.tanh, mox)
  assert len(found) == sites
  new = yax.sub(found, yax.trace_like(jnp.sin), mox)
  yax.check_mox(new)
  ref = Looping(kind, act=jnp.sin).apply
  assert_runs_like(new, ref, v, x, 1e-6)


def test_multi_output_pattern_and_pattern_constants():
  def pattern(x, y):
    return jnp.sin(x) * y, jnp.cos(x)

  def f(a, b):
    s, c = pattern(a, b)
    return s + c, c * 3.0

  a, b = jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3))
  mox = yax.make_mox(f)(a, b)
  (m,) = yax.match(pattern, mox)
  assert m.inputs == mox.inputs[:2]
  new = yax.sub([m], yax.trace_like(lambda x, y: (jnp.cos(x) * y, jnp.sin(x))),
                mox)
  yax.check_mox(new)
  assert max_diff(yax.eval_mox(new, a, b),
                  (jnp.cos(a) * b + jnp.sin(a), jnp.sin(a) * 3.0)) < 1e-6


def test_group_moves_dependent_equations_after_the_new_node():
  pattern = lambda x: (jnp.sin(x), jnp.cos(x))

  def f(x):
    s = jnp.sin(x)
    u = s * 2.0  # reads an output; sits between the matched equations
    c = jnp.cos(x)
    return u + c

  x = jnp.linspace(-1.0, 1.0, 5)
  mox = yax.make_mox(f)(x)
  (m,) = yax.match(pattern, mox)
  g = yax.group([m], mox, 'sincos')
  yax.check_mox(g)
  assert [getattr(c, 'name', None) or c.prim.name for c in g.children] == [
      'sincos', 'mul', 'add']
  assert max_diff(yax.eval_mox(g, x), f(x)) == 0.0
  new = yax.sub([m], yax.trace_like(lambda x: (jnp.cos(x), jnp.sin(x))), mox)
  yax.check_mox(new)
  assert max_diff(yax.eval_mox(new, x), jnp.cos(x) * 2.0 + jnp.sin(x)) < 1e-6


# ------------------------------------------------------------ negatives

def manual_gelu(x, *, c=0.7071067690849304):
  """The exact GELU written out as JAX writes it."""
  return (0.5 * x) * jax.lax.erfc(-x * np.float32(c))


class GeluNamedDense(nn.Module):
  """A Dense whose name is the name a group will want, then two GELUs."""

  @nn.compact
  def __call__(self, x):
    h = exact_gelu(nn.Dense(4, name='gelu')(x))
    return exact_gelu(nn.Dense(4, name='out')(h))


class OnesScale(nn.Module):
  """A replacement with a variable named like the Dense's kernel."""

  @nn.compact
  def __call__(self, x):
    w = self.param('kernel', nn.initializers.ones, (x.shape[-1], x.shape[-1]))
    return x * w[0]


def test_a_group_never_takes_the_path_of_an_existing_module():
  model = GeluNamedDense()
  x = jax.random.normal(jax.random.key(0), (2, 4))
  v = model.init(jax.random.key(1), x)
  # A module the traced call never runs still owns its path in the params.
  v = {'params': {**v['params'], 'gelu_1': {'kernel': jnp.full((4, 4), 3.0)}}}
  mox = yax.make_mox(model.apply)(v, x)
  g = yax.group(exact_gelu, mox, name='gelu')
  groups = [n for n in yax.query('//module_call[@name="gelu"]', g)
            if n.is_ephemeral]
  existing = {n.path for n in yax.query('//module_call', mox)}
  assert existing >= {('gelu',), ('out',)}
  assert [n.path for n in groups] == [('gelu_2',), ('gelu_3',)]
  # A replacement with variables gets weights of its own, not the Dense's
  # (nor the uncalled module's): compare with plain Flax.
  s = OnesScale()
  rep = yax.make_mox(s.apply)(s.init(jax.random.key(0), x), x)
  new = yax.sub(groups, rep, g)
  yax.check_mox(new)
  v2 = {'params': {**v['params'], 'gelu_2': {'kernel': jnp.ones((4, 4))},
                   'gelu_3': {'kernel': jnp.ones((4, 4))}}}
  dense = lambda name, h: nn.Dense(4).apply(
      {'params': v['params'][name]}, h)
  ref = dense('out', dense('gelu', x))  # each GELU became x * 1
  assert max_diff(yax.eval_mox(new, v2, x), ref) < 1e-6


def test_manual_gelu_matches_like_jax_nn_gelu():
  x = jnp.ones((2, 5))
  # jax.nn.gelu ends with a copy; a pattern without it matches the rest.
  assert len(yax.match(manual_gelu, yax.make_mox(manual_gelu)(x))) == 1
  assert len(yax.match(manual_gelu, yax.make_mox(exact_gelu)(x))) == 1


def test_escaping_interior_value_is_not_matched():
  def f(x):
    half = 0.5 * x
    return half * jax.lax.erfc(-x * np.float32(0.7071067690849304)), half

  mox = yax.make_mox(f)(jnp.ones((2, 5)))
  assert yax.match(manual_gelu, mox) == []
  (erfc,) = yax.query('//erfc', mox)
  why = yax.explain_match(manual_gelu, mox, erfc)
  assert why.startswith('no match') and 'also read by' in why
  assert 'an output of the enclosing body' in why


def test_across_a_module_boundary_is_not_matched():
  class Half(nn.Module):
    @nn.compact
    def __call__(self, x):
      return -x * np.float32(0.7071067690849304)

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return (0.5 * x) * jax.lax.erfc(Half()(x))

  x = jnp.ones((2, 5))
  mox = yax.make_mox(M().apply)({}, x)
  assert np.allclose(yax.eval_mox(mox, {}, x), manual_gelu(x))
  assert yax.match(manual_gelu, mox) == []
  why = yax.explain_match(manual_gelu, mox, yax.query('//erfc', mox)[0])
  assert 'another body' in why and 'module_call boundary' in why


def test_a_different_literal_is_not_matched():
  mox = yax.make_mox(lambda x: manual_gelu(x, c=0.7))(jnp.ones((3,)))
  assert yax.match(manual_gelu, mox) == []
  why = yax.explain_match(manual_gelu, mox, yax.query('//erfc', mox)[0])
  assert 'literal differs' in why and '0.7' in why


def test_a_different_param_is_not_matched():
  mox = yax.make_mox(lambda x: jnp.sum(x, axis=1) * 2.0)(jnp.ones((3, 4)))
  pattern = lambda x: jnp.sum(x, axis=0) * 2.0
  assert yax.match(pattern, mox) == []
  why = yax.explain_match(pattern, mox, yax.query('//reduce_sum', mox)[0])
  assert "param 'axes' differs" in why
  assert len(yax.match(lambda x: jnp.sum(x, axis=1) * 2.0, mox)) == 1


def test_matches_do_not_overlap_and_earlier_ones_win():
  f = lambda x: jnp.sin(jnp.sin(jnp.sin(x)))
  mox = yax.make_mox(f)(jnp.ones(3))
  sins = yax.query('//sin', mox)
  (m,) = yax.match(lambda x: jnp.sin(jnp.sin(x)), mox)
  assert m.equations == sins[:2]
  mox4 = yax.make_mox(lambda x: f(jnp.sin(x)))(jnp.ones(3))
  ms = yax.match(lambda x: jnp.sin(jnp.sin(x)), mox4)
  sins4 = yax.query('//sin', mox4)
  assert [m.equations for m in ms] == [sins4[:2], sins4[2:]]


def test_a_match_that_cannot_be_one_node_is_refused():
  pattern = lambda x, y: (jnp.sin(x), y * jnp.cos(x))

  def f(x):
    s = jnp.sin(x)
    u = s + 1.0  # depends on an output of the would-be match, feeds it
    return s, u * jnp.cos(x)

  mox = yax.make_mox(f)(jnp.ones(3))
  assert yax.match(pattern, mox) == []
  why = yax.explain_match(pattern, mox, yax.query('//sin', mox)[0])
  assert 'cannot be one node' in why


def _sin_and_scaled(x, y):
  s = jnp.sin(x)
  return s, s * y


def _crossed(xa, xb):
  """Two occurrences of _sin_and_scaled, each scaled by a function of the
  other's sine: either one alone is a convex match, but grouped together
  they would read each other's outputs (a cycle)."""
  sa, sb = jnp.sin(xa), jnp.sin(xb)
  ya, yb = jnp.cos(sb), jnp.exp(sa)
  return sa * ya, sb * yb


def test_matches_that_read_each_others_outputs_never_group_into_a_cycle():
  xa, xb = jnp.arange(3.0), jnp.arange(3.0) + 0.5
  mox = yax.make_mox(_crossed)(xa, xb)
  sin_a, sin_b = yax.query('//sin', mox)
  mul_a, mul_b = yax.query('//mul', mox)
  assert sin_a.inputs[0] is mox.inputs[0]
  ms = yax.match(_sin_and_scaled, mox)
  # The earlier occurrence (in evaluation order) wins; the other cannot be
  # grouped with it.
  assert [m.equations for m in ms] == [[sin_a, mul_a]]
  g = yax.group(_sin_and_scaled, mox, 'p')
  yax.check_mox(g)
  assert max_diff(yax.eval_mox(g, xa, xb), _crossed(xa, xb)) == 0.0
  # Matches put together by hand are refused, and the tree is unchanged.
  a = yax.Match([sin_a, mul_a], [xa_sym := mox.inputs[0], mul_a.inputs[1]],
                [sin_a.outputs[0], mul_a.outputs[0]], (), mox)
  b = yax.Match([sin_b, mul_b], [mox.inputs[1], mul_b.inputs[1]],
                [sin_b.outputs[0], mul_b.outputs[0]], (), mox)
  assert xa_sym is sin_a.inputs[0]
  before = str(mox)
  with pytest.raises(yax.SubstitutionError, match='cannot be grouped'):
    yax.group([a, b], mox, 'p')
  with pytest.raises(yax.SubstitutionError, match='cannot be grouped'):
    yax.sub([a, b], yax.trace_like(_sin_and_scaled), mox)
  assert str(mox) == before


class Shifted(nn.Module):
  """Reads ``shift`` (an array computed outside) through its field, not
  through its arguments."""
  shift: object = None

  @nn.compact
  def __call__(self, x):
    return x + self.shift


class ReadsThroughClosure(nn.Module):
  feeds_back: bool = False

  @nn.compact
  def __call__(self, x):
    s = jnp.sin(x)
    t = Shifted(shift=s)(x)
    if self.feeds_back:
      return s, x * t   # the module call sits between two matched values
    return jnp.cos(x), t


def test_a_module_call_reading_a_match_output_through_a_closure_stays_after():
  x = jnp.arange(4.0)
  model = ReadsThroughClosure()
  v = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(v, x)
  (call,) = yax.query('//module_call[@type="Shifted"]', mox)
  assert call.inputs == [mox.inputs[-1]]  # reads sin(x) by closure only
  g = yax.group(lambda x: (jnp.sin(x), jnp.cos(x)), mox, 'p')
  yax.check_mox(g)
  body = yax.query('//module_call[@type="ReadsThroughClosure"]', g)[0]
  kinds = [c.params.get('name') if isinstance(c, yax.Mox) else c.prim.name
           for c in body.children]
  assert kinds == ['p', 'Shifted_0']
  assert max_diff(yax.eval_mox(g, v, x), model.apply(v, x)) == 0.0
  # The same module call between a match's equations, feeding one of them:
  # no match (it could not be one node).
  model = ReadsThroughClosure(feeds_back=True)
  mox = yax.make_mox(model.apply)(v, x)
  assert yax.match(lambda x, y: (jnp.sin(x), x * y), mox) == []
  why = yax.explain_match(lambda x, y: (jnp.sin(x), x * y), mox,
                          yax.query('//sin', mox)[0])
  assert 'Shifted_0' in why and 'cannot be one node' in why


def test_pattern_inputs_do_not_match_literals():
  mox = yax.make_mox(lambda x: jnp.sin(x) * 3.0)(jnp.ones(3))
  assert yax.match(lambda x, y: jnp.sin(x) * y, mox) == []
  why = yax.explain_match(lambda x, y: jnp.sin(x) * y, mox,
                          yax.query('//sin', mox)[0])
  assert 'the literal 3.0' in why


def test_explain_a_primitive_the_pattern_lacks():
  mox = yax.make_mox(lambda x: jnp.cos(x))(jnp.ones(3))
  why = yax.explain_match(exact_gelu, mox, yax.query('//cos', mox)[0])
  assert why.startswith('no match') and 'no cos equation' in why


@pytest.mark.parametrize('pattern, message', [
    (lambda x: x, 'computes nothing'),
    (lambda x, y: (jnp.sin(x), jnp.cos(y)), 'not connected'),
    (lambda x, y: jnp.sin(x), 'input 1 .* is not read'),
    (lambda *xs: jnp.sin(xs[0]), 'cannot tell how many arrays'),
    (lambda x: (jnp.sin(x), x), 'output 1 .* is one of its inputs'),
    (lambda x: x @ jnp.ones((5, 7, 9, 11)), 'cannot trace the pattern'),
    ('//erfc', 'a pattern must be a function'),
])
def test_unusable_patterns_raise_pattern_error(pattern, message):
  mox = yax.make_mox(lambda x, y: jnp.sin(x) + jnp.cos(y))(
      jnp.ones(3), jnp.ones(3))
  with pytest.raises(yax.PatternError, match=message):
    yax.match(pattern, mox)


@pytest.mark.parametrize('pattern, message', [
    (lambda x, y: (jnp.sin(x), jnp.cos(y)), 'not connected'),
    (lambda x, y: jnp.sin(x), 'input 1 .* is not read'),
])
def test_unusable_patterns_are_refused_without_a_candidate(pattern, message):
  """Validated before any search: the tree holds no sin or cos."""
  mox = yax.make_mox(lambda x: jnp.exp(x) * 2.0)(jnp.ones(3))
  with pytest.raises(yax.PatternError, match=message):
    yax.match(pattern, mox)


@jax.jit
def _jitted_gelu_helper(x):
  return jnp.tanh(exact_gelu(x)) + 1.0


def test_match_holds_only_equations_map_mox_visits():
  """A match inside a jit-ed helper's body (a Jaxpr calling no module)."""
  mox = yax.make_mox(lambda x: _jitted_gelu_helper(x) * 2.0)(jnp.ones(3))
  ms = yax.match(exact_gelu, mox)
  assert len(ms) == 1
  visited = {id(n) for n in yax.map_mox(lambda n: n, mox)}
  assert all(id(e) in visited for e in ms[0].equations)


def test_an_activation_inside_a_shard_map_body_is_found_and_swapped():
  """MoE experts under shard_map (EasyDeL's Mixtral): a body that calls no
  module; on a mesh of one device."""
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((1,), ('x',))

  def experts(act):
    return jax.shard_map(
        lambda x, w: act(jnp.einsum('bi,eio->ebo', x, w)).sum(0),
        mesh=mesh, in_specs=(P(), P()), out_specs=P())

  x = jnp.linspace(-2.0, 2.0, 8).reshape(2, 4)
  w = jnp.linspace(-1.0, 1.0, 48).reshape(3, 4, 4)
  mox = yax.make_mox(lambda x, w: experts(jax.nn.silu)(x, w) + 1.0)(x, w)
  sites = yax.match(jax.nn.silu, mox)
  assert len(sites) == 1
  visited = {id(n) for n in yax.map_mox(lambda n: n, mox)}
  assert all(id(e) in visited for e in sites[0].equations)
  new = yax.sub(sites, yax.trace_like(jnp.tanh), mox)
  yax.check_mox(new)
  want = experts(jnp.tanh)(x, w) + 1.0
  np.testing.assert_allclose(yax.eval_mox(new, x, w), want, rtol=1e-6,
                             atol=1e-6)
  assert not np.allclose(yax.eval_mox(mox, x, w), want)


def test_sub_rejects_matches_of_another_tree_and_leaves_the_tree_intact():
  f = lambda x: jnp.tanh(exact_gelu(x))
  mox_a = yax.make_mox(f)(jnp.ones(3))
  mox_b = yax.make_mox(f)(jnp.ones(3))
  ms = yax.match(exact_gelu, mox_a)
  before = str(mox_b)
  with pytest.raises(yax.SubstitutionError, match='not a match in this tree'):
    yax.sub(ms, yax.trace_like(tanh_gelu), mox_b)
  assert str(mox_b) == before
  with pytest.raises(yax.SubstitutionError, match='mixes Match objects'):
    yax.sub([ms[0], yax.query('//tanh', mox_a)[0]], yax.trace_like(jnp.sin),
            mox_a)
  # A replacement of the wrong type: SubstitutionError, nothing changes.
  before = str(mox_a)
  with pytest.raises(yax.SubstitutionError, match='output 0 has type'):
    yax.sub(ms, yax.trace_like(lambda x: x.sum()), mox_a)
  assert str(mox_a) == before


# ---------------------------------------------------- property test

UNARY = {
    'sin': jnp.sin, 'tanh': jnp.tanh, 'neg': lambda x: -x,
    'square': lambda x: x * x, 'scale': lambda x: x * 1.5,
    'shift': lambda x: x + 0.25, 'sigmoid': jax.nn.sigmoid,
    'abs': jnp.abs, 'exp_neg_sq': lambda x: jnp.exp(-x * x),
}


def _compose(names):
  def f(x):
    for name in names:
      x = UNARY[name](x)
    return x
  return f


class RandomModel(nn.Module):
  widths: tuple
  wrap: tuple  # per layer: apply the activation in a submodule?
  act: object

  @nn.compact
  def __call__(self, x):
    for i, (w, sub) in enumerate(zip(self.widths, self.wrap)):
      x = nn.Dense(w)(x)
      if sub:
        x = Act(self.act, name=f'act_{i}')(x)
      else:
        x = self.act(x)
    return nn.Dense(2)(x)


class Act(nn.Module):
  fn: object

  @nn.compact
  def __call__(self, x):
    return self.fn(x)


@settings(max_examples=15)
@given(names=st.lists(st.sampled_from(sorted(UNARY)), min_size=1, max_size=4),
       widths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       wrap=st.lists(st.booleans(), min_size=3, max_size=3),
       batch=st.integers(1, 3))
def test_random_elementwise_patterns_in_random_models(names, widths, wrap,
                                                      batch):
  act = _compose(names)
  model = RandomModel(tuple(widths), tuple(wrap[:len(widths)]), act)
  x = jax.random.normal(jax.random.key(0), (batch, 3))
  v = model.init(jax.random.key(1), x)
  mox = yax.make_mox(model.apply)(v, x)
  ms = yax.match(act, mox)
  assert len(ms) == len(widths)
  assert [m.inputs[0].aval.shape for m in ms] == [(batch, w) for w in widths]
  # An equivalent function with another structure: the same math under jit.
  new = yax.sub(ms, yax.trace_like(jax.jit(act)), mox)
  yax.check_mox(new)
  assert len(equations(new, prim='jit')) == len(widths)
  expected = jax.jit(model.apply)(v, x)
  assert_trees_close(jax.jit(lambda v, x: yax.eval_mox(new, v, x))(v, x),
                     expected, rtol=1e-5, atol=1e-6)
  g = yax.group(act, mox, 'act')
  yax.check_mox(g)
  assert len(yax.query('//module_call[@name="act"]', g)) == len(widths)
  assert_trees_close(jax.jit(lambda v, x: yax.eval_mox(g, v, x))(v, x),
                     expected)


def test_group_path_is_fresh_next_to_a_picky_argument():
  """A group's path is none that the traced arguments name (here the
  params' 'gelu' entry). A pytree node of the user's whose unflatten
  refuses placeholder leaves (Picky) used to leave the arguments' names
  unread, and the group took the path 'gelu'."""
  from helpers import Picky

  def f(params, p, x):
    return exact_gelu(x @ params['gelu']['w']) * p.w

  params = {'gelu': {'w': jnp.eye(3)}}
  args = (params, Picky(jnp.full(3, 2.0)), jnp.linspace(-1.0, 1.0, 3))
  mox = yax.make_mox(f)(*args)
  g = yax.group(exact_gelu, mox, 'gelu')
  yax.check_mox(g)
  (node,) = [n for n in yax.map_mox(lambda n: n, g)
             if isinstance(n, yax.Mox) and n.name == 'gelu']
  assert node.path == ('gelu_1',)
  np.testing.assert_allclose(yax.eval_mox(g, *args), f(*args), rtol=1e-6)


def test_a_pattern_that_cannot_be_traced_at_a_dtype_says_so():
  # Before: the failed bfloat16 probe was dropped without a word, and
  # explain_match gave the float32 trace's first difference instead
  # ("primitive differs (pattern tanh, tree convert_element_type)").
  def no_half(x):
    if x.dtype == jnp.bfloat16:
      raise TypeError('no bfloat16 form')
    return jnp.tanh(x.astype(jnp.float32)).astype(x.dtype) * 2.0

  model = lambda x: jnp.tanh(x.astype(jnp.float32)).astype(x.dtype) * 2.0
  x = jnp.ones((2, 3), jnp.bfloat16)
  mox = yax.make_mox(model)(x)
  assert yax.match(no_half, mox) == []
  why = yax.explain_match(no_half, mox, yax.query('//mul', mox)[0])
  assert why.startswith('no match'), why
  assert 'cannot be traced with bfloat16 inputs' in why, why
  assert 'TypeError: no bfloat16 form' in why, why
  # The same model in float16 matches: the reason is the dtype alone.
  f16 = yax.make_mox(model)(x.astype(jnp.float16))
  assert len(yax.match(no_half, f16)) == 1
