"""Real third-party model code: MaxText 0.2.5's decoders (NNX, and the NNX
model bridged into Linen by its ``ToLinen`` copy, ``TransformerLinen``),
built from MaxText's own model configs shrunk to 2 layers, width 64,
vocabulary 128, with random weights (``nnx.eval_shape`` shapes, random
values; nothing is downloaded), run on a host mesh under MaxText's logical
axis rules.

Every check compares YAX with the model's own forward pass (``jax.jit`` of
the split form, or of ``TransformerLinen.apply``) on the same inputs: trace
and exact replay (Llama 2, Mistral, Gemma 1/2/3, Mixtral and DeepSeek 3 MoE;
scanned layers for Llama, Mixtral, DeepSeek 3), the summary's parameter
total (every parameter in exactly one row), LoRA (identity at init, the
adapters' sharding names, ``merge`` reproduces the adapted model) on the
attention and MLP projections, on scanned stacks and on the MoE experts,
int8 ``quantize`` and ``cast`` to bfloat16.

MaxText needs Python >= 3.12: ``bash tests/install_real_models.sh`` installs
it there (CI: the Python 3.12 venv). Where it is not installed the file is
skipped, unless ``YAX_REQUIRE_MAXTEXT=1`` (set by CI where it is installed:
a silent skip there is a defect), which makes it fail.
"""

import functools
import importlib
import os
import tempfile
import types
import warnings

import flax
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from yax._src.rewrite import quant_formats
from helpers import (assert_trees_close, assert_views_agree, import_required,
                     jit_call, modules, trained_adapters)

INSTALL = ('python3.12 -m venv .venv && .venv/bin/pip install -e ".[test]" '
           '&& bash tests/install_real_models.sh .venv/bin/python')


# MaxText sets this Flax flag at import, for every later Flax user: it is
# put back after the import and set only while these tests run (see
# ``maxtext_flags``), so the rest of the suite sees Flax as it is.
_FLAG = 'flax_always_shard_variable'


def import_maxtext():
  names = ('configs.pyconfig', 'layers.quantizations', 'models.models',
           'utils.maxtext_utils')

  def load():
    saved = getattr(flax.config, _FLAG, None)
    try:
      with warnings.catch_warnings():
        # MaxText's imports use names JAX and Flax deprecate: not YAX's.
        warnings.simplefilter('ignore', DeprecationWarning)
        return {n.split('.')[-1]: importlib.import_module(f'maxtext.{n}')
                for n in names}
    finally:
      if saved is not None:
        flax.config.update(_FLAG, saved)

  return types.SimpleNamespace(**import_required(
      'maxtext', 'MaxText 0.2.5 (Python >= 3.12)', 'YAX_REQUIRE_MAXTEXT',
      INSTALL, load))


mt = import_maxtext()

pytestmark = [
    # MaxText's own code warns (its Flax/JAX deprecations): not YAX's calls.
    pytest.mark.filterwarnings('ignore::DeprecationWarning:maxtext'),
    pytest.mark.filterwarnings('ignore::DeprecationWarning:flax'),
    # Its ToLinen copy calls `module.iter_modules()` (qwix fix-up).
    pytest.mark.filterwarnings(
        "ignore:The 'm.iter_modules\\(\\)' method is deprecated"
        ':DeprecationWarning'),
]


@pytest.fixture(scope='module', autouse=True)
def maxtext_flags():
  saved = getattr(flax.config, _FLAG, None)
  if saved is not None:
    flax.config.update(_FLAG, False)
  yield
  if saved is not None:
    flax.config.update(_FLAG, saved)


TOL = dict(rtol=1e-5, atol=1e-5)
B, L, VOCAB = 2, 8, 128
# family -> (MaxText model config, overrides that keep it tiny)
FAMILIES = {
    'llama2': ('llama2-7b', {}),
    'mistral': ('mistral-7b', {}),
    'gemma': ('gemma-2b', {}),
    'gemma2': ('gemma2-2b', {'sliding_window_size': 4}),
    'gemma3': ('gemma3-4b', {'sliding_window_size': 4}),
    'mixtral': ('mixtral-8x7b', {'num_experts': 4, 'num_experts_per_tok': 2}),
    # MLA attention (equal query and KV heads), one dense layer then MoE.
    'deepseek3': ('deepseek3-tiny', {
        'num_experts': 4, 'num_experts_per_tok': 2, 'first_num_dense_layers': 1,
        'base_num_kv_heads': 4, 'q_lora_rank': 16, 'kv_lora_rank': 16,
        'qk_nope_head_dim': 8, 'qk_rope_head_dim': 8, 'v_head_dim': 16}),
}
SCANNED = ('llama2', 'mixtral', 'deepseek3')
OUTDIR = tempfile.mkdtemp(prefix='yax-maxtext-')


def config(family: str, scan: bool):
  name, extra = FAMILIES[family]
  overrides = dict(
      model_name=name, override_model_config=True, base_num_decoder_layers=2,
      base_emb_dim=64, base_mlp_dim=64, base_moe_mlp_dim=64,
      base_num_query_heads=4, base_num_kv_heads=2, head_dim=16,
      vocab_size=VOCAB, scan_layers=scan, attention='dot_product',
      per_device_batch_size=B, max_target_length=L,
      max_prefill_predict_length=L, enable_checkpointing=False, run_name='yax',
      base_output_directory=OUTDIR, dtype='float32', weight_dtype='float32',
      # The dense expert path (CPU); no distributed runtime.
      sparse_matmul=False, megablox=False, skip_jax_distributed_system=True)
  overrides.update(extra)
  base = os.path.join(os.path.dirname(mt.pyconfig.__file__), 'base.yml')
  return mt.pyconfig.initialize(['', base], **overrides)


def random_fill(shapes, seed):
  """Random normal values (std 0.2) for the float leaves of ``shapes``; RNG
  keys and counts as NNX starts them."""
  rng = np.random.default_rng(seed)

  def fill(s):
    if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
      return jax.random.key(seed)
    if not jnp.issubdtype(s.dtype, jnp.floating):
      return jnp.zeros(s.shape, s.dtype)
    return jnp.asarray(rng.normal(0.0, 0.2, s.shape), s.dtype)
  return jax.tree.map(fill, shapes)


@functools.cache
def build(family: str, scan: bool, linen: bool = False):
  """A tiny MaxText model: its call ``run(params, tokens, positions)``, its
  params (the NNX state, or the Linen variables), the trace and the model's
  own (jitted) output."""
  cfg = config(family, scan)
  mesh = mt.maxtext_utils.get_mesh_from_config(cfg)
  quant = mt.quantizations.configure_quantization(cfg)
  tokens = (jnp.arange(B * L).reshape(B, L) * 7) % (VOCAB - 1) + 1
  positions = jnp.broadcast_to(jnp.arange(L), (B, L))

  def context():
    return _Both(jax.set_mesh(mesh), nn.logical_axis_rules(
        cfg.logical_axis_rules))

  with context():
    if linen:
      model = mt.models.transformer_as_linen(cfg, mesh, quant=quant)
      rngs = {'params': jax.random.key(0), 'dropout': jax.random.key(1)}
      shapes = jax.eval_shape(lambda: model.init(
          rngs, tokens, positions, enable_dropout=False))
      params = random_fill(shapes, 0)
      run = lambda v, t, p: model.apply(v, t, p, enable_dropout=False)
      n = sum(np.size(x) for x in jax.tree.leaves(params['params']))
    else:
      abstract = nnx.eval_shape(lambda: mt.models.Transformer(
          cfg, mesh, quant=quant, rngs=nnx.Rngs(params=0, dropout=1)))
      graphdef, shapes = nnx.split(abstract)
      params = random_fill(shapes, 0)
      run = lambda s, t, p: nnx.merge(graphdef, s)(t, p, enable_dropout=False)
      n = sum(np.size(x) for x in jax.tree.leaves(
          nnx.state(abstract, nnx.Param)))
    args = (tokens, positions)
    mox = yax.make_mox(run)(params, *args)
    expected = jax.jit(run)(params, *args)
  return types.SimpleNamespace(
      family=family, scan=scan, linen=linen, cfg=cfg, context=context,
      run=run, params=params, args=args, mox=mox, expected=expected,
      n_params=int(n))


class _Both:
  """Two context managers as one."""

  def __init__(self, a, b):
    self.a, self.b = a, b

  def __enter__(self):
    self.a.__enter__()
    self.b.__enter__()

  def __exit__(self, *exc):
    self.b.__exit__(*exc)
    return self.a.__exit__(*exc)


def jit_eval(mox, *args):
  return jit_call(lambda *a: yax.eval_mox(mox, *a), *args)


CASES = [pytest.param(f, False, id=f) for f in FAMILIES] + [
    pytest.param(f, True, id=f'{f}-scanned') for f in SCANNED]
LINEN = [pytest.param('llama2', s, id='llama2' + ('-scanned' if s else ''))
         for s in (False, True)]


# ------------------------------------------------------------------ tests

@pytest.mark.parametrize('family,scan', CASES)
def test_trace_and_exact_replay(family, scan):
  m = build(family, scan)
  with m.context():
    assert m.expected.shape == (B, L, VOCAB)
    assert_trees_close(jit_eval(m.mox, m.params, *m.args), m.expected, **TOL)
  (top,) = [r for r in yax.summary(m.mox) if r.depth == 0]
  assert top.module == 'Transformer'
  # The decoder layers are module calls at the paths of their params
  # (decoder/layers_0, ...; DeepSeek: dense_layers_0, moe_layers_0; one
  # stack per kind of layer when scanned).
  layers = {n.path for n in yax.query('//module_call', m.mox)
            if len(n.path) == 2 and n.path[0] == 'decoder'
            and 'layers' in n.path[1]}
  params = m.params['decoder']
  assert all(p[1] in params for p in layers), layers
  assert len(layers) == (2 if not scan or family == 'deepseek3' else 1)
  assert assert_views_agree(m.mox) == len(modules(m.mox))


@pytest.mark.parametrize('family,scan', CASES)
def test_summary_counts_every_parameter_once(family, scan):
  m = build(family, scan)
  (top,) = [r for r in yax.summary(m.mox) if r.depth == 0]
  assert top.params == m.n_params


@pytest.mark.parametrize('family,scan', LINEN)
def test_linen_bridge_trace_replay_and_paths(family, scan):
  """``TransformerLinen`` (MaxText's ToLinen copy) builds the NNX model
  inside its Linen call: the NNX calls are at the paths of their params,
  the bridge call holds every variable, the summary counts each once."""
  m = build(family, scan, linen=True)
  with m.context():
    assert_trees_close(jit_eval(m.mox, m.params, *m.args), m.expected, **TOL)
  assert not yax.query('//module_call[starts-with(@path, "<closure>")]',
                       m.mox)
  params = m.params['params']
  for node in yax.query('//module_call[@type="DenseGeneral"]', m.mox):
    holder = params
    for key in node.path:
      holder = holder[key]
    assert 'kernel' in holder, node.path
  (top,) = [r for r in yax.summary(m.mox) if r.depth == 0]
  # The bridge call's row holds every param; each is the own param of the
  # row of the bridged NNX module that reads it.
  assert top.module == 'TransformerLinen' and top.params == m.n_params
  assert assert_views_agree(m.mox) == len(modules(m.mox))


def test_linen_bridge_summary_counts_every_parameter_once():
  m = build('llama2', False, linen=True)
  (top,) = [r for r in yax.summary(m.mox) if r.depth == 0]
  assert top.params == m.n_params


def check_lora(m, selection, stack=()):
  """LoRA with rank 2: identity at init; trained adapters change the
  output, ``merge`` gives params the model itself computes the same with;
  every adapter is an ``nnx.LoRAParam`` whose sharding names (both
  ``out_sharding`` and its alias ``sharding_names``) are its kernel's
  contracted axes then ``None`` (A), ``None`` then the kernel's other axes
  (B); the names of a stacked kernel's stack axes (``stack``) lead both."""
  with m.context():
    res = yax.lora(m.mox, m.params, selection, rank=2, alpha=4.0,
                   key=jax.random.key(1))
    assert res.paths
    assert_trees_close(jit_eval(res.mox, res.params, *m.args), m.expected,
                       **TOL)
    trained = trained_adapters(res.params, res.mask)
    adapted = jit_eval(res.mox, trained, *m.args)
    assert not np.allclose(adapted, m.expected, **TOL)
    merged = res.merge(trained)
    assert jax.tree.structure(merged) == jax.tree.structure(m.params)
    assert_trees_close(jax.jit(m.run)(merged, *m.args), adapted, rtol=1e-4,
                       atol=1e-4)
  for path in res.paths:
    holder = res.params['params'] if m.linen else res.params
    for key in path:
      holder = holder[key]
    adapters = {k: v for k, v in holder.items() if k.endswith(
        ('lora_a', 'lora_b'))}
    assert adapters, path
    for name, var in adapters.items():
      kernel = holder[name[:-len('lora_a')].rstrip('_') or 'kernel']
      if m.linen:  # Linen params: boxed as the kernel is
        assert isinstance(var, nn.LogicallyPartitioned), (path, name)
        assert isinstance(kernel, nn.LogicallyPartitioned), (path, name)
        given = [('names', var.names, var.value, kernel.names)]
      else:
        assert isinstance(var, nnx.LoRAParam), (path, name)
        meta, kmeta = var.get_metadata(), kernel.get_metadata()
        given = [(key, meta[key], var.get_value(), kmeta[key])
                 for key in ('out_sharding', 'sharding_names')
                 if key in kmeta]
      assert given, (path, name)
      for key, names, value, knames in given:
        names, knames = tuple(names), tuple(knames)
        assert len(names) == np.ndim(value), (path, name, key, names)
        if stack and set(stack) <= set(knames):  # a stacked kernel
          assert names[:len(stack)] == stack, (path, name, key, names)
          names = names[len(stack):]
          knames = tuple(n for n in knames if n not in stack)
        # A keeps the kernel's leading (contracted) names then None; B
        # starts with None then keeps the kernel's trailing names.
        if name.endswith('lora_a'):
          assert names[-1] is None and set(names[:-1]) <= set(knames), (
              path, name, key, names, knames)
        else:
          assert names[0] is None and set(names[1:]) <= set(knames), (
              path, name, key, names, knames)
  return res


DENSE = '//module_call[@type="DenseGeneral"]'


@pytest.mark.parametrize('family', ['llama2', 'gemma3'])
def test_lora_on_every_projection(family):
  res = check_lora(build(family, False), DENSE)
  # q, k, v, out, wi_0, wi_1, wo per layer, and the logits projection
  # where the model has one (Gemma ties it to the embedding).
  per_layer = 7
  assert len(res.paths) >= 2 * per_layer


def test_lora_on_scanned_stacks():
  # The stacked kernels are (embed, layers, mlp): the layer axis leads the
  # adapters, as the scan slices them.
  check_lora(build('llama2', True), DENSE, stack=('layers',))


def test_lora_on_moe_experts():
  """RoutedMoE contracts its three expert kernels (wi_0, wi_1, wo:
  [experts, in, out]) in one call, between routing and an activation:
  each gets its adapters in place, one pair per expert (stacked on the
  experts axis), named after its kernel."""
  m = build('mixtral', False)
  res = check_lora(m, '//module_call[@type="RoutedMoE"][@method="__call__"]',
                   stack=('exp',))
  assert len(res.paths) == 2  # one MoE block per layer
  for path in res.paths:
    holder = res.params
    for key in path:
      holder = holder[key]
    for kernel in ('wi_0', 'wi_1', 'wo'):
      experts, n_in, n_out = holder[kernel].get_value().shape
      assert holder[f'{kernel}_lora_a'].get_value().shape == (
          experts, n_in, 2)
      assert holder[f'{kernel}_lora_b'].get_value().shape == (
          experts, 2, n_out)


MOE = '//module_call[@type="RoutedMoE"][@method="__call__"]'


@pytest.mark.parametrize('family,scan,weight', [
    pytest.param('mixtral', False, 'int8', id='mixtral-int8'),
    pytest.param('mixtral', True, 'nf4', id='mixtral-scanned-nf4'),
    pytest.param('deepseek3', False, 'int8', id='deepseek3-int8')])
def test_quantize_moe_experts_and_qlora(family, scan, weight):
  """The experts' kernels (wi_0, wi_1, wo: [experts, in, out]), which
  RoutedMoE contracts between routing and an activation, stored quantized
  with one scale per expert and output channel (failed before: refused as
  'the output of its contraction goes through name'); LoRA on top adapts
  them in place, per expert, and merges back into float kernels."""
  m = build(family, scan)
  with m.context():
    q = yax.quantize(m.mox, m.params, MOE, weight=weight)
    yax.check_mox(q.mox)
    back = q.dequantize(q.params)
    assert_trees_close(jit_eval(q.mox, q.params, *m.args),
                       jax.jit(m.run)(back, *m.args), rtol=1e-4, atol=1e-4)
    before, after = q.nbytes
    assert after < before
    for path in q.paths:
      for kernel in ('wi_0', 'wi_1', 'wo'):
        stored = _leaf(q.params, (*path, kernel))
        original = np.asarray(_leaf(m.params, (*path, kernel)))
        scale = _leaf(q.params, (*path, f'{kernel}_scale'))
        assert stored.shape == original.shape
        assert stored.dtype != original.dtype
        # Scanned: [experts, layers, in, out], the layers moved to the
        # front for the scan; the scales are stacked as it slices them.
        sliced = np.moveaxis(original, 1, 0)[-1] if scan else original
        last = scale[-1] if scan else scale
        experts, _, n_out = sliced.shape
        assert last.shape == (experts, 1, n_out)
        # Expert 1 (of the last layer), as a lone [in, out] kernel is.
        _, want = quant_formats.quantize_kernel(sliced[1], weight, (0,))
        np.testing.assert_array_equal(last[1], want)
    res = yax.lora(q.mox, q.params, MOE, rank=2, key=jax.random.key(3))
    assert_trees_close(jit_eval(res.mox, res.params, *m.args),
                       jit_eval(q.mox, q.params, *m.args), **TOL)
    trained = trained_adapters(res.params, res.mask)
    adapted = jit_eval(res.mox, trained, *m.args)
    merged = res.merge(trained)
    assert jax.tree.structure(merged) == jax.tree.structure(m.params)
    assert_trees_close(jax.jit(m.run)(merged, *m.args), adapted, rtol=1e-4,
                       atol=1e-4)


def test_lora_through_the_linen_bridge():
  """Under a mesh, LogicallyPartitioned.unbox passes every kernel through a
  sharding constraint before the bridged NNX modules read it: still the
  param. The adapters sit next to it in the Linen params, boxed with
  their axis names."""
  res = check_lora(build('llama2', False, linen=True), DENSE)
  # q, k, v, out, wi_0, wi_1, wo per layer, and the logits projection.
  assert len(res.paths) == 2 * 7 + 1


def test_quantize_int8():
  # Every MaxText layer runs under jax.checkpoint: quantize reaches into
  # the lifted bodies.
  m = build('llama2', False)
  with m.context():
    q = yax.quantize(m.mox, m.params, DENSE, weight='int8')
    # The rematerialized bodies return the layer state (NNX): the kernels
    # they return are the stored int8 ones (failed before: remat2's outputs
    # kept float32 types).
    yax.check_mox(q.mox)
    back = q.dequantize(q.params)
    assert_trees_close(jit_eval(q.mox, q.params, *m.args),
                       jax.jit(m.run)(back, *m.args), rtol=1e-4, atol=1e-4)
  # The state holds RNG streams (key<fry> leaves): counted, not a TypeError.
  assert any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
             for x in jax.tree.leaves(m.params))
  before, after = q.nbytes
  assert after < before


def _leaf(params, path):
  node = params['params'] if 'params' in params else params
  for k in path:
    node = node[k]
  return nn.meta.unbox(node[...] if isinstance(node, nnx.Variable) else node)


@pytest.mark.parametrize('family,linen,weight', [
    pytest.param('llama2', False, 'int8', id='llama2-scanned-int8'),
    pytest.param('llama2', False, 'nf4', id='llama2-scanned-nf4'),
    pytest.param('deepseek3', False, 'int8', id='deepseek3-scanned-int8'),
    pytest.param('llama2', True, 'int4', id='linen-llama2-scanned-int4')])
def test_quantize_scanned_stacks(family, linen, weight):
  # Scanned layers keep their kernels stacked on axis 1 ([embed, layers,
  # mlp]); a transpose moves the stack to the front before the scan slices
  # it. The stored kernel keeps its layout and its dtype becomes the
  # format's; its scales are stacked per layer on axis 0.
  m = build(family, True, linen)
  with m.context():
    q = yax.quantize(m.mox, m.params, DENSE, weight=weight)
    back = q.dequantize(q.params)
    yax.check_mox(q.mox)
    assert_trees_close(jit_eval(q.mox, q.params, *m.args),
                       jax.jit(m.run)(back, *m.args), rtol=1e-4, atol=1e-4)
  kernel = (*next(p for p in q.paths if p[-1] == 'wi_0'), 'kernel')
  stored, scale = _leaf(q.params, kernel), _leaf(
      q.params, (*kernel[:-1], 'kernel_scale'))
  original = np.asarray(_leaf(m.params, kernel))
  assert stored.shape == original.shape and stored.dtype != original.dtype
  layers = original.shape[1]
  assert scale.shape == (layers, 1, original.shape[2])
  # Layer i's slice quantized on its own, as an unscanned layer is.
  last = layers - 1
  _, ref_scale = quant_formats.quantize_kernel(original[:, last, :], weight,
                                               (0,))
  np.testing.assert_array_equal(scale[last], ref_scale)
  step = float(np.abs(original).max()) / {'int8': 127, 'int4': 7}.get(
      weight, 1)
  np.testing.assert_allclose(_leaf(back, kernel), original, atol=step)
  before, after = q.nbytes
  assert after < before


@pytest.mark.parametrize('family,scan', [
    pytest.param('llama2', True, id='llama2-scanned'),
    pytest.param('mixtral', False, id='mixtral'),
    pytest.param('mixtral', True, id='mixtral-scanned')])
def test_cast_scanned_layers_and_moe_blocks(family, scan):
  # The RoutedMoE body, replayed at bfloat16, compares its router logits
  # with float32 constants (failed before: 'lax.max requires arguments to
  # have the same dtypes').
  m = build(family, scan)
  sel = '//module_call[@type="DenseGeneral" or @type="RoutedMoE"]'
  with m.context():
    low = yax.cast(m.mox, sel, 'bfloat16')
    yax.check_mox(low)
    got = jit_eval(low, m.params, *m.args)
  assert got.dtype == m.expected.dtype
  assert not np.array_equal(got, m.expected)
  np.testing.assert_allclose(got, m.expected, rtol=0.1,
                             atol=0.1 * float(np.abs(m.expected).max()))
  cast = yax.query(sel, low)
  assert cast and all(n.params['compute_dtype'] == 'bfloat16' for n in cast)
  if family == 'mixtral':
    assert any(n.type_name == 'RoutedMoE' for n in cast)


def test_cast_to_bfloat16():
  m = build('llama2', False)
  with m.context():
    low = yax.cast(m.mox, DENSE, 'bfloat16')
    got = jit_eval(low, m.params, *m.args)
  assert got.dtype == m.expected.dtype
  assert not np.array_equal(got, m.expected)
  np.testing.assert_allclose(got, m.expected, rtol=0.1,
                             atol=0.1 * float(np.abs(m.expected).max()))
  for node in yax.query(DENSE, low):
    assert node.params['compute_dtype'] == 'bfloat16'


def test_lean_norm_reads_maxtext_rmsnorm():
  # MaxText's RMSNorm is its own NNX class (x * rsqrt(mean(x^2) + eps),
  # then an einsum with the scale; a static out_sharding argument): before,
  # lean_norm refused it by class; now it reads it from its body. Scanned
  # layers, as benchmarks/memory_maxtext.py runs them.
  scan = True
  m = build('llama2', scan)
  new = yax.lean_norm(m.mox)
  yax.check_mox(new)
  norms = yax.query('//module_call[@type="RMSNorm"]', m.mox)
  lean = yax.query('//module_call[@lean="norm"]', new)
  # Two per decoder layer (one layer body when scanned) and the final one.
  assert len(lean) == len(norms) == (3 if scan else 5)
  assert [n.path for n in lean] == [n.path for n in norms]

  # Gradients with respect to every float parameter (the state also holds
  # RNG keys and counts), against jax.grad of MaxText's own forward pass.
  leaves, tree = jax.tree.flatten(m.params)
  floats = [k for k, leaf in enumerate(leaves)
            if jnp.issubdtype(leaf.dtype, jnp.floating)]

  def loss(run):
    def f(values, *args):
      full = list(leaves)
      for k, value in zip(floats, values):
        full[k] = value
      return jnp.sum(jnp.sin(run(jax.tree.unflatten(tree, full), *args)))
    return f

  mine = lambda p, *a: yax.eval_mox(new, p, *a)
  start = [leaves[k] for k in floats]
  with m.context():
    assert_trees_close(jit_eval(new, m.params, *m.args), m.expected, **TOL)
    assert_trees_close(jax.jit(jax.grad(loss(mine)))(start, *m.args),
                       jax.jit(jax.grad(loss(m.run)))(start, *m.args),
                       rtol=1e-4, atol=1e-5)
