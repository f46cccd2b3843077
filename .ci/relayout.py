#!/usr/bin/env python3
"""Moves YAX's flat ``yax/_*.py`` layout into the packages of ``yax/_src/``.

Run it from the root of a YAX checkout whose work tree is clean::

    python3 .ci/relayout.py            # moves, rewrites, stages
    python3 .ci/relayout.py --check    # only says what it would move

It is deterministic and does everything with ``git mv`` (history follows the
files) and in-place text edits, then stages the result (``git add``); it
commits nothing. Afterwards run::

    python3 /work/shared/hooks/layering.py
    python -m pytest -q tests/test_layering.py tests/test_docs.py ...

What it does:

1. ``git mv`` every flat module to its new place (:data:`MODULES`), the
   viewer's files to ``yax/_src/report/viewer/``, and every test file to the
   folder of the package it tests (:data:`TESTS`); writes the packages'
   ``__init__.py`` (a docstring, no imports: importing a package must not
   import its modules, or the packages would import each other).
2. Rewrites every reference in the tracked Python, Markdown, TOML and shell
   files and ``.ci/run``: imports (``from yax._sub import x``,
   ``from yax import _nnx``), dotted names in strings (``'yax._bundled:factory'``,
   ``[project.scripts]``), paths (``yax/_compat.py``, ``tests/test_x.py``), and
   module names in the docs (``_sub.py`` -> ``rewrite/engine.py``).
   A module imported as an object keeps an underscore alias,
   ``from yax._src.trace import nnx as _nnx``, so code reading ``_nnx.x``
   is unchanged; where the module was renamed (``_sub`` -> ``engine``) the
   alias follows the new name in that file (``_engine.x``).
3. Writes a new ``tests/test_layering.py`` whose ``LAYERS`` is
   :data:`PACKAGES` (the order per package, plus "tools never import
   tools"), and the twin list in ``docs/design.md`` ("## Layers").

A module or test file this script does not know (one a later change added)
stops it before anything is touched: add it to :data:`MODULES` or
:data:`TESTS` and run it again.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import re
import subprocess
import sys
import tokenize

# ------------------------------------------------------------------ tables

# Every flat module -> its module path under ``yax``. Entries for modules
# that a checkout does not have yet are skipped.
MODULES: dict[str, str] = {
    # foundations
    '_errors': '_src.errors',
    '_compat': '_src.compat',
    '_version': '_src.version',
    # the data model: nodes, variables and arguments, JAX bridge, checks
    '_ir': '_src.ir.nodes',
    '_variables': '_src.ir.variables',
    '_arguments': '_src.ir.arguments',
    '_containers': '_src.ir.containers',
    '_format': '_src.ir.text',
    '_lower': '_src.ir.lower',
    '_rules': '_src.ir.rules',
    '_check': '_src.ir.check',
    # JAX callable <-> tree: markers, calls, Linen and NNX frontends, eval
    '_markers': '_src.trace.markers',
    '_calls': '_src.trace.calls',
    '_nnx': '_src.trace.nnx',
    '_trace': '_src.trace.make',
    '_eval': '_src.trace.eval',
    # renderings a rewrite may read: Jaxpr text, XML/JSON/YSON, XPath
    '_printing': '_src.views.printing',
    '_serialize': '_src.views.serialize',
    '_query': '_src.views.query',
    # the engine and what tools share
    '_sub': '_src.rewrite.engine',
    '_pattern': '_src.rewrite.pattern',
    '_contraction': '_src.rewrite.contraction',
    '_formats': '_src.rewrite.quant_formats',
    # tools: clients of the engine that never import each other
    '_lora': '_src.tools.lora',
    '_quantize': '_src.tools.quantize',
    '_cast': '_src.tools.cast',
    '_init': '_src.tools.init_params',
    '_remat': '_src.tools.remat',
    '_randomized': '_src.tools.randomized',
    '_fewbit': '_src.tools.fewbit',
    '_fewbit_tables': '_src.tools.fewbit_tables',
    '_fewbit_solver': '_src.tools.fewbit_solver',
    # what a tree holds and costs, and the interactive viewers
    '_summary': '_src.report.summary',
    '_flops': '_src.report.flops',
    '_html': '_src.report.html',
    '_explorer': '_src.report.explorer',
    # the command
    '_cli': '_src.cli.main',
    '_bundled': '_src.cli.bundled',
    '_bundled_nnx': '_src.cli.bundled_nnx',
}

# Folders of package data: old -> new (relative to the checkout).
DATA = {'yax/viewer': 'yax/_src/report/viewer'}

# The packages, lowest first: a module imports only from its own package and
# lower ones ('' is ``yax`` itself: ``__init__.py`` and ``__main__.py``).
# (package, what it holds, its __init__ docstring)
PACKAGES: list[tuple[str, str, str]] = [
    ('_src', 'foundations',
     'YAX\'s implementation; ``yax/__init__.py`` is the public surface.\n\n'
     'The modules directly here are the foundations (errors, the one home of\n'
     'JAX/Flax internals, the version); the packages are layered, lowest\n'
     'first: ``ir``, ``trace``, ``views``, ``rewrite``, ``tools``, ``report``,\n'
     '``cli`` (``tests/test_layering.py`` checks it; ``docs/design.md``,\n'
     '"Layers", says why).'),
    ('_src.ir', 'the data model: nodes, their variables and arguments, the '
     'JAX bridge (lowering, per-primitive rules), checks',
     'The MoX data model: nodes, their variables and arguments, lowering to\n'
     'Jaxprs, per-primitive rules, the invariant checker.'),
    ('_src.trace', 'JAX callable <-> tree: boundary markers, module calls, the '
     'Linen and NNX frontends, and evaluation (which splits NNX arguments as '
     'the NNX frontend does)',
     'From a JAX callable to a tree (``make_mox``: markers, calls, the Linen\n'
     'and NNX frontends) and back (``eval_mox``).'),
    ('_src.views', 'read-only renderings a rewrite may use: Jaxpr text, '
     'XML/JSON/YSON, XPath',
     'Read-only renderings of a tree: Jaxpr text, the XML view (and JSON,\n'
     'YSON), XPath queries over it.'),
    ('_src.rewrite', 'the rewrite engine and the analyses tools share: '
     'selection and substitution, patterns, contractions, quantized formats',
     'The rewrite engine (selection, substitution) and what the tools share:\n'
     'pattern matching, kernel contractions, quantized storage formats.'),
    ('_src.tools', 'tools: clients of the engine, which never import each '
     'other',
     'Tools: thin clients of the rewrite engine (LoRA, quantization, casts,\n'
     'new params, memory rewrites). A tool never imports another tool.'),
    ('_src.report', 'what a tree holds and costs (summary, FLOPs) and the '
     'viewers (HTML, Model Explorer); above the tools, as the summary reads '
     'variable locations through the engine',
     'What a tree holds and costs (the summary table, FLOP rules) and the\n'
     'interactive viewers (HTML page, Google Model Explorer). The viewer\'s\n'
     'page, style and script are package data in ``viewer/``.'),
    ('_src.cli', 'the command line and its bundled example models',
     'The ``yax`` command and its bundled example models.'),
    ('', 'public surface', ''),
]

TOOLS = '_src.tools'

# Imports between tools the layering test lets through, each with the
# reason (written into tests/test_layering.py, which fails when one is no
# longer made). Empty is the goal (issue 24: "Tools never import each
# other"); e.g. {('quantize', 'lora'): 'reads the kernel plan in _lora'}.
TOOL_EXCEPTIONS: dict[tuple[str, str], str] = {}

# Test files -> their folder under tests/ ('' stays in tests/): the folder
# of the package they test; ``real`` for third-party model code.
TESTS: dict[str, str] = {
    'test_layering': '', 'test_docs': '', 'test_examples': '',
    'test_ir': 'ir', 'test_check': 'ir', 'test_format_callables': 'ir',
    'test_variables': 'ir', 'test_arguments': 'ir',
    'test_trace': 'trace', 'test_nnx': 'trace', 'test_nnx_properties': 'trace',
    'test_properties': 'trace', 'test_eval': 'trace', 'test_sharding': 'trace',
    'test_whatever_runs': 'trace', 'test_one_model': 'trace',
    'test_guarantees_core': 'trace',
    'test_printing': 'views', 'test_serialize': 'views', 'test_query': 'views',
    'test_guarantees_views': 'views',
    'test_sub': 'rewrite', 'test_sub_properties': 'rewrite',
    'test_pattern': 'rewrite', 'test_guarantees_rewrite': 'rewrite',
    'test_new_variables': 'rewrite', 'test_contraction': 'rewrite',
    'test_lora': 'tools', 'test_lora_layouts': 'tools',
    'test_lora_sharding': 'tools', 'test_quantize': 'tools',
    'test_cast': 'tools', 'test_init': 'tools', 'test_init_params': 'tools',
    'test_remat': 'tools', 'test_randomized': 'tools', 'test_fewbit': 'tools',
    'test_memory': 'tools', 'test_quantize_lifted': 'tools',
    'test_randomized_linear': 'tools', 'test_qlora': 'tools',
    'test_summary': 'report', 'test_html': 'report', 'test_explorer': 'report',
    'test_cli': 'cli',
    'test_hf_models': 'real', 'test_real_models': 'real',
    'test_real_nnx': 'real', 'test_easydel': 'real', 'test_gemma4': 'real',
    'test_maxtext': 'real',
}

# Files rewritten: tracked files with these endings, and these names.
TEXT_SUFFIXES = ('.py', '.md', '.toml', '.sh', '.cfg', '.txt', '.yml', '.yaml')
TEXT_NAMES = ('.ci/run',)

# ------------------------------------------------------------------ helpers


class RelayoutError(Exception):
  pass


def fail(message: str):
  raise RelayoutError(message)


def git(*args: str, capture: bool = True) -> str:
  out = subprocess.run(['git', *args], check=True, text=True,
                       capture_output=capture)
  return out.stdout if capture else ''


def module_file(dotted: str) -> str:
  """'_src.ir.nodes' -> 'yax/_src/ir/nodes.py'."""
  return 'yax/' + dotted.replace('.', '/') + '.py'


def short_path(dotted: str) -> str:
  """'_src.ir.nodes' -> 'ir/nodes.py' (relative to yax/_src)."""
  return dotted.removeprefix('_src.').replace('.', '/') + '.py'


def base(dotted: str) -> str:
  return dotted.rpartition('.')[2]


def alias(old: str) -> str:
  """The local name of a module imported as an object."""
  return '_' + base(MODULES[old])


def test_path(name: str) -> str:
  folder = TESTS[name]
  return f'tests/{folder}/{name}.py' if folder else f'tests/{name}.py'


# ------------------------------------------------------------ the rewrites

_NAMES = None  # alternation of the known flat module names, longest first


def names_re() -> str:
  global _NAMES
  if _NAMES is None:
    _NAMES = '|'.join(sorted((m[1:] for m in MODULES), key=len, reverse=True))
  return _NAMES


def rewrite_dotted(text: str, where: str) -> str:
  """``yax._sub`` -> ``yax._src.rewrite.engine`` (code, strings, prose);
  an unknown ``yax._x`` fails."""
  def sub(m):
    name = '_' + m.group(1)
    if name == '_src':
      return m.group(0)
    if name not in MODULES:
      fail(f'{where}: yax.{name} is not in MODULES (relayout.py): add it')
    return 'yax.' + MODULES[name]
  return re.sub(r'\byax\._([A-Za-z]\w*)', sub, text)


def rewrite_paths(text: str) -> str:
  """``yax/_compat.py`` -> ``yax/_src/compat.py``; ``tests/test_x.py`` ->
  ``tests/<folder>/test_x.py``."""
  text = re.sub(rf'\byax/_({names_re()})\.py\b',
                lambda m: module_file(MODULES['_' + m.group(1)]), text)
  text = re.sub(r'\byax/viewer/', 'yax/_src/report/viewer/', text)

  def test(m):
    name = m.group(1)
    return test_path(name) if name in TESTS else m.group(0)
  return re.sub(r'\btests/(test_\w+)\.py\b', test, text)


_FROM_YAX = re.compile(r'^(?P<indent>[ \t]*)from yax import (?P<names>[^#\n(]+?)'
                       r'(?P<comment>[ \t]*#[^\n]*)?$', re.M)


def rewrite_module_imports(text: str, where: str) -> tuple[str, set[str]]:
  """``from yax import _lower, _nnx`` -> one ``from yax._src.pkg import mod
  as _alias`` line per module (public names stay in a ``from yax import``
  line). Returns the text and the flat modules imported as objects."""
  if re.search(r'^[ \t]*from yax import \(', text, re.M):
    fail(f'{where}: a parenthesised "from yax import (" is not handled')
  imported: set[str] = set()

  def sub(m):
    indent, comment = m.group('indent'), m.group('comment') or ''
    names = [n.strip() for n in m.group('names').split(',') if n.strip()]
    public, lines = [], []
    for entry in names:
      name, _, asname = entry.partition(' as ')
      name, asname = name.strip(), asname.strip()
      if not name.startswith('_') or name.startswith('__'):
        public.append(entry)
        continue
      if name not in MODULES:
        fail(f'{where}: "from yax import {name}": {name} is not in MODULES')
      imported.add(name)
      package, _, mod = MODULES[name].rpartition('.')
      local = asname or alias(name)
      lines.append(f'{indent}from yax.{package} import {mod} as {local}'
                   f'{comment}')
    if public:
      lines.insert(0, f'{indent}from yax import {", ".join(public)}{comment}')
    return '\n'.join(lines)
  return _FROM_YAX.sub(sub, text), imported


def check_alias(text: str, old: str, where: str):
  """Fails if the new alias of ``old`` is a name ``text`` uses already."""
  new = alias(old)
  if new != old and re.search(rf'(?<![\w.]){re.escape(new)}\b', text):
    fail(f'{where}: renaming {old} to {new} would clash with a name {new} '
         'already used there')


def rename_alias(text: str, old: str) -> str:
  """Renames the local name ``old`` (a module imported as an object) to
  its new alias everywhere in the file (code, comments, docstrings)."""
  new = alias(old)
  if new == old:
    return text
  return re.sub(rf'(?<![\w.]){re.escape(old)}\b', new, text)


def rewrite_prose(text: str) -> str:
  """Module names in Markdown: ``_sub.py`` -> ``rewrite/engine.py``,
  `` `_sub` `` -> `` `rewrite/engine.py` ``, `` `_sub.var_keys` `` ->
  `` `engine.var_keys` ``."""
  names = names_re()
  text = re.sub(rf'(?<![\w/.])_({names})\.py\b',
                lambda m: short_path(MODULES['_' + m.group(1)]), text)
  text = re.sub(rf'`_({names})`',
                lambda m: f'`{short_path(MODULES["_" + m.group(1)])}`', text)
  text = re.sub(rf'`_({names})\.(?=[A-Za-z_])',
                lambda m: f'`{base(MODULES["_" + m.group(1)])}.', text)
  return text


def _python_prose(text: str) -> str:
  """``_sub.py`` -> ``rewrite/engine.py``; a double-backquoted ``_sub`` ->
  ``rewrite/engine.py``; ``_sub.x`` (double-backquoted) -> ``_engine.x``."""
  names = names_re()
  text = re.sub(rf'(?<![\w/.])_({names})\.py\b',
                lambda m: short_path(MODULES['_' + m.group(1)]), text)
  # ``_markers`` -> ``trace/markers.py``; ``_trace.opened`` -> ``_make.opened``
  text = re.sub(rf'``_({names})``',
                lambda m: f'``{short_path(MODULES["_" + m.group(1)])}``', text)
  text = re.sub(rf'``_({names})\.(?=[A-Za-z_])',
                lambda m: f'``{alias("_" + m.group(1))}.', text)
  return text


def rewrite_python_prose(text: str, where: str) -> str:
  """Module names in comments and docstrings (see :func:`_python_prose`); a
  module file named in a code string fails (its right new name depends on
  what the code does with it)."""
  names = names_re()
  try:
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
  except (tokenize.TokenError, SyntaxError):
    return text
  lines = text.splitlines(keepends=True)
  offsets = [0]
  for line in lines:
    offsets.append(offsets[-1] + len(line))
  edits = []
  for tok in tokens:
    if tok.type not in (tokenize.COMMENT, tokenize.STRING):
      continue
    prose = tok.type == tokenize.COMMENT or tok.string.lstrip(
        'rRbBuUfF').startswith(('"""', "\'\'\'"))
    if not prose and re.search(rf'(?<![\w/.])_({names})\.py\b', tok.string):
      fail(f'{where}:{tok.start[0]}: the string {tok.string} names a module '
           'file in code: add a SPECIFIC edit for it')
    new = _python_prose(tok.string)
    if new != tok.string:
      start = offsets[tok.start[0] - 1] + tok.start[1]
      end = offsets[tok.end[0] - 1] + tok.end[1]
      edits.append((start, end, new))
  for start, end, new in reversed(edits):
    text = text[:start] + new + text[end:]
  return text


def rewrite_python(text: str, where: str, moved_down: bool) -> str:
  original = text
  text, imported = rewrite_module_imports(text, where)
  for old in sorted(imported):
    check_alias(original, old, where)
    text = rename_alias(text, old)
  text = rewrite_dotted(text, where)
  text = tidy_imports(text, sort=not where.endswith('__init__.py'))
  text = rewrite_paths(text)
  text = rewrite_python_prose(text, where)
  # Test helpers: tests/conftest.py puts tests/ on sys.path for every test
  # folder, so ``helpers`` is one import wherever a test file is.
  text = re.sub(r'^(\s*)from tests\.helpers import', r'\1from helpers import',
                text, flags=re.M)
  text = re.sub(r'^(\s*)import tests\.helpers as', r'\1import helpers as',
                text, flags=re.M)
  if moved_down:
    text = text.replace('Path(__file__).resolve().parent.parent',
                        'Path(__file__).resolve().parents[2]')
    if re.search(r'Path\(__file__\)(?!\.resolve\(\)\.parents\[2\])'
                 r'|dirname\(__file__\)|dirname\(os\.path\.abspath\(__file__',
                 text):
      fail(f'{where}: a path from __file__ that moving the file one folder '
           'down would break: fix it here')
  return text


_IMPORT_START = re.compile(r'^(?P<indent>[ \t]*)from (?P<module>yax[\w.]*) import ')
WIDTH = 80


def _statements(lines: list[str], i: int):
  """The ``from yax... import`` statement starting at line ``i``: (end line
  index, indent, module, names, trailing comment), or None if it is not one
  this tidier handles (a backslash continuation, a comment inside)."""
  m = _IMPORT_START.match(lines[i])
  if not m:
    return None
  j, body = i, lines[i][m.end():]
  if body.lstrip().startswith('('):
    while ')' not in lines[j]:
      j += 1
      if j >= len(lines):
        return None
      body += '\n' + lines[j]
  if '\\' in body:
    return None
  comment = ''
  if '#' in body:
    head, _, tail = body.rpartition(')') if '(' in body else ('', '', body)
    code, sep, note = tail.partition('#')
    if '#' in head or not sep:
      return None
    comment = '  #' + note.rstrip()
    body = head + (')' if '(' in body else '') + code
  names = [n.strip() for n in body.replace('(', ' ').replace(')', ' ')
           .split(',') if n.strip()]
  if not names or any(' ' in n and ' as ' not in n for n in names):
    return None
  return j, m.group('indent'), m.group('module'), names, comment


def _emit(indent: str, module: str, names: list[str], comment: str) -> list[str]:
  prefix = f'{indent}from {module} import '
  one = prefix + ', '.join(names) + comment
  if len(one) <= WIDTH or len(names) == 1:
    return [one]
  out, line = [], prefix + '('
  pad = ' ' * len(line)
  for k, name in enumerate(names):
    piece = name + (', ' if k < len(names) - 1 else ')')
    if len(line + piece.rstrip()) > WIDTH and line.strip() not in (
        '', prefix.strip() + ' ('):
      out.append(line.rstrip())
      line = pad
    line += piece
  out.append(line + comment)
  return out


def tidy_imports(text: str, sort: bool) -> str:
  """Re-wraps ``from yax... import`` statements to 80 columns (continuation
  lines under the parenthesis) and sorts each run of them by module, as the
  rewritten module paths no longer sort as the old ones did."""
  lines = text.split('\n')
  out, i = [], 0
  while i < len(lines):
    found = _statements(lines, i)
    if found is None:
      out.append(lines[i])
      i += 1
      continue
    run = []
    while found is not None and found[1] == (run[0][1] if run else found[1]):
      run.append(found)
      i = found[0] + 1
      found = _statements(lines, i) if i < len(lines) else None
    if sort:
      run.sort(key=lambda st: (st[2], st[3]))
    for _, indent, module, names, comment in run:
      out.extend(_emit(indent, module, names, comment))
  return '\n'.join(out)


def rewrite_markdown(text: str, where: str) -> str:
  text, imported = rewrite_module_imports(text, where)  # code examples
  renamed = sorted(m for m in imported if alias(m) != m)
  if renamed:
    fail(f'{where}: an example imports {renamed} as objects, which this '
         'script renames only in Python files: edit it by hand')
  text = rewrite_dotted(text, where)
  text = rewrite_paths(text)
  text = rewrite_prose(text)
  return text


def rewrite_other(text: str, where: str) -> str:
  text = rewrite_dotted(text, where)
  return rewrite_paths(text)


# Edits that the rules above do not make, each applied exactly where it is
# expected: (file as it is before the move, old text, new text).
SPECIFIC: list[tuple[str, str, str]] = [
    ('tests/test_docs.py', "if py.name != '_compat.py'",
     "if py != ROOT / 'yax' / '_src' / 'compat.py'"),
    ('tests/test_docs.py', "ROOT / 'yax' / '_compat.py'",
     "ROOT / 'yax' / '_src' / 'compat.py'"),
    ('pyproject.toml',
     'yax = ["viewer/*.html", "viewer/*.css", "viewer/*.js"]',
     '"yax._src.report" = ["viewer/*.html", "viewer/*.css", "viewer/*.js"]'),
    # Scripts run on host devices import test modules, now in subfolders.
    ('tests/helpers.py', "      [str(root), str(root / 'tests')] +\n",
     "      [str(root), str(root / 'tests')] +\n"
     "      [str(p) for p in sorted((root / 'tests').iterdir())\n"
     "       if p.is_dir() and not p.name.startswith(('_', '.'))] +\n"),
    ('yax/_fewbit_solver.py', "with_name('_fewbit_tables.py')",
     "with_name('fewbit_tables.py')"),
    ('.ci/run', 'for f in tests/test_*.py; do',
     "for f in $(find tests -name 'test_*.py' | sort); do"),
    ('docs/design.md',
     '`yax/__init__.py` is the whole public surface; it re-exports names from\n'
     'private modules, one concept each:',
     '`yax/__init__.py` is the whole public surface; it re-exports names from\n'
     'the modules of `yax/_src/` (private as a whole, as `jax._src` is), one\n'
     'concept each, in packages that are the layers below (paths are relative\n'
     'to `yax/_src/`):'),
]

# ------------------------------------------------------------ layering test


def layers_doc_rows(modules_of: dict[str, list[str]]) -> list[str]:
  rows = []
  for i, (package, what, _) in enumerate(PACKAGES, 1):
    folder = 'yax/' + package.replace('.', '/') + ('/' if package else '')
    mods = ', '.join(f'`{m}.py`' for m in modules_of.get(package, []))
    rows.append(f'{i}. `{folder}`, {what}: {mods}')
  return rows


LAYERS_DOC_INTRO = '''## Layers

Modules live in packages that are layers, lowest first: a module imports
only from its own package and lower ones, never a private (`_`-prefixed)
name of another module, no two modules import each other (even through a
function-level import), a package's `__init__.py` imports nothing, and a
tool never imports another tool (a tool's own helper modules, named after
it, as `fewbit_tables.py` for `fewbit.py`, are its own).
`tests/test_layering.py` checks all of it on the source (its `LAYERS` is
this list, and each line names the package's modules):

'''


def _table_order(row: str) -> int:
  """Where a row of the "## Layout" table goes: by the package of the first
  module it names (``ir/nodes.py``), rows naming none last."""
  order = [p for p, _, _ in PACKAGES]
  packages = {short_path(v): v.rpartition('.')[0] for v in MODULES.values()}
  m = re.match(r'\| `([\w/]+\.py)`', row)
  if not m or m.group(1) not in packages:
    return len(order)
  return order.index(packages[m.group(1)])


def sort_layout_table(text: str) -> str:
  """The rows of the module table under "## Layout", grouped by package in
  the order of the layers (a stable sort: rows keep their order inside a
  package)."""
  m = re.search(r'^## Layout\n.*?^\|---\|---\|\n((?:\|.*\n)+)', text,
                re.M | re.S)
  if not m:
    print('note: docs/design.md has no "## Layout" table; not sorted')
    return text
  rows = m.group(1).splitlines(keepends=True)
  rows.sort(key=_table_order)
  return text[:m.start(1)] + ''.join(rows) + text[m.end(1):]


def write_layers_doc(path: pathlib.Path, modules_of: dict[str, list[str]]):
  text = sort_layout_table(path.read_text(encoding='utf-8'))
  m = re.search(r'^## Layers\n.*?(?=^Where a lower module needs)', text,
                re.M | re.S)
  if not m:
    fail(f'{path}: no "## Layers" section ending before "Where a lower '
         'module needs": update write_layers_doc')
  new = LAYERS_DOC_INTRO + '\n'.join(layers_doc_rows(modules_of)) + '\n\n'
  path.write_text(text[:m.start()] + new + text[m.end():], encoding='utf-8')


def layers_literal() -> str:
  lines = ['LAYERS: list[tuple[str, str]] = [']
  for package, what, _ in PACKAGES:
    lines.append(f'    ({package!r}, {what!r}),')
  lines.append(']')
  return '\n'.join(lines)


def exceptions_literal() -> str:
  if not TOOL_EXCEPTIONS:
    return 'TOOL_EXCEPTIONS: dict[tuple[str, str], str] = {}'
  lines = ['TOOL_EXCEPTIONS: dict[tuple[str, str], str] = {']
  for (importer, target), why in sorted(TOOL_EXCEPTIONS.items()):
    lines.append(f'    ({importer!r}, {target!r}):\n        {why!r},')
  lines.append('}')
  return '\n'.join(lines)


LAYERING_TEST = pathlib.Path(__file__).with_name('relayout_test_layering.py.in')

# ------------------------------------------------------------------- main


def inventory(root: pathlib.Path):
  flat = sorted(p.stem for p in (root / 'yax').glob('_*.py')
                if not p.stem.startswith('__'))
  unknown = [m for m in flat if m not in MODULES]
  tests = sorted(p.stem for p in (root / 'tests').glob('test_*.py'))
  unknown_tests = [t for t in tests if t not in TESTS]
  if unknown or unknown_tests:
    fail('not in relayout.py\'s tables (add them, then run again):'
         + (f'\n  MODULES: {unknown}' if unknown else '')
         + (f'\n  TESTS: {unknown_tests}' if unknown_tests else ''))
  for name in flat:
    package = MODULES[name].rpartition('.')[0]
    if package not in [p for p, _, _ in PACKAGES]:
      fail(f'MODULES[{name!r}] = {MODULES[name]!r}: package {package!r} is '
           'not in PACKAGES')
  data = [d for d in DATA if (root / d).is_dir()]
  return flat, tests, data


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--check', action='store_true',
                      help='only list the moves; change nothing')
  args = parser.parse_args(argv)
  root = pathlib.Path(git('rev-parse', '--show-toplevel').strip())
  if pathlib.Path.cwd().resolve() != root.resolve():
    fail(f'run from the checkout root ({root})')
  if (root / 'yax' / '_src').exists():
    fail('yax/_src exists already: this checkout has been moved')
  flat, tests, data = inventory(root)
  known = set(flat)
  skipped = sorted(set(MODULES) - known)
  moves = [(f'yax/{m}.py', module_file(MODULES[m])) for m in flat]
  moves += [(d, DATA[d]) for d in data]
  moves += [(f'tests/{t}.py', test_path(t)) for t in tests
            if TESTS[t]]
  for old, new in moves:
    print(f'{old} -> {new}')
  if skipped:
    print(f'(not in this checkout, skipped: {", ".join(skipped)})')
  if args.check:
    return 0
  if git('status', '--porcelain').strip():
    fail('the work tree has uncommitted changes: commit or stash them first')
  if not LAYERING_TEST.exists():
    fail(f'{LAYERING_TEST} (the new tests/test_layering.py) is missing')

  # Only modules this checkout has count as names to rewrite.
  for m in skipped:
    del MODULES[m]
  global _NAMES
  _NAMES = None

  # 1. Rewrite every tracked text file in place (before the moves).
  moved_down = {f'tests/{t}.py' for t in tests if TESTS[t]}
  files = [f for f in git('ls-files').splitlines()
           if (f.endswith(TEXT_SUFFIXES) or f in TEXT_NAMES)
           and f != 'tests/test_layering.py' and not f.startswith('.ci/relayout')
           and (root / f).is_file()]
  specific = {}
  for where, old, new in SPECIFIC:
    specific.setdefault(where, []).append((old, new))
  rewritten = {}  # all computed first: a failure leaves the tree as it was
  for f in files:
    path = root / f
    text = original = path.read_text(encoding='utf-8')
    for old, new in specific.pop(f, []):
      if text.count(old) != 1:
        fail(f'{f}: expected the text {old!r} once, found it '
             f'{text.count(old)} times: update SPECIFIC')
      text = text.replace(old, new)
    if f.endswith('.py'):
      text = rewrite_python(text, f, f in moved_down)
    elif f.endswith('.md'):
      text = rewrite_markdown(text, f)
    else:
      text = rewrite_other(text, f)
    if text != original:
      rewritten[path] = text
  if specific:  # files this checkout does not have
    print(f'(SPECIFIC edits skipped, no such file: {sorted(specific)})')
  for path, text in rewritten.items():
    path.write_text(text, encoding='utf-8')

  # 2. Move.
  for package, _, _ in PACKAGES:
    if package:
      (root / 'yax' / package.replace('.', '/')).mkdir(parents=True,
                                                       exist_ok=True)
  for old, new in moves:
    (root / new).parent.mkdir(parents=True, exist_ok=True)
    git('mv', old, new)
  for package, _, doc in PACKAGES:
    if package:
      init = root / 'yax' / package.replace('.', '/') / '__init__.py'
      init.write_text(f'"""{doc}\n"""\n', encoding='utf-8')
      git('add', str(init.relative_to(root)))

  # 3. The layering test and its twin in docs/design.md.
  modules_of: dict[str, list[str]] = {}
  for path in sorted((root / 'yax').rglob('*.py')):
    rel = path.relative_to(root / 'yax').with_suffix('')
    if rel.name == '__init__' and len(rel.parts) > 1:
      continue
    package = '.'.join(rel.parts[:-1])
    modules_of.setdefault(package, []).append(rel.name)
  template = LAYERING_TEST.read_text(encoding='utf-8')
  for marker in ('@@LAYERS@@', '@@TOOL_EXCEPTIONS@@'):
    if template.count(marker) != 1:
      fail(f'{LAYERING_TEST}: expected one {marker} marker')
  (root / 'tests' / 'test_layering.py').write_text(
      template.replace('@@LAYERS@@', layers_literal()).replace(
          '@@TOOL_EXCEPTIONS@@', exceptions_literal()), encoding='utf-8')
  write_layers_doc(root / 'docs' / 'design.md', modules_of)

  # 4. Nothing may still name a flat module.
  left = []
  for f in git('ls-files').splitlines() + [
      f for f in git('ls-files', '--others', '--exclude-standard').splitlines()]:
    path = root / f
    if not path.is_file() or not (f.endswith(TEXT_SUFFIXES) or f in TEXT_NAMES):
      continue
    text = path.read_text(encoding='utf-8')
    for m in re.finditer(rf'\byax[./]_({names_re()})\b', text):
      line = text.count('\n', 0, m.start()) + 1
      left.append(f'{f}:{line}: {m.group(0)}')
  git('add', '-A', 'yax', 'tests', 'docs', 'pyproject.toml', '.ci', 'README.md',
      *[d for d in ('benchmarks', 'examples') if (root / d).exists()])
  if left:
    fail('still naming flat modules:\n  ' + '\n  '.join(left))
  print(f'moved {len(moves)} paths; rewrote references; staged (not '
        'committed). Next: python3 /work/shared/hooks/layering.py and the '
        'tests.')
  return 0


if __name__ == '__main__':
  try:
    sys.exit(main())
  except RelayoutError as e:
    print(f'relayout.py: error: {e}', file=sys.stderr)
    sys.exit(1)
