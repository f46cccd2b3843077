"""The ``yax`` command compared with the Python API on the same model.

Most tests call the command's entry function, ``yax._src.cli.main.main(args)``, in
this process (with its own stdout/stderr and working directory): the same
code path as the console script minus interpreter start-up and imports,
which cost seconds per call. A few smoke tests (marked below) still run
``python -m yax`` and the ``yax`` console script as real processes.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import gzip
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import yax
from yax._src.cli import bundled as _bundled
from yax._src.cli import main as _main
from yax._src.report import summary as _summary


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


def lora_factory():
  import yax
  model = MLP()
  x = jnp.ones((2, 4))
  variables = model.init(jax.random.key(0), x)
  mox = yax.make_mox(model.apply)(variables, x)
  return yax.lora(mox, variables, '//module_call[@name="out"]', rank=2).mox


def mean_loss(outputs):
  return jnp.mean(outputs)


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


@dataclasses.dataclass
class Result:
  returncode: int
  stdout: bytes
  stderr: bytes


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch):
  """``yax summary`` fits its table to ``COLUMNS`` when set: commands run
  in this process see no ``COLUMNS`` from the environment the tests were
  started in (tests that want one set it)."""
  monkeypatch.delenv('COLUMNS', raising=False)


def run_yax(*args, cwd, exe=None, check=True, subprocess_run=False):
  """Runs ``yax ARGS`` in ``cwd``: in this process through ``_main.main``,
  or, with ``subprocess_run`` (or ``exe``), as ``python -m yax`` (or the
  given executable)."""
  args = [str(a) for a in args]
  if subprocess_run or exe:
    cmd = [exe] if exe else [sys.executable, '-m', 'yax']
    proc = subprocess.run([*cmd, *args], cwd=cwd, env=_env(),
                          capture_output=True, timeout=600)
    result = Result(proc.returncode, proc.stdout, proc.stderr)
  else:
    result = _run_in_process(args, cwd)
  if check and result.returncode != 0:
    raise AssertionError(f'yax {args} exited {result.returncode}:\n'
                         f'{result.stderr.decode()}')
  return result


def _run_in_process(args, cwd) -> Result:
  out = io.TextIOWrapper(io.BytesIO(), encoding='utf-8', write_through=True)
  err = io.TextIOWrapper(io.BytesIO(), encoding='utf-8', write_through=True)
  saved_path = list(sys.path)
  # A file model is imported under its stem unless that name is taken: drop
  # what an earlier run imported, as a fresh process would not have it.
  for name in ('yax_cli_model', 'broken'):
    sys.modules.pop(name, None)
  with contextlib.chdir(cwd), contextlib.redirect_stdout(out), \
      contextlib.redirect_stderr(err):
    try:
      status = _main.main(args)
    finally:
      sys.path[:] = saved_path
  return Result(status, out.buffer.getvalue(), err.buffer.getvalue())


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


def test_smoke_python_m_yax_process(workdir, model):
  """A real `python -m yax` process: output, an error and no-match status."""
  mox, _ = model
  out = run_yax('show', 'yax_cli_model.py:factory', cwd=workdir,
                subprocess_run=True).stdout.decode()
  assert out == str(mox) + '\n'
  # A failing run: nothing on stdout, one line on stderr, status 1 (the
  # message texts are checked in-process by test_error_is_one_line_...).
  none = run_yax('query', '//conv_general_dilated', 'yax_cli_model.py',
                 cwd=workdir, check=False, subprocess_run=True)
  assert (none.returncode, none.stdout) == (1, b'')
  assert none.stderr.decode() == 'yax: no match for //conv_general_dilated\n'


def test_show_accepts_module_name_and_default_factory(workdir, model):
  mox, _ = model
  out = run_yax('show', 'yax_cli_model', cwd=workdir).stdout.decode()
  assert out == str(mox) + '\n'


def test_factory_with_kwargs(workdir):
  fn_out = run_yax('query', '--count', '//module_call[@type="Dense"]',
                   'yax_cli_model:kw_factory', cwd=workdir).stdout.decode()
  assert fn_out.strip() == '2'


def _table_rows(out: str) -> dict[str, list[str]]:
  """{path: first-line cells} of a summary table."""
  rows = {}
  for line in out.splitlines():
    cells = [c.strip() for c in line.split('│')[1:-1]]
    if cells and cells[0] and cells[0] != 'path':
      rows[cells[0]] = cells
  return rows


def test_summary_table(workdir, model):
  mox, variables = model
  out = run_yax('summary', 'yax_cli_model.py:factory', cwd=workdir).stdout.decode()
  total = _param_count(variables)
  assert f'Total params: {total:,}' in out
  assert all(line == line.rstrip() for line in out.splitlines())
  rows = _table_rows(out)
  assert set(rows) == {'hidden', 'out', '(top)'}
  # Columns: path, module, inputs, outputs, variables, own params, params,
  # FLOPs. hidden: Dense(4 -> 5) on a (2, 4) input.
  hidden = variables['params']['hidden']
  n_hidden = hidden['kernel'].size + hidden['bias'].size
  assert rows['hidden'][1:5] == ['Dense', 'inputs: f32[2,4]', 'f32[2,5]',
                                 'bias: f32[5]']
  assert rows['hidden'][5:7] == [f'{n_hidden}', f'{n_hidden}']
  # The matmul and the bias add.
  assert rows['hidden'][7] == f'{2 * 2 * 4 * 5 + 2 * 5}'
  assert rows['(top)'][1:3] == ['MLP', 'x: f32[2,4]']
  assert rows['(top)'][5:7] == ['', f'{total:,}']


def _factory_module(workdir):
  spec = importlib.util.spec_from_file_location(
      'yax_cli_model_by_hand', workdir / 'yax_cli_model.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_summary_memory_column_is_memory_reports(workdir, model):
  """``--memory``: the bytes of yax.memory_report of the step written by
  hand (plain Flax, the sum of squares of the outputs); ``--loss``: of
  that loss instead."""
  import jax.numpy as jnp
  _, variables = model
  module = _factory_module(workdir)
  x = jnp.ones((2, 4))
  apply = module.MLP().apply
  for flags, loss in [
      (['--memory'], lambda v, x: jnp.sum(jnp.square(apply(v, x)))),
      (['--loss', 'yax_cli_model:mean_loss'],
       lambda v, x: jnp.mean(apply(v, x)))]:
    report = yax.memory_report(loss, variables, x, xla=False)
    out = run_yax('summary', *flags, 'yax_cli_model.py:factory',
                  cwd=workdir).stdout.decode()
    rows = _table_rows(out)
    # Columns: path, module, inputs, outputs, variables, own params,
    # params, saved, FLOPs.
    (head,) = [line for line in out.splitlines() if '│ path' in line]
    assert head.split('│')[8].strip() == 'saved'
    kept = report.by_path()
    assert {p: rows[p][7] for p in rows} == {
        p: f'{kept[q]:,}' if kept[q] else ''
        for p, q in [('(top)', '<MLP>'), ('hidden', 'hidden'),
                     ('out', 'out')]}
    assert (f'Saved for the backward pass: {report.total:,} bytes '
            f'({report.unattributed:,} outside module calls)') in out
  assert kept['<MLP>'] > 0  # the ReLU's
  # The square keeps the outputs, the mean nothing.
  assert report.unattributed == 0
  plain = run_yax('summary', 'yax_cli_model.py:factory', cwd=workdir)
  assert 'saved' not in plain.stdout.decode()


def test_html_memory_embeds_memory_reports(workdir, model):
  import jax.numpy as jnp
  _, variables = model
  module = _factory_module(workdir)
  x = jnp.ones((2, 4))
  apply = module.MLP().apply
  report = yax.memory_report(lambda v, x: jnp.sum(jnp.square(apply(v, x))),
                             variables, x, xla=False)
  run_yax('html', '--memory', '--no-compress', '-o', 'memory.html',
          'yax_cli_model.py:factory', cwd=workdir)
  page = (workdir / 'memory.html').read_text()
  (body,) = re.findall(r'<script id="yax-data"[^>]*>(.*?)</script>', page,
                       re.S)
  data = json.loads(body)
  assert data['memory']['saved'] == report.total
  assert sorted(s for s in data['saved'] if s is not None) == sorted(
      report.by_path().values())


def test_memory_refusals(workdir):
  mox_factory = run_yax('summary', '--memory',
                        'yax_cli_model.py:lora_factory', cwd=workdir,
                        check=False)
  assert mox_factory.returncode == 2
  assert 'returned a yax.Mox, with no arguments' in \
      mox_factory.stderr.decode()
  bad_loss = run_yax('summary', '--loss', 'yax_cli_model', 'yax_cli_model.py',
                     cwd=workdir, check=False)
  assert bad_loss.returncode == 2
  assert "--loss 'yax_cli_model': expected module:fn" in \
      bad_loss.stderr.decode()


@pytest.mark.parametrize('columns', ['100', '120'])
def test_summary_piped_fits_columns_as_shutil_reads_it(workdir, monkeypatch,
                                                       columns):
  monkeypatch.setenv('COLUMNS', columns)
  assert shutil.get_terminal_size().columns == int(columns)  # shutil's rule
  out = run_yax('summary', 'yax._src.cli.bundled:factory', cwd=workdir).stdout.decode()
  lines = out.splitlines()
  assert max(len(line) for line in lines) <= int(columns)
  assert all(line == line.rstrip() for line in lines)
  # Without COLUMNS, piped output is as wide as the table needs (wider
  # than 120 for this model), still without trailing spaces.
  monkeypatch.delenv('COLUMNS')
  wide = run_yax('summary', 'yax._src.cli.bundled:factory', cwd=workdir).stdout.decode()
  assert max(len(line) for line in wide.splitlines()) > 120
  assert all(line == line.rstrip() for line in wide.splitlines())
  # An explicit --width wins over COLUMNS.
  monkeypatch.setenv('COLUMNS', columns)
  narrow = run_yax('summary', '--width', '140', 'yax._src.cli.bundled:factory',
                   cwd=workdir).stdout.decode()
  assert max(len(line) for line in narrow.splitlines()) > int(columns)


def test_summary_depth_and_xla_flops(workdir, model):
  mox, _ = model
  out = run_yax('summary', '--depth', '0', '--xla-flops', 'yax_cli_model.py',
                cwd=workdir).stdout.decode()
  assert 'MLP' in out
  assert 'hidden' not in out  # nested one level below the top module
  m = re.search(r'XLA cost analysis \(compiled, whole model\): ([\d,]+) FLOPs',
                out)
  assert m is not None, out
  closed = yax.to_jaxpr(mox)
  specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
           for v in closed.jaxpr.invars]
  compiled = jax.jit(jax.extend.core.jaxpr_as_fun(closed)).lower(*specs).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  want = cost['flops'] + cost.get('transcendentals', 0)
  assert int(m.group(1).replace(',', '')) == round(want)


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


def test_factory_may_return_a_rewritten_mox(workdir):
  """Before, a factory returning a Mox was refused ("returned a Mox,
  expected a tuple"), and wrapping it in eval_mox showed 0 module calls."""
  out = run_yax('summary', 'yax_cli_model.py:lora_factory',
                cwd=workdir).stdout.decode()
  rows = _table_rows(out)
  assert set(rows) == {'hidden', 'out', '(top)'}
  assert rows['(top)'][1] == 'MLP'  # it keeps its type
  assert '3 module calls' not in out and '4 module calls' in out  # + LoRA
  # out: Dense(5 -> 3) in the LoRA call with its adapters (5 x 2, 2 x 3).
  lora_row = next(line for line in out.splitlines() if '│ LoRA' in line)
  cells = [c.strip() for c in lora_row.split('│')]
  assert cells[1:3] == ['out', 'LoRA']
  # Own params (the adapters), then all it reads (with the Dense's).
  own, total = f'{5 * 2 + 2 * 3}', f'{5 * 3 + 3 + 5 * 2 + 2 * 3}'
  assert own in cells and total in cells
  assert cells.index(own) < cells.index(total)
  found = run_yax('query', '//module_call[@type="LoRA"]/@path',
                  'yax_cli_model.py:lora_factory', cwd=workdir).stdout
  assert found.decode().split() == ['out']


def test_html_writes_a_default_file_named_after_the_model(workdir):
  """Before, -o was required."""
  proc = run_yax('html', 'yax_cli_model.py', cwd=workdir)
  assert proc.stderr.decode().startswith('wrote yax_cli_model.html (')
  assert (workdir / 'yax_cli_model.html').read_text().startswith('<!doctype html>')
  assert _main.default_html_name('pkg.mod:build') == 'mod_build.html'
  assert _main.default_html_name('yax._src.cli.bundled:factory') == \
      'bundled.html'


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
  assert 'Transformer' in out and 'yax._src.cli.bundled:factory' in out
  assert f'Total params: {_param_count(args[0]):,}' in out
  assert f'FLOPs: {_summary.flops(mox):,} ' in out


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
  # The help describes the output that test_query_prints_path_and_type and
  # test_equation_matches_name_their_module check.
  assert 'PATH  TYPE[.method]  OUTPUT-TYPES' in out
  assert 'PATH  PRIMITIVE[name=NAME]  OUTPUT-TYPES' in out
  assert 'NAME:TYPE' in out and 'exits with' in out
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
    (['show', '--no-such-option'], 2, r"No such option:? '?--no-such-option"),
    (['no-such-command'], 2, r"No such command 'no-such-command'"),
    (['summary', '--depth', '-1'], 2, r"Invalid value for '--depth'"),
    (['xml', '-o', 'no/such/dir/out.xml', 'yax_cli_model.py'], 1,
     r'cannot write no/such/dir/out.xml: No such file or directory'),
]


@pytest.fixture(scope='module')
def error_runs(workdir):
  """Runs every error case once."""
  return {tuple(args): run_yax(*args, cwd=workdir, check=False)
          for args, _, _ in ERRORS}


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
  rows = {r.path: r for r in yax.summary(mox)}
  for name in ('hidden', 'out'):
    assert rows[name].params == _param_count({'params': variables['params'][name]})
  assert rows[''].params == _param_count(variables)


def test_query_without_match_exits_1(workdir):
  res = run_yax('query', '//module_call[@type="Conv"]', 'yax_cli_model.py',
                cwd=workdir, check=False)
  assert (res.returncode, res.stdout) == (1, b'')
  assert res.stderr.decode() == 'yax: no match for //module_call[@type="Conv"]\n'
  res = run_yax('query', '--count', '//conv_general_dilated', 'yax_cli_model.py',
                cwd=workdir, check=False)
  assert (res.returncode, res.stdout) == (1, b'0\n')
  # A match exits 0; an XPath value (a number) is a match.
  assert run_yax('query', 'count(//conv_general_dilated)', 'yax_cli_model.py',
                 cwd=workdir).stdout == b'0\n'


class FakeTerminal(io.StringIO):
  def __init__(self, tty):
    super().__init__()
    self.tty = tty

  def isatty(self):
    return self.tty


def test_progress_only_on_a_terminal_and_only_when_slow():
  import time
  for tty, delay, shown in [(True, 0.0, True), (True, 60.0, False),
                            (False, 0.0, False)]:
    stream = FakeTerminal(tty)
    with _main.progress('tracing m.py', stream=stream, delay=delay):
      time.sleep(0.3)
    text = stream.getvalue()
    assert ('yax: tracing m.py...' in text) == shown, (tty, delay, text)
    if shown:  # the line is erased at the end
      assert text.endswith('\r\x1b[K')
    else:
      assert text == ''


def test_factory_spec_parsing():
  assert _main._parse_spec('pkg.mod:make') == ('pkg.mod', 'make')
  assert _main._parse_spec('dir/file.py') == ('dir/file.py', 'factory')
  assert _main._parse_spec('C:model.py') == ('C:model.py', 'factory')
  assert _main._parse_spec('file.py:Cls.build') == ('file.py', 'Cls.build')
  with pytest.raises(_main._Usage, match='not a Python identifier'):
    _main._parse_spec('file.py:a-b')


def test_summary_dtypes_column(workdir):
  plain = run_yax('summary', 'yax._src.cli.bundled:factory', cwd=workdir).stdout.decode()
  assert ' dtype ' not in plain.splitlines()[1]
  out = run_yax('summary', '--dtypes', 'yax._src.cli.bundled:factory',
                cwd=workdir).stdout.decode()
  header = next(line for line in out.splitlines() if 'dtype' in line)
  assert 'path' in header and 'FLOPs' in header
  assert 'float32' in out
