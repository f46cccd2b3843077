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
