"""YAX's LoRA next to Google's Qwix LoRA, on the same models, in one run.

Run: ``python benchmarks/lora_peers.py`` (about 7 minutes on 2 shared CPU
cores, mostly XLA compiles: the Hugging Face models are BERT-base and GPT-2
small sized) or ``--small`` for one-layer tiny configs (about 40 s of CPU
time, no apply repeats); ``--models bert,gpt2`` for a subset,
``--verbose`` for the tracebacks of failures. Needs Qwix and transformers
(the ``bench`` extra: ``pip install -e .[bench]``). Every model is built
from a config with random weights; nothing is downloaded.

Models (one instance, its weights and inputs shared by both libraries):

* ``linen``: a Linen Transformer-ish stack: Gemma-style ``Einsum`` modules
  (a param ``w`` contracted by ``jnp.einsum('BTD,NDH->BTNH', x, w)`` for
  q/k/v, ``'BTNH,NHD->BTD'`` for the output projection), a ``nn.Dense`` MLP
  and a ``nn.Dense`` head; adapted twice: every Dense and Einsum, then the
  Dense layers only;
* ``nnx``: an NNX model with ``nnx.Conv``, ``nnx.LinearGeneral``,
  ``nnx.Einsum`` and ``nnx.Linear``, all adapted;
* ``bert``: Hugging Face ``FlaxBertModel``, every ``Dense``;
* ``gpt2``: Hugging Face ``FlaxGPT2LMHeadModel``, every ``FlaxConv1D``; then
  also the output head, a ``Dense`` tied to the input embedding (HF calls
  ``lm_head.apply({'params': {'kernel': embedding.T}}, h)``).

Each row adapts the same layers with both libraries, with the same rank and
alpha (``--rank``, ``--alpha``):

* YAX: ``yax.make_mox`` of the forward function, then ``yax.lora`` with an
  XPath selection; the training step runs ``yax.eval_mox(res.mox, ...)``.
* Qwix: ``qwix.LoraProvider(module_path=<regex>, rank=, alpha=)`` and
  ``qwix.apply_lora_to_model``. On NNX that call runs the model once and
  creates the adapters. On Linen (and the HF models' Linen modules) the
  adapters appear in an ``init`` of the wrapped module; the script runs it
  under ``jax.jit`` and grafts the adapters onto the original weights. (An
  eager ``init`` finds a kernel only by its shape, and so misses transposed
  non-square kernels such as GPT-2's ``FlaxConv1D``: on that row a note
  gives what an eager ``init`` creates.)

Printed per model and selection, a column per library and their ratio
YAX / Qwix (a library that raises gets ``fails: <Type: message>``):

* adapters: the adapted modules, counted by class;
* apply: the first application (cold caches) and the median of ``--repeat``
  more (3; none with ``--small``), seconds (YAX: trace + lora; Qwix:
  apply_lora_to_model + the init pass it needs + grafting);
* train step: a jitted function returning the loss (mean square of the
  model output) and its gradient with respect to the adapters only (the
  frozen weights are a separate argument): median time per call after
  compiling, the libraries timed in interleaved rounds; and its XLA FLOPs
  (``jax.jit(f).lower(...).compile().cost_analysis()``);
* output at init: largest absolute difference between the adapted model
  (B = 0) and the original one;
* merge: YAX only (Qwix has no merge): the adapters are perturbed (B
  random), ``res.merge`` folds them into the kernels, and the ORIGINAL model
  run on the merged weights is compared with the adapted model (the size of
  the adapters' effect on the output next to it).

Timings are what this machine gave in this run (a shared CPU is noisy);
nothing here asserts them.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import traceback
import warnings

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_TF', '0')
os.environ.setdefault('USE_FLAX', '1')

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import yax  # noqa: E402

ADAPTER_SUFFIXES = ('_lora_a', '_lora_b')


# ----------------------------------------------------------------- models

class Einsum(nn.Module):
  """Gemma-style projection: one param ``w``, contracted by an einsum."""
  shape: tuple

  @nn.compact
  def __call__(self, eqn: str, x):
    w = self.param('w', nn.initializers.normal(0.05), self.shape)
    return jnp.einsum(eqn, x, w)


class Block(nn.Module):
  heads: int
  head_dim: int
  mlp: int

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    h = nn.LayerNorm(name='ln_attn')(x)
    shape = (self.heads, d, self.head_dim)
    q = Einsum(shape, name='q_einsum')('BTD,NDH->BTNH', h)
    k = Einsum(shape, name='k_einsum')('BTD,NDH->BTNH', h)
    v = Einsum(shape, name='v_einsum')('BTD,NDH->BTNH', h)
    logits = jnp.einsum('BTNH,BSNH->BNTS', q, k) / np.sqrt(self.head_dim)
    att = jnp.einsum('BNTS,BSNH->BTNH', jax.nn.softmax(logits), v)
    out = Einsum((self.heads, self.head_dim, d), name='attn_vec_einsum')(
        'BTNH,NHD->BTD', att)
    x = x + out
    h = nn.LayerNorm(name='ln_mlp')(x)
    h = nn.Dense(d, name='down')(nn.gelu(nn.Dense(self.mlp, name='up')(h)))
    return x + h


class LinenLM(nn.Module):
  layers: int
  heads: int
  head_dim: int
  mlp: int
  out: int

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = Block(self.heads, self.head_dim, self.mlp, name=f'block_{i}')(x)
    return nn.Dense(self.out, name='head')(nn.LayerNorm(name='ln_f')(x))


class NNXBlock(nnx.Module):

  def __init__(self, d, heads, head_dim, mlp, *, rngs):
    self.conv = nnx.Conv(d, d, kernel_size=(3,), rngs=rngs)
    self.qkv = nnx.LinearGeneral(d, (3, heads, head_dim), rngs=rngs)
    self.out = nnx.Einsum('btnh,nhd->btd', (heads, head_dim, d), (d,),
                          rngs=rngs)
    self.up = nnx.Linear(d, mlp, rngs=rngs)
    self.down = nnx.Linear(mlp, d, rngs=rngs)
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.head_dim = head_dim

  def __call__(self, x):
    x = x + nnx.relu(self.conv(x))
    qkv = self.qkv(self.norm(x))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(self.head_dim)
    att = jnp.einsum('bnts,bsnh->btnh', jax.nn.softmax(logits), v)
    x = x + self.out(att)
    return x + self.down(nnx.gelu(self.up(x)))


class NNXModel(nnx.Module):

  def __init__(self, layers, d, heads, head_dim, mlp, out, *, rngs):
    self.blocks = nnx.List(
        [NNXBlock(d, heads, head_dim, mlp, rngs=rngs) for _ in range(layers)])
    self.head = nnx.Linear(d, out, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


# ------------------------------------------------------------ tree helpers

def split_by_mask(tree, mask):
  """(trainable leaves, frozen leaves, rebuild(trainable, frozen))."""
  leaves, treedef = jax.tree.flatten(tree)
  flags = jax.tree.leaves(mask)
  assert len(flags) == len(leaves), (len(flags), len(leaves))
  train = [x for x, m in zip(leaves, flags) if m]
  frozen = [x for x, m in zip(leaves, flags) if not m]

  def rebuild(train, frozen):
    it_t, it_f = iter(train), iter(frozen)
    return treedef.unflatten(
        [next(it_t) if m else next(it_f) for m in flags])

  return train, frozen, rebuild


def adapter_mask(tree):
  """True on leaves whose dict key ends in ``_lora_a``/``_lora_b`` (Qwix)."""
  def is_adapter(path, _):
    return any(getattr(k, 'key', None) is not None and
               str(k.key).endswith(ADAPTER_SUFFIXES) for k in path)
  return jax.tree_util.tree_map_with_path(is_adapter, tree)


def graft(base, inited):
  """``base`` with the adapters of ``inited`` added next to its kernels."""
  if not isinstance(inited, dict) and not hasattr(inited, 'items'):
    return base
  out = dict(base)
  for k, v in inited.items():
    if isinstance(k, str) and k.endswith(ADAPTER_SUFFIXES):
      out[k] = v
    elif k in base:
      out[k] = graft(base[k], v)
  return out


def qwix_linen_adapters(params, classes):
  """Counter of module classes holding Qwix adapters in a Linen tree."""
  found = collections.Counter()

  def walk(tree, path):
    if not hasattr(tree, 'items'):
      return
    for k, v in tree.items():
      if isinstance(k, str) and k.endswith('_lora_a'):
        found[classes.get(path, '?')] += 1
      else:
        walk(v, (*path, k))

  walk(params.get('params', params), ())
  return found


def linen_classes(fn, *args):
  """{module path: class name} of every Linen module ``fn(*args)`` calls."""
  classes = {}

  def interceptor(next_fun, a, kw, context):
    classes.setdefault(tuple(context.module.path),
                       type(context.module).__name__)
    return next_fun(*a, **kw)

  with nn.intercept_methods(interceptor):
    jax.eval_shape(fn, *args)
  return classes


def max_diff(a, b) -> float:
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) -
                               jnp.asarray(b, jnp.float32))))


def perturb(tree, mask, seed=1, scale=0.05):
  """Adapters replaced by random values (B no longer zero)."""
  leaves, treedef = jax.tree.flatten(tree)
  flags = jax.tree.leaves(mask)
  rng = np.random.default_rng(seed)
  return treedef.unflatten([
      jnp.asarray(rng.normal(0, scale, x.shape), x.dtype) if m else x
      for x, m in zip(leaves, flags)])


def compile_step(fn, *args):
  """(the compiled ``jax.jit(fn)`` for these arguments, its XLA FLOPs)."""
  compiled = jax.jit(fn).lower(*args).compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return compiled, float((cost or {}).get('flops', float('nan')))


def loss_of(out):
  return jnp.mean(jnp.square(out.astype(jnp.float32)))


# ------------------------------------------------------------- the cases

class Side:
  """One library's result on one model (or the reason it failed)."""

  def __init__(self):
    self.error = None
    self.adapters = None
    self.apply_first = self.apply_median = None
    self.step = None  # (compiled jitted step, its args)
    self.step_s = self.flops = None
    self.init_diff = None
    self.merge = None  # (max diff, size of the adapters' effect) or text
    self.notes = []
    self.reason = None  # the failure, longer


def failure(e: BaseException, limit: int = 70) -> str:
  """``fails: <ExceptionType: message>``: the message's first line (with
  the first item of a list of reasons, as YAX's errors give), cut at
  ``limit`` characters."""
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  msg = lines[0] if lines else ''
  item = next((l for l in lines[1:] if l.startswith('- ')), None)
  if item:
    msg = f'{msg.rstrip(":")}: {item[2:]}'
  msg = msg.split(' (https://')[0]  # Flax's link to its error page
  if len(msg) > limit:
    msg = msg[:limit - 3] + '...'
  return f'fails: {type(e).__name__}: {msg}'


def timed_apply(apply_fn, repeat):
  """(result, seconds of the first call, median seconds of ``repeat``
  more); each call's arrays are waited for."""

  def once():
    t0 = time.perf_counter()
    result = apply_fn()
    jax.block_until_ready([x for x in jax.tree.leaves(result)
                           if isinstance(x, jax.Array)])
    return result, time.perf_counter() - t0

  result, first = once()
  times = [once()[1] for _ in range(repeat)]
  return result, first, statistics.median(times) if times else None


def run_yax(case, sel, args) -> Side:
  side = Side()
  fn, params, inputs, out = (case['fn'], case['params'], case['inputs'],
                             case['out'])

  def apply():
    fresh = lambda p, *a: fn(p, *a)  # a new function: no trace cache
    mox = yax.make_mox(fresh)(params, *inputs)
    return yax.lora(mox, params, sel, rank=args.rank, alpha=args.alpha,
                    key=jax.random.key(0))

  stage = 'apply'
  try:
    res, side.apply_first, side.apply_median = timed_apply(apply, args.repeat)
    wrapped = {tuple(n.path): n.type_name for n in yax.query(
        '//module_call[@type="LoRA"]/module_call', res.mox)}
    side.adapters = collections.Counter(wrapped.values())
    stage = 'forward'
    reference = case['reference']
    adapted = jax.jit(lambda p, *a: out(yax.eval_mox(res.mox, p, *a)))
    side.init_diff = max_diff(adapted(res.params, *inputs), reference)
    trained = perturb(res.params, res.mask)
    lora_out = adapted(trained, *inputs)
    try:
      merged_out = case['original'](res.merge(trained), *inputs)
      side.merge = (max_diff(merged_out, lora_out),
                    max_diff(lora_out, reference))
    except Exception as e:  # noqa: BLE001 - reported in the table
      side.merge = failure(e, limit=40)
      side.notes.append(f'YAX merge {failure(e, limit=400)}')
    stage = 'train step'
    train, frozen, rebuild = split_by_mask(res.params, res.mask)

    def step(train, frozen, *inputs):
      loss = lambda t: loss_of(out(yax.eval_mox(res.mox, rebuild(t, frozen),
                                                 *inputs)))
      return jax.value_and_grad(loss)(train)

    compiled, side.flops = compile_step(step, train, frozen, *inputs)
    side.step = (compiled, (train, frozen, *inputs))
  except Exception as e:  # noqa: BLE001 - reported in the table
    fail(side, e, stage, args)
  return side


def run_qwix(case, module_path, args) -> Side:
  side = Side()
  inputs, out = case['inputs'], case['out']
  stage = 'apply'
  try:
    (forward, lora_params, mask, adapters), side.apply_first, \
        side.apply_median = timed_apply(
            lambda: case['qwix'](args, module_path), args.repeat)
    side.adapters = adapters
    stage = 'forward'
    side.init_diff = max_diff(out(forward(lora_params, *inputs)),
                              case['reference'])
    side.merge = 'no merge'
    stage = 'train step'
    train, frozen, rebuild = split_by_mask(lora_params, mask)

    def step(train, frozen, *inputs):
      loss = lambda t: loss_of(out(forward(rebuild(t, frozen), *inputs)))
      return jax.value_and_grad(loss)(train)

    compiled, side.flops = compile_step(step, train, frozen, *inputs)
    side.step = (compiled, (train, frozen, *inputs))
  except Exception as e:  # noqa: BLE001 - reported in the table
    fail(side, e, stage, args)
  return side


def fail(side, e, stage, args):
  side.error = failure(e)
  side.reason = f'{failure(e, limit=400)} (in {stage})'
  if args.verbose:
    traceback.print_exception(e)


def qwix_provider(args, module_path):
  import qwix
  return qwix.LoraProvider(module_path=module_path, rank=args.rank,
                           alpha=args.alpha)


def linen_qwix(module, base_params, init_args, apply_kwargs, classes):
  """Qwix on a Linen module: ``apply_lora_to_model``, a jitted ``init`` pass
  (it creates the adapters), and the original weights grafted in. Under
  ``jax.jit`` Qwix finds a kernel through the ops applied to it; an eager
  ``init`` finds it only by shape, which misses a transposed non-square
  kernel (GPT-2's ``FlaxConv1D``), so the eager pass is only reported.
  Returns ``side(args, module_path) -> (forward, params, mask, adapters)``
  with ``forward(params, *inputs)``."""

  def side(args, module_path):
    import qwix
    lora_module = qwix.apply_lora_to_model(
        module, qwix_provider(args, module_path))
    inited = jax.jit(lora_module.init)(jax.random.key(0), *init_args)
    params = {'params': graft(base_params, inited['params'])}

    def forward(p, *inputs):
      return lora_module.apply(p, *inputs, **apply_kwargs)

    return (forward, params, adapter_mask(params),
            qwix_linen_adapters(params, classes))

  def eager_note(args, module_path, with_jit):
    import qwix
    lora_module = qwix.apply_lora_to_model(
        module, qwix_provider(args, module_path))
    t0 = time.perf_counter()
    inited = lora_module.init(jax.random.key(0), *init_args)
    seconds = time.perf_counter() - t0
    n = sum(qwix_linen_adapters(inited, classes).values())
    return (f'Qwix with an eager init (no jax.jit): {n} adapted modules '
            f'({with_jit} with jit), init {seconds:.3g} s')

  side.eager_note = eager_note
  return side


def make_linen_case(args):
  if args.small:
    cfg = dict(layers=1, heads=2, head_dim=8, mlp=64, out=16)
    d, batch, seq = 16, 2, 16
  else:
    cfg = dict(layers=4, heads=8, head_dim=64, mlp=2048, out=512)
    d, batch, seq = 512, 4, 128
  model = LinenLM(**cfg)
  x = jax.random.normal(jax.random.key(1), (batch, seq, d))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  classes = linen_classes(model.apply, variables, x)
  return dict(
      name=f'linen: LinenLM {cfg["layers"]} blocks, d={d}, x {batch}x{seq}x{d}',
      fn=model.apply, params=variables, inputs=(x,), out=lambda y: y,
      selections=[
          ('Dense + Einsum', '//module_call[@type="Dense" or @type="Einsum"]',
           '.*', False),
          ('Dense only', '//module_call[@type="Dense"]',
           '(.*/)?(up|down|head)', False)],
      qwix=linen_qwix(model, variables['params'], (x,), {}, classes))


def make_nnx_case(args):
  if args.small:
    cfg = dict(layers=1, d=16, heads=2, head_dim=8, mlp=64, out=16)
    batch, seq = 2, 16
  else:
    cfg = dict(layers=4, d=512, heads=8, head_dim=64, mlp=2048, out=512)
    batch, seq = 4, 128
  model = NNXModel(**cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (batch, seq, cfg['d']))
  graphdef, state = nnx.split(model)

  def fn(state, x):
    return nnx.merge(graphdef, state)(x)

  def qwix_side(args, module_path):
    import qwix
    lora_model = qwix.apply_lora_to_model(
        model, qwix_provider(args, module_path), x, rngs=nnx.Rngs(0))
    lgraph, lstate = nnx.split(lora_model)
    mask = jax.tree.map(lambda v: isinstance(v, nnx.LoRAParam), lstate,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))
    adapters = collections.Counter()
    for _, module in lora_model.iter_modules():
      n = sum(isinstance(v, nnx.LoRAParam) for a, v in vars(module).items()
              if a.endswith('_lora_a'))
      if n:
        adapters[type(module).__name__] += n

    def forward(s, x):
      return nnx.merge(lgraph, s)(x)

    return forward, lstate, mask, adapters

  return dict(
      name=f'nnx: NNXModel {cfg["layers"]} blocks, d={cfg["d"]}, '
           f'x {batch}x{seq}x{cfg["d"]}',
      fn=fn, params=state, inputs=(x,), out=lambda y: y,
      selections=[(
          'Linear, LinearGeneral, Einsum, Conv',
          '//module_call[@type="Linear" or @type="LinearGeneral" or '
          '@type="Einsum" or @type="Conv"]', '.*', False)],
      qwix=qwix_side)


def _hf_qwix(module, base, init_args, classes):
  """Qwix on an HF model's Linen module; its forward takes only the ids
  (the other arguments fixed, as the HF wrapper builds them)."""
  inner = linen_qwix(module, base, init_args, dict(deterministic=True),
                     classes)
  rest = init_args[1:]

  def side(args, module_path):
    forward, params, mask, adapters = inner(args, module_path)
    return ((lambda p, ids: forward(p, ids, *rest)), params, mask, adapters)

  side.eager_note = inner.eager_note
  return side


def hf_model(cls, config):
  """An HF Flax model with random weights (initialised under jax.jit)."""
  model = cls(config, seed=0, _do_init=False)
  params = jax.jit(model.init_weights, static_argnums=1)(
      jax.random.PRNGKey(0), (1, 1))
  return model, params


def make_bert_case(args):
  from transformers import BertConfig, FlaxBertModel
  config = (BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=4, intermediate_size=37,
                       max_position_embeddings=64)
            if args.small else BertConfig())
  batch, seq = (2, 16) if args.small else (1, 128)
  model, params = hf_model(FlaxBertModel, config)
  ids = jnp.ones((batch, seq), jnp.int32)
  mask, types = jnp.ones_like(ids), jnp.zeros_like(ids)
  pos = jnp.broadcast_to(jnp.arange(seq), ids.shape)

  def fn(params, ids):
    return model(ids, params=params)

  classes = linen_classes(fn, params, ids)
  return dict(
      name=f'bert: FlaxBertModel {config.num_hidden_layers} layers, '
           f'hidden {config.hidden_size}, ids {batch}x{seq}',
      fn=fn, params=params, inputs=(ids,),
      out=lambda y: y.last_hidden_state,
      selections=[
          ('every Dense', '//module_call[@type="Dense"]', '.*', False)],
      qwix=_hf_qwix(model.module, params,
                    (ids, mask, types, pos, None), classes))


def make_gpt2_case(args):
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  config = (GPT2Config(vocab_size=99, n_positions=64, n_embd=32, n_layer=1,
                       n_head=4) if args.small else GPT2Config())
  batch, seq = (2, 16) if args.small else (1, 128)
  model, params = hf_model(FlaxGPT2LMHeadModel, config)
  ids = jnp.ones((batch, seq), jnp.int32)
  mask = jnp.ones_like(ids)
  pos = jnp.broadcast_to(jnp.arange(seq), ids.shape)

  def fn(params, ids):
    return model(ids, params=params)

  classes = linen_classes(fn, params, ids)
  return dict(
      name=f'gpt2: FlaxGPT2LMHeadModel {config.n_layer} layers, '
           f'n_embd {config.n_embd}, ids {batch}x{seq}',
      fn=fn, params=params, inputs=(ids,), out=lambda y: y.logits,
      selections=[
          ('every FlaxConv1D', '//module_call[@type="FlaxConv1D"]',
           '.*/(c_attn|c_proj|c_fc)', True),
          ('also the tied lm_head Dense',
           '//module_call[@type="FlaxConv1D" or @type="Dense"]', '.*', False)],
      qwix=_hf_qwix(model.module, params, (ids, mask, pos), classes))


CASES = dict(linen=make_linen_case, nnx=make_nnx_case, bert=make_bert_case,
             gpt2=make_gpt2_case)


# -------------------------------------------------------------- printing

def time_steps(sides, rounds, calls):
  """Median per-call seconds of each side's jitted step, interleaved."""
  live = [s for s in sides if s.step is not None]
  for s in live:
    fn, a = s.step
    for _ in range(2):
      jax.block_until_ready(fn(*a))
  samples = {id(s): [] for s in live}
  for _ in range(rounds):
    for s in live:
      fn, a = s.step
      t0 = time.perf_counter()
      for _ in range(calls):
        r = fn(*a)
      jax.block_until_ready(r)
      samples[id(s)].append((time.perf_counter() - t0) / calls)
  for s in live:
    s.step_s = statistics.median(samples[id(s)])


def fmt_counter(c):
  if c is None:
    return '-'
  return ' '.join(f'{k}:{v}' for k, v in sorted(c.items())) or '-'


def fmt_num(x, unit=''):
  if x is None:
    return '-'
  return f'{x:.3g}{unit}'


def ratio(a, b):
  if a is None or b is None or not b:
    return '-'
  return f'{a / b:.2f}'


def print_case(name, y: Side, q: Side, args):
  print(f'\n== {name}')
  rows = [('', 'YAX', 'Qwix', 'YAX/Qwix')]
  if y.error or q.error:
    rows.append(('status', y.error or 'ok', q.error or 'ok', ''))

  def row(label, show, key=None):
    """A row of what each side measured before it failed, if it did."""
    def cell(s):
      try:
        return show(s)
      except (TypeError, AttributeError):  # not measured
        return '-'

    def value(s):
      try:
        return key(s)
      except (TypeError, AttributeError):
        return None

    cells = (cell(y), cell(q))
    if cells != ('-', '-'):
      vy, vq = (value(y), value(q)) if key else (None, None)
      rows.append((label, *cells,
                   '' if vy is None or vq is None else ratio(vy, vq)))

  total = lambda s: sum(s.adapters.values())
  row('adapters (modules by class)', lambda s: fmt_counter(s.adapters))
  row('adapters (total)', lambda s: str(total(s)), total)
  row('apply, first (s)', lambda s: fmt_num(s.apply_first),
      lambda s: s.apply_first)
  if args.repeat:
    row(f'apply, median of {args.repeat} more (s)',
        lambda s: fmt_num(s.apply_median), lambda s: s.apply_median)
  row('train step, jit, median (ms)',
      lambda s: fmt_num(None if s.step_s is None else 1e3 * s.step_s),
      lambda s: s.step_s)
  row('train step, XLA FLOPs', lambda s: fmt_num(s.flops), lambda s: s.flops)
  row('output at init vs original, max|diff|',
      lambda s: fmt_num(s.init_diff))

  def merge(s):
    if s.merge is None:
      raise TypeError
    if isinstance(s.merge, str):
      return s.merge
    return f'{s.merge[0]:.3g} (adapters move it {s.merge[1]:.3g})'

  row('merged vs adapted, max|diff|', merge)
  cols = [max(len(r[i]) for r in rows) for i in range(4)]
  for r in rows:
    print('  '.join(c.ljust(w) for c, w in zip(r, cols)).rstrip())


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--small', action='store_true',
                      help='tiny configs (well under a minute)')
  parser.add_argument('--models', default=','.join(CASES),
                      help=f'comma-separated subset of {",".join(CASES)}')
  parser.add_argument('--rank', type=int, default=8)
  parser.add_argument('--alpha', type=float, default=16.0)
  parser.add_argument('--repeat', type=int, default=None,
                      help='apply repeats after the first (default 3, 0 small)')
  parser.add_argument('--rounds', type=int, default=None,
                      help='train-step timing rounds (default 7, 5 small)')
  parser.add_argument('--verbose', action='store_true',
                      help='print the tracebacks of failures')
  args = parser.parse_args(argv)
  if args.repeat is None:
    args.repeat = 0 if args.small else 3
  rounds = args.rounds or (5 if args.small else 7)
  calls = 20 if args.small else 2

  import flax
  import qwix
  import transformers
  transformers.logging.set_verbosity_error()  # its Flax deprecation notice
  print(f'jax {jax.__version__}, flax {flax.__version__}, qwix '
        f'{getattr(qwix, "__version__", "?")}, transformers '
        f'{transformers.__version__}, yax {yax.__version__}; '
        f'{jax.devices()[0].device_kind} x{jax.device_count()}, '
        f'rank {args.rank}, alpha {args.alpha}'
        f'{", small configs" if args.small else ""}')
  summary = []
  for key in args.models.split(','):
    t0 = time.perf_counter()
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')  # transformers' and Flax's notices
      case = CASES[key](args)
      # the original model's output, jitted: YAX's merged weights run in it
      case['original'] = jax.jit(
          lambda p, *a, case=case: case['out'](case['fn'](p, *a)))
      case['reference'] = case['original'](case['params'], *case['inputs'])
      for label, xpath, regex, eager_check in case['selections']:
        y = run_yax(case, xpath, args)
        q = run_qwix(case, regex, args)
        note = getattr(case['qwix'], 'eager_note', None)
        if eager_check and note is not None:
          with_jit = '-' if q.error else sum(q.adapters.values())
          try:
            q.notes.append(note(args, regex, with_jit))
          except Exception as e:  # noqa: BLE001 - reported
            q.notes.append('Qwix with an eager init (no jax.jit): '
                           + failure(e))
        time_steps([y, q], rounds, calls)
        print_case(f'{case["name"]}; adapting: {label}', y, q, args)
        print(f'  YAX selection: {xpath}')
        print(f'  Qwix module_path: {regex!r}')
        for who, side in (('YAX', y), ('Qwix', q)):
          if side.error:
            print(f'  {who} {side.reason}')
        for n in y.notes + q.notes:
          print(f'  note: {n}')
        summary.append((f'{key}: {label}', y, q))
        sys.stdout.flush()
    print(f'  ({time.perf_counter() - t0:.0f} s for this model)')

  print('\n== ratios YAX / Qwix (below 1: YAX smaller or faster; '
        'timings from this run only)')
  width = max(len(k) for k, _, _ in summary) + 2
  print(f'  {"model: adapting":{width}}{"apply first":>12}{"apply median":>14}'
        f'{"step time":>11}{"step FLOPs":>12}')
  for key, y, q in summary:
    if y.error or q.error:
      print(f'  {key:{width}}' + '; '.join(
          f'{who} {s.error}' for who, s in (('YAX', y), ('Qwix', q))
          if s.error))
      continue
    print(f'  {key:{width}}{ratio(y.apply_first, q.apply_first):>12}'
          f'{ratio(y.apply_median, q.apply_median):>14}'
          f'{ratio(y.step_s, q.step_s):>11}{ratio(y.flops, q.flops):>12}')


if __name__ == '__main__':
  main()
