"""Shared test helpers: tree comparison and tree walking."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from yax._src.ir.nodes import iter_nodes


def assert_trees_close(a, b, *, rtol=1e-5, atol=1e-5):
  """Same pytree structure and leaves equal to float tolerance."""
  ta, tb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
  assert ta == tb, f'tree structures differ:\n  {ta}\n  {tb}'
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape, (x.shape, y.shape)
    assert x.dtype == y.dtype, (x.dtype, y.dtype)
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@jax.tree_util.register_pytree_node_class
class Picky:
  """A pytree node whose unflatten accepts arrays only (placeholder leaves
  make it raise TypeError)."""

  def __init__(self, w):
    if not hasattr(w, 'shape'):
      raise TypeError('Picky holds arrays')
    self.w = w

  def tree_flatten(self):
    return (self.w,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children)


def modules(mox, type_name=None):
  """Module calls (non-ephemeral ``Mox`` nodes) anywhere in the tree,
  including bodies of lifted transforms (``Equation.children``)."""
  return [n for n in iter_nodes(mox) if isinstance(n, yax.Mox)
          and not n.is_ephemeral
          and (type_name is None or n.type_name == type_name)]


def equations(mox, *, prim=None, name=None):
  """Equations anywhere in the tree, by primitive name and/or display name."""
  return [n for n in iter_nodes(mox) if isinstance(n, yax.Equation)
          and (prim is None or n.prim.name == prim)
          and (name is None or n.name == name)]


def flops(compiled) -> float:
  """FLOPs from ``cost_analysis()``: a dict, or a list of dicts on some
  versions."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get('flops', 0.0))


def is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def jit_call(fn, *args, **kwargs):
  """Calls ``jax.jit(fn)`` with array leaves as traced arguments and every
  other leaf (bools, strings, ``None``) closed over as a static value."""
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  dyn = [i for i, x in enumerate(leaves) if is_array(x)]

  def flat(*vals):
    full = list(leaves)
    for i, v in zip(dyn, vals):
      full[i] = v
    a, k = jax.tree_util.tree_unflatten(tree, full)
    return fn(*a, **k)

  return jax.jit(flat)(*[leaves[i] for i in dyn])


def jit_eval(mox):
  """``jax.jit`` of ``eval_mox`` for this tree (non-array leaves static)."""
  return lambda *a, **k: jit_call(
      lambda *a, **k: yax.eval_mox(mox, *a, **k), *a, **k)


def check_rewrite(mox):
  """``yax.check_mox`` (scopes and types) on a tree a rewrite produced.

  Every test that rewrites a tree calls this on the result."""
  yax.check_mox(mox)
  return mox


@contextlib.contextmanager
def tensorflow_placeholder():
  """``gemma.gm.nn`` imports ``kauldron.typing``, whose ``array_types`` module
  runs ``import tensorflow as tf`` only to name ``tf.Tensor`` in a few
  type aliases (``TfArray``, ``TfFloat``, ...) that the Gemma model code does
  not use. Installing TensorFlow (hundreds of MB) for that is not worth it:
  while gemma is imported, ``tensorflow`` is a module holding a placeholder
  ``Tensor`` class, removed again afterwards so that no other library (etils,
  jaxtyping, transformers) sees a fake TensorFlow. A real TensorFlow, when
  installed, is used as is."""
  if 'tensorflow' in sys.modules or importlib.util.find_spec('tensorflow'):
    yield
    return
  stub = types.ModuleType('tensorflow')
  stub.__doc__ = 'placeholder for kauldron.typing (tests/helpers.py)'
  stub.Tensor = type('Tensor', (), {})
  sys.modules['tensorflow'] = stub
  try:
    yield
  finally:
    if sys.modules.get('tensorflow') is stub:
      del sys.modules['tensorflow']


def random_variables(model, seed, *args, **kwargs):
  """Variables with the shapes ``model.init`` gives, filled with random
  normals (std 0.2): faster than compiling the initializers, and no weight
  is zero (Gemma's RMSNorm scales start at zero)."""
  shapes = jax.eval_shape(model.init, jax.random.key(0), *args, **kwargs)
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: jnp.asarray(rng.normal(0.0, 0.2, s.shape).astype(s.dtype)),
      shapes)


def run_on_host_devices(script: str, tmp_path, done: str, devices: int = 8):
  """Runs ``script`` in a fresh Python with ``devices`` host CPU devices
  (the count is fixed when JAX starts) and ``tests/`` importable; asserts
  it exits cleanly and prints ``done``. Returns its stdout."""
  import os
  import pathlib
  import subprocess
  root = pathlib.Path(__file__).resolve().parent.parent
  path = tmp_path / 'on_host_devices.py'
  path.write_text(script)
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      f' --xla_force_host_platform_device_count={devices}'
                      ).strip()
  env['PYTHONPATH'] = os.pathsep.join(
      [str(root), str(root / 'tests')] +
      [str(p) for p in sorted((root / 'tests').iterdir())
       if p.is_dir() and not p.name.startswith(('_', '.'))] +
      ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  proc = subprocess.run([sys.executable, str(path)], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  assert done in proc.stdout
  return proc.stdout


def saved_residuals(fn, *args) -> list[str]:
  """The types of what JAX keeps for the backward pass of ``fn`` (JAX's
  own ``print_saved_residuals``), sorted; the arguments and literals
  excluded, as they take no memory of their own."""
  import io

  import jax.ad_checkpoint
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
  return sorted(line.split(' ')[0] for line in buf.getvalue().splitlines()
                if line and ' from the argument ' not in line
                and ' from a literal' not in line)


def import_required(package: str, what: str, env: str, install: str, load):
  """``load()`` (the imports of a test module's third-party model code)
  where ``package`` is installed. Where it is not, or its import fails, the
  test module is skipped with the reason, unless the environment variable
  ``env`` is set (CI sets it where the package is installed: a silent skip
  there is a defect), which makes it fail."""
  required = os.environ.get(env, '').strip().lower() not in (
      '', '0', 'false', 'no')
  if importlib.util.find_spec(package) is None:
    msg = f'{what} is not installed (run: {install})'
    if required:
      pytest.fail(f'{msg}; {env} is set', pytrace=False)
    pytest.skip(msg, allow_module_level=True)
  try:
    return load()
  except ImportError as e:
    if required:  # a failure, with its traceback
      raise
    pytest.skip(f'{what} does not import ({e}); run: {install}',
                allow_module_level=True)


def trained_adapters(params, mask, seed: int = 2):
  """``params`` with every adapter weight (where ``mask`` is true)
  perturbed by normals of std 0.3, as if trained (``lora_b`` is zero at
  init); the other weights unchanged."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda v, is_adapter: v + jnp.asarray(
          rng.normal(0.0, 0.3, np.shape(v)), v.dtype) if is_adapter else v,
      params, mask)


def module_calls_per_view(mox) -> dict[str, list]:
  """The module calls each view of ``mox`` shows, per view, as sorted lists.

  SPEC "Every view sees the same module calls". Each view is read through
  its own public output, not through YAX's tree: ``map_mox`` (every
  ``Mox`` it yields), the XML text (``dump_xml``), ``to_json``, the YSON
  text (``dump_yson``), ``query('//module_call')``, the HTML viewer's
  embedded XML, as ``(path, type, ephemeral)`` triples; and, for the views
  that show module calls by path (one row or group per module), the
  ``(path, type)`` pairs of the non-ephemeral calls: the summary's rows
  (helper methods are folded into their module's row), the HTML viewer's
  ``totals['module_calls']`` count, and Model Explorer's group namespaces
  (one per path, the root's ``''`` left out).
  """
  import io
  import json

  import yt.yson
  from lxml import etree

  from yax._src.report import html as _html

  def from_elements(elements):
    return sorted((e.get('path', ''), e.get('type', ''), e.get('ephemeral'))
                  for e in elements)

  def from_xml_text(text):
    root = etree.fromstring(text.encode() if isinstance(text, str) else text)
    return from_elements(root.iter('module_call'))

  def json_calls(d, out):
    if d['tag'] == 'module_call':
      a = d['attrs']
      out.append((a.get('path', ''), a.get('type', ''), a.get('ephemeral')))
    for child in d.get('children', ()):
      json_calls(child, out)
    return out

  def yson_calls(node, out):
    if isinstance(node, list):
      a = node.attributes
      if a.get('primitive') == 'module_call':
        out.append((a.get('path', ''), a.get('type', ''), a.get('ephemeral')))
      for child in node:
        yson_calls(child, out)
    return out

  def mox_triple(n):
    return ('/'.join(map(str, n.path)), n.type_name or '',
            'true' if n.is_ephemeral else 'false')

  buf = io.StringIO()
  yax.dump_xml(mox, buf)
  ybuf = io.BytesIO()
  yax.dump_yson(mox, ybuf)
  payload = _html.payload(mox)
  views = {
      'map_mox': sorted(mox_triple(n) for n in yax.map_mox(lambda n: n, mox)
                        if isinstance(n, yax.Mox)),
      'xml': from_xml_text(buf.getvalue()),
      'json': sorted(json_calls(json.loads(yax.to_json(mox)), [])),
      'yson': sorted(yson_calls(yt.yson.loads(ybuf.getvalue()), [])),
      'query': sorted(mox_triple(n)
                      for n in yax.query('//module_call', mox)),
      'html': from_xml_text(payload['xml']),
  }
  calls = [t for t in views['map_mox'] if t[2] == 'false']
  views['map_mox calls'] = sorted({t[:2] for t in calls})
  views['summary'] = sorted({(r.path, r.module) for r in yax.summary(mox)
                             if r.module})
  views['map_mox count'] = [len(calls)]
  views['html count'] = [payload['totals']['module_calls']]
  graph = yax.to_model_explorer(mox)
  views['map_mox paths'] = sorted({t[0] for t in calls if t[0]})
  views['explorer'] = sorted(k for k in graph.groupNodeAttributes if k)
  return views


def assert_views_agree(mox) -> int:
  """Asserts that every view of ``mox`` shows the same module calls (see
  :func:`module_calls_per_view`); returns how many module calls (not
  ephemeral) there are."""
  v = module_calls_per_view(mox)
  for name in ('xml', 'json', 'yson', 'query', 'html'):
    assert v[name] == v['map_mox'], (name, _difference(v[name], v['map_mox']))
  assert v['summary'] == v['map_mox calls'], _difference(
      v['summary'], v['map_mox calls'])
  assert v['html count'] == v['map_mox count']
  assert v['explorer'] == v['map_mox paths'], _difference(
      v['explorer'], v['map_mox paths'])
  return v['map_mox count'][0]


def _difference(a, b) -> str:
  import collections
  ca, cb = collections.Counter(a), collections.Counter(b)
  return f'only in the view: {ca - cb}; only in map_mox: {cb - ca}'
