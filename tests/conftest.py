"""Test configuration: CPU only, no PyTorch, fast hypothesis profile."""

import os

os.environ.setdefault('USE_TORCH', '0')
os.environ.setdefault('USE_FLAX', '1')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

try:
  import hypothesis
except ImportError:  # pragma: no cover - hypothesis is a test dependency
  pass
else:
  hypothesis.settings.register_profile(
      'yax', max_examples=25, deadline=None, derandomize=True, database=None,
      suppress_health_check=[hypothesis.HealthCheck.too_slow,
                             hypothesis.HealthCheck.data_too_large])
  hypothesis.settings.load_profile('yax')


import pytest  # noqa: E402


@pytest.fixture(scope='session')
def tiny_bert_mox():
  """A small FlaxBertModel (random weights, no download), traced HF-style."""
  import jax.numpy as jnp
  from transformers import BertConfig, FlaxBertModel

  import yax
  model = FlaxBertModel(BertConfig(
      vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=37, max_position_embeddings=64), seed=0)
  ids = jnp.ones((1, 8), jnp.int32)
  return yax.make_mox(lambda p, x: model(x, params=p))(model.params, ids)


@pytest.fixture(scope='session')
def tiny_resnet_mox():
  """A small FlaxResNetModel (random weights, no download), traced HF-style."""
  import jax.numpy as jnp
  from transformers import FlaxResNetModel, ResNetConfig

  import yax
  model = FlaxResNetModel(ResNetConfig(
      embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_channels=3),
      seed=0)
  images = jnp.ones((1, 3, 16, 16), jnp.float32)
  return yax.make_mox(lambda p, x: model(x, params=p))(model.params, images)


@pytest.fixture(autouse=True, scope='session')
def _check_every_rewrite():
  """Runs ``yax.check_mox`` (scopes and types) on every tree that
  ``yax.sub`` or ``yax.lora`` returns anywhere in the test suite (session
  scope: hypothesis tests accept no function-scoped fixtures)."""
  import yax

  sub, lora = yax.sub, yax.lora

  def checked_sub(*args, **kwargs):
    new = sub(*args, **kwargs)
    yax.check_mox(new)
    return new

  def checked_lora(*args, **kwargs):
    res = lora(*args, **kwargs)
    yax.check_mox(res.mox)
    return res

  yax.sub, yax.lora = checked_sub, checked_lora
  yield
  yax.sub, yax.lora = sub, lora
