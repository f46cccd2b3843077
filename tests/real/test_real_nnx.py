"""Real third-party NNX model code: the LLMs of Google's `tunix` 0.1.7
(Llama 3, Qwen 3 with a mixture of experts, Gemma 3), built from tiny configs
written out here, with random weights (nothing is downloaded).

Every check compares YAX with the model's own forward pass on the same
inputs (a prefill into a KV cache, so the cache is an input and an output):
trace, replay eagerly and under ``jax.jit``, state updates (``sow``),
queries counted from the config, an activation swap against the model patched
by hand, LoRA (identity at init, ``merge`` reproduces the adapted model), int8
``quantize`` (against the model run on the dequantized weights), ``cast``
to bfloat16 (within bfloat16 error of the float model) and the summary's
parameter total.

Install the libraries with ``bash tests/install_real_models.sh``. When tunix
is missing the tests fail if ``CI`` is set (a silent skip in CI is a defect),
and are skipped with the reason otherwise.
"""

import importlib
import importlib.util
import inspect
import os
import sys
import types
import warnings

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from helpers import (assert_trees_close, assert_views_agree, modules,
                     trained_adapters)

TOL = dict(rtol=1e-4, atol=1e-4)
INSTALL = 'bash tests/install_real_models.sh'

# DeprecationWarnings that tunix's own code raises on every model it builds
# or runs with jax 0.10 / flax 0.12.8 (tests turn DeprecationWarnings into
# errors; YAX cannot change tunix). Limited to warnings attributed to tunix's
# modules, and to this file.
pytestmark = [
    # tunix's shard(): `pxla.thread_resources.env.physical_mesh`.
    pytest.mark.filterwarnings(
        'ignore:jax.interpreters.pxla.thread_resources is deprecated'
        ':DeprecationWarning:tunix'),
    # tunix reads weights as `self.w.value`.
    pytest.mark.filterwarnings(
        "ignore:'.value' access is now deprecated:DeprecationWarning:tunix"),
    # tunix creates its weights as nnx.Param(..., sharding=(...)); Flax warns
    # from its own variablelib.
    pytest.mark.filterwarnings(
        "ignore:'sharding' is deprecated, use 'out_sharding' instead"
        ':DeprecationWarning'),
]


def _in_ci() -> bool:
  return os.environ.get('CI', '').strip().lower() not in ('', '0', 'false', 'no')


def _missing(what: str, err: BaseException):
  msg = f'{what} is not installed ({type(err).__name__}: {err}); run: {INSTALL}'
  if _in_ci():
    pytest.fail(msg, pytrace=False)
  pytest.skip(msg)


def import_tunix_model(family: str):
  """``tunix.models.<family>.model``.

  ``tunix/__init__.py`` imports the whole trainer stack (datasets, grain,
  optax, orbax, qwix, sampler backends, ...), none of which the model code
  uses: it imports only jax, flax, jaxtyping and einops (and tunix's small
  ``generate.mappings``/``utils`` modules). When the package is not imported
  yet, ``tunix`` is registered as a bare package with the installed
  directory as its ``__path__``, so its submodules import from the real
  files without running the package ``__init__``.

  Importing a model module also runs tunix's
  ``env_utils.setup_sharding_environment()``, which sets Flax's global
  ``flax_always_shard_variable`` flag to False; the flag is restored here
  (so that tests collected after this file see Flax's own setting) and set
  for this file's tests by the ``_tunix_flax_config`` fixture.
  """
  if 'tunix' not in sys.modules:
    spec = importlib.util.find_spec('tunix')
    if spec is None or not spec.submodule_search_locations:
      _missing('google-tunix 0.1.7', ImportError("No module named 'tunix'"))
    package = types.ModuleType('tunix')
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__doc__ = 'tunix without its __init__ (tests/real/test_real_nnx.py)'
    sys.modules['tunix'] = package
  flag = flax.config.flax_always_shard_variable
  try:
    with warnings.catch_warnings():
      # qwen3: `from jax.experimental.shard_map import shard_map` (deprecated
      # in jax 0.8; used only on its TPU megablox/splash paths).
      warnings.filterwarnings(
          'ignore', 'jax.experimental.shard_map is deprecated',
          DeprecationWarning)
      return importlib.import_module(f'tunix.models.{family}.model')
  except ImportError as e:
    _missing(f'tunix.models.{family} (google-tunix 0.1.7)', e)
  finally:
    flax.config.update('flax_always_shard_variable', flag)


@pytest.fixture(scope='module')
def _tunix_flax_config():
  """What a tunix user runs under: importing a tunix model sets
  ``flax_always_shard_variable=False`` (its weights carry sharding names
  such as ``('tp', 'fsdp')``; with the flag on, Flax refuses to create them
  without a mesh). Restored after this file's tests."""
  with flax.config.temp_flip_flag('always_shard_variable', False):
    yield


# ------------------------------------------------------------ tiny configs

B, L, CACHE = 2, 8, 12
FAMILIES = ('llama3', 'qwen3', 'gemma3')


def _llama3(lib):
  return lib.ModelConfig(
      num_layers=2, vocab_size=64, embed_dim=32, hidden_dim=48, num_heads=4,
      head_dim=8, num_kv_heads=2, rope_theta=500_000, norm_eps=1e-5,
      weight_tying=False)


def _qwen3(lib):
  # Qwen3-30B-A3B style: every layer a mixture of experts (top-2 of 4).
  return lib.ModelConfig(
      num_layers=2, vocab_size=64, embed_dim=32, hidden_dim=24, num_heads=4,
      head_dim=8, num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6,
      use_tied_embedding=False, num_experts=4, num_experts_per_tok=2)


def _gemma3(lib):
  return lib.ModelConfig(
      num_layers=2, num_embed=64, embed_dim=32, hidden_dim=48, num_heads=4,
      head_dim=8, num_kv_heads=2, sliding_window_size=4,
      local_base_frequency=10_000, global_base_frequency=1_000_000,
      param_dtype=jnp.float32)


# What each family's code does, for the checks (read from tunix's source):
# its classes, the MLP's activation and how it reaches the tree.
SPECS = {
    'llama3': dict(config=_llama3, cls='Llama3', mlp='MLP', act='silu',
                   attn_einsums=4, mlp_linears=3),
    'qwen3': dict(config=_qwen3, cls='Qwen3', mlp='MoELayer', act='silu',
                  attn_einsums=4, mlp_linears=1),   # MoE: the router
    'gemma3': dict(config=_gemma3, cls='Gemma3', mlp='FeedForward',
                   act='gelu', attn_einsums=3, mlp_linears=3),  # q, kv, out
}


def random_model(ctor, seed):
  """The model ``ctor()`` builds, with every weight drawn at random (std
  0.2). tunix initialises the MLP kernels and Gemma's norm scales to zeros
  (real weights come from checkpoints): with those, an activation swap
  would change nothing. Shapes come from ``nnx.eval_shape`` (no initializer
  is compiled); the Params keep their sharding metadata."""
  graphdef, state = nnx.split(nnx.eval_shape(ctor))
  assert {type(v).__name__ for v in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))} == {'Param'}
  rng = np.random.default_rng(seed)
  state = jax.tree.map(
      lambda s: jnp.asarray(rng.normal(0.0, 0.2, s.shape).astype(s.dtype)),
      state)
  return nnx.merge(graphdef, state)


def n_params(model) -> int:
  return sum(int(np.size(x)) for x in jax.tree.leaves(nnx.state(model,
                                                                nnx.Param)))


def snapshot(model):
  graphdef, state = nnx.split(model)
  return graphdef, jax.tree.map(np.asarray, state)


@pytest.fixture(scope='module', params=FAMILIES)
def lm(request, _tunix_flax_config):
  family = request.param
  lib = import_tunix_model(family)
  spec = SPECS[family]
  config = spec['config'](lib)
  model = random_model(
      lambda: getattr(lib, spec['cls'])(config, rngs=nnx.Rngs(0)), seed=7)
  num_kv_heads, head_dim = config.num_kv_heads, config.head_dim
  tokens = (jnp.arange(B * L).reshape(B, L) * 7) % 63 + 1
  positions = jnp.broadcast_to(jnp.arange(L), (B, L))
  # Prefill into a KV cache longer than the prompt, as tunix's sampler does.
  cache = {f'layer_{i}': {
      'k': jnp.zeros((B, CACHE, num_kv_heads, head_dim), jnp.float32),
      'v': jnp.zeros((B, CACHE, num_kv_heads, head_dim), jnp.float32),
      'end_index': jnp.zeros((B,), jnp.int32)}
      for i in range(config.num_layers)}
  mask = jnp.broadcast_to(
      jnp.arange(CACHE)[None, :] <= jnp.arange(L)[:, None], (B, L, CACHE))
  args = (tokens, positions, cache, mask)
  fn = lambda m, *a: m(*a)
  before = snapshot(model)
  mox = yax.make_mox(fn)(model, *args)
  after = snapshot(model)
  expected = nnx.jit(lambda m, *a: m(*a))(model, *args)
  return types.SimpleNamespace(
      family=family, lib=lib, spec=spec, config=config, model=model,
      args=args, fn=fn, mox=mox, expected=expected, before=before,
      after=after)


def jit_eval(mox, *args):
  return jax.jit(lambda *a: yax.eval_mox(mox, *a))(*args)


def split_form(lm):
  graphdef, state = nnx.split(lm.model)
  fn = lambda s, *a: nnx.merge(graphdef, s)(*a)
  return graphdef, state, fn, yax.make_mox(fn)(state, *lm.args)


# ------------------------------------------------------------------ tests

def test_trace_replay_eager_and_jit(lm):
  logits, new_cache = lm.expected
  assert logits.shape == (B, L, 64)
  assert set(new_cache) == {f'layer_{i}' for i in range(lm.config.num_layers)}
  assert int(new_cache['layer_0']['end_index'][0]) == L
  # Tracing does not change the model.
  assert lm.after[0] == lm.before[0]
  assert_trees_close(lm.after[1], lm.before[1], rtol=0, atol=0)
  assert_trees_close(yax.eval_mox(lm.mox, lm.model, *lm.args), lm.expected,
                     **TOL)
  assert_trees_close(jit_eval(lm.mox, lm.model, *lm.args), lm.expected, **TOL)
  # The functional form replays too.
  _, state, fn, mox = split_form(lm)
  assert_trees_close(jit_eval(mox, state, *lm.args), lm.expected, **TOL)
  assert assert_views_agree(lm.mox) == len(modules(lm.mox))
  assert assert_views_agree(mox) == len(modules(mox))


def test_sow_state_update(lm):
  """Qwen 3 and Gemma 3 store the final hidden states with ``sow`` when
  asked: a state update that ``eval_mox`` applies to the model it is given,
  as the call would."""
  if lm.family == 'llama3':  # tunix's Llama 3 has no such option
    assert 'output_hidden_states' not in inspect.signature(
        lm.lib.Llama3.__call__).parameters
    return
  fn = lambda m, *a: m(*a, output_hidden_states=True)
  plain, replayed, jitted = (nnx.clone(lm.model) for _ in range(3))
  want = nnx.jit(fn)(plain, *lm.args)
  mox = yax.make_mox(fn)(nnx.clone(lm.model), *lm.args)
  got = yax.eval_mox(mox, replayed, *lm.args)
  assert_trees_close(got, want, **TOL)
  sown = nnx.state(plain, nnx.Intermediate)
  assert jax.tree.leaves(sown)[0].shape == (B, L, lm.config.embed_dim)
  assert_trees_close(nnx.state(replayed, nnx.Intermediate), sown, **TOL)
  got = nnx.jit(lambda m, *a: yax.eval_mox(mox, m, *a))(jitted, *lm.args)
  assert_trees_close(got, want, **TOL)
  assert_trees_close(nnx.state(jitted, nnx.Intermediate), sown, **TOL)


def test_queries_count_from_config(lm):
  mox, layers, spec = lm.mox, lm.config.num_layers, lm.spec
  attention = yax.query(
      '//module_call[@type="Attention"][@method="__call__"]', mox)
  assert [a.path for a in attention] == [
      ('layers', str(i), 'attn') for i in range(layers)]
  mlps = yax.query(
      f'//module_call[@type="{spec["mlp"]}"][@method="__call__"]', mox)
  assert [m.path for m in mlps] == [
      ('layers', str(i), 'mlp') for i in range(layers)]
  assert len(yax.query(
      '//module_call[@type="Attention"][@method="__call__"]'
      '//module_call[@type="Einsum"]', mox)) == spec['attn_einsums'] * layers
  assert len(yax.query(
      f'//module_call[@type="{spec["mlp"]}"][@method="__call__"]'
      '//module_call[@type="Linear"]', mox)) == spec['mlp_linears'] * layers


def _activation_sites(lm):
  """The MLP activations of the tree: ``nnx.silu`` is a jitted function (a
  ``jit`` equation named ``silu``, found by XPath); ``nnx.gelu`` is inlined
  (found by data flow)."""
  spec, mox = lm.spec, lm.mox
  within = f'//module_call[@type="{spec["mlp"]}"]'
  if spec['act'] == 'silu':
    return yax.query(f'{within}//*[@name="silu"]', mox)
  return yax.match(nnx.gelu, mox, within=within)


def test_activation_swap_matches_the_patched_model(lm, monkeypatch):
  spec, config = lm.spec, lm.config
  sites = _activation_sites(lm)
  # One per MLP; the CPU path of Qwen 3's MoE runs every expert.
  per_layer = config.num_experts if lm.family == 'qwen3' else 1
  assert len(sites) == per_layer * config.num_layers
  other = {'silu': jax.nn.gelu, 'gelu': jax.nn.silu}[spec['act']]
  new = yax.sub(sites, yax.trace_like(other), lm.mox)
  got = jit_eval(new, lm.model, *lm.args)
  # By hand: tunix calls `nnx.silu` / `nnx.gelu` of flax.nnx at run time.
  monkeypatch.setattr(nnx, spec['act'], other)
  want = nnx.jit(lambda m, *a: m(*a))(lm.model, *lm.args)
  assert not np.allclose(want[0], lm.expected[0], **TOL)
  assert_trees_close(got, want, **TOL)


def _check_lora(lm, selection, n_modules):
  graphdef, state, fn, mox = split_form(lm)
  res = yax.lora(mox, state, selection, rank=2, alpha=4.0,
                 key=jax.random.key(1))
  assert isinstance(res.params, nnx.State) and isinstance(res.mask, nnx.State)
  assert len(res.paths) == n_modules
  adapters = [v for v in jax.tree.leaves(
      res.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
      if isinstance(v, nnx.LoRAParam)]
  assert len(adapters) == 2 * n_modules
  assert sum(jax.tree.leaves(res.mask)) == 2 * n_modules
  # B = 0 at init: the adapted tree computes what the model does.
  assert_trees_close(jit_eval(res.mox, res.params, *lm.args), lm.expected,
                     **TOL)
  # Trained adapters change the output; merged into the kernels, the model
  # itself computes the same.
  trained = trained_adapters(res.params, res.mask)
  adapted = jit_eval(res.mox, trained, *lm.args)
  assert not np.allclose(adapted[0], lm.expected[0], **TOL)
  merged = res.merge(trained)
  assert isinstance(merged, nnx.State)
  assert_trees_close(jit_eval(mox, merged, *lm.args), adapted, **TOL)
  assert_trees_close(
      nnx.jit(lambda m, *a: m(*a))(nnx.merge(graphdef, merged), *lm.args),
      adapted, **TOL)
  return res


def test_lora_on_the_mlp_linears(lm):
  """nnx.Linear kernels created with nnx.with_partitioning (sharding names
  kept on the adapters); for Qwen 3's MoE, the router."""
  spec, layers = lm.spec, lm.config.num_layers
  res = _check_lora(
      lm, f'//module_call[@type="{spec["mlp"]}"][@method="__call__"]'
      '//module_call[@type="Linear"]', spec['mlp_linears'] * layers)
  mlp = res.params['layers'][0]['mlp']
  linear = mlp['router'] if lm.family == 'qwen3' else mlp['gate_proj']
  a, b = linear['lora_a'], linear['lora_b']
  assert a.shape == (lm.config.embed_dim, 2)
  assert isinstance(a, nnx.LoRAParam) and isinstance(b, nnx.LoRAParam)


def test_lora_on_the_attention_einsums(lm):
  """tunix's own Einsum modules (weight ``w``): ``BTD,DNH->BTNH`` and
  ``BTNH,NHD->BTD`` (Gemma 3: ``BTD,NDH->BTNH``, ``BSD,CKDH->CBSKH``)."""
  spec, layers = lm.spec, lm.config.num_layers
  res = _check_lora(
      lm, '//module_call[@type="Attention"][@method="__call__"]'
      '//module_call[@type="Einsum"]', spec['attn_einsums'] * layers)
  attn = res.params['layers'][0]['attn']
  q = attn['q_einsum'] if lm.family == 'gemma3' else attn['q_proj']
  assert q['lora_a'].shape == (lm.config.embed_dim, 2)
  assert q['lora_b'].shape == (2, lm.config.num_heads, lm.config.head_dim)


def test_summary_counts_every_parameter(lm):
  top = yax.summary(lm.mox)[0]
  assert top.module == lm.spec['cls'] and top.path == ''
  assert top.params == n_params(lm.model)


# ------------------------------------------- quantize (int8) and cast (bf16)

def _mlp_linears(lm):
  return (f'//module_call[@type="{lm.spec["mlp"]}"][@method="__call__"]'
          '//module_call[@type="Linear"]',
          lm.spec['mlp_linears'] * lm.config.num_layers)


def _attn_einsums(lm):
  return ('//module_call[@type="Attention"][@method="__call__"]'
          '//module_call[@type="Einsum"]',
          lm.spec['attn_einsums'] * lm.config.num_layers)


# The selections of the LoRA tests above, with how many calls each picks.
SELECTIONS = {
    'mlp_linears': _mlp_linears,
    'attn_einsums': _attn_einsums,
}


def _kernel_path(lm, which):
  """A weight of layer 0 that ``which`` quantizes: its path in the state."""
  if which == 'mlp_linears':
    name = 'router' if lm.family == 'qwen3' else 'gate_proj'
    return ('layers', 0, 'mlp', name, 'kernel')
  name = 'q_einsum' if lm.family == 'gemma3' else 'q_proj'
  return ('layers', 0, 'attn', name, 'w')


def _leaf(state, path):
  node = state
  for k in path:
    node = node[k]
  return node[...] if isinstance(node, nnx.Variable) else node


@pytest.mark.parametrize('which', list(SELECTIONS))
def test_quantize_int8_matches_the_dequantized_model(lm, which):
  """int8 kernels (one scale per output channel) on the selected calls: the
  quantized tree computes what tunix's model computes with the dequantized
  weights."""
  selection, n_modules = SELECTIONS[which](lm)
  graphdef, state, _, mox = split_form(lm)
  q = yax.quantize(mox, state, selection, weight='int8')
  yax.check_mox(q.mox)
  assert len(q.paths) == n_modules
  back = q.dequantize(q.params)
  assert isinstance(back, nnx.State)
  want = nnx.jit(lambda m, *a: m(*a))(nnx.merge(graphdef, back), *lm.args)
  # Rounding the kernels changes the output beyond the tolerance.
  assert not np.allclose(want[0], lm.expected[0], **TOL)
  assert_trees_close(jit_eval(q.mox, q.params, *lm.args), want, **TOL)
  path = _kernel_path(lm, which)
  original = np.asarray(_leaf(state, path))
  stored = _leaf(q.params, path)
  assert stored.dtype == jnp.int8 and stored.shape == original.shape
  # Dequantized, each kernel is within one int8 step of the float one.
  step = float(np.abs(original).max()) / 127
  np.testing.assert_allclose(np.asarray(_leaf(back, path)), original,
                             atol=step)
  assert not np.array_equal(np.asarray(_leaf(back, path)), original)
  for node in yax.query(selection, q.mox):
    assert node.params['quant'] == 'int8'
  before, after = q.nbytes
  assert after < before


@pytest.mark.parametrize('which', list(SELECTIONS))
def test_cast_to_bfloat16(lm, which):
  """The selected calls compute in bfloat16; the output keeps its dtype and
  stays within bfloat16 error of tunix's float32 forward."""
  selection, n_modules = SELECTIONS[which](lm)
  _, state, _, mox = split_form(lm)
  low = yax.cast(mox, selection, 'bfloat16')
  yax.check_mox(low)
  got = jit_eval(low, state, *lm.args)
  assert jax.tree.structure(got) == jax.tree.structure(lm.expected)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(lm.expected)):
    assert g.dtype == e.dtype and g.shape == e.shape
  logits, expected = got[0], lm.expected[0]
  assert not np.array_equal(logits, expected)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(lm.expected)):
    e = np.asarray(e)
    np.testing.assert_allclose(
        g, e, rtol=0.1, atol=0.1 * float(np.abs(e).max(initial=0)))
  nodes = yax.query(selection, low)
  assert len(nodes) == n_modules
  for node in nodes:
    assert node.params['compute_dtype'] == 'bfloat16'
  # The stored params are not changed.
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state))
