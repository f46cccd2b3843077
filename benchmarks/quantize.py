"""YAX's weight quantization next to Google's Qwix PTQ, on the same models.

Run: ``python benchmarks/quantize.py`` (medium configs: 4-layer d=512
Linen/NNX stacks, 6-layer BERT-base and GPT-2-small widths; about 3 minutes
on 2 shared CPU cores, mostly XLA compiles) or ``--small`` for one-layer
tiny configs (under a minute); ``--models bert,gpt2`` for a subset,
``--formats int8,nf4`` for a subset of formats, ``--verbose`` for the
tracebacks of failures. Needs Qwix and transformers (the ``bench`` extra).
Every model is built from a config with random weights; nothing is
downloaded.

Models (one instance, its weights and inputs shared by both libraries):

* ``linen``: a Linen stack of Gemma-style ``Einsum`` modules (a param ``w``
  contracted by ``jnp.einsum('BTD,NDH->BTNH', x, w)`` for q/k/v,
  ``'BTNH,NHD->BTD'`` for the output) and an ``nn.Dense`` MLP and head;
* ``conv``: a Linen CNN of ``nn.Conv`` layers and an ``nn.Dense`` head;
* ``general``: a Linen MLP on per-head features: ``nn.DenseGeneral``
  contracting two axes (``axis=(-2, -1)``, heads x head dim) into two
  (``features=(heads, head dim)``), and an ``nn.Dense`` head; quantized per
  output channel and with tiles of 32 contracted elements. The tiles are
  not the same groups in both libraries: YAX cuts a channel's contracted
  elements, flattened in kernel order (the SPEC's rule), into runs of 32,
  here one per input head; Qwix's ``tile_size`` cuts only the innermost
  contracted axis and reduces the others whole, so with head dim 32 its
  tiled DenseGeneral keeps one scale per channel (its bytes and error equal
  its untiled row's). On the Dense head (one contracted axis) the groups
  are the same;
* ``nnx``: an NNX model of ``nnx.Einsum`` attention projections and an
  ``nnx.Linear`` MLP and head;
* ``bert``: Hugging Face ``FlaxBertModel`` (every ``Dense``);
* ``gpt2``: Hugging Face ``FlaxGPT2LMHeadModel`` (every ``FlaxConv1D``;
  then, int8 only, the output head: a ``Dense`` whose kernel is the input
  embedding, transposed, which HF passes in as ``{'kernel': wte.T}``).

For each model, layer kind and weight format, the same layers are quantized
(weights only, one absmax scale per output channel, or per tile where the
row's kind says so, post-training):

* YAX: ``yax.make_mox`` of the forward function, then ``yax.quantize(mox,
  params, <XPath by module type>, weight=fmt, tile=tile)`` (int8, int4,
  nf4, fp8 = float8_e4m3fn); the forward is ``yax.eval_mox(res.mox,
  res.params, ...)``.
* Qwix: ``qwix.quantize_model(model, qwix.PtqProvider([QuantizationRule(
  module_path=<regex>, weight_qtype=fmt, tile_size=tile)]))``. Linen (and
  the HF models'
  Linen modules): ``jax.eval_shape`` of the quantized module's ``init``
  gives the abstract quantized tree, ``qwix.quantize_params`` fills it from
  the float weights, and the forward is the quantized module's ``apply``.
  NNX: ``quantize_model`` runs the model once on the input and quantizes its
  weights in place; the forward is ``nnx.merge`` of its split state.
  Qwix's formats have the same names (``jnp.int8``, ``jnp.int4``, ``'nf4'``,
  ``jnp.float8_e4m3fn``). YAX is symmetric absmax (absmax maps to qmax,
  127 or 7, codes -qmax .. qmax); Qwix maps the absmax to qmax + 0.5
  (127.5, 7.5) and uses the whole signed range: int8 and int4 errors differ
  a little (either way) for that reason; nf4 and fp8 codes are the same.

Printed per model, one row per layer kind and format, a column group per
library (a library that raises gets ``fails: <Type: message>`` instead):

* layers: how many module calls hold a quantized kernel (YAX: ``.paths``;
  Qwix: quantized arrays in its params tree);
* rel err: ``||y_q - y|| / ||y||`` of the model output against the float
  model on the same weights and input (both float32);
* MB: bytes of ALL parameters after quantization (quantized kernels, their
  scales, and the untouched float params), 4-bit values counted as half a
  byte (YAX: ``res.nbytes[1]``; Qwix: the sum over the leaves of its params
  tree); the float model's bytes are in the model's header line;
* ms: the jitted forward, median time per call after compiling (YAX and
  Qwix timed in interleaved rounds; the float forward in the header).

Then, for BERT, ``yax.cast`` of every ``Dense`` to bfloat16 (LayerNorm and
softmax stay float32) next to HF's own ``FlaxBertModel(config,
dtype=jnp.bfloat16)`` (everything in bfloat16) on the same weights: the
relative error of each against the float32 model, and their step time.

Timings are what this machine gave in this run (a shared CPU is noisy, and
on CPU a dequantize-then-matmul forward is not expected to be faster than
the float one); nothing here asserts them.
"""

from __future__ import annotations

import argparse
import os
import re
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

FORMATS = ('int8', 'int4', 'nf4', 'fp8')


def qwix_qtype(fmt):
  """Qwix's name for one of YAX's weight formats."""
  return {'int8': jnp.int8, 'int4': jnp.int4, 'nf4': 'nf4',
          'fp8': jnp.float8_e4m3fn}[fmt]


# ----------------------------------------------------------------- models

class GemmaEinsum(nn.Module):
  """A Gemma-style projection: one param ``w`` contracted by an einsum."""
  shape: tuple

  @nn.compact
  def __call__(self, eqn: str, x):
    w = self.param('w', nn.initializers.lecun_normal(), self.shape)
    return jnp.einsum(eqn, x, w)


class LinenBlock(nn.Module):
  heads: int
  head_dim: int
  mlp: int

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    h = nn.LayerNorm(name='ln1')(x)
    qkv = [GemmaEinsum((self.heads, d, self.head_dim), name=f'{n}_einsum')(
        'BTD,NDH->BTNH', h) for n in 'qkv']
    q, k, v = qkv
    logits = jnp.einsum('BTNH,BSNH->BNTS', q, k) / np.sqrt(self.head_dim)
    att = jnp.einsum('BNTS,BSNH->BTNH', jax.nn.softmax(logits), v)
    x = x + GemmaEinsum((self.heads, self.head_dim, d), name='o_einsum')(
        'BTNH,NHD->BTD', att)
    h = nn.LayerNorm(name='ln2')(x)
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
      x = LinenBlock(self.heads, self.head_dim, self.mlp, name=f'layer_{i}')(x)
    return nn.Dense(self.out, name='head')(nn.LayerNorm(name='ln_f')(x))


class ConvNet(nn.Module):
  features: tuple
  classes: int

  @nn.compact
  def __call__(self, x):
    for i, f in enumerate(self.features):
      x = nn.relu(nn.Conv(f, (3, 3), strides=(2, 2) if i else (1, 1),
                          name=f'conv_{i}')(x))
    return nn.Dense(self.classes, name='head')(jnp.mean(x, axis=(1, 2)))


class NNXBlock(nnx.Module):

  def __init__(self, d, heads, head_dim, mlp, *, rngs):
    shape = (heads, d, head_dim)
    self.q = nnx.Einsum('btd,ndh->btnh', shape, rngs=rngs)
    self.k = nnx.Einsum('btd,ndh->btnh', shape, rngs=rngs)
    self.v = nnx.Einsum('btd,ndh->btnh', shape, rngs=rngs)
    self.o = nnx.Einsum('btnh,nhd->btd', (heads, head_dim, d), (d,),
                        rngs=rngs)
    self.up = nnx.Linear(d, mlp, rngs=rngs)
    self.down = nnx.Linear(mlp, d, rngs=rngs)
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.head_dim = head_dim

  def __call__(self, x):
    h = self.ln1(x)
    q, k, v = self.q(h), self.k(h), self.v(h)
    logits = jnp.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(self.head_dim)
    x = x + self.o(jnp.einsum('bnts,bsnh->btnh', jax.nn.softmax(logits), v))
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class NNXModel(nnx.Module):

  def __init__(self, layers, d, heads, head_dim, mlp, out, *, rngs):
    self.blocks = nnx.List(
        [NNXBlock(d, heads, head_dim, mlp, rngs=rngs) for _ in range(layers)])
    self.head = nnx.Linear(d, out, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


# --------------------------------------------------------------- helpers

def failure(e: BaseException, limit: int = 90) -> str:
  """``fails: <ExceptionType: message>``: the message's first line, or the
  first ``- `` item of its list of reasons where it has one (YAX's errors
  list the refused module calls so), cut at ``limit`` characters."""
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  msg = lines[0] if lines else ''
  item = next((l for l in lines[1:] if l.startswith('- ')), None)
  if item and limit < 200:  # the reason, without the call's name
    msg = re.sub(r"^module_call \S+ at path '[^']*': ", '', item[2:])
  elif item:
    msg = f'{msg.rstrip(":")}: {item[2:]}'
  msg = msg.split(' (https://')[0]
  if len(msg) > limit:
    msg = msg[:limit - 3] + '...'
  return f'fails: {type(e).__name__}: {msg}'


def rel_err(y, ref) -> float:
  y = jnp.asarray(y, jnp.float32)
  return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))


def tree_bytes(tree) -> int:
  """Bytes of the array leaves; 4-bit types count half a byte."""
  total = 0.0
  for leaf in jax.tree.leaves(tree):
    if not hasattr(leaf, 'dtype') or not hasattr(leaf, 'shape'):
      continue
    dtype = jnp.dtype(leaf.dtype)
    bits = 4 if dtype in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) \
        else 8 * dtype.itemsize
    total += int(np.prod(leaf.shape)) * bits / 8
  return int(np.ceil(total))


def qwix_quantized_count(tree) -> int:
  """Quantized arrays (QArray ``qvalue`` leaves) in a Qwix params tree."""
  def is_qvalue(k):
    return 'qvalue' in (getattr(k, 'key', None), getattr(k, 'name', None))
  return sum(1 for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
             if any(map(is_qvalue, path)))


def compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile()


def time_interleaved(calls, rounds, per_round):
  """Median seconds per call of each ``(fn, args)`` (None entries skipped),
  after two warm-up calls, the functions timed in interleaved rounds."""
  live = [c for c in calls if c is not None]
  for fn, args in live:
    for _ in range(2):
      jax.block_until_ready(fn(*args))
  samples = [[] for _ in live]
  for _ in range(rounds):
    for i, (fn, args) in enumerate(live):
      t0 = time.perf_counter()
      for _ in range(per_round):
        r = fn(*args)
      jax.block_until_ready(r)
      samples[i].append((time.perf_counter() - t0) / per_round)
  it = iter(statistics.median(s) for s in samples)
  return [None if c is None else next(it) for c in calls]


class Side:
  """One library's result on one row (or why it failed)."""

  def __init__(self):
    self.error = self.reason = None
    self.layers = self.err = self.nbytes = self.step_s = None
    self.step = None  # (compiled forward, args)


def fail(side, e, args):
  side.error = failure(e)
  side.reason = failure(e, limit=300)
  if args.verbose:
    traceback.print_exception(e)


# ------------------------------------------------------------- the sides

def run_yax(case, xpath, fmt, tile, args) -> Side:
  side = Side()
  try:
    res = yax.quantize(case['mox'], case['params'], xpath, weight=fmt,
                       tile=tile)
    side.layers = len(res.paths)
    side.nbytes = res.nbytes[1]
    out, inputs = case['out'], case['inputs']
    fwd = compiled(lambda p, *a: out(yax.eval_mox(res.mox, p, *a)),
                   res.params, *inputs)
    side.err = rel_err(fwd(res.params, *inputs), case['reference'])
    side.step = (fwd, (res.params, *inputs))
  except Exception as e:  # noqa: BLE001 - reported in the table
    fail(side, e, args)
  return side


def run_qwix(case, regex, fmt, tile, args) -> Side:
  side = Side()
  try:
    import qwix
    provider = qwix.PtqProvider([qwix.QuantizationRule(
        module_path=regex, weight_qtype=qwix_qtype(fmt), tile_size=tile)])
    forward, qparams = case['qwix'](qwix, provider)
    side.layers = qwix_quantized_count(qparams)
    side.nbytes = tree_bytes(qparams)
    inputs = case['inputs']
    fwd = compiled(lambda p, *a: case['out'](forward(p, *a)), qparams,
                   *inputs)
    side.err = rel_err(fwd(qparams, *inputs), case['reference'])
    side.step = (fwd, (qparams, *inputs))
  except Exception as e:  # noqa: BLE001 - reported in the table
    fail(side, e, args)
  return side


def linen_qwix(module, float_params, inputs, rest=(), apply_kwargs=None):
  """Qwix PTQ of a Linen module: the abstract quantized params from a
  ``jax.eval_shape`` of the quantized module's init, filled from the float
  params (the 'params' collection) by ``qwix.quantize_params``. The module
  is called with ``*inputs, *rest``; the forward takes ``(params, *inputs)``
  (``rest`` fixed, as the HF wrappers build it)."""
  apply_kwargs = apply_kwargs or {}

  def side(qwix, provider):
    qmodel = qwix.quantize_model(module, provider)
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), *inputs, *rest)
    qparams = qwix.quantize_params(float_params, abstract['params'])

    def forward(p, *inputs):
      return qmodel.apply({'params': p}, *inputs, *rest, **apply_kwargs)

    return forward, qparams

  return side


# ------------------------------------------------------------- the models

def make_linen(args):
  if args.small:
    cfg, (b, t, d) = dict(layers=1, heads=2, head_dim=8, mlp=64, out=16), \
        (2, 8, 16)
  else:
    cfg, (b, t, d) = dict(layers=4, heads=8, head_dim=64, mlp=2048,
                          out=512), (4, 128, 512)
  model = LinenLM(**cfg)
  x = jax.random.normal(jax.random.key(1), (b, t, d))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  qwix_side = linen_qwix(model, variables['params'], (x,))
  return dict(
      name=f'linen: LinenLM {cfg["layers"]} layers, d={d}, '
           f'Einsum + Dense, x {b}x{t}x{d}',
      fn=model.apply, params=variables, inputs=(x,), out=lambda y: y,
      kinds=[('Einsum', '//module_call[@type="GemmaEinsum"]', '.*_einsum',
              FORMATS),
             ('Dense', '//module_call[@type="Dense"]', '(.*/)?(up|down|head)',
              FORMATS)],
      qwix=qwix_side)


def make_conv(args):
  if args.small:
    feats, classes, (b, hw, c) = (8, 16), 10, (2, 16, 3)
  else:
    feats, classes, (b, hw, c) = (64, 128, 256, 256), 1000, (8, 64, 3)
  model = ConvNet(feats, classes)
  x = jax.random.normal(jax.random.key(1), (b, hw, hw, c))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  qwix_side = linen_qwix(model, variables['params'], (x,))
  return dict(
      name=f'conv: ConvNet {len(feats)} nn.Conv 3x3 {feats} + Dense head, '
           f'x {b}x{hw}x{hw}x{c}',
      fn=model.apply, params=variables, inputs=(x,), out=lambda y: y,
      kinds=[('Conv', '//module_call[@type="Conv"]', 'conv_.*', FORMATS),
             ('Dense', '//module_call[@type="Dense"]', 'head', ('int8',))],
      qwix=qwix_side)


class GeneralMLP(nn.Module):
  """Per-head features through DenseGeneral layers contracting two axes."""
  heads: int
  head_dim: int
  out: int

  @nn.compact
  def __call__(self, x):  # [batch, time, heads, head_dim]
    for i in range(2):
      x = nn.gelu(nn.DenseGeneral((self.heads, self.head_dim),
                                  axis=(-2, -1), name=f'general_{i}')(x))
    return nn.Dense(self.out, name='head')(x.reshape(*x.shape[:2], -1))


def make_general(args):
  if args.small:
    cfg, (b, t) = dict(heads=2, head_dim=32, out=16), (2, 8)
  else:
    cfg, (b, t) = dict(heads=8, head_dim=64, out=512), (4, 128)
  model = GeneralMLP(**cfg)
  x = jax.random.normal(jax.random.key(1), (b, t, cfg['heads'],
                                            cfg['head_dim']))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  xpath = '//module_call[@type="DenseGeneral"]'
  return dict(
      name=f'general: 2 DenseGeneral (heads, head_dim) -> (heads, head_dim) '
           f'+ Dense head, x {b}x{t}x{cfg["heads"]}x{cfg["head_dim"]}',
      fn=model.apply, params=variables, inputs=(x,), out=lambda y: y,
      kinds=[('DenseGeneral', xpath, 'general_.*', FORMATS),
             ('DenseGeneral tile=32', xpath, 'general_.*', FORMATS, 32),
             ('Dense tile=32', '//module_call[@type="Dense"]', 'head',
              ('int8', 'int4'), 32)],
      qwix=linen_qwix(model, variables['params'], (x,)))


def make_nnx(args):
  if args.small:
    cfg, (b, t) = dict(layers=1, d=16, heads=2, head_dim=8, mlp=64,
                       out=16), (2, 8)
  else:
    cfg, (b, t) = dict(layers=4, d=512, heads=8, head_dim=64, mlp=2048,
                       out=512), (4, 128)
  model = NNXModel(**cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (b, t, cfg['d']))
  graphdef, state = nnx.split(model)

  def fn(state, x):
    return nnx.merge(graphdef, state)(x)

  def qwix_side(qwix, provider):
    qmodel = qwix.quantize_model(model, provider, x)
    qgraph, qstate = nnx.split(qmodel)

    def forward(s, x):
      return nnx.merge(qgraph, s)(x)

    return forward, qstate

  return dict(
      name=f'nnx: NNXModel {cfg["layers"]} layers, d={cfg["d"]}, '
           f'nnx.Einsum + nnx.Linear, x {b}x{t}x{cfg["d"]}',
      fn=fn, params=state, inputs=(x,), out=lambda y: y,
      kinds=[('Einsum', '//module_call[@type="Einsum"]', r'blocks/\d+/[qkvo]',
              FORMATS),
             ('Linear', '//module_call[@type="Linear"]',
              r'blocks/\d+/(up|down)|head', FORMATS)],
      qwix=qwix_side)


def hf_model(cls, config, **kw):
  """An HF Flax model with random weights (initialised under jax.jit)."""
  model = cls(config, seed=0, _do_init=False, **kw)
  params = jax.jit(model.init_weights, static_argnums=1)(
      jax.random.PRNGKey(0), (1, 1))
  return model, params


def make_bert(args):
  from transformers import BertConfig, FlaxBertModel
  if args.small:
    config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=37,
                        max_position_embeddings=64)
    b, t = 2, 16
  else:
    config = BertConfig(num_hidden_layers=6)
    b, t = 1, 128
  model, params = hf_model(FlaxBertModel, config)
  ids = jax.random.randint(jax.random.key(2), (b, t), 0, config.vocab_size)
  mask, types = jnp.ones_like(ids), jnp.zeros_like(ids)
  pos = jnp.broadcast_to(jnp.arange(t), ids.shape)

  def fn(params, ids):
    return model(ids, params=params)

  qwix_side = linen_qwix(model.module, params, (ids,),
                         (mask, types, pos, None), dict(deterministic=True))
  return dict(
      name=f'bert: FlaxBertModel {config.num_hidden_layers} layers, hidden '
           f'{config.hidden_size}, ids {b}x{t}',
      fn=fn, params=params, inputs=(ids,), out=lambda y: y.last_hidden_state,
      kinds=[('Dense', '//module_call[@type="Dense"]',
              '.*/(query|key|value|dense)', FORMATS)],
      qwix=qwix_side, cast=(FlaxBertModel, config))


def make_gpt2(args):
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  if args.small:
    config = GPT2Config(vocab_size=99, n_positions=64, n_embd=32, n_layer=1,
                        n_head=4)
    b, t = 2, 16
  else:
    config = GPT2Config(n_layer=6)
    b, t = 1, 128
  model, params = hf_model(FlaxGPT2LMHeadModel, config)
  ids = jax.random.randint(jax.random.key(2), (b, t), 0, config.vocab_size)
  mask = jnp.ones_like(ids)
  pos = jnp.broadcast_to(jnp.arange(t), ids.shape)

  def fn(params, ids):
    return model(ids, params=params)

  qwix_side = linen_qwix(model.module, params, (ids,), (mask, pos),
                         dict(deterministic=True))
  return dict(
      name=f'gpt2: FlaxGPT2LMHeadModel {config.n_layer} layers, n_embd '
           f'{config.n_embd}, ids {b}x{t}',
      fn=fn, params=params, inputs=(ids,), out=lambda y: y.logits,
      kinds=[('FlaxConv1D', '//module_call[@type="FlaxConv1D"]',
              '.*/(c_attn|c_proj|c_fc)', FORMATS),
             ('tied lm_head Dense', '//module_call[@type="Dense"]',
              'lm_head', ('int8',))],
      qwix=qwix_side)


CASES = dict(linen=make_linen, conv=make_conv, general=make_general,
             nnx=make_nnx, bert=make_bert, gpt2=make_gpt2)


# -------------------------------------------------------- cast (BERT only)

def run_cast(case, rounds, per_round, args):
  """yax.cast of BERT's Dense layers to bfloat16 next to HF's own
  ``dtype=jnp.bfloat16`` model, on the same float32 weights."""
  cls, config = case['cast']
  params, ids, out = case['params'], case['inputs'][0], case['out']

  def yax_cast():
    low = yax.cast(case['mox'], '//module_call[@type="Dense"]', 'bfloat16')
    return lambda p, i: out(yax.eval_mox(low, p, i))

  def hf_bfloat16():
    hf16 = cls(config, seed=0, _do_init=False, dtype=jnp.bfloat16)
    return lambda p, i: out(hf16(i, params=p))

  rows = []
  for label, build in (('yax.cast(Dense -> bfloat16)', yax_cast),
                       (f'HF {cls.__name__}(dtype=bfloat16)', hf_bfloat16)):
    try:
      fwd = compiled(build(), params, ids)
      rows.append((label, rel_err(fwd(params, ids), case['reference']),
                   (fwd, (params, ids))))
    except Exception as e:  # noqa: BLE001 - reported
      if args.verbose:
        traceback.print_exception(e)
      rows.append((label, failure(e), None))
  times = time_interleaved([r[2] for r in rows], rounds, per_round)
  print('  bfloat16 compute, same float32 weights (rel err vs float32):')
  width = max(len(r[0]) for r in rows)
  for (label, err, _), t in zip(rows, times):
    if isinstance(err, str):
      print(f'    {label:{width}}  {err}')
    else:
      print(f'    {label:{width}}  rel err {err:.3g}, {1e3 * t:.3g} ms')


# -------------------------------------------------------------- printing

def fmt_side(s: Side):
  """A side's four cells, or its failure as one cell."""
  if s.error:
    return [s.error]
  return [str(s.layers), f'{s.err:.2e}', f'{s.nbytes / 1e6:.3g}',
          '-' if s.step_s is None else f'{1e3 * s.step_s:.3g}']


def print_table(rows):
  """rows: (kind, format, YAX cells, Qwix cells); a side that failed has
  one cell, its message, which spans (and may overrun) its column group."""
  head = ['layers', 'rel err', 'MB', 'ms']
  full = [r for r in [('kind', 'format', head, head)] + rows]
  label_w = [max(len(r[i]) for r in full) for i in range(2)]
  side_w = [max([len(r[j][i]) for r in full for j in (2, 3)
                 if len(r[j]) == 4]) for i in range(4)]
  group = sum(side_w) + 2 * 3

  def cells(c):
    if len(c) == 1:
      return c[0].ljust(group)
    return '  '.join(x.ljust(w) for x, w in zip(c, side_w))

  print(f'  {"":{label_w[0]}}  {"":{label_w[1]}}  {"YAX":{group}}  | Qwix')
  for kind, fmt, y, q in full:
    print(f'  {kind:{label_w[0]}}  {fmt:{label_w[1]}}  {cells(y)}  | '
          f'{cells(q)}'.rstrip())


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--small', action='store_true',
                      help='tiny configs (about a minute)')
  parser.add_argument('--models', default=','.join(CASES),
                      help=f'comma-separated subset of {",".join(CASES)}')
  parser.add_argument('--formats', default=','.join(FORMATS),
                      help=f'comma-separated subset of {",".join(FORMATS)}')
  parser.add_argument('--rounds', type=int, default=None,
                      help='timing rounds (default 5, 3 small)')
  parser.add_argument('--verbose', action='store_true',
                      help='print the tracebacks of failures')
  args = parser.parse_args(argv)
  rounds = args.rounds or (3 if args.small else 5)
  per_round = 10 if args.small else 2
  formats = args.formats.split(',')

  import flax
  import qwix
  import transformers
  transformers.logging.set_verbosity_error()
  print(f'jax {jax.__version__}, flax {flax.__version__}, qwix '
        f'{getattr(qwix, "__version__", "?")}, transformers '
        f'{transformers.__version__}, yax {yax.__version__}; '
        f'{jax.devices()[0].device_kind} x{jax.device_count()}'
        f'{"; small configs" if args.small else ""}')
  print('per row: layers quantized, rel err = ||y_q - y|| / ||y|| of the '
        'output, MB = all params after, ms = jitted forward (median)')
  t_all = time.perf_counter()
  reasons = []
  for key in args.models.split(','):
    t0 = time.perf_counter()
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')  # transformers' and Flax's notices
      case = CASES[key](args)
      out, inputs, params = case['out'], case['inputs'], case['params']
      ref_fwd = compiled(lambda p, *a: out(case['fn'](p, *a)), params,
                         *inputs)
      case['reference'] = jnp.asarray(ref_fwd(params, *inputs), jnp.float32)
      case['mox'] = yax.make_mox(case['fn'])(params, *inputs)
      (float_s,) = time_interleaved([(ref_fwd, (params, *inputs))], rounds,
                                    per_round)
      print(f'\n== {case["name"]}')
      print(f'  float32: {tree_bytes(params) / 1e6:.3g} MB of params, '
            f'forward {1e3 * float_s:.3g} ms')
      rows, notes = [], []
      for kind, xpath, regex, kind_formats, *tile in case['kinds']:
        tile = tile[0] if tile else None
        for fmt in [f for f in kind_formats if f in formats]:
          y = run_yax(case, xpath, fmt, tile, args)
          q = run_qwix(case, regex, fmt, tile, args)
          ty, tq = time_interleaved([y.step, q.step], rounds, per_round)
          y.step_s, q.step_s = ty, tq
          y.step = q.step = None  # free the executables
          rows.append((kind, fmt, fmt_side(y), fmt_side(q)))
          for who, s in (('YAX', y), ('Qwix', q)):
            if s.error:
              reasons.append((f'{who} {s.error}',
                              f'{key} {kind} {fmt}: {who} {s.reason}'))
            elif s.layers == 0:
              notes.append(f'{kind} {fmt}: {who} quantized no layer; nothing '
                           'raised, its params are the float ones')
      print_table(rows)
      for kind, xpath, regex, *_ in case['kinds']:
        print(f'  {kind}: YAX {xpath}; Qwix module_path {regex!r}')
      for n in notes:
        print(f'  note: {n}')
      if 'cast' in case:
        run_cast(case, rounds, per_round, args)
    print(f'  ({time.perf_counter() - t0:.0f} s for this model)')
    sys.stdout.flush()
  if reasons:
    print('\n== failures, longer')
    seen = set()
    for short, long in reasons:  # the first row of each distinct failure
      if short not in seen:
        seen.add(short)
        print(f'  {long}')
  print(f'\n(total {time.perf_counter() - t_all:.0f} s)')


if __name__ == '__main__':
  main()
