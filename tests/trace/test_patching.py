"""trace/patching.py: the class patch NNX and Equinox share."""

from __future__ import annotations

import pytest

from yax._src.trace import patching


class _Base:
  pass


def _wrap(fn, name):
  def method(self, *args):
    return ('wrapped', name, fn(self, *args))
  method._yax_original = fn
  return method


def _classes():
  return patching.subclasses(_Base)


def _names(cls):
  return [n for n in ('__call__', 'helper') if n in vars(cls)]


def test_nested_uses_share_one_patch_and_the_last_restores():
  class A(_Base):
    def __call__(self, x):
      return x + 1

  class B(A):
    def helper(self):
      return 'h'

  original_call, original_helper = A.__call__, B.helper
  patch = patching.ClassPatch(_classes, _names, _wrap)
  with patch.applied():
    assert A()(1) == ('wrapped', '__call__', 2)
    with patch.applied():
      assert B().helper() == ('wrapped', 'helper', 'h')
    # The inner use left; the outer one still holds the patch.
    assert A()(1) == ('wrapped', '__call__', 2)
  assert A.__call__ is original_call and B.helper is original_helper
  assert A()(1) == 2


def test_a_failing_patch_restores_what_it_patched():
  class C(_Base):
    def __call__(self):
      return 'c'

  def bad_wrap(fn, name):
    raise RuntimeError('cannot wrap')

  original = C.__call__
  patch = patching.ClassPatch(_classes, _names, bad_wrap)
  with pytest.raises(RuntimeError, match='cannot wrap'):
    with patch.applied():
      pass
  assert C.__call__ is original
  # The count went back to zero: a later working patch applies and leaves.
  good = patching.ClassPatch(_classes, _names, _wrap)
  with good.applied():
    assert C()() == ('wrapped', '__call__', 'c')
  assert C()() == 'c'
