"""Real third-party NNX model code: EasyDeL 0.3.0's model zoo (Llama,
Mistral, Qwen 2, Gemma 2 and Mixtral with a mixture of experts), built from
tiny configs written out here, with random weights (nothing is downloaded).

Every check compares YAX with the model's own forward pass on the same
inputs: trace (the model unchanged, module calls counted from the config),
replay eagerly and under ``jax.jit``/``nnx.jit``, state updates (dropout's
RNG counts), XPath queries for the attention projections, an activation swap
against the model patched by hand, LoRA (identity at init, gradients equal
to the model's own kernel gradients, ``merge`` reproduces the adapted model),
int8 quantization and bfloat16 casts of the attention projections and MLP
linears (against the model's own forward on the dequantized weights, and
within bfloat16's error of its float32 forward) and the summary's parameter
total.

EasyDeL needs transformers 5 and the rest of the suite transformers<5, so
this file runs in an environment of its own (CI: ``.ci-venv-easydel``)::

  python3 -m venv .venv-easydel && .venv-easydel/bin/pip install -e ".[test]"
  bash tests/install_easydel.sh .venv-easydel/bin/python
  .venv-easydel/bin/python -m pytest -q tests/real/test_easydel.py

Where EasyDeL is not installed (the main test environment) the whole file
is skipped, unless ``YAX_REQUIRE_EASYDEL=1`` (set by CI's EasyDeL section:
a silent skip there is a defect), which makes it fail.

What EasyDeL 0.3.0 needs on a CPU without PyTorch, done here:
``EASYDEL_AUTO=0 ENABLE_DISTRIBUTED_INIT=0`` before its import (otherwise it
sets GPU-only XLA flags that jaxlib's CPU client aborts on), five Hugging
Face modeling modules replaced by empty ones (see ``import_easydel``), its
forward run under ``with model.mesh:``, and Mixtral's grouped matmul forced
to XLA (``moe_force_xla_gmm=True``; otherwise it autotunes for minutes).
``nnx.jit`` cannot run an EasyDeL model's own forward (its ``frequencies``
cached property creates a Variable inside the trace: "Cannot extract graph
node from different trace level"), so the model's own forward is run with
``jax.jit`` over its split form (``own_forward``), as EasyDeL compiles it.
"""

import functools
import importlib
import importlib.util
import os
import sys
import types
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from yax._src.report import summary as _summary
from helpers import assert_trees_close

TOL = dict(rtol=1e-4, atol=1e-4)
INSTALL = ('python3 -m venv .venv-easydel && .venv-easydel/bin/pip install '
           '-e ".[test]" && bash tests/install_easydel.sh '
           '.venv-easydel/bin/python')
# Hugging Face modeling modules that EasyDeL's config modules patch at import
# time; without torch, transformers 5 makes each of them a placeholder that
# raises ImportError on the first attribute read (EasyDeL only guards the
# import itself). EasyDeL's own model code never uses them.
TORCH_ONLY_HF_MODULES = ('glm4v_moe', 'llama4', 'phimoe', 'qwen3_5_moe',
                         'qwen3_next')


def _required() -> bool:
  return os.environ.get('YAX_REQUIRE_EASYDEL', '').strip().lower() not in (
      '', '0', 'false', 'no')


def import_easydel():
  """``import easydel`` the way it runs on a CPU without PyTorch.

  Skips the module when EasyDeL is not installed (fails instead when
  ``YAX_REQUIRE_EASYDEL`` is set). Sets ``EASYDEL_AUTO=0`` and
  ``ENABLE_DISTRIBUTED_INIT=0`` (read at import), and, when torch is not
  installed, puts an empty module in place of each of
  ``transformers.models.<name>.modeling_<name>`` for the names in
  ``TORCH_ONLY_HF_MODULES``: as the attribute of the (lazy) package, which is
  where ``from transformers.models.X import modeling_X`` looks first, and in
  ``sys.modules``.
  """
  if importlib.util.find_spec('easydel') is None:
    msg = f'EasyDeL is not installed (it runs in its own venv: {INSTALL})'
    if _required():
      pytest.fail(msg + '; YAX_REQUIRE_EASYDEL is set', pytrace=False)
    pytest.skip(msg, allow_module_level=True)
  os.environ['EASYDEL_AUTO'] = '0'
  os.environ['ENABLE_DISTRIBUTED_INIT'] = '0'
  if importlib.util.find_spec('torch') is None:
    for family in TORCH_ONLY_HF_MODULES:
      name = f'transformers.models.{family}.modeling_{family}'
      stub = types.ModuleType(name)
      stub.__doc__ = f'empty: {name} needs torch (tests/real/test_easydel.py)'
      sys.modules[name] = stub
      package = importlib.import_module(f'transformers.models.{family}')
      setattr(package, f'modeling_{family}', stub)
  try:
    with warnings.catch_warnings():
      # EasyDeL's own import uses names Flax deprecates (`nnx.VariableState`
      # in easydel.utils.traversals): not YAX's calls. (pytest.importorskip
      # would ignore every warning of the import in the same way.)
      warnings.simplefilter('ignore', DeprecationWarning)
      return importlib.import_module('easydel')
  except ImportError as e:
    if _required():  # a failure, with its traceback
      raise
    pytest.skip(f'EasyDeL does not import ({e}); run: {INSTALL}',
                allow_module_level=True)


ed = import_easydel()

pytestmark = [
    # EasyDeL 0.3.0 finds its mesh in the legacy `with mesh:` context only
    # (under `jax.set_mesh(mesh)` its attention asserts "No mesh found under
    # this context manager"); jax warns when a test enters it.
    pytest.mark.filterwarnings(
        'ignore:`with mesh.` context manager has been deprecated'
        ':DeprecationWarning'),
    # EasyDeL reads its weights as `variable.value` (Flax warns from its
    # variablelib; attributed to EasyDeL's modules).
    pytest.mark.filterwarnings(
        "ignore:'.value' access is now deprecated:DeprecationWarning:easydel"),
    # EasyDeL's module protocol calls `m.iter_children()`.
    pytest.mark.filterwarnings(
        "ignore:The 'm.iter_children\\(\\)' method is deprecated"
        ':DeprecationWarning:easydel'),
    # eformer's sharding constraints read the legacy mesh context.
    pytest.mark.filterwarnings(
        'ignore:jax.interpreters.pxla.thread_resources is deprecated'
        ':DeprecationWarning:eformer'),
]


# ------------------------------------------------------------ tiny configs

B, L, VOCAB = 2, 8, 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
HEAD_DIM = 8

FAMILIES = ('llama', 'mistral', 'qwen2', 'gemma2', 'mixtral')

# What each family's code does, for the checks (read from EasyDeL's source):
# its classes, where the MLP sits in a decoder layer and which attribute of
# it holds the activation (`ACT2FN[config.hidden_act]`, fixed at
# construction), and the MLP's linear layers that are module calls.
SPECS = {
    'llama': dict(config='LlamaConfig', cls='LlamaForCausalLM',
                  attn='LlamaAttention', mlp='LlamaMLP', mlp_at='mlp',
                  act_at=('mlp', 'act_fn'), act='silu', mlp_linears=3,
                  layer_norms=2,
                  dropout=dict(embd_pdrop=0.25, resid_pdrop=0.25)),
    'mistral': dict(config='MistralConfig', cls='MistralForCausalLM',
                    attn='MistralAttention', mlp='MistralMLP', mlp_at='mlp',
                    act_at=('mlp', 'act_fn'), act='silu', mlp_linears=3,
                    layer_norms=2,
                    extra=dict(head_dim=HEAD_DIM, sliding_window=4)),
    # Qwen 2: q/k/v projections with biases. Its embedding dropout has no
    # RNG stream (EasyDeL builds it without `rngs`, so a rate > 0 fails in
    # EasyDeL's own forward): only the residual dropouts are turned on.
    'qwen2': dict(config='Qwen2Config', cls='Qwen2ForCausalLM',
                  attn='Qwen2Attention', mlp='Qwen2MLP', mlp_at='mlp',
                  act_at=('mlp', 'act_fn'), act='silu', mlp_linears=3,
                  layer_norms=2, dropout=dict(resid_pdrop=0.25)),
    # Gemma 2: tanh GELU (inlined, found by data flow), four norms a layer,
    # logit soft-capping, the head tied to the embedding.
    'gemma2': dict(config='Gemma2Config', cls='Gemma2ForCausalLM',
                   attn='Gemma2Attention', mlp='Gemma2MLP', mlp_at='mlp',
                   act_at=('mlp', 'act'), act='gelu_tanh', mlp_linears=3,
                   layer_norms=4,
                   extra=dict(head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                              sliding_window=4, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0)),
    # Mixtral: every layer a sparse mixture of experts (top-2 of 4); the
    # experts' kernels are read by the MoE block itself (a grouped matmul),
    # the router `gate` is its one linear module call.
    'mixtral': dict(config='MixtralConfig', cls='MixtralForCausalLM',
                    attn='MixtralAttention', mlp='MixtralSparseMoeBlock',
                    mlp_at='block_sparse_moe',
                    act_at=('block_sparse_moe', 'experts', 'act_fn'),
                    act='silu', mlp_linears=1, layer_norms=2,
                    extra=dict(num_local_experts=4, num_experts_per_tok=2,
                               moe_force_xla_gmm=True)),
}
# EasyDeL's linear layers; each `__call__` calls a helper method of its own
# (a module call too).
LINEAR = ('//module_call[@type="ColumnParallelLinear" or '
          '@type="RowParallelLinear"][@method="__call__"]')
GELU_TANH = functools.partial(jax.nn.gelu, approximate=True)


def make_config(family, **overrides):
  spec = SPECS[family]
  return getattr(ed, spec['config'])(
      **{**COMMON, **spec.get('extra', {}), **overrides})


def build(family, config):
  return getattr(ed, SPECS[family]['cls'])(
      config=config, dtype=jnp.float32, param_dtype=jnp.float32,
      precision=None, rngs=nnx.Rngs(0))


def randomize(model, seed):
  """Every parameter drawn again at random (std 0.2) in place: EasyDeL
  initialises kernels with std 0.02 and norm scales to ones, which leaves
  logits nearly uniform and an activation swap nearly invisible."""
  rng = np.random.default_rng(seed)
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(
      lambda x: jnp.asarray(rng.normal(0.0, 0.2, x.shape).astype(x.dtype)),
      params))
  return model


def n_params(model) -> int:
  return sum(int(np.size(x)) for x in jax.tree.leaves(nnx.state(model,
                                                                nnx.Param)))


def to_numpy(tree):
  """Leaves as NumPy arrays (PRNG keys as their key data)."""
  return jax.tree.map(
      lambda x: np.asarray(jax.random.key_data(x) if jnp.issubdtype(
          x.dtype, jax.dtypes.prng_key) else x), tree)


def snapshot(model):
  graphdef, state = nnx.split(model)
  return graphdef, to_numpy(state)


def call(m, input_ids):
  return m(input_ids=input_ids)


def own_forward(model, ids):
  """The model's own forward pass, compiled with ``jax.jit`` over its split
  form (``nnx.jit`` fails on EasyDeL models, see the module docstring)."""
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, ids: call(nnx.merge(graphdef, s), ids))(state, ids)


@pytest.fixture(scope='module', params=FAMILIES)
def lm(request):
  family = request.param
  spec = SPECS[family]
  config = make_config(family)
  model = randomize(build(family, config), seed=7)
  ids = (jnp.arange(B * L, dtype=jnp.int32).reshape(B, L) * 7) % 63 + 1
  with model.mesh:
    before = snapshot(model)
    mox = yax.make_mox(call)(model, ids)
    after = snapshot(model)
    expected = own_forward(model, ids)
  return types.SimpleNamespace(
      family=family, spec=spec, config=config, model=model, ids=ids, mox=mox,
      expected=expected, before=before, after=after)


@pytest.fixture(autouse=True)
def _model_mesh(request):
  """EasyDeL's forward (and so its traced tree) runs under its mesh."""
  if 'lm' not in request.fixturenames:
    yield
    return
  with request.getfixturevalue('lm').model.mesh:
    yield


def fresh(lm):
  """A copy of the model as built: every replay of the module form runs on
  one, since the first call changes an EasyDeL model (see
  ``test_trace_replay_eager_and_jit``) and a tree traced before it no longer
  matches the model after it."""
  return nnx.clone(lm.model)


def jit_eval(mox, *args):
  return jax.jit(lambda *a: yax.eval_mox(mox, *a))(*args)


def split_form(lm):
  graphdef, state = nnx.split(lm.model)
  fn = lambda s, ids: call(nnx.merge(graphdef, s), ids)
  return graphdef, state, fn, yax.make_mox(fn)(state, lm.ids)


def layer_paths(lm, *tail):
  return [('model', 'layers', str(i), *tail)
          for i in range(lm.config.num_hidden_layers)]


def attention_xpath(lm):
  return f'//module_call[@type="{lm.spec["attn"]}"][@method="__call__"]'


def mlp_xpath(lm):
  return f'//module_call[@type="{lm.spec["mlp"]}"][@method="__call__"]'


# ------------------------------------------------------------------ tests

def test_trace_replay_eager_and_jit(lm):
  out = lm.expected
  assert out.logits.shape == (B, L, VOCAB)
  assert out.last_hidden_state.shape == (B, L, lm.config.hidden_size)
  # Tracing does not change the model.
  assert lm.after[0] == lm.before[0]
  assert_trees_close(lm.after[1], lm.before[1], rtol=0, atol=0)
  # Eagerly, next to the model's own eager call. The first call of an
  # EasyDeL model caches its RoPE table on the base model (`frequencies`, a
  # cached property holding an nnx Variable): a state update, which
  # eval_mox applies as the call does.
  assert 'frequencies' not in vars(lm.model.model)
  own, replayed = fresh(lm), fresh(lm)
  want = call(own, lm.ids)
  assert_trees_close(want, out, **TOL)
  assert_trees_close(yax.eval_mox(lm.mox, replayed, lm.ids), want, **TOL)
  # (Read from the instances: reading the property would compute it.)
  assert 'frequencies' in vars(replayed.model)
  assert 'frequencies' in vars(own.model)
  np.testing.assert_array_equal(
      np.asarray(replayed.model.frequencies[...]),
      np.asarray(own.model.frequencies[...]))
  # The functional form under jax.jit.
  _, state, _, mox = split_form(lm)
  assert_trees_close(jit_eval(mox, state, lm.ids), out, **TOL)
  # The module form under nnx.jit (which keeps its shared Rngs; jax.jit would
  # flatten the module as a pytree and duplicate them).
  assert_trees_close(
      nnx.jit(lambda m, ids: yax.eval_mox(lm.mox, m, ids))(fresh(lm), lm.ids),
      out, **TOL)


def test_replay_step_after_step(lm):
  """Three steps, as users run a model: the tree traced before the model's
  first call replays every step on one model, eagerly and under nnx.jit,
  next to the model's own calls on another (the first caches its RoPE table
  in the model: the tree accepts the model with and without it)."""
  own, eager, jitted = fresh(lm), fresh(lm), fresh(lm)
  replay = nnx.jit(lambda m, ids: yax.eval_mox(lm.mox, m, ids))
  for step in range(3):
    ids = (lm.ids + step) % VOCAB
    want = call(own, ids)
    assert_trees_close(yax.eval_mox(lm.mox, eager, ids), want, **TOL)
    assert_trees_close(replay(jitted, ids), want, **TOL)
    assert_trees_close(to_numpy(nnx.state(eager)), to_numpy(nnx.state(own)),
                       rtol=0, atol=0)
    np.testing.assert_array_equal(
        np.asarray(vars(eager.model)['frequencies'][...]),
        np.asarray(vars(own.model)['frequencies'][...]))


def test_module_calls_count_from_config(lm):
  mox, spec, layers = lm.mox, lm.spec, lm.config.num_hidden_layers
  count = lambda xpath: int(yax.query(f'count({xpath})', mox))
  top = yax.query('/*/module_call', mox)
  assert [(m.type_name, m.path) for m in top] == [(spec['cls'], ())]
  assert count('//module_call[@type="Embed"]') == 1
  assert [m.path for m in yax.query(
      '//module_call[contains(@type, "DecoderLayer")][@method="__call__"]',
      mox)] == layer_paths(lm)
  assert count(attention_xpath(lm)) == layers
  assert count(mlp_xpath(lm)) == layers
  # q, k, v, o and the MLP's linears in every layer, and the head.
  assert count(LINEAR) == layers * (4 + spec['mlp_linears']) + 1
  assert count('//module_call[contains(@type, "RMSNorm")]'
               '[@method="__call__"]') == layers * spec['layer_norms'] + 1
  assert count('//module_call[@type="RotaryEmbedding"]') == layers


def test_query_finds_the_attention_projections(lm):
  mox = lm.mox
  attention = yax.query(attention_xpath(lm), mox)
  assert [a.path for a in attention] == layer_paths(lm, 'self_attn')
  projections = yax.query(f'{attention_xpath(lm)}{LINEAR}', mox)
  assert [p.path for p in projections] == [
      (*a.path, name) for a in attention
      for name in ('q_proj', 'k_proj', 'v_proj', 'o_proj')]
  assert [p.type_name for p in projections[:4]] == (
      ['ColumnParallelLinear'] * 3 + ['RowParallelLinear'])
  heads, kv_heads = lm.config.num_attention_heads, lm.config.num_key_value_heads
  hidden = lm.config.hidden_size
  # Their output widths in the traced tree: q [.., heads * head_dim], k and
  # v [.., kv_heads * head_dim], o [.., hidden].
  assert [p.outputs[0].aval.shape[-1] for p in projections[:4]] == [
      heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM, hidden]
  # Qwen 2's q/k/v carry biases, the others' none.
  with_bias = [p.path[-1] for p in projections[:4]
               if 'bias' in nnx.state(_at(lm.model, p.path))]
  assert with_bias == (['q_proj', 'k_proj', 'v_proj']
                       if lm.family == 'qwen2' else [])


def _at(module, path):
  for name in path:
    module = module[int(name)] if name.isdigit() else getattr(module, name)
  return module


def test_dropout_state_update(lm):
  """Llama's and Qwen 2's dropouts draw from the model's RNG streams when the
  config turns them on: every draw advances a count, a state update that
  ``eval_mox`` applies to the model it is given, as the call would. The other
  families have no dropout module."""
  dropouts = [m for _, m in nnx.iter_graph(lm.model)
              if isinstance(m, nnx.Dropout)]
  rates = lm.spec.get('dropout')
  if rates is None:
    assert dropouts == []
    return
  assert dropouts and {d.rate for d in dropouts} == {0.0}
  model = build(lm.family, make_config(lm.family, **rates))
  nnx.update(model, nnx.state(lm.model, nnx.Param))
  rng_state = lambda m: to_numpy(nnx.state(m, nnx.RngState))
  start = rng_state(model)
  plain, replayed, jitted = (nnx.clone(model) for _ in range(3))
  want = call(plain, lm.ids)                # eager: NNX updates the counts
  assert not np.allclose(want.logits, lm.expected.logits, **TOL)
  advanced = rng_state(plain)
  assert any((x != y).any() for x, y in zip(jax.tree.leaves(advanced),
                                            jax.tree.leaves(start)))
  mox = yax.make_mox(call)(nnx.clone(model), lm.ids)
  assert_trees_close(yax.eval_mox(mox, replayed, lm.ids), want, **TOL)
  assert_trees_close(rng_state(replayed), advanced, rtol=0, atol=0)
  got = nnx.jit(lambda m, ids: yax.eval_mox(mox, m, ids))(jitted, lm.ids)
  assert_trees_close(got, want, **TOL)
  assert_trees_close(rng_state(jitted), advanced, rtol=0, atol=0)


def _activation_sites(lm):
  """The MLP activations: ``nn.swish`` (silu) is a jitted function (a ``jit``
  equation named ``silu``, found by XPath); Mixtral's sits inside the
  ``shard_map`` of its grouped matmul, a body that calls no module, which
  XPath does not enter and ``yax.match`` does; Gemma 2's tanh GELU is
  inlined (found by data flow)."""
  if lm.family == 'mixtral':
    return yax.match(jax.nn.silu, lm.mox, within=mlp_xpath(lm))
  if lm.spec['act'] == 'silu':
    return yax.query(f'{mlp_xpath(lm)}//*[@name="silu"]', lm.mox)
  return yax.match(GELU_TANH, lm.mox, within=mlp_xpath(lm))


def test_activation_swap_matches_the_patched_model(lm):
  sites = _activation_sites(lm)
  assert len(sites) == lm.config.num_hidden_layers
  other = {'silu': GELU_TANH, 'gelu_tanh': jax.nn.silu}[lm.spec['act']]
  new = yax.sub(sites, yax.trace_like(other), lm.mox)
  got = yax.eval_mox(new, fresh(lm), lm.ids)
  # By hand: EasyDeL binds `ACT2FN[config.hidden_act]` to an attribute of
  # each MLP at construction; a copy of the model with that attribute
  # replaced in every layer.
  patched = nnx.clone(lm.model)
  *where, attr = lm.spec['act_at']
  for layer in patched.model.layers:
    setattr(_at(layer, where), attr, other)
  want = own_forward(patched, lm.ids)
  assert not np.allclose(want.logits, lm.expected.logits, **TOL)
  assert_trees_close(got, want, **TOL)


def _check_lora(lm, selection, paths):
  graphdef, state, fn, mox = split_form(lm)
  res = yax.lora(mox, state, selection, rank=2, alpha=4.0,
                 key=jax.random.key(1))
  assert isinstance(res.params, nnx.State) and isinstance(res.mask, nnx.State)
  assert sorted(res.paths) == sorted(paths)
  adapters = [v for v in jax.tree.leaves(
      res.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
      if isinstance(v, nnx.LoRAParam)]
  assert len(adapters) == 2 * len(paths)
  assert sum(jax.tree.leaves(res.mask)) == 2 * len(paths)
  # B = 0 at init: the adapted tree computes what the model does.
  assert_trees_close(jit_eval(res.mox, res.params, lm.ids), lm.expected,
                     **TOL)
  # Trained adapters change the output; merged into the kernels, the model
  # itself computes the same.
  rng = np.random.default_rng(2)
  trained = jax.tree.map(
      lambda v, is_adapter: v + jnp.asarray(
          rng.normal(0.0, 0.3, np.shape(v)), v.dtype) if is_adapter else v,
      res.params, res.mask)
  adapted = jit_eval(res.mox, trained, lm.ids)
  assert not np.allclose(adapted.logits, lm.expected.logits, **TOL)
  merged = res.merge(trained)
  assert isinstance(merged, nnx.State)
  assert_trees_close(jit_eval(mox, merged, lm.ids), adapted, **TOL)
  assert_trees_close(own_forward(nnx.merge(graphdef, merged), lm.ids),
                     adapted, **TOL)
  return res, trained


def _node(state, path):
  for name in path:
    state = state[int(name) if name.isdigit() else name]
  return state


def test_lora_on_the_attention_projections(lm):
  """EasyDeL's ColumnParallelLinear/RowParallelLinear q, k, v, o (kernels
  ``[in, out]``; Qwen 2's q/k/v with biases). Gradients reach the adapters:
  at init (B = 0) the gradient of B is ``(alpha / rank) A^T dL/dW`` with
  ``dL/dW`` the gradient of the model's own forward for that kernel, and A's
  is zero; after training every adapter has a gradient."""
  paths = [(*a, p) for a in layer_paths(lm, 'self_attn')
           for p in ('q_proj', 'k_proj', 'v_proj', 'o_proj')]
  res, trained = _check_lora(
      lm, f'{attention_xpath(lm)}{LINEAR}', paths)
  q = _node(res.params, paths[0])
  heads = lm.config.num_attention_heads
  assert q['lora_a'].shape == (lm.config.hidden_size, 2)
  assert q['lora_b'].shape == (2, heads * HEAD_DIM)

  weights = jnp.asarray(np.random.default_rng(3).normal(
      size=(B, L, VOCAB)), jnp.float32)
  loss = lambda out: jnp.sum(out.logits * weights)
  graphdef, params, rest = nnx.split(lm.model, nnx.Param, ...)
  own = jax.jit(jax.grad(lambda p: loss(call(nnx.merge(graphdef, p, rest),
                                             lm.ids))))(params)
  # Gradients with respect to the adapters only, the rest held fixed (as
  # optax.masked(..., res.mask) would train them).
  def grad(tree):
    adapters, fixed = nnx.split_state(tree, nnx.LoRAParam, ...)
    return jax.jit(jax.grad(lambda a: loss(yax.eval_mox(
        res.mox, nnx.merge_state(a, fixed), lm.ids))))(adapters)
  at_init = grad(res.params)
  for path in paths:
    a = np.asarray(_node(res.params, path)['lora_a'][...])
    dw = np.asarray(_node(own, path)['kernel'][...])
    g = _node(at_init, path)
    np.testing.assert_allclose(np.asarray(g['lora_b'][...]),
                               (4.0 / 2) * a.T @ dw, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(g['lora_a'][...]), 0.0)
  after = grad(trained)
  for path in paths:
    for name in ('lora_a', 'lora_b'):
      g = np.asarray(_node(after, path)[name][...])
      assert np.isfinite(g).all() and np.abs(g).max() > 0, (path, name)


def test_lora_on_the_mlp_linears(lm):
  """gate/up/down of the dense MLPs; for Mixtral's MoE block, the router."""
  mlp_at = lm.spec['mlp_at']
  names = (('gate',) if lm.family == 'mixtral'
           else ('gate_proj', 'up_proj', 'down_proj'))
  paths = [(*m, n) for m in layer_paths(lm, mlp_at) for n in names]
  res, _ = _check_lora(lm, f'{mlp_xpath(lm)}{LINEAR}', paths)
  first = _node(res.params, paths[0])
  out = (lm.config.num_local_experts if lm.family == 'mixtral'
         else lm.config.intermediate_size)
  assert first['lora_a'].shape == (lm.config.hidden_size, 2)
  assert first['lora_b'].shape == (2, out)
  assert isinstance(first['lora_a'], nnx.LoRAParam)


def test_summary_counts_every_parameter(lm):
  """Every parameter of the model sits in exactly one row and in the
  total. Gemma 2 ties its head to the embedding, yet EasyDeL also creates
  the head's own kernel, which its forward never reads (changing it changes
  nothing): no call reads it, so it is the own param of the `lm_head` row
  (the head is called, with the embedding), marked unread."""
  rows = yax.summary(lm.mox)
  top = rows[0]
  assert top.module == lm.spec['cls'] and top.path == ''
  unused = 0
  if getattr(lm.config, 'tie_word_embeddings', False):
    assert lm.family == 'gemma2'
    changed = fresh(lm)
    changed.lm_head.kernel[...] = changed.lm_head.kernel[...] + 1.0
    assert_trees_close(own_forward(changed, lm.ids), lm.expected,
                       rtol=0, atol=0)
    unused = changed.lm_head.kernel.size
    assert unused == lm.config.hidden_size * VOCAB
    # The head is called (with the embedding's transpose): its row owns
    # the kernel it does not read.
    head = [r for r in rows if r.path == 'lm_head']
    assert len(head) == 1 and head[0].unread_params == unused, head
    assert head[0].own_params == head[0].params == unused
    assert any(v.startswith('kernel: ') and v.endswith('(unread)')
               for v in head[0].variables), head[0].variables
  assert sum(r.unread_params for r in rows) == unused
  assert top.params == n_params(lm.model)
  assert _summary.total_params(lm.mox)[0] == n_params(lm.model)
  # Each parameter is the own parameter of one row: Mixtral's experts,
  # read by the MoE block (inside a shard_map) from a submodule that is
  # never called, are the block's own.
  assert sum(r.own_params for r in rows) == top.params


# ------------------------------------------------- quantization and casts

def _linear_paths(lm):
  """The module paths of q, k, v, o and of the MLP's linears (Mixtral's:
  the router), layer by layer."""
  mlp_names = (('gate',) if lm.family == 'mixtral'
               else ('gate_proj', 'up_proj', 'down_proj'))
  return [path for i in range(lm.config.num_hidden_layers) for path in (
      *[('model', 'layers', str(i), 'self_attn', p)
        for p in ('q_proj', 'k_proj', 'v_proj', 'o_proj')],
      *[('model', 'layers', str(i), lm.spec['mlp_at'], n)
        for n in mlp_names])]


def _linears(lm):
  """The attention projections and the MLP's linear layers (one XPath)."""
  return f'{attention_xpath(lm)}{LINEAR} | {mlp_xpath(lm)}{LINEAR}'


def test_quantize_int8_the_attention_and_mlp_linears(lm):
  """int8 kernels (one scale per output column) for q, k, v, o and the MLP's
  linears: the quantized tree computes what EasyDeL's own forward computes
  with the dequantized kernels, and the stored kernels are int8."""
  graphdef, state, _, mox = split_form(lm)
  selection = _linears(lm)
  paths = _linear_paths(lm)
  assert [n.path for n in yax.query(selection, mox)] == paths
  q = yax.quantize(mox, state, selection, weight='int8')
  yax.check_mox(q.mox)
  assert sorted(q.paths) == sorted(paths)
  assert isinstance(q.params, nnx.State)
  back = q.dequantize(q.params)
  assert isinstance(back, nnx.State)
  got = jit_eval(q.mox, q.params, lm.ids)
  want = own_forward(nnx.merge(graphdef, back), lm.ids)
  assert_trees_close(got, want, **TOL)
  # Quantization changed the model (slightly): not the float output.
  assert not np.array_equal(np.asarray(got.logits),
                            np.asarray(lm.expected.logits))
  top = float(np.abs(lm.expected.logits).max())
  np.testing.assert_allclose(got.logits, lm.expected.logits, rtol=0,
                             atol=0.05 * top)
  for path in paths:
    stored, float_node, back_node = (_node(t, path)
                                     for t in (q.params, state, back))
    original = np.asarray(float_node['kernel'][...])
    kernel = stored['kernel'][...]
    assert kernel.dtype == jnp.int8 and kernel.shape == original.shape, path
    assert stored['kernel_scale'][...].shape == (1, original.shape[1]), path
    assert stored['kernel_scale'][...].dtype == jnp.float32
    # Dequantized within one int8 step of the float kernel (absmax/127
    # per output column).
    step = np.abs(original).max(axis=0) / 127.0
    err = np.abs(np.asarray(back_node['kernel'][...]) - original)
    assert (err <= step / 2 + 1e-7).all(), path
    if 'bias' in float_node:  # Qwen 2's q/k/v: biases stay float
      assert stored['bias'][...].dtype == jnp.float32
  before, after = q.nbytes
  assert after < before
  if lm.family == 'mixtral':
    # Only the router is a linear module call; the experts' kernels, read
    # by the MoE block inside the shard_map of its grouped matmul, stay
    # float, and selecting the block itself is refused with the true
    # reason: the kernel plan looks through the shard_map body (one
    # device) and finds the experts' kernels, which are variables of a
    # submodule the block never calls (before: "it has no parameter of 2
    # or more axes that reaches a dot_general").
    for i in range(lm.config.num_hidden_layers):
      experts = _node(q.params, ('model', 'layers', str(i),
                                 'block_sparse_moe', 'experts'))
      assert {experts[w]['kernel'][...].dtype
              for w in ('w1', 'w2', 'w3')} == {jnp.dtype(jnp.float32)}
    with pytest.raises(yax.SubstitutionError) as refused:
      yax.quantize(mox, state, mlp_xpath(lm), weight='int8')
    message = str(refused.value)
    assert 'cannot quantize 2 of the 2 module calls' in message
    for i in range(lm.config.num_hidden_layers):
      assert (f"module_call MixtralSparseMoeBlock at path 'model/layers/{i}/"
              "block_sparse_moe': the kernels it contracts (nnx/experts/w1/"
              'kernel, nnx/experts/w2/kernel, nnx/experts/w3/kernel) are '
              'variables of its submodules' in message), message


def test_cast_the_attention_and_mlp_linears_to_bfloat16(lm):
  """q, k, v, o and the MLP's linears computing in bfloat16, next to
  EasyDeL's own float32 forward: the outputs keep their dtype and are
  within bfloat16's error; the matmuls of the selected calls multiply
  bfloat16 values, the norms stay float32."""
  _, state, _, mox = split_form(lm)
  selection = _linears(lm)
  low = yax.cast(mox, selection, 'bfloat16')
  yax.check_mox(low)
  got = jit_eval(low, state, lm.ids)
  want = lm.expected
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype and g.shape == w.shape
  assert got.logits.dtype == jnp.float32
  assert not np.array_equal(np.asarray(got.logits), np.asarray(want.logits))
  top = float(np.abs(want.logits).max())
  np.testing.assert_allclose(got.logits, want.logits, rtol=0.1,
                             atol=0.1 * top)
  hidden = float(np.abs(want.last_hidden_state).max())
  np.testing.assert_allclose(got.last_hidden_state, want.last_hidden_state,
                             rtol=0.1, atol=0.1 * hidden)
  cast = yax.query(selection, low)
  assert [n.path for n in cast] == _linear_paths(lm)
  assert all(n.params['compute_dtype'] == 'bfloat16' for n in cast)
  # Every matmul of a cast call multiplies bfloat16 values. EasyDeL's
  # attention returns bfloat16 even in this float32 model, so its o_proj
  # was traced converting its input to float32 (`astype(self.dtype)`); that
  # explicit cast is kept on replay: o_proj's dot_general takes bfloat16
  # values converted to float32 (the same products; it accumulates in
  # float32 as the others do), the other calls' take bfloat16 operands.
  widened = set()
  for node in cast:
    assert node.outputs[0].aval.dtype == jnp.float32, node.path
    made_by = {o: e for e in node.children if not isinstance(e, yax.Mox)
               for o in e.outputs}
    dots = [e for e in made_by.values() if e.prim.name == 'dot_general']
    assert dots, node.path
    for dot in dots:
      for s in dot.inputs:
        if s.aval.dtype == jnp.bfloat16:
          continue
        widened.add(node.path)
        src = made_by.get(s)
        assert src is not None and src.prim.name == 'convert_element_type' \
            and src.inputs[0].aval.dtype == jnp.bfloat16, (node.path, dot)
  assert widened == set(layer_paths(lm, 'self_attn', 'o_proj'))
  for path in widened:
    (traced,) = yax.query(f'{attention_xpath(lm)}{LINEAR}'
                          f'[@path="{"/".join(path)}"]', mox)
    assert traced.inputs[-1].aval.dtype == jnp.bfloat16
  norms = yax.query('//module_call[contains(@type, "RMSNorm")]'
                    '[@method="__call__"]', low)
  assert norms and all('compute_dtype' not in n.params for n in norms)


def test_cast_the_mlp_blocks_to_bfloat16(lm):
  """Each layer's whole MLP call to bfloat16 (run again on bfloat16 inputs
  and variables: an NNX call). Mixtral's MoE block routes in float32 (its
  router weights) next to bfloat16 experts inside a ``shard_map``, whose
  body then runs at the dtypes it was traced for (failed before: the
  ``shard_map`` was bound with its raw params, "KeyError: 'subfuns'")."""
  _, state, _, mox = split_form(lm)
  selection = mlp_xpath(lm)
  low = yax.cast(mox, selection, 'bfloat16')
  yax.check_mox(low)
  got = jit_eval(low, state, lm.ids)
  want = lm.expected
  assert got.logits.dtype == want.logits.dtype
  assert not np.array_equal(np.asarray(got.logits), np.asarray(want.logits))
  np.testing.assert_allclose(got.logits, want.logits, rtol=0.1,
                             atol=0.1 * float(np.abs(want.logits).max()))
  cast = yax.query(selection, low)
  assert [n.path for n in cast] == layer_paths(lm, lm.spec['mlp_at'])
  assert all(n.params['compute_dtype'] == 'bfloat16' for n in cast)
