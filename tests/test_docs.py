"""The README and docs/*.md are executed, so their examples can never rot.

Conventions (also described in docs/design.md):

* Every fenced block opened with ```` ```python ```` is executed. The blocks of
  one file run in order in one namespace, so a later block can use names
  defined by an earlier one. Each file is one test, with the file's path as
  its id. Blocks run in a fresh temporary directory (files they write go
  there).
* A block fenced ```` ```output ```` right after a ``python`` block is the
  text that block prints: the test compares it with the captured stdout,
  doctest style (whitespace runs are equal, ``...`` matches anything).
* Anything else (```` ```pycon ````, ```` ```text ````, ```` ```bash ````,
  ```` ```xml ````, ...) is not executed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import io
import pathlib
import re
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC_FILES = sorted(p for p in [ROOT / 'README.md', *(ROOT / 'docs').glob('*.md')]
                   if p.is_file())

_FENCE = re.compile(r'^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)')


@dataclasses.dataclass
class Block:
  lang: str
  line: int  # 1-based line of the first code line
  code: str
  expected_output: str | None = None
  output_line: int | None = None


def parse_blocks(text: str) -> list[Block]:
  """Fenced code blocks of a Markdown text, in order, with line numbers."""
  blocks: list[Block] = []
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    fence, lang, indent = m['fence'], m['info'].lower(), len(m['indent'])
    if fence[0] == '`' and '`' in lines[i][m.end('fence'):]:
      i += 1  # inline code such as ```` ```python ````, not a fence
      continue
    start = i + 1
    j = start
    while j < len(lines) and not re.match(
        rf'^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$', lines[j]):
      j += 1
    if j == len(lines):
      raise ValueError(f'line {i + 1}: code block opened with {fence} is '
                       'never closed')
    body = [line[indent:] if line[:indent].isspace() else line
            for line in lines[start:j]]
    blocks.append(Block(lang, start + 1, '\n'.join(body) + '\n'))
    i = j + 1
  # Attach each ```output block to the python block right before it.
  merged: list[Block] = []
  for block in blocks:
    if block.lang == 'output':
      if not merged or merged[-1].lang != 'python' or \
          merged[-1].expected_output is not None:
        raise ValueError(f'line {block.line - 1}: an ```output block must '
                         'follow a ```python block')
      merged[-1].expected_output = block.code
      merged[-1].output_line = block.line
    else:
      merged.append(block)
  return [b for b in merged if b.lang == 'python']


def _doc_id(path: pathlib.Path) -> str:
  try:
    return str(path.relative_to(ROOT))
  except ValueError:
    return str(path)


_CHECKER = doctest.OutputChecker()
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def run_file(path: pathlib.Path) -> int:
  """Executes the python blocks of ``path``; returns how many ran."""
  rel = _doc_id(path)
  blocks = parse_blocks(path.read_text(encoding='utf-8'))
  namespace = {'__name__': f'docs_{path.stem.replace("-", "_")}'}
  for block in blocks:
    # Pad with blank lines so tracebacks point at the Markdown line.
    source = '\n' * (block.line - 1) + block.code
    stdout = io.StringIO()
    try:
      code = compile(source, str(path), 'exec', dont_inherit=True)
      with contextlib.redirect_stdout(stdout):
        exec(code, namespace)  # noqa: S102 - executing our own docs
    except BaseException as e:  # noqa: BLE001 - reported with location
      if isinstance(e, (KeyboardInterrupt, SystemExit)):
        raise
      tb = ''.join(traceback.format_exception(e))
      pytest.fail(f'{rel}: the ```python block at line {block.line} failed:\n'
                  f'{tb}', pytrace=False)
    if block.expected_output is not None:
      got = stdout.getvalue()
      if not _CHECKER.check_output(block.expected_output, got, _FLAGS):
        pytest.fail(
            f'{rel}: the ```output block at line {block.output_line} does '
            f'not match what the ```python block at line {block.line} '
            f'prints.\n--- documented\n{block.expected_output}'
            f'--- printed\n{got}', pytrace=False)
  return len(blocks)


def _files_with_blocks():
  # A cheap filter: parse errors are reported by the test of that file.
  return [pytest.param(path, id=_doc_id(path)) for path in DOC_FILES
          if re.search(r'^ {0,3}(`{3,}|~{3,})\s*python', path.read_text(
              encoding='utf-8'), re.MULTILINE | re.IGNORECASE)]


@pytest.mark.parametrize('path', _files_with_blocks())
def test_doc_examples_run(path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert run_file(path) > 0


def test_readme_exists_with_examples():
  readme = ROOT / 'README.md'
  assert readme.is_file(), 'README.md is missing'
  assert parse_blocks(readme.read_text(encoding='utf-8')), \
      'README.md has no ```python block'


# ------------------------------------------------- the checker itself

def test_parse_blocks_lines_languages_and_outputs():
  text = ('# Title\n'
          '```python\n'
          'x = 1\n'
          'print(x)\n'
          '```\n'
          '```output\n'
          '1\n'
          '```\n'
          '```` ```python ```` inline, not a fence.\n'
          '````pycon\n'
          '>>> not run\n'
          '````\n'
          '  ```python\n'
          '  y = x + 1\n'
          '  ```\n')
  blocks = parse_blocks(text)
  assert [(b.lang, b.line, b.code) for b in blocks] == [
      ('python', 3, 'x = 1\nprint(x)\n'), ('python', 14, 'y = x + 1\n')]
  assert blocks[0].expected_output == '1\n'
  assert blocks[0].output_line == 7
  assert blocks[1].expected_output is None


def test_parse_blocks_rejects_unclosed_and_orphan_output():
  with pytest.raises(ValueError, match='line 2: code block opened with ``` '
                     'is never closed'):
    parse_blocks('text\n```python\nx = 1\n')
  with pytest.raises(ValueError, match='must follow a ```python block'):
    parse_blocks('```text\nx\n```\n```output\n1\n```\n')


def test_run_file_reports_file_and_line(tmp_path):
  doc = tmp_path / 'broken.md'
  doc.write_text('intro\n\n```python\na = 1\n```\n\n```python\n'
                 'b = a + 1\nraise RuntimeError("boom")\n```\n')
  with pytest.raises(pytest.fail.Exception,
                     match=r'(?s)broken.md: the ```python block at line 8 '
                     r'failed:.*broken.md", line 9.*RuntimeError: boom'):
    run_file(doc)


def test_run_file_checks_output(tmp_path):
  doc = tmp_path / 'out.md'
  doc.write_text('```python\nprint("a   b", [1, 2, 3])\n```\n'
                 '```output\na b [1, ...]\n```\n')
  assert run_file(doc) == 1
  doc.write_text('```python\nprint(2)\n```\n```output\n3\n```\n')
  with pytest.raises(pytest.fail.Exception,
                     match=r'(?s)the ```output block at line 5 does not '
                     r'match.*documented\n3\n--- printed\n2'):
    run_file(doc)


# ------------------------------------- claims made in docs/design.md

_PRIVATE = ('jax._src', 'jaxlib', 'flax.core')


def _private_uses(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, module) for each import of a JAX/Flax internal module."""
  import ast
  found = []
  for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module] + [f'{node.module}.{a.name}' for a in node.names]
    for name in names:
      if any(name == p or name.startswith(p + '.') for p in _PRIVATE):
        found.append((node.lineno, name))
        break
  return found


def test_private_imports_live_in_compat_only():
  offenders = [f'{py.relative_to(ROOT)}:{line}: {name}'
               for py in sorted((ROOT / 'yax').rglob('*.py'))
               if py != ROOT / 'yax' / '_src' / 'compat.py'
               for line, name in _private_uses(py)]
  assert not offenders, ('JAX/Flax internals may only be imported in '
                         'yax/_src/compat.py:\n' + '\n'.join(offenders))


def test_each_private_import_in_compat_says_why():
  compat = ROOT / 'yax' / '_src' / 'compat.py'
  lines = compat.read_text(encoding='utf-8').splitlines()
  uses = _private_uses(compat)
  assert uses, 'yax/_src/compat.py imports no JAX internals: update docs/design.md'
  for line, name in uses:
    above = lines[max(0, line - 4):line - 1]
    assert any(l.strip().startswith('# Why:') for l in above), (
        f'yax/_src/compat.py:{line}: import of {name} has no "# Why:" comment '
        'right above it')


def test_private_import_detector(tmp_path):
  mod = tmp_path / 'm.py'
  mod.write_text('import jax\nfrom jax import numpy\nfrom jax._src import core\n'
                 'import flax.core.scope as s\nfrom flax.linen import Dense\n'
                 'from jax import _src\n')
  assert _private_uses(mod) == [(3, 'jax._src'), (4, 'flax.core.scope'),
                                (6, 'jax._src')]
