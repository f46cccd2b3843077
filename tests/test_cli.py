"""The ``yax`` command, run as a real process (``python -m yax`` and the
``yax`` console script), compared with the Python API on the same model."""

from __future__ import annotations

import base64
import concurrent.futures
import gzip
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yax
from yax import _bundled, _cli, _summary

from helpers import flops as xla_cost_flops

MODEL_PY = '''
import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(5, name='hidden')(x))
    return nn.Dense(3, name='out')(h)


def factory():
  model = MLP()
  x = jnp.ones((2, 4))
  variables = model.init(jax.random.key(0), x)
  return model.apply, (variables, x), {}


def kw_factory():
  model = MLP()
  x = jnp.ones((2, 4))
  return model.apply, [model.init(jax.random.key(0), x)], {'x': x}


def raises():
  raise RuntimeError('boom in factory')


def two_tuple():
  return (lambda x: x, (jnp.ones(2),))


def not_a_tuple():
  return 42


def fn_not_callable():
  return (1, (), {})


def args_not_a_tuple():
  return (lambda x: x, 5, {})


def kwargs_not_a_dict():
  return (lambda x: x, (), [1])


def trace_fails():
  return (lambda x: x.no_such_attribute, (jnp.ones(2),), {})


not_callable = 3
'''

BROKEN_PY = 'import no_such_package_for_yax_tests\n'


def _env():
  env = dict(os.environ)
  env.update(JAX_PLATFORMS='cpu', TF_CPP_MIN_LOG_LEVEL='3', USE_TORCH='0',
             COLUMNS='200', PYTHONWARNINGS='ignore')
  env.pop('YAX_DEBUG', None)
  return env


def run_yax(*args, cwd, exe=None, check=True):
  """Runs ``python -m yax ARGS`` (or the given executable) in ``cwd``."""
  cmd = [exe] if exe else [sys.executable, '-m', 'yax']
  proc = subprocess.run([*cmd, *map(str, args)], cwd=cwd, env=_env(),
                        capture_output=True, timeout=600)
  if check and proc.returncode != 0:
    raise AssertionError(f'yax {args} exited {proc.returncode}:\n'
                         f'{proc.stderr.decode()}')
  return proc


def console_script():
  bindir = os.path.dirname(sys.executable)
  return shutil.which('yax', path=bindir + os.pathsep + os.environ.get('PATH', ''))


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  d = tmp_path_factory.mktemp('cli')
  (d / 'yax_cli_model.py').write_text(MODEL_PY)
  (d / 'broken.py').write_text(BROKEN_PY)
  return d


@pytest.fixture(scope='module')
def model(workdir):
  """The factory module imported in this process, and its traced tree."""
  # Imported under the name the command gives it (the file's stem), so the
  # classes' qualified names (fqn="yax_cli_model.MLP") match.
  spec = importlib.util.spec_from_file_location(
      'yax_cli_model', workdir / 'yax_cli_model.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  fn, args, kwargs = module.factory()
  mox = yax.make_mox(fn)(*args, **kwargs)
  return mox, args[0]


def _param_count(variables) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(
      variables['params']))


# -------------------------------------------------------------- commands

def test_show_prints_str_of_the_mox(workdir, model):
  mox, _ = model
  out = run_yax('show', 'yax_cli_model.py:factory', cwd=workdir).stdout.decode()
  assert out == str(mox) + '\n'


def test_show_accepts_module_name_and_default_factory(workdir, model):
  mox, _ = model
  out = run_yax('show', 'yax_cli_model', cwd=workdir).stdout.decode()
  assert out == str(mox) + '\n'


def test_factory_with_kwargs(workdir):
  fn_out = run_yax('query', '--count', '//module_call[@type="Dense"]',
                   'yax_cli_model:kw_factory', cwd=workdir).stdout.decode()
  assert fn_out.strip() == '2'


def test_summary_table(workdir, model):
  mox, variables = model
  out = run_yax('summary', 'yax_cli_model.py:factory', cwd=workdir).stdout.decode()
  total = _param_count(variables)
  assert f'Total params: {total:,}' in out
  lines = {line.split()[1]: line for line in out.splitlines()
           if re.match(r'^\W*(hidden|out|\(top\))\s', line)}
  assert set(lines) == {'hidden', 'out', '(top)'}
  # hidden: Dense(4 -> 5) on a (2, 4) input.
  hidden = variables['params']['hidden']
  n_hidden = hidden['kernel'].size + hidden['bias'].size
  assert 'Dense' in lines['hidden'] and 'f32[2,4]' in lines['hidden']
  assert 'f32[2,5]' in lines['hidden']
  assert f' {n_hidden} (' in lines['hidden']
  assert f' {2 * 2 * 4 * 5} ' in lines['hidden'] + ' '
  assert 'MLP' in lines['(top)'] and f' {total} (' in lines['(top)']


def test_summary_depth_and_xla_flops(workdir, model):
  mox, _ = model
  out = run_yax('summary', '--depth', '0', '--xla-flops', 'yax_cli_model.py',
                cwd=workdir).stdout.decode()
  assert 'MLP' in out
  assert 'hidden' not in out  # nested one level below the top module
  m = re.search(r'FLOPs \(XLA cost analysis, whole model\): ([\d,]+)', out)
  assert m is not None, out
  closed = yax.to_jaxpr(mox)
  specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
           for v in closed.jaxpr.invars]
  compiled = jax.jit(jax.extend.core.jaxpr_as_fun(closed)).lower(*specs).compile()
  assert int(m.group(1).replace(',', '')) == round(xla_cost_flops(compiled))


def test_xml_stdout_and_file(workdir, model):
  mox, _ = model
  want = io.StringIO()
  yax.dump_xml(mox, want)
  out = run_yax('xml', 'yax_cli_model.py:factory', cwd=workdir).stdout.decode()
  assert out == want.getvalue()
  run_yax('xml', '--indent', '0', '-o', 'out.xml', 'yax_cli_model.py:factory',
          cwd=workdir)
  want0 = io.StringIO()
  yax.dump_xml(mox, want0, indent=0)
  assert (workdir / 'out.xml').read_text() == want0.getvalue()


def test_json(workdir, model):
  mox, _ = model
  out = run_yax('json', 'yax_cli_model.py:factory', cwd=workdir).stdout.decode()
  assert out == mox.to_json() + '\n'
  assert json.loads(out) == mox.to_dict()
  run_yax('json', '--indent', '2', '-o', 'out.json', 'yax_cli_model.py:factory',
          cwd=workdir)
  assert (workdir / 'out.json').read_text() == mox.to_json(indent=2) + '\n'


def test_yson(workdir, model):
  pytest.importorskip('yt.yson', reason='the yson extra (ytsaurus-client) '
                      'is not installed')
  mox, _ = model
  want = io.BytesIO()
  yax.dump_yson(mox, want)
  out = run_yax('yson', 'yax_cli_model.py:factory', cwd=workdir).stdout
  assert out == want.getvalue()
  run_yax('yson', '-o', 'out.yson', 'yax_cli_model.py:factory', cwd=workdir)
  assert (workdir / 'out.yson').read_bytes() == want.getvalue()


def test_query_prints_path_and_type(workdir, model):
  mox, _ = model
  xpath = '//module_call[@type="Dense"]'
  out = run_yax('query', xpath, 'yax_cli_model.py:factory', cwd=workdir).stdout.decode()
  assert out.splitlines() == ['hidden  Dense  f32[2,5]', 'out  Dense  f32[2,3]']
  assert len(out.splitlines()) == len(yax.query(xpath, mox))


def test_query_count_and_values(workdir, model):
  mox, _ = model
  cases = {
      '//dot_general': None,
      '//module_call[@type="Dense"]/@features': ['5', '3'],
      'count(//module_call)': None,
      '//module_call[@name="out"]/output': None,
  }
  for xpath, expected in cases.items():
    got = run_yax('query', xpath, 'yax_cli_model.py:factory',
                  cwd=workdir).stdout.decode().splitlines()
    result = yax.query(xpath, mox)
    if expected is not None:
      assert got == expected
    if isinstance(result, list):
      assert len(got) == len(result), (xpath, got)
      count = run_yax('query', '--count', xpath, 'yax_cli_model.py:factory',
                      cwd=workdir).stdout.decode()
      assert count == f'{len(result)}\n'
    else:
      assert got == [str(int(result))], (xpath, got)
  # An output symbol prints as name:type, with its name in the XML.
  out = run_yax('query', '//module_call[@name="out"]/output',
                'yax_cli_model.py:factory', cwd=workdir).stdout.decode().strip()
  name = yax.query('string(//module_call[@name="out"]/output)', mox)
  assert out == f'{name}:f32[2,3]'


def test_equation_matches_name_their_module(workdir):
  out = run_yax('query', '//module_call[@name="hidden"]/dot_general',
                'yax_cli_model.py:factory', cwd=workdir).stdout.decode()
  assert out == 'hidden  dot_general  f32[2,5]\n'
  out = run_yax('query', '//*[@name="relu"]', 'yax_cli_model.py:factory',
                cwd=workdir).stdout.decode()
  assert out == '/  custom_jvp_call[name=relu]  f32[2,5]\n'


def test_html_writes_self_contained_viewer(workdir, model):
  mox, _ = model
  proc = run_yax('html', '-o', 'view.html', '--title', 'my model',
                 'yax_cli_model.py:factory', cwd=workdir)
  assert proc.stderr.decode().startswith('wrote view.html (')
  page = (workdir / 'view.html').read_text()
  assert '<title>my model &middot; yax</title>' in page
  assert not re.search(r'(src|href)\s*=', page), 'no external resources'
  assert 'http://' not in page and 'https://' not in page
  blob = re.search(r'data-encoding="gzip\+base64">([^<]*)</script>', page)
  data = json.loads(gzip.decompress(base64.b64decode(blob.group(1))))
  want = io.StringIO()
  yax.dump_xml(mox, want, indent=None)
  assert data['xml'] == want.getvalue()
  n_nodes = len(yax.query('//*[not(self::input or self::output)]', mox))
  assert len(data['texts']) == len(data['params']) == n_nodes
  assert data['texts'][0] == str(mox)
  assert data['totals']['params'] == _summary.total_params(mox)[0]


def test_html_no_compress_embeds_json(workdir, model):
  mox, _ = model
  run_yax('html', '--no-compress', '-o', 'plain.html', 'yax_cli_model.py:factory',
          cwd=workdir)
  page = (workdir / 'plain.html').read_text()
  blob = re.search(r'data-encoding="json">(.*?)</script>', page, re.S)
  data = json.loads(blob.group(1))
  assert data['texts'][0] == str(mox)


def test_bundled_model_without_argument(workdir):
  fn, args, kwargs = _bundled.factory()
  mox = yax.make_mox(fn)(*args, **kwargs)
  out = run_yax('summary', cwd=workdir).stdout.decode()
  assert 'Transformer' in out and 'yax._bundled:factory' in out
  assert f'Total params: {_param_count(args[0]):,}' in out
  dense = '//module_call[@type="Dense"]'
  count = run_yax('query', '--count', dense, cwd=workdir).stdout.decode()
  assert count == f'{len(yax.query(dense, mox))}\n'


def test_console_script(workdir, model):
  exe = console_script()
  if exe is None:
    pytest.skip('the yax console script is not on PATH (package not installed)')
  mox, _ = model
  out = run_yax('query', '--count', '//module_call', 'yax_cli_model.py:factory',
                cwd=workdir, exe=exe).stdout.decode()
  assert out == f'{len(yax.query("//module_call", mox))}\n'
  bad = run_yax('query', '//[', 'yax_cli_model.py', cwd=workdir, exe=exe, check=False)
  assert bad.returncode == 2
  assert bad.stderr.decode().startswith('yax: error: invalid XPath')


def test_help_and_version(workdir):
  out = run_yax(cwd=workdir).stdout.decode()
  assert 'Usage: yax' in out and 'summary' in out and 'MODEL is' in out
  out = run_yax('query', '--help', cwd=workdir).stdout.decode()
  assert 'XPATH' in out and '--count' in out
  out = run_yax('--version', cwd=workdir).stdout.decode()
  assert out.startswith('yax ')


# ------------------------------------------------------------------ errors

ERRORS = [
    # (arguments, exit status, pattern the one-line message must match)
    (['query', '//module_call[', 'yax_cli_model.py'], 2,
     r"invalid XPath expression at column 15: '//module_call\['"),
    (['query', '//module_call[@type=="Dense"]', 'yax_cli_model.py'], 2,
     r'invalid XPath'),
    (['show', 'no_such_module_for_yax:factory'], 2,
     r"no module named 'no_such_module_for_yax'"),
    (['show', 'missing.py:factory'], 2, r'model file not found: missing.py'),
    (['show', 'sub/missing.py'], 2, r'model file not found: sub/missing.py'),
    (['show', 'yax_cli_model.py:nope'], 2, r"yax_cli_model.py has no attribute 'nope'"),
    (['show', 'yax_cli_model:nope'], 2, r"yax_cli_model has no attribute 'nope'"),
    (['show', 'yax_cli_model.py:not_callable'], 2,
     r"'not_callable' is a int, expected a function"),
    (['show', 'yax_cli_model.py:'], 2, r'not of the form module:factory'),
    (['show', 'yax_cli_model.py:1x'], 2, r"factory name '1x' is not a Python identifier"),
    (['show', 'yax_cli_model.py:raises'], 1,
     r'factory yax_cli_model.py:raises raised RuntimeError: boom in factory'),
    (['show', 'yax_cli_model.py:two_tuple'], 1,
     r'returned a tuple of length 2, expected a tuple \(fn, args, kwargs\)'),
    (['show', 'yax_cli_model.py:not_a_tuple'], 1,
     r'returned a int, expected a tuple \(fn, args, kwargs\)'),
    (['show', 'yax_cli_model.py:fn_not_callable'], 1, r'returned fn=int that is not callable'),
    (['show', 'yax_cli_model.py:args_not_a_tuple'], 1, r'returned args of type int'),
    (['show', 'yax_cli_model.py:kwargs_not_a_dict'], 1, r'returned kwargs of type list'),
    (['show', 'yax_cli_model.py:trace_fails'], 1,
     r"tracing yax_cli_model.py:trace_fails failed: AttributeError: .*no_such_attribute"),
    (['show', 'broken.py'], 1,
     r"importing .*broken.py failed: ModuleNotFoundError: No module named "
     r"'no_such_package_for_yax_tests'"),
    (['show', 'broken:factory'], 1,
     r"importing module 'broken' failed: ModuleNotFoundError"),
    (['html', 'yax_cli_model.py'], 2, r"Missing option '-o' / '--output'"),
    (['show', '--no-such-option'], 2, r"No such option:? '?--no-such-option"),
    (['no-such-command'], 2, r"No such command 'no-such-command'"),
    (['summary', '--depth', '-1'], 2, r"Invalid value for '--depth'"),
    (['xml', '-o', 'no/such/dir/out.xml', 'yax_cli_model.py'], 1,
     r'cannot write no/such/dir/out.xml: No such file or directory'),
]


@pytest.fixture(scope='module')
def error_runs(workdir):
  """Runs every error case once, several processes at a time."""
  with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 1)) as pool:
    futures = {tuple(args): pool.submit(run_yax, *args, cwd=workdir, check=False)
               for args, _, _ in ERRORS}
    return {args: f.result() for args, f in futures.items()}


@pytest.mark.parametrize('args,status,pattern', ERRORS,
                         ids=[' '.join(a) for a, _, _ in ERRORS])
def test_error_is_one_line_and_exit_status(error_runs, args, status, pattern):
  proc = error_runs[tuple(args)]
  err = proc.stderr.decode()
  assert proc.returncode == status, err
  assert 'Traceback' not in err
  lines = err.splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith('yax: error: ')
  assert re.search(pattern, lines[0]), lines[0]
  assert proc.stdout == b''


def test_debug_shows_traceback(workdir):
  proc = run_yax('--debug', 'show', 'yax_cli_model.py:raises', cwd=workdir, check=False)
  err = proc.stderr.decode()
  assert proc.returncode == 1
  assert 'Traceback' in err and 'RuntimeError: boom in factory' in err
  assert err.splitlines()[-1].startswith('yax: error: factory yax_cli_model.py:raises')
  # --debug also works after the subcommand.
  proc = run_yax('show', '--debug', 'yax_cli_model.py:trace_fails', cwd=workdir,
                 check=False)
  assert proc.returncode == 1 and 'Traceback' in proc.stderr.decode()


# -------------------------------------------------- summary (in process)

def test_param_counts_match_flax(model):
  mox, variables = model
  assert _summary.total_params(mox)[0] == _param_count(variables)
  rows = {r.path: r for r in _summary.rows(mox)}
  for name in ('hidden', 'out'):
    assert rows[name].params == _param_count({'params': variables['params'][name]})
  assert rows[''].params == _param_count(variables)


def test_shared_module_params_counted_once():
  class Shared(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = nn.Dense(4)
      return dense(dense(x))
  m = Shared()
  x = jnp.ones((1, 4))
  variables = m.init(jax.random.key(0), x)
  mox = yax.make_mox(m.apply)(variables, x)
  assert len([r for r in _summary.rows(mox) if r.module == 'Dense']) == 2
  assert _summary.total_params(mox)[0] == _param_count(variables) == 20


def test_other_collections_reported_separately():
  m = nn.BatchNorm(use_running_average=True)
  x = jnp.ones((2, 3))
  variables = m.init(jax.random.key(0), x)
  mox = yax.make_mox(m.apply)(variables, x)
  (row,) = _summary.rows(mox)
  assert row.params == 6 and row.other_vars == {'batch_stats': 6}


def test_matmul_flops_match_xla():
  a, b = jnp.ones((4, 6)), jnp.ones((6, 7))
  mox = yax.make_mox(lambda a, b: a @ b)(a, b)
  compiled = jax.jit(lambda a, b: a @ b).lower(a, b).compile()
  assert _summary.flops(mox) == 2 * 4 * 6 * 7 == round(xla_cost_flops(compiled))


def test_conv_flops():
  x, w = jnp.ones((2, 3, 8, 8)), jnp.ones((5, 3, 3, 3))
  f = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), 'VALID')
  mox = yax.make_mox(f)(x, w)
  # Every output element is a 3*3*3 dot product (VALID: no padding).
  expected = 2 * (2 * 5 * 6 * 6) * (3 * 3 * 3)
  compiled = jax.jit(f).lower(x, w).compile()
  assert _summary.flops(mox) == expected == round(xla_cost_flops(compiled))


def test_flops_inside_scan_count_every_iteration():
  def f(c, xs):
    return jax.lax.scan(lambda c, x: (c @ x, None), c, xs)[0]
  c, xs = jnp.ones((2, 3)), jnp.ones((5, 3, 3))
  mox = yax.make_mox(f)(c, xs)
  assert _summary.flops(mox) == 5 * 2 * 2 * 3 * 3


def test_factory_spec_parsing():
  assert _cli._parse_spec('pkg.mod:make') == ('pkg.mod', 'make')
  assert _cli._parse_spec('dir/file.py') == ('dir/file.py', 'factory')
  assert _cli._parse_spec('C:model.py') == ('C:model.py', 'factory')
  assert _cli._parse_spec('file.py:Cls.build') == ('file.py', 'Cls.build')
  with pytest.raises(_cli._Usage, match='not a Python identifier'):
    _cli._parse_spec('file.py:a-b')
