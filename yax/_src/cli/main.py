"""The ``yax`` command: trace a model, then print, export, query or view it.

Every subcommand takes an optional MODEL argument, a *factory*: a function
that returns ``(fn, args, kwargs)``; the command traces
``yax.make_mox(fn)(*args, **kwargs)``. A factory may also return a
``yax.Mox`` (a rewritten model: ``yax.lora(...).mox``), shown as it is.
MODEL is written ``module:factory``
(an importable module, looked up from the current directory first) or
``path/to/file.py:factory``; ``:factory`` may be left out when the function
is called ``factory``. Without MODEL the bundled example model
(``yax._src.cli.bundled:factory``, a small Transformer) is traced.

Errors print one line, ``yax: error: ...``, on stderr and exit with status
2 for usage errors (bad option or XPath, a MODEL that names no module, file
or factory) and 1 for everything else (the model's code failed, tracing
failed, an output file could not be written). ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import collections.abc
import contextlib
import importlib
import importlib.util
import os
import re
import sys
import threading
import time
import traceback
from typing import Any

import click

BUNDLED = 'yax._src.cli.bundled:factory'

_debug = False


class _Failure(click.ClickException):
  """A non-usage error (exit status 1)."""
  exit_code = 1


class _Usage(click.UsageError):
  """A usage error (exit status 2)."""
  exit_code = 2


def _one_line(text: str) -> str:
  lines = [line.strip() for line in str(text).splitlines()]
  lines = [line for line in lines if line and not re.fullmatch(r'[\^~\s]+', line)]
  return ' '.join(lines)


def _describe(exc: BaseException) -> str:
  message = _one_line(str(exc))
  name = type(exc).__name__
  return f'{name}: {message}' if message else name


# ------------------------------------------------------------- progress

PROGRESS_DELAY = 2.0  # seconds before a step shows progress


@contextlib.contextmanager
def progress(what: str, *, stream=None, delay: float = PROGRESS_DELAY):
  """Shows ``yax: WHAT... 3.2s`` on stderr while the block runs longer than
  ``delay`` seconds, only when stderr is a terminal; the line is erased when
  the block ends, so nothing is left in the output."""
  stream = stream if stream is not None else sys.stderr
  try:
    tty = stream.isatty()
  except (AttributeError, ValueError):
    tty = False
  if not tty:
    yield
    return
  done = threading.Event()
  shown = []

  def tick():
    start = time.monotonic()
    if done.wait(delay):
      return
    frames = '|/-\\'
    k = 0
    while not done.is_set():
      stream.write(f'\r\x1b[Kyax: {what}... {frames[k % 4]} '
                   f'{time.monotonic() - start:.1f}s')
      stream.flush()
      shown.append(True)
      k += 1
      done.wait(0.2)

  thread = threading.Thread(target=tick, daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()
    if shown:
      stream.write('\r\x1b[K')
      stream.flush()


# --------------------------------------------------------------- models

def _parse_spec(spec: str) -> tuple[str, str]:
  target, attr = spec, 'factory'
  head, sep, tail = spec.rpartition(':')
  if sep and not re.fullmatch(r'[A-Za-z]', head):  # not a Windows drive
    target, attr = head, tail
  if not target or not attr:
    raise _Usage(f'MODEL {spec!r} is not of the form module:factory or '
                 'path/to/file.py:factory')
  if not all(part.isidentifier() for part in attr.split('.')):
    raise _Usage(f'MODEL {spec!r}: factory name {attr!r} is not a Python '
                 'identifier (expected module:factory or file.py:factory)')
  return target, attr


def _is_file_target(target: str) -> bool:
  return target.endswith('.py') or '/' in target or os.sep in target


def _module_name_for(path: str) -> str:
  """The file's stem (so classes show as ``model.MLP``), unless that name
  means another module."""
  stem = os.path.splitext(os.path.basename(path))[0]
  if stem.isidentifier() and stem not in sys.modules:
    try:
      found = importlib.util.find_spec(stem)
    except (ImportError, ValueError):
      found = None
    if found is None or (found.origin and os.path.abspath(found.origin) == path):
      return stem
  return '_yax_model_' + re.sub(r'\W', '_', stem)


def _import_file(path: str):
  if not os.path.isfile(path):
    raise _Usage(f'model file not found: {path}')
  path = os.path.abspath(path)
  folder = os.path.dirname(path)
  if folder not in sys.path:
    sys.path.insert(0, folder)  # so the file can import its neighbours
  name = _module_name_for(path)
  module_spec = importlib.util.spec_from_file_location(name, path)
  if module_spec is None or module_spec.loader is None:
    raise _Usage(f'cannot import {path}: not a Python source file')
  module = importlib.util.module_from_spec(module_spec)
  sys.modules[name] = module
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:
    sys.modules.pop(name, None)
    raise _Failure(f'importing {path} failed: {_describe(e)}') from e
  return module


def _import_module(name: str):
  if '' not in sys.path and os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())  # like `python -m`
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name and (name == e.name or name.startswith(e.name + '.')):
      raise _Usage(f'no module named {name!r} (MODEL is module:factory or '
                   'path/to/file.py:factory)') from e
    raise _Failure(f'importing module {name!r} failed: {_describe(e)}') from e
  except Exception as e:
    raise _Failure(f'importing module {name!r} failed: {_describe(e)}') from e


def load_model(spec: str | None) -> tuple[Any, tuple, dict, str]:
  """Imports and calls a factory; returns ``(fn, args, kwargs, label)``,
  ``fn`` a ``Mox`` (and no arguments) when the factory returned one."""
  from yax._src.ir.nodes import Mox
  spec = spec or BUNDLED
  target, attr = _parse_spec(spec)
  module = _import_file(target) if _is_file_target(target) else \
      _import_module(target)
  factory = module
  for part in attr.split('.'):
    if not hasattr(factory, part):
      raise _Usage(f'{target} has no attribute {attr!r} (MODEL is '
                   'module:factory or path/to/file.py:factory)')
    factory = getattr(factory, part)
  if not callable(factory):
    raise _Usage(f'{spec}: {attr!r} is a {type(factory).__name__}, expected '
                 'a function returning (fn, args, kwargs)')
  try:
    with progress(f'building {spec}'):
      result = factory()
  except Exception as e:
    raise _Failure(f'factory {spec} raised {_describe(e)}') from e
  if isinstance(result, Mox):  # a traced (and perhaps rewritten) model
    return result, (), {}, spec
  expected = 'expected a tuple (fn, args, kwargs) or a yax.Mox'
  if not isinstance(result, (tuple, list)) or len(result) != 3:
    found = (f'a {type(result).__name__} of length {len(result)}'
             if isinstance(result, (tuple, list)) else
             f'a {type(result).__name__}')
    raise _Failure(f'factory {spec} returned {found}, {expected}')
  fn, args, kwargs = result
  from yax._src.trace import systems as _systems
  fn, args = _systems.module_as_argument(fn, args)  # a model is traced
  if not callable(fn):                          # as an argument
    raise _Failure(f'factory {spec} returned fn={type(fn).__name__} that is not '
                   f'callable, {expected}')
  if not isinstance(args, (tuple, list)):
    raise _Failure(f'factory {spec} returned args of type '
                   f'{type(args).__name__}, {expected} with args a tuple')
  if not isinstance(kwargs, collections.abc.Mapping):
    raise _Failure(f'factory {spec} returned kwargs of type '
                   f'{type(kwargs).__name__}, {expected} with kwargs a dict')
  return fn, tuple(args), dict(kwargs), spec


def trace_model(spec: str | None):
  """Loads MODEL and traces it; returns ``(mox, label)``. A factory's
  ``Mox`` is returned as it is (tracing it again would record its
  evaluation, with no module calls)."""
  return _trace_loaded(*load_model(spec))


def _trace_loaded(fn, args, kwargs, label):
  from yax._src.ir.nodes import Mox
  from yax._src.trace.make import make_mox
  if isinstance(fn, Mox):
    return fn, label
  try:
    with progress(f'tracing {label}'):
      return make_mox(fn)(*args, **kwargs), label
  except Exception as e:
    raise _Failure(f'tracing {label} failed: {_describe(e)}') from e


def sum_of_squares(outputs):
  """``--memory``'s default loss: the sum of the squares of every floating
  array in the model's outputs (computed in float32)."""
  import jax
  import jax.numpy as jnp
  leaves = [x for x in jax.tree_util.tree_leaves(outputs)
            if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
  if not leaves:
    raise _Failure('--memory: the model returns no floating array to '
                   'differentiate (give --loss MODULE:FN)')
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)


def _load_loss(spec: str):
  """``--loss``'s function, ``module:fn`` or ``path/to/file.py:fn``."""
  if ':' not in spec:
    raise _Usage(f'--loss {spec!r}: expected module:fn or '
                 'path/to/file.py:fn')
  target, attr = _parse_spec(spec)
  found = _import_file(target) if _is_file_target(target) else \
      _import_module(target)
  for part in attr.split('.'):
    if not hasattr(found, part):
      raise _Usage(f'--loss: {target} has no attribute {attr!r}')
    found = getattr(found, part)
  if not callable(found):
    raise _Usage(f'--loss {spec!r} is a {type(found).__name__}, expected a '
                 'function of the model\'s outputs')
  return found


def memory_of(fn, args, kwargs, label, loss_spec: str | None):
  """``--memory``: ``yax.memory_report`` of the training step
  ``loss(fn(*args, **kwargs))`` differentiated with respect to the first
  argument (the params); ``loss`` is ``--loss``'s function or
  :func:`sum_of_squares`."""
  from yax._src.ir.nodes import Mox
  from yax._src.report.memory import memory_report
  if isinstance(fn, Mox):
    raise _Usage(f'--memory: the factory {label} returned a yax.Mox, with no '
                 'arguments to run a training step on; return (fn, args, '
                 'kwargs), e.g. (lambda v, x: yax.eval_mox(mox, v, x), '
                 '(variables, x), {})')
  if not args:
    raise _Usage(f'--memory: the factory {label} gives fn no positional '
                 'argument; the step differentiates with respect to the '
                 'first one (the params)')
  out_loss = _load_loss(loss_spec) if loss_spec else sum_of_squares

  def loss(params, *rest):
    return out_loss(fn(params, *rest, **kwargs))

  try:
    with progress(f'measuring what a training step of {label} keeps'):
      return memory_report(loss, *args, xla=False)
  except (click.ClickException, click.exceptions.Exit):
    raise
  except Exception as e:
    raise _Failure(f'--memory on {label} failed: {_describe(e)}') from e


memory_option = click.option(
    '--memory', is_flag=True,
    help='Add the bytes each module call keeps for the backward pass '
    '(yax.memory_report, its own, submodules excluded) of the step '
    'grad(loss(fn(*args, **kwargs))) with respect to args[0] (the params); '
    'loss: the sum of squares of the floating outputs unless --loss.')
loss_option = click.option(
    '--loss', metavar='MODULE:FN', default=None,
    help='With --memory (implies it): the loss, a function of the model\'s '
    'outputs returning a scalar (module:fn or path/to/file.py:fn).')


# --------------------------------------------------------------- output

class _Output:
  """``-o FILE`` (``-`` or none: stdout), text or binary."""

  def __init__(self, path: str | None, binary: bool = False):
    self.path = None if path in (None, '-') else path
    self.binary = binary
    self.file = None

  def __enter__(self):
    if self.path is None:
      self.file = sys.stdout.buffer if self.binary else sys.stdout
      return self.file
    try:
      self.file = open(self.path, 'wb' if self.binary else 'w',
                       **({} if self.binary else {'encoding': 'utf-8'}))
    except OSError as e:
      raise _Failure(f'cannot write {self.path}: {e.strerror or e}') from e
    return self.file

  def __exit__(self, *exc):
    if self.path is not None:
      self.file.close()
    else:
      self.file.flush()
    return False


def _set_debug(ctx, param, value):
  global _debug
  if value:
    _debug = True
  return value


debug_option = click.option(
    '--debug', is_flag=True, expose_value=False, is_eager=True,
    callback=_set_debug, help='Show tracebacks instead of one-line errors.')
model_argument = click.argument('model', required=False, metavar='[MODEL]')
output_option = click.option(
    '-o', '--output', metavar='FILE', default=None,
    help='Write to FILE instead of stdout.')


# ------------------------------------------------------------- commands

@click.group(invoke_without_command=True,
             context_settings={'help_option_names': ['-h', '--help']},
             epilog='MODEL is module:factory or path/to/file.py:factory, a '
             'function returning (fn, args, kwargs); yax traces '
             'yax.make_mox(fn)(*args, **kwargs). Without MODEL: the bundled '
             'example Transformer (yax._src.cli.bundled:factory).')
@click.version_option(package_name='yax-mox', prog_name='yax',
                      message='%(prog)s %(version)s')
@debug_option
@click.pass_context
def cli(ctx):
  """Trace a JAX/Flax model into a module expression (MoX) and print,
  export, query or view it."""
  if ctx.invoked_subcommand is None:
    click.echo(ctx.get_help())


@cli.command()
@model_argument
@output_option
@debug_option
def show(model, output):
  """Print the MoX in Jaxpr syntax with module_call blocks."""
  mox, _ = trace_model(model)
  with progress('printing'):
    text = str(mox)
  with _Output(output) as f:
    f.write(text + '\n')


@cli.command()
@model_argument
@click.option('--depth', type=click.IntRange(min=0), default=None,
              help='Show module calls nested at most this deep (0: only the '
              'outermost).')
@click.option('--xla-flops', is_flag=True,
              help="Also compile the model once and report XLA's FLOP count.")
@click.option('--width', type=click.IntRange(min=20), default=None,
              help='Fit the table in this many columns (default: COLUMNS '
              'when set, else the terminal width; unlimited when not writing '
              'to a terminal and COLUMNS is not set).')
@click.option('--dtypes', is_flag=True,
              help='Add a column with the dtype each module call computes '
              'in (shown anyway where calls were cast or quantized).')
@memory_option
@loss_option
@debug_option
def summary(model, depth, xla_flops, width, dtypes, memory, loss):
  """Print a table of module calls: path, type, named inputs and outputs,
  own variables, own and total parameters, FLOPs (with --memory: the bytes
  each keeps for the backward pass)."""
  from yax._src.report import summary as _summary
  loaded = load_model(model)
  mox, label = _trace_loaded(*loaded)
  report = memory_of(*loaded, loss) if memory or loss else None
  with progress('summarizing'):
    _summary.print_table(mox, depth=depth, title=label, xla=xla_flops,
                         width=width, dtypes=dtypes, memory=report)


def _export(name: str, what: str, *, indent: int | None, indent_help: str,
            binary: bool = False):
  """Makes ``write(mox, file, indent)`` the command ``yax NAME``: trace
  MODEL, then write it to ``-o FILE`` or stdout (the command's help is
  ``write``'s docstring)."""
  def register(write):
    @cli.command(name=name, help=write.__doc__)
    @model_argument
    @output_option
    @click.option('--indent', type=click.IntRange(min=0), default=indent,
                  show_default=indent is not None, help=indent_help)
    @debug_option
    def command(model, output, indent):
      mox, _ = trace_model(model)
      with _Output(output, binary=binary) as f, progress(f'writing {what}'):
        write(mox, f, indent)
    return write
  return register


@_export('xml', 'XML', indent=2,
         indent_help='Spaces per nesting level (0: none).')
def _write_xml(mox, f, indent):
  """Print the MoX as XML."""
  from yax._src.views.serialize import dump_xml
  dump_xml(mox, f, indent=indent)


@_export('yson', 'YSON', indent=2, binary=True,
         indent_help='Spaces per nesting level (0: compact).')
def _write_yson(mox, f, indent):
  """Print the MoX as YSON (needs the yson extra: ytsaurus-client)."""
  from yax._src.views.serialize import dump_yson
  dump_yson(mox, f, indent=indent)


@_export('json', 'JSON', indent=None,
         indent_help='Pretty-print with this many spaces (default: one line).')
def _write_json(mox, f, indent):
  """Print the MoX as JSON (same content as the XML)."""
  f.write(mox.to_json(indent=indent) + '\n')


def _xpath_error(xpath: str, e: Exception) -> _Usage:
  lines = [line for line in str(e).splitlines() if line.strip() != xpath.strip()]
  message = _one_line('\n'.join(lines))
  if not message.lower().startswith('invalid xpath'):
    message = f'invalid XPath {xpath!r}: {message}'
  return _Usage(message)


def _check_xpath(xpath: str):
  """Compiles XPATH on an empty tree, so a typo fails before tracing."""
  from yax._src.errors import XPathError
  from yax._src.ir.nodes import Mox
  from yax._src.views import query as _query
  try:
    _query.query(xpath, Mox([], []))
  except XPathError as e:
    raise _xpath_error(xpath, e) from e


def _where(path) -> str:
  return '/'.join(map(str, path)) or '/'


def describe_matches(mox, matches) -> list[str]:
  """One line per query result (see ``yax query --help``)."""
  from yax._src.ir.nodes import Equation, Mox, Symbol
  from yax._src.report.summary import type_text
  from yax._src.views.serialize import xml_view
  view = xml_view(mox)
  names = getattr(view, 'names', None) or {}
  wanted = {id(m) for m in matches if isinstance(m, Equation)}
  elements = {id(obj): el for el, obj in view.objects.items()
              if id(obj) in wanted}
  owner = {}  # node id -> path of the module call it belongs to
  stack = [(mox, ())]
  while stack:
    node, path = stack.pop()
    if isinstance(node, Mox) and node.path:
      path = node.path
    owner[id(node)] = path
    stack.extend((c, path) for c in node.children)
  lines = []
  for item in matches:
    if isinstance(item, Mox):
      kind = item.type_name or ('(root)' if item is mox else 'ephemeral')
      if item.entrypoint not in (None, '__call__'):
        kind += '.' + item.entrypoint
      outs = ' '.join(type_text(s) for s in item.outputs)
      lines.append(f'{_where(owner.get(id(item), item.path))}  {kind}  {outs}'
                   .rstrip())
    elif isinstance(item, Equation):
      kind = item.prim.name
      el = elements.get(id(item))
      name = el.get('name') if el is not None else item.params.get('name')
      if isinstance(name, str):
        kind += f'[name={name}]'
      outs = ' '.join(type_text(s) for s in item.outputs)
      lines.append(f'{_where(owner.get(id(item), ()))}  {kind}  {outs}'.rstrip())
    elif isinstance(item, Symbol):
      name = names.get(item, '_')
      lines.append(f'{name}:{type_text(item)}')
    elif isinstance(item, float) and item.is_integer():
      lines.append(str(int(item)))
    elif isinstance(item, bool):
      lines.append('true' if item else 'false')
    else:
      lines.append(str(item))
  return lines


@cli.command()
@click.argument('xpath')
@model_argument
@click.option('--count', 'count_only', is_flag=True,
              help='Print only the number of matches.')
@debug_option
def query(xpath, model, count_only):
  """Evaluate XPATH on the MoX's XML view; print one match per line.

  \b
  Each match prints as one line:
    module call   PATH  TYPE[.method]  OUTPUT-TYPES
                  (e.g. "block_0/mlp  MLP  f32[2,8,32]"; PATH "/" is the top)
    equation      PATH  PRIMITIVE[name=NAME]  OUTPUT-TYPES
                  (PATH of the module call it belongs to)
    input/output  NAME:TYPE (the symbol's name in `yax xml`)
    attribute     its value; an XPath number, string or boolean: the value

  With no match, prints "yax: no match for XPATH" on stderr and exits with
  status 1 (like grep); --count then prints 0.
  """
  from yax._src.errors import XPathError
  from yax._src.views import query as _query
  _check_xpath(xpath)
  mox, _ = trace_model(model)
  try:
    with progress('querying'):
      result = _query.query(xpath, mox)
  except XPathError as e:
    raise _xpath_error(xpath, e) from e
  matches = result if isinstance(result, list) else [result]
  if count_only:
    click.echo(len(matches))
  else:
    lines = describe_matches(mox, matches)
    if lines:
      sys.stdout.write('\n'.join(lines) + '\n')
  if not matches:
    sys.stdout.flush()
    sys.stderr.write(f'yax: no match for {xpath}\n')
    raise click.exceptions.Exit(1)


@cli.command()
@model_argument
@click.option('-o', '--output', metavar='FILE', default=None,
              help='The HTML file to write (default: MODEL\'s name with '
              '.html, in the current directory, e.g. model.html for '
              'model.py:factory; - for stdout).')
@click.option('--title', default=None, help='Page title (default: MODEL).')
@click.option('--no-compress', is_flag=True,
              help='Embed the data as plain JSON instead of gzip+base64 '
              '(bigger file; for browsers without DecompressionStream).')
@memory_option
@loss_option
@debug_option
def html(model, output, title, no_compress, memory, loss):
  """Write a self-contained interactive HTML viewer of the MoX.

  One file, no network access: a collapsible module tree, each node's
  attributes and Jaxpr, and an XPath search box that runs in the browser
  (with --memory: the bytes each module call keeps for the backward pass).
  """
  from yax._src.report import html as _html
  loaded = load_model(model)
  mox, label = _trace_loaded(*loaded)
  report = memory_of(*loaded, loss) if memory or loss else None
  if output is None:
    output = default_html_name(label)
  with progress('rendering the viewer'):
    text = _html.render_html(mox, title=title or label,
                             compress=not no_compress, memory=report)
  with _Output(output) as f:
    f.write(text)
  if output not in (None, '-'):
    from yax._src.report.summary import human_bytes
    click.echo(f'wrote {output} ({human_bytes(len(text.encode()))})', err=True)


def default_html_name(label: str) -> str:
  """``yax html``'s file when ``-o`` is not given: the model file's or
  module's name, and the factory's when it is not ``factory``:
  ``model.py:factory`` -> ``model.html``, ``pkg.mod:build`` ->
  ``mod_build.html``."""
  target, attr = _parse_spec(label)
  stem = (os.path.splitext(os.path.basename(target))[0]
          if _is_file_target(target) else target.rsplit('.', 1)[-1])
  name = stem if attr == 'factory' else f'{stem}_{attr}'
  return re.sub(r'[^A-Za-z0-9_.-]+', '_', name) + '.html'


@cli.command()
@model_argument
@click.option('--host', default='localhost', show_default=True,
              help='Host the server listens on.')
@click.option('--port', type=click.IntRange(min=1, max=65535), default=8080,
              show_default=True, help='Port (8080: the first free one from 8080 on).')
@click.option('--no-browser', is_flag=True, help='Do not open a browser tab.')
@click.option('-o', '--output', metavar='FILE', default=None,
              help='Only write the graph JSON to FILE (open it in Model '
              'Explorer later) instead of serving it.')
@debug_option
def explorer(model, host, port, no_browser, output):
  """Open the MoX in Google Model Explorer (needs the explorer extra).

  Starts Model Explorer's local web server on the graph (layers nested by
  module path, one node per equation, data-flow edges) and prints its URL;
  Ctrl+C stops it.
  """
  from yax._src.report import explorer as _explorer
  mox, label = trace_model(model)
  name = re.sub(r'[^A-Za-z0-9_.-]+', '_', label.rsplit('/', 1)[-1]) or 'model'
  try:
    if output not in (None, '-'):
      with progress('building the graph'):
        _explorer.write_graph(mox, output, graph_id=name)
      click.echo(f'wrote {output}', err=True)
      return
    with progress('building the graph'):
      _explorer.to_model_explorer(mox)  # fail early without the extra
    sys.stdout.flush()
    _explorer.serve(mox, name=name, host=host, port=port,
                    open_browser=not no_browser)
  except _explorer.ExplorerError as e:
    raise _Failure(str(e)) from e


# ----------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
  """Entry point of ``yax`` and ``python -m yax``; returns the exit status."""
  global _debug
  _debug = False
  try:
    status = cli.main(args=argv, prog_name='yax', standalone_mode=False)
    # Without standalone mode click returns an Exit's status instead of
    # raising it (and a command's return value otherwise).
    return status if isinstance(status, int) else 0
  except click.exceptions.Exit as e:
    return e.exit_code
  except click.exceptions.Abort:
    sys.stderr.write('yax: aborted\n')
    return 130
  except click.ClickException as e:
    if _debug and (e.__cause__ is not None):
      traceback.print_exception(e)
    message = _one_line(e.format_message())
    if isinstance(e, click.UsageError) and not isinstance(e, _Usage):
      command = e.ctx.command_path if e.ctx is not None else 'yax'
      message += f" (see '{command} --help')"
    sys.stderr.write(f'yax: error: {message}\n')
    return e.exit_code
  except BrokenPipeError:
    # stdout closed early (`yax show | head`): not an error.
    try:
      sys.stdout = open(os.devnull, 'w')
    except OSError:  # pragma: no cover
      pass
    return 0
  except KeyboardInterrupt:
    sys.stderr.write('yax: interrupted\n')
    return 130
  except Exception as e:  # noqa: BLE001 - the CLI's last resort
    if _debug:
      traceback.print_exception(e)
    from yax._src.errors import YaxError
    text = _one_line(str(e)) if isinstance(e, YaxError) else _describe(e)
    sys.stderr.write(f'yax: error: {text}\n')
    return 1
