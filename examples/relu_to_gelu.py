"""Swap every ReLU of a Hugging Face Flax model for GELU, without its source.

The model is traced once; ``yax.sub`` replaces each ``relu`` (whatever module
it sits in) with the body of ``jax.nn.gelu``. A traced function is specialised
to its input shape, and the ReLUs of a ResNet see many shapes, so the
replacement is a callable that traces GELU for the shape of each node.

The result is checked against the same Hugging Face model built to use GELU
(the tanh approximation, ``jax.nn.gelu``'s default, which is HF's
``ACT2FN['gelu_new']``):

* BERT: ``BertConfig(hidden_act='gelu_new')``; every activation follows the
  config.
* ResNet: ``ResNetConfig.hidden_act`` does not reach every layer (the inner
  convolutions of a block hard-code ``"relu"``), so the reference runs the HF
  modules with ``ACT2FN['relu']`` pointing at GELU.

Models are built from configs (random weights, no download). Run::

    python examples/relu_to_gelu.py            # ResNet-50 and BERT-base
    python examples/relu_to_gelu.py --small    # tiny configs (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import time

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_FLAX', '1')

import jax
import jax.numpy as jnp
import numpy as np

import yax


@functools.lru_cache(maxsize=None)
def traced_gelu(shape, dtype):
  """``jax.nn.gelu`` traced for one input shape (cached per shape)."""
  return yax.make_mox(jax.nn.gelu)(jax.ShapeDtypeStruct(shape, dtype))


RELU = '//*[@name="relu"]'  # nn.relu: a custom_jvp_call named relu


def gelu_like(path, node):
  """The replacement for one ReLU: GELU traced for that node's input."""
  x = node.inputs[0].aval
  return traced_gelu(tuple(x.shape), x.dtype)


def relu_to_gelu(mox):
  """Returns (new tree, number of ReLUs replaced)."""
  return yax.sub(RELU, gelu_like, mox), len(yax.query(RELU, mox))


@contextlib.contextmanager
def hf_relu_is_gelu():
  """Makes HF Flax modules that look up ``ACT2FN['relu']`` get GELU."""
  from transformers import modeling_flax_utils
  table = modeling_flax_utils.ACT2FN
  saved = table['relu']
  table['relu'] = table['gelu_new']  # partial(nn.gelu, approximate=True)
  try:
    yield
  finally:
    table['relu'] = saved


def random_params(model, shape):
  """Random weights of the right shapes for an HF Flax model.

  Only the shapes come from HF (``jax.eval_shape`` of its init): its own
  random init compiles slowly on a CPU, and any weights serve to compare two
  models that share them.
  """
  init = lambda key: model.init_weights(key, shape)
  shapes = jax.eval_shape(init, jax.random.key(0))
  rng = np.random.default_rng(0)

  def fill(path, leaf):
    name = str(getattr(path[-1], 'key', path[-1]))
    if name in ('var', 'scale'):  # BatchNorm variance, norm scales
      return np.ones(leaf.shape, leaf.dtype)
    if name == 'mean':  # BatchNorm running mean
      return np.zeros(leaf.shape, leaf.dtype)
    fan_in = int(np.prod(leaf.shape[:-1])) if leaf.ndim > 1 else 100
    return (rng.standard_normal(leaf.shape) / np.sqrt(fan_in)).astype(
        leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def resnet(small: bool):
  from transformers import FlaxResNetModel, ResNetConfig
  if small:
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16],
                          depths=[1, 1, 1], layer_type='bottleneck')
    size = 32
  else:
    config = ResNetConfig()  # ResNet-50
    size = 224
  model = FlaxResNetModel(config, input_shape=(1, size, size, 3),
                          _do_init=False)
  pixels = jax.random.normal(jax.random.key(1), (1, 3, size, size))
  params = random_params(model, model.input_shape)  # NHWC

  def reference(params, pixels):
    with hf_relu_is_gelu():
      return model(pixels, params=params)

  return 'ResNet', model, params, pixels, reference


def bert(small: bool):
  from transformers import BertConfig, FlaxBertModel
  sizes = (dict(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=37,
                max_position_embeddings=64) if small else {})
  model = FlaxBertModel(BertConfig(hidden_act='relu', **sizes),
                        _do_init=False)
  seq = 16 if small else 128
  ids = jax.random.randint(jax.random.key(1), (1, seq), 0,
                           model.config.vocab_size)
  params = random_params(model, ids.shape)
  # The reference: the same weights in a BERT whose config asks for GELU.
  ref_model = FlaxBertModel(BertConfig(hidden_act='gelu_new', **sizes),
                            _do_init=False)

  def reference(params, ids):
    return ref_model(ids, params=params)

  return 'BERT', model, params, ids, reference


def run(build, small: bool) -> float:
  start = time.perf_counter()
  name, model, params, x, reference = build(small)
  mox = yax.make_mox(model)(x, params=params)
  new, n = relu_to_gelu(mox)
  left = len(yax.query(RELU, new))
  shapes = sorted({tuple(e.inputs[0].aval.shape)
                   for e in yax.query(RELU, mox)})
  print(f'{name}: replaced {n} ReLU with GELU ({left} left), '
        f'{len(shapes)} input shape(s): {shapes}')

  out = jax.jit(lambda p, x: yax.eval_mox(new, x, params=p))(params, x)
  ref = jax.jit(reference)(params, x)
  before = jax.jit(lambda p, x: model(x, params=p))(params, x)
  diff = float(jnp.abs(out.last_hidden_state - ref.last_hidden_state).max())
  moved = float(jnp.abs(out.last_hidden_state
                        - before.last_hidden_state).max())
  print(f'{name}: max abs difference vs HF with GELU: {diff:.2e} '
        f'(vs the original ReLU model: {moved:.2e}) '
        f'[{time.perf_counter() - start:.1f} s]')
  return diff


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', choices=['resnet', 'bert', 'both'],
                      default='both')
  parser.add_argument('--small', action='store_true',
                      help='tiny configs (for CI)')
  args = parser.parse_args(argv)
  builds = {'resnet': [resnet], 'bert': [bert], 'both': [resnet, bert]}
  diffs = [run(build, args.small) for build in builds[args.model]]
  return 0 if max(diffs) < 1e-4 else 1


if __name__ == '__main__':
  raise SystemExit(main())
